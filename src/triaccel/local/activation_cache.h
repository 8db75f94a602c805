// NeuroFlux activation cache: one block's outputs for a whole split, stored in bf16, so the next block trains on
// them and earlier blocks never run again. Lives on the GPU when it fits the budget, else in pinned host memory
// (plain host memory on a CPU-only run) and is gathered there and copied to the GPU batch by batch.
// Invariant: row i holds sample i of the split in the order it was written; labels are kept by the caller.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>

#include <array>
#include <cstdint>
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
  ActivationCache(int64_t samples, const std::vector<int64_t>& sample_shape, CachePlace place,
                  const c10::Device& device, bool channels_last = false);

  // Rows [offset, offset + batch.size(0)) from a float batch on `device` (converted to bf16).
  void write(int64_t offset, const at::Tensor& batch);
  // Rows `index` ((count) int64) as a float32 batch on `device` (channels_last when the cache is). Pass the index
  // on the CPU for a host cache and on `device` for a device cache (else it is moved, a synchronizing copy). A host
  // cache on CUDA gathers into one of two pinned buffers and copies without waiting: the GPU may still be training on
  // the previous batch while the next one is gathered (a buffer is reused once its copy has finished).
  at::Tensor read(const at::Tensor& index) const;
  // Rows [offset, offset + count) as a float32 batch on `device` (channels_last when the cache is).
  at::Tensor read_range(int64_t offset, int64_t count) const;

  int64_t size() const { return data_.size(0); }
  CachePlace place() const { return place_; }
  int64_t bytes() const { return data_.numel() * 2; }
  static int64_t bytes_for(int64_t samples, const std::vector<int64_t>& sample_shape);

 private:
  // (count, row) bf16 rows → (count, sample_shape...) float32 on device_, in the cache's layout.
  at::Tensor unpack(const at::Tensor& rows) const;

  CachePlace place_;
  c10::Device device_;
  std::vector<int64_t> sample_shape_;
  bool channels_last_ = false;
  at::Tensor data_;             // (N, row elements) bf16, on device_ or on the host (pinned when device_ is CUDA)
  struct Staging {
    at::Tensor rows;                  // (batch, row elements) bf16 pinned: host rows gathered for one read
    std::optional<c10::Event> copied;  // recorded after its copy to the device was queued
  };
  mutable std::array<Staging, 2> staging_;  // alternating reads (CUDA host caches only)
  mutable size_t next_staging_ = 0;
};

}  // namespace triaccel
