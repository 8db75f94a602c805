#include "triaccel/core/errors.h"

#include <c10/util/Exception.h>

namespace triaccel {

std::string error_one_line(const std::exception& e) {
  std::string msg;
  if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) {
    msg = ce->msg();  // without the C++ stack trace
  } else {
    msg = e.what();
  }
  // Keep the first line of multi-line messages (c10 appends context lines).
  const auto nl = msg.find('\n');
  if (nl != std::string::npos) msg = msg.substr(0, nl);
  return msg;
}

}  // namespace triaccel
