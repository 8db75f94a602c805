#include "triaccel/optim/baoc_optimizer.h"

#include "triaccel/core/errors.h"
#include "triaccel/core/flat_view.h"
#include "triaccel/optim/quant8.h"
#include "triaccel/core/named_tensors.h"
#ifdef TRIACCEL_WITH_CUDA
#include "triaccel/kernels/adam8_step.h"
#include "triaccel/kernels/adam_step.h"
#include "triaccel/kernels/factored_step.h"
#endif

#include <ATen/ATen.h>
#include <torch/utils.h>
#include <torch/autograd.h>

#include <cmath>
#include <map>

namespace triaccel {
namespace {

constexpr double kFactoredEps = 1e-30;  // added to g² before the row/column means (Adafactor's ε1)

// A dense tensor's elements in memory order (the order of 8-bit blocks), as a 1-D view.
at::Tensor memory_flat(const at::Tensor& t) { return triaccel::memory_flat(t, "BaocOptimizer"); }

// g in p's memory layout (a copy only if the layouts differ).
at::Tensor like_param(const at::Tensor& g, const at::Tensor& p) {
  at::Tensor g32 = g.to(at::kFloat);
  if (g32.strides() == p.strides()) return g32;
  return at::empty_like(p).copy_(g32);
}

Quantized8 encode_like(const at::Tensor& x32, const at::Tensor& p, const at::Tensor& map) {
  return quant8_encode(memory_flat(like_param(x32, p)), map);
}

at::Tensor decode_like(const at::Tensor& codes, const at::Tensor& absmax, const at::Tensor& p, const at::Tensor& map) {
  at::Tensor out = at::empty_like(p, p.options().dtype(at::kFloat));
  memory_flat(out).copy_(quant8_decode({codes, absmax}, map, {p.numel()}));
  return out;
}

// A factored tensor as (rows, cols) in memory order: rows = the first dimension after any leading 1s
// (state_format_factor_shape; outermost in memory for contiguous tensors, and size(0) of channels_last ones), columns
// in memory order within a row. The rank-1 factorization does not depend on the order of the columns, so this equals
// the logical (rows, rest) view up to a permutation of c.
at::Tensor factored_view(const at::Tensor& x, int64_t rows, int64_t cols) {
  int64_t d = 0;
  while (d + 1 < x.dim() && x.size(d) == 1) ++d;
  TORCH_CHECK(x.dim() < 2 || (x.size(d) == rows && x.stride(d) == cols) || x.size(d) == 1,
              "factored state needs its row dimension outermost in memory");
  return memory_flat(x).view({rows, cols});
}

// v̂ = r cᵀ / mean(r) in the memory layout of p (float32).
at::Tensor factored_expand(const at::Tensor& r, const at::Tensor& c, const at::Tensor& p) {
  at::Tensor out = at::empty_like(p, p.options().dtype(at::kFloat));
  memory_flat(out).copy_((at::outer(r, c) / r.mean()).reshape({-1}));
  return out;
}

double bias_correction(double beta, double count) { return 1.0 - std::pow(beta, count); }

// One moment's storage in a BaocTensorState: the tensor (float32, bfloat16, 8-bit codes, or a factored format's
// full v), the 8-bit codec's absmax, a factored v's row and column means.
struct MomentSlot {
  at::Tensor* t;
  at::Tensor* absmax;
  at::Tensor* row;
  at::Tensor* col;
};

MomentSlot m_slot(BaocTensorState& s) { return {&s.m, &s.m_absmax, nullptr, nullptr}; }
MomentSlot v_slot(BaocTensorState& s) { return {&s.v, &s.v_absmax, &s.v_row, &s.v_col}; }

// Creates the storage of codec c holding x (float32, p's layout). `map`: the 8-bit codec's code map.
void moment_encode(MomentCodec c, const at::Tensor& x, const at::Tensor& p, const at::Tensor& map, MomentSlot out) {
  switch (c) {
    case MomentCodec::kNone: return;
    case MomentCodec::kFloat32: *out.t = x.clone(); return;
    case MomentCodec::kBFloat16: *out.t = x.to(at::kBFloat16); return;
    case MomentCodec::kQuant8: {
      Quantized8 q = encode_like(x, p, map);
      *out.t = q.codes;
      *out.absmax = q.absmax;
      return;
    }
    case MomentCodec::kFactored: {
      TORCH_CHECK(out.row != nullptr, "BaocOptimizer: only the second moment can be factored");
      const auto [rows, cols] = state_format_factor_shape(p.sizes().vec());
      if (rows > 0) {
        const at::Tensor x2 = factored_view(x, rows, cols);
        *out.row = x2.mean(1).contiguous();
        *out.col = x2.mean(0).contiguous();
      } else {
        *out.t = x.clone();
      }
      return;
    }
  }
}

// The moment as float32 in p's layout (the stored tensor itself for kFloat32: updates to it update the state);
// undefined for kNone.
at::Tensor moment_decode(MomentCodec c, const BaocTensorState& s, bool second, const at::Tensor& p,
                         const at::Tensor& map) {
  const at::Tensor& t = second ? s.v : s.m;
  switch (c) {
    case MomentCodec::kNone: return {};
    case MomentCodec::kFloat32: return t;
    case MomentCodec::kBFloat16: return t.to(at::kFloat);
    case MomentCodec::kQuant8: return decode_like(t, second ? s.v_absmax : s.m_absmax, p, map);
    case MomentCodec::kFactored: return s.v_row.defined() ? factored_expand(s.v_row, s.v_col, p) : s.v;
  }
  return {};
}

// Stores the updated float32 moment x (from moment_decode) back into its storage, in place.
void moment_store(MomentCodec c, const at::Tensor& x, const at::Tensor& p, const at::Tensor& map, MomentSlot slot) {
  switch (c) {
    case MomentCodec::kFloat32:
      if (!x.is_same(*slot.t)) slot.t->copy_(x);
      return;
    case MomentCodec::kBFloat16: slot.t->copy_(x); return;
    case MomentCodec::kQuant8: {
      Quantized8 q = encode_like(x, p, map);
      slot.t->copy_(q.codes);
      slot.absmax->copy_(q.absmax);
      return;
    }
    default: TORCH_CHECK(false, "BaocOptimizer: moment_store of a codec the element-wise reference does not update");
  }
}

// The factored / no-momentum update (CPU reference) with every scalar as a tensor, masked by ok.
// lr_eff, bc2: float32 scalars; ok: bool scalar.
void second_moment_only_step(BaocTensorState& s, const at::Tensor& p, const at::Tensor& g, const at::Tensor& lr_eff,
                             double wd, const at::Tensor& bc2, const at::Tensor& ok, const BaocOptions& o) {
  const at::Tensor g32 = like_param(g, p);
  at::Tensor vhat;
  if (s.v_row.defined()) {
    // Rows = size(0), the outermost dimension in memory; columns in memory order (factored_view).
    const int64_t rows = s.v_row.size(0), cols = s.v_col.size(0);
    const at::Tensor g2 = factored_view(g32 * g32 + kFactoredEps, rows, cols);
    const at::Tensor r = s.v_row * o.beta2 + g2.mean(1) * (1 - o.beta2);
    const at::Tensor c = s.v_col * o.beta2 + g2.mean(0) * (1 - o.beta2);
    s.v_row.copy_(at::where(ok, r, s.v_row));
    s.v_col.copy_(at::where(ok, c, s.v_col));
    vhat = factored_expand(r, c, p);
  } else {
    const at::Tensor v = s.v * o.beta2 + g32 * g32 * (1 - o.beta2);
    s.v.copy_(at::where(ok, v, s.v));
    vhat = v;
  }
  const at::Tensor denom = vhat.sqrt() / bc2.sqrt() + o.eps;
  const at::Tensor p_new = p * (1 - lr_eff * wd) - lr_eff * g32 / denom;
  p.copy_(at::where(ok, p_new, p));
}

}  // namespace

void BaocOptions::validate() const {
  TRIACCEL_CHECK_INPUT(beta1 >= 0 && beta1 < 1, option_ref("adam_beta1"), " must be in [0, 1), got ", beta1);
  TRIACCEL_CHECK_INPUT(beta2 > 0 && beta2 < 1, option_ref("adam_beta2"), " must be in (0, 1), got ", beta2);
  TRIACCEL_CHECK_INPUT(eps > 0, option_ref("adam_eps"), " must be > 0, got ", eps);
  TRIACCEL_CHECK_INPUT(weight_decay >= 0, option_ref("weight_decay"), " must be >= 0, got ", weight_decay);
}

BaocOptimizer::BaocOptimizer(const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                             BaocOptions options, StateFormat initial)
    : Optimizer(named_params, options.weight_decay, "BaocOptimizer"), options_(options) {
  options_.validate();
  pending_formats_.assign(params().size(), initial);
  const at::Device device = params().empty() ? at::Device(at::kCPU) : params()[0].device();
  map_signed_ = quant8_map(true).to(device);
  map_unsigned_ = quant8_map(false).to(device);
  mids_signed_ = quant8_midpoints(map_signed_);
  mids_unsigned_ = quant8_midpoints(map_unsigned_);
  counts_ = at::zeros({static_cast<int64_t>(params().size()), 2}, at::TensorOptions().dtype(at::kDouble).device(device));
  stats_have_prev_ = at::zeros({1}, counts_.options());
}

std::vector<StateFormat> BaocOptimizer::formats() const {
  if (!initialized_) return pending_formats_;
  std::vector<StateFormat> out;
  for (const auto& s : states_) out.push_back(s.format);
  return out;
}

int64_t BaocOptimizer::state_bytes() const {
  const auto f = formats();
  int64_t total = 0;
  for (size_t i = 0; i < params().size(); ++i) {
    if (owned(i)) total += state_format_bytes(f[i], params()[i].sizes().vec());
  }
  return total;
}

BaocTensorState BaocOptimizer::state_make(size_t i, StateFormat f, const at::Tensor& m32, const at::Tensor& v32) const {
  const at::Tensor& p = params()[i];
  const auto f32 = p.options().dtype(at::kFloat);
  BaocTensorState s;
  s.format = f;
  const StateFormatTraits& t = state_format_traits(f);
  if (t.m != MomentCodec::kNone) {
    moment_encode(t.m, m32.defined() ? like_param(m32, p) : at::zeros_like(p, f32), p, map_signed_, m_slot(s));
  }
  if (t.v != MomentCodec::kNone) {
    moment_encode(t.v, v32.defined() ? like_param(v32, p) : at::zeros_like(p, f32), p, map_unsigned_, v_slot(s));
  }
  return s;
}

BaocTensorState BaocOptimizer::state_host_temporary(size_t i) const {
  const torch::NoGradGuard no_grad;
  BaocTensorState s = state_make(i, states_[i].format, {}, {});  // on the device, one tensor's at a time
  for (at::Tensor* t : {&s.m, &s.v, &s.m_absmax, &s.v_absmax, &s.v_row, &s.v_col}) {
    if (t->defined()) *t = t->cpu();
  }
  return s;
}

void BaocOptimizer::state_init() {
  if (initialized_) return;
  const torch::NoGradGuard no_grad;
  states_.clear();
  for (size_t i = 0; i < params().size(); ++i) {
    if (owned(i)) {
      states_.push_back(state_make(i, pending_formats_[i], {}, {}));
    } else {  // another process's (sharded state): the format alone
      states_.emplace_back();
      states_.back().format = pending_formats_[i];
    }
  }
  initialized_ = true;
}

at::Tensor BaocOptimizer::m_float(size_t i) const {
  if (!initialized_ || !owned(i)) return {};
  const BaocTensorState& s = states_[i];
  return moment_decode(state_format_traits(s.format).m, s, false, params()[i], map_signed_);
}

at::Tensor BaocOptimizer::v_float(size_t i) const {
  if (!initialized_ || !owned(i)) return {};
  const BaocTensorState& s = states_[i];
  return moment_decode(state_format_traits(s.format).v, s, true, params()[i], map_unsigned_);
}

void BaocOptimizer::formats_set(const std::vector<StateFormat>& formats) {
  TORCH_CHECK(formats.size() == params().size(), "formats_set: ", formats.size(), " formats for ", params().size(),
              " tensors");
  if (!initialized_) {
    pending_formats_ = formats;
    return;
  }
  const torch::NoGradGuard no_grad;
  const at::Tensor counts_cpu = counts_.cpu();
  bool changed = false;
  for (size_t i = 0; i < params().size(); ++i) {
    const StateFormat from = states_[i].format, to = formats[i];
    if (from == to) continue;
    changed = true;
    // A moment the old format lacked restarts its count (on every rank: the counts are everyone's).
    if (state_format_has_m(to) && !state_format_has_m(from)) counts_[static_cast<int64_t>(i)][0].fill_(0);
    if (state_format_has_v(to) && !state_format_has_v(from)) counts_[static_cast<int64_t>(i)][1].fill_(0);
    if (!owned(i)) {  // another rank's state: the format alone (its SGD scale arrives below)
      states_[i] = BaocTensorState{};
      states_[i].format = to;
      states_[i].sgd_scale = 0;
      continue;
    }
    const at::Tensor m32 = state_format_has_m(to) ? m_float(i) : at::Tensor();
    const at::Tensor v32 = v_float(i);  // also feeds the SGD scale
    const float old_scale = states_[i].sgd_scale;
    BaocTensorState next = state_make(i, to, m32, state_format_has_v(to) ? v32 : at::Tensor());
    next.sgd_scale = old_scale;
    if (state_format_traits(to).sgd_scaled && v32.defined()) {
      const double count_v = counts_cpu[static_cast<int64_t>(i)][1].item<double>();
      const double bc2 = count_v > 0 ? bias_correction(options_.beta2, count_v) : 1.0;
      const double mean_v = v32.mean().item<double>() / bc2;
      next.sgd_scale = static_cast<float>(1.0 / (std::sqrt(mean_v) + options_.eps));
    }
    states_[i] = std::move(next);
  }
  if (!sharded() || !changed) return;
  // Every tensor's SGD scale is its owner's (a checkpoint written by rank 0 holds them all).
  std::vector<double> scales;
  for (size_t i = 0; i < params().size(); ++i) scales.push_back(owned(i) ? states_[i].sgd_scale : 0.0);
  scales = sum_over_ranks(std::move(scales));
  for (size_t i = 0; i < params().size(); ++i) states_[i].sgd_scale = static_cast<float>(scales[i]);
}

namespace {

// Advances step counts (all rows of counts_, or one) by a step unless found_inf: on CUDA on the device (the kernels
// read found_inf there too), true; elsewhere synced on found_inf, false when the step is skipped.
bool counts_advance(at::Tensor counts, const at::Tensor& found_inf) {
  if (counts.is_cuda()) {
    counts.add_(found_inf.reshape({}).eq(0).to(at::kDouble));
    return true;
  }
  if (found_inf.item<float>() != 0.f) return false;
  counts.add_(1.0);
  return true;
}

}  // namespace

void BaocOptimizer::step(const at::Tensor& lr, const at::Tensor& found_inf) {
  const std::vector<at::Tensor> g = grads_required();
  state_init();
  const torch::NoGradGuard no_grad;
  if (stats_on_) stream_stats_add(g, found_inf);
  if (!counts_advance(counts_, found_inf)) return;
  const auto [indices, grads] = owned_of(g);
  update(indices, grads, lr, found_inf);
}

void BaocOptimizer::step_one(size_t i, const at::Tensor& grad, const at::Tensor& lr, const at::Tensor& found_inf) {
  TORCH_CHECK(i < params().size() && grad.defined(), "BaocOptimizer::step_one: parameter ", i, " of ",
              params().size(), grad.defined() ? "" : " without a gradient");
  TORCH_CHECK(!stats_on_, "BaocOptimizer::step_one: gradient statistics read a step's gradients together");
  state_init();
  const torch::NoGradGuard no_grad;
  // Its step counts alone, as step() advances all of them.
  if (!counts_advance(counts_.select(0, static_cast<int64_t>(i)), found_inf)) return;
  if (owned(i)) update({i}, {grad}, lr, found_inf);
}

void BaocOptimizer::update(const std::vector<size_t>& indices, const std::vector<at::Tensor>& g, const at::Tensor& lr,
                           const at::Tensor& found_inf) {
#ifdef TRIACCEL_WITH_CUDA
  if (!params().empty() && params()[0].is_cuda()) {
    const AdamStepHyper hyper{static_cast<float>(options_.beta1), static_cast<float>(options_.beta2),
                              static_cast<float>(options_.eps)};
    std::map<StateFormat, std::vector<size_t>> groups;  // positions in `indices`
    for (size_t k = 0; k < indices.size(); ++k) groups[states_[indices[k]].format].push_back(k);
    for (const auto& [format, idx] : groups) {
      std::vector<at::Tensor> ps, gs, ms, vs, mas, vas;
      std::vector<float> wds, ks;
      std::vector<int64_t> rows;
      for (size_t k : idx) {
        const size_t i = indices[k];
        const BaocTensorState& s = states_[i];
        ps.push_back(params()[i]);
        gs.push_back(g[k]);
        ms.push_back(s.m);
        vs.push_back(s.v);
        mas.push_back(s.m_absmax);
        vas.push_back(s.v_absmax);
        wds.push_back(weight_decays()[i]);
        ks.push_back(s.sgd_scale);
        rows.push_back(static_cast<int64_t>(i));
      }
      const StateFormatTraits& t = state_format_traits(format);
      if (t.m == MomentCodec::kQuant8 || t.v == MomentCodec::kQuant8) {
        TORCH_CHECK(t.m == MomentCodec::kQuant8 && t.v == MomentCodec::kQuant8, "BaocOptimizer: format ", t.name,
                    ": the 8-bit kernel needs both moments 8-bit");
        adam8_step_cuda(ps, gs, ms, vs, mas, vas, wds, lr_scales_device(), counts_, rows, map_signed_,
                        map_unsigned_, lr, found_inf, hyper);
      } else if (t.v == MomentCodec::kFactored) {
        TORCH_CHECK(t.m == MomentCodec::kNone, "BaocOptimizer: format ", t.name, ": the factored kernel keeps no m");
        // Matrices: the factored kernel. 1-D tensors keep a full float32 v: the same math as kNoMomentum.
        std::vector<at::Tensor> fp, fg, fr, fc, np, ng, nm, nv;
        std::vector<float> fwd, nwd, nk;
        std::vector<int64_t> frow, nrow;
        for (size_t j = 0; j < idx.size(); ++j) {
          const BaocTensorState& s = states_[indices[idx[j]]];
          if (s.v_row.defined()) {
            fp.push_back(ps[j]); fg.push_back(gs[j]); fr.push_back(s.v_row); fc.push_back(s.v_col);
            fwd.push_back(wds[j]); frow.push_back(rows[j]);
          } else {
            np.push_back(ps[j]); ng.push_back(gs[j]); nm.push_back(at::Tensor()); nv.push_back(s.v);
            nwd.push_back(wds[j]); nk.push_back(ks[j]); nrow.push_back(rows[j]);
          }
        }
        factored_step_cuda(fp, fg, fr, fc, fwd, lr_scales_device(), counts_, frow, lr, found_inf, hyper);
        adam_step_cuda(UpdateRule::kNoMomentum, at::kFloat, np, ng, nm, nv, nwd, lr_scales_device(), nk, counts_,
                       nrow, lr, found_inf, hyper);
      } else {
        // The element-wise kernel: the rule from the moments kept, the storage type from their codec.
        const MomentCodec storage = t.m != MomentCodec::kNone ? t.m : t.v;
        TORCH_CHECK((t.m == MomentCodec::kNone || t.v == MomentCodec::kNone || t.m == t.v) &&
                        (storage == MomentCodec::kNone || storage == MomentCodec::kFloat32 ||
                         storage == MomentCodec::kBFloat16),
                    "BaocOptimizer: format ", t.name, " has no kernel (moments of one type, float32 or bfloat16)");
        adam_step_cuda(update_rule_for(t.m != MomentCodec::kNone, t.v != MomentCodec::kNone),
                       storage == MomentCodec::kBFloat16 ? at::kBFloat16 : at::kFloat, ps, gs, ms, vs, wds,
                       lr_scales_device(), ks, counts_, rows, lr, found_inf, hyper);
      }
    }
    return;
  }
#endif
  const at::Tensor counts_cpu = counts_.cpu();
  const double lr_value = lr.item<double>();
  for (size_t k = 0; k < indices.size(); ++k) {
    const size_t i = indices[k];
    const auto row = static_cast<int64_t>(i);
    baoc_tensor_step_reference(states_[i], params()[i], g[k], lr_value * lr_scales()[i], weight_decays()[i],
                               counts_cpu[row][0].item<double>(), counts_cpu[row][1].item<double>(), options_,
                               map_signed_, map_unsigned_);
  }
}

void baoc_tensor_step_reference(BaocTensorState& s, const at::Tensor& p, const at::Tensor& g_in, double lr_eff,
                                double wd, double count_m, double count_v, const BaocOptions& o,
                                const at::Tensor& map_signed, const at::Tensor& map_unsigned) {
  const torch::NoGradGuard no_grad;
  const at::Tensor g = like_param(g_in, p);
  const double bc1 = bias_correction(o.beta1, count_m);
  const double bc2 = bias_correction(o.beta2, count_v);
  // The rule follows from the moments the format keeps (state_format.h); moments are updated in float32 and stored
  // back in their codec.
  const StateFormatTraits& t = state_format_traits(s.format);
  const bool has_m = t.m != MomentCodec::kNone, has_v = t.v != MomentCodec::kNone;
  if (has_v && (!has_m || t.v == MomentCodec::kFactored)) {
    TORCH_CHECK(!has_m && (t.v == MomentCodec::kFactored || t.v == MomentCodec::kFloat32), "BaocOptimizer: format ",
                t.name, " has no reference rule");
    const auto f32 = p.options().dtype(at::kFloat);
    second_moment_only_step(s, p, g, at::scalar_tensor(lr_eff, f32), wd, at::scalar_tensor(bc2, f32),
                            at::scalar_tensor(true, p.options().dtype(at::kBool)), o);
    return;
  }
  const at::Tensor m = moment_decode(t.m, s, false, p, map_signed);
  const at::Tensor v = moment_decode(t.v, s, true, p, map_unsigned);
  p.mul_(1 - lr_eff * wd);
  if (has_m) m.mul_(o.beta1).add_(g, 1 - o.beta1);
  if (has_v) {
    // The order of torch::optim::AdamW: decay, moments, denom = √v / √bc2 + ε, p −= (lr / bc1) · m / denom.
    v.mul_(o.beta2).addcmul_(g, g, 1 - o.beta2);
    const at::Tensor denom = (v.sqrt() / std::sqrt(bc2)).add_(o.eps);
    p.addcdiv_(m, denom, -lr_eff / bc1);
  } else if (has_m) {
    p.add_(m, -lr_eff * s.sgd_scale / bc1);
  } else {
    p.add_(g, -lr_eff * s.sgd_scale);
  }
  if (has_m) moment_store(t.m, m, p, map_signed, m_slot(s));
  if (has_v) moment_store(t.v, v, p, map_unsigned, v_slot(s));
}

void BaocOptimizer::stream_stats_enable(bool on) {
  if (on == stats_on_) return;
  TORCH_CHECK(!on || !sharded() || sum_over_ranks_,
              "BaocOptimizer: a statistics window over sharded state needs set_sum_over_ranks");
  stats_on_ = on;
  stats_prev_.clear();
  if (!stats_have_prev_.defined()) stats_have_prev_ = at::zeros({1}, counts_.options());
  stats_have_prev_.zero_();
  if (on) {
    const auto f64 = counts_.options();
    if (!stats_sum_.defined()) stats_sum_ = at::zeros({static_cast<int64_t>(params().size()), kStreamColumns}, f64);
    for (size_t i = 0; i < params().size(); ++i) {
      const at::Tensor& p = params()[i];
      stats_prev_.push_back(owned(i) ? at::zeros_like(p, p.options().dtype(at::kFloat)) : at::Tensor());
    }
  }
}

void BaocOptimizer::stream_stats_add(const std::vector<at::Tensor>& grads, const at::Tensor& found_inf) {
  const at::Tensor ok = found_inf.reshape({}).eq(0);
  const at::Tensor zero = at::zeros({}, counts_.options());
  const at::Tensor have_prev = stats_have_prev_.reshape({});
  std::vector<at::Tensor> rows;
  // No host branches on the window's progress: the previous gradient starts at zero (its terms add nothing) and
  // have_prev, a device flag, masks |g_t|² of the window's first step, so a captured graph replays correctly.
  for (size_t i = 0; i < params().size(); ++i) {
    if (!owned(i)) {  // its owner's row (summed over the ranks when read)
      rows.push_back(at::zeros({kStreamColumns}, counts_.options()));
      continue;
    }
    const at::Tensor g = like_param(grads[i], params()[i]);
    const at::Tensor gg = (g * g).sum().to(at::kDouble);
    const at::Tensor pair_dot = (g * stats_prev_[i]).sum().to(at::kDouble);
    const at::Tensor pair_prev = (stats_prev_[i] * stats_prev_[i]).sum().to(at::kDouble);
    const at::Tensor pair_cur = gg * have_prev;
    const at::Tensor m = m_float(i);
    const at::Tensor mom_dot = m.defined() ? (g * m).sum().to(at::kDouble) : zero;
    const at::Tensor mom_sq = m.defined() ? (m * m).sum().to(at::kDouble) : zero;
    const at::Tensor mom_gg = m.defined() ? gg : zero;
    rows.push_back(at::stack({pair_dot, pair_prev, pair_cur, mom_dot, mom_sq, mom_gg}));
    stats_prev_[i].copy_(at::where(ok, g, stats_prev_[i]));
  }
  const at::Tensor sums = at::stack(rows);  // (T, kStreamColumns)
  stats_sum_.add_(at::where(ok, sums, at::zeros_like(sums)));
  stats_have_prev_.copy_(at::where(ok, at::ones_like(stats_have_prev_), stats_have_prev_));
}

void BaocOptimizer::sum_in_place(at::Tensor& t) const {
  if (!sharded()) return;
  TORCH_CHECK(sum_over_ranks_, "BaocOptimizer: sharded state needs set_sum_over_ranks");
  sum_over_ranks_(t);
}

std::vector<double> BaocOptimizer::sum_over_ranks(std::vector<double> values) const {
  if (!sharded() || values.empty()) return values;
  at::Tensor t = at::tensor(values, at::kDouble).to(counts_.device());
  sum_in_place(t);
  const at::Tensor host = t.cpu().contiguous();
  const double* d = host.data_ptr<double>();
  return {d, d + host.numel()};
}

at::Tensor BaocOptimizer::stream_stats_take() {
  if (!stats_sum_.defined()) return at::zeros({static_cast<int64_t>(params().size()), kStreamColumns}, at::kDouble);
  at::Tensor sums = stats_sum_.clone();
  sum_in_place(sums);
  stats_sum_.zero_();
  return sums.cpu();
}

Optimizer::NamedTensors BaocOptimizer::state_tensors() { return state_entries(/*for_checkpoint=*/true); }

Optimizer::NamedTensors BaocOptimizer::state_entries(bool for_checkpoint) {
  state_init();
  NamedTensors out;
  std::vector<int64_t> codes;
  std::vector<float> scales;
  for (const auto& s : states_) {
    codes.push_back(static_cast<int64_t>(s.format));
    scales.push_back(s.sgd_scale);
  }
  out.emplace_back("baoc.formats", at::tensor(codes, at::kLong));
  out.emplace_back("baoc.sgd_scales", at::tensor(scales, at::kFloat));
  out.emplace_back("baoc.counts", counts_);
  // The statistics window in progress (so a resume inside it stays exact).
  if (!stats_sum_.defined()) stats_sum_ = at::zeros({static_cast<int64_t>(params().size()), kStreamColumns}, counts_.options());
  if (for_checkpoint && sharded() && sum_over_ranks_) {  // (without it no window ever ran: the sums are zero)
    at::Tensor sums = stats_sum_.clone();  // every row from its owner
    sum_in_place(sums);
    out.emplace_back("baoc.stream_sums", sums);
  } else {
    out.emplace_back("baoc.stream_sums", stats_sum_);
  }
  if (!stats_have_prev_.defined()) stats_have_prev_ = at::zeros({1}, counts_.options());
  out.emplace_back("baoc.stream_have_prev", stats_have_prev_);
  if (stats_on_) {
    for (size_t i = 0; i < params().size(); ++i) {
      // Another rank's previous gradient: a host temporary its owner's is gathered into.
      const at::Tensor prev = owned(i) ? stats_prev_[i] : at::zeros(params()[i].sizes(), at::kFloat);
      out.emplace_back(names()[i] + ".g_prev", prev);
    }
  }
  for (size_t i = 0; i < states_.size(); ++i) {
    // Another process's tensor: host temporaries of its format's shapes, its owner's values gathered into them
    // (train/param_shards.h).
    const BaocTensorState s = owned(i) ? states_[i] : state_host_temporary(i);
    const std::pair<const char*, const at::Tensor*> fields[] = {{".m", &s.m},           {".v", &s.v},
                                                                {".m_absmax", &s.m_absmax}, {".v_absmax", &s.v_absmax},
                                                                {".v_row", &s.v_row},   {".v_col", &s.v_col}};
    for (const auto& [suffix, t] : fields) {
      if (t->defined()) out.emplace_back(names()[i] + suffix, *t);
    }
  }
  return out;
}

void BaocOptimizer::state_load(const NamedTensors& stored, const std::string& path) {
  const auto find = [&](const std::string& name) -> at::Tensor {
    for (const auto& [n, t] : stored) {
      if (n == name) return t;
    }
    throw UserError("checkpoint " + path + " lacks optimizer tensor '" + name +
                    "' (written by another " + option_ref("optimizer") + "? resume with the one it was trained with)");
  };
  const at::Tensor codes = find("baoc.formats").to(at::kLong).contiguous();
  const at::Tensor scales = find("baoc.sgd_scales").to(at::kFloat).contiguous();
  TRIACCEL_CHECK_INPUT(codes.numel() == static_cast<int64_t>(params().size()), "checkpoint ", path, " holds ",
                       codes.numel(), " optimizer formats, this run has ", params().size(), " parameters");
  std::vector<StateFormat> formats;
  for (int64_t i = 0; i < codes.numel(); ++i) {
    const int64_t c = codes[i].item<int64_t>();
    TRIACCEL_CHECK_INPUT(c >= 0 && c < static_cast<int64_t>(state_format_table().size()), "checkpoint ", path,
                         " has a bad optimizer format code ", c);
    formats.push_back(static_cast<StateFormat>(c));
  }
  // Fresh state in the stored formats, then every tensor copied in by name.
  initialized_ = false;
  pending_formats_ = formats;
  state_init();
  for (size_t i = 0; i < states_.size(); ++i) states_[i].sgd_scale = scales[static_cast<int64_t>(i)].item<float>();
  bool window_open = false;
  for (const auto& [n, t] : stored) window_open = window_open || (!names().empty() && n == names()[0] + ".g_prev");
  stream_stats_enable(window_open);
  named_tensors_load(state_entries(/*for_checkpoint=*/false), stored, "optimizer", path);
  if (sharded()) {  // the stored sums hold every rank's rows: keep the owned ones (the others are their owners')
    for (size_t i = 0; i < params().size(); ++i) {
      if (!owned(i)) stats_sum_[static_cast<int64_t>(i)].zero_();
    }
  }
}

}  // namespace triaccel
