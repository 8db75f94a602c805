#include "triaccel/train/step.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>

#include <limits>
#ifdef TRIACCEL_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#endif

namespace triaccel {

AutocastScope::AutocastScope(const c10::Device& device, PrecisionMode precision)
    : type_(device.type()),
      prev_enabled_(at::autocast::is_autocast_enabled(device.type())),
      prev_dtype_(at::autocast::get_autocast_dtype(device.type())),
      active_(precision != PrecisionMode::kFP32) {
  if (!active_) return;
  at::autocast::set_autocast_enabled(type_, true);
  at::autocast::set_autocast_dtype(type_, precision == PrecisionMode::kAmpBF16 ? at::kBFloat16 : at::kHalf);
  // No weight-cast cache: a cached cast would be baked into a captured graph with stale values.
  at::autocast::set_autocast_cache_enabled(false);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!active_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(type_, prev_enabled_);
  at::autocast::set_autocast_dtype(type_, prev_dtype_);
}

struct TrainStep::Graph {
#ifdef TRIACCEL_WITH_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
  at::Tensor images;  // static input buffers, (B, C, H, W) float32 and (B) int64
  at::Tensor labels;
};

TrainStep::TrainStep(Model& model, Optimizer& sgd, LossScaler& scaler, StepOptions options, const c10::Device& device)
    : model_(model), sgd_(sgd), scaler_(scaler), options_(options), device_(device) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device_);
  lr_ = at::zeros({1}, f32);
  loss_sum_ = at::zeros({1}, f32);
  correct_sum_ = at::zeros({1}, f32);
  last_loss_ = at::zeros({1}, f32);
  if (!device_.is_cuda()) options_.cuda_graphs = false;
  for (const auto& b : model_.buffers()) {
    buffers_.push_back(b);
    buffers_before_.push_back(at::empty_like(b));
  }
  if (options_.fault_injection) {
    loss_fault_ = at::ones({1}, f32);
    grad_fault_ = at::zeros({1}, f32);
  }
}

bool TrainStep::last_step_skipped() const { return scaler_.found_inf().item<float>() != 0; }

void TrainStep::skipped_step_restore() {
  const torch::NoGradGuard no_grad;
  for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i].copy_(buffers_before_[i]);
}

void TrainStep::set_fault(FaultKind kind) {
  TORCH_CHECK(options_.fault_injection || kind == FaultKind::kNone,
              "TrainStep::set_fault needs StepOptions::fault_injection");
  TORCH_CHECK(kind != FaultKind::kOom, "TrainStep::set_fault: out of memory is raised by the caller");
  if (kind == fault_ || !options_.fault_injection) return;
  fault_ = kind;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  loss_fault_.fill_(kind == FaultKind::kNanLoss ? nan : 1.0);
  grad_fault_.fill_(kind == FaultKind::kNanGrad   ? nan
                    : kind == FaultKind::kInfGrad ? std::numeric_limits<double>::infinity()
                                                  : 0.0);
}

TrainStep::~TrainStep() = default;

void TrainStep::metrics_reset() {
  loss_sum_.zero_();
  correct_sum_.zero_();
}

void TrainStep::body(const at::Tensor& images, const at::Tensor& labels) {
  grads_release();
  {
    const torch::NoGradGuard no_grad;
    for (size_t i = 0; i < buffers_.size(); ++i) buffers_before_[i].copy_(buffers_[i]);
  }
  // (B, classes), or (B, T, V) for a language model: flattened to one prediction per label element.
  const at::Tensor logits = forward(images).flatten(0, -2);
  const at::Tensor targets = labels.flatten();
  at::Tensor loss = at::cross_entropy_loss(logits.to(at::kFloat), targets, {}, at::Reduction::Mean, -100,
                                           options_.label_smoothing);
  if (options_.fault_injection) loss = loss * loss_fault_;
  scaler_.scale(loss).backward();
  const torch::NoGradGuard no_grad;
  const std::vector<at::Tensor> grads = sgd_.grads();
  if (options_.fault_injection) {
    for (const auto& g : grads) {
      if (!g.defined()) continue;
      g.add_(grad_fault_);
      break;
    }
  }
  scaler_.unscale_and_check(grads);
  if (grad_stats_enabled_) {
    // A skipped step (inf/NaN) contributes nothing: where() rather than a multiply, since NaN · 0 is NaN.
    const at::Tensor ok = scaler_.found_inf().eq(0);
    const at::Tensor stats = grad_stats_compute(grads, grad_stats_layout_);
    grad_stats_sum_.add_(at::where(ok, stats, at::zeros_like(stats)));
    grad_stats_steps_.add_(ok.to(at::kFloat));
  }
  sgd_.step(lr_, scaler_.found_inf());
  scaler_.update();
  const at::Tensor loss_detached = loss.detach().reshape({1});
  last_loss_.copy_(loss_detached);
  // A skipped step's samples are retried by the trainer: they count once, when their step is not skipped.
  const at::Tensor ok = scaler_.found_inf().eq(0);
  const at::Tensor zero = at::zeros({1}, loss_sum_.options());
  loss_sum_.add_(at::where(ok, loss_detached.to(at::kFloat) * static_cast<double>(labels.size(0)), zero));
  // Per sample: a sample's share of correct predictions (its correct tokens / T; 0 or 1 for a classifier).
  const double labels_per_sample = static_cast<double>(targets.numel()) / static_cast<double>(labels.size(0));
  correct_sum_.add_(
      at::where(ok, logits.detach().argmax(1).eq(targets).sum().to(at::kFloat) / labels_per_sample, zero));
}

at::Tensor TrainStep::forward(const at::Tensor& images) {
  if (unit_precisions_.empty()) {
    const AutocastScope autocast(device_, options_.precision);
    return model_.forward(images);
  }
  std::vector<Precision> applied;
  for (Precision p : unit_precisions_) applied.push_back(precision_applied(p));
  return unit_precision_forward(model_, images, applied, device_);
}

at::Tensor unit_precision_forward(Model& model, const at::Tensor& images, const std::vector<Precision>& precisions,
                                  const c10::Device& device,
                                  const std::function<void(size_t, const at::Tensor&)>& unit_input) {
  const auto& units = model.units();
  TORCH_CHECK(precisions.size() == units.size(), "unit_precision_forward: ", precisions.size(), " precisions for ",
              units.size(), " units");
  at::Tensor x = images;
  for (size_t i = 0; i < units.size(); ++i) {
    const Precision p = precisions[i];
    const at::ScalarType dtype = p == Precision::kFP32 ? at::kFloat : p == Precision::kBF16 ? at::kBFloat16 : at::kHalf;
    if (x.is_floating_point() && x.scalar_type() != dtype) x = x.to(dtype);
    if (unit_input) unit_input(i, x);
    if (p == Precision::kFP32) {
      x = units[i].forward(x);
    } else {
      const AutocastScope autocast(device, p == Precision::kBF16 ? PrecisionMode::kAmpBF16 : PrecisionMode::kAmpFP16);
      x = units[i].forward(x);
    }
  }
  return x;
}

Precision TrainStep::precision_applied(Precision decided) const {
  // CPUs have no fast fp16 convolutions (measured: ~15x slower than bf16 here); fp16 decisions run as bf16 there.
  return decided == Precision::kFP16 && !device_.is_cuda() ? Precision::kBF16 : decided;
}

void TrainStep::set_unit_precisions(const std::vector<Precision>& precisions) {
  TORCH_CHECK(precisions.empty() || precisions.size() == model_.units().size(), "set_unit_precisions: ",
              precisions.size(), " precisions for ", model_.units().size(), " units");
  if (precisions == unit_precisions_) return;
  unit_precisions_ = precisions;
  invalidate_graph();
}

void TrainStep::invalidate_graph() {
  if (!graph_) return;
  graph_.reset();
  // One eager step (cuDNN picks algorithms for the new dtypes) before the next capture.
  eager_steps_at_graph_size_ = std::max<int64_t>(0, options_.warmup_steps - 1);
}

void TrainStep::set_graph_batch_size(int64_t batch) {
  if (batch == options_.graph_batch_size) return;
  options_.graph_batch_size = batch;
  graph_.reset();
  eager_steps_at_graph_size_ = std::max<int64_t>(0, options_.warmup_steps - 1);
}

void TrainStep::grad_stats_enable(GradStatsLayout layout) {
  TORCH_CHECK(layout.num_tensors() == sgd_.params().size(), "grad_stats_enable: layout has ", layout.num_tensors(),
              " tensors, the optimizer ", sgd_.params().size());
  grad_stats_layout_ = std::move(layout);
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device_);
  grad_stats_sum_ = at::zeros({grad_stats_layout_.num_units(), kGradStatsColumns}, f32);
  grad_stats_steps_ = at::zeros({1}, f32);
  grad_stats_enabled_ = true;
  invalidate_graph();
}

at::Tensor TrainStep::grad_stats_take() {
  TORCH_CHECK(grad_stats_enabled_, "grad_stats_take: statistics are not enabled");
  const at::Tensor mean = (grad_stats_sum_ / grad_stats_steps_.clamp_min(1)).cpu();
  grad_stats_sum_.zero_();
  grad_stats_steps_.zero_();
  return mean;
}

void TrainStep::grads_release() {
  // Like zero_grad(set_to_none=True): backward creates fresh gradients, so they do not occupy memory during the
  // forward pass (the peak). Inside a capture they come from the graph's private pool at fixed addresses.
  for (const auto& p : sgd_.params()) p.mutable_grad() = at::Tensor();
}

bool TrainStep::capture(const at::Tensor& images, const at::Tensor& labels) {
#ifdef TRIACCEL_WITH_CUDA
  auto g = std::make_unique<Graph>();
  // The caller's buffers become the graph's static inputs (no copy); later batches are written into them.
  g->images = images;
  g->labels = labels;
  std::string error;
  g->graph = cuda_graph_capture(
      [&]() {
        if (options_.during_capture) options_.during_capture();
        body(g->images, g->labels);
      },
      &error);
  if (!g->graph) {
    if (error.empty()) {
      ++graph_capture_ooms_;
    } else if (graph_capture_error_.empty()) {
      graph_capture_error_ = error;
    }
    return false;
  }
  graph_ = std::move(g);
  ++graph_captures_;
  return true;
#else
  return false;
#endif
}

void TrainStep::run(const at::Tensor& images, const at::Tensor& labels, double lr) {
  lr_.fill_(lr);
  const int64_t batch = images.size(0);
  const bool graph_size = options_.cuda_graphs && batch == options_.graph_batch_size && batch != graph_refused_batch_;
  if (!graph_size) {
    body(images, labels);
    return;
  }
  if (!graph_) {
    if (eager_steps_at_graph_size_ < options_.warmup_steps) {
      ++eager_steps_at_graph_size_;
      body(images, labels);
      return;
    }
    if (!capture(images, labels)) {
      // No room for the graph's pool, or an operation the capture refused: this batch size runs eagerly from now on,
      // starting with this step (the capture ran nothing). Only an eager step that runs out of memory is the batch's
      // fault (the trainer's).
      graph_refused_batch_ = batch;
      grads_release();
      body(images, labels);
      return;
    }
  } else {
    // The trainer passes views of one buffer (new Tensor objects, same memory): compare storage, not identity.
    if (images.data_ptr() != graph_->images.data_ptr()) graph_->images.copy_(images);
    if (labels.data_ptr() != graph_->labels.data_ptr()) graph_->labels.copy_(labels);
    grads_release();  // frees gradients an eager step (a shorter last batch) may have left
  }
#ifdef TRIACCEL_WITH_CUDA
  graph_->graph->replay();
#endif
}

}  // namespace triaccel
