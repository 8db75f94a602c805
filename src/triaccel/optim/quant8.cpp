#include "triaccel/optim/quant8.h"

#include "triaccel/optim/state_format.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace triaccel {

at::Tensor quant8_map(bool is_signed) {
  const int bits = is_signed ? 7 : 8;
  std::vector<double> mags;
  for (int e = 0; e < bits; ++e) {
    const int count = 1 << (bits - 1 - e);
    const double top = std::pow(10.0, -e);
    for (int j = 1; j <= count; ++j) mags.push_back(top * (0.1 + 0.9 * j / count));
  }
  std::vector<float> values;
  for (double m : mags) values.push_back(static_cast<float>(m));
  values.push_back(0.f);
  if (is_signed) {
    for (double m : mags) values.push_back(static_cast<float>(-m));
    values.push_back(0.f);
  }
  std::sort(values.begin(), values.end());
  TORCH_CHECK(values.size() == 256, "quant8_map: ", values.size(), " values");
  return at::tensor(values, at::kFloat);
}

at::Tensor quant8_midpoints(const at::Tensor& map) {
  return (map.narrow(0, 0, 255) + map.narrow(0, 1, 255)) * 0.5;
}

at::Tensor quant8_absmax_round_up(const at::Tensor& absmax) {
  // A non-negative finite float32 rounds up to a bfloat16 by adding 0xFFFF to its bits and clearing the low 16
  // (the kernel does the same in registers, so both paths store the same scale).
  const at::Tensor bits = absmax.to(at::kFloat).contiguous().view(at::kInt);
  const at::Tensor up = bits.add(0xFFFF).bitwise_and(static_cast<int64_t>(static_cast<int32_t>(0xFFFF0000u)));
  return up.view(at::kFloat).to(at::kBFloat16);  // exact: the low 16 bits are zero
}

Quantized8 quant8_encode(const at::Tensor& x, const at::Tensor& map) {
  const int64_t n = x.numel();
  const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  at::Tensor flat = x.contiguous().reshape({-1}).to(at::kFloat);
  flat = at::constant_pad_nd(flat, {0, blocks * kQuantBlock - n}).view({blocks, kQuantBlock});
  const at::Tensor absmax = quant8_absmax_round_up(flat.abs().amax(1));  // (blocks) bfloat16
  const at::Tensor a = absmax.to(at::kFloat).unsqueeze(1);
  const at::Tensor normalized = at::where(a > 0, flat / a, at::zeros_like(flat));
  const at::Tensor mids = quant8_midpoints(map).to(x.device());
  const at::Tensor codes = at::bucketize(normalized, mids).to(at::kByte).reshape({-1}).narrow(0, 0, n);
  return {codes.contiguous(), absmax};
}

at::Tensor quant8_decode(const Quantized8& q, const at::Tensor& map, at::IntArrayRef shape) {
  const int64_t n = q.codes.numel();
  const at::Tensor values = map.to(q.codes.device()).index_select(0, q.codes.to(at::kLong));
  const at::Tensor scale = q.absmax.to(at::kFloat).repeat_interleave(kQuantBlock).narrow(0, 0, n);
  return (values * scale).reshape(shape);
}

}  // namespace triaccel
