// The command line's launcher of data-parallel ranks (`triaccel train --nproc N`, docs/distributed.md): N copies of
// this program on this host, each with the torchrun-style environment core/dist reads (RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT: a free port). It waits for them; when one fails,
// it stops the others and names the rank. A cluster launcher (torchrun, Slurm) sets the same variables itself.
#pragma once

#include "triaccel/run/config.h"

#include <string>
#include <vector>

namespace triaccel::api {

// Whether `config` asks this process to start the ranks: nproc > 1, and it is not one of them (no RANK set).
bool launch_needed(const Config& config);

struct LaunchResult {
  int exit_code = 0;       // 0 when every rank exited 0; else the first failed rank's code (128 + signal if killed)
  int failed_rank = -1;    // the first rank that failed (-1: none)
  bool by_signal = false;  // it was killed by a signal (exit_code - 128)
};

// Checks the options once (UserError, before any rank starts), then runs `argv` (this program's arguments, argv[0]
// first) in nproc processes and waits for them. SIGTERM to the launcher is passed on to every rank; SIGINT reaches
// the ranks from the terminal. A rank that fails stops the others (SIGTERM, then SIGKILL after 10 s).
LaunchResult launch(const Config& config, const std::vector<std::string>& argv);

}  // namespace triaccel::api
