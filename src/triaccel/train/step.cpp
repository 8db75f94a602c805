#include "triaccel/train/step.h"

#include "triaccel/core/errors.h"
#include "triaccel/train/fp8_linear.h"
#include "triaccel/train/fp8_saved.h"
#include "triaccel/train/recompute.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/utils.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <utility>
#ifdef TRIACCEL_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#endif

namespace triaccel {

namespace {

StepGraphOptions graph_options(const StepOptions& o, const c10::Device& device, std::function<void()> before_replay) {
  StepGraphOptions g;
  g.enabled = o.cuda_graphs && device.is_cuda() && (!o.grad_reduce.start || o.grad_reduce.capturable);
  g.batch = o.graph_batch_size;
  g.warmup_steps = o.warmup_steps;
  g.during_capture = o.during_capture;
  g.during_pool_warmup = o.during_pool_warmup;
  g.before_replay = std::move(before_replay);  // gradients an eager step (a shorter last batch) may have left
  // The step's eager run at another batch size leaves only its gradients (released before a replay); what else it
  // writes (weights, optimizer state, the scaler, the metrics, BatchNorm statistics) exists before and is updated in
  // place. So that run takes its memory from the graph's pool instead of needing its own beside it.
  g.eager_in_pool = true;
  // Its warm-up leaves only its gradients too (released before the capture): the last one runs in the capture's pool.
  g.warmup_in_pool = true;
  // A capture refused by an error (e.g. a call from autograd's thread that global mode forbids, as a recompute's
  // nested backward may make) is retried once in relaxed mode before the step stays eager.
  g.relaxed_retry = true;
  g.agree_capture = o.grad_reduce.agree_capture;
  return g;
}

// A parameter's post-accumulate-grad hook: the update in backward of that parameter.
class UpdateInBackwardHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  explicit UpdateInBackwardHook(std::function<void(const at::Tensor&)> update) : update_(std::move(update)) {}
  void operator()(const torch::autograd::Variable& param) override { update_(param); }

 private:
  std::function<void(const at::Tensor&)> update_;
};

// *flag true for the scope's life (none when null), false after it, also when backward throws.
class FlagScope {
 public:
  explicit FlagScope(bool* flag) : flag_(flag) {
    if (flag_) *flag_ = true;
  }
  ~FlagScope() {
    if (flag_) *flag_ = false;
  }
  FlagScope(const FlagScope&) = delete;
  FlagScope& operator=(const FlagScope&) = delete;

 private:
  bool* flag_;
};

}  // namespace

TrainStep::TrainStep(Model& model, Optimizer& optimizer, LossScaler& scaler, StepOptions options,
                     const c10::Device& device)
    : model_(model),
      optimizer_(optimizer),
      scaler_(scaler),
      options_(options),
      device_(device),
      graph_(graph_options(options, device, [this]() { grads_release(); })) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device_);
  lr_ = at::zeros({1}, f32);
  loss_sum_ = at::zeros({1}, f32);
  correct_sum_ = at::zeros({1}, f32);
  last_loss_ = at::zeros({1}, f32);
  for (const auto& b : model_.buffers()) {
    buffers_.push_back(b);
    buffers_before_.push_back(at::empty_like(b));
  }
  if (options_.grad_reduce.start) {
    grad_buckets_ = std::make_unique<GradBuckets>(optimizer_.params(), options_.grad_reduce.buckets,
                                                  options_.grad_reduce.start);
  }
  if (options_.fault_injection || options_.grad_reduce.start) loss_factor_ = at::ones({1}, f32);
  if (options_.fault_injection) grad_fault_ = at::zeros({1}, f32);
  if (fp8_linears(options_.precision)) {
    fp8_ = std::make_unique<Fp8Linears>(options_.fp8);
    fp8_->layers_name(model_);
  }
}

bool TrainStep::last_step_skipped() const { return scaler_.found_inf().item<float>() != 0; }

void TrainStep::skipped_step_restore() {
  const torch::NoGradGuard no_grad;
  for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i].copy_(buffers_before_[i]);
}

bool TrainStep::run_failed(const at::Tensor& images, const at::Tensor& labels, double lr) {
  TORCH_CHECK(grad_buckets_, "TrainStep::run_failed is for data parallelism (StepOptions::grad_reduce)");
  const Phase phase = std::exchange(phase_, Phase::kIdle);
  if (phase != Phase::kIdle || graph_.runs_eagerly(images.size(0))) return run_failed_eagerly(phase);
  // The other ranks replay (or capture) their graphs at this batch: so does this rank, its loss times NaN.
  loss_factor_.fill_(std::numeric_limits<double>::quiet_NaN());
  bool ran = true;
  try {
    run(images, labels, lr);
  } catch (const c10::OutOfMemoryError&) {  // a capture that failed, then its eager step
    ran = false;
  }
  loss_factor_.fill_(fault_ == FaultKind::kNanLoss ? std::numeric_limits<double>::quiet_NaN() : 1.0);
  return ran || run_failed_eagerly(std::exchange(phase_, Phase::kIdle));
}

bool TrainStep::run_failed_eagerly(Phase phase) {
  if (phase == Phase::kUpdate) return false;  // the sums were in: the other ranks' updates run
  const torch::NoGradGuard no_grad;
  if (phase == Phase::kIdle) {  // the step never began: its restore puts back what is there now
    for (size_t i = 0; i < buffers_.size(); ++i) buffers_before_[i].copy_(buffers_[i]);
  }
  grads_release();  // this rank's share: zeros, times NaN
  if (!grad_buckets_->finish_poisoned()) return false;
  const at::Tensor zero = at::zeros({1}, last_loss_.options());
  update(zero, zero, 0, 1.0);  // found_inf from the NaN sums: the optimizer skips, the metrics take nothing
  return true;
}

void TrainStep::failed_step_restore() {
  skipped_step_restore();
  scaler_.update_undo();
}

void TrainStep::set_fault(FaultKind kind) {
  TORCH_CHECK(options_.fault_injection || kind == FaultKind::kNone,
              "TrainStep::set_fault needs StepOptions::fault_injection");
  TORCH_CHECK(kind != FaultKind::kOom, "TrainStep::set_fault: out of memory is raised by the caller");
  if (kind == fault_ || !options_.fault_injection) return;
  fault_ = kind;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  loss_factor_.fill_(kind == FaultKind::kNanLoss ? nan : 1.0);
  grad_fault_.fill_(kind == FaultKind::kNanGrad   ? nan
                    : kind == FaultKind::kInfGrad ? std::numeric_limits<double>::infinity()
                                                  : 0.0);
}

TrainStep::~TrainStep() {
  if (!updates_in_backward_hooked_) return;
  for (const auto& p : optimizer_.params()) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
}

bool TrainStep::update_in_backward_possible() const {
  if (!optimizer_.steps_one() || grad_buckets_ || options_.fault_injection || scaler_.options().enabled ||
      options_.after_update || grad_stats_enabled_) {
    return false;
  }
  return updates_in_backward_hooked_ || post_accumulate_grad_hooks_free(optimizer_.params());
}

bool post_accumulate_grad_hooks_free(const std::vector<at::Tensor>& params) {
  return std::all_of(params.begin(), params.end(), [](const at::Tensor& p) {
    return p.requires_grad() && !torch::autograd::impl::post_acc_grad_hooks(p);
  });
}

void TrainStep::set_update_in_backward(bool on) {
  if (on == update_in_backward_) return;
  TORCH_CHECK(!on || update_in_backward_possible(),
              "set_update_in_backward: this step cannot update in backward (update_in_backward_possible)");
  if (on && !updates_in_backward_hooked_) {
    const std::vector<at::Tensor>& params = optimizer_.params();
    for (size_t i = 0; i < params.size(); ++i) {
      torch::autograd::impl::set_post_acc_grad_hooks(
          params[i], std::make_unique<UpdateInBackwardHook>([this, i](const at::Tensor& p) { update_one(i, p); }));
    }
    updates_in_backward_hooked_ = true;
  }
  update_in_backward_ = on;
  invalidate_graph();
}

void TrainStep::update_one(size_t i, const at::Tensor& param) {
  if (!updating_in_backward_) return;  // another backward (the memory model's trace, a curvature pass)
  const torch::NoGradGuard no_grad;
  // The gradient leaves the parameter now: its memory goes back once its update is queued.
  const at::Tensor grad = std::exchange(param.mutable_grad(), at::Tensor());
  if (!grad.defined()) return;
  scaler_.check({grad});
  optimizer_.step_one(i, grad, lr_, scaler_.found_inf());
}

size_t TrainStep::fp8_layers() const { return fp8_ ? fp8_->layers() : 0; }

NamedTensors TrainStep::fp8_state() const { return fp8_ ? fp8_->state() : NamedTensors(); }

void TrainStep::fp8_restore(const NamedTensors& stored, const std::string& path) {
  if (stored.empty()) return;
  TRIACCEL_CHECK_INPUT(fp8_ != nullptr, "checkpoint ", path, " holds fp8 scales, and this run is not amp-fp8");
  fp8_->restore(stored, path);
}

void TrainStep::metrics_reset() {
  loss_sum_.zero_();
  correct_sum_.zero_();
}

void TrainStep::body(const at::Tensor& images, const at::Tensor& labels) {
  phase_ = Phase::kPass;
  grads_release();
  {
    const torch::NoGradGuard no_grad;
    for (size_t i = 0; i < buffers_.size(); ++i) buffers_before_[i].copy_(buffers_[i]);
  }
  // Micro-batches of at most m samples; their gradients accumulate. With one micro-batch the step is exactly the
  // whole-batch step (no weighting op).
  const int64_t n = images.size(0);
  const int64_t m = options_.micro_batch > 0 ? std::min(options_.micro_batch, n) : n;
  // The update in backward: one micro-batch only (accumulated gradients must all exist before an update).
  updated_in_backward_ = update_in_backward_ && m >= n && n > 0 && !grad_stats_enabled_;
  if (updated_in_backward_) scaler_.found_inf_reset();
  at::Tensor loss_total;     // (1): the batch's mean loss
  at::Tensor correct_total;  // (1) float32: correct predictions (label elements)
  int64_t label_elements = 0;
  for (int64_t start = 0; start < n; start += m) {
    const int64_t len = std::min(m, n - start);
    const bool whole = len == n;
    const at::Tensor x = whole ? images : images.narrow(0, start, len);
    const at::Tensor y = whole ? labels : labels.narrow(0, start, len);
    // The objective's mean loss and metric (train/objective.h: cross-entropy and accuracy unless the program gave
    // its own).
    const ObjectiveTerms terms = objective_terms(options_.objective.get(), forward(x), y, options_.label_smoothing);
    at::Tensor loss = terms.loss;
    if (loss_factor_.defined()) loss = loss * loss_factor_;
    if (!whole) loss = loss * (static_cast<double>(len) / static_cast<double>(n));  // the micro-batch's share
    // Data parallelism: this rank's share of the global batch weights its gradients through the loss (a multiply
    // of one number) rather than as a pass over each bucket; the buckets add the weighted gradients as they are.
    const double share = grad_buckets_ ? options_.grad_reduce.weight() : 1.0;
    if (grad_buckets_ && start + len >= n) grad_buckets_->arm();  // the last micro-batch: reduces
    const at::Tensor scaled = scaler_.scale(share != 1.0 ? loss * share : loss);
    if (updated_in_backward_) scaler_.check({loss.detach().reshape({1}).clone()});  // (a copy: checked in place)
    {
      const FlagScope updating(updated_in_backward_ ? &updating_in_backward_ : nullptr);
      scaled.backward();
    }
    const torch::NoGradGuard no_grad;
    const at::Tensor& correct = terms.metric;
    loss_total = loss_total.defined() ? loss_total + loss.detach() : loss.detach();
    correct_total = correct_total.defined() ? correct_total + correct : correct;
    label_elements += terms.counted;
  }
  const torch::NoGradGuard no_grad;
  if (n == 0) {  // a data-parallel rank with no samples in this (short) batch: it contributes zero gradients
    loss_total = at::zeros({1}, last_loss_.options());
    correct_total = at::zeros({1}, last_loss_.options());
  }
  if (grad_buckets_) {
    if (n == 0) grad_buckets_->arm();  // no backward ran: every bucket starts here
    grad_buckets_->finish();
  }
  phase_ = Phase::kUpdate;
  // Per sample: a sample's share of correct predictions (its correct tokens / T; 0 or 1 for a classifier).
  const double labels_per_sample =
      n > 0 ? static_cast<double>(label_elements) / static_cast<double>(n) : 1.0;
  update(loss_total, correct_total, n, labels_per_sample);
}

void TrainStep::update(const at::Tensor& loss_total, const at::Tensor& correct_total, int64_t n,
                       double labels_per_sample) {
  const torch::NoGradGuard no_grad;
  if (!std::exchange(updated_in_backward_, false)) {  // (else each parameter's update ran in backward)
    const std::vector<at::Tensor> grads = optimizer_.grads();
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
    optimizer_.step(lr_, scaler_.found_inf());
  }
  if (options_.after_update) options_.after_update();
  scaler_.update();
  const at::Tensor loss_detached = loss_total.reshape({1});
  last_loss_.copy_(loss_detached);
  // A skipped step's samples are retried by the trainer: they count once, when their step is not skipped.
  const at::Tensor ok = scaler_.found_inf().eq(0);
  const at::Tensor zero = at::zeros({1}, loss_sum_.options());
  loss_sum_.add_(at::where(ok, loss_detached.to(at::kFloat) * static_cast<double>(n), zero));
  correct_sum_.add_(at::where(ok, correct_total / labels_per_sample, zero));
}

at::Tensor TrainStep::forward(const at::Tensor& images) {
  if (recompute_.empty() && unit_precisions_.empty() && fp8_saved_.empty()) {
    // amp-fp8: the model's linear layers FP8 takes (null: their own forward).
    const LinearOverrideScope fp8(fp8_.get());
    const AutocastScope autocast(device_, options_.precision);
    return model_.forward(images);
  }
  // Unit by unit, each at its precision (unit_forward_at's rule; an FP8 unit's linear layers in FP8), the recomputed
  // units' activations dropped until backward. A recomputed unit casts inside the recompute, so it keeps its input as
  // it came — the previous unit's output, which that unit's backward holds anyway — not a copy in its dtype (an fp32
  // unit after a bf16 one: twice the input's bytes, which the memory model, pricing the input as it comes, did not
  // predict).
  // An FP8-stored unit runs under the scope of one store for the whole forward, so a tensor two units save (one's
  // output, the next's input) is stored once.
  at::Tensor x = images;
  std::optional<Fp8SavedStore> fp8_store;
  if (!fp8_saved_.empty()) fp8_store.emplace();
  for (size_t u = 0; u < model_.units().size(); ++u) {
    const auto forward = [this, u](const at::Tensor& in) { return unit_forward(u, in); };
    const bool recomputed = !recompute_.empty() && recompute_[u];
    if (recomputed) {
      x = recompute_forward(forward, x, unit_params_[u], unit_buffers_[u]);
    } else if (!fp8_saved_.empty() && fp8_saved_[u]) {
      const Fp8SavedScope scope(*fp8_store);
      x = forward(x);
    } else {
      x = forward(x);
    }
  }
  fp8_saved_last_tensors_ = fp8_store ? fp8_store->stored_tensors() : 0;
  return x;
}

at::Tensor TrainStep::unit_forward(size_t u, const at::Tensor& x) const {
  const std::optional<Precision> precision = unit_precision_at(unit_precisions_, u, device_);
  // Set here, per unit: a recompute in backward runs on autograd's thread; under Tri-Accel's precisions only the
  // units at fp8 take the FP8 linears.
  const LinearOverrideScope fp8(fp8_linears(unit_mode(precision, options_.precision)) ? fp8_.get() : nullptr);
  return unit_forward_at(precision, options_.precision, device_, x, model_.units()[u].forward);
}

void TrainStep::set_micro_batch(int64_t micro_batch) {
  TORCH_CHECK(micro_batch >= 0, "set_micro_batch: ", micro_batch);
  if (micro_batch == options_.micro_batch) return;
  options_.micro_batch = micro_batch;
  invalidate_graph();
}

void TrainStep::set_recompute(const std::vector<bool>& recompute) {
  const auto& units = model_.units();
  TORCH_CHECK(recompute.empty() || recompute.size() == units.size(), "set_recompute: ", recompute.size(),
              " flags for ", units.size(), " units");
  const bool any = std::find(recompute.begin(), recompute.end(), true) != recompute.end();
  const std::vector<bool> next = any ? recompute : std::vector<bool>();
  if (next == recompute_) return;
  recompute_ = next;
  if (any && unit_params_.empty()) {
    for (const Unit& unit : units) {
      unit_params_.push_back(unit.parameters());
      std::vector<at::Tensor> buffers;
      for (const auto& module : unit.modules) {
        for (const auto& b : module->buffers()) buffers.push_back(b);
      }
      unit_buffers_.push_back(std::move(buffers));
    }
  }
  invalidate_graph();
}

void TrainStep::set_fp8_saved(const std::vector<bool>& fp8_saved) {
  TORCH_CHECK(fp8_saved.empty() || fp8_saved.size() == model_.units().size(), "set_fp8_saved: ", fp8_saved.size(),
              " flags for ", model_.units().size(), " units");
  const bool any = std::find(fp8_saved.begin(), fp8_saved.end(), true) != fp8_saved.end();
  TORCH_CHECK(!any || fp8_saved_available(), "set_fp8_saved: FP8 storage of saved activations is not available here");
  const std::vector<bool> next = any ? fp8_saved : std::vector<bool>();
  if (next == fp8_saved_) return;
  fp8_saved_ = next;
  invalidate_graph();
}

void TrainStep::set_unit_precisions(const std::vector<Precision>& precisions) {
  TORCH_CHECK(precisions.empty() || precisions.size() == model_.units().size(), "set_unit_precisions: ",
              precisions.size(), " precisions for ", model_.units().size(), " units");
  if (precisions == unit_precisions_) return;
  unit_precisions_ = precisions;
  invalidate_graph();
}

void TrainStep::invalidate_graph() {
  graph_.invalidate();  // one eager step (cuDNN picks algorithms for the new dtypes) before the next capture
}

void TrainStep::grad_stats_enable(GradStatsLayout layout) {
  TORCH_CHECK(layout.num_tensors() == optimizer_.params().size(), "grad_stats_enable: layout has ", layout.num_tensors(),
              " tensors, the optimizer ", optimizer_.params().size());
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
  for (const auto& p : optimizer_.params()) p.mutable_grad() = at::Tensor();
}

void TrainStep::run(const at::Tensor& images, const at::Tensor& labels, double lr) {
  // The optimizer's state before the first forward, not after the first backward (where the optimizer would make it):
  // there it would take the holes the freed activations left, and under a --vram-budget those partly used 20 MiB
  // pages of the allocator's expandable segments would stay mapped for good around the state, memory the step's CUDA
  // graph (a pool of its own) cannot use, so captures whose eager steps fit would run out of memory (measured:
  // docs/results/memory-planner.md).
  optimizer_.state_init();
  lr_.fill_(lr);
  graph_.run([this](const at::Tensor& x, const at::Tensor& y) { body(x, y); }, images, labels);
  phase_ = Phase::kIdle;
}

}  // namespace triaccel
