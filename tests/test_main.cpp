#include <gtest/gtest.h>
#include <torch/torch.h>

#include <csignal>
#include <cstdlib>
#include <execinfo.h>
#include <unistd.h>

#include <string>

namespace triaccel::test {

std::string source_dir() {
  const char* env = std::getenv("TRIACCEL_SOURCE_DIR");
  return env != nullptr && *env != '\0' ? env : TRIACCEL_SOURCE_DIR;
}

}  // namespace triaccel::test

namespace {

// A crash (the GPU machine has no debugger) prints the failing thread's stack to stderr before the process dies:
// addresses in the binary, which `addr2line -f -e triaccel_tests` or `nm -C` resolve on the build machine.
void crash_stack(int signal) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  const char header[] = "\n*** fatal signal; the stack:\n";
  (void)!write(STDERR_FILENO, header, sizeof(header) - 1);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}

}  // namespace

int main(int argc, char** argv) {
  // The data-parallel tests run their ranks as threads of this process, each with its own process groups. c10d's
  // flight recorder (a process-wide singleton) inserts a group into a std::map outside its mutex at the group's first
  // collective (FlightRecorder::recordWithResetEnabled, torch 2.11): two ranks' first collectives at once corrupted
  // it (a crash inside ProcessGroupGloo::enqueue in two of five runs of these tests on two H100s). A rank that is a
  // process of its own has one Gloo group and never meets this. Off here, before any group exists.
  setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0);
  setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0", /*overwrite=*/0);
  ::testing::InitGoogleTest(&argc, argv);
  at::set_num_threads(2);
#if !defined(__SANITIZE_ADDRESS__)  // under ASan (make test) its own report is better
  for (int s : {SIGSEGV, SIGBUS, SIGFPE, SIGILL}) std::signal(s, crash_stack);
#endif
  return RUN_ALL_TESTS();
}
