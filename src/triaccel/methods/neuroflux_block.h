// NeuroFlux's block trainer (methods/neuroflux.cpp runs the blocks; docs/neuroflux.md): one block's units and
// heads under one fused SGD at the block's own batch, schedule and data order, its steps through a StepGraph, an
// out-of-memory error retried at a smaller batch (agreed by every rank with data parallelism), and its position and
// state for a checkpoint inside the block. Also what the run and the trainer share: a split's input to a block, a
// block's result, the seed streams and checkpoint prefixes. Internal to methods/neuroflux*.
#pragma once

#include "triaccel/control/batch/batch_policy.h"
#include "triaccel/control/memory/memory_profile.h"
#include "triaccel/control/memory/partitioner.h"
#include "triaccel/core/bytes.h"
#include "triaccel/core/device.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"
#include "triaccel/core/profile.h"
#include "triaccel/data/dataset.h"
#include "triaccel/data/loader.h"
#include "triaccel/methods/activation_cache.h"
#include "triaccel/models/registry.h"
#include "triaccel/optim/sgd.h"
#include "triaccel/run/component_options.h"
#include "triaccel/run/step_recovery.h"
#include "triaccel/train/checkpoint.h"
#include "triaccel/train/grad_buckets.h"
#include "triaccel/train/precision.h"
#include "triaccel/train/rng.h"
#include "triaccel/train/schedule.h"
#include "triaccel/train/step_graph.h"
#include "triaccel/methods/neuroflux.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/autograd.h>
#include <torch/utils.h>
#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <unordered_set>

namespace triaccel {
namespace neuroflux {

constexpr uint64_t kBlockStream = 0x4e46426c6f63ULL;  // an independent seed stream (seed_mix)
constexpr const char* kAuxPrefix = "neuroflux_aux.";  // head entries in the checkpoint's model state
constexpr const char* kBlockSums = "neuroflux_block.";  // a block in progress: its loss sums in the optimizer state

// A seeded permutation of [0, n) (int64, on the CPU).
at::Tensor permutation(int64_t n, uint64_t seed);
// An oom event's reason for the `ooms`-th error of a block beside its CUDA graph's pool: from the second on the block
// stays eager.
const char* beside_pool_reason(int64_t ooms);
Json cache_place_or_null(const std::unique_ptr<ActivationCache>& cache);

// One split's input to the current block: the ordered, unaugmented loader (block 0) or the previous block's cache.
struct SplitInput {
  std::unique_ptr<Loader> loader;
  std::unique_ptr<ActivationCache> cache;
  at::Tensor labels;  // (N) int64 on the device, row order

  int64_t size() const { return labels.size(0); }
  at::Tensor rows(int64_t offset, int64_t count, bool channels_last) const {
    if (cache) return layout(cache->read_range(offset, count), channels_last);
    return loader->batch(offset, count).first;
  }
  static at::Tensor layout(const at::Tensor& x, bool channels_last) {
    return channels_last && x.dim() == 4 ? x.contiguous(at::MemoryFormat::ChannelsLast) : x;
  }
};

// What one block's training leaves for its event.
struct BlockResult {
  int64_t final_batch = 0;
  int64_t steps = 0;
  int64_t short_steps = 0;  // steps below the planned batch (only after an out-of-memory retry)
  double train_s = 0;
  at::Tensor loss_sum, correct;  // per unit of the block, summed over the last epoch
  bool cuda_graph = false;
  int64_t capture_ooms = 0;
  std::string capture_error;
  bool relaxed = false;
  ActivationCache::IoStats train_io;
  Json input_place;  // where the block's input cache lives ("device", "host"); null for block 0 (the data)
  int64_t alloc_retries_before = 0;  // the allocator's retries when the block started
  Json replan;                       // the block's batch re-planned at its start from the allocator (null: as planned)
  Json calibration;                  // the measured step it was re-planned from (null: none; the CPU, a resume); its
                                     // seconds ("s") are in train_s
  double train_peak_gb = 0;          // the allocator's peak over the block's training (before its cache pass)
  bool stopped = false;              // stopped inside the block (a stop request); its checkpoint is written
};

// One block's training: its parameters (units and heads) under one fused SGD, its own batch, schedule and data
// order, its steps through a StepGraph.
class BlockTrainer {
 public:
  BlockTrainer(Session& session, const BlockPlan& bp, size_t b, size_t n_blocks, const std::vector<AuxHead>& heads,
               const Dataset& train_set, SplitInput& train_in, const LoaderOptions& train_lo,
               const LoaderOptions& plain_lo, const MemoryProfile& profile, const PartitionOptions& po,
               int64_t* run_step);
  // Called after every step; returning true stops the block there (its result has `stopped`).
  using AfterStep = std::function<bool(const BlockTrainer&)>;
  void on_step(AfterStep f) { after_step_ = std::move(f); }
  // Continues from a checkpoint written inside this block: `progress` and `state` as progress() and state() gave.
  void resume(const Json& progress, const NamedTensors& state, const std::string& path);
  // Trains every epoch (from the resumed position); the block's result for its event.
  BlockResult train();

  // Where the block is, for a checkpoint: its index, epoch, offset in the epoch, batch, steps, epoch times.
  Json progress() const;
  // Data parallel: the stop request and the checkpoint due after the step that just ran, agreed with that step
  // (StepRecovery::agreed); empty in one process.
  const std::optional<std::pair<StopRequest, bool>>& agreed() const { return recovery_.agreed(); }
  // The block's SGD momenta and running loss sums (data parallel: summed over the ranks, a collective every rank
  // makes; resume() gives them back to rank 0).
  NamedTensors state() const;

 private:
  void epoch(int64_t e);
  // One step at [offset, offset + count) of epoch order `order` (fill: rows from the epoch's start), through
  // recovery_ (data parallel: agreed by every rank, agreed()); false: retry.
  bool step_at(int64_t e, int64_t offset, int64_t count, int64_t fill, const at::Tensor& order,
               const at::Tensor& order_dev, const at::Tensor& flip);
  // Data parallel, on a rank whose step ran out of memory: its part of the step's collectives (so every rank stays in
  // step, and every rank's update is skipped through skip_); false when its update had begun.
  bool step_failed();
  // A step of `count` samples that ran out of memory (data parallel: on some rank, every rank alike): the same samples
  // again at the batch the ranks agreed (the same batch beside the graph's pool, then eager from the second time; a
  // smaller one otherwise, eager), with the oom event (rank 0), or a stop with one line when no batch fits or a rank's
  // update had begun. Returns false (retry).
  bool step_retry(const StepOutcome& oom, int64_t count);
  void grads_release();
  void body(const at::Tensor& x, const at::Tensor& y);

  Session& session_;
  const Config& config_;
  const BlockPlan& bp_;
  const size_t b_;
  const size_t n_blocks_;
  const std::vector<AuxHead>& heads_;
  SplitInput& train_in_;
  const LoaderOptions& train_lo_;
  const LoaderOptions& plain_lo_;
  const MemoryProfile& profile_;
  const PartitionOptions& po_;
  double fixed_bytes_ = 0;  // what a step needs at any batch: held at the block's start + the block's own fixed bytes
  int64_t* run_step_;
  const int64_t n_train_;
  const uint64_t block_seed_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<Sgd> sgd_;
  std::unique_ptr<GradBuckets> buckets_;  // data parallel: the gradients' sum over the ranks (null: one process)
  std::unique_ptr<Loader> train_aug_;  // block 0: shuffled, augmented batches from the data
  ScheduleOptions sched_;
  at::Tensor lr_;
  // Nonzero skips the update. Data parallel: the ranks' sum, made in every step, of 1 from each rank that ran out of
  // memory in it (step_failed); the ranks' loss sums take the step's only where it is 0.
  at::Tensor skip_;
  at::Tensor step_loss_, step_correct_, keep_;  // data parallel: the step's sums, and 1 - min(skip_, 1)
  // Data parallel: how far the step came on this rank (-1: before its body, 0: in it, 1: the gradients summed, 2:
  // skip_ too).
  int phase_ = -1;
  StepRecovery recovery_{session_};  // the step's out-of-memory recovery; data parallel: its stop agreement
  StepGraph graph_;
  std::vector<double> epoch_times_;
  int64_t retries_before_ = 0;
  BlockResult r_;
  int64_t batch_ = 0;  // smaller than planned only after an out-of-memory retry
  int64_t beside_pool_ooms_ = 0;  // out-of-memory errors beside the CUDA graph's pool in this block
  AfterStep after_step_;
  // Position: the epoch and offset of the next step; the current epoch's training time before this session.
  int64_t epoch_ = 0, offset_ = 0;
  double epoch_before_s_ = 0, t_epoch_ = 0;
};

}  // namespace neuroflux
}  // namespace triaccel
