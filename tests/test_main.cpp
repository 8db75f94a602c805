#include <gtest/gtest.h>
#include <torch/torch.h>

#include <csignal>
#include <execinfo.h>
#include <unistd.h>

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
  ::testing::InitGoogleTest(&argc, argv);
  at::set_num_threads(2);
#if !defined(__SANITIZE_ADDRESS__)  // under ASan (make test) its own report is better
  for (int s : {SIGSEGV, SIGBUS, SIGFPE, SIGILL}) std::signal(s, crash_stack);
#endif
  return RUN_ALL_TESTS();
}
