// Helpers shared by the benchmark programs (bench/*.cpp).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
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

// "A:B" → {A, B} (e.g. a BatchNormLaunch's rows in flight and blocks per SM); throws std::invalid_argument
// naming `what` otherwise.
inline std::pair<int, int> int_pair_parse(const std::string& s, const std::string& what) {
  const auto colon = s.find(':');
  try {
    if (colon != std::string::npos) return {std::stoi(s.substr(0, colon)), std::stoi(s.substr(colon + 1))};
  } catch (const std::exception&) {
  }
  throw std::invalid_argument(what + ": '" + s + "' is not two whole numbers A:B (e.g. 4:4)");
}

}  // namespace bench
