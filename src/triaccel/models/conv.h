// Convolutions whose cuDNN kernels need help under heuristics (no autotuning).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/conv.h>

#include <cstdint>

namespace triaccel {

// Whether a depthwise convolution (groups == channels > 1) should run on NCHW copies of a channels_last CUDA input:
// under cuDNN's heuristics (`cudnn_autotune` false), on maps of at most 2x2 pixels with a kernel over 3, where the
// heuristics pick channels_last kernels an order of magnitude slower than NCHW's; at k3 on 2x2 and on 4x4 maps
// channels_last is as fast or faster, and autotuned it is fast everywhere (dev/probe_depthwise.py; measured:
// docs/results/memory-planner.md).
bool depthwise_nchw_wins(int64_t channels, int64_t groups, int64_t kernel, int64_t height, int64_t width,
                         bool cuda_channels_last, bool cudnn_autotune);

// conv(x), a depthwise convolution on NCHW copies where depthwise_nchw_wins (its output back in channels_last, so the
// layers after it see what they saw before). Same values and gradients as conv(x).
at::Tensor conv2d_forward(torch::nn::Conv2dImpl& conv, const at::Tensor& x);

}  // namespace triaccel
