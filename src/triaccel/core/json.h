// JSON type used by telemetry, checkpoints, plans and benchmarks (key order preserved).
#pragma once

#include <nlohmann/json.hpp>

namespace triaccel {
using Json = nlohmann::ordered_json;
}  // namespace triaccel
