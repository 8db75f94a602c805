// A timeline of chosen training steps (the `profile_steps` option): PyTorch's profiler (Kineto, with CUPTI on a GPU)
// records the host's operators and ranges and every GPU kernel and copy, including those a CUDA graph replays and
// NCCL's, and writes them as a Chrome trace (chrome://tracing, Perfetto; bench/trace_summary.py sums it up).
#pragma once

#include <ATen/record_function.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace triaccel {

// "FIRST:END" → {FIRST, END}: the steps FIRST .. END-1 (global step counts, as in the events). UserError naming
// `option` for anything else (not two integers, FIRST < 0, END <= FIRST). "" → nullopt.
std::optional<std::pair<int64_t, int64_t>> profile_steps_parse(const std::string& text, const std::string& option);

// Traces [first, end) of a run's steps into `path`. at_step(s) is called before each step (a retried step again):
// the trace starts at `first` and is written at `end` (after the GPU finished the steps), or by finish() / the
// destructor when the run ends inside the window. Only one trace runs in a process at a time.
class StepProfiler {
 public:
  StepProfiler(std::pair<int64_t, int64_t> steps, std::string path, c10::Device device);
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Returns true when this call wrote the trace (the caller reports it).
  bool at_step(int64_t step);
  // Writes the trace if one is running; true when it did.
  bool finish();
  // The steps traced: [first, the step at which it stopped).
  std::pair<int64_t, int64_t> traced() const { return {first_, stopped_at_}; }
  const std::string& path() const { return path_; }

 private:
  int64_t first_;
  int64_t end_;
  int64_t last_seen_ = -1;
  int64_t stopped_at_ = -1;
  std::string path_;
  c10::Device device_;
  bool running_ = false;
  bool written_ = false;
};

// A named range on the host's timeline of a trace (a no-op unless a trace is running): e.g. "triaccel::step".
#define TRIACCEL_PROFILE_RANGE(name) RECORD_USER_SCOPE(name)

}  // namespace triaccel
