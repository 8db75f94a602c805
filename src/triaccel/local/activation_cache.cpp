// NeuroFlux activation cache; see activation_cache.h.
#include "triaccel/local/activation_cache.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <functional>
#include <numeric>

namespace triaccel {

std::string cache_place_name(CachePlace place) { return place == CachePlace::kDevice ? "device" : "host"; }

int64_t ActivationCache::bytes_for(int64_t samples, const std::vector<int64_t>& sample_shape) {
  int64_t n = samples * 2;
  for (int64_t d : sample_shape) n *= d;
  return n;
}

ActivationCache::ActivationCache(int64_t samples, const std::vector<int64_t>& sample_shape, CachePlace place,
                                 const c10::Device& device, bool channels_last)
    : place_(place), device_(device), sample_shape_(sample_shape), channels_last_(channels_last && sample_shape.size() == 3) {
  const int64_t row = std::accumulate(sample_shape.begin(), sample_shape.end(), int64_t{1}, std::multiplies<>());
  auto opts = at::TensorOptions().dtype(at::kBFloat16);
  if (place == CachePlace::kDevice) {
    data_ = at::empty({samples, row}, opts.device(device));
  } else {
    data_ = at::empty({samples, row}, opts.device(at::kCPU).pinned_memory(device.is_cuda()));
  }
}

void ActivationCache::write(int64_t offset, const at::Tensor& batch) {
  TORCH_CHECK(offset >= 0 && offset + batch.size(0) <= size(), "cache write [", offset, ", ",
              offset + batch.size(0), ") is outside the cache of ", size(), " rows");
  at::Tensor b = batch.detach().to(at::kBFloat16);
  // Rows in the cache's order: (H, W, C) for a channels_last cache (a no-op for a channels_last batch), on the device.
  b = channels_last_ ? b.permute({0, 2, 3, 1}).contiguous() : b.contiguous();
  // Into pinned host memory without waiting (the caller synchronizes before the rows are read on the host).
  data_.narrow(0, offset, b.size(0)).copy_(b.view({b.size(0), data_.size(1)}), /*non_blocking=*/true);
}

at::Tensor ActivationCache::unpack(const at::Tensor& rows) const {
  const int64_t n = rows.size(0);
  const at::Tensor x = rows.to(at::kFloat);
  if (!channels_last_) {
    std::vector<int64_t> shape{n};
    shape.insert(shape.end(), sample_shape_.begin(), sample_shape_.end());
    return x.view(shape);
  }
  return x.view({n, sample_shape_[1], sample_shape_[2], sample_shape_[0]}).permute({0, 3, 1, 2});
}

at::Tensor ActivationCache::read(const at::Tensor& index) const {
  if (place_ == CachePlace::kDevice) return unpack(data_.index_select(0, index.to(device_)));
  const int64_t count = index.size(0);
  if (!device_.is_cuda()) return unpack(data_.index_select(0, index.cpu()));
  // Gathered on the host into the older of two pinned buffers (once its last copy is done), copied without waiting.
  Staging& s = staging_[next_staging_];
  next_staging_ = 1 - next_staging_;
  if (s.copied) s.copied->synchronize();
  if (!s.rows.defined() || s.rows.size(0) < count) {
    s.rows = at::empty({count, data_.size(1)}, data_.options().pinned_memory(true));
  }
  at::Tensor rows = s.rows.narrow(0, 0, count);
  at::index_select_out(rows, data_, 0, index.cpu());
  const at::Tensor on_device = rows.to(device_, /*non_blocking=*/true);
  if (!s.copied) s.copied.emplace(device_.type());
  s.copied->record(c10::impl::VirtualGuardImpl(device_.type()).getStream(device_));
  return unpack(on_device);
}

at::Tensor ActivationCache::read_range(int64_t offset, int64_t count) const {
  // The cache outlives the copy, so it need not wait (pinned host rows; a no-op for a device cache).
  return unpack(data_.narrow(0, offset, count).to(device_, /*non_blocking=*/true));
}

}  // namespace triaccel
