#include "triaccel/api/stop_signals.h"

namespace triaccel::api {

namespace {

volatile sig_atomic_t g_stop_signal = 0;

void on_stop_signal(int sig) {
  if (g_stop_signal != 0) {
    signal(sig, SIG_DFL);
    raise(sig);
    return;
  }
  g_stop_signal = sig;
}

}  // namespace

StopSignals::StopSignals() {
  g_stop_signal = 0;
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGINT, &sa, &old_int_);
  sigaction(SIGTERM, &sa, &old_term_);
}

StopSignals::~StopSignals() {
  sigaction(SIGINT, &old_int_, nullptr);
  sigaction(SIGTERM, &old_term_, nullptr);
}

StopRequest StopSignals::requested() {
  switch (g_stop_signal) {
    case SIGINT: return StopRequest::kInterrupt;
    case SIGTERM: return StopRequest::kTerminate;
    default: return StopRequest::kNone;
  }
}

}  // namespace triaccel::api
