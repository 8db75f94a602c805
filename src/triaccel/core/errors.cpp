#include "triaccel/core/errors.h"

#include <c10/util/Exception.h>

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
  std::string msg;
  if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) {
    msg = option_render(ce->msg(), plain_key);  // without the C++ stack trace
  } else {
    msg = e.what();
  }
  // Keep the first line of multi-line messages (c10 appends context lines).
  const auto nl = msg.find('\n');
  if (nl != std::string::npos) msg = msg.substr(0, nl);
  return msg;
}

}  // namespace triaccel
