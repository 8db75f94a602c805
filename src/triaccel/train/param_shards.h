// Optimizer state sharded across the data-parallel ranks (ZeRO stage 1, docs/distributed.md). Every parameter has
// one owner; the owners are contiguous runs of the optimizer's parameter order, each rank's run holding about
// 1 / world of the parameters (shard_owners). Only a parameter's owner keeps its optimizer state and updates it
// (Optimizer::set_owned); after every step each owner's updated parameters reach the other ranks by broadcast,
// bucket by bucket through one small staging buffer (sync). A checkpoint gathers the state first (gather): the entries
// of a parameter's state from its owner to the rank that writes, through the host.
//
// Invariants:
// - Every rank computes the same owners from the same parameter list, and issues the same broadcasts in the same
//   order (owner 0's buckets first); a rank's memory holds its own shard of the state, plus the staging buffer
//   (shard_bucket_bytes: a larger parameter is broadcast in place, alone). The buffer is kept small so that the
//   state's saving stays: with a buffer as large as a rank's shard of the weights, SGD's momentum (4 bytes a
//   parameter, of which a rank keeps 1/N) would save nothing.
// - A skipped step (inf/NaN) changes no parameter on its owner, so the broadcast after it changes nothing either.
// - sync() enqueues its work on the parameters' stream through NCCL (a CUDA graph captures it); gather() runs on the
//   host (Gloo) and synchronizes.
#pragma once

#include "triaccel/core/dist.h"
#include "triaccel/core/named_tensors.h"

#include <ATen/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace triaccel {

// The owner of each parameter, given each one's element count: contiguous runs in order, the boundary to rank r + 1
// placed where the running count first reaches (r + 1) / world of the total. Every rank gets a run, possibly empty.
std::vector<int> shard_owners(const std::vector<int64_t>& numels, int world);

// The broadcast buckets: consecutive parameters of one owner, up to `bucket_bytes` of float32 each (0: one bucket
// per owner), a parameter larger than that alone.
struct ParamShardBucket {
  int owner = 0;
  std::vector<size_t> params;  // consecutive parameter indices
  int64_t numel = 0;
};
std::vector<ParamShardBucket> shard_buckets(const std::vector<int64_t>& numels, const std::vector<int>& owners,
                                            int64_t bucket_bytes);
// The staging buffer's bytes those buckets need: the largest bucket of several parameters (a lone parameter is
// broadcast in place).
int64_t shard_staging_bytes(const std::vector<ParamShardBucket>& buckets);

// What sharding leaves on the rank that owns most, given each parameter's element count, the owners and the
// optimizer's state bytes per element (SGD's momentum 4, AdamW 8): that rank's state bytes, and the buckets' cap,
// 4 MiB (ResNet-18 on two ranks: 12 broadcasts per step) or a quarter of the state the rank no longer keeps,
// whichever is less, so that the staging buffer never takes back more than a quarter of the saving.
struct ShardSizes {
  int64_t state_bytes = 0;
  int64_t bucket_bytes = 0;
};
ShardSizes shard_sizes(const std::vector<int64_t>& numels, const std::vector<int>& owners,
                       int64_t state_bytes_per_element);

// The whole layout over `world` ranks, computed once per run (the memory planner prices it, the trainer builds its
// ParamShards from it): the owners, shard_sizes' of them and the staging buffer's bytes of their buckets.
struct ShardLayout {
  std::vector<int> owners;
  ShardSizes sizes;
  int64_t staging_bytes = 0;
};
ShardLayout shard_layout(const std::vector<int64_t>& numels, int world, int64_t state_bytes_per_element);

class ParamShards {
 public:
  // params: the optimizer's parameters, in its order (float32, one device); owners: shard_owners' over them; dist:
  // the ranks' group (its broadcasts move the parameters, its point-to-point calls the gathered state).
  ParamShards(std::vector<at::Tensor> params, std::vector<int> owners, Dist& dist, int64_t bucket_bytes);

  // This rank's flags for Optimizer::set_owned.
  std::vector<bool> owned() const;
  // After the optimizer's step, on every rank: each parameter receives its owner's value.
  void sync();
  // Before a checkpoint, on every rank: on rank `root` (the one that writes) each entry of `state` named
  // "<parameter name>.<field>" receives its owner's value (a host tensor where another rank owns it); each owner
  // sends it there (Dist::send, Dist::recv) and nothing else moves. Other entries (the optimizer's own, the same on
  // every rank), and every entry on the other ranks, stay. `names`: the parameters' names, in the order of `params`.
  void gather(NamedTensors& state, const std::vector<std::string>& names, int root = 0) const;

 private:
  std::vector<at::Tensor> params_;
  std::vector<int> owners_;
  Dist& dist_;
  int rank_ = 0;
  // Copies the contiguous `t` from rank `root` into every other rank's `t`.
  void broadcast(at::Tensor& t, int root);
  std::vector<ParamShardBucket> buckets_;
  at::Tensor staging_;  // (largest bucket's numel) float32; undefined when every bucket is one contiguous parameter
};

}  // namespace triaccel
