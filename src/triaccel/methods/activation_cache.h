// NeuroFlux activation cache: one block's outputs for a whole split, stored in bf16, so the next block trains on
// them and earlier blocks never run again. Lives on the GPU when it fits the budget, else in host memory, gathered
// there and copied to the GPU batch by batch.
// Invariant: row i holds sample i of the split in the order it was written; labels are kept by the caller.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace triaccel {

enum class CachePlace { kDevice, kHost };
std::string cache_place_name(CachePlace place);  // "device" | "host"

class ActivationCache {
 public:
  // samples × sample_shape bf16 elements, uninitialized. `device` is where batches are read to. With
  // `channels_last` (a (C, H, W) sample shape), a row holds its sample in (H, W, C) order: channels_last batches are
  // written with one plain copy (a device-to-host copy that must permute runs on the host, several times slower)
  // and read back as channels_last batches.
  // A host cache is plain (pageable) memory: pinning gigabytes costs more than it saves (cudaHostAlloc of a multi-GB
  // cache takes seconds, most of a cache pass; docs/results/neuroflux.md). Rows cross to and from the GPU through two
  // small pinned staging buffers, without waiting: the host copies or gathers batch i+1 while the GPU works on batch i.
  // On CUDA the copies run on their own streams (one per direction), so a batch's transfer overlaps the GPU's work
  // on the previous batch instead of queuing behind it; the caller's stream waits for a read's copy by an event.
  ActivationCache(int64_t samples, const std::vector<int64_t>& sample_shape, CachePlace place,
                  const c10::Device& device, bool channels_last = false);
  ~ActivationCache();
  ActivationCache(const ActivationCache&) = delete;
  ActivationCache& operator=(const ActivationCache&) = delete;

  // Host memory of freed host caches is kept (at most two buffers) for the next cache: a fresh multi-GB buffer pays
  // its page faults on first touch, inside the cache pass. Frees what is kept (call when the run ends).
  static void host_pool_release();
  static int64_t host_pool_bytes();  // kept now
  // Faults in host buffers of these sizes (bf16 elements) on background threads and adds them to the pool, for the
  // first cache passes: their fresh multi-GB caches otherwise pay the first touch inside the pass (a large share of
  // a short run's time; docs/results/neuroflux.md). A cache that needs a buffer, and host_pool_bytes, wait for it.
  static void host_pool_prefill(const std::vector<int64_t>& numels);

  // Rows [offset, offset + batch.size(0)) from a float batch on `device` (converted to bf16). A host cache on CUDA
  // may finish the copy later: read, read_range and flush see every row written.
  void write(int64_t offset, const at::Tensor& batch);
  // Rows `index` ((count) int64) as a float32 batch on `device` (channels_last when the cache is). Pass the index
  // on the CPU for a host cache and on `device` for a device cache (else it is moved, a synchronizing copy).
  at::Tensor read(const at::Tensor& index) const;
  // Rows [offset, offset + count) as a float32 batch on `device` (channels_last when the cache is).
  at::Tensor read_range(int64_t offset, int64_t count) const;
  // Waits for the writes still on their way to the host and stores them.
  void flush() const;
  // Rows [offset, offset + count) as stored (bf16, (count, row elements), on the device or in host memory), to be
  // filled in place by a collective (data parallel: another rank computed them). Call flush() first.
  at::Tensor stored_rows(int64_t offset, int64_t count) { return data_.narrow(0, offset, count); }

  int64_t size() const { return data_.size(0); }
  CachePlace place() const { return place_; }
  int64_t bytes() const { return data_.numel() * 2; }
  static int64_t bytes_for(int64_t samples, const std::vector<int64_t>& sample_shape);

  // Where a host cache's transfers spent host time (for the `block` event): copying rows between the cache and the
  // staging buffers, and waiting for a staging buffer's previous copy to finish.
  struct IoStats {
    double host_copy_s = 0;
    double wait_s = 0;
    int64_t bytes_to_device = 0;
    int64_t bytes_to_host = 0;
    IoStats& operator+=(const IoStats& o);
    IoStats operator-(const IoStats& o) const;  // what was added since o (an earlier reading of the same cache)
  };
  const IoStats& io_stats() const { return io_; }

 private:
  struct Staging {
    at::Tensor rows;                   // (batch, row elements) bf16, pinned
    std::optional<c10::Event> done;    // recorded after its copy (to or from the device) was queued
    int64_t write_offset = 0;          // a write waiting in `rows`: its first row in data_ ...
    int64_t write_count = 0;           // ... and its row count (0: none)
  };
  // (count, row) bf16 rows → (count, sample_shape...) float32 on device_, in the cache's layout.
  at::Tensor unpack(const at::Tensor& rows) const;
  // The older staging buffer, free: its last copy has finished and a write waiting in it is stored.
  Staging& staging_take(int64_t count) const;
  void staging_release(Staging& s, const c10::Stream& stream) const;  // records `done` on `stream`
  void store(Staging& s) const;            // a finished write from s.rows into data_
  void wait(Staging& s) const;             // for s's last copy (counted in io_.wait_s)
  // Host rows put into a staging buffer by `fill` ((count, row) bf16), copied to device_ without waiting.
  at::Tensor staged_read(int64_t count, const std::function<void(at::Tensor&)>& fill) const;

  CachePlace place_;
  c10::Device device_;
  std::vector<int64_t> sample_shape_;
  bool channels_last_ = false;
  bool staged_ = false;         // a host cache on CUDA: transfers go through staging_
  at::Tensor data_;             // (N, row elements) bf16, on device_ or in host memory
  mutable std::array<Staging, 2> staging_;  // used alternately
  mutable size_t next_staging_ = 0;
  std::optional<c10::Stream> to_device_stream_, to_host_stream_;  // staged: the copy streams
  mutable std::optional<c10::Event> batch_ready_;  // a write's batch computed on the caller's stream
  mutable IoStats io_;
};

}  // namespace triaccel
