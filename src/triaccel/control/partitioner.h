// NeuroFlux partitioner: splits a model's units into consecutive blocks and gives each block its batch size and
// aux-head level, so that every block, trained with its heads, fits the memory budget, and the predicted training
// time is smallest. A pure function of a MemoryProfile and options: testable on the CPU with made-up profiles.
//
// Memory of block [s, e) at batch B, heads at level L (one level per block):
//   base + Σ_u 3·4·(params_u + head_params_u(L)) + Σ_u (train_u + head_u(L)).fixed
//        + B · ( Σ_u (train_u + head_u(L)).per_sample + in_bytes_s · 1.5 + out_bytes_{e-1} · 0.5 )
// (every unit of a block runs forward with a detached input, the local losses are summed and one backward frees
// all graphs; the input batch is held in fp32 and its bf16 staging copy, the block's output in bf16 for the cache).
// The batch is the largest that fits, capped at max_batch and rounded down to a multiple of 8 from 16 up.
// The head level per block: the most filters whose batch reaches target_batch, else the smallest head (no conv).
// Predicted time (seconds): per epoch Σ_u N · w_u · (1 + sat_batch / B) with w_u = per-sample work, modelled as the
// unit's per-sample bytes / bytes_per_s (heads are left out: counting them would reward merging blocks only to get
// smaller heads, trading local accuracy for a little time); plus, for every block after the first, one forward pass of
// the previous block to write the cache (N · w / 3) and, when the cache lives on the host, its transfer every epoch.
// The partition is exact: dynamic programming over the split points (O(U²·levels)).
#pragma once

#include "triaccel/control/memory_profile.h"

#include <cstdint>
#include <string>
#include <vector>

namespace triaccel {

struct PartitionOptions {
  double budget_bytes = 0;      // the memory budget (> 0)
  double base_bytes = 0;        // always allocated (the resident dataset, the label tensor)
  double safety = 0.9;          // plan against safety × budget: allocator fragmentation, cuDNN workspaces
  int64_t samples = 0;          // training samples per epoch (N)
  int64_t epochs = 1;
  int64_t max_batch = 512;
  int64_t min_batch = 2;        // BatchNorm in train mode needs two samples
  int64_t target_batch = 128;   // heads keep their widest level while the block still reaches this batch
  // Time model (not measured; defaults guessed for an H100: ResNet-18 trains ~12k CIFAR images/s in bf16 at large
  // batch on ~4 MB of per-sample activations, so ~5e10 effective bytes/s).
  double bytes_per_s = 5e10;    // per-sample training bytes processed per second
  double sat_batch = 128;       // batch at which the device is half as fast per sample as at infinity
  double host_bytes_per_s = 1e10;  // host cache: gather + pinned copy rate; 0 = no transfer cost (CPU)

  void validate() const;
};

struct BlockPlan {
  int64_t first = 0;           // first unit (index)
  int64_t end = 0;             // one past the last unit
  int64_t batch = 0;
  int64_t head_level = 0;      // aux_head.h ladder level
  double bytes = 0;            // predicted peak at `batch`
  double time_s = 0;           // predicted training time (all epochs) incl. its cache pass
};

struct Partition {
  std::vector<BlockPlan> blocks;
  double time_s = 0;           // predicted total
};

// The best plan for one block [first, end), or batch = 0 when it does not fit at min_batch.
BlockPlan block_plan(const MemoryProfile& profile, const PartitionOptions& options, int64_t first, int64_t end);

// The exact best partition. Throws UserError when no partition fits, naming the minimum budget that would.
Partition partition_plan(const MemoryProfile& profile, const PartitionOptions& options);

// The smallest budget (bytes, before the safety factor is applied) under which some partition fits.
double partition_min_budget(const MemoryProfile& profile, const PartitionOptions& options);

}  // namespace triaccel
