// NeuroFlux activation cache; see activation_cache.h.
#include "triaccel/methods/activation_cache.h"

#include "triaccel/core/host_workers.h"
#include "triaccel/core/io.h"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <functional>
#include <future>
#include <mutex>
#include <numeric>
#include <thread>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace triaccel {

std::string cache_place_name(CachePlace place) { return place == CachePlace::kDevice ? "device" : "host"; }

int64_t ActivationCache::bytes_for(int64_t samples, const std::vector<int64_t>& sample_shape) {
  int64_t n = samples * 2;
  for (int64_t d : sample_shape) n *= d;
  return n;
}

namespace {

// Flat bf16 host buffers of freed host caches, reused by later ones (NeuroFlux runs one thread; the mutex keeps the
// pool safe anyway). Three: NeuroFlux's pass writes one cache per split (training, held-out, test) while the previous
// block's three are freed one by one; with fewer, the training split's new cache found no buffer and paid its first
// touch again every pass.
std::mutex host_pool_mutex;
std::vector<at::Tensor> host_pool;
constexpr size_t kHostPoolKeep = 3;

// The host gather: dst row i ← src row index[i], split over the host workers (core/host_workers.h) in pieces of
// about 1 MB. ATen's index_select gathers rows barely faster with all threads than with one, and slower than one
// thread's memcpy, while ATen's copy_ of a contiguous range scales with the threads — so contiguous ranges use copy_,
// and gathers this (dev/probe_host_transfer.py; measured: docs/results/neuroflux.md).
void gather_rows(std::byte* dst, const std::byte* src, int64_t n, int64_t row_bytes, const int64_t* index) {
  const int64_t piece = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(row_bytes, 1));
  host_parallel((n + piece - 1) / piece, [&](int64_t part) {
    const int64_t end = std::min(n, (part + 1) * piece);
    for (int64_t i = part * piece; i < end; ++i) {
      std::memcpy(dst + i * row_bytes, src + index[i] * row_bytes, static_cast<size_t>(row_bytes));
    }
  });
}

// (samples, row) bf16 host memory. On Linux large buffers are mapped with transparent huge pages requested: a
// multi-GB cache is first touched inside a cache pass, and 2 MB pages fault in 512 times fewer than 4 KB ones.
at::Tensor host_rows_alloc(int64_t samples, int64_t row) {
  const auto options = at::TensorOptions().dtype(at::kBFloat16);
#ifdef __linux__
  constexpr int64_t kHuge = int64_t{1} << 21;
  const int64_t bytes = samples * row * 2;
  if (bytes >= kHuge) {
    const auto length = static_cast<size_t>((bytes + kHuge - 1) / kHuge * kHuge);
    void* p = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) {
      madvise(p, length, MADV_HUGEPAGE);  // advice only: without THP the pages are 4 KB
      return at::from_blob(p, {samples, row}, [length](void* q) { munmap(q, length); }, options);
    }
  }
#endif
  return at::empty({samples, row}, options);
}

// The prefill under way (host_pool_prefill); waited for before the pool is looked at.
std::mutex prefill_mutex;
std::future<void> prefill;
void prefill_wait() {
  const std::lock_guard<std::mutex> lock(prefill_mutex);
  if (prefill.valid()) prefill.get();
}

at::Tensor host_rows_take(int64_t samples, int64_t row) {
  const int64_t n = samples * row;
  prefill_wait();
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
  return host_rows_alloc(samples, row);
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
  prefill_wait();
  const std::lock_guard<std::mutex> lock(host_pool_mutex);
  host_pool.clear();
}

void ActivationCache::host_pool_prefill(const std::vector<int64_t>& numels) {
  prefill_wait();
  const std::lock_guard<std::mutex> lock(prefill_mutex);
  prefill = std::async(std::launch::async, [numels]() {
    std::vector<at::Tensor> bufs;
    for (int64_t n : numels) bufs.push_back(host_rows_alloc(n, 1).view({n}));
    // One write per 4 KB page, the pages split over a few threads of its own (the kernel zeroes each page it faults
    // in); not the host workers, which serve one caller at a time: the block's gathers would wait for the prefill.
    constexpr int kThreads = 8;
    constexpr int64_t kPage = 4096;
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&bufs, t]() {
        for (const auto& b : bufs) {
          auto* p = static_cast<volatile char*>(b.data_ptr());
          const int64_t pages = (b.numel() * 2 + kPage - 1) / kPage;
          for (int64_t i = pages * t / kThreads; i < pages * (t + 1) / kThreads; ++i) p[i * kPage] = 0;
        }
      });
    }
    for (auto& th : threads) th.join();
    const std::lock_guard<std::mutex> pool_lock(host_pool_mutex);
    for (auto& b : bufs) host_pool.push_back(b);
  });
}

int64_t ActivationCache::host_pool_bytes() {
  prefill_wait();
  const std::lock_guard<std::mutex> lock(host_pool_mutex);
  int64_t bytes = 0;
  for (const auto& t : host_pool) bytes += t.numel() * 2;
  return bytes;
}

ActivationCache::IoStats& ActivationCache::IoStats::operator+=(const IoStats& o) {
  host_copy_s += o.host_copy_s;
  wait_s += o.wait_s;
  bytes_to_device += o.bytes_to_device;
  bytes_to_host += o.bytes_to_host;
  return *this;
}

ActivationCache::IoStats ActivationCache::IoStats::operator-(const IoStats& o) const {
  return IoStats{host_copy_s - o.host_copy_s, wait_s - o.wait_s, bytes_to_device - o.bytes_to_device,
                 bytes_to_host - o.bytes_to_host};
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
  if (staged_) {
    // Two streams of the pool that are not the caller's (on the caller's stream a copy would wait for its work).
    const c10::impl::VirtualGuardImpl impl(device_.type());
    const c10::Stream current = impl.getStream(device_);
    const auto other = [&]() {
      c10::Stream s = impl.getStreamFromGlobalPool(device_, /*isHighPriority=*/false);
      for (int tries = 0; s == current && tries < 4; ++tries) s = impl.getStreamFromGlobalPool(device_, false);
      return s;
    };
    to_device_stream_ = other();
    to_host_stream_ = other();
  }
}

ActivationCache::Staging& ActivationCache::staging_take(int64_t count) const {
  Staging& s = staging_[next_staging_];
  next_staging_ = 1 - next_staging_;
  if (s.done) wait(s);
  store(s);
  if (!s.rows.defined() || s.rows.size(0) < count) {
    s.rows = at::empty({count, data_.size(1)}, data_.options().pinned_memory(true));
  }
  return s;
}

void ActivationCache::staging_release(Staging& s, const c10::Stream& stream) const {
  if (!s.done) s.done.emplace(device_.type());
  s.done->record(stream);
}

void ActivationCache::wait(Staging& s) const {
  const double t0 = time_since_start_s();
  s.done->synchronize();
  io_.wait_s += time_since_start_s() - t0;
}

void ActivationCache::store(Staging& s) const {
  if (s.write_count == 0) return;
  const double t0 = time_since_start_s();
  data_.narrow(0, s.write_offset, s.write_count).copy_(s.rows.narrow(0, 0, s.write_count));
  io_.host_copy_s += time_since_start_s() - t0;
  io_.bytes_to_host += s.write_count * data_.size(1) * 2;
  s.write_count = 0;
}

void ActivationCache::flush() const {
  // The older buffer first (its write came first), so a row written twice keeps its last value.
  for (int k = 0; k < 2; ++k) {
    Staging& s = staging_[(next_staging_ + static_cast<size_t>(k)) % 2];
    if (s.write_count == 0) continue;
    wait(s);
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
  // The copy stream waits for the batch, copies it down without holding up the caller's stream, and the batch's
  // memory is not reused before that copy has read it.
  const c10::Stream compute = c10::impl::VirtualGuardImpl(device_.type()).getStream(device_);
  if (!batch_ready_) batch_ready_.emplace(device_.type());
  batch_ready_->record(compute);
  batch_ready_->block(*to_host_stream_);
  {
    const c10::StreamGuard guard(*to_host_stream_);
    s.rows.narrow(0, 0, count).copy_(b, /*non_blocking=*/true);
  }
  b.record_stream(*to_host_stream_);
  staging_release(s, *to_host_stream_);
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
  const double t0 = time_since_start_s();
  fill(rows);
  io_.host_copy_s += time_since_start_s() - t0;
  io_.bytes_to_device += count * data_.size(1) * 2;
  // Allocated on and copied by the copy stream; the caller's stream waits for the copy (an event, not the host), and
  // the memory is not reused before the caller's stream is done with it.
  const c10::Stream compute = c10::impl::VirtualGuardImpl(device_.type()).getStream(device_);
  at::Tensor on_device;
  {
    const c10::StreamGuard guard(*to_device_stream_);
    on_device = rows.to(device_, /*non_blocking=*/true);
  }
  staging_release(s, *to_device_stream_);
  s.done->block(compute);
  on_device.record_stream(compute);
  return unpack(on_device);
}

at::Tensor ActivationCache::read(const at::Tensor& index) const {
  if (place_ == CachePlace::kDevice) return unpack(data_.index_select(0, index.to(device_)));
  if (!staged_) return unpack(data_.index_select(0, index.cpu()));
  const at::Tensor idx = index.cpu().to(at::kLong).contiguous();
  const int64_t* p = idx.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < idx.numel(); ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] < size(), "cache read of row ", p[i], " outside the cache of ", size(), " rows");
  }
  return staged_read(idx.numel(), [&](at::Tensor& rows) {
    gather_rows(static_cast<std::byte*>(rows.data_ptr()), static_cast<const std::byte*>(data_.const_data_ptr()),
                idx.numel(), data_.size(1) * 2, p);
  });
}

at::Tensor ActivationCache::read_range(int64_t offset, int64_t count) const {
  if (!staged_) return unpack(data_.narrow(0, offset, count).to(device_));
  TORCH_CHECK(offset >= 0 && count >= 0 && offset + count <= size(), "cache read [", offset, ", ", offset + count,
              ") is outside the cache of ", size(), " rows");
  return staged_read(count, [&](at::Tensor& rows) { rows.copy_(data_.narrow(0, offset, count)); });
}

}  // namespace triaccel
