// Device resolution and memory statistics from the CUDA caching allocator.
// Peak VRAM as docs/measuring.md defines it: the allocator's allocated_bytes peak since the last reset, in GB (1e9 bytes).
#pragma once

#include "triaccel/core/enum_names.h"

#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>

namespace triaccel {

// The `device` option.
enum class DeviceKind { kAuto, kCpu, kCuda };

template <>
struct EnumNames<DeviceKind> {
  static constexpr EnumName<DeviceKind> kNames[] = {
      {DeviceKind::kAuto, "auto"}, {DeviceKind::kCpu, "cpu"}, {DeviceKind::kCuda, "cuda"}};
};

// auto → cuda when a GPU is visible, else cpu; cpu; cuda (UserError if no GPU is visible).
c10::Device device_resolve(DeviceKind kind);

struct MemoryStats {
  int64_t allocated_bytes = 0;       // now
  int64_t peak_allocated_bytes = 0;  // since the last memory_stats_reset_peak
  int64_t reserved_bytes = 0;        // held by the caching allocator
  int64_t peak_reserved_bytes = 0;   // since the last memory_stats_reset_peak
  int64_t device_total_bytes = 0;    // the card's capacity
  // cudaMalloc retries after the allocator freed its whole cache (a sign of working near --vram-budget: each one
  // synchronizes the device), since the process started.
  int64_t alloc_retries = 0;
};

// All zero on the CPU.
MemoryStats memory_stats(const c10::Device& device);
void memory_stats_reset_peak(const c10::Device& device);

// Returns the caching allocator's unused blocks to the device (after an out-of-memory error). No-op on the CPU.
void memory_cache_release(const c10::Device& device);

// Caps what the caching allocator may reserve on the device at `bytes` (--vram-budget): an allocation that would
// pass it frees cached blocks and then raises c10::OutOfMemoryError, which the trainer turns into a smaller batch.
// A no-op on the CPU. Throws UserError when the device has less memory than `bytes`.
void memory_cap_set(const c10::Device& device, int64_t bytes);

// Turns the caching allocator's expandable segments on for the scope (see MemoryCapScope), unless they are on already
// or a PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF names them (the user's choice). A session under a --vram-budget
// holds one from its start, so what it allocates before the cap (weights, NeuroFlux's memory profile) sits in them
// too: with them turned on only at the cap, those blocks sit in plain segments whose freed gaps stay reserved under
// it, and a tight budget runs out of memory again and again (measured: docs/results/neuroflux.md). A no-op on the CPU.
class ExpandableSegmentsScope {
 public:
  explicit ExpandableSegmentsScope(const c10::Device& device);
  ~ExpandableSegmentsScope();
  ExpandableSegmentsScope(const ExpandableSegmentsScope&) = delete;
  ExpandableSegmentsScope& operator=(const ExpandableSegmentsScope&) = delete;

 private:
  bool set_ = false;  // this scope turned them on (and turns them off at its end)
};

// memory_cap_set for a scope: the allocator's previous cap comes back when the scope ends, so a run (or a test) with
// a --vram-budget leaves later work in the same process uncapped.
// With `expandable` the scope also turns the caching allocator's expandable segments on (new segments map pages into
// one growing address range, and pages freed inside a segment go back to the cap). Without them what fits under a
// cap is what fragmentation leaves: blocks freed inside segments that still hold a live block stay reserved, so a
// tight cap is reached with far less allocated and the step's CUDA graph may never fit (measured:
// docs/results/memory-planner.md). A PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF that names expandable_segments
// is the user's choice and is left alone.
class MemoryCapScope {
 public:
  MemoryCapScope(const c10::Device& device, int64_t bytes, bool expandable = true);
  ~MemoryCapScope();
  MemoryCapScope(const MemoryCapScope&) = delete;
  MemoryCapScope& operator=(const MemoryCapScope&) = delete;

 private:
  c10::Device device_;
  double previous_fraction_ = 1.0;
  std::optional<ExpandableSegmentsScope> expandable_;
};

// A transient lever under a vram_budget: cuBLAS's workspace becomes one 4 MiB chunk instead of Hopper's 32 MiB per
// stream (it comes out of the caching allocator). Takes effect only before the process's first cuBLAS call; a user's
// CUBLAS_WORKSPACE_CONFIG stays.
void cublas_workspace_small();

// Frees the workspaces cuBLAS and cuBLASLt keep per (handle, stream) in the caching allocator (32 MiB each on Hopper
// by default). A run takes a fresh stream from the pool, so without this every run in one process (the Python
// module's train() calls) left its workspaces allocated after it ended. Synchronizes the device first. No-op on the
// CPU.
void cublas_workspaces_release(const c10::Device& device);

// Whether the caching allocator makes expandable segments now (false on the CPU).
bool memory_expandable_segments();

// A diagnostic (TRIACCEL_MEMORY_HISTORY, docs/measuring.md): the caching allocator records its last `max_entries`
// allocations and frees, each with its C++ stack; memory_history_write writes them and the blocks alive now as
// PyTorch's memory snapshot (a pickle: bench/memory_peak.py, torch.cuda._memory_viz). No-ops on the CPU.
void memory_history_start(const c10::Device& device, size_t max_entries);
void memory_history_write(const c10::Device& device, const std::string& path);
// Drops the recorded events (not the stacks of the blocks alive): the next snapshot's events start here.
void memory_history_clear(const c10::Device& device);

// "NVIDIA H100 80GB HBM3" → "h100"; "cpu" on the CPU. Used for bench/results/<gpu>/.
std::string device_short_name(const c10::Device& device);
std::string device_long_name(const c10::Device& device);

void device_synchronize(const c10::Device& device);

}  // namespace triaccel
