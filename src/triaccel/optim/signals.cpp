#include "triaccel/optim/signals.h"

#include "triaccel/optim/quant8.h"

#include <ATen/ATen.h>
#include <torch/utils.h>
#include <torch/autograd.h>

#include <cmath>

namespace triaccel {
namespace {

struct UnitSums {
  double pair_dot = 0, pair_prev = 0, pair_cur = 0, mom_dot = 0, mom_sq = 0, mom_gg = 0;
  bool state = false;  // some tensor had exact state
  MomentSums moments;  // over the unit's tensors with exact state
};

at::Tensor update_dir(const at::Tensor& mh, const at::Tensor& vh, double eps) { return mh / (vh.sqrt() + eps); }

// Elements [a, a + len) of t in its logical (row-major) order: a view when t is contiguous, else a copy of the
// dim-0 slices that hold them (a channels_last weight: len plus at most two of its rows).
at::Tensor logical_range(const at::Tensor& t, int64_t a, int64_t len) {
  if (t.is_contiguous() || t.dim() == 0) return t.reshape({-1}).narrow(0, a, len);
  const int64_t per_row = t.numel() / t.size(0);
  const int64_t r0 = a / per_row, r1 = (a + len + per_row - 1) / per_row;
  return t.narrow(0, r0, r1 - r0).reshape({-1}).narrow(0, a - r0 * per_row, len);
}

}  // namespace

MomentSums moment_sums(const at::Tensor& m32, const at::Tensor& v32, const at::Tensor& map_signed,
                       const at::Tensor& map_unsigned, double bc1, double bc2, double eps, int64_t chunk_elements) {
  TORCH_CHECK(chunk_elements > 0 && chunk_elements % kQuantBlock == 0, "moment_sums: chunks of ", chunk_elements,
              " elements, not a multiple of the 8-bit codec's block of ", kQuantBlock);
  const torch::NoGradGuard no_grad;
  const int64_t n = v32.numel();
  const auto f64 = v32.options().dtype(at::kDouble);
  // A first pass: the mean of v̂ (the SGD formats' scalar preconditioner) and the rank-1 factors of v̂ (its row and
  // column means over the factor shape, optim/state_format.h), also chunk by chunk (a float64 sum of the whole
  // tensor would convert it whole first). Row k of the factor shape holds the logical elements [k·cols, (k+1)·cols).
  const auto [rows, cols] = state_format_factor_shape(v32.sizes().vec());
  at::Tensor v_sum = at::zeros({}, f64), r, c;
  if (rows > 0) {
    r = at::zeros({rows}, f64);
    c = at::zeros({cols}, f64);
  }
  for (int64_t a = 0; a < n; a += chunk_elements) {
    const int64_t len = std::min(chunk_elements, n - a);
    const at::Tensor v = logical_range(v32, a, len).to(at::kDouble);
    v_sum += v.sum();
    if (rows > 0) {
      const at::Tensor k = at::arange(a, a + len, f64.dtype(at::kLong));
      r.index_add_(0, at::floor_divide(k, cols), v);
      c.index_add_(0, at::remainder(k, cols), v);
    }
  }
  const double v_mean = n > 0 ? v_sum.item<double>() / static_cast<double>(n) / bc2 : 0.0;
  const double scalar_den = std::sqrt(v_mean) + eps;
  double r_mean = 1;
  if (rows > 0) {
    r /= static_cast<double>(cols) * bc2;
    c /= static_cast<double>(rows) * bc2;
    r_mean = r.mean().item<double>();
  }
  // Then chunk by chunk: each chunk starts at a multiple of the codec's block, so its 8-bit blocks are the whole
  // tensor's. Each term in its own statement, so that its temporaries go before the next (live at once: the chunk's
  // m, v, m̂, v̂ and u in float64 and one term's few). The sums stay on the device (one read at the end).
  at::Tensor sums = at::zeros({9}, f64);
  for (int64_t a = 0; a < n; a += chunk_elements) {
    const int64_t len = std::min(chunk_elements, n - a);
    const at::Tensor m32c = logical_range(m32, a, len).contiguous(), v32c = logical_range(v32, a, len).contiguous();
    const at::Tensor m = m32c.to(at::kDouble), v = v32c.to(at::kDouble);
    const at::Tensor mh = m / bc1, vh = v / bc2;
    const at::Tensor u = update_dir(mh, vh, eps);
    const auto du = [&](const at::Tensor& m_other, const at::Tensor& v_other) {
      return (u - update_dir(m_other, v_other, eps)).pow(2).sum();
    };
    std::vector<at::Tensor> part(9);
    part[0] = (u * u).sum();
    // One scalar preconditioner per tensor, the SGD formats' k = 1 / (√mean(v̂) + ε): the same metric as the
    // factorization's error below, so the two compare (a scalar is the constant rank-1 factorization).
    part[1] = (u - mh / scalar_den).pow(2).sum();
    part[2] = du(m.to(at::kBFloat16).to(at::kDouble) / bc1, v.to(at::kBFloat16).to(at::kDouble) / bc2);
    // 8-bit: the block-wise codec over the logical element order (the optimizer blocks memory order; the same for
    // contiguous tensors, an estimate for channels_last ones).
    part[3] = du(quant8_decode(quant8_encode(m32c, map_signed), map_signed, {len}).to(at::kDouble) / bc1,
                 quant8_decode(quant8_encode(v32c, map_unsigned), map_unsigned, {len}).to(at::kDouble) / bc2);
    if (rows > 0) {
      const at::Tensor k = at::arange(a, a + len, f64.dtype(at::kLong));
      part[4] = du(mh, r.index_select(0, at::floor_divide(k, cols)) * c.index_select(0, at::remainder(k, cols)) /
                           r_mean);
    } else {
      part[4] = at::zeros({}, f64);
    }
    part[5] = (mh * mh).sum();
    part[6] = (vh - mh * mh).clamp_min(0).sum();
    const at::Tensor logv = (vh + 1e-30).log();
    part[7] = logv.sum();
    part[8] = (logv * logv).sum();
    sums += at::stack(part);
  }
  const at::Tensor h = sums.cpu();
  const double* x = h.data_ptr<double>();
  MomentSums out;
  out.u_sq = x[0];
  out.du_scalar = x[1];
  out.du_bf16 = x[2];
  out.du_8bit = x[3];
  out.du_factor = x[4];
  out.mh_sq = x[5];
  out.noise = x[6];
  out.logv = x[7];
  out.logv_sq = x[8];
  out.elems = static_cast<double>(n);
  return out;
}

std::vector<UnitSignals> baoc_signals(const BaocOptimizer& opt, const at::Tensor& stream_sums,
                                      const std::vector<int64_t>& unit_of_tensor, int64_t num_units,
                                      const std::vector<UnitSignals>& previous, int64_t chunk_elements) {
  const torch::NoGradGuard no_grad;
  const size_t n_tensors = opt.params().size();
  TORCH_CHECK(unit_of_tensor.size() == n_tensors, "baoc_signals: ", unit_of_tensor.size(), " unit indices for ",
              n_tensors, " tensors");
  TORCH_CHECK(stream_sums.size(0) == static_cast<int64_t>(n_tensors) && stream_sums.size(1) == kStreamColumns,
              "baoc_signals: stream sums of shape ", stream_sums.sizes());
  const at::Tensor sums = stream_sums.to(at::kDouble).cpu();
  const at::Tensor counts = opt.counts().cpu();
  const double eps = opt.options().eps, b1 = opt.options().beta1, b2 = opt.options().beta2;
  std::vector<UnitSums> acc(static_cast<size_t>(num_units));
  std::vector<int64_t> params(static_cast<size_t>(num_units), 0);
  for (size_t i = 0; i < n_tensors; ++i) {
    const int64_t u = unit_of_tensor[i];
    TORCH_CHECK(u >= 0 && u < num_units, "baoc_signals: unit ", u, " out of range");
    UnitSums& a = acc[static_cast<size_t>(u)];
    params[static_cast<size_t>(u)] += opt.params()[i].numel();
    const auto row = static_cast<int64_t>(i);
    a.pair_dot += sums[row][kStreamDotPrev].item<double>();
    a.pair_prev += sums[row][kStreamSqPrev].item<double>();
    a.pair_cur += sums[row][kStreamSqCur].item<double>();
    a.mom_dot += sums[row][kStreamDotMom].item<double>();
    a.mom_sq += sums[row][kStreamSqMom].item<double>();
    a.mom_gg += sums[row][kStreamSqGradM].item<double>();
    // Sharded state: the moments are their owner's; that rank adds them (summed over the ranks below).
    if (opt.state(i).format != StateFormat::kAdamW32 || !opt.state_initialized() || !opt.owned(i)) continue;
    const double cm = counts[row][0].item<double>(), cv = counts[row][1].item<double>();
    if (cm <= 0 || cv <= 0) continue;
    a.state = true;
    a.moments += moment_sums(opt.m_float(i), opt.v_float(i), opt.map_signed(), opt.map_unsigned(),
                             1 - std::pow(b1, cm), 1 - std::pow(b2, cv), eps, chunk_elements);
  }
  if (opt.sharded()) {  // the stream's sums are every rank's already; the moments' are summed here
    std::vector<double> flat;
    for (UnitSums& a : acc) {
      flat.push_back(a.state ? 1.0 : 0.0);
      for (const double* v : a.moments.fields()) flat.push_back(*v);
    }
    flat = opt.sum_over_ranks(std::move(flat));
    size_t at = 0;
    for (UnitSums& a : acc) {
      a.state = flat[at++] > 0;
      for (double* v : a.moments.fields()) *v = flat[at++];
    }
  }
  std::vector<UnitSignals> out(static_cast<size_t>(num_units));
  for (int64_t u = 0; u < num_units; ++u) {
    const UnitSums& a = acc[static_cast<size_t>(u)];
    UnitSignals s = previous.size() == static_cast<size_t>(num_units) ? previous[static_cast<size_t>(u)] : UnitSignals{};
    s.params = params[static_cast<size_t>(u)];
    if (a.pair_prev > 0 && a.pair_cur > 0) s.cos_successive = a.pair_dot / std::sqrt(a.pair_prev * a.pair_cur);
    if (a.mom_sq > 0 && a.mom_gg > 0) s.cos_momentum = a.mom_dot / std::sqrt(a.mom_sq * a.mom_gg);
    const MomentSums& m = a.moments;
    if (a.state && m.u_sq > 0) {
      s.quant_error_bf16 = std::sqrt(m.du_bf16 / m.u_sq);
      s.quant_error_8bit = std::sqrt(m.du_8bit / m.u_sq);
      s.factor_error = std::sqrt(m.du_factor / m.u_sq);
      s.precond_error = std::sqrt(m.du_scalar / m.u_sq);
      s.snr = m.noise > 0 ? m.mh_sq / m.noise : 0;
      const double mean = m.logv / m.elems;
      s.log_v_spread = std::sqrt(std::max(0.0, m.logv_sq / m.elems - mean * mean));
    }
    out[static_cast<size_t>(u)] = s;
  }
  return out;
}

}  // namespace triaccel
