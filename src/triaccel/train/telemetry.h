// events.jsonl: one JSON object per line, each with "event", "step" and "time_s" first (DESIGN.md, Telemetry).
// Lines are flushed as they are written, so a crashed run keeps every event up to the crash.
#pragma once

#include "triaccel/core/json.h"

#include <cstdint>
#include <fstream>
#include <string>

namespace triaccel {

class EventLog {
 public:
  // append = false starts a new file (a fresh run); true continues an existing one (a resumed run).
  EventLog(const std::string& path, bool append);

  void write(const std::string& event, int64_t step, double time_s, const Json& fields);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ofstream out_;
};

// Reads every event of a file (for tests and reports); throws UserError naming the line that does not parse.
std::vector<Json> events_read(const std::string& path);

}  // namespace triaccel
