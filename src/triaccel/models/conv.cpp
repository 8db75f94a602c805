// Convolutions whose cuDNN kernels need help under heuristics; see conv.h.
#include "triaccel/models/conv.h"

#include <ATen/Context.h>
#include <ATen/ops/conv2d.h>

#include <variant>

namespace triaccel {

bool depthwise_nchw_wins(int64_t channels, int64_t groups, int64_t kernel, int64_t height, int64_t width,
                         bool cuda_channels_last, bool cudnn_autotune) {
  const bool depthwise = groups > 1 && groups == channels;
  return depthwise && cuda_channels_last && !cudnn_autotune && kernel > 3 && height * width <= 4 &&
         height * width > 1;  // at 1x1 both layouts are the same memory
}

at::Tensor conv2d_forward(torch::nn::Conv2dImpl& conv, const at::Tensor& x) {
  const auto& o = conv.options;
  const auto* padding = std::get_if<torch::ExpandingArray<2>>(&o.padding());
  const bool cl = x.is_cuda() && x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast);
  if (!padding || !std::holds_alternative<torch::enumtype::kZeros>(o.padding_mode()) || x.dim() != 4 ||
      !depthwise_nchw_wins(x.size(1), o.groups(), (*o.kernel_size())[0], x.size(2), x.size(3), cl,
                           at::globalContext().benchmarkCuDNN())) {
    return conv.forward(x);
  }
  // The weight (C, 1, k, k) has the same memory in both layouts, but its channels_last strides make cuDNN choose
  // channels_last again: a contiguous copy (C·k² values) does not.
  const at::Tensor weight = conv.weight.clone(at::MemoryFormat::Contiguous);
  const at::Tensor y =
      at::conv2d(x.contiguous(), weight, conv.bias, *o.stride(), **padding, *o.dilation(), o.groups());
  return y.contiguous(at::MemoryFormat::ChannelsLast);
}

}  // namespace triaccel
