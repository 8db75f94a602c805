// Data parallelism's gradient reduction, overlapped with backward (docs/distributed.md), in the way of DDP's Reducer:
// the parameters are laid, last first (the order backward produces their gradients), into buckets of about
// `bucket_bytes` of gradients, each a flat buffer allocated once. A hook on each parameter's gradient accumulator
// counts its gradient in during the backward pass that reduces (the step's last micro-batch: arm()); a bucket whose
// gradients are all in copies them into its buffer (one multi-tensor copy) and starts its sum over the ranks at once,
// while backward goes on with the layers before it. A rank's share of the global batch weights its loss, not the
// buckets (TrainStep, NeuroFlux's BlockTrainer): the buckets add the gradients as they are.
// finish(), after that pass, starts what is left, waits for every bucket and makes each parameter's gradient a view
// of its place in its bucket (laid out as the parameter), so the sums are read where they were reduced, without a
// copy back.
//
// Invariants:
// - Buckets start strictly in index order, whatever order the gradients come in: every rank issues the same
//   collectives in the same order (a rank with an empty share, which runs no backward, starts them all in finish()).
// - A parameter whose gradient did not come in that pass reduces what its .grad holds (earlier micro-batches'), or
//   zeros when it has none; after finish() every parameter's gradient is defined, holds the ranks' sum, and aliases
//   the bucket until the next step releases it (TrainStep releases gradients before every backward, so no backward
//   accumulates into a bucket).
// - The cast to `wire` (bf16 compression, as DDP's bf16 hook) comes after the copy, in the gradients' dtype.
// - Hooks outside an armed pass (the curvature probe's products, evaluation) do nothing.
// With bucket_bytes 0 no hook is installed: one bucket holds every gradient and starts in finish(), after backward.
// With tail_bytes the parameters at the front (the last gradients backward produces) make a small last bucket.
#pragma once

#include "triaccel/core/dist.h"

#include <ATen/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

namespace triaccel {

// Starts the sum over the ranks of `flat` in place (Dist::all_reduce_sum_start); the returned work waits for it.
using GradBucketStart = std::function<DistWork(const at::Tensor& flat)>;

// The defaults here are the run's (Config's grad_bucket_mb reads bucket_bytes; grad_buckets_options derives tail_bytes
// from it the same way).
struct GradBucketsOptions {
  // grad_bucket_mb: > 0: buckets of about this many gradient bytes, started during backward; 0: one, after backward.
  int64_t bucket_bytes = int64_t{25} << 20;
  at::ScalarType wire = at::ScalarType::Undefined;  // the dtype the sums run in (kBFloat16: compression); Undefined:
                                                    // the gradients' own
  // > 0 (with bucket_bytes): the gradients backward produces last, up to this many bytes, make a bucket of their own,
  // so the bucket before it starts while they are computed and only this small one is left after backward (else the
  // last bucket is whatever the cap left over: ResNet-18's 20 of 45 MB, reduced with the GPU otherwise idle).
  int64_t tail_bytes = int64_t{1} << 20;
};

// The bytes the buckets of `params` parameters hold, allocated with them and kept: a float32 copy of every gradient,
// and a bf16 one to send where the options compress (the memory planner's fixed bytes, NeuroFlux's block plans).
int64_t grad_buckets_bytes(int64_t params, const GradBucketsOptions& options);

class GradBuckets {
 public:
  // `params`: the optimizer's parameters, in its order (their gradients' dtype and device make the buckets').
  GradBuckets(std::vector<at::Tensor> params, GradBucketsOptions options, GradBucketStart start);
  ~GradBuckets();
  GradBuckets(const GradBuckets&) = delete;
  GradBuckets& operator=(const GradBuckets&) = delete;

  // The next backward pass reduces: its gradients go to the buckets as they come.
  void arm();
  // After that pass (or instead of it, for a rank without samples): the rest of the buckets, the waits, the sums in
  // the gradients. Disarms.
  void finish();
  // finish() for a pass that failed on this rank (its step ran out of memory) while the other ranks' passes go on:
  // the buckets not yet started start with NaN in place of this rank's share (the pass is armed first when it was
  // not), so every rank's sums come out non-finite and every rank skips its update. False when every bucket had
  // started already: nothing is left to carry the NaN.
  bool finish_poisoned();

  // Each bucket's parameters (indices into `params`), in the order they start.
  const std::vector<std::vector<size_t>>& buckets() const;
  // How many buckets the last reducing pass started from its hooks, while backward ran (the rest started in finish()).
  int64_t started_during_backward() const;
  // The bytes the buckets' buffers hold (grad_buckets_bytes models them).
  int64_t bytes() const;

 private:
  struct State;
  std::shared_ptr<State> state_;  // the hooks hold it weakly: a hook outliving this object does nothing
};

}  // namespace triaccel
