// Hessian-vector products by double backward and power iteration with deflation (see hvp.h).
// H·v is the vector-Jacobian product of the first-order gradients g = ∂loss/∂θ with v, i.e. one backward of
// Σ_i g_i·v_i through the graph that create_graph kept; both backwards retain the loss's graph.
#include "triaccel/control/curvature/hvp.h"

#include "triaccel/core/cuda_graph.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#ifdef TRIACCEL_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

namespace triaccel {

namespace {

// Replaces undefined gradients (parameters the graph does not reach) by zeros shaped like the parameter.
std::vector<at::Tensor> zeros_filled(std::vector<at::Tensor> grads, const std::vector<at::Tensor>& params) {
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) grads[i] = at::zeros_like(params[i], at::MemoryFormat::Contiguous);
  }
  return grads;
}

// Projects out of w (n) its components along each unit vector in basis (each (n)): classical Gram–Schmidt.
at::Tensor orthogonalized(at::Tensor w, const std::vector<at::Tensor>& basis) {
  for (const auto& u : basis) w = w - at::dot(u, w) * u;
  return w;
}

}  // namespace

HvpOperator::HvpOperator(const at::Tensor& loss, std::vector<at::Tensor> params) : params_(std::move(params)) {
  TORCH_CHECK(loss.defined() && loss.numel() == 1, "HvpOperator needs a scalar loss, got ",
              loss.defined() ? loss.sizes() : at::IntArrayRef{});
  TORCH_CHECK(loss.requires_grad(), "HvpOperator: the loss does not require grad (was it computed under no_grad?)");
  for (const auto& p : params_) {
    TORCH_CHECK(p.defined() && p.requires_grad(), "HvpOperator: every parameter must require grad");
    TORCH_CHECK(at::isFloatingType(p.scalar_type()), "HvpOperator: parameters must be floating point, got ",
                p.scalar_type());
    numel_ += p.numel();
  }
  if (params_.empty()) return;
  grads_ = torch::autograd::grad({loss}, params_, /*grad_outputs=*/{}, /*retain_graph=*/true,
                                 /*create_graph=*/true, /*allow_unused=*/true);
}

HvpOperator::HvpOperator(std::vector<at::Tensor> params, std::vector<at::Tensor> grads_with_graph)
    : params_(std::move(params)), grads_(std::move(grads_with_graph)) {
  TORCH_CHECK(params_.size() == grads_.size(), "HvpOperator: ", params_.size(), " parameters but ", grads_.size(),
              " gradients");
  for (const auto& p : params_) {
    TORCH_CHECK(p.defined() && p.requires_grad(), "HvpOperator: every parameter must require grad");
    numel_ += p.numel();
  }
}

std::vector<at::Tensor> HvpOperator::apply(const std::vector<at::Tensor>& v) const {
  TORCH_CHECK(v.size() == params_.size(), "HvpOperator::apply: expected ", params_.size(), " tensors, got ",
              v.size());
  // Only gradients that still depend on θ have a second derivative; the others contribute zero rows.
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> directions;
  for (size_t i = 0; i < params_.size(); ++i) {
    TORCH_CHECK(v[i].sizes() == params_[i].sizes(), "HvpOperator::apply: tensor ", i, " has shape ", v[i].sizes(),
                ", the parameter has ", params_[i].sizes());
    if (!grads_[i].defined() || !grads_[i].requires_grad()) continue;
    outputs.push_back(grads_[i]);
    directions.push_back(v[i].detach().to(grads_[i].options()));
  }
  if (outputs.empty()) return zeros_filled(std::vector<at::Tensor>(params_.size()), params_);
  // One backward of Σ_i g_i·v_i: grad_outputs = v is exactly that vector-Jacobian product.
  std::vector<at::Tensor> hv = torch::autograd::grad(outputs, params_, directions, /*retain_graph=*/true,
                                                     /*create_graph=*/false, /*allow_unused=*/true);
  return zeros_filled(std::move(hv), params_);
}

at::TensorOptions HvpOperator::flat_options() const {
  TORCH_CHECK(!params_.empty(), "HvpOperator has no parameters");
  return params_.front().options().requires_grad(false);
}

struct HvpOperator::Graph {
#ifdef TRIACCEL_WITH_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
  at::Tensor input;   // (n): the captured product reads v here
  at::Tensor output;  // (n): and writes H·v here (in the graph's pool)
};

at::Tensor HvpOperator::apply_flat(const at::Tensor& v) const {
  TORCH_CHECK(v.dim() == 1 && v.numel() == numel_, "HvpOperator::apply_flat: expected a vector of ", numel_,
              " elements, got shape ", v.sizes());
#ifdef TRIACCEL_WITH_CUDA
  if (graph_) {
    graph_->input.copy_(v);
    graph_->graph->replay();
    return graph_->output.clone();  // the next replay overwrites the output
  }
  at::Tensor hv = apply_flat_eager(v);
  const bool capturable = numel_ > 0 && v.is_cuda() && params_.front().is_cuda() &&
                          c10::cuda::getCurrentCUDAStream() != c10::cuda::getDefaultCUDAStream();
  if (graph_wanted_ && !graph_tried_ && capturable) {
    graph_tried_ = true;
    auto g = std::make_shared<Graph>();
    g->input = v.detach().clone();
    g->graph = cuda_graph_capture([&]() { g->output = apply_flat_eager(g->input); });
    if (g->graph) graph_ = std::move(g);
  }
  return hv;
#else
  return apply_flat_eager(v);
#endif
}

std::vector<at::Tensor> flat_pieces(const at::Tensor& flat, const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> pieces;
  pieces.reserve(params.size());
  int64_t offset = 0;
  for (const auto& p : params) {
    pieces.push_back(flat.narrow(0, offset, p.numel()).view(p.sizes()));
    offset += p.numel();
  }
  return pieces;
}

at::Tensor HvpOperator::apply_flat_eager(const at::Tensor& v) const {
  std::vector<at::Tensor> hv = apply(flat_pieces(v, params_));
  for (auto& t : hv) t = t.reshape({-1});
  return at::cat(hv);  // (n)
}

std::vector<at::Tensor> hessian_vector_product(const at::Tensor& loss, const std::vector<at::Tensor>& params,
                                               const std::vector<at::Tensor>& v) {
  return HvpOperator(loss, params).apply(v);
}

StartVectors::StartVectors(uint64_t seed, const at::TensorOptions& options) : options_(options) {
  // Drawing a large unit's millions of float64 values on the CPU can take longer than a warm probe's products for it
  // (measured: docs/results/tri-accel.md): on a GPU the draw stays there, in the parameters' dtype.
  if (options_.device().is_cuda()) {
    generator_ = at::detail::getCUDAHooks().getNewGenerator(options_.device().index());
    generator_.set_current_seed(seed);
  } else {
    generator_ = at::make_generator<at::CPUGeneratorImpl>(seed);
  }
}

at::Tensor StartVectors::next(int64_t n) {
  if (options_.device().is_cuda()) return at::randn({n}, generator_, options_);
  return at::randn({n}, generator_, at::TensorOptions().dtype(at::kDouble)).to(options_);
}

at::Tensor StartVectors::uniform(int64_t n) {
  if (options_.device().is_cuda()) return at::rand({n}, generator_, options_);
  return at::rand({n}, generator_, at::TensorOptions().dtype(at::kDouble)).to(options_);
}

EigenResult power_iteration_topk(const HvpOperator& op, int k, int max_iters, double tol, uint64_t seed,
                                 const std::vector<at::Tensor>& warm_start) {
  TORCH_CHECK(k >= 1, "power_iteration_topk: k must be >= 1, got ", k);
  TORCH_CHECK(max_iters >= 1, "power_iteration_topk: max_iters must be >= 1, got ", max_iters);
  TORCH_CHECK(tol >= 0 && std::isfinite(tol), "power_iteration_topk: tol must be >= 0, got ", tol);

  EigenResult result;
  result.converged = true;
  const int64_t n = op.numel();
  if (n == 0) return result;
  const int count = static_cast<int>(std::min<int64_t>(k, n));

  const at::TensorOptions options = op.flat_options();
  StartVectors starts(seed, options);
  std::vector<at::Tensor> eigenvectors;  // unit vectors (n), found so far
  std::vector<double> eigenvalues;

  for (int j = 0; j < count; ++j) {
    // A random start only where no warm start is given; a warm start never leaves the device.
    at::Tensor start;
    if (j < static_cast<int>(warm_start.size()) && warm_start[j].defined() && warm_start[j].numel() == n) {
      start = warm_start[j].detach().reshape({n}).to(options);
    } else {
      start = starts.next(n);
    }
    at::Tensor v = orthogonalized(start, eigenvectors);  // (n)
    v = v / v.norm();

    double lambda = 0.0;
    bool converged = false;
    for (int it = 0; it < max_iters; ++it) {
      // Deflation: H restricted to the complement of the eigenvectors found so far.
      const at::Tensor w = orthogonalized(op.apply_flat(v), eigenvectors);  // (n)
      ++result.iterations;
      const double previous = lambda;
      lambda = (at::dot(v, w) / at::dot(v, v)).item<double>();
      const double w_norm = w.norm().item<double>();
      if (w_norm == 0.0 || !std::isfinite(w_norm)) {
        converged = std::isfinite(lambda);
        break;
      }
      v = w / w_norm;
      if (it > 0 && std::abs(lambda - previous) <= tol * std::abs(lambda)) {
        converged = true;
        break;
      }
    }
    result.converged = result.converged && converged;
    eigenvalues.push_back(lambda);
    eigenvectors.push_back(v);  // unit length and orthogonal to the earlier ones by construction
  }

  std::vector<size_t> order(eigenvalues.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return std::abs(eigenvalues[a]) > std::abs(eigenvalues[b]); });
  for (size_t i : order) result.eigenvalues.push_back(eigenvalues[i]);
  result.eigenvectors = std::move(eigenvectors);
  return result;
}

}  // namespace triaccel
