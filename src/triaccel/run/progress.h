// Progress on stderr: a bar redrawn in place on a terminal, or a plain line every log_every steps, or nothing.
#pragma once

#include "triaccel/run/config.h"

#include <cstdint>
#include <functional>
#include <string>

namespace triaccel {

// How a front end spells an option named in a message (core/errors.h option_ref): the CLI's flag, or the key.
using OptionSpelling = std::function<std::string(const std::string& key)>;

class ProgressPrinter {
 public:
  // spell: how lines spell the options they name (empty: by key).
  ProgressPrinter(ProgressMode mode, OptionSpelling spell);
  void step(int64_t epoch, int64_t epochs, int64_t done, int64_t total, double loss, double lr, double img_s);
  void line(const std::string& text);

 private:
  bool bar_ = false;
  bool off_ = false;
  OptionSpelling spell_;
};

}  // namespace triaccel
