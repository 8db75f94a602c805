// NeuroFlux auxiliary heads (docs/neuroflux.md): the local classifier attached to one unit's output.
//   optional conv3x3 with k filters → BatchNorm → ReLU → adaptive average pool to 2×2 → flatten → linear.
// k = 0 drops the conv/BN/ReLU (pool → linear on the unit's own channels). k is chosen per block by the partitioner
// from a ladder that halves the unit's channel count (fewer filters when memory is tight). A unit whose output is
// already flat (N, F) gets a linear head whatever k is. Module names: "conv", "bn", "fc" (exported as "exit.*").
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace triaccel {

constexpr int64_t kAuxPool = 2;        // pooled spatial size (2×2)
constexpr int64_t kAuxLevels = 4;      // ladder levels: 0 = C filters, 1 = C/2, 2 = C/4, 3 = no conv
constexpr int64_t kAuxMinFilters = 8;  // a conv level never has fewer filters than this

// The filter count of ladder level `level` for a unit with `channels` output channels (0 = no conv).
int64_t aux_filters(int64_t channels, int64_t level);

class AuxHeadImpl : public torch::nn::Module {
 public:
  // unit_out_shape: one sample's output shape, (C, H, W) or (F).
  AuxHeadImpl(const std::vector<int64_t>& unit_out_shape, int64_t filters, int64_t num_classes);

  // (N, C, H, W) or (N, F) → (N, classes)
  at::Tensor forward(const at::Tensor& x);
  int64_t filters() const { return filters_; }
  int64_t parameter_count() const;

 private:
  int64_t filters_ = 0;
  bool flat_input_ = false;
  torch::nn::Conv2d conv_{nullptr};
  torch::nn::BatchNorm2d bn_{nullptr};
  torch::nn::Linear fc_{nullptr};
};
TORCH_MODULE(AuxHead);

}  // namespace triaccel
