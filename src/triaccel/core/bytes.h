// Byte sizes as users write them: "2GB", "1.5GB", "512MB", "3GiB", "800000000". GB/MB/KB are decimal (1e9, as
// docs/measuring.md measures peak VRAM); GiB/MiB/KiB are binary. Case-insensitive; a trailing "B" is optional ("2G").
#pragma once

#include <cstdint>
#include <string>

namespace triaccel {

// One GB as sizes are printed and logged (peak VRAM in docs/measuring.md): decimal.
constexpr double kGB = 1e9;

// Parses `text` into bytes; `key` names the option in the error ("vram_budget must be a size like 2GB ...").
int64_t bytes_parse(const std::string& text, const std::string& key);

// 2.5e9 → "2.50 GB".
std::string bytes_format(double bytes);

}  // namespace triaccel
