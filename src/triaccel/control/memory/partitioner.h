// NeuroFlux partitioner: splits a model's units into consecutive blocks and gives each block its batch size and
// aux-head level, so that every block, trained with its heads, fits the memory budget, and the predicted training
// time is smallest. A pure function of a MemoryProfile and options: testable on the CPU with made-up profiles.
//
// Memory of block [s, e) at batch B, heads at level L (one level per block):
//   base + Σ_{u∉[s,e)} 4·(params_u + max_L head_params_u(L))
//        + Σ_{u∈[s,e)} 3·4·(params_u + head_params_u(L)) + Σ_u (train_u + head_u(L)).fixed
//        + B · ( Σ_u (train_u + head_u(L)).per_sample + in_bytes_s · 2.5 + out_bytes_{e-1} · 0.5 )
// (every unit and head stays on the device while any block trains, so the other units' weights and their heads —
// at their widest level, not yet chosen — are held too; every unit of a block runs forward with a detached input,
// the local losses are summed and one backward frees all graphs; the input batch is held in fp32, in the CUDA
// graph's static input and as its bf16 staging rows, the block's output in bf16 for the cache).
// The batch is the largest that fits, capped at max_batch and rounded down to a multiple of 8 from 16 up.
// The head level per block: the most filters whose batch reaches target_batch, else the smallest head (no conv).
// Predicted time (seconds): per epoch Σ_u N · w_u · (1 + sat_batch / B) with w_u = per-sample work, modelled as the
// unit's per-sample bytes / bytes_per_s (heads are left out: counting them would reward merging blocks only to get
// smaller heads, trading local accuracy for a little time); plus, for every block after the first, one forward pass of
// the previous block to write the cache (N · w / 3) and, when the cache lives on the host, its transfer every epoch.
// The partition is exact: dynamic programming over the split points (O(U²·levels)).
#pragma once

#include "triaccel/control/memory/memory_profile.h"

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
  // Time model (not measured; defaults guessed for a Hopper GPU: ResNet-18 trains ~12k CIFAR images/s in bf16 at
  // large batch on ~4 MB of per-sample activations, so ~5e10 effective bytes/s).
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
  double epoch_s = 0;          // predicted seconds per epoch on the memory planner's basis (partition_epoch_s)
};

struct Partition {
  std::vector<BlockPlan> blocks;
  double time_s = 0;           // predicted total
  double epoch_s = 0;          // predicted seconds per epoch on the memory planner's basis (partition_epoch_s)
};

// A NeuroFlux epoch priced on the basis the memory planner prices a backprop epoch on (memory_planner.h), so that
// method auto can compare the two: FLOPs at one rate, and a per-step overhead of `overhead_samples` samples of the
// step's own work (launches, an under-filled device: what makes small batches slow), as the planner's overhead_s is
// of a whole-network sample.
struct PartitionEpochInputs {
  int64_t train_samples = 0;    // rows each block trains on per epoch (the training split less the held-out rows)
  int64_t holdout_samples = 0;  // rows every cache pass scores
  int64_t test_samples = 0;
  int64_t epochs = 1;           // each block trains this many epochs; its cache pass runs once
  double flops_per_s = 0;       // the planner's kGpuTrainFlopsPerS
  double overhead_samples = 0;  // the planner's kGpuOverheadSamples
  double host_bytes_per_s = 0;  // > 0: the caches live in host memory and cross at this rate; 0: on the device
};

// Seconds per epoch of each block (BlockPlan::epoch_s) and of the partition (Partition::epoch_s). Block [s, e) at
// batch B with heads at its level, w = Σ_u (F_u + H_u) the forward FLOPs of a sample through its units and heads
// (F_u = 2 · params_u · output positions, as the planner's UnitCost::flops; H_u: the head's conv3x3 at the unit's
// output positions and its linear layer on the 2×2 pool):
//   train  = ceil(N / B) · (B + overhead) · 3 · w / rate            every step at B (epoch_fill), forward + backward
//   pass   = ceil(P / B) · (B + overhead) · w / rate / epochs       the cache pass, once per block: a forward over the
//            held-out, test and (all but the last block) training rows P, shared over the epochs
//   cache  = (N · in_b + P · out_b / epochs) / host rate            host caches: the block's input read each epoch, its
//            output written once (bf16: half the fp32 bytes in_b, out_b of one sample; none for the first input)
// The split points stay those of partition_plan (its own time model chooses them); this prices what it chose.
void partition_epoch_s(const MemoryProfile& profile, const PartitionEpochInputs& inputs, Partition* partition);

// What NeuroFlux keeps of the data (methods/neuroflux.cpp): its held-out rows come out of the training split
// (holdout_asked, at most a tenth of it); under a vram_budget on a GPU the images stream from host memory when they
// would take more than kNeuroFluxHostDataShare of it; the resident bytes are the images (uint8) and 16 bytes a row
// (labels and order), or, streamed, the 16 bytes a row and two uint8 staging batches of max_batch rows.
constexpr double kNeuroFluxHostDataShare = 0.25;
struct NeuroFluxData {
  int64_t train = 0;            // rows trained on
  int64_t holdout = 0;
  int64_t test = 0;
  int64_t sample_elements = 0;  // one sample's stored image elements (uint8)
  bool host = false;            // the images stream from host memory
  int64_t max_batch = 0;        // the largest block batch (staging)
  double resident_bytes() const;
};
NeuroFluxData neuroflux_data(int64_t train_rows, int64_t test_rows, int64_t sample_elements, int64_t holdout_asked,
                             int64_t max_batch, double budget_bytes, bool gpu);

// The best plan for one block [first, end), or batch = 0 when it does not fit at min_batch.
BlockPlan block_plan(const MemoryProfile& profile, const PartitionOptions& options, int64_t first, int64_t end);

// The exact best partition. Throws UserError when no partition fits, naming the minimum budget that would.
Partition partition_plan(const MemoryProfile& profile, const PartitionOptions& options);

// The smallest budget (bytes, before the safety factor is applied) under which some partition fits.
double partition_min_budget(const MemoryProfile& profile, const PartitionOptions& options);

// The block re-planned from the allocator's reading when it starts: `held_bytes` are allocated then (the data, every
// unit's and head's weights, caches on the device, library workspaces: what the plan modelled as base and other
// weights, now read), and the block adds its own gradients and momenta, its units' and heads' fixed bytes and
// B · per-sample bytes. Its batch becomes the largest under safety × budget, rounded as the plan's and at most the
// planned one (0 when not even min_batch fits), its bytes the prediction at that batch.
BlockPlan block_replan_for_held(const MemoryProfile& profile, const PartitionOptions& options, const BlockPlan& block,
                                double held_bytes);

// The block re-planned from one measured step (made when the block starts, on top of `held_bytes` allocated then):
// `body_bytes` is the allocator's peak over one forward and one backward of the block's units and heads at `rows`
// samples (per process; `world` processes share each batch), above what was allocated before (the input batch among
// it), without the parameters' gradients. It replaces the profile's per-sample bytes of the units and heads (each
// unit's own peak, summed, over-counts the backward's transients, which come one unit at a time):
//   body = (body_bytes − the units' and heads' fixed bytes) / (rows · world) a sample.
// The batch: the largest, at most the planned one, whose step fits safety × budget with the input's modelled copies
// beside the body (fixed + B · (body + input copies): under a CUDA graph the body lives in the graph's pool and the
// batch being read in the default pool, and the budget caps both pools' reserved bytes); it never grows (a larger
// batch is a new shape, fewer steps, and less room beside the graph's pool). Its bytes: the predicted allocated peak,
// fixed + B · (in + max(body, 2.5 · in)): the batch's one fp32 copy beside the body, or the read's copies before it.
BlockPlan block_replan_measured(const MemoryProfile& profile, const PartitionOptions& options, const BlockPlan& block,
                                double held_bytes, double body_bytes, int64_t rows, int64_t world);

// The block's own fixed bytes on top of what is held at its start (see block_replan_for_held).
double block_own_fixed_bytes(const MemoryProfile& profile, const PartitionOptions& options, const BlockPlan& block);

// The batch to retry with after an out-of-memory error at `batch`: the per-sample bytes corrected so that the failed
// batch needs the whole budget (fixed + batch · per_sample' = budget, the least the failure shows), then the largest
// batch under safety × budget: batch · (safety · budget − fixed) / (budget − fixed), rounded down as the plan's and
// below `batch`; 0 when it would go below min_batch. `fixed_bytes`: what the step needs at any batch.
int64_t oom_retry_batch(int64_t batch, double fixed_bytes, const PartitionOptions& options);

}  // namespace triaccel
