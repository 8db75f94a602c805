// Multi-tensor apply shared by the fused optimizer kernels (sgd_step, adam_step, adam8_step, factored_step): one
// launch updates a pack of tensors. Each tensor is cut into CUDA blocks; the pack holds, per tensor, the kernel's
// Record (its pointers and scalars) and a prefix sum of blocks, and each block finds its tensor by a linear scan of
// that prefix sum (packs are short, so the scan beats the divergence of anything smarter).
//
// Invariants:
//  - A TensorPack is a kernel parameter passed by value as `const __grid_constant__`: a launch carries every
//    pointer and scalar it reads, so a captured CUDA graph replays with the same pointers. The caller keeps the
//    tensors at fixed addresses for as long as the graph may replay.
//  - One byte budget, kTensorPackBytes, decides how many tensors a launch takes: TensorPack::kMax follows from the
//    Record's size and the number of phases, so a pack and a kernel's few other parameters stay within the classic
//    4 KiB kernel-parameter limit.
//  - A pack can serve several launches over the same tensors with different block counts ("phases", e.g. one block
//    per row, then one per chunk of elements): phase p's launch has block_start[p][count] blocks, and its blocks
//    find their tensor in block_start[p].
//  - Every prefix sum in a pack stays ≤ the packer's block limit (< 2^31), so block indices fit an int.
#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace triaccel {

constexpr size_t kTensorPackBytes = 4000;  // sizeof(TensorPack) ≤ this, whatever the Record

// The argument of one multi-tensor launch: `count` tensors, their records, and per phase the prefix sum of blocks
// (block_start[p][0] = 0; tensor t owns blocks [block_start[p][t], block_start[p][t + 1]) of phase p's launch).
template <typename Record, int kPhases>
struct TensorPack {
  static_assert(kPhases >= 1, "a pack has at least one phase");
  static_assert(std::is_trivially_copyable<Record>::value, "a Record travels in the kernel parameters");
  // Room for the int count, the kPhases extra prefix-sum entries and padding before and after the records; what
  // is left is shared out at one Record and kPhases ints per tensor (sizeof(TensorPack) ≤ kTensorPackBytes is
  // checked by TensorPacker).
  static constexpr int kMax = static_cast<int>(
      (kTensorPackBytes - (kPhases + 1) * sizeof(int) - 2 * (alignof(Record) - 1)) /
      (sizeof(Record) + kPhases * sizeof(int)));
  static_assert(kMax >= 8, "Record too large for the TensorPack byte budget");

  int count;
  Record rec[kMax];
  int block_start[kPhases][kMax + 1];
};

// The tensor that owns this block, given one phase's prefix sum of `count` tensors.
__device__ __forceinline__ int tensor_pack_find(const int* block_start, int count) {
  int t = 0;
  while (t + 1 < count && block_start[t + 1] <= static_cast<int>(blockIdx.x)) ++t;
  return t;
}

// Fills TensorPacks on the host and hands each full one to `launch(const TensorPack&)`, which owns the <<<>>> and
// its C10_CUDA_KERNEL_LAUNCH_CHECK(). add() launches the pack first when the new tensor would not fit (kMax
// tensors, or a prefix sum past block_limit); finish() launches the last, partial pack. The launch callback may
// be handed a pack whose phases have 0 blocks (all of its tensors empty).
template <typename Record, int kPhases, typename Launch>
class TensorPacker {
 public:
  using Pack = TensorPack<Record, kPhases>;
  static_assert(sizeof(Pack) <= kTensorPackBytes, "TensorPack is larger than its byte budget");

  // op names the caller in errors; no tensor may have block_limit or more blocks in any phase.
  TensorPacker(const char* op, int block_limit, Launch launch)
      : op_(op), block_limit_(block_limit), launch_(std::move(launch)) {
    TORCH_CHECK(block_limit > 0, op, ": block limit must be > 0, got ", block_limit);
  }

  // blocks[p]: the tensor's number of blocks in phase p.
  void add(const Record& rec, const int64_t (&blocks)[kPhases]) {
    for (int p = 0; p < kPhases; ++p) {
      TORCH_CHECK(blocks[p] >= 0 && blocks[p] < block_limit_, op_, ": tensor too large (", blocks[p],
                  " blocks in phase ", p, ", limit ", block_limit_, ")");
    }
    bool fits = pack_.count < Pack::kMax;
    for (int p = 0; fits && p < kPhases; ++p) fits = pack_.block_start[p][pack_.count] + blocks[p] <= block_limit_;
    if (!fits) flush();
    const int k = pack_.count;
    pack_.rec[k] = rec;
    for (int p = 0; p < kPhases; ++p) {
      pack_.block_start[p][k + 1] = pack_.block_start[p][k] + static_cast<int>(blocks[p]);
    }
    pack_.count = k + 1;
  }

  void finish() {
    if (pack_.count > 0) flush();
  }

 private:
  void flush() {
    launch_(static_cast<const Pack&>(pack_));
    pack_.count = 0;
    for (int p = 0; p < kPhases; ++p) pack_.block_start[p][0] = 0;
  }

  const char* op_;
  int64_t block_limit_;
  Launch launch_;
  Pack pack_{};
};

// make_tensor_packer<Record, kPhases>(op, block_limit, launch): a TensorPacker with the callback's type deduced.
template <typename Record, int kPhases, typename Launch>
TensorPacker<Record, kPhases, Launch> make_tensor_packer(const char* op, int block_limit, Launch launch) {
  return TensorPacker<Record, kPhases, Launch>(op, block_limit, std::move(launch));
}

}  // namespace triaccel
