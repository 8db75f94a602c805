// Hessian-vector products by double backward, and top-k Hessian eigenvalues by power iteration with deflation
// (Tri-Accel §3.2; docs/tri-accel.md).
//
// Invariants:
// - H is the block of the Hessian of `loss` for the given parameter group (∂²loss / ∂θ_i ∂θ_j over that group
//   only); H·v is returned as one tensor per parameter, each with that parameter's shape, dtype and device.
// - Parameters the loss does not depend on (or depends on only linearly) contribute zero rows: their HVP is zeros.
// - The loss's graph is retained, so any number of HVPs can be taken from one loss, and several HvpOperators
//   (e.g. one per unit) can share one forward pass. Nothing is accumulated into parameters' .grad.
// - power_iteration_topk is deterministic for a seed on a given device: start vectors come from a generator of their
//   own seeded with it (the CPU's in float64 for CPU tensors, the GPU's for CUDA tensors).
#pragma once

#include <ATen/Tensor.h>
#include <ATen/core/Generator.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace triaccel {

// H·v for the parameter group `params`, by double backward of `loss` (a scalar that requires grad).
// v: one tensor per parameter, same shapes. Recomputes the first-order gradients on every call; use HvpOperator
// to take many products from one loss.
std::vector<at::Tensor> hessian_vector_product(const at::Tensor& loss, const std::vector<at::Tensor>& params,
                                               const std::vector<at::Tensor>& v);

// Views of `flat` (a vector of Σ numel elements) shaped as each of `params`, in order: the layout of apply_flat.
std::vector<at::Tensor> flat_pieces(const at::Tensor& flat, const std::vector<at::Tensor>& params);

// H for one parameter group as a linear operator: the first-order gradients g = ∂loss/∂θ are computed once
// (with create_graph), then each apply(v) is one backward of Σ_i g_i·v_i.
class HvpOperator {
 public:
  HvpOperator(const at::Tensor& loss, std::vector<at::Tensor> params);
  // From first-order gradients already computed with create_graph (grads[i] of params[i]; undefined = unused), so
  // several operators (one per unit) share one first-order backward pass.
  HvpOperator(std::vector<at::Tensor> params, std::vector<at::Tensor> grads_with_graph);

  // v: one tensor per parameter, same shapes → H·v, one tensor per parameter.
  std::vector<at::Tensor> apply(const std::vector<at::Tensor>& v) const;

  // The same product on flat vectors: v (n), in the parameters' dtype and device → H·v (n), where
  // n = numel() and the layout is the parameters' elements concatenated in order.
  at::Tensor apply_flat(const at::Tensor& v) const;

  // CUDA: after the first apply_flat (eager, which also makes cuBLAS/cuDNN set up their handles and workspaces), the
  // product is captured once in a CUDA graph on a fixed input vector, and every later apply_flat copies v in and
  // replays it: the same kernels on the same saved tensors, without autograd's per-node host work. That helps the
  // products near the output, small enough for the host work to dominate; deeper units' products are bound by GPU
  // work and take as long graphed or not (docs/results/tri-accel.md). Needs a non-default current stream (the
  // trainer's); where the capture is refused or fails the operator stays eager. The graph and its memory pool live
  // as long as the operator.
  void graph_after_first_product(bool enabled) { graph_wanted_ = enabled; }
  bool graphed() const { return graph_ != nullptr; }

  int64_t numel() const { return numel_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  at::TensorOptions flat_options() const;

 private:
  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> grads_;  // g_i with a graph to θ; undefined where g_i does not depend on the group
  int64_t numel_ = 0;
  at::Tensor apply_flat_eager(const at::Tensor& v) const;
  // A cache of the same computation, made on first use (hence mutable): the captured product, its fixed input and
  // output vectors.
  struct Graph;
  bool graph_wanted_ = false;
  mutable bool graph_tried_ = false;
  mutable std::shared_ptr<Graph> graph_;
};

// The power iteration's random start vectors for a seed: drawn one after another from a generator of their own,
// on the CPU in float64 (the reference) and cast to `options`, on a GPU there in `options`' dtype. Deterministic for
// a seed on a given device.
class StartVectors {
 public:
  StartVectors(uint64_t seed, const at::TensorOptions& options);
  at::Tensor next(int64_t n);  // (n), not normalized
  at::Tensor uniform(int64_t n);  // (n) in [0, 1) from the same generator (the Fisher round's label draws)

 private:
  at::TensorOptions options_;
  at::Generator generator_;
};

struct EigenResult {
  std::vector<double> eigenvalues;  // sorted by decreasing |λ|, signed
  int iterations = 0;               // Hessian-vector products taken, summed over all k eigenvalues
  bool converged = false;           // every eigenvalue met the tolerance within max_iters
  std::vector<at::Tensor> eigenvectors;  // unit vectors (n), in the order they were found (not sorted)
};

// Top-k eigenvalues of H by magnitude: power iteration on each eigenvalue in turn, the iterate orthogonalized
// (Gram–Schmidt) against the eigenvectors already found at every step, λ = vᵀHv / vᵀv (Rayleigh quotient),
// stopping when |λ_t − λ_{t−1}| ≤ tol·|λ_t| or after max_iters products. k is clamped to the group's size.
// warm_start: start vectors (n) from an earlier run (e.g. the previous probe's eigenvectors, which move slowly
// during training); the j-th search starts from warm_start[j] when given and of the right size, else from a seeded
// random vector.
EigenResult power_iteration_topk(const HvpOperator& op, int k, int max_iters, double tol, uint64_t seed,
                                 const std::vector<at::Tensor>& warm_start = {});

}  // namespace triaccel
