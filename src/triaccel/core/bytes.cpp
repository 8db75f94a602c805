#include "triaccel/core/bytes.h"

#include "triaccel/core/errors.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace triaccel {

int64_t bytes_parse(const std::string& text, const std::string& key) {
  const std::string hint = option_ref(key) + " must be a size like 2GB, 512MB or 3GiB, got '" + text + "'";
  TRIACCEL_CHECK_INPUT(!text.empty(), hint);
  const char* begin = text.c_str();
  char* end = nullptr;
  const double value = std::strtod(begin, &end);
  TRIACCEL_CHECK_INPUT(end != begin && std::isfinite(value) && value > 0, hint);
  std::string suffix;
  for (const char* c = end; *c != '\0'; ++c) {
    if (!std::isspace(static_cast<unsigned char>(*c))) suffix += static_cast<char>(std::toupper(*c));
  }
  double scale = 0;
  if (suffix.empty() || suffix == "B") scale = 1;
  else if (suffix == "K" || suffix == "KB") scale = 1e3;
  else if (suffix == "M" || suffix == "MB") scale = 1e6;
  else if (suffix == "G" || suffix == "GB") scale = 1e9;
  else if (suffix == "T" || suffix == "TB") scale = 1e12;
  else if (suffix == "KIB") scale = 1024.0;
  else if (suffix == "MIB") scale = 1024.0 * 1024;
  else if (suffix == "GIB") scale = 1024.0 * 1024 * 1024;
  TRIACCEL_CHECK_INPUT(scale > 0, hint);
  const double bytes = value * scale;
  TRIACCEL_CHECK_INPUT(bytes >= 1 && bytes < 9.0e18, hint);
  return static_cast<int64_t>(std::llround(bytes));
}

std::string bytes_format(double bytes) {
  char buf[64];
  if (bytes >= 1e9) std::snprintf(buf, sizeof buf, "%.2f GB", bytes / 1e9);
  else if (bytes >= 1e6) std::snprintf(buf, sizeof buf, "%.1f MB", bytes / 1e6);
  else std::snprintf(buf, sizeof buf, "%.0f bytes", bytes);
  return buf;
}

}  // namespace triaccel
