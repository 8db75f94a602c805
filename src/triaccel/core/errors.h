// User-facing errors. Library code throws UserError for anything the user can fix (a file, a flag, a budget);
// main() prints its message as one line and exits with kExitUserError. Internal bugs stay c10::Error.
// This header needs no LibTorch (the fuzz targets include it); error_one_line (errors.cpp) does.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace triaccel {

constexpr int kExitUserError = 2;
constexpr int kExitInternalError = 1;

class UserError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Streams every argument into one string (what c10::str does, without LibTorch).
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream ss;
  (ss << ... << args);
  return ss.str();
}

// Throws UserError with the concatenated message when cond is false: TRIACCEL_CHECK_INPUT(n > 0, "--batch-size must be > 0, got ", n)
#define TRIACCEL_CHECK_INPUT(cond, ...)                              \
  do {                                                               \
    if (!(cond)) throw ::triaccel::UserError(::triaccel::str_cat(__VA_ARGS__)); \
  } while (0)

// Converts any exception into the one line that main() prints (newlines folded).
std::string error_one_line(const std::exception& e);

}  // namespace triaccel
