// BAOC statistics: per-unit UnitSignals (optim/risk.h) from a BaocOptimizer's state and the gradient-stream sums of
// a statistics window (BaocOptimizer::stream_stats_take). Directional stability comes from the stream; SNR,
// anisotropy, factorization and quantization errors from the moments, and only from tensors whose state is
// currently exact (kAdamW32): a unit already in a lossy or momentum-free format keeps the values `previous` holds
// for those signals (its last exact measurement). Synchronizes with the device (runs at plan time only). Sharded state:
// each rank adds the moments it owns and the sums are added over the ranks (a collective: every rank calls it).
#pragma once

#include "triaccel/optim/baoc_optimizer.h"
#include "triaccel/optim/risk.h"

#include <ATen/Tensor.h>

#include <cstdint>
#include <vector>

namespace triaccel {

// unit_of_tensor[i]: the unit of optimizer tensor i. previous: the last signals per unit (empty: none).
std::vector<UnitSignals> baoc_signals(const BaocOptimizer& optimizer, const at::Tensor& stream_sums,
                                      const std::vector<int64_t>& unit_of_tensor, int64_t num_units,
                                      const std::vector<UnitSignals>& previous = {});

}  // namespace triaccel
