#include "triaccel/core/events.h"

#include "triaccel/core/errors.h"

#include <filesystem>
#include <fstream>
#include <iterator>

namespace triaccel {

namespace {

// A process killed while it wrote an event may leave a last line without its newline: appending after it would
// glue two events into one invalid line. Cut the file back to its last complete line before appending.
std::string drop_partial_last_line(const std::string& path) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec || size == 0) return path;
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.empty() || bytes.back() == '\n') return path;
  const auto nl = bytes.rfind('\n');
  std::filesystem::resize_file(path, nl == std::string::npos ? 0 : nl + 1, ec);
  return path;
}

}  // namespace

EventLog::EventLog(const std::string& path, bool append)
    : path_(path), out_(append ? drop_partial_last_line(path) : path, append ? std::ios::app : std::ios::trunc) {
  TRIACCEL_CHECK_INPUT(out_.good(), "cannot write ", path, "; choose a writable ", option_ref("out"), " folder");
}

void EventLog::write(const char* event, int64_t step, double time_s, const Json& fields) {
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
      throw UserError(str_cat(path, ": line ", n, " is not valid JSON (", e.what(), ")"));
    }
  }
  return events;
}

}  // namespace triaccel
