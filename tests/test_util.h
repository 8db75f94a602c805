// Shared helpers for the unit tests: scratch folders and GPU detection.
#pragma once

#include <torch/cuda.h>

#include <filesystem>
#include <random>
#include <string>

namespace triaccel::test {

// A fresh, empty folder under the system temp dir, removed when the object dies.
class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() / ("triaccel_" + tag + "_" + std::to_string(rd()));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string path() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

inline bool gpu_available() { return torch::cuda::is_available(); }

}  // namespace triaccel::test

#define TRIACCEL_SKIP_WITHOUT_GPU() \
  if (!::triaccel::test::gpu_available()) GTEST_SKIP() << "no CUDA GPU"
