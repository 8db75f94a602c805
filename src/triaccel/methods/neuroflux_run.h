// The NeuroFlux run on a session (docs/neuroflux.md): its phases, in methods/neuroflux.cpp (setup, the blocks, the
// checkpoints) and methods/neuroflux_exits.cpp (the cache passes that score every exit, the export, the summary).
// Internal to methods/neuroflux*.
#pragma once

#include "triaccel/methods/neuroflux_block.h"

namespace triaccel {
namespace neuroflux {

// The NeuroFlux run on a session: the phases in the order they run.
class NeuroFluxRun {
 public:
  explicit NeuroFluxRun(Session& session);
  Json run();

 private:
  void data_split();
  void plan_make();
  void heads_make();
  void restore();
  void events_open();
  void host_prefill();
  double cache_pass(size_t b, CachePlace* place);
  void cache_pass_split(size_t b, SplitInput& in, std::vector<double>* accs, CachePlace place);
  BlockResult block_train(size_t b);
  // Data parallel: rank 0's buffers (BatchNorm's running statistics, gathered from its shares) of block b's units and
  // heads on every rank, as DDP broadcasts them, so the cache pass and the exits are one model's on every rank.
  void buffers_agree(size_t b);
  // After every step of a block: checkpoints inside it when one is due or a stop is requested; true: stop.
  bool block_step_done(const BlockTrainer& trainer);
  // Ends the run early for `reason` (its checkpoint is written): the stop event and line. block_in_progress: the
  // block stopped inside (-1: at a block boundary).
  Json stop(const std::string& reason, int64_t block_in_progress);
  void checkpoint(const BlockTrainer* in_block);
  void block_end(size_t b, const BlockResult& r);
  NamedTensors live_state() const;
  at::Tensor logits_of(int64_t u, const at::Tensor& h);
  Json exits_export();
  Json exit_models_write(int64_t chosen, const std::string& exit_path);
  struct ExitRates {
    double exit_rate = 0, full_rate = 0;  // images/s
    int64_t exit_batch = 0, full_batch = 0;
  };
  ExitRates exit_rates(int64_t chosen);
  Json summary(const Json& chosen);

  // Declared first, so destroyed last: after the caches have given their host memory back to the pool, it is freed.
  struct HostPoolRelease {
    ~HostPoolRelease() { ActivationCache::host_pool_release(); }
  } host_pool_release_;
  Session& session_;
  const Config& config_;
  const c10::Device device_;
  Model& model_;
  const std::vector<Unit>& units_;
  const int64_t n_units_;
  // Data: the training split minus a seeded held-out part (for choosing the exit), and the test split.
  Dataset train_set_, hold_set_;
  int64_t n_train_ = 0, n_hold_ = 0;
  LoaderOptions plain_lo_, train_lo_;
  SplitInput hold_in_, test_in_, train_in_;  // train_in_: the loader for block 0 (built on demand), else the cache
  std::vector<int64_t> sample_shape_;
  double resident_ = 0;
  bool host_data_ = false;  // the images stream from pinned host memory (a tight vram_budget)
  // Plan.
  ProfileSource source_ = ProfileSource::kModel;
  MemoryProfile profile_;
  double profile_s_ = 0;
  bool explicit_budget_ = false;
  double budget_ = 0;
  PartitionOptions po_;
  Partition plan_;
  int64_t backprop_batch_ = 0;
  std::vector<AuxHead> heads_;
  // Progress (restored from the checkpoint when resuming at a block boundary).
  int64_t blocks_done_ = 0, step_ = 0;
  double peak_gb_ = 0;
  std::string stop_reason_;        // a stop request's reason (sigint, sigterm)
  Json block_resume_;              // the block in progress at the checkpoint resumed from (null: none)
  NamedTensors block_resume_state_;
  std::vector<double> block_seconds_;  // training + cache pass, per block
  // Per-unit exit accuracies on the held-out and test splits, filled as blocks finish.
  std::vector<double> hold_acc_, test_acc_;
  ActivationCache::IoStats pass_io_;  // host caches' transfers in the last cache pass
  int64_t pass_rows_ = 0;             // rows this rank ran through the block in the last cache pass
  int64_t pass_batch_ = 0;            // the cache pass's batch: the block's, lower after an out-of-memory retry
};

}  // namespace neuroflux
}  // namespace triaccel
