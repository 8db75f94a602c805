#include "triaccel/optim/state_format.h"

#include "triaccel/core/errors.h"

#include <c10/util/Exception.h>

namespace triaccel {

const std::vector<StateFormatTraits>& state_format_table() {
  using C = MomentCodec;
  static const std::vector<StateFormatTraits> table = {
      //  format                    name            m             v             sgd_scaled
      {StateFormat::kAdamW32, "adamw-fp32", C::kFloat32, C::kFloat32, false},
      {StateFormat::kAdamW16, "adamw-bf16", C::kBFloat16, C::kBFloat16, false},
      {StateFormat::kAdamW8, "adamw-8bit", C::kQuant8, C::kQuant8, false},
      {StateFormat::kFactored, "factored", C::kNone, C::kFactored, false},
      {StateFormat::kNoMomentum, "no-momentum", C::kNone, C::kFloat32, false},
      {StateFormat::kSgdMomentum, "sgd-momentum", C::kFloat32, C::kNone, true},
      {StateFormat::kSgd, "sgd", C::kNone, C::kNone, true},
  };
  return table;
}

const StateFormatTraits& state_format_traits(StateFormat f) {
  const auto& table = state_format_table();
  const auto i = static_cast<size_t>(f);
  TORCH_CHECK(i < table.size() && table[i].format == f, "state_format_traits: format ", static_cast<int>(f),
              " is not in the table (or the table is out of enum order)");
  return table[i];
}

const std::vector<StateFormat>& state_formats_all() {
  static const std::vector<StateFormat> all = [] {
    std::vector<StateFormat> out;
    for (const auto& t : state_format_table()) out.push_back(t.format);
    return out;
  }();
  return all;
}

std::string state_format_name(StateFormat f) { return state_format_traits(f).name; }

StateFormat state_format_parse(const std::string& name) {
  std::string known;
  for (const auto& t : state_format_table()) {
    if (t.name == name) return t.format;
    known += (known.empty() ? "" : ", ") + std::string(t.name);
  }
  throw UserError("unknown optimizer-state format '" + name + "'; use one of " + known);
}

bool state_format_has_m(StateFormat f) { return state_format_traits(f).m != MomentCodec::kNone; }
bool state_format_has_v(StateFormat f) { return state_format_traits(f).v != MomentCodec::kNone; }

bool state_format_per_element_adamw(StateFormat f) {
  const StateFormatTraits& t = state_format_traits(f);
  return t.m != MomentCodec::kNone && t.v != MomentCodec::kNone && t.v != MomentCodec::kFactored;
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

namespace {

// Storage bytes of one moment of a tensor of n elements and this shape.
int64_t codec_bytes(MomentCodec c, int64_t n, const std::vector<int64_t>& shape) {
  switch (c) {
    case MomentCodec::kNone: return 0;
    case MomentCodec::kFloat32: return 4 * n;
    case MomentCodec::kBFloat16: return 2 * n;
    case MomentCodec::kQuant8: return n + 2 * ((n + kQuantBlock - 1) / kQuantBlock);  // codes + a 2-byte absmax
    case MomentCodec::kFactored: {
      const auto [r, cols] = state_format_factor_shape(shape);
      return r > 0 ? 4 * (r + cols) : 4 * n;
    }
  }
  TORCH_CHECK(false, "codec_bytes: bad codec");
  return 0;
}

// Bytes a step reads and writes per element for one moment.
double codec_bytes_moved(MomentCodec c) {
  switch (c) {
    case MomentCodec::kNone: return 0;
    case MomentCodec::kFloat32: return 8;
    case MomentCodec::kBFloat16: return 4;
    case MomentCodec::kQuant8: return 2;
    case MomentCodec::kFactored: return 4;  // the gradient is read twice (statistics, update)
  }
  return 8;
}

}  // namespace

int64_t state_format_bytes(StateFormat f, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  const StateFormatTraits& t = state_format_traits(f);
  return codec_bytes(t.m, n, shape) + codec_bytes(t.v, n, shape);
}

double state_format_bytes_moved(StateFormat f) {
  const StateFormatTraits& t = state_format_traits(f);
  return 12 + codec_bytes_moved(t.m) + codec_bytes_moved(t.v);
}

}  // namespace triaccel
