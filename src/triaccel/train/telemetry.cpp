#include "triaccel/train/telemetry.h"

#include "triaccel/core/errors.h"

namespace triaccel {

EventLog::EventLog(const std::string& path, bool append)
    : path_(path), out_(path, append ? std::ios::app : std::ios::trunc) {
  TRIACCEL_CHECK_INPUT(out_.good(), "cannot write ", path, "; choose a writable --out folder");
}

void EventLog::write(const std::string& event, int64_t step, double time_s, const Json& fields) {
  Json line{{"event", event}, {"step", step}, {"time_s", time_s}};
  for (const auto& [k, v] : fields.items()) line[k] = v;
  out_ << line.dump(-1, ' ', false, Json::error_handler_t::replace) << '\n';
  out_.flush();
  TRIACCEL_CHECK_INPUT(out_.good(), "writing ", path_, " failed (disk full?)");
}

std::vector<Json> events_read(const std::string& path) {
  std::ifstream in(path);
  TRIACCEL_CHECK_INPUT(in.good(), "cannot read ", path);
  std::vector<Json> events;
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    try {
      events.push_back(Json::parse(line));
    } catch (const std::exception& e) {
      throw UserError(c10::str(path, ": line ", n, " is not valid JSON (", e.what(), ")"));
    }
  }
  return events;
}

}  // namespace triaccel
