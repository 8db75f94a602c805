// NeuroFlux activation cache; see activation_cache.h.
#include "triaccel/local/activation_cache.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <functional>
#include <mutex>
#include <numeric>

namespace triaccel {

std::string cache_place_name(CachePlace place) { return place == CachePlace::kDevice ? "device" : "host"; }

int64_t ActivationCache::bytes_for(int64_t samples, const std::vector<int64_t>& sample_shape) {
  int64_t n = samples * 2;
  for (int64_t d : sample_shape) n *= d;
  return n;
}

namespace {

// Flat bf16 host buffers of freed host caches, reused by later ones (NeuroFlux runs one thread; the mutex keeps the
// pool safe anyway).
std::mutex host_pool_mutex;
std::vector<at::Tensor> host_pool;
constexpr size_t kHostPoolKeep = 2;

at::Tensor host_rows_take(int64_t samples, int64_t row) {
  const int64_t n = samples * row;
  {
    const std::lock_guard<std::mutex> lock(host_pool_mutex);
    auto best = host_pool.end();
    for (auto it = host_pool.begin(); it != host_pool.end(); ++it) {
      if (it->numel() >= n && (best == host_pool.end() || it->numel() < best->numel())) best = it;
    }
    if (best != host_pool.end()) {
      at::Tensor buf = *best;
      host_pool.erase(best);
      return buf.narrow(0, 0, n).view({samples, row});
    }
  }
  return at::empty({samples, row}, at::TensorOptions().dtype(at::kBFloat16));
}

void host_rows_give(const at::Tensor& rows) {
  // The whole underlying buffer goes back (rows may be a view of a larger pooled one).
  const int64_t capacity = static_cast<int64_t>(rows.storage().nbytes() / 2);
  const at::Tensor flat = at::empty({0}, rows.options()).set_(rows.storage(), 0, {capacity}, {1});
  const std::lock_guard<std::mutex> lock(host_pool_mutex);
  host_pool.push_back(flat);
  if (host_pool.size() > kHostPoolKeep) {  // keep the largest buffers
    std::sort(host_pool.begin(), host_pool.end(), [](const at::Tensor& a, const at::Tensor& b) { return a.numel() > b.numel(); });
    host_pool.resize(kHostPoolKeep);
  }
}

}  // namespace

void ActivationCache::host_pool_release() {
  const std::lock_guard<std::mutex> lock(host_pool_mutex);
  host_pool.clear();
}

int64_t ActivationCache::host_pool_bytes() {
  const std::lock_guard<std::mutex> lock(host_pool_mutex);
  int64_t bytes = 0;
  for (const auto& t : host_pool) bytes += t.numel() * 2;
  return bytes;
}

ActivationCache::~ActivationCache() {
  if (place_ == CachePlace::kHost && data_.defined()) host_rows_give(data_);
}

ActivationCache::ActivationCache(int64_t samples, const std::vector<int64_t>& sample_shape, CachePlace place,
                                 const c10::Device& device, bool channels_last)
    : place_(place),
      device_(device),
      sample_shape_(sample_shape),
      channels_last_(channels_last && sample_shape.size() == 3),
      staged_(place == CachePlace::kHost && device.is_cuda()) {
  const int64_t row = std::accumulate(sample_shape.begin(), sample_shape.end(), int64_t{1}, std::multiplies<>());
  data_ = place == CachePlace::kDevice ? at::empty({samples, row}, at::TensorOptions().dtype(at::kBFloat16).device(device))
                                       : host_rows_take(samples, row);
}

ActivationCache::Staging& ActivationCache::staging_take(int64_t count) const {
  Staging& s = staging_[next_staging_];
  next_staging_ = 1 - next_staging_;
  if (s.done) s.done->synchronize();
  store(s);
  if (!s.rows.defined() || s.rows.size(0) < count) {
    s.rows = at::empty({count, data_.size(1)}, data_.options().pinned_memory(true));
  }
  return s;
}

void ActivationCache::staging_release(Staging& s) const {
  if (!s.done) s.done.emplace(device_.type());
  s.done->record(c10::impl::VirtualGuardImpl(device_.type()).getStream(device_));
}

void ActivationCache::store(Staging& s) const {
  if (s.write_count == 0) return;
  data_.narrow(0, s.write_offset, s.write_count).copy_(s.rows.narrow(0, 0, s.write_count));
  s.write_count = 0;
}

void ActivationCache::flush() const {
  // The older buffer first (its write came first), so a row written twice keeps its last value.
  for (int k = 0; k < 2; ++k) {
    Staging& s = staging_[(next_staging_ + static_cast<size_t>(k)) % 2];
    if (s.write_count == 0) continue;
    s.done->synchronize();
    store(s);
  }
}

void ActivationCache::write(int64_t offset, const at::Tensor& batch) {
  TORCH_CHECK(offset >= 0 && offset + batch.size(0) <= size(), "cache write [", offset, ", ",
              offset + batch.size(0), ") is outside the cache of ", size(), " rows");
  at::Tensor b = batch.detach().to(at::kBFloat16);
  // Rows in the cache's order: (H, W, C) for a channels_last cache (a no-op for a channels_last batch), on the device.
  b = channels_last_ ? b.permute({0, 2, 3, 1}).contiguous() : b.contiguous();
  const int64_t count = b.size(0);
  b = b.view({count, data_.size(1)});
  if (!staged_) {
    data_.narrow(0, offset, count).copy_(b);
    return;
  }
  Staging& s = staging_take(count);
  s.rows.narrow(0, 0, count).copy_(b, /*non_blocking=*/true);
  staging_release(s);
  s.write_offset = offset;
  s.write_count = count;
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

at::Tensor ActivationCache::staged_read(int64_t count, const std::function<void(at::Tensor&)>& fill) const {
  flush();
  Staging& s = staging_take(count);
  at::Tensor rows = s.rows.narrow(0, 0, count);
  fill(rows);
  const at::Tensor on_device = rows.to(device_, /*non_blocking=*/true);
  staging_release(s);
  return unpack(on_device);
}

at::Tensor ActivationCache::read(const at::Tensor& index) const {
  if (place_ == CachePlace::kDevice) return unpack(data_.index_select(0, index.to(device_)));
  if (!staged_) return unpack(data_.index_select(0, index.cpu()));
  return staged_read(index.size(0), [&](at::Tensor& rows) { at::index_select_out(rows, data_, 0, index.cpu()); });
}

at::Tensor ActivationCache::read_range(int64_t offset, int64_t count) const {
  if (!staged_) return unpack(data_.narrow(0, offset, count).to(device_));
  return staged_read(count, [&](at::Tensor& rows) { rows.copy_(data_.narrow(0, offset, count)); });
}

}  // namespace triaccel
