// Optimizer-state formats: how one parameter tensor is updated and what state it keeps (docs/baoc.md).
// Every format applies decoupled weight decay p ← p·(1 − lr·s·wd) first (s: the tensor's lr scale), then:
//   kAdamW32     m, v float32                      p −= lr·s · m̂ / (√v̂ + ε)          (torch.optim.AdamW)
//   kAdamW16     m, v bfloat16 (updated in fp32, stored rounded to nearest)
//   kAdamW8      m, v 8-bit codes, block-wise (256) absmax scales in float32: m on the signed dynamic map,
//                v on the unsigned one (optim/quant8.h); updated in fp32, re-quantized after each step
//   kFactored    no first moment; second moment factored Adafactor-style for tensors with dim ≥ 2 viewed as
//                (R = size(0), C = numel / R): row means r (R) and column means c (C) of g², v̂ ≈ r cᵀ / mean(r);
//                1-D tensors keep a full float32 v.                 p −= lr·s · g / (√v̂ + ε)
//   kNoMomentum  no first moment, full float32 v                    p −= lr·s · g / (√v̂ + ε)
//   kSgdMomentum float32 m (the same EMA as AdamW's m)              p −= lr·s·k · m̂
// kSgd         no state                                           p −= lr·s·k · g m̂, v̂ are bias-corrected by
// per-tensor step counts (a moment created fresh by a conversion restarts its count). k is a per-tensor constant 1 /
// (√mean(v̂) + ε) frozen when the tensor enters an SGD format (BAOC's format plan): SGD on the AdamW learning-rate
// scale, with one scalar preconditioner per tensor instead of one per element.
//
// A format is one row of state_format_table(): how it stores each moment (a MomentCodec), and from that everything
// else follows: its bytes, its update rule (m and v → AdamW, v only → no-momentum, m only → SGD-momentum, none →
// SGD), the kernel that runs it (8-bit and factored codecs have kernels of their own, the others one element-wise
// kernel templated on the storage type), its risk terms and its time model. Adding a format is a value in the enum
// and a row in the table (docs/architecture.md, "Add a state format").
#pragma once

#include "triaccel/kernels/adam8_step.h"  // kQuantBlock: elements per absmax block of the 8-bit codec

#include <cstdint>
#include <string>
#include <vector>

namespace triaccel {

// Checkpoints store the value: append new formats, never renumber.
enum class StateFormat : int { kAdamW32 = 0, kAdamW16, kAdamW8, kFactored, kNoMomentum, kSgdMomentum, kSgd };

// How one moment is stored. Updates are computed in float32 whatever the storage.
enum class MomentCodec {
  kNone,      // not kept
  kFloat32,   // a float32 tensor of the parameter's shape and layout
  kBFloat16,  // bfloat16, rounded to nearest even after each update
  kQuant8,    // 8-bit codes + one absmax per kQuantBlock elements (m: the signed map, v: the unsigned one; quant8.h)
  kFactored,  // v only: row and column means of g² for matrices (state_format_factor_shape), float32 for the rest
};

struct StateFormatTraits {
  StateFormat format;
  const char* name;  // the format plan's menus, events and plans
  MomentCodec m;     // first moment
  MomentCodec v;     // second moment
  bool sgd_scaled;   // p −= lr·s·k·(m̂ or g) with k frozen on entry; requires v = kNone
};

// Every format, in enum order.
const std::vector<StateFormatTraits>& state_format_table();
const StateFormatTraits& state_format_traits(StateFormat f);

const std::vector<StateFormat>& state_formats_all();
std::string state_format_name(StateFormat f);  // "adamw-fp32", "adamw-bf16", "adamw-8bit", "factored", ...
StateFormat state_format_parse(const std::string& name);  // UserError listing the names
bool state_format_has_m(StateFormat f);
bool state_format_has_v(StateFormat f);  // full or factored second moment

// Exact optimizer-state bytes of one parameter tensor of this shape in format f (scales and factors included).
int64_t state_format_bytes(StateFormat f, const std::vector<int64_t>& shape);
// Bytes a step moves per element in format f: the parameter read and written (8), the gradient read (4), and each
// moment read and written at its storage width (a factored v: the gradient read a second time, 4).
double state_format_bytes_moved(StateFormat f);
// Whether f keeps both moments element-wise (the AdamW family: what a lookup table's rows may use).
bool state_format_per_element_adamw(StateFormat f);

// The (R, C) view a factored format uses for `shape`: R = the first dimension after any leading 1s, C = the rest;
// {0, 0} when the tensor keeps a full v (dim < 2, R or C = 1, or 4-D with a leading 1).
std::pair<int64_t, int64_t> state_format_factor_shape(const std::vector<int64_t>& shape);

}  // namespace triaccel
