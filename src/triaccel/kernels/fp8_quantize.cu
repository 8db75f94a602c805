// FP8 quantize (fp8_quantize.h): per element v = float(x)·scale (one float32 multiply, as the reference's), then
// __nv_fp8_e4m3(v) / __nv_fp8_e5m2(v): round-to-nearest-even with __NV_SATFINITE, which maps |v| > fmax and ±inf to
// ±fmax, i.e. the reference's clamp-then-cast (the clamp leaves nothing past fmax for its cast to round). A NaN in x
// is written as 0x7f before the multiply (a NaN's sign is not kept by the hardware's multiply, nor by the reference).
// amax: each thread keeps the max of |x|'s float bits as an unsigned integer (for non-negative floats the integer
// order is the float order, and a NaN's bits exceed inf's, so a NaN wins as it does in the reference's max); a warp
// shuffle, a shared-memory pass over the warps and one atomicMax per block finish it. Loads are 16 bytes (8 bf16/fp16
// or 4 float32 elements) where x and out are aligned to them. The scale update of delayed scaling is one kernel of one
// thread (fp8_scale_update_cuda): a captured step replays both with no host sync.
#include "triaccel/kernels/fp8_quantize.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <algorithm>
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
constexpr int kScaleMinExponent = -126;  // the clamp of the scale's exponent (train/fp8.h)
constexpr int kScaleMaxExponent = 127;

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

template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};
template <int kVec>
struct alignas(kVec) BytePack {
  unsigned char v[kVec];
};

// out[i] = fp8(x[i]·scale) for i < n, kVec elements a load (one 16-byte load of x, one kVec-byte store; x and out
// aligned to them) and the tail one by one; the scale is *scale_ptr when given (a scale kept on the device), else
// scale_value. amax_bits (may be null): max of |x| as float bits, joined with what it holds (atomicMax). inverse_out
// (may be null): 1 / scale, written once: the scale these bytes were made with.
template <typename T, typename Fp8, int kVec>
__global__ void fp8_quantize_kernel(const T* __restrict__ x, unsigned char* __restrict__ out, int64_t n,
                                    const float* __restrict__ scale_ptr, float scale_value,
                                    unsigned int* __restrict__ amax_bits, float* __restrict__ inverse_out) {
  const float scale = scale_ptr != nullptr ? *scale_ptr : scale_value;
  if (inverse_out != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *inverse_out = 1.f / scale;
  unsigned int bits = 0u;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t packs = n / kVec;
  for (int64_t p = first; p < packs; p += stride) {
    const Pack<T, kVec> in = reinterpret_cast<const Pack<T, kVec>*>(x)[p];
    BytePack<kVec> q;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float v = load_float(in.v, j);
      q.v[j] = fp8_byte<Fp8>(v, scale);
      bits = max(bits, __float_as_uint(v) & 0x7fffffffu);
    }
    reinterpret_cast<BytePack<kVec>*>(out)[p] = q;
  }
  for (int64_t i = packs * kVec + first; i < n; i += stride) {
    const float v = load_float(x, i);
    out[i] = fp8_byte<Fp8>(v, scale);
    bits = max(bits, __float_as_uint(v) & 0x7fffffffu);
  }
  if (amax_bits != nullptr) block_amax(bits, amax_bits);
}

struct QuantizeArgs {
  const void* x;
  unsigned char* out;
  int64_t n;
  const float* scale_ptr;
  float scale_value;
  unsigned int* amax_bits;
  float* inverse_out;
};

template <typename T, typename Fp8>
void fp8_quantize_launch_typed(const QuantizeArgs& a, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool aligned = reinterpret_cast<uintptr_t>(a.x) % 16 == 0 && reinterpret_cast<uintptr_t>(a.out) % kVec == 0;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t items = aligned ? (a.n + kVec - 1) / kVec : a.n;
  const int blocks = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>((items + kThreads - 1) / kThreads, sms * kBlocksPerSm)));
  const T* x = static_cast<const T*>(a.x);
  if (aligned) {
    fp8_quantize_kernel<T, Fp8, kVec><<<blocks, kThreads, 0, stream>>>(x, a.out, a.n, a.scale_ptr, a.scale_value,
                                                                       a.amax_bits, a.inverse_out);
  } else {
    fp8_quantize_kernel<T, Fp8, 1><<<blocks, kThreads, 0, stream>>>(x, a.out, a.n, a.scale_ptr, a.scale_value,
                                                                   a.amax_bits, a.inverse_out);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Fp8>
void fp8_quantize_launch_format(at::ScalarType in, const QuantizeArgs& a, cudaStream_t stream) {
  switch (in) {
    case at::kFloat: fp8_quantize_launch_typed<float, Fp8>(a, stream); break;
    case at::kBFloat16: fp8_quantize_launch_typed<__nv_bfloat16, Fp8>(a, stream); break;
    case at::kHalf: fp8_quantize_launch_typed<__half, Fp8>(a, stream); break;
    default: TORCH_CHECK(false, "fp8_quantize_cuda: x must be float32, bfloat16 or float16, got ", in);
  }
}

void fp8_quantize_launch(at::ScalarType in, at::ScalarType format, const QuantizeArgs& a, cudaStream_t stream) {
  if (format == at::kFloat8_e4m3fn) {
    fp8_quantize_launch_format<__nv_fp8_e4m3>(in, a, stream);
  } else {
    fp8_quantize_launch_format<__nv_fp8_e5m2>(in, a, stream);
  }
}

// The checks both entry points make of x and out.
void fp8_quantize_check_args(const at::Tensor& x, const at::Tensor& out) {
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
}

// One float32 element on `device`.
void fp8_scalar_check(const at::Tensor& t, const c10::Device& device, const char* what) {
  TORCH_CHECK(t.defined() && t.device() == device && t.scalar_type() == at::kFloat && t.numel() == 1 &&
                  t.is_contiguous(),
              "fp8_quantize_cuda: ", what, " must be one float32 element on ", device);
}

// The delayed-scaling update (fp8_scale_update_cuda), one thread: the rule of Fp8DeviceScale::update.
__global__ void fp8_scale_update_kernel(float* ring, int64_t* next, float* scale, float* amax, int history,
                                        int target_exponent, double target_fraction) {
  const float a = fabsf(*amax);
  *amax = 0.f;
  if (isfinite(a)) {
    ring[*next] = a;
    *next = (*next + 1) % history;
  }
  float m = 0.f;
  for (int i = 0; i < history; ++i) m = fmaxf(m, ring[i]);
  if (m > 0.f) {
    int k = 0;
    const float f = frexpf(m, &k);
    int e = target_exponent - k - (static_cast<double>(f) > target_fraction ? 1 : 0);
    e = min(max(e, kScaleMinExponent), kScaleMaxExponent);
    *scale = __int_as_float((e + 127) << 23);
  }
}


// The quantize with its transpose (fp8_quantize_transpose_cuda): a block takes a kTile x kTile tile of x (R, C),
// writes its bytes to out (R, C) and, through shared memory, to out_t (C, R). Each thread handles kRun consecutive
// elements of a row, then kRun consecutive elements of a transposed row; with `vector` (x, out and out_t aligned, C and
// R multiples of kRun) as 16-byte loads and stores, else element by element with bounds checks.
constexpr int kTile = 64;
constexpr int kRun = 16;
constexpr int kTileStride = kTile + 4;  // bytes a shared-memory row: 4-byte aligned, rows off the same banks

template <typename T, typename Fp8, bool vector>
__global__ void fp8_quantize_transpose_kernel(const T* __restrict__ x, unsigned char* __restrict__ out,
                                              unsigned char* __restrict__ out_t, int64_t rows, int64_t cols,
                                              const float* __restrict__ scale_ptr, unsigned int* __restrict__ amax_bits,
                                              float* __restrict__ inverse_out) {
  static_assert(kTile * kTile == kThreads * kRun, "one run a thread in each phase");
  __shared__ unsigned char tile[kTile * kTileStride];
  const float scale = *scale_ptr;
  if (inverse_out != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *inverse_out = 1.f / scale;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile, c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int lr = threadIdx.x / (kTile / kRun), lc = (threadIdx.x % (kTile / kRun)) * kRun;
  unsigned int bits = 0u;
  {
    const int64_t r = r0 + lr, c = c0 + lc;
    unsigned char* srow = tile + lr * kTileStride + lc;
    if (vector) {
      if (r < rows && c < cols) {
        constexpr int kPer = 16 / sizeof(T);
        alignas(16) unsigned char q[kRun];
#pragma unroll
        for (int p = 0; p < kRun / kPer; ++p) {
          const Pack<T, kPer> in = *reinterpret_cast<const Pack<T, kPer>*>(x + r * cols + c + p * kPer);
#pragma unroll
          for (int j = 0; j < kPer; ++j) {
            const float v = load_float(in.v, j);
            q[p * kPer + j] = fp8_byte<Fp8>(v, scale);
            bits = max(bits, __float_as_uint(v) & 0x7fffffffu);
          }
        }
        *reinterpret_cast<uint4*>(out + r * cols + c) = *reinterpret_cast<const uint4*>(q);
#pragma unroll
        for (int j = 0; j < kRun; j += 4) *reinterpret_cast<uint32_t*>(srow + j) = *reinterpret_cast<uint32_t*>(q + j);
      }
    } else {
      for (int j = 0; j < kRun; ++j) {
        if (r >= rows || c + j >= cols) break;
        const float v = load_float(x, r * cols + c + j);
        const unsigned char q = fp8_byte<Fp8>(v, scale);
        out[r * cols + c + j] = q;
        srow[j] = q;
        bits = max(bits, __float_as_uint(v) & 0x7fffffffu);
      }
    }
  }
  __syncthreads();
  {
    // The transposed tile: out_t row c (one of this tile's columns), kRun of its entries (the tile's rows).
    const int tc = lr, tr = lc;
    const int64_t c = c0 + tc, r = r0 + tr;
    if (vector) {
      if (c < cols && r < rows) {
        alignas(16) unsigned char q[kRun];
#pragma unroll
        for (int j = 0; j < kRun; ++j) q[j] = tile[(tr + j) * kTileStride + tc];
        *reinterpret_cast<uint4*>(out_t + c * rows + r) = *reinterpret_cast<const uint4*>(q);
      }
    } else {
      for (int j = 0; j < kRun; ++j) {
        if (c >= cols || r + j >= rows) break;
        out_t[c * rows + r + j] = tile[(tr + j) * kTileStride + tc];
      }
    }
  }
  if (amax_bits != nullptr) block_amax(bits, amax_bits);
}

template <typename T, typename Fp8>
void fp8_quantize_transpose_typed(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out,
                                  const at::Tensor& out_t, const at::Tensor& amax, const at::Tensor& inverse,
                                  cudaStream_t stream) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile), static_cast<unsigned>((rows + kTile - 1) / kTile));
  const T* xp = static_cast<const T*>(x.data_ptr());
  auto* o = static_cast<unsigned char*>(out.data_ptr());
  auto* ot = static_cast<unsigned char*>(out_t.data_ptr());
  const bool vector = rows % kRun == 0 && cols % kRun == 0 && reinterpret_cast<uintptr_t>(xp) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(o) % 16 == 0 && reinterpret_cast<uintptr_t>(ot) % 16 == 0;
  auto* bits = reinterpret_cast<unsigned int*>(amax.data_ptr<float>());
  if (vector) {
    fp8_quantize_transpose_kernel<T, Fp8, true><<<grid, kThreads, 0, stream>>>(
        xp, o, ot, rows, cols, scale.data_ptr<float>(), bits, inverse.data_ptr<float>());
  } else {
    fp8_quantize_transpose_kernel<T, Fp8, false><<<grid, kThreads, 0, stream>>>(
        xp, o, ot, rows, cols, scale.data_ptr<float>(), bits, inverse.data_ptr<float>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Fp8>
void fp8_quantize_transpose_format(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out,
                                   const at::Tensor& out_t, const at::Tensor& amax, const at::Tensor& inverse,
                                   cudaStream_t stream) {
  switch (x.scalar_type()) {
    case at::kFloat: fp8_quantize_transpose_typed<float, Fp8>(x, scale, out, out_t, amax, inverse, stream); break;
    case at::kBFloat16:
      fp8_quantize_transpose_typed<__nv_bfloat16, Fp8>(x, scale, out, out_t, amax, inverse, stream);
      break;
    case at::kHalf: fp8_quantize_transpose_typed<__half, Fp8>(x, scale, out, out_t, amax, inverse, stream); break;
    default: TORCH_CHECK(false, "fp8_quantize_transpose_cuda: x must be float32, bfloat16 or float16");
  }
}

}  // namespace

void fp8_quantize_cuda(const at::Tensor& x, float scale, const at::Tensor& out, const at::Tensor& amax) {
  fp8_quantize_check_args(x, out);
  TORCH_CHECK(std::isfinite(scale) && scale > 0.f, "fp8_quantize_cuda: scale must be finite and > 0, got ", scale);
  if (amax.defined()) fp8_scalar_check(amax, x.device(), "amax");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  unsigned int* amax_bits = nullptr;
  if (amax.defined()) {
    amax_bits = reinterpret_cast<unsigned int*>(amax.data_ptr<float>());
    C10_CUDA_CHECK(cudaMemsetAsync(amax_bits, 0, sizeof(unsigned int), stream));
  }
  if (x.numel() == 0) return;
  fp8_quantize_launch(x.scalar_type(), out.scalar_type(),
                      QuantizeArgs{x.data_ptr(), static_cast<unsigned char*>(out.data_ptr()), x.numel(), nullptr,
                                   scale, amax_bits, nullptr},
                      stream);
}

void fp8_quantize_device_scale_cuda(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out,
                                    const at::Tensor& amax, const at::Tensor& inverse) {
  fp8_quantize_check_args(x, out);
  fp8_scalar_check(scale, x.device(), "scale");
  fp8_scalar_check(amax, x.device(), "amax");
  fp8_scalar_check(inverse, x.device(), "inverse");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // An empty x launches one block of nothing but the inverse (n = 0: no element, amax joined with 0).
  fp8_quantize_launch(x.scalar_type(), out.scalar_type(),
                      QuantizeArgs{x.data_ptr(), static_cast<unsigned char*>(out.data_ptr()), x.numel(),
                                   scale.data_ptr<float>(), 1.f,
                                   reinterpret_cast<unsigned int*>(amax.data_ptr<float>()), inverse.data_ptr<float>()},
                      stream);
}

void fp8_scale_update_cuda(const at::Tensor& ring, const at::Tensor& next, const at::Tensor& scale,
                           const at::Tensor& amax, int target_exponent, double target_fraction) {
  TORCH_CHECK(ring.is_cuda() && ring.scalar_type() == at::kFloat && ring.dim() == 1 && ring.numel() >= 1 &&
                  ring.is_contiguous(),
              "fp8_scale_update_cuda: ring must be a contiguous float32 CUDA vector");
  TORCH_CHECK(next.device() == ring.device() && next.scalar_type() == at::kLong && next.numel() == 1,
              "fp8_scale_update_cuda: next must be one int64 on ", ring.device());
  fp8_scalar_check(scale, ring.device(), "scale");
  fp8_scalar_check(amax, ring.device(), "amax");
  const c10::cuda::CUDAGuard guard(ring.device());
  fp8_scale_update_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(
      ring.data_ptr<float>(), next.data_ptr<int64_t>(), scale.data_ptr<float>(), amax.data_ptr<float>(),
      static_cast<int>(ring.numel()), target_exponent, target_fraction);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void fp8_quantize_transpose_cuda(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out,
                                  const at::Tensor& out_t, const at::Tensor& amax, const at::Tensor& inverse) {
  fp8_quantize_check_args(x, out);
  TORCH_CHECK(x.dim() == 2, "fp8_quantize_transpose_cuda: x must be a matrix, got ", x.sizes());
  TORCH_CHECK(out_t.defined() && out_t.device() == x.device() && out_t.scalar_type() == out.scalar_type() &&
                  out_t.is_contiguous() && out_t.dim() == 2 && out_t.size(0) == x.size(1) &&
                  out_t.size(1) == x.size(0),
              "fp8_quantize_transpose_cuda: out_t must be a contiguous (", x.size(1), ", ", x.size(0), ") ",
              out.scalar_type(), " matrix on ", x.device());
  fp8_scalar_check(scale, x.device(), "scale");
  fp8_scalar_check(amax, x.device(), "amax");
  fp8_scalar_check(inverse, x.device(), "inverse");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (x.numel() == 0) {  // no tile: the inverse alone (amax joined with nothing)
    inverse.copy_(at::reciprocal(scale));
    return;
  }
  if (out.scalar_type() == at::kFloat8_e4m3fn) {
    fp8_quantize_transpose_format<__nv_fp8_e4m3>(x, scale, out, out_t, amax, inverse, stream);
  } else {
    fp8_quantize_transpose_format<__nv_fp8_e5m2>(x, scale, out, out_t, amax, inverse, stream);
  }
}

}  // namespace triaccel
