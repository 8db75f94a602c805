// Tolerant reading of one run's events.jsonl for reports. Unlike events_read (train/telemetry.h), nothing here
// throws for a bad file: a missing, empty or unreadable file, a line that is not JSON, a cut-off last line or a line
// without "event" becomes a problem (one line naming the file, the line and the fix) and the rest of the run is kept.
#pragma once

#include "triaccel/core/json.h"

#include <string>
#include <vector>

namespace triaccel {

struct RunEvents {
  std::string name;                   // shown in the page: the run folder's name, or the file's name less .events.jsonl
  std::string file;                   // the events file read (RUN_DIR/events.jsonl, or the file given)
  std::vector<Json> events;           // every line that parsed to an object with "event", in file order
  std::vector<std::string> problems;  // one line each, in the order found
};

// Reads a run folder (its events.jsonl) or an events file; never throws for bad input.
RunEvents run_events_read(const std::string& run_path);

// Gives runs that share a name a " (2)", " (3)", ... suffix so that every run is told apart in the page.
void run_names_make_unique(std::vector<RunEvents>& runs);

}  // namespace triaccel
