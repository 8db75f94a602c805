// Byte sizes as users write them: "2GB", "1.5GB", "512MB", "3GiB", "800000000". GB/MB/KB are decimal (1e9, as
// DESIGN.md measures peak VRAM); GiB/MiB/KiB are binary. Case-insensitive; a trailing "B" is optional ("2G").
#pragma once

#include <cstdint>
#include <string>

namespace triaccel {

// Parses `text` into bytes; `flag` names the option in the error ("--vram-budget must be a size like 2GB ...").
int64_t bytes_parse(const std::string& text, const std::string& flag);

// 2.5e9 → "2.50 GB".
std::string bytes_format(double bytes);

}  // namespace triaccel
