// events.jsonl: one JSON object per line, each with "event", "step" and "time_s" first (docs/architecture.md,
// "Events"); the writer, the reader and the names of every event, declared once here. They live in core/ because
// both the engine that writes them (train/, control/, methods/) and the report that reads them use them.
// Lines are flushed as they are written, so a crashed run keeps every event up to the crash.
#pragma once

#include "triaccel/core/json.h"

#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace triaccel {

// The event names. Each event's fields are described where it is written and in docs/architecture.md.
namespace event {
inline constexpr const char* kConfig = "config";          // first line of a run: the resolved configuration
inline constexpr const char* kResume = "resume";          // first line of a resumed session
inline constexpr const char* kEpoch = "epoch";            // per epoch: losses, accuracy, time, memory
inline constexpr const char* kCheckpoint = "checkpoint";  // a checkpoint was written
inline constexpr const char* kOom = "oom";                // an out-of-memory error and what was done about it
inline constexpr const char* kSkip = "skip";              // a step skipped for an inf/NaN (fault handling)
inline constexpr const char* kStop = "stop";              // the run stopped before its end (--max-steps, a signal)
inline constexpr const char* kSummary = "summary";        // last line of a finished run
inline constexpr const char* kPrecision = "precision";    // Tri-Accel: per-unit precision decisions
inline constexpr const char* kCurvature = "curvature";    // Tri-Accel: a curvature probe and the lr scales
inline constexpr const char* kBatch = "batch";            // Tri-Accel: the elastic batch controller's window
inline constexpr const char* kOptimPlan = "optim_plan";   // BAOC: the optimizer-state plan
inline constexpr const char* kBlockPlan = "block_plan";   // NeuroFlux: the blocks, their batches and heads
inline constexpr const char* kBlock = "block";            // NeuroFlux: a block finished
inline constexpr const char* kExit = "exit";              // NeuroFlux: the exported early exit
inline constexpr const char* kMemoryPlan = "memory_plan";  // the memory planner: its levers, predicted and measured peak
inline constexpr const char* kProfile = "profile";        // a timeline of chosen steps was written (profile_steps)
// Written by runs before the two plans had their own names (still read: tests/fixtures/report/ holds such files).
inline constexpr const char* kLegacyPlan = "plan";
}  // namespace event

// One event to write: its name (event::k*) and its fields.
struct Event {
  const char* name;
  Json fields;
};
using Events = std::vector<Event>;

class EventLog {
 public:
  // append = false starts a new file (a fresh run); true continues an existing one (a resumed run).
  EventLog(const std::string& path, bool append);

  void write(const char* event, int64_t step, double time_s, const Json& fields);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ofstream out_;
};

// Reads every event of a file (for tests and reports); throws UserError naming the line that does not parse.
std::vector<Json> events_read(const std::string& path);

}  // namespace triaccel
