// SIGINT and SIGTERM while a run trains, for a front end's RunHooks::stop_requested (the CLI, the Python module): the
// first signal is recorded and the run stops after the step in flight with a checkpoint; a second takes the signal's
// default action at once (the last complete checkpoint stays valid: checkpoints are written to a temporary file and
// renamed). The handlers in place before are put back when the StopSignals ends (Python's own, in the module).
#pragma once

#include "triaccel/run/session.h"

#include <signal.h>

namespace triaccel::api {

class StopSignals {
 public:
  StopSignals();  // installs the handlers and forgets any signal recorded before
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // What was received since the newest StopSignals was made: kInterrupt (SIGINT), kTerminate (SIGTERM) or kNone.
  static StopRequest requested();

 private:
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

}  // namespace triaccel::api
