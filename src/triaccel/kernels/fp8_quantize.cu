// FP8 quantize (fp8_quantize.h): per element v = float(x)·scale (one float32 multiply, as the reference's), then
// __nv_fp8_e4m3(v) / __nv_fp8_e5m2(v): round-to-nearest-even with __NV_SATFINITE, which maps |v| > fmax and ±inf to
// ±fmax, i.e. the reference's clamp-then-cast (the clamp leaves nothing past fmax for its cast to round). A NaN in x
// is written as 0x7f before the multiply (a NaN's sign is not kept by the hardware's multiply, nor by the reference).
// amax: each thread keeps the max of |x|'s float bits as an unsigned integer (for non-negative floats the integer
// order is the float order, and a NaN's bits exceed inf's, so a NaN wins as it does in the reference's max); a warp
// shuffle, a shared-memory pass over the warps and one atomicMax per block finish it.
#include "triaccel/kernels/fp8_quantize.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>

namespace triaccel {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBlocksPerSm = 8;  // grid-stride loop beyond this
constexpr unsigned char kNanByte = 0x7f;

__device__ __forceinline__ float load_float(const float* x, int64_t i) { return x[i]; }
__device__ __forceinline__ float load_float(const __nv_bfloat16* x, int64_t i) { return __bfloat162float(x[i]); }
__device__ __forceinline__ float load_float(const __half* x, int64_t i) { return __half2float(x[i]); }

template <typename Fp8>
__device__ __forceinline__ unsigned char fp8_byte(float x, float scale) {
  if (isnan(x)) return kNanByte;
  const Fp8 q(x * scale);  // round to nearest even, __NV_SATFINITE
  return static_cast<unsigned char>(q.__x);
}

// Max over the block of `bits` (every thread calls it); thread 0 adds the block's max to *amax_bits.
__device__ __forceinline__ void block_amax(unsigned int bits, unsigned int* amax_bits) {
  __shared__ unsigned int warp_max[kWarps];
  for (int offset = 16; offset > 0; offset >>= 1) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, offset));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_max[warp] = bits;
  __syncthreads();
  if (warp == 0) {
    bits = lane < kWarps ? warp_max[lane] : 0u;
    for (int offset = 16; offset > 0; offset >>= 1) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, offset));
    if (lane == 0) atomicMax(amax_bits, bits);
  }
}

// out[i] = fp8(x[i]·scale) for i < n; amax_bits (may be null): max of |x| as float bits.
template <typename T, typename Fp8>
__global__ void fp8_quantize_kernel(const T* __restrict__ x, unsigned char* __restrict__ out, int64_t n, float scale,
                                    unsigned int* __restrict__ amax_bits) {
  unsigned int bits = 0u;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const float v = load_float(x, i);
    out[i] = fp8_byte<Fp8>(v, scale);
    bits = max(bits, __float_as_uint(v) & 0x7fffffffu);
  }
  if (amax_bits != nullptr) block_amax(bits, amax_bits);
}

template <typename T, typename Fp8>
void fp8_quantize_launch_typed(const void* x, unsigned char* out, int64_t n, float scale, unsigned int* amax_bits,
                               int blocks, cudaStream_t stream) {
  fp8_quantize_kernel<T, Fp8><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(x), out, n, scale, amax_bits);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Fp8>
void fp8_quantize_launch_format(at::ScalarType in, const void* x, unsigned char* out, int64_t n, float scale,
                                unsigned int* amax_bits, int blocks, cudaStream_t stream) {
  switch (in) {
    case at::kFloat: fp8_quantize_launch_typed<float, Fp8>(x, out, n, scale, amax_bits, blocks, stream); break;
    case at::kBFloat16:
      fp8_quantize_launch_typed<__nv_bfloat16, Fp8>(x, out, n, scale, amax_bits, blocks, stream);
      break;
    case at::kHalf: fp8_quantize_launch_typed<__half, Fp8>(x, out, n, scale, amax_bits, blocks, stream); break;
    default: TORCH_CHECK(false, "fp8_quantize_cuda: x must be float32, bfloat16 or float16, got ", in);
  }
}

void fp8_quantize_launch(at::ScalarType in, at::ScalarType format, const void* x, unsigned char* out, int64_t n,
                         float scale, unsigned int* amax_bits, cudaStream_t stream) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int blocks = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, sms * kBlocksPerSm));
  if (format == at::kFloat8_e4m3fn) {
    fp8_quantize_launch_format<__nv_fp8_e4m3>(in, x, out, n, scale, amax_bits, blocks, stream);
  } else {
    fp8_quantize_launch_format<__nv_fp8_e5m2>(in, x, out, n, scale, amax_bits, blocks, stream);
  }
}

}  // namespace

void fp8_quantize_cuda(const at::Tensor& x, float scale, const at::Tensor& out, const at::Tensor& amax) {
  TORCH_CHECK(x.defined() && x.is_cuda(), "fp8_quantize_cuda: x must be a CUDA tensor");
  TORCH_CHECK(x.is_contiguous(), "fp8_quantize_cuda: x must be contiguous");
  const at::ScalarType in = x.scalar_type();
  TORCH_CHECK(in == at::kFloat || in == at::kBFloat16 || in == at::kHalf,
              "fp8_quantize_cuda: x must be float32, bfloat16 or float16, got ", in);
  TORCH_CHECK(out.defined() && out.device() == x.device(), "fp8_quantize_cuda: out must be on ", x.device());
  const at::ScalarType format = out.scalar_type();
  TORCH_CHECK(format == at::kFloat8_e4m3fn || format == at::kFloat8_e5m2,
              "fp8_quantize_cuda: out must be float8_e4m3fn or float8_e5m2, got ", format);
  TORCH_CHECK(out.is_contiguous() && out.numel() == x.numel(), "fp8_quantize_cuda: out must be contiguous, ",
              x.numel(), " elements, got ", out.numel());
  TORCH_CHECK(std::isfinite(scale) && scale > 0.f, "fp8_quantize_cuda: scale must be finite and > 0, got ", scale);
  if (amax.defined()) {
    TORCH_CHECK(amax.device() == x.device() && amax.scalar_type() == at::kFloat && amax.numel() == 1,
                "fp8_quantize_cuda: amax must be one float32 element on ", x.device());
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  unsigned int* amax_bits = nullptr;
  if (amax.defined()) {
    amax_bits = reinterpret_cast<unsigned int*>(amax.data_ptr<float>());
    C10_CUDA_CHECK(cudaMemsetAsync(amax_bits, 0, sizeof(unsigned int), stream));
  }
  const int64_t n = x.numel();
  if (n == 0) return;
  fp8_quantize_launch(in, format, x.data_ptr(), static_cast<unsigned char*>(out.data_ptr()), n, scale, amax_bits,
                      stream);
}

}  // namespace triaccel
