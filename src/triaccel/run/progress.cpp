#include "triaccel/run/progress.h"

#include "triaccel/core/errors.h"

#include <unistd.h>

#include <cstdio>

namespace triaccel {

ProgressPrinter::ProgressPrinter(ProgressMode mode, OptionSpelling spell) : spell_(std::move(spell)) {
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  bar_ = mode == ProgressMode::kBar || (mode == ProgressMode::kAuto && tty);
  off_ = mode == ProgressMode::kOff;
}

void ProgressPrinter::step(int64_t epoch, int64_t epochs, int64_t done, int64_t total, double loss, double lr,
                           double img_s) {
  if (off_) return;
  if (bar_) {
    const int width = 30;
    const int filled = total > 0 ? static_cast<int>(width * done / total) : 0;
    std::fprintf(stderr, "\repoch %lld/%lld [%s%s] %lld/%lld loss %.4f lr %.4g %.0f img/s   ",
                 static_cast<long long>(epoch + 1), static_cast<long long>(epochs), std::string(filled, '#').c_str(),
                 std::string(width - filled, '.').c_str(), static_cast<long long>(done),
                 static_cast<long long>(total), loss, lr, img_s);
  } else {
    std::fprintf(stderr, "epoch %lld/%lld step %lld/%lld loss %.4f lr %.4g %.0f img/s\n",
                 static_cast<long long>(epoch + 1), static_cast<long long>(epochs), static_cast<long long>(done),
                 static_cast<long long>(total), loss, lr, img_s);
  }
  std::fflush(stderr);
}

void ProgressPrinter::line(const std::string& text) {
  if (off_) return;
  const std::string shown =
      option_render(text, spell_ ? spell_ : OptionSpelling([](const std::string& key) { return key; }));
  std::fprintf(stderr, "%s%s\n", bar_ ? "\r" : "", shown.c_str());
  std::fflush(stderr);
}

}  // namespace triaccel
