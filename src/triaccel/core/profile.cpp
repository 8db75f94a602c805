#include "triaccel/core/profile.h"

#include "triaccel/core/device.h"
#include "triaccel/core/errors.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <charconv>
#include <filesystem>
#include <set>
#include <system_error>

namespace triaccel {

namespace {

namespace prof = torch::profiler::impl;

bool parse_int(const std::string& s, int64_t* out) {
  if (s.empty()) return false;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && end == s.data() + s.size();
}

std::set<prof::ActivityType> activities_for(const c10::Device& device) {
  std::set<prof::ActivityType> a{prof::ActivityType::CPU};
  if (device.is_cuda()) a.insert(prof::ActivityType::CUDA);
  return a;
}

}  // namespace

std::optional<std::pair<int64_t, int64_t>> profile_steps_parse(const std::string& text, const std::string& option) {
  if (text.empty()) return std::nullopt;
  const size_t colon = text.find(':');
  int64_t first = -1;
  int64_t end = -1;
  const bool ok = colon != std::string::npos && parse_int(text.substr(0, colon), &first) &&
                  parse_int(text.substr(colon + 1), &end) && first >= 0 && end > first;
  TRIACCEL_CHECK_INPUT(ok, option, " must be FIRST:END with 0 <= FIRST < END (the steps FIRST to END-1 are traced, "
                       "e.g. 200:220), got '", text, "'");
  return std::make_pair(first, end);
}

StepProfiler::StepProfiler(std::pair<int64_t, int64_t> steps, std::string path, c10::Device device)
    : first_(steps.first), end_(steps.second), path_(std::move(path)), device_(device) {}

StepProfiler::~StepProfiler() {
  try {
    finish();
  } catch (...) {  // a destructor must not throw; a trace lost at teardown is only a diagnostic
  }
}

bool StepProfiler::at_step(int64_t step) {
  if (written_ || step == last_seen_) return false;  // a retried step does not move the window
  last_seen_ = step;
  if (!running_ && step >= first_ && step < end_) {
    const prof::ProfilerConfig config(prof::ProfilerState::KINETO);
    torch::autograd::profiler::prepareProfiler(config, activities_for(device_));
    device_synchronize(device_);  // the trace starts with the GPU idle: no earlier step's kernels in it
    torch::autograd::profiler::enableProfiler(config, activities_for(device_));
    running_ = true;
    first_ = step;
    return false;
  }
  if (running_ && step >= end_) {
    stopped_at_ = step;
    return finish();
  }
  return false;
}

bool StepProfiler::finish() {
  if (!running_) return false;
  if (stopped_at_ < 0) stopped_at_ = last_seen_ + 1;
  device_synchronize(device_);  // the last step's kernels end before the trace does
  running_ = false;
  written_ = true;
  auto result = torch::autograd::profiler::disableProfiler();
  const std::filesystem::path parent = std::filesystem::path(path_).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);  // a rank on another host than rank 0
  result->save(path_);
  return true;
}

}  // namespace triaccel
