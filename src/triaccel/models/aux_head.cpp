// NeuroFlux auxiliary heads; see aux_head.h. Initialization as the models' (kaiming-normal convs, BN 1/0).
#include "triaccel/models/aux_head.h"

#include "triaccel/models/batch_norm.h"
#include "triaccel/models/model.h"

#include <torch/nn/functional/pooling.h>

#include <algorithm>

namespace triaccel {

int64_t aux_filters(int64_t channels, int64_t level) {
  TORCH_CHECK(level >= 0 && level < kAuxLevels, "aux head level must be in [0, ", kAuxLevels, "), got ", level);
  if (level == kAuxLevels - 1) return 0;
  return std::max(kAuxMinFilters, channels >> level);
}

AuxHeadImpl::AuxHeadImpl(const std::vector<int64_t>& unit_out_shape, int64_t filters, int64_t num_classes) {
  TORCH_CHECK(unit_out_shape.size() == 3 || unit_out_shape.size() == 1,
              "aux head expects a (C, H, W) or (F) unit output, got ", unit_out_shape.size(), " dims");
  flat_input_ = unit_out_shape.size() == 1;
  filters_ = flat_input_ ? 0 : filters;
  int64_t features = 0;
  if (flat_input_) {
    features = unit_out_shape[0];
  } else {
    const int64_t channels = unit_out_shape[0];
    if (filters_ > 0) {
      conv_ = register_module(
          "conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, filters_, 3).padding(1).bias(false)));
      bn_ = register_module("bn", torch::nn::BatchNorm2d(filters_));
    }
    features = (filters_ > 0 ? filters_ : channels) * kAuxPool * kAuxPool;
  }
  fc_ = register_module("fc", torch::nn::Linear(features, num_classes));
  model_init_conv_bn(*this);
}

at::Tensor AuxHeadImpl::forward(const at::Tensor& x) {
  if (flat_input_) return fc_(x);
  at::Tensor h = x;                                  // (N, C, H, W)
  if (filters_ > 0) h = batch_norm_forward(bn_, conv_(h), /*relu=*/true);  // (N, k, H, W)
  h = torch::adaptive_avg_pool2d(h, {kAuxPool, kAuxPool}).flatten(1);  // (N, k·4)
  return fc_(h);
}

int64_t AuxHeadImpl::parameter_count() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

}  // namespace triaccel
