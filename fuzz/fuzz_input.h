// Shared by the fuzz targets: the readers take file paths (they stat, open and, for gzip, stream files), so each
// input is written to a scratch file first, in /dev/shm when it exists (a RAM file system: no disk traffic).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

namespace triaccel::fuzz {

inline std::string scratch_path(const std::string& name) {
  const char* dir = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  return std::string(dir) + "/triaccel_fuzz_" + std::to_string(::getpid()) + "_" + name;
}

inline void scratch_write(const std::string& path, const uint8_t* data, size_t size) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) __builtin_trap();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) __builtin_trap();
  std::fclose(f);
}

}  // namespace triaccel::fuzz
