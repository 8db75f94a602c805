#include "triaccel/train/param_shards.h"

#include "triaccel/core/flat_view.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/utils.h>

#include <algorithm>
#include <unordered_map>

namespace triaccel {
namespace {

at::Tensor memory_flat(const at::Tensor& t) { return triaccel::memory_flat(t, "ParamShards"); }

}  // namespace

std::vector<int> shard_owners(const std::vector<int64_t>& numels, int world) {
  TORCH_CHECK(world >= 1, "shard_owners: world ", world);
  int64_t total = 0;
  for (int64_t n : numels) total += n;
  std::vector<int> owners;
  int64_t before = 0;  // elements of the parameters before this one
  for (int64_t n : numels) {
    // The rank whose share [r / world, (r + 1) / world) of the total holds this parameter's middle element.
    const int64_t middle = before + n / 2;
    const int owner = total > 0 ? static_cast<int>(std::min<int64_t>(world - 1, middle * world / total)) : 0;
    owners.push_back(owners.empty() ? owner : std::max(owners.back(), owner));
    before += n;
  }
  return owners;
}

std::vector<ParamShardBucket> shard_buckets(const std::vector<int64_t>& numels, const std::vector<int>& owners,
                                            int64_t bucket_bytes) {
  TORCH_CHECK(numels.size() == owners.size(), "shard_buckets: ", owners.size(), " owners for ", numels.size(),
              " parameters");
  const int64_t limit = bucket_bytes > 0 ? std::max<int64_t>(1, bucket_bytes / 4) : INT64_MAX;
  std::vector<ParamShardBucket> out;
  for (size_t i = 0; i < numels.size(); ++i) {
    const bool fits = !out.empty() && out.back().owner == owners[i] && out.back().numel + numels[i] <= limit;
    if (!fits) out.push_back(ParamShardBucket{owners[i], {}, 0});
    out.back().params.push_back(i);
    out.back().numel += numels[i];
  }
  return out;
}

int64_t shard_staging_bytes(const std::vector<ParamShardBucket>& buckets) {
  int64_t largest = 0;
  for (const ParamShardBucket& b : buckets) {
    if (b.params.size() > 1) largest = std::max(largest, b.numel);
  }
  return 4 * largest;
}

ShardSizes shard_sizes(const std::vector<int64_t>& numels, const std::vector<int>& owners,
                       int64_t state_bytes_per_element) {
  TORCH_CHECK(numels.size() == owners.size(), "shard_sizes: ", owners.size(), " owners for ", numels.size(),
              " parameters");
  int64_t total = 0;
  std::unordered_map<int, int64_t> owned;
  for (size_t i = 0; i < numels.size(); ++i) {
    total += numels[i];
    owned[owners[i]] += numels[i];
  }
  int64_t largest = 0;
  for (const auto& [rank, n] : owned) largest = std::max(largest, n);
  ShardSizes out;
  out.state_bytes = state_bytes_per_element * largest;
  const int64_t saving = state_bytes_per_element * (total - largest);
  out.bucket_bytes = std::min<int64_t>(int64_t{4} << 20, saving / 4);
  return out;
}

ShardLayout shard_layout(const std::vector<int64_t>& numels, int world, int64_t state_bytes_per_element) {
  ShardLayout out;
  out.owners = shard_owners(numels, world);
  out.sizes = shard_sizes(numels, out.owners, state_bytes_per_element);
  out.staging_bytes = shard_staging_bytes(shard_buckets(numels, out.owners, out.sizes.bucket_bytes));
  return out;
}

ParamShards::ParamShards(std::vector<at::Tensor> params, std::vector<int> owners, Dist& dist, int64_t bucket_bytes)
    : params_(std::move(params)), owners_(std::move(owners)), dist_(dist), rank_(dist.rank()) {
  std::vector<int64_t> numels;
  for (const at::Tensor& p : params_) {
    TORCH_CHECK(p.scalar_type() == at::kFloat, "ParamShards: parameters must be float32");
    numels.push_back(p.numel());
  }
  buckets_ = shard_buckets(numels, owners_, bucket_bytes);
  const int64_t staging = shard_staging_bytes(buckets_) / 4;
  if (staging > 0) staging_ = at::empty({staging}, params_[0].options());
}

std::vector<bool> ParamShards::owned() const {
  std::vector<bool> out;
  for (int o : owners_) out.push_back(o == rank_);
  return out;
}

void ParamShards::broadcast(at::Tensor& t, int root) {
  std::vector<at::Tensor> one{t};
  dist_.broadcast(one, root);
}

void ParamShards::sync() {
  const torch::NoGradGuard no_grad;
  for (const ParamShardBucket& b : buckets_) {
    if (b.params.size() == 1) {
      at::Tensor flat = memory_flat(params_[b.params[0]]);
      broadcast(flat, b.owner);
      continue;
    }
    at::Tensor flat = staging_.narrow(0, 0, b.numel);
    int64_t offset = 0;
    if (b.owner == rank_) {
      for (size_t i : b.params) {
        flat.narrow(0, offset, params_[i].numel()).copy_(memory_flat(params_[i]));
        offset += params_[i].numel();
      }
    }
    broadcast(flat, b.owner);
    if (b.owner == rank_) continue;
    offset = 0;
    for (size_t i : b.params) {
      memory_flat(params_[i]).copy_(flat.narrow(0, offset, params_[i].numel()));
      offset += params_[i].numel();
    }
  }
}

void ParamShards::gather(NamedTensors& state, const std::vector<std::string>& names, int root) const {
  TORCH_CHECK(names.size() == params_.size(), "ParamShards::gather: ", names.size(), " names for ", params_.size(),
              " parameters");
  std::unordered_map<std::string, int> owner_of;
  for (size_t i = 0; i < names.size(); ++i) owner_of[names[i]] = owners_[i];
  const torch::NoGradGuard no_grad;
  int tag = 0;  // the entry's position: the same on every rank, which lists the same entries in the same order
  for (auto& [name, t] : state) {
    const size_t dot = name.rfind('.');
    if (dot == std::string::npos) continue;
    const auto it = owner_of.find(name.substr(0, dot));
    if (it == owner_of.end()) continue;  // the optimizer's own entry (the same on every rank)
    const int owner = it->second;
    ++tag;
    if (owner == root || (rank_ != owner && rank_ != root)) continue;
    at::Tensor host = t.to(at::kCPU).contiguous();  // through the host (Gloo); the owner's is only read
    if (rank_ == owner) {
      dist_.send(host, root, tag);
    } else {
      dist_.recv(host, owner, tag);
      t = host;
    }
  }
}

}  // namespace triaccel
