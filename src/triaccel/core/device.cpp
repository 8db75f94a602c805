#include "triaccel/core/device.h"

#include "triaccel/core/context_trace.h"
#include "triaccel/core/errors.h"

#include <ATen/Context.h>
#include <torch/cuda.h>
#ifdef TRIACCEL_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/cuda/memory_snapshot.h>
#endif

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

namespace triaccel {

c10::Device device_resolve(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kCpu: return c10::Device(c10::kCPU);
    case DeviceKind::kAuto:
      return torch::cuda::is_available() ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
    case DeviceKind::kCuda:
      TRIACCEL_CHECK_INPUT(torch::cuda::is_available(), option_ref("device"),
                           " cuda: no CUDA GPU is visible; use cpu or auto");
      return c10::Device(c10::kCUDA, 0);
  }
  return c10::Device(c10::kCPU);
}

MemoryStats memory_stats(const c10::Device& device) {
  MemoryStats s;
#ifdef TRIACCEL_WITH_CUDA
  if (device.is_cuda()) {
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);  // the allocator exists only after CUDA init
    using c10::CachingAllocator::StatType;
    const auto st = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    const auto agg = static_cast<size_t>(StatType::AGGREGATE);
    s.allocated_bytes = st.allocated_bytes[agg].current;
    s.peak_allocated_bytes = st.allocated_bytes[agg].peak;
    s.reserved_bytes = st.reserved_bytes[agg].current;
    s.peak_reserved_bytes = st.reserved_bytes[agg].peak;
    s.device_total_bytes = static_cast<int64_t>(at::cuda::getDeviceProperties(device.index())->totalGlobalMem);
    s.alloc_retries = st.num_alloc_retries;
  }
#endif
  return s;
}

void memory_stats_reset_peak(const c10::Device& device) {
#ifdef TRIACCEL_WITH_CUDA
  if (device.is_cuda()) {
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
  }
#endif
}

void memory_cache_release(const c10::Device& device) {
#ifdef TRIACCEL_WITH_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

void cublas_workspaces_release(const c10::Device& device) {
#ifdef TRIACCEL_WITH_CUDA
  if (!device.is_cuda() || !c10::cuda::hasPrimaryContext(device.index())) return;
  c10::cuda::device_synchronize();
  at::cuda::clearCublasWorkspaces();
#endif
}

void memory_cap_set(const c10::Device& device, int64_t bytes) {
#ifdef TRIACCEL_WITH_CUDA
  if (device.is_cuda()) {
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    const auto total = static_cast<double>(at::cuda::getDeviceProperties(device.index())->totalGlobalMem);
    TRIACCEL_CHECK_INPUT(static_cast<double>(bytes) <= total, option_ref("vram_budget"), " ", static_cast<double>(bytes) / 1e9,
                         " GB is more than this GPU has (", total / 1e9, " GB); lower it or drop the flag");
    c10::cuda::CUDACachingAllocator::setMemoryFraction(static_cast<double>(bytes) / total, device.index());
  }
#endif
}

#ifdef TRIACCEL_WITH_CUDA
namespace {

bool user_names_expandable_segments() {
  for (const char* name : {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && std::string(v).find("expandable_segments") != std::string::npos) return true;
  }
  return false;
}

}  // namespace
#endif

void cublas_workspace_small() { setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:1", /*overwrite=*/0); }

void context_trace(const char* where) {
#ifdef TRIACCEL_WITH_CUDA
  static const bool on = std::getenv("TRIACCEL_TRACE_CONTEXTS") != nullptr;
  if (!on) return;
  static std::mutex mutex;  // ranks as threads (tests) share the last reading
  static std::string last;
  const std::lock_guard<std::mutex> lock(mutex);
  std::string held;
  for (c10::DeviceIndex d = 0; d < c10::cuda::device_count(); ++d) {
    if (c10::cuda::hasPrimaryContext(d)) held += (held.empty() ? "" : ",") + std::to_string(d);
  }
  if (held == last) return;
  last = held;
  std::fprintf(stderr, "[contexts] pid %d: GPUs {%s} at %s\n", static_cast<int>(getpid()), held.c_str(), where);
#else
  (void)where;
#endif
}

bool memory_expandable_segments() {
#ifdef TRIACCEL_WITH_CUDA
  return c10::CachingAllocator::AcceleratorAllocatorConfig::use_expandable_segments();
#else
  return false;
#endif
}

#ifdef TRIACCEL_WITH_CUDA
namespace {
size_t history_entries = 0;  // memory_history_start's
}  // namespace
#endif

void memory_history_start(const c10::Device& device, size_t max_entries) {
#ifdef TRIACCEL_WITH_CUDA
  history_entries = max_entries;
  if (device.is_cuda()) torch::cuda::_record_memory_history("all", "all", "all", max_entries);
#else
  (void)device;
  (void)max_entries;
#endif
}

void memory_history_clear(const c10::Device& device) {
#ifdef TRIACCEL_WITH_CUDA
  if (device.is_cuda() && history_entries > 0) {
    torch::cuda::_record_memory_history("all", "all", "all", history_entries, /*clearHistory=*/true);
  }
#else
  (void)device;
#endif
}

void memory_history_write(const c10::Device& device, const std::string& path) {
#ifdef TRIACCEL_WITH_CUDA
  if (!device.is_cuda()) return;
  const std::string pickled = torch::cuda::_memory_snapshot_pickled();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  TORCH_CHECK(f, "cannot write the memory snapshot ", path);
  std::fwrite(pickled.data(), 1, pickled.size(), f);
  std::fclose(f);
#else
  (void)device;
  (void)path;
#endif
}

MemoryCapScope::MemoryCapScope(const c10::Device& device, int64_t bytes, bool expandable) : device_(device) {
#ifdef TRIACCEL_WITH_CUDA
  if (device.is_cuda()) {
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    previous_fraction_ = c10::cuda::CUDACachingAllocator::getMemoryFraction(device.index());
  }
#endif
  memory_cap_set(device, bytes);
  if (expandable) expandable_.emplace(device);
}

MemoryCapScope::~MemoryCapScope() {
#ifdef TRIACCEL_WITH_CUDA
  if (device_.is_cuda()) c10::cuda::CUDACachingAllocator::setMemoryFraction(previous_fraction_, device_.index());
#endif
}

ExpandableSegmentsScope::ExpandableSegmentsScope(const c10::Device& device) {
#ifdef TRIACCEL_WITH_CUDA
  if (device.is_cuda() && !memory_expandable_segments() && !user_names_expandable_segments()) {
    c10::CachingAllocator::setAllocatorSettings("expandable_segments:True");
    set_ = true;
  }
#else
  (void)device;
#endif
}

ExpandableSegmentsScope::~ExpandableSegmentsScope() {
#ifdef TRIACCEL_WITH_CUDA
  if (set_) c10::CachingAllocator::setAllocatorSettings("expandable_segments:False");
#endif
}

std::string device_long_name(const c10::Device& device) {
#ifdef TRIACCEL_WITH_CUDA
  if (device.is_cuda()) return at::cuda::getDeviceProperties(device.index())->name;
#endif
  return "cpu";
}

std::string device_short_name(const c10::Device& device) {
  std::string name = device_long_name(device);
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  for (const char* known : {"h100", "h200", "a100", "l4", "a10g", "t4", "v100"}) {
    if (name.find(known) != std::string::npos) return known;
  }
  std::string out;
  for (char c : name) out += std::isalnum(static_cast<unsigned char>(c)) ? c : '-';
  return out;
}

void device_synchronize(const c10::Device& device) {
#ifdef TRIACCEL_WITH_CUDA
  if (device.is_cuda()) c10::cuda::device_synchronize();
#endif
}

}  // namespace triaccel
