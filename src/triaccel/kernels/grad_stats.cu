// Fused multi-tensor per-unit gradient statistics: one launch reduces up to kMaxTensors gradients (more launches
// for longer lists, all accumulating into the same buffers), then one small launch turns the sums into
// [l2 norm, mean, variance, max |g|] per unit (core/grad_stats.h; grad_stats_reference is the spec).
//
// Blocks map to (tensor, chunk of kChunk elements). Each thread accumulates Σg, Σg², max|g| in float32 (16-byte
// vector loads where the tensor is aligned), the block reduces them with warp shuffles and shared memory, and
// thread 0 adds the block's partials to the unit's float64 accumulator (atomicAdd on double) and raises the
// unit's max |g| (atomicMax on the int bit pattern: non-negative floats order like ints; a NaN from fabsf has
// the sign bit clear and sorts above +inf, so NaN wins). The finalize kernel computes mean and variance in
// float64 from the two sums, so E[g²] − E[g]² loses nothing to float32 rounding of the final step.
//
// The tensor list travels by value in the kernel parameters and the buffers are zeroed with zero_ on the
// stream, so nothing depends on the data and the whole call can be captured in a CUDA graph.
//
// Cost: ResNet-18 has 11.2M parameters → fp32 gradients are 45 MB read once (22 MB in bf16/fp16) → ~15 µs at
// 3 TB/s of HBM bandwidth, plus ~2 launches; well under 2% of a ~2 ms training step. The atomics are 3 per 16K-element
// block (~700 blocks for ResNet-18), negligible.
#include "triaccel/kernels/grad_stats.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace triaccel {
namespace {

constexpr int kMaxTensors = 64;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kChunk = 16384;  // elements per block: 64 per thread
constexpr int kMaxFinalizeUnits = 256;

enum class GradDtype : int8_t { kFloat, kBFloat16, kHalf };

struct GradStatsLaunchArgs {
  int num_tensors;
  const void* data[kMaxTensors];
  int64_t numel[kMaxTensors];
  int unit[kMaxTensors];
  GradDtype dtype[kMaxTensors];
  int block_start[kMaxTensors + 1];  // prefix sum of blocks per tensor
};

struct FinalizeArgs {
  int first_unit;
  int num_units;
  int64_t count[kMaxFinalizeUnits];  // n of units first_unit + k
};

struct Partial {
  float sum_sq;
  float sum;
  float max_abs;
};

// max that propagates NaN (fmaxf drops it).
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

__device__ __forceinline__ void partial_add(Partial& p, float v) {
  p.sum += v;
  p.sum_sq = fmaf(v, v, p.sum_sq);
  p.max_abs = nan_max(p.max_abs, fabsf(v));
}

// Accumulates x[begin, end) into p; threads stride through the range, kVec elements per 16-byte load.
template <typename T>
__device__ void chunk_accumulate(const T* __restrict__ x, int64_t begin, int64_t end, Partial& p) {
  constexpr int kVec = 16 / sizeof(T);
  // begin is a multiple of kChunk (so of kVec): an aligned base pointer keeps every vector load aligned.
  if ((reinterpret_cast<uintptr_t>(x) & 15) == 0) {
    const int64_t vec_end = begin + (end - begin) / kVec * kVec;
    for (int64_t i = begin + static_cast<int64_t>(threadIdx.x) * kVec; i < vec_end;
         i += static_cast<int64_t>(kThreads) * kVec) {
      union {
        uint4 raw;
        T v[kVec];
      } load;
      load.raw = __ldg(reinterpret_cast<const uint4*>(x + i));
#pragma unroll
      for (int k = 0; k < kVec; ++k) partial_add(p, static_cast<float>(load.v[k]));
    }
    begin = vec_end;
  }
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) partial_add(p, static_cast<float>(x[i]));
}

__device__ __forceinline__ Partial warp_reduce(Partial p) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    p.sum_sq += __shfl_down_sync(0xffffffffu, p.sum_sq, offset);
    p.sum += __shfl_down_sync(0xffffffffu, p.sum, offset);
    p.max_abs = nan_max(p.max_abs, __shfl_down_sync(0xffffffffu, p.max_abs, offset));
  }
  return p;
}

// acc: (U, 2) float64 [Σg², Σg]; out: (U, 4) float32, column kMaxAbs raised here (as int bits).
__global__ void grad_stats_reduce_kernel(const __grid_constant__ GradStatsLaunchArgs args, double* __restrict__ acc,
                                         float* __restrict__ out) {
  // Find this block's tensor (lists are short: a linear scan beats the divergence of anything smarter).
  int t = 0;
  while (t + 1 < args.num_tensors && args.block_start[t + 1] <= static_cast<int>(blockIdx.x)) ++t;
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - args.block_start[t]) * kChunk;
  const int64_t end = min(begin + kChunk, args.numel[t]);

  Partial p{0.f, 0.f, 0.f};
  switch (args.dtype[t]) {
    case GradDtype::kFloat:
      chunk_accumulate(static_cast<const float*>(args.data[t]), begin, end, p);
      break;
    case GradDtype::kBFloat16:
      chunk_accumulate(static_cast<const c10::BFloat16*>(args.data[t]), begin, end, p);
      break;
    case GradDtype::kHalf:
      chunk_accumulate(static_cast<const c10::Half*>(args.data[t]), begin, end, p);
      break;
  }

  __shared__ Partial warp_partials[kWarps];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  p = warp_reduce(p);
  if (lane == 0) warp_partials[warp] = p;
  __syncthreads();
  if (warp != 0) return;
  p = lane < kWarps ? warp_partials[lane] : Partial{0.f, 0.f, 0.f};
  p = warp_reduce(p);
  if (lane == 0) {
    const int u = args.unit[t];
    atomicAdd(&acc[2 * u + 0], static_cast<double>(p.sum_sq));
    atomicAdd(&acc[2 * u + 1], static_cast<double>(p.sum));
    atomicMax(reinterpret_cast<int*>(&out[4 * u + 3]), __float_as_int(p.max_abs));
  }
}

// One thread per unit: out[u] = [sqrt(Σg²), Σg / n, Σg² / n − mean² (≥ 0), max |g| (already there)].
__global__ void grad_stats_finalize_kernel(const __grid_constant__ FinalizeArgs args, const double* __restrict__ acc,
                                           float* __restrict__ out) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= args.num_units) return;
  const int u = args.first_unit + k;
  const double sum_sq = acc[2 * u + 0];
  const double sum = acc[2 * u + 1];
  const int64_t n = args.count[k];
  double mean = 0.0, var = 0.0;
  if (n > 0) {
    mean = sum / static_cast<double>(n);
    var = sum_sq / static_cast<double>(n) - mean * mean;
    var = var < 0.0 ? 0.0 : var;  // keeps NaN
  }
  out[4 * u + 0] = static_cast<float>(sqrt(sum_sq));
  out[4 * u + 1] = static_cast<float>(mean);
  out[4 * u + 2] = static_cast<float>(var);
}

void grad_stats_reduce_launch(const GradStatsLaunchArgs& args, double* acc, float* out, cudaStream_t stream) {
  const int blocks = args.block_start[args.num_tensors];
  if (blocks == 0) return;
  grad_stats_reduce_kernel<<<blocks, kThreads, 0, stream>>>(args, acc, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void grad_stats_finalize_launch(const FinalizeArgs& args, const double* acc, float* out, cudaStream_t stream) {
  if (args.num_units == 0) return;
  grad_stats_finalize_kernel<<<(args.num_units + kThreads - 1) / kThreads, kThreads, 0, stream>>>(args, acc, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

GradDtype grad_dtype(const at::Tensor& g, size_t i) {
  switch (g.scalar_type()) {
    case at::kFloat:
      return GradDtype::kFloat;
    case at::kBFloat16:
      return GradDtype::kBFloat16;
    case at::kHalf:
      return GradDtype::kHalf;
    default:
      TORCH_CHECK(false, "grad_stats_cuda: gradient ", i, " must be float32, bfloat16 or float16, got ",
                  g.scalar_type());
  }
}

}  // namespace

void grad_stats_cuda(const std::vector<at::Tensor>& grads, const std::vector<int64_t>& tensor_unit,
                     const std::vector<int64_t>& unit_numel, const at::Tensor& out) {
  const auto num_units = static_cast<int64_t>(unit_numel.size());
  TORCH_CHECK(grads.size() == tensor_unit.size(), "grad_stats_cuda: ", grads.size(), " gradients but ",
              tensor_unit.size(), " unit indices");
  TORCH_CHECK(out.is_cuda(), "grad_stats_cuda: out must be a CUDA tensor, got ", out.device());
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.sizes() == at::IntArrayRef({num_units, 4}),
              "grad_stats_cuda: out must be a contiguous float32 (", num_units, ", 4) tensor, got ",
              out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(num_units < (1 << 28), "grad_stats_cuda: too many units (", num_units, ")");
  const at::Device device = out.device();
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  // Validate everything before the first launch, so a bad input leaves no half-done work on the stream.
  for (size_t i = 0; i < grads.size(); ++i) {
    TORCH_CHECK(tensor_unit[i] >= 0 && tensor_unit[i] < num_units, "grad_stats_cuda: tensor ", i,
                " has unit index ", tensor_unit[i], ", expected [0, ", num_units, ")");
    const at::Tensor& g = grads[i];
    if (!g.defined()) continue;
    TORCH_CHECK(g.is_cuda() && g.device() == device, "grad_stats_cuda: gradient ", i, " is on ", g.device(),
                ", expected ", device);
    grad_dtype(g, i);
    TORCH_CHECK(g.is_non_overlapping_and_dense(), "grad_stats_cuda: gradient ", i,
                " must be dense (any memory format)");
    TORCH_CHECK((g.numel() + kChunk - 1) / kChunk < (1 << 30), "grad_stats_cuda: gradient ", i, " is too large");
  }

  at::Tensor acc = at::empty({num_units, 2}, out.options().dtype(at::kDouble));  // (U, 2) [Σg², Σg], float64
  acc.zero_();
  out.zero_();  // max |g| is raised from 0
  double* acc_ptr = acc.data_ptr<double>();
  float* out_ptr = out.data_ptr<float>();

  GradStatsLaunchArgs args{};
  auto flush = [&]() {
    grad_stats_reduce_launch(args, acc_ptr, out_ptr, stream);
    args.num_tensors = 0;
    args.block_start[0] = 0;
  };
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    if (!g.defined() || g.numel() == 0) continue;  // counts as zeros: nothing to add
    const int k = args.num_tensors;
    args.data[k] = g.data_ptr();  // dense: the numel elements start here, in some order (irrelevant to a sum)
    args.numel[k] = g.numel();
    args.unit[k] = static_cast<int>(tensor_unit[i]);
    args.dtype[k] = grad_dtype(g, i);
    args.block_start[k + 1] = args.block_start[k] + static_cast<int>((g.numel() + kChunk - 1) / kChunk);
    args.num_tensors = k + 1;
    if (args.num_tensors == kMaxTensors || args.block_start[args.num_tensors] > (1 << 30)) flush();
  }
  if (args.num_tensors > 0) flush();

  for (int64_t first = 0; first < num_units; first += kMaxFinalizeUnits) {
    FinalizeArgs fin{};
    fin.first_unit = static_cast<int>(first);
    fin.num_units = static_cast<int>(std::min<int64_t>(kMaxFinalizeUnits, num_units - first));
    for (int k = 0; k < fin.num_units; ++k) fin.count[k] = unit_numel[static_cast<size_t>(first + k)];
    grad_stats_finalize_launch(fin, acc_ptr, out_ptr, stream);
  }
}

}  // namespace triaccel
