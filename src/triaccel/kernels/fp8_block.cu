// Block-scaled FP8 (fp8_block.h). One warp a block of 128 elements, four consecutive elements a lane (one vector
// load and one 4-byte store where the pointers are aligned for it): the block's
// amax by a warp shuffle (NaN ignored: fmaxf drops it), its scale s = 2^e for the largest e with amax·2^e ≤ 448
// (amax = m·2^E, m in [0.5, 1): e = 9 - E when m ≤ 0.875, else 8 - E; clamped to [-126, 127]; 1 for an amax of 0 or
// inf), then each element's byte through __nv_fp8_e4m3 (round to nearest even, saturating at ±448: an inf input
// becomes ±448 as the reference's clamp makes it). Dequantize, four elements a thread: float(q) / s, then the output
// dtype's round to nearest.
#include "triaccel/kernels/fp8_block.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>

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

// Four consecutive elements at i (16-byte loads of float32, 8-byte of 16-bit types) when `vec`, else one at a time
// up to n.
__device__ __forceinline__ void load4(const float* x, int64_t i, float v[4]) {
  const float4 a = *reinterpret_cast<const float4*>(x + i);
  v[0] = a.x;
  v[1] = a.y;
  v[2] = a.z;
  v[3] = a.w;
}
__device__ __forceinline__ void load4(const __nv_bfloat16* x, int64_t i, float v[4]) {
  const uint2 a = *reinterpret_cast<const uint2*>(x + i);
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&a.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&a.y));
  v[0] = lo.x;
  v[1] = lo.y;
  v[2] = hi.x;
  v[3] = hi.y;
}
__device__ __forceinline__ void load4(const __half* x, int64_t i, float v[4]) {
  const uint2 a = *reinterpret_cast<const uint2*>(x + i);
  const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&a.x));
  const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&a.y));
  v[0] = lo.x;
  v[1] = lo.y;
  v[2] = hi.x;
  v[3] = hi.y;
}
__device__ __forceinline__ void store4(float* y, int64_t i, const float v[4]) {
  *reinterpret_cast<float4*>(y + i) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store4(__nv_bfloat16* y, int64_t i, const float v[4]) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
  uint2 a;
  a.x = *reinterpret_cast<const unsigned*>(&lo);
  a.y = *reinterpret_cast<const unsigned*>(&hi);
  *reinterpret_cast<uint2*>(y + i) = a;
}
__device__ __forceinline__ void store4(__half* y, int64_t i, const float v[4]) {
  const __half2 lo = __floats2half2_rn(v[0], v[1]), hi = __floats2half2_rn(v[2], v[3]);
  uint2 a;
  a.x = *reinterpret_cast<const unsigned*>(&lo);
  a.y = *reinterpret_cast<const unsigned*>(&hi);
  *reinterpret_cast<uint2*>(y + i) = a;
}

__device__ __forceinline__ unsigned char e4m3_byte(float scaled, float original) {
  return isnan(original) ? kBlockNanByte : static_cast<unsigned char>(__nv_fp8_e4m3(scaled).__x);
}

// `vec`: x and out aligned for four elements at a time (the lanes of a full group of four use one load and one
// store; a tail shorter than four goes one element at a time).
template <typename T>
__global__ void fp8_block_quantize_kernel(const T* __restrict__ x, unsigned char* __restrict__ out,
                                          float* __restrict__ scales, int64_t n, int64_t blocks, bool vec) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kBlockWarps;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kBlockWarps + threadIdx.x / 32; b < blocks; b += warps) {
    const int64_t first = b * kFp8BlockElements + lane * kPerLane;
    const bool whole = vec && first + kPerLane <= n;
    float v[kPerLane];
    if (whole) {
      load4(x, first, v);
    } else {
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) v[j] = first + j < n ? block_load(x, first + j) : 0.f;
    }
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) amax = fmaxf(amax, fabsf(v[j]));
    for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    const float s = block_scale_of(amax);
    if (lane == 0) scales[b] = s;
    if (whole) {
      unsigned word = 0;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) word |= static_cast<unsigned>(e4m3_byte(v[j] * s, v[j])) << (8 * j);
      *reinterpret_cast<unsigned*>(out + first) = word;
    } else {
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        if (first + j >= n) break;
        out[first + j] = e4m3_byte(v[j] * s, v[j]);
      }
    }
  }
}

// Four elements a thread (one 4-byte load, one vector store) when `vec`, the tail one at a time.
template <typename T>
__global__ void fp8_block_dequantize_kernel(const unsigned char* __restrict__ q, const float* __restrict__ scales,
                                            T* __restrict__ out, int64_t n, bool vec) {
  const int64_t groups = (n + 3) / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kBlockThreads;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kBlockThreads + threadIdx.x; g < groups; g += stride) {
    const int64_t i = 4 * g;
    const float s = scales[i / kFp8BlockElements];  // a group of four lies in one block (128 = 32 groups)
    if (vec && i + 4 <= n) {
      const unsigned word = *reinterpret_cast<const unsigned*>(q + i);
      float v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        __nv_fp8_e4m3 f;
        f.__x = static_cast<__nv_fp8_storage_t>((word >> (8 * j)) & 0xffu);
        v[j] = static_cast<float>(f) / s;
      }
      store4(out, i, v);
    } else {
      for (int64_t k = i; k < n && k < i + 4; ++k) {
        __nv_fp8_e4m3 f;
        f.__x = q[k];
        block_store(out, k, static_cast<float>(f) / s);
      }
    }
  }
}

bool aligned_for4(const void* values, int64_t element_size, const void* bytes) {
  return reinterpret_cast<uintptr_t>(values) % static_cast<uintptr_t>(4 * element_size) == 0 &&
         reinterpret_cast<uintptr_t>(bytes) % 4 == 0;
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
  const bool vec = aligned_for4(x.data_ptr(), x.element_size(), o);
  switch (x.scalar_type()) {
    case at::kFloat:
      fp8_block_quantize_kernel<float><<<grid, kBlockThreads, 0, stream>>>(x.data_ptr<float>(), o, s, n, blocks,
                                                                            vec);
      break;
    case at::kBFloat16:
      fp8_block_quantize_kernel<__nv_bfloat16><<<grid, kBlockThreads, 0, stream>>>(
          reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), o, s, n, blocks, vec);
      break;
    default:
      fp8_block_quantize_kernel<__half><<<grid, kBlockThreads, 0, stream>>>(
          reinterpret_cast<const __half*>(x.data_ptr()), o, s, n, blocks, vec);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void fp8_block_dequantize_cuda(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& out) {
  block_args_check(out, q, scales, "fp8_block_dequantize_cuda");
  const int64_t n = out.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int grid = fp8_block_grid((n + 3) / 4);
  const unsigned char* b = q.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const bool vec = aligned_for4(out.data_ptr(), out.element_size(), b);
  switch (out.scalar_type()) {
    case at::kFloat:
      fp8_block_dequantize_kernel<float><<<grid, kBlockThreads, 0, stream>>>(b, s, out.data_ptr<float>(), n, vec);
      break;
    case at::kBFloat16:
      fp8_block_dequantize_kernel<__nv_bfloat16><<<grid, kBlockThreads, 0, stream>>>(
          b, s, reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), n, vec);
      break;
    default:
      fp8_block_dequantize_kernel<__half><<<grid, kBlockThreads, 0, stream>>>(
          b, s, reinterpret_cast<__half*>(out.data_ptr()), n, vec);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace triaccel
