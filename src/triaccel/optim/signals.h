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

#include <array>
#include <cstdint>
#include <vector>

namespace triaccel {

// Elements of the moments' decoded float64 copies a chunk of moment_sums holds at once: its temporaries are
// about kSignalChunkBytesPerElement bytes an element (a dozen float64 copies and the 8-bit round trip), so a plan
// costs a few MB beside the state whatever the largest tensor (run/memory_setup.h: optimizer_priced prices it).
constexpr int64_t kSignalChunkElements = int64_t{1} << 15;  // a multiple of kQuantBlock
constexpr int64_t kSignalChunkBytesPerElement = 192;

// The sums over one tensor's exact AdamW moments (float32 m and v of the parameter's shape, any strides; bias
// corrections bc1, bc2) that UnitSignals' moment terms come from: ‖u‖² of the update direction u = m̂ / (√v̂ + ε) and
// ‖u − u'‖² for u' from the scalar preconditioner, bf16 moments, 8-bit moments (the block-wise codec over the logical
// element order) and v̂'s rank-1 factorization; ‖m̂‖², the noise Σ max(v̂ − m̂², 0), Σ log v̂, Σ log² v̂ and the count.
// Computed chunk_elements at a time (a multiple of kQuantBlock): the chunking changes nothing but the order of the
// float64 sums.
struct MomentSums {
  double u_sq = 0, du_scalar = 0, du_bf16 = 0, du_8bit = 0, du_factor = 0;
  double mh_sq = 0, noise = 0, logv = 0, logv_sq = 0, elems = 0;
  // Every sum, in one order (adding two tensors' sums, or a unit's over the ranks, goes through it).
  std::array<double*, 10> fields() {
    return {&u_sq, &du_scalar, &du_bf16, &du_8bit, &du_factor, &mh_sq, &noise, &logv, &logv_sq, &elems};
  }
  MomentSums& operator+=(MomentSums other) {
    const auto mine = fields(), theirs = other.fields();
    for (size_t k = 0; k < mine.size(); ++k) *mine[k] += *theirs[k];
    return *this;
  }
};
MomentSums moment_sums(const at::Tensor& m32, const at::Tensor& v32, const at::Tensor& map_signed,
                       const at::Tensor& map_unsigned, double bc1, double bc2, double eps,
                       int64_t chunk_elements = kSignalChunkElements);

// unit_of_tensor[i]: the unit of optimizer tensor i. previous: the last signals per unit (empty: none).
// chunk_elements: moment_sums'.
std::vector<UnitSignals> baoc_signals(const BaocOptimizer& optimizer, const at::Tensor& stream_sums,
                                      const std::vector<int64_t>& unit_of_tensor, int64_t num_units,
                                      const std::vector<UnitSignals>& previous = {},
                                      int64_t chunk_elements = kSignalChunkElements);

}  // namespace triaccel
