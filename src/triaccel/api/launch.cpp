#include "triaccel/api/launch.h"

#include "triaccel/core/errors.h"
#include "triaccel/run/session.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace triaccel::api {
namespace {

volatile sig_atomic_t g_forward_signal = 0;
void on_launcher_signal(int sig) { g_forward_signal = sig; }

void signal_all(const std::vector<pid_t>& pids, const std::vector<bool>& running, int sig) {
  for (size_t r = 0; r < pids.size(); ++r) {
    if (running[r]) kill(pids[r], sig);
  }
}

}  // namespace

bool launch_needed(const Config& config) {
  const char* rank = std::getenv("RANK");
  return config.execution.nproc > 1 && (rank == nullptr || *rank == '\0');
}

LaunchResult launch(const Config& config, const std::vector<std::string>& argv) {
  config_for_run(config).validate();  // an option error is reported once, not by every rank
  const int n = static_cast<int>(config.execution.nproc);
  const int port = free_local_port();
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);

  struct sigaction sa {};
  sa.sa_handler = on_launcher_signal;
  sigemptyset(&sa.sa_mask);
  struct sigaction old_int {}, old_term {};
  sigaction(SIGTERM, &sa, &old_term);
  sa.sa_handler = SIG_IGN;  // the terminal sends SIGINT to every rank too: they stop at a step with a checkpoint
  sigaction(SIGINT, &sa, &old_int);

  std::vector<pid_t> pids(n, -1);
  std::vector<bool> running(n, false);
  for (int r = 0; r < n; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      sigaction(SIGINT, &old_int, nullptr);
      sigaction(SIGTERM, &old_term, nullptr);
      setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(n).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      // As torchrun does: the host's cores shared among the ranks unless the user set it.
      const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
      setenv("OMP_NUM_THREADS", std::to_string(std::max(1u, cores / static_cast<unsigned>(n))).c_str(), 0);
      execv("/proc/self/exe", args.data());
      _exit(127);
    }
    if (pid < 0) {
      signal_all(pids, running, SIGKILL);
      throw UserError(str_cat(option_ref("nproc"), " ", n, ": could not start rank ", r, " (", std::strerror(errno),
                              "); use fewer processes"));
    }
    pids[r] = pid;
    running[r] = true;
  }

  LaunchResult result;
  int alive = n;
  bool stopping = false;
  std::chrono::steady_clock::time_point kill_at{};
  while (alive > 0) {
    if (g_forward_signal != 0) {
      signal_all(pids, running, g_forward_signal);
      g_forward_signal = 0;
    }
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid <= 0) {
      if (stopping && std::chrono::steady_clock::now() >= kill_at) signal_all(pids, running, SIGKILL);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    int r = 0;
    while (r < n && pids[r] != pid) ++r;
    if (r == n) continue;
    running[r] = false;
    alive -= 1;
    const bool signalled = WIFSIGNALED(status);
    const int code = signalled ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
    if (code == 0 || result.failed_rank >= 0) continue;
    if (code == kExitStopped && !signalled) {  // stopped by a request: the others stop at the same step
      result.exit_code = code;
      continue;
    }
    result.exit_code = code;
    result.failed_rank = r;
    result.by_signal = signalled;
    if (!stopping && alive > 0) {  // any other failure stops the others
      stopping = true;
      signal_all(pids, running, SIGTERM);
      kill_at = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    }
  }
  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);
  return result;
}

}  // namespace triaccel::api
