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
  double u_sq = 0, du_bf16 = 0, du_8bit = 0, du_factor = 0, du_scalar = 0;
  double mh_sq = 0, noise = 0, logv = 0, logv_sq = 0, elems = 0;
};

double sum_d(const at::Tensor& t) { return t.sum().item<double>(); }

at::Tensor update_dir(const at::Tensor& mh, const at::Tensor& vh, double eps) { return mh / (vh.sqrt() + eps); }

}  // namespace

std::vector<UnitSignals> baoc_signals(const BaocOptimizer& opt, const at::Tensor& stream_sums,
                                      const std::vector<int64_t>& unit_of_tensor, int64_t num_units,
                                      const std::vector<UnitSignals>& previous) {
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
    const at::Tensor m = opt.m_float(i).to(at::kDouble), v = opt.v_float(i).to(at::kDouble);
    const double bc1 = 1 - std::pow(b1, cm), bc2 = 1 - std::pow(b2, cv);
    const at::Tensor mh = m / bc1, vh = v / bc2;
    const at::Tensor u_exact = update_dir(mh, vh, eps);
    a.u_sq += sum_d(u_exact * u_exact);
    // One scalar preconditioner per tensor, the SGD formats' k = 1 / (√mean(v̂) + ε): the same metric as the
    // factorization's error below, so the two compare (a scalar is the constant rank-1 factorization).
    a.du_scalar += sum_d((u_exact - mh / (std::sqrt(vh.mean().item<double>()) + eps)).pow(2));
    // bf16: both moments rounded.
    const at::Tensor m16 = m.to(at::kBFloat16).to(at::kDouble), v16 = v.to(at::kBFloat16).to(at::kDouble);
    a.du_bf16 += sum_d((u_exact - update_dir(m16 / bc1, v16 / bc2, eps)).pow(2));
    // 8-bit: the block-wise codec over the logical element order (the optimizer blocks memory order; the same
    // for contiguous tensors, an estimate for channels_last ones).
    const at::Tensor m32 = opt.m_float(i), v32 = opt.v_float(i);
    const at::Tensor ms = opt.map_signed(), mu = opt.map_unsigned();
    const at::Tensor m8 = quant8_decode(quant8_encode(m32.reshape({-1}), ms), ms, {m32.numel()}).to(at::kDouble);
    const at::Tensor v8 = quant8_decode(quant8_encode(v32.reshape({-1}), mu), mu, {v32.numel()}).to(at::kDouble);
    a.du_8bit += sum_d((u_exact.reshape({-1}) - update_dir(m8 / bc1, v8 / bc2, eps)).pow(2));
    // Rank-1 factorization of v̂ (matrices only; 1-D tensors keep a full v in the factored format).
    const auto [rows, cols] = state_format_factor_shape(opt.params()[i].sizes().vec());
    if (rows > 0) {
      const at::Tensor v2 = vh.reshape({rows, cols});
      const at::Tensor r = v2.mean(1), c = v2.mean(0);
      const at::Tensor vf = (at::outer(r, c) / r.mean()).reshape(vh.sizes());
      a.du_factor += sum_d((u_exact - update_dir(mh, vf, eps)).pow(2));
    }
    a.mh_sq += sum_d(mh * mh);
    a.noise += sum_d((vh - mh * mh).clamp_min(0));
    const at::Tensor logv = (vh + 1e-30).log();
    a.logv += sum_d(logv);
    a.logv_sq += sum_d(logv * logv);
    a.elems += static_cast<double>(vh.numel());
  }
  if (opt.sharded()) {  // the stream's sums are every rank's already; the moments' are summed here
    std::vector<double> flat;
    for (const UnitSums& a : acc) {
      for (double v : {a.state ? 1.0 : 0.0, a.u_sq, a.du_bf16, a.du_8bit, a.du_factor, a.du_scalar, a.mh_sq, a.noise,
                       a.logv, a.logv_sq, a.elems}) {
        flat.push_back(v);
      }
    }
    flat = opt.sum_over_ranks(std::move(flat));
    size_t at = 0;
    for (UnitSums& a : acc) {
      a.state = flat[at++] > 0;
      for (double* v : {&a.u_sq, &a.du_bf16, &a.du_8bit, &a.du_factor, &a.du_scalar, &a.mh_sq, &a.noise, &a.logv,
                        &a.logv_sq, &a.elems}) {
        *v = flat[at++];
      }
    }
  }
  std::vector<UnitSignals> out(static_cast<size_t>(num_units));
  for (int64_t u = 0; u < num_units; ++u) {
    const UnitSums& a = acc[static_cast<size_t>(u)];
    UnitSignals s = previous.size() == static_cast<size_t>(num_units) ? previous[static_cast<size_t>(u)] : UnitSignals{};
    s.params = params[static_cast<size_t>(u)];
    if (a.pair_prev > 0 && a.pair_cur > 0) s.cos_successive = a.pair_dot / std::sqrt(a.pair_prev * a.pair_cur);
    if (a.mom_sq > 0 && a.mom_gg > 0) s.cos_momentum = a.mom_dot / std::sqrt(a.mom_sq * a.mom_gg);
    if (a.state && a.u_sq > 0) {
      s.quant_error_bf16 = std::sqrt(a.du_bf16 / a.u_sq);
      s.quant_error_8bit = std::sqrt(a.du_8bit / a.u_sq);
      s.factor_error = std::sqrt(a.du_factor / a.u_sq);
      s.precond_error = std::sqrt(a.du_scalar / a.u_sq);
      s.snr = a.noise > 0 ? a.mh_sq / a.noise : 0;
      const double mean = a.logv / a.elems;
      s.log_v_spread = std::sqrt(std::max(0.0, a.logv_sq / a.elems - mean * mean));
    }
    out[static_cast<size_t>(u)] = s;
  }
  return out;
}

}  // namespace triaccel
