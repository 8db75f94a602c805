#include "triaccel/optim/state_format.h"

#include "triaccel/core/errors.h"

#include <c10/util/Exception.h>

namespace triaccel {

const std::vector<StateFormat>& state_formats_all() {
  static const std::vector<StateFormat> all = {StateFormat::kAdamW32,    StateFormat::kAdamW16,
                                               StateFormat::kAdamW8,     StateFormat::kFactored,
                                               StateFormat::kNoMomentum, StateFormat::kSgdMomentum,
                                               StateFormat::kSgd};
  return all;
}

std::string state_format_name(StateFormat f) {
  switch (f) {
    case StateFormat::kAdamW32: return "adamw-fp32";
    case StateFormat::kAdamW16: return "adamw-bf16";
    case StateFormat::kAdamW8: return "adamw-8bit";
    case StateFormat::kFactored: return "factored";
    case StateFormat::kNoMomentum: return "no-momentum";
    case StateFormat::kSgdMomentum: return "sgd-momentum";
    case StateFormat::kSgd: return "sgd";
  }
  return "?";
}

StateFormat state_format_parse(const std::string& name) {
  std::string known;
  for (StateFormat f : state_formats_all()) {
    if (state_format_name(f) == name) return f;
    known += (known.empty() ? "" : ", ") + state_format_name(f);
  }
  throw UserError("unknown optimizer-state format '" + name + "'; use one of " + known);
}

bool state_format_has_m(StateFormat f) {
  return f == StateFormat::kAdamW32 || f == StateFormat::kAdamW16 || f == StateFormat::kAdamW8 ||
         f == StateFormat::kSgdMomentum;
}

bool state_format_has_v(StateFormat f) {
  return f == StateFormat::kAdamW32 || f == StateFormat::kAdamW16 || f == StateFormat::kAdamW8 ||
         f == StateFormat::kFactored || f == StateFormat::kNoMomentum;
}

std::pair<int64_t, int64_t> state_format_factor_shape(const std::vector<int64_t>& shape) {
  if (shape.size() < 2) return {0, 0};
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  // Leading size-1 dimensions are skipped (a position embedding (1, T, D) factors as T × D); rows is then the
  // outermost dimension in memory for contiguous tensors. A 4-D tensor stored channels_last has N, H, W, C in
  // memory, so one with N = 1 keeps a full v.
  size_t d = 0;
  while (d + 1 < shape.size() && shape[d] == 1) ++d;
  if (shape.size() == 4 && d > 0) return {0, 0};
  const int64_t rows = shape[d];
  if (rows <= 1 || n / rows <= 1) return {0, 0};
  return {rows, n / rows};
}

int64_t state_format_bytes(StateFormat f, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  switch (f) {
    case StateFormat::kAdamW32: return 8 * n;
    case StateFormat::kAdamW16: return 4 * n;
    case StateFormat::kAdamW8: return 2 * n + 2 * 2 * blocks;  // codes of m and v + one bf16 absmax per block each
    case StateFormat::kFactored: {
      const auto [r, c] = state_format_factor_shape(shape);
      return r > 0 ? 4 * (r + c) : 4 * n;
    }
    case StateFormat::kNoMomentum: return 4 * n;
    case StateFormat::kSgdMomentum: return 4 * n;
    case StateFormat::kSgd: return 0;
  }
  TORCH_CHECK(false, "state_format_bytes: bad format");
  return 0;
}

}  // namespace triaccel
