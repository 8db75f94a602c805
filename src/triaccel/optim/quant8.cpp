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

namespace {

// One chunk of whole blocks (the last one may be short): the codec's ATen reference, whose temporaries are about
// kQuant8ChunkBytesPerElement bytes an element (the padded copy, the normalized values, bucketize's int64 indices).
void encode_chunk(const at::Tensor& flat_in, const at::Tensor& mids, at::Tensor codes_out, at::Tensor absmax_out) {
  const int64_t n = flat_in.numel();
  const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  const at::Tensor flat = at::constant_pad_nd(flat_in, {0, blocks * kQuantBlock - n}).view({blocks, kQuantBlock});
  const at::Tensor absmax = quant8_absmax_round_up(flat.abs().amax(1));  // (blocks) bfloat16
  const at::Tensor a = absmax.to(at::kFloat).unsqueeze(1);
  const at::Tensor normalized = at::where(a > 0, flat / a, at::zeros_like(flat));
  codes_out.copy_(at::bucketize(normalized, mids).to(at::kByte).reshape({-1}).narrow(0, 0, n));
  absmax_out.copy_(absmax);
}

}  // namespace

Quantized8 quant8_encode(const at::Tensor& x, const at::Tensor& map) {
  const int64_t n = x.numel();
  const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  const at::Tensor flat = x.contiguous().reshape({-1}).to(at::kFloat);
  const at::Tensor mids = quant8_midpoints(map).to(x.device());
  Quantized8 q{at::empty({n}, flat.options().dtype(at::kByte)), at::empty({blocks}, flat.options().dtype(at::kBFloat16))};
  // Chunk by chunk (whole blocks each, so the bytes are the whole tensor's): the temporaries stay a few MB whatever
  // the tensor (a BAOC conversion of ResNet-18's largest convolution ran out of memory in them under a budget).
  for (int64_t a = 0; a < n; a += kQuant8ChunkElements) {
    const int64_t len = std::min(kQuant8ChunkElements, n - a);
    encode_chunk(flat.narrow(0, a, len), mids, q.codes.narrow(0, a, len),
                 q.absmax.narrow(0, a / kQuantBlock, (len + kQuantBlock - 1) / kQuantBlock));
  }
  return q;
}

at::Tensor quant8_decode(const Quantized8& q, const at::Tensor& map, at::IntArrayRef shape) {
  const int64_t n = q.codes.numel();
  const at::Tensor m = map.to(q.codes.device());
  at::Tensor out = at::empty({n}, q.codes.options().dtype(at::kFloat));
  for (int64_t a = 0; a < n; a += kQuant8ChunkElements) {  // chunks of whole blocks, as quant8_encode
    const int64_t len = std::min(kQuant8ChunkElements, n - a);
    const at::Tensor values = m.index_select(0, q.codes.narrow(0, a, len).to(at::kLong));
    const at::Tensor scale = q.absmax.narrow(0, a / kQuantBlock, (len + kQuantBlock - 1) / kQuantBlock)
                                 .to(at::kFloat)
                                 .repeat_interleave(kQuantBlock)
                                 .narrow(0, 0, len);
    out.narrow(0, a, len).copy_(values * scale);
  }
  return out.reshape(shape);
}

}  // namespace triaccel
