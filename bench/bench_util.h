// Helpers shared by the benchmark programs (bench/*.cpp).
#pragma once

#include <sstream>
#include <string>
#include <vector>

namespace bench {

// "a,b,c" → {"a", "b", "c"}: the benchmarks' comma-separated lists.
inline std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(item);
  return out;
}

}  // namespace bench
