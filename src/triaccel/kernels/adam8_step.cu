// Fused multi-tensor AdamW with 8-bit block-wise states; one launch updates one TensorPack of tensors
// (multi_tensor_apply.cuh). One CUDA block of kQuantBlock (256) threads owns one quantization block of one tensor
// (elements in memory order): each thread dequantizes its m (signed map) and v (unsigned map), applies the AdamW
// update in fp32 (as kAdamW in kernels/adam_step.cu), the block reduces the new absmax of m and of v (rounded up to
// the bfloat16 it is stored as, the rule of quant8_absmax_round_up), and each thread re-quantizes to the nearest
// map value (binary search over the midpoints, ties to the lower code: the rule of quant8_encode). Nothing changes
// when *found_inf != 0.
#include "triaccel/kernels/adam8_step.h"
#include "triaccel/kernels/multi_tensor_apply.cuh"
#include "triaccel/kernels/tensor_checks.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

namespace triaccel {
namespace {

constexpr int kThreads = static_cast<int>(kQuantBlock);
constexpr int kBlockLimit = 1 << 30;  // blocks per launch

struct Adam8Record {
  float* param;
  const float* grad;
  uint8_t* m_codes;         // (numel)
  uint8_t* v_codes;         // (numel)
  __nv_bfloat16* m_absmax;  // (ceil(numel / kQuantBlock))
  __nv_bfloat16* v_absmax;  // (ceil(numel / kQuantBlock))
  const double* counts;     // (count_m, count_v) of the tensor
  int64_t numel;
  float weight_decay;
  const float* lr_scale;    // on the device: read at every launch
};
using Adam8Pack = TensorPack<Adam8Record, 1>;  // one phase: one block per quantization block

__device__ __forceinline__ float block_max(float x, float* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float r = scratch[0];
  for (int w = 1; w < kThreads / 32; ++w) r = fmaxf(r, scratch[w]);
  return r;
}

// A non-negative finite float rounded up to a bfloat16 (returned as the float it equals).
__device__ __forceinline__ float round_up_to_bf16(float x) {
  return __uint_as_float((__float_as_uint(x) + 0xFFFFu) & 0xFFFF0000u);
}

// The number of midpoints < x: the index of the nearest map value (ties to the lower one).
__device__ __forceinline__ int nearest_code(const float* mids, float x) {
  int lo = 0, hi = 255;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (mids[mid] < x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

__global__ void adam8_step_kernel(const __grid_constant__ Adam8Pack pack, const float* __restrict__ map_s,
                                  const float* __restrict__ map_u, const float* __restrict__ lr_ptr,
                                  const float* __restrict__ found_inf_ptr, AdamStepHyper h) {
  if (*found_inf_ptr != 0.f) return;
  __shared__ float smap_s[256], smap_u[256], smid_s[255], smid_u[255], scratch[kThreads / 32], bc[2];
  smap_s[threadIdx.x] = map_s[threadIdx.x];
  smap_u[threadIdx.x] = map_u[threadIdx.x];
  __syncthreads();
  if (threadIdx.x < 255) {
    smid_s[threadIdx.x] = (smap_s[threadIdx.x] + smap_s[threadIdx.x + 1]) * 0.5f;
    smid_u[threadIdx.x] = (smap_u[threadIdx.x] + smap_u[threadIdx.x + 1]) * 0.5f;
  }
  const int t = tensor_pack_find(pack.block_start[0], pack.count);
  const Adam8Record& rec = pack.rec[t];
  if (threadIdx.x == 0) {
    bc[0] = static_cast<float>(1.0 - pow(static_cast<double>(h.beta1), rec.counts[0]));
    bc[1] = static_cast<float>(1.0 - pow(static_cast<double>(h.beta2), rec.counts[1]));
  }
  __syncthreads();
  const int64_t qb = static_cast<int64_t>(blockIdx.x) - pack.block_start[0][t];
  const int64_t i = qb * kQuantBlock + threadIdx.x;
  const bool valid = i < rec.numel;
  const float lr = *lr_ptr * *rec.lr_scale;
  float m = 0.f, v = 0.f;
  if (valid) {
    float pv = rec.param[i] * (1.f - lr * rec.weight_decay);
    const float g = rec.grad[i];
    m = smap_s[rec.m_codes[i]] * __bfloat162float(rec.m_absmax[qb]);
    v = smap_u[rec.v_codes[i]] * __bfloat162float(rec.v_absmax[qb]);
    m = h.beta1 * m + (1.f - h.beta1) * g;
    v = h.beta2 * v + (1.f - h.beta2) * g * g;
    pv -= (lr / bc[0]) * m / (sqrtf(v) / sqrtf(bc[1]) + h.eps);
    rec.param[i] = pv;
  }
  const float m_max = round_up_to_bf16(block_max(valid ? fabsf(m) : 0.f, scratch));
  const float v_max = round_up_to_bf16(block_max(valid ? fabsf(v) : 0.f, scratch));
  if (valid) {
    rec.m_codes[i] = static_cast<uint8_t>(nearest_code(smid_s, m_max > 0.f ? m / m_max : 0.f));
    rec.v_codes[i] = static_cast<uint8_t>(nearest_code(smid_u, v_max > 0.f ? v / v_max : 0.f));
  }
  if (threadIdx.x == 0) {
    rec.m_absmax[qb] = __float2bfloat16_rz(m_max);  // exact: m_max is a bfloat16 value
    rec.v_absmax[qb] = __float2bfloat16_rz(v_max);
  }
}

void adam8_step_launch(const Adam8Pack& pack, const float* map_s, const float* map_u, const float* lr,
                       const float* found_inf, const AdamStepHyper& h, cudaStream_t stream) {
  const int blocks = pack.block_start[0][pack.count];
  if (blocks == 0) return;
  adam8_step_kernel<<<blocks, kThreads, 0, stream>>>(pack, map_s, map_u, lr, found_inf, h);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void adam8_step_cuda(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& m_codes, const std::vector<at::Tensor>& v_codes,
                     const std::vector<at::Tensor>& m_absmax, const std::vector<at::Tensor>& v_absmax,
                     const std::vector<float>& weight_decays, const at::Tensor& lr_scales,
                     const at::Tensor& counts, const std::vector<int64_t>& count_rows, const at::Tensor& map_signed,
                     const at::Tensor& map_unsigned, const at::Tensor& lr, const at::Tensor& found_inf,
                     const AdamStepHyper& hyper) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && m_codes.size() == n && v_codes.size() == n && m_absmax.size() == n &&
                  v_absmax.size() == n && weight_decays.size() == n && count_rows.size() == n,
              "adam8_step_cuda: list lengths differ");
  if (n == 0) return;
  const at::Device device = params[0].device();
  tensor_check_cuda("adam8_step_cuda", lr, "lr", device, at::kFloat);
  tensor_check_cuda("adam8_step_cuda", found_inf, "found_inf", device, at::kFloat);
  tensor_check_cuda("adam8_step_cuda", counts, "counts", device, at::kDouble);
  tensor_check_cuda("adam8_step_cuda", map_signed, "map_signed", device, at::kFloat);
  tensor_check_cuda("adam8_step_cuda", map_unsigned, "map_unsigned", device, at::kFloat);
  TORCH_CHECK(map_signed.numel() == 256 && map_unsigned.numel() == 256, "adam8_step_cuda: maps must have 256 values");
  TORCH_CHECK(counts.is_contiguous() && counts.dim() == 2 && counts.size(1) == 2, "adam8_step_cuda: counts must be (T, 2)");
  lr_scales_check("adam8_step_cuda", lr_scales, device, counts.size(0));
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float* map_s_ptr = map_signed.data_ptr<float>();
  const float* map_u_ptr = map_unsigned.data_ptr<float>();
  const float* lr_ptr = lr.data_ptr<float>();
  const float* found_inf_ptr = found_inf.data_ptr<float>();
  auto packer = make_tensor_packer<Adam8Record, 1>("adam8_step_cuda", kBlockLimit, [&](const Adam8Pack& pack) {
    adam8_step_launch(pack, map_s_ptr, map_u_ptr, lr_ptr, found_inf_ptr, hyper, stream);
  });
  for (size_t i = 0; i < n; ++i) {
    tensor_check_cuda("adam8_step_cuda", params[i], "param", device, at::kFloat);
    tensor_check_cuda("adam8_step_cuda", grads[i], "grad", device, at::kFloat);
    TORCH_CHECK(same_dense_layout(params[i], grads[i]), "adam8_step_cuda: param and grad layouts differ (tensor ", i, ")");
    const int64_t numel = params[i].numel();
    const int64_t blocks = (numel + kQuantBlock - 1) / kQuantBlock;
    tensor_check_cuda("adam8_step_cuda", m_codes[i], "m codes", device, at::kByte);
    tensor_check_cuda("adam8_step_cuda", v_codes[i], "v codes", device, at::kByte);
    tensor_check_cuda("adam8_step_cuda", m_absmax[i], "m absmax", device, at::kBFloat16);
    tensor_check_cuda("adam8_step_cuda", v_absmax[i], "v absmax", device, at::kBFloat16);
    TORCH_CHECK(m_codes[i].numel() == numel && v_codes[i].numel() == numel && m_absmax[i].numel() == blocks &&
                    v_absmax[i].numel() == blocks,
                "adam8_step_cuda: state sizes do not match tensor ", i);
    TORCH_CHECK(count_rows[i] >= 0 && count_rows[i] < counts.size(0), "adam8_step_cuda: bad count row");
    Adam8Record rec;
    rec.param = params[i].data_ptr<float>();
    rec.grad = grads[i].data_ptr<float>();
    rec.m_codes = m_codes[i].data_ptr<uint8_t>();
    rec.v_codes = v_codes[i].data_ptr<uint8_t>();
    rec.m_absmax = reinterpret_cast<__nv_bfloat16*>(m_absmax[i].data_ptr<at::BFloat16>());
    rec.v_absmax = reinterpret_cast<__nv_bfloat16*>(v_absmax[i].data_ptr<at::BFloat16>());
    rec.counts = counts.data_ptr<double>() + 2 * count_rows[i];
    rec.numel = numel;
    rec.weight_decay = weight_decays[i];
    rec.lr_scale = lr_scales.data_ptr<float>() + count_rows[i];
    packer.add(rec, {blocks});
  }
  packer.finish();
}

}  // namespace triaccel
