#include "triaccel/core/io.h"

#include "triaccel/core/errors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

namespace triaccel {
namespace fs = std::filesystem;

namespace {

std::string errno_text() { return std::strerror(errno); }

// Test-only hooks for the reliability tests (docs/reliability.md), read from the environment at each write:
//   TRIACCEL_TEST_WRITE_DELAY_MS=N  pause N ms after the first half of the bytes (a kill then lands mid-write)
//   TRIACCEL_TEST_WRITE_FAIL=ENOSPC the second half of the write fails with ENOSPC, as on a full disk
int64_t test_write_delay_ms() {
  const char* v = std::getenv("TRIACCEL_TEST_WRITE_DELAY_MS");
  return v ? std::max<int64_t>(0, std::atoll(v)) : 0;
}
bool test_write_fails() {
  const char* v = std::getenv("TRIACCEL_TEST_WRITE_FAIL");
  return v && std::string(v) == "ENOSPC";
}

void fsync_directory(const fs::path& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;  // best effort: some filesystems refuse directory fds
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

void file_write_atomic(const std::string& path, const std::string& bytes) {
  const fs::path target(path);
  const fs::path tmp = target.string() + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TRIACCEL_CHECK_INPUT(fd >= 0, "cannot write ", tmp.string(), ": ", errno_text(),
                       "; choose a writable " + option_ref("out") + " folder");
  size_t done = 0;
  const size_t half = bytes.size() / 2;
  const int64_t delay_ms = test_write_delay_ms();
  const bool fail = test_write_fails();
  while (done < bytes.size()) {
    // Two halves when a test hook is set, so that the pause or the failure falls inside the file.
    const size_t end = (delay_ms > 0 || fail) && done < half ? half : bytes.size();
    ssize_t n = 0;
    if (fail && done >= half) {
      errno = ENOSPC;
      n = -1;
    } else {
      n = ::write(fd, bytes.data() + done, end - done);
    }
    if (n < 0 && errno == EINTR) continue;
    if (n > 0 && delay_ms > 0 && done < half && done + static_cast<size_t>(n) >= half) {
      std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    }
    if (n <= 0) {
      const std::string why = errno_text();
      ::close(fd);
      ::unlink(tmp.c_str());
      throw UserError("writing " + path + " failed after " + std::to_string(done) + " of " +
                      std::to_string(bytes.size()) + " bytes: " + why +
                      "; free disk space and resume (the previous file is intact)");
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw UserError("writing " + path + " failed at fsync: " + why + "; the previous file is intact");
  }
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    const std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw UserError("cannot rename " + tmp.string() + " to " + path + ": " + why);
  }
  fsync_directory(target.parent_path());
}

void file_remove_stale_temps(const std::string& path) {
  const fs::path target(path);
  const std::string prefix = target.filename().string() + ".tmp.";
  std::error_code ec;
  const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().filename().string().rfind(prefix, 0) == 0) fs::remove(it->path(), ec);
  }
}

std::string file_read_all(const std::string& path) {
  std::error_code ec;
  TRIACCEL_CHECK_INPUT(fs::is_regular_file(path, ec), "file not found: ", path);
  std::ifstream in(path, std::ios::binary);
  TRIACCEL_CHECK_INPUT(in.good(), "cannot open ", path, " for reading");
  std::ostringstream ss;
  ss << in.rdbuf();
  TRIACCEL_CHECK_INPUT(!in.bad(), "read error in ", path);
  return ss.str();
}

bool file_exists(const std::string& path) {
  std::error_code ec;
  return fs::exists(path, ec);
}

void directory_prepare_writable(const std::string& dir, const std::string& key) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  TRIACCEL_CHECK_INPUT(fs::is_directory(dir, ec), option_ref(key), " ", dir,
                       ": cannot create the folder (", ec ? ec.message() : "not a folder",
                       "); choose a writable path");
  TRIACCEL_CHECK_INPUT(::access(dir.c_str(), W_OK) == 0, option_ref(key), " ", dir,
                       ": folder is not writable; choose a writable path");
}

double time_since_start_s() {
  static const auto t0 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace triaccel
