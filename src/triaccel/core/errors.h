// User-facing errors. Library code throws UserError for anything the user can fix (a file, an option, a budget); the
// front end (the CLI, the Python module) prints or raises its message as one line. Internal bugs stay c10::Error.
//
// Options are named by their configuration key (`vram_budget`), never by a front end's spelling of it: a message
// marks each key with option_ref(), what() shows the plain key, and a front end renders the marks its own way
// (UserError::message: the CLI writes `--vram-budget`, Python `vram_budget`).
// Neither this header nor errors.cpp needs LibTorch (the fuzz targets link them).
#pragma once

#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>

namespace triaccel {

constexpr int kExitUserError = 2;
constexpr int kExitInternalError = 1;
// Stopped early on request (SIGINT, SIGTERM) after writing a checkpoint: resume to continue.
constexpr int kExitStopped = 3;

// A configuration key inside an error message, marked so that a front end can spell it ("vram_budget" on its own,
// "--vram-budget" in the CLI).
std::string option_ref(const std::string& key);

// The message with every option_ref mark rendered by `spell` (key → how the front end writes it).
std::string option_render(const std::string& marked, const std::function<std::string(const std::string&)>& spell);

class UserError : public std::runtime_error {
 public:
  // `message` may hold option_ref marks; what() shows their plain keys.
  explicit UserError(const std::string& message);

  // The message with the options spelled by `spell`.
  std::string message(const std::function<std::string(const std::string&)>& spell) const {
    return option_render(marked_, spell);
  }

 private:
  std::string marked_;
};

// Streams every argument into one string (what c10::str does, without LibTorch).
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream ss;
  (ss << ... << args);
  return ss.str();
}

// Throws UserError with the concatenated message when cond is false:
//   TRIACCEL_CHECK_INPUT(n > 0, option_ref("batch_size"), " must be > 0, got ", n)
#define TRIACCEL_CHECK_INPUT(cond, ...)                              \
  do {                                                               \
    if (!(cond)) throw ::triaccel::UserError(::triaccel::str_cat(__VA_ARGS__)); \
  } while (0)

// Converts any exception into one line (newlines folded; option marks shown as plain keys).
std::string error_one_line(const std::exception& e);

}  // namespace triaccel
