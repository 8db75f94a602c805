#include "triaccel/report/run_events.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

namespace triaccel {
namespace {

namespace fs = std::filesystem;

constexpr const char* kEventsFile = "events.jsonl";
constexpr const char* kEventsSuffix = ".events.jsonl";
constexpr size_t kLinesNamed = 5;  // bad lines named one by one before "and N more"

std::string run_name_of(const fs::path& given, bool is_dir) {
  fs::path p = given.lexically_normal();
  if (!p.has_filename()) p = p.parent_path();  // "runs/r18/" → "runs/r18"
  if (is_dir) return p.filename().string();
  const std::string file = p.filename().string();
  if (file == kEventsFile) {
    const std::string parent = p.parent_path().filename().string();
    return parent.empty() ? file : parent;
  }
  const std::string suffix = kEventsSuffix;
  if (file.size() > suffix.size() && file.compare(file.size() - suffix.size(), suffix.size(), suffix) == 0) {
    return file.substr(0, file.size() - suffix.size());
  }
  return p.stem().string();
}

std::string line_list(const std::vector<int64_t>& lines) {
  std::ostringstream s;
  s << (lines.size() == 1 ? "line " : "lines ");
  for (size_t i = 0; i < lines.size() && i < kLinesNamed; ++i) s << (i ? ", " : "") << lines[i];
  if (lines.size() > kLinesNamed) s << " and " << lines.size() - kLinesNamed << " more";
  s << (lines.size() == 1 ? " is" : " are");
  return s.str();
}

}  // namespace

RunEvents run_events_read(const std::string& run_path) {
  RunEvents run;
  std::error_code ec;
  const fs::path given(run_path);
  const bool is_dir = fs::is_directory(given, ec);
  run.name = run_name_of(given, is_dir);
  run.file = is_dir ? (given / kEventsFile).string() : run_path;
  if (!fs::exists(given, ec)) {
    run.problems.push_back(run_path + ": not found; give a run folder written by `triaccel train --out DIR` (it holds "
                           "events.jsonl) or an events.jsonl file");
    return run;
  }
  if (is_dir && !fs::exists(run.file, ec)) {
    run.problems.push_back(run.file + ": not found; is " + run_path +
                           " a run folder (`triaccel train --out DIR`)? The run may not have started");
    return run;
  }
  if (fs::is_directory(run.file, ec)) {
    run.problems.push_back(run.file + ": is a folder, not an events file; give the run folder that holds events.jsonl");
    return run;
  }
  std::ifstream in(run.file, std::ios::binary);
  if (!in.good()) {
    run.problems.push_back(run.file + ": cannot be read; check its permissions");
    return run;
  }
  std::ostringstream whole;
  whole << in.rdbuf();
  const std::string text = whole.str();
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) {
    run.problems.push_back(run.file + ": empty; the run wrote no events (did it start, or is it still loading data?)");
    return run;
  }

  std::vector<int64_t> not_json, not_event;
  int64_t cut_off = 0;
  size_t begin = 0;
  int64_t n = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    const bool last_unterminated = end == std::string::npos;
    if (last_unterminated) end = text.size();
    const std::string line = text.substr(begin, end - begin);
    begin = end + 1;
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    Json event;
    try {
      event = Json::parse(line);
    } catch (const std::exception&) {
      if (last_unterminated) {
        cut_off = n;
      } else {
        not_json.push_back(n);
      }
      continue;
    }
    if (!event.is_object() || !event.contains("event") || !event["event"].is_string()) {
      not_event.push_back(n);
      continue;
    }
    run.events.push_back(std::move(event));
  }
  if (!not_json.empty()) {
    run.problems.push_back(run.file + ": " + line_list(not_json) + " not valid JSON; skipped (was the file edited or "
                           "written by two runs at once?)");
  }
  if (!not_event.empty()) {
    run.problems.push_back(run.file + ": " + line_list(not_event) + " not an event (a JSON object with a string "
                           "\"event\"); skipped");
  }
  if (cut_off > 0) {
    run.problems.push_back(run.file + ": the last line (" + std::to_string(cut_off) +
                           ") is cut off; ignored (the run was stopped while writing, or is still running)");
  }
  if (run.events.empty() && run.problems.empty()) {
    run.problems.push_back(run.file + ": holds no events");
  }
  return run;
}

void run_names_make_unique(std::vector<RunEvents>& runs) {
  std::map<std::string, int> seen;
  for (auto& r : runs) {
    const int k = ++seen[r.name];
    if (k > 1) r.name += " (" + std::to_string(k) + ")";
  }
}

}  // namespace triaccel
