// The curvature probe (see probe.h): one train-mode forward on a small batch, then per unit an HvpOperator over
// that unit's parameters from the same loss and power iteration for its top-k eigenvalues. Everything the forward
// changes (BatchNorm running statistics, num_batches_tracked, generator states) is snapshotted before and
// written back after, so probing never perturbs training.
#include "triaccel/control/curvature/curvature_probe.h"

#include "triaccel/core/clock.h"
#include "triaccel/core/cuda_graph.h"
#include "triaccel/core/device.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/profile.h"
#include "triaccel/control/curvature/hvp.h"
#include "triaccel/models/batch_norm.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/nn/modules/conv.h>
#ifdef TRIACCEL_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <cmath>
#include <mutex>
#include <optional>

namespace triaccel {

namespace {

// Everything a train-mode forward may change, captured on construction and written back by restore():
// buffers, the train/eval mode, autocast on the device, and the default generator of the CPU and the device. Also
// sets whether the probe's convolutions may use cuDNN (options.cudnn) until restore().
class ModelStateGuard {
 public:
  ModelStateGuard(Model& model, const c10::Device& device, ProbePrecision precision, bool cudnn)
      : model_(model), device_(device), was_training_(model.is_training()) {
    at::NoGradGuard no_grad;
    for (const auto& buffer : model_.buffers(/*recurse=*/true)) {
      buffers_.push_back(buffer);
      saved_buffers_.push_back(buffer.clone());
    }
    generator_save(at::Device(at::kCPU));
    if (device_.type() != at::kCPU) generator_save(device_);
    autocast_enabled_ = at::autocast::is_autocast_enabled(device_.type());
    autocast_dtype_ = at::autocast::get_autocast_dtype(device_.type());
    // The fused BatchNorm kernel (16-bit inputs) has no second derivative: ATen's BatchNorm for the probe.
    bn_kernel_off_.emplace();
    // The probe's own arithmetic, whatever the training step's autocast was.
    at::autocast::set_autocast_enabled(device_.type(), precision == ProbePrecision::kBF16);
    at::autocast::set_autocast_dtype(device_.type(), at::kBFloat16);
    cudnn_was_ = at::globalContext().userEnabledCuDNN();
    at::globalContext().setUserEnabledCuDNN(cudnn_was_ && cudnn);
  }

  void restore() {
    if (restored_) return;
    restored_ = true;
    at::autocast::set_autocast_enabled(device_.type(), autocast_enabled_);
    at::autocast::set_autocast_dtype(device_.type(), autocast_dtype_);
    at::autocast::clear_cache();  // the bf16 copies of the weights, if the probe made any
    at::globalContext().setUserEnabledCuDNN(cudnn_was_);
    bn_kernel_off_.reset();
    for (auto& [generator, state] : generators_) {
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(state);
    }
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i].copy_(saved_buffers_[i]);
    model_.train(was_training_);
  }

  ~ModelStateGuard() {
    try {
      restore();
    } catch (const std::exception& e) {
      TORCH_WARN("curvature probe: could not restore the model state: ", e.what());
    }
  }

 private:
  void generator_save(const at::Device& device) {
    at::Generator generator = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(generator.mutex());
    generators_.emplace_back(generator, generator.get_state());
  }

  Model& model_;
  c10::Device device_;
  bool was_training_;
  bool autocast_enabled_ = false;
  bool cudnn_was_ = true;
  at::ScalarType autocast_dtype_ = at::kBFloat16;
  std::optional<BatchNormKernelOff> bn_kernel_off_;
  bool restored_ = false;
  std::vector<at::Tensor> buffers_;
  std::vector<at::Tensor> saved_buffers_;
  std::vector<std::pair<at::Generator, at::Tensor>> generators_;
};

}  // namespace

bool probe_cudnn_auto(const Model& model, CurvatureEstimator estimator) {
  if (estimator != CurvatureEstimator::kFisher) return true;
  for (const auto& module : model.modules(/*include_self=*/false)) {
    const auto* conv = module->as<torch::nn::Conv2dImpl>();
    if (conv != nullptr && conv->options.groups() > 1) return false;
  }
  return true;
}

void CurvatureOptions::validate() const {
  TRIACCEL_CHECK_INPUT(top_k >= 1, option_ref("curv_top_k"), " must be >= 1, got ", top_k);
  TRIACCEL_CHECK_INPUT(max_iters >= 1, option_ref("curv_max_iters"), " must be >= 1, got ", max_iters);
  TRIACCEL_CHECK_INPUT(tol >= 0 && std::isfinite(tol), "curvature probe: tol must be a number >= 0, got ", tol);
  TRIACCEL_CHECK_INPUT(batch >= 1, option_ref("curv_batch"), " must be >= 1, got ", batch);
  TRIACCEL_CHECK_INPUT(every_steps >= 1, option_ref("curv_every"), " must be >= 1, got ", every_steps);
  TRIACCEL_CHECK_INPUT(chunk >= -1, option_ref("curv_chunk"), " must be >= -1, got ", chunk);
}

std::vector<UnitCurvature> curvature_probe(Model& model, const at::Tensor& images, const at::Tensor& labels,
                                           const CurvatureOptions& options, double* wall_seconds,
                                           std::vector<std::vector<at::Tensor>>* warm_start,
                                           const std::vector<size_t>* only_units) {
  options.validate();
  TORCH_CHECK(images.dim() == 4, "curvature_probe: images must be (N, C, H, W), got ", images.sizes());
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == images.size(0), "curvature_probe: labels must be (",
              images.size(0), "), got ", labels.sizes());
  TORCH_CHECK(images.size(0) >= 1, "curvature_probe: empty batch");
  const Clock& clock = options.clock ? *options.clock : steady_clock();
  const double start = clock.now_s();
  const c10::Device device = images.device();

  std::vector<UnitCurvature> result;
  {
    ModelStateGuard state(model, device, options.precision, options.cudnn);
    at::AutoGradMode grad_mode(true);
    model.train(true);

    const int64_t n = std::min(options.batch, images.size(0));
    const at::Tensor x = images.narrow(0, 0, n);                  // (n, C, H, W)
    const at::Tensor y = labels.narrow(0, 0, n).to(at::kLong);    // (n)
    const auto& units = model.units();
    const auto selected = [&](size_t i) {
      return only_units == nullptr || std::find(only_units->begin(), only_units->end(), i) != only_units->end();
    };
    // A unit's Hessian block depends only on the units from it on (its input is a constant for its parameters), so
    // the units before the first probed one run without a graph: their activations, the largest ones (full
    // resolution), are not kept for the double backward. Exact; when only late units are probed (the round-robin
    // starts at the output) the probe needs a fraction of a whole-network graph's memory and backward work.
    size_t first = 0;
    while (first < units.size() && !selected(first)) ++first;
    at::Tensor h = x;
    {
      const at::NoGradGuard no_graph;
      for (size_t i = 0; i < first; ++i) h = units[i].forward(h);
    }
    for (size_t i = first; i < units.size(); ++i) h = units[i].forward(h);
    at::Tensor logits = h;                                        // (n, classes)
    if (at::isReducedFloatingType(logits.scalar_type())) logits = logits.to(at::kFloat);
    const at::Tensor loss = at::cross_entropy_loss(logits, y);   // scalar

    // First-order gradients of every unit's parameters in one backward pass (with their graph); each unit's
    // operator then takes its slice, instead of one create-graph backward per unit.
    std::vector<std::vector<at::Tensor>> unit_params(units.size());
    std::vector<at::Tensor> all_params;
    for (size_t i = 0; i < units.size(); ++i) {
      if (!selected(i)) continue;
      for (const auto& p : units[i].parameters()) {
        if (p.requires_grad()) {
          unit_params[i].push_back(p);
          all_params.push_back(p);
        }
      }
    }
    const std::vector<at::Tensor> all_grads =
        all_params.empty() ? std::vector<at::Tensor>{}
                           : torch::autograd::grad({loss}, all_params, /*grad_outputs=*/{}, /*retain_graph=*/true,
                                                   /*create_graph=*/true, /*allow_unused=*/true);
    size_t next_grad = 0;
    for (size_t i = 0; i < units.size(); ++i) {
      const double unit_start = clock.now_s();
      UnitCurvature entry;
      entry.unit = units[i].name;
      if (!selected(i)) {
        entry.probed = false;
        result.push_back(std::move(entry));
        continue;
      }
      const std::vector<at::Tensor>& params = unit_params[i];
      std::vector<at::Tensor> grads(all_grads.begin() + static_cast<long>(next_grad),
                                    all_grads.begin() + static_cast<long>(next_grad + params.size()));
      next_grad += params.size();
      if (params.empty()) {
        entry.converged = true;
      } else {
        HvpOperator op(params, std::move(grads));  // this unit's slice of the shared first-order gradients
        const bool warm = warm_start != nullptr && warm_start->size() == units.size() && !(*warm_start)[i].empty();
        // A warm start converges in a few products, fewer than a capture costs (a warm probe runs faster eager than
        // with the capture; measured: docs/results/tri-accel.md): the graph is for cold starts.
        op.graph_after_first_product(options.cuda_graphs && !warm);
        const EigenResult eigen = power_iteration_topk(op, options.top_k, options.max_iters, options.tol,
                                                       options.seed + i,
                                                       warm ? (*warm_start)[i] : std::vector<at::Tensor>{});
        if (warm_start != nullptr) {
          if (warm_start->size() != units.size()) warm_start->assign(units.size(), {});
          (*warm_start)[i] = eigen.eigenvectors;
        }
        entry.eigenvalues = eigen.eigenvalues;
        entry.lambda_max = *std::max_element(eigen.eigenvalues.begin(), eigen.eigenvalues.end());
        entry.iterations = eigen.iterations;
        entry.converged = eigen.converged;
        entry.graphed = op.graphed();
      }
      entry.seconds = clock.now_s() - unit_start;
      result.push_back(std::move(entry));
    }
    state.restore();
  }
  device_synchronize(device);
  if (wall_seconds != nullptr) *wall_seconds = clock.now_s() - start;
  return result;
}

namespace {
// The Fisher rounds' label draws have a generator of their own, apart from the start vectors' (seed + unit index).
constexpr uint64_t kLabelSeedOffset = 0x9e3779b97f4a7c15ULL;
}  // namespace

struct CurvatureRound::State {
  State(Model& m, CurvatureOptions o) : model(m), options(std::move(o)) {}
  Model& model;
  CurvatureOptions options;
  at::Tensor x, y;                                 // the probe batch, (n, C, H, W) and (n), or tokens (n, T), (n, T)
  std::vector<std::vector<at::Tensor>> params;     // per unit: its parameters that require grad
  std::vector<at::Tensor> all_params;              // all of them, in unit order
  std::vector<int64_t> offset, numel;              // per unit: its slice of the flat vectors
  // v, (Σ numel): each unit's current unit vector, the only large tensor kept between passes and rounds — in host
  // memory (pinned) for a GPU model, so the training steps between rounds do not carry it. A pass copies it to the
  // device, makes w = per-unit H_uu·v_u (kFisher: F_uu·v_u), writes each unit's Rayleigh quotient and ‖w_u‖ to
  // `stats` and, for the units `active` marks, v_u = w_u / ‖w_u‖, and copies v back; its device tensors are its own
  // (in the graph's pool when captured).
  at::Tensor v;
  at::Tensor stats;                                // (2 · units): per unit vᵀw / vᵀv, then ‖w‖
  at::Tensor active;                               // (units) bool, written by the host before each pass
  at::Tensor label_u;                              // kFisher: uniform draws shaped as y, one per label, fixed for the run
  bool started = false;                            // v holds the last round's vectors
#ifdef TRIACCEL_WITH_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
  int captures_tried = 0;                          // of the current graph: first cold, then after an eager pass
  StepGraph* host = nullptr;                       // share_pool's: the pass is a side graph of this one's
  int64_t side = 0;                                // the side graph's handle (0: none captured)
  std::vector<const void*> storage;                // the parameters' data at the capture
  int64_t graph_bytes = 0;
  CurvatureRound::Timing timing;                   // of the last round

  at::Tensor slice(const at::Tensor& flat, size_t u) const { return flat.narrow(0, offset[u], numel[u]); }

  bool fisher() const { return options.estimator == CurvatureEstimator::kFisher; }
  // Samples per forward/backward, within [1, n].
  int64_t chunk() const {
    const int64_t n = x.size(0);
    const int64_t c = options.chunk >= 0 ? options.chunk : (fisher() ? kFisherChunk : kHessianChunk);
    return c > 0 ? std::min(c, n) : n;
  }

  // kFisher: `labels` = one label per sample drawn from `logits`' softmax (the model's, in eval mode), by inverting
  // its CDF at the sample's fixed uniform draw `u`. Drawn from each pass's own forward: the weights do not move within
  // a round, so its passes draw the same labels, and no forward of its own runs for them (a forward of the whole batch
  // was a shape of its own for cuDNN to set up at the first round). The same draws every round (common random
  // numbers): a label moves only where the model's prediction moved across it, so each round's Fisher is near the
  // last one's and the warm start holds, while every round's labels are a draw from the model as it is then.
  // A token model's logits (m, T, V) are m·T rows, one label each.
  static void draw_labels(const at::Tensor& logits, const at::Tensor& u, const at::Tensor& labels) {
    const at::NoGradGuard no_grad;
    const at::Tensor cdf = at::softmax(logits.detach().reshape({-1, logits.size(-1)}), 1).cumsum(1);  // (rows, V)
    const at::Tensor drawn = (cdf < u.reshape({-1}).to(cdf.options()).unsqueeze(1)).sum(1).clamp_max(cdf.size(1) - 1);
    labels.copy_(drawn.view(labels.sizes()));
  }

  // kFisher's products: per chunk k of m samples, the gradient s_k of the sum of its samples' losses at the drawn
  // labels; each unit's w_u += s_k,u (s_k,u·v_u); then w /= the batch's labels (n; a token model's n·T, whose
  // training loss is the mean over tokens: each token's label is drawn on its own, so the cross terms of one
  // sequence's tokens have mean zero as those of two samples do). The samples' gradients at labels drawn from the model
  // have mean zero and are independent (eval mode), so E[s_k s_kᵀ] = Σ_{i∈k} F_i: (1/n) Σ_k s_k s_kᵀ is the samples'
  // Fisher for any m (m = 1: exactly (1/n) Σ_i g_i g_iᵀ), at the cost of n/m forward/backward passes.
  void fisher_products(const at::Tensor& vf, at::Tensor& w) {
    const auto& units = model.units();
    const int64_t n = x.size(0);
    const int64_t m = chunk();
    for (int64_t first = 0; first < n; first += m) {
      const int64_t count = std::min(m, n - first);
      at::Tensor h = x.narrow(0, first, count);
      for (const Unit& unit : units) h = unit.forward(h);
      if (at::isReducedFloatingType(h.scalar_type())) h = h.to(at::kFloat);
      const at::Tensor yc = y.narrow(0, first, count);
      draw_labels(h, label_u.narrow(0, first, count), yc);
      const at::Tensor loss = at::cross_entropy_loss(h.reshape({-1, h.size(-1)}), yc.reshape({-1}), /*weight=*/{},
                                                     at::Reduction::Sum);
      const std::vector<at::Tensor> grads = torch::autograd::grad({loss}, all_params, /*grad_outputs=*/{},
                                                                  /*retain_graph=*/false, /*create_graph=*/false,
                                                                  /*allow_unused=*/true);
      // Read from the gradients as autograd made them: a flat copy of them was a quarter of the pass's memory (v, w,
      // the gradients, the copy; 45 MB each on ResNet-18).
      const at::NoGradGuard no_grad;
      size_t next = 0;
      for (size_t u = 0; u < units.size(); ++u) {
        const std::vector<at::Tensor>& ps = params[u];
        if (ps.empty()) continue;
        const std::vector<at::Tensor> vs = flat_pieces(slice(vf, u), ps);
        const std::vector<at::Tensor> ws = flat_pieces(slice(w, u), ps);
        at::Tensor dot = at::zeros({}, vf.options());  // s_k,u · v_u
        for (size_t j = 0; j < ps.size(); ++j) {
          if (grads[next + j].defined()) dot.add_(at::sum(grads[next + j] * vs[j]));
        }
        for (size_t j = 0; j < ps.size(); ++j) {
          if (grads[next + j].defined()) ws[j].addcmul_(grads[next + j], dot);
        }
        next += ps.size();
      }
    }
    const at::NoGradGuard no_grad;
    w.div_(static_cast<double>(y.numel()));
  }

  // One pass: one product per unit into w (kHessian: per chunk, the forward, the first-order gradients with their
  // graph, the products added), then the statistics and the active units' next vectors.
  void pass() {
    at::Tensor vf = v;  // v itself on the CPU
#ifdef TRIACCEL_WITH_CUDA
    if (x.is_cuda()) {
      vf = at::empty(v.sizes(), v.options().device(x.device()).pinned_memory(false));
      cuda_copy_pinned_async(vf, v);
    }
#endif
    at::Tensor w = at::zeros_like(vf);
    if (fisher()) {
      fisher_products(vf, w);
    } else {
      const int64_t n = x.size(0);
      const int64_t m = chunk();
      for (int64_t first = 0; first < n; first += m) {
        const int64_t count = std::min(m, n - first);
        chunk_products(x.narrow(0, first, count), y.narrow(0, first, count), static_cast<double>(count) / n, vf, w);
      }
    }
    const at::NoGradGuard no_grad;
    std::vector<at::Tensor> parts;
    for (size_t u = 0; u < numel.size(); ++u) {
      if (numel[u] == 0) continue;
      const at::Tensor vu = slice(vf, u), wu = slice(w, u);
      const at::Tensor norm = wu.norm();
      parts.push_back(at::dot(vu, wu) / at::dot(vu, vu));
      parts.push_back(norm);
      vu.copy_(at::where(active[static_cast<int64_t>(u)].logical_and(norm > 0), wu / norm, vu));
    }
    stats.copy_(at::stack(parts));
#ifdef TRIACCEL_WITH_CUDA
    if (x.is_cuda()) cuda_copy_pinned_async(v, vf);
#endif
  }

  // One chunk's products, `weight` (its share of the batch) times its mean loss's, added to w.
  void chunk_products(const at::Tensor& xc, const at::Tensor& yc, double weight, const at::Tensor& vf, at::Tensor& w) {
    const auto& units = model.units();
    at::Tensor h = xc;
    for (const Unit& unit : units) h = unit.forward(h);
    if (at::isReducedFloatingType(h.scalar_type())) h = h.to(at::kFloat);
    at::Tensor loss = at::cross_entropy_loss(h, yc);
    if (weight != 1.0) loss = loss * weight;
    const std::vector<at::Tensor> grads = torch::autograd::grad({loss}, all_params, /*grad_outputs=*/{},
                                                                /*retain_graph=*/true, /*create_graph=*/true,
                                                                /*allow_unused=*/true);
    size_t next = 0;
    for (size_t u = 0; u < units.size(); ++u) {
      const std::vector<at::Tensor>& ps = params[u];
      if (ps.empty()) continue;
      const HvpOperator op(ps, std::vector<at::Tensor>(grads.begin() + static_cast<long>(next),
                                                       grads.begin() + static_cast<long>(next + ps.size())));
      next += ps.size();
      const std::vector<at::Tensor> hv = op.apply(flat_pieces(slice(vf, u), ps));
      std::vector<at::Tensor> out = flat_pieces(slice(w, u), ps);
      for (size_t j = 0; j < ps.size(); ++j) out[j].add_(hv[j]);
    }
  }

  std::vector<const void*> storage_now() const {
    std::vector<const void*> out;
    for (const auto& p : all_params) out.push_back(p.data_ptr());
    return out;
  }

  bool has_graph() const {
#ifdef TRIACCEL_WITH_CUDA
    return graph != nullptr || side != 0;
#else
    return false;
#endif
  }

  // The pass: replayed when captured. Without a graph yet (and one wanted) it is captured first and replayed — the
  // eager pass costs as much host work as the capture (measured: docs/results/tri-accel.md) — and where that capture
  // fails (a library setting itself up) once more after an eager pass. True when the pass ran as a replay.
  bool run_pass(const Clock& clock) {
#ifdef TRIACCEL_WITH_CUDA
    if (host) return run_side_pass(clock);
    const bool capturable = options.cuda_graphs && x.is_cuda() &&
                            c10::cuda::getCurrentCUDAStream() != c10::cuda::getDefaultCUDAStream();
    if (!graph && capturable && captures_tried == 0) capture(clock);
    if (graph) {
      graph->replay();
      return true;
    }
    const double t0 = clock.now_s();
    pass();
    device_synchronize(x.device());
    timing.eager_s += clock.now_s() - t0;
    if (capturable && captures_tried == 1) capture(clock);  // replayed from the next pass on
    return false;
#else
    const double t0 = clock.now_s();
    pass();
    timing.eager_s += clock.now_s() - t0;
    return false;
#endif
  }

#ifdef TRIACCEL_WITH_CUDA
  // share_pool's pass: the side graph replayed, captured first when there is none (the step's graph was captured
  // again since the last round, or this is the first).
  bool run_side_pass(const Clock& clock) {
    if (side != 0 && host->side_replay(side)) return true;
    const double t1 = clock.now_s();
    const int64_t before = memory_stats(x.device()).reserved_bytes;
    side = host->side_capture([&]() { pass(); });
    timing.capture_s += clock.now_s() - t1;
    TORCH_CHECK_WITH(OutOfMemoryError, side != 0,
                     "CurvatureRound: the pass could not be captured in the training step's graph pool");
    graph_bytes = memory_stats(x.device()).reserved_bytes - before;  // what the shared pool grew by
    storage = storage_now();
    host->side_replay(side);
    return true;
  }

  void capture(const Clock& clock) {
    TRIACCEL_PROFILE_RANGE("triaccel::curvature_capture");
    ++captures_tried;
    const double t1 = clock.now_s();
    memory_cache_release(x.device());  // as the capture does: what stays reserved after it is the graph's pool
    const int64_t before = memory_stats(x.device()).reserved_bytes;
    graph = cuda_graph_capture([&]() { pass(); });  // records, runs nothing
    if (graph) {
      graph_bytes = memory_stats(x.device()).reserved_bytes - before;
      storage = storage_now();
    }
    timing.capture_s += clock.now_s() - t1;
  }
#endif
};

CurvatureRound::CurvatureRound(Model& model, const at::Tensor& images, const at::Tensor& labels,
                               CurvatureOptions options)
    : s_(std::make_unique<State>(model, std::move(options))) {
  State& s = *s_;
  s.options.validate();
  TORCH_CHECK(s.options.top_k == 1, "CurvatureRound: top_k must be 1 (lockstep power iteration has no deflation)");
  const bool tokens = images.dim() == 2 && labels.sizes() == images.sizes();
  TORCH_CHECK((images.dim() == 4 && labels.dim() == 1) || (tokens && s.fisher()),
              "CurvatureRound: images must be (N, C, H, W) and labels (N), or for the Fisher tokens and targets (N, "
              "T), got ", images.sizes(), " and ", labels.sizes());
  TORCH_CHECK(labels.size(0) == images.size(0) && images.size(0) >= 1, "CurvatureRound: ", images.size(0),
              " inputs and ", labels.size(0), " labels");
  const int64_t n = std::min(s.options.batch, images.size(0));
  s.x = images.narrow(0, 0, n).clone();
  s.y = labels.narrow(0, 0, n).to(at::kLong).clone();
  int64_t total = 0;
  for (const Unit& unit : model.units()) {
    std::vector<at::Tensor> ps;
    int64_t count = 0;
    for (const auto& p : unit.parameters()) {
      if (!p.requires_grad()) continue;
      ps.push_back(p);
      s.all_params.push_back(p);
      count += p.numel();
    }
    s.offset.push_back(total);
    s.numel.push_back(count);
    total += count;
    s.params.push_back(std::move(ps));
  }
  TORCH_CHECK(!s.all_params.empty(), "CurvatureRound: the model has no parameters to probe");
  const at::TensorOptions flat = s.all_params.front().options().requires_grad(false);
  // v on the host for a GPU model (pinned: its copies are recorded in the captured pass).
  s.v = at::zeros({total}, flat.device(at::kCPU).pinned_memory(flat.device().is_cuda()));
  int64_t probed_units = 0;
  for (int64_t c : s.numel) probed_units += c > 0 ? 1 : 0;
  s.stats = at::zeros({2 * probed_units}, flat);
  s.active = at::zeros({static_cast<int64_t>(s.numel.size())}, flat.dtype(at::kBool));
  if (s.fisher()) {
    s.label_u = StartVectors(s.options.seed + kLabelSeedOffset, flat).uniform(s.y.numel()).view(s.y.sizes());
  }
}

CurvatureRound::~CurvatureRound() = default;

void CurvatureRound::share_pool(StepGraph* step_graph) {
  s_->host = step_graph;
  s_->side = 0;
}

bool CurvatureRound::graphed() const { return s_->has_graph(); }
int64_t CurvatureRound::graph_bytes() const { return s_->graph_bytes; }
const CurvatureRound::Timing& CurvatureRound::timing() const { return s_->timing; }
const at::Tensor& CurvatureRound::labels() const { return s_->y; }
int64_t CurvatureRound::chunk() const { return s_->chunk(); }

namespace {

// One lockstep pass's readings (per unit with parameters, in order: the Rayleigh quotient and ‖H·v‖) applied to the
// units still iterating: λ takes the quotient; a unit is done when ‖H·v‖ is 0 or not finite (converged if λ is
// finite), or, after the first pass, when λ moved less than `tol` relative.
void pass_readings_apply(const double* h, const std::vector<int64_t>& numel, bool first_pass, double tol,
                         std::vector<double>& lambda, std::vector<int>& iterations, std::vector<bool>& done,
                         std::vector<bool>& converged) {
  for (size_t u = 0; u < numel.size(); ++u) {
    if (numel[u] == 0) continue;
    const double quotient = *h++;
    const double w_norm = *h++;
    if (done[u]) continue;
    const double previous = lambda[u];
    lambda[u] = quotient;
    ++iterations[u];
    if (w_norm == 0.0 || !std::isfinite(w_norm)) {
      done[u] = true;
      converged[u] = std::isfinite(lambda[u]);
      continue;
    }
    if (!first_pass && std::abs(lambda[u] - previous) <= tol * std::abs(lambda[u])) {
      done[u] = true;
      converged[u] = true;
    }
  }
}

}  // namespace

std::vector<UnitCurvature> CurvatureRound::run(double* wall_seconds) {
  TRIACCEL_PROFILE_RANGE("triaccel::curvature_round");
  State& s = *s_;
  const Clock& clock = s.options.clock ? *s.options.clock : steady_clock();
  const double start = clock.now_s();
  const c10::Device device = s.x.device();
  const auto& units = s.model.units();
  const size_t n_units = units.size();
  std::vector<double> lambda(n_units, 0.0);
  std::vector<int> iterations(n_units, 0);
  std::vector<bool> done(n_units, false), converged(n_units, false);
  for (size_t u = 0; u < n_units; ++u) done[u] = converged[u] = s.numel[u] == 0;
  {
    ModelStateGuard state(s.model, device, s.options.precision, s.options.cudnn);
    at::AutoGradMode grad_mode(true);
    s.model.train(!s.fisher());
#ifdef TRIACCEL_WITH_CUDA
    if (s.has_graph() && s.storage != s.storage_now()) {  // a parameter has new storage: the graph reads the old one
      s.graph.reset();
      s.side = 0;
      s.captures_tried = 0;
      s.graph_bytes = 0;
    }
#endif
    s.timing = Timing{};
    const bool cold = !s.started;
    if (!s.started) {  // unit u starts from a seeded random vector, as curvature_probe's unit u does
      at::NoGradGuard no_grad;
      for (size_t u = 0; u < n_units; ++u) {
        if (s.numel[u] == 0) continue;
        const at::Tensor start_v = StartVectors(s.options.seed + u, s.stats.options()).next(s.numel[u]);
        s.slice(s.v, u).copy_(start_v / start_v.norm());
      }
      s.started = true;
    }
    double replay_total = 0;
    int replays = 0;
    const int passes = std::min(s.options.max_iters, cold ? kColdRoundPasses : s.options.warm_round_passes());
    for (int it = 0; it < passes; ++it) {
      if (std::all_of(done.begin(), done.end(), [](bool d) { return d; })) break;
      {
        std::vector<uint8_t> active(n_units);
        for (size_t u = 0; u < n_units; ++u) active[u] = done[u] ? 0 : 1;
        const at::NoGradGuard no_grad;
        s.active.copy_(at::tensor(at::ArrayRef<uint8_t>(active)).to(at::kBool));
      }
      const double t0 = clock.now_s();
      const bool replayed = s.run_pass(clock);
      ++s.timing.passes;
      // Per unit with parameters: the Rayleigh quotient and ‖H·v‖ (the pass moved the active units' v), in one read.
      const at::Tensor host = s.stats.to(at::kDouble).cpu();
      const double pass_s = clock.now_s() - t0;
      s.timing.passes_s += pass_s;
      if (replayed) {
        replay_total += pass_s;
        ++replays;
        if (s.timing.fastest_replay_s < 0 || pass_s < s.timing.fastest_replay_s) s.timing.fastest_replay_s = pass_s;
      }
      pass_readings_apply(host.data_ptr<double>(), s.numel, it == 0, s.options.tol, lambda, iterations, done,
                          converged);
    }
    if (replays > 0) s.timing.replay_s = replay_total / replays;
    state.restore();
  }
  device_synchronize(device);
  const double round_s = clock.now_s() - start;
  int total_products = 0;
  for (int i : iterations) total_products += i;
  std::vector<UnitCurvature> result;
  for (size_t u = 0; u < n_units; ++u) {
    UnitCurvature entry;
    entry.unit = units[u].name;
    entry.converged = converged[u];
    entry.iterations = iterations[u];
    entry.graphed = s.has_graph();
    if (s.numel[u] > 0) {
      entry.eigenvalues = {lambda[u]};
      entry.lambda_max = lambda[u];
      entry.seconds = total_products > 0 ? round_s * iterations[u] / total_products : 0.0;
    }
    result.push_back(std::move(entry));
  }
  if (wall_seconds != nullptr) *wall_seconds = round_s;
  return result;
}

}  // namespace triaccel
