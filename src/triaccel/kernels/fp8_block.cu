// Block-scaled FP8 (fp8_block.h). One warp a block of 128 elements, four consecutive elements a lane: the block's
// amax by a warp shuffle (NaN ignored: fmaxf drops it), its scale s = 2^e for the largest e with amax·2^e ≤ 448
// (amax = m·2^E, m in [0.5, 1): e = 9 - E when m ≤ 0.875, else 8 - E; clamped to [-126, 127]; 1 for an amax of 0 or
// inf), then each element's byte through __nv_fp8_e4m3 (round to nearest even, saturating at ±448: an inf input
// becomes ±448 as the reference's clamp makes it). Dequantize: float(q) / s, then the output dtype's round to nearest.
#include "triaccel/kernels/fp8_block.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>

namespace triaccel {
namespace {

constexpr int kBlockThreads = 256;
constexpr int kBlockWarps = kBlockThreads / 32;
constexpr int kPerLane = kFp8BlockElements / 32;
constexpr unsigned char kBlockNanByte = 0x7f;

__device__ __forceinline__ float block_load(const float* x, int64_t i) { return x[i]; }
__device__ __forceinline__ float block_load(const __nv_bfloat16* x, int64_t i) { return __bfloat162float(x[i]); }
__device__ __forceinline__ float block_load(const __half* x, int64_t i) { return __half2float(x[i]); }
__device__ __forceinline__ void block_store(float* y, int64_t i, float v) { y[i] = v; }
__device__ __forceinline__ void block_store(__nv_bfloat16* y, int64_t i, float v) { y[i] = __float2bfloat16_rn(v); }
__device__ __forceinline__ void block_store(__half* y, int64_t i, float v) { y[i] = __float2half_rn(v); }

__device__ __forceinline__ float block_scale_of(float amax) {
  if (!(amax > 0.f) || isinf(amax)) return 1.f;
  int k = 0;
  const float m = frexpf(amax, &k);
  const int e = min(max((m <= 0.875f ? 9 : 8) - k, -126), 127);
  return __int_as_float((e + 127) << 23);
}

template <typename T>
__global__ void fp8_block_quantize_kernel(const T* __restrict__ x, unsigned char* __restrict__ out,
                                          float* __restrict__ scales, int64_t n, int64_t blocks) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kBlockWarps;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kBlockWarps + threadIdx.x / 32; b < blocks; b += warps) {
    const int64_t first = b * kFp8BlockElements + lane * kPerLane;
    float v[kPerLane];
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      v[j] = first + j < n ? block_load(x, first + j) : 0.f;
      amax = fmaxf(amax, fabsf(v[j]));
    }
    for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    const float s = block_scale_of(amax);
    if (lane == 0) scales[b] = s;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if (first + j >= n) break;
      out[first + j] = isnan(v[j]) ? kBlockNanByte : static_cast<unsigned char>(__nv_fp8_e4m3(v[j] * s).__x);
    }
  }
}

template <typename T>
__global__ void fp8_block_dequantize_kernel(const unsigned char* __restrict__ q, const float* __restrict__ scales,
                                            T* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kBlockThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kBlockThreads + threadIdx.x; i < n; i += stride) {
    __nv_fp8_e4m3 f;
    f.__x = q[i];
    block_store(out, i, static_cast<float>(f) / scales[i / kFp8BlockElements]);
  }
}

int fp8_block_grid(int64_t items) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((items + kBlockThreads - 1) / kBlockThreads, sms * 16)));
}

void block_args_check(const at::Tensor& values, const at::Tensor& q, const at::Tensor& scales, const char* op) {
  TORCH_CHECK(values.defined() && values.is_cuda() && values.is_contiguous() && values.dim() == 1, op,
              ": the values must be a contiguous CUDA vector");
  const at::ScalarType t = values.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, op,
              ": the values must be float32, bfloat16 or float16, got ", t);
  TORCH_CHECK(q.defined() && q.device() == values.device() && q.scalar_type() == at::kByte && q.is_contiguous() &&
                  q.numel() == values.numel(),
              op, ": the bytes must be a contiguous uint8 vector of ", values.numel(), " on ", values.device());
  const int64_t blocks = (values.numel() + kFp8BlockElements - 1) / kFp8BlockElements;
  TORCH_CHECK(scales.defined() && scales.device() == values.device() && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && scales.numel() == blocks,
              op, ": the scales must be a contiguous float32 vector of ", blocks, " on ", values.device());
}

}  // namespace

void fp8_block_quantize_cuda(const at::Tensor& x, const at::Tensor& out, const at::Tensor& scales) {
  block_args_check(x, out, scales, "fp8_block_quantize_cuda");
  const int64_t n = x.numel(), blocks = scales.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int grid = fp8_block_grid(blocks * 32);
  unsigned char* o = out.data_ptr<uint8_t>();
  float* s = scales.data_ptr<float>();
  switch (x.scalar_type()) {
    case at::kFloat:
      fp8_block_quantize_kernel<float><<<grid, kBlockThreads, 0, stream>>>(x.data_ptr<float>(), o, s, n, blocks);
      break;
    case at::kBFloat16:
      fp8_block_quantize_kernel<__nv_bfloat16><<<grid, kBlockThreads, 0, stream>>>(
          reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), o, s, n, blocks);
      break;
    default:
      fp8_block_quantize_kernel<__half><<<grid, kBlockThreads, 0, stream>>>(
          reinterpret_cast<const __half*>(x.data_ptr()), o, s, n, blocks);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void fp8_block_dequantize_cuda(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& out) {
  block_args_check(out, q, scales, "fp8_block_dequantize_cuda");
  const int64_t n = out.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int grid = fp8_block_grid(n);
  const unsigned char* b = q.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  switch (out.scalar_type()) {
    case at::kFloat:
      fp8_block_dequantize_kernel<float><<<grid, kBlockThreads, 0, stream>>>(b, s, out.data_ptr<float>(), n);
      break;
    case at::kBFloat16:
      fp8_block_dequantize_kernel<__nv_bfloat16><<<grid, kBlockThreads, 0, stream>>>(
          b, s, reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), n);
      break;
    default:
      fp8_block_dequantize_kernel<__half><<<grid, kBlockThreads, 0, stream>>>(
          b, s, reinterpret_cast<__half*>(out.data_ptr()), n);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace triaccel
