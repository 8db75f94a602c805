#include "triaccel/core/clock.h"

#include "triaccel/core/io.h"

namespace triaccel {
namespace {

class SteadyClock : public Clock {
 public:
  double now_s() const override { return time_since_start_s(); }
};

}  // namespace

const Clock& steady_clock() {
  static const SteadyClock clock;
  return clock;
}

}  // namespace triaccel
