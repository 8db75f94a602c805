// Training-mode BatchNorm2d for CUDA on bf16 or fp16 channels_last activations with float32 parameters, optionally
// fused with the ReLU that follows it. PyTorch 2.11 runs the bf16 case (bf16 input, fp32 weight) with ATen's native
// channels-last kernels, since cuDNN's BN refuses mixed dtypes; these kernels are the faster replacement
// (docs/foundation.md, "BatchNorm kernel"). fp16 takes the same kernels (Tri-Accel's fp16 units, AMP fp16), so the
// two 16-bit formats keep the same saved tensors and the same memory. The spec is ATen's batch_norm in float64 on
// the same 16-bit values (tests/test_batch_norm.cpp).
//
// Invariants: per-channel statistics are reduced in float32 in two stages (per-block partials into a scratch
// tensor, then a fixed-order combine), with no atomics, so results are bit-identical run to run on one device;
// no host synchronization and no data-dependent host decision, so both calls can be captured in a CUDA graph.
#pragma once

#include <ATen/Tensor.h>

#include <tuple>

namespace triaccel {

// Rows of the (4, C) float32 statistics tensor the forward returns and the backward consumes.
enum BatchNormStatsRow : int64_t {
  kBatchNormMean = 0,    // batch mean over N·H·W
  kBatchNormInvstd = 1,  // 1 / sqrt(biased variance + eps)
  kBatchNormScale = 2,   // weight · invstd
  kBatchNormShift = 3,   // bias − mean · scale   (so y = x · scale + shift, computed as one fmaf)
};

// x: (N, C, H, W) bfloat16 or float16, CUDA, channels_last-contiguous, N·H·W ≥ 2. weight, bias, running_mean,
// running_var: (C) float32, contiguous, on x's device. running_mean / running_var are updated in place as
// torch.nn.BatchNorm2d does in training: r ← (1 − momentum)·r + momentum·s, with the unbiased variance for
// running_var. Returns (y, stats): y = x̂·weight + bias (then max(·, 0) when relu), (N, C, H, W) channels_last in
// x's dtype; stats (4, C) float32 as above. Runs on the current stream of x's device.
std::tuple<at::Tensor, at::Tensor> batch_norm_forward_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                           const at::Tensor& bias, const at::Tensor& running_mean,
                                                           const at::Tensor& running_var, double momentum,
                                                           double eps, bool relu);

// dy: (N, C, H, W) CUDA in x's dtype (any layout; made channels_last-contiguous here); x, weight and stats as given
// to and returned by batch_norm_forward_cuda, relu as there (the ReLU mask y > 0 is recomputed from x and stats
// exactly as the forward computed y). Returns (dx channels_last in x's dtype, dweight (C) float32, dbias (C)
// float32).
std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_backward_cuda(const at::Tensor& dy, const at::Tensor& x,
                                                                        const at::Tensor& weight,
                                                                        const at::Tensor& stats, bool relu);

// A residual block's end in one pass: y = max(x̂·weight + bias + residual, 0), rounded once to x's dtype (PyTorch's
// bn → add → relu rounds after each). residual: x's shape, dtype and device, channels_last-contiguous. The rest as
// batch_norm_forward_cuda (stats, running statistics).
std::tuple<at::Tensor, at::Tensor> batch_norm_add_relu_forward_cuda(const at::Tensor& x, const at::Tensor& residual,
                                                                    const at::Tensor& weight, const at::Tensor& bias,
                                                                    const at::Tensor& running_mean,
                                                                    const at::Tensor& running_var, double momentum,
                                                                    double eps);

// Its backward, with y as that forward returned it (the mask is y > 0; y is the block's output, which the next layer
// keeps anyway, so the residual need not be saved). Returns (dx, dweight, dbias, dresidual): dresidual = dy masked
// by y > 0, also the gradient the normalization's backward consumes.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_add_relu_backward_cuda(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
    const at::Tensor& stats);

// How the kernels lay out their work; a benchmark's knob (bench/bench_batch_norm.cpp sweeps it against the rules in
// one run), process-wide, set before the calls it is for (a captured CUDA graph keeps the launches it recorded).
// A field left 0 follows its rule.
struct BatchNormLaunch {
  int rows_in_flight = 0;  // rows a backward thread loads before using any, 2 or 4; rule: 4, 2 under a ReLU mask
  int blocks_per_sm = 0;   // the grid's blocks per SM; rule: the fewest the call's kernels hold at once (occupancy)
};
void batch_norm_launch_set(const BatchNormLaunch& launch);

}  // namespace triaccel
