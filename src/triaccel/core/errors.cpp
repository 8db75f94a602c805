#include "triaccel/core/errors.h"

namespace triaccel {
namespace {

// Control characters no option name or message text contains.
constexpr char kOpen = '\x01';
constexpr char kClose = '\x02';

std::string plain_key(const std::string& key) { return key; }

}  // namespace

std::string option_ref(const std::string& key) { return std::string(1, kOpen) + key + kClose; }

std::string option_render(const std::string& marked, const std::function<std::string(const std::string&)>& spell) {
  std::string out;
  size_t i = 0;
  while (i < marked.size()) {
    const size_t open = marked.find(kOpen, i);
    const size_t close = open == std::string::npos ? std::string::npos : marked.find(kClose, open + 1);
    if (close == std::string::npos) {
      out += marked.substr(i);
      break;
    }
    out += marked.substr(i, open - i);
    out += spell(marked.substr(open + 1, close - open - 1));
    i = close + 1;
  }
  return out;
}

UserError::UserError(const std::string& message)
    : std::runtime_error(option_render(message, plain_key)), marked_(message) {}

std::string error_one_line(const std::exception& e) {
  // A c10::Error's what() is its message, then context and the C++ stack trace on later lines: the first line is
  // the message, so no LibTorch is needed here (the fuzz targets link this file without it).
  std::string msg = option_render(e.what(), plain_key);
  const auto nl = msg.find('\n');
  if (nl != std::string::npos) msg = msg.substr(0, nl);
  return msg;
}

}  // namespace triaccel
