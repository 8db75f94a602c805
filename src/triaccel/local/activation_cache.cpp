// NeuroFlux activation cache; see activation_cache.h.
#include "triaccel/local/activation_cache.h"

#include <ATen/ATen.h>

namespace triaccel {

std::string cache_place_name(CachePlace place) { return place == CachePlace::kDevice ? "device" : "host"; }

int64_t ActivationCache::bytes_for(int64_t samples, const std::vector<int64_t>& sample_shape) {
  int64_t n = samples * 2;
  for (int64_t d : sample_shape) n *= d;
  return n;
}

ActivationCache::ActivationCache(int64_t samples, const std::vector<int64_t>& sample_shape, CachePlace place,
                                 const c10::Device& device)
    : place_(place), device_(device) {
  std::vector<int64_t> shape{samples};
  shape.insert(shape.end(), sample_shape.begin(), sample_shape.end());
  auto opts = at::TensorOptions().dtype(at::kBFloat16);
  if (place == CachePlace::kDevice) {
    data_ = at::empty(shape, opts.device(device));
  } else {
    data_ = at::empty(shape, opts.device(at::kCPU).pinned_memory(device.is_cuda()));
  }
}

void ActivationCache::write(int64_t offset, const at::Tensor& batch) {
  TORCH_CHECK(offset >= 0 && offset + batch.size(0) <= size(), "cache write [", offset, ", ",
              offset + batch.size(0), ") is outside the cache of ", size(), " rows");
  data_.narrow(0, offset, batch.size(0)).copy_(batch.detach().to(at::kBFloat16));
}

at::Tensor ActivationCache::read(const at::Tensor& index) const {
  if (place_ == CachePlace::kDevice) return data_.index_select(0, index.to(device_)).to(at::kFloat);
  // Gathered on the host into a pinned staging buffer, then one synchronous copy (so the buffer is free on return).
  const int64_t count = index.size(0);
  if (!device_.is_cuda()) return data_.index_select(0, index).to(at::kFloat);
  if (!staging_.defined() || staging_.size(0) < count) {
    std::vector<int64_t> shape(data_.sizes().begin(), data_.sizes().end());
    shape[0] = count;
    staging_ = at::empty(shape, data_.options().pinned_memory(true));
  }
  at::Tensor rows = staging_.narrow(0, 0, count);
  at::index_select_out(rows, data_, 0, index);
  return rows.to(device_, /*non_blocking=*/false).to(at::kFloat);
}

at::Tensor ActivationCache::read_range(int64_t offset, int64_t count) const {
  return data_.narrow(0, offset, count).to(device_).to(at::kFloat);
}

}  // namespace triaccel
