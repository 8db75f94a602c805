// Training-mode BatchNorm2d (+ optional fused ReLU) on bf16 or fp16 channels_last activations; kernels/batch_norm.h
// has the contract, ATen's batch_norm in float64 is the spec (tests/test_batch_norm.cpp). Everything below is
// written once over an element format E (Bf16Format, HalfFormat): activations are decoded to float32 on load and
// rounded to nearest on store; statistics and coefficients are float32 whatever E is.
//
// Layout: a channels_last (N, C, H, W) tensor is a row-major (M, C) matrix with M = N·H·W. Every heavy kernel uses
// one tiling (Tiling): blockIdx.x picks a tile of up to 64 channels, blockIdx.y a block of `chunk` consecutive rows;
// inside a block a thread owns kVec consecutive channels (kVec = 8: one 16-byte load; kVec = 1 when C is not a
// multiple of 8 or a pointer is misaligned) and walks the rows row_lane, row_lane + row_lanes, … of its row block.
// A thread's channels never change, so it keeps their per-channel constants in registers. The grid is sized to
// as many blocks per SM as every kernel of the call holds at once, one wave (fewer only when there are fewer rows
// than threads): blocks_per_sm_for.
//
// Forward:  stats (per-block mean / M2 of each channel → partial (C, G)) → stats_combine (one block per channel:
//           Chan's parallel-variance merge in a fixed order; running stats; scale = w·invstd, shift = b − mean·scale)
//           → transform (y = fmaf(x, scale, shift), optional ReLU, or a residual added then ReLU; stored as E).
// Backward: backward_reduce (per-block Σg and Σg·(x − mean), g = dy masked by y > 0 under ReLU → partial (C, G))
//           → backward_combine (fixed-order sums; dw, db and the three dx coefficients)
//           → backward_elemt (dx = k1·g + kx·(x − mean) + k0, stored as E).
//           With the residual (a block's end) the mask is read from the stored y, and backward_reduce also writes g,
//           which is the residual's gradient and what backward_elemt reads instead of dy.
// Within a thread the variance uses sums of x − x₀ (x₀: the thread's first value of the channel), which keeps
// float32 sums of squares free of cancellation when |mean| ≫ std; threads, blocks and the grid are merged with
// Chan's formula. Every reduction has a fixed shape and order and there are no atomics: bit-reproducible.
// The fused ReLU's mask is recomputed in the backward from x and the saved scale / shift through the same function
// that produced y (bn_output), so it equals y > 0 exactly and y need not be kept or read again.
//
// Bytes (ResNet-18/CIFAR, b512: 314 M activations in the 20 BN layers, 628 MB bf16): forward reads x twice and
// writes y once (1.9 GB), backward reads x and dy twice and writes dx once (3.1 GB); small layers are re-read from
// L2. Scratch: partial (C, G) float2, at most ~8·SMs·C·8 bytes, allocated on the current stream.
#include "triaccel/kernels/batch_norm.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

namespace triaccel {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxTileChannels = 64;
constexpr int kUnroll = 4;  // rows the forward loads before using any: 4 × 16 bytes in flight per thread
constexpr int kCombineThreads = 128;

// Grid geometry shared by the kernels of one call (see the top of the file).
struct Tiling {
  int64_t rows;       // M = N·H·W
  int64_t chunk;      // rows per row block (a multiple of row_lanes, except when clamped by rows)
  int channels;       // C
  int tile_channels;  // channels per block: min(C, 64)
  int lanes;          // threads per row: tile_channels / kVec
  int row_lanes;      // rows a block touches at once: kThreads / lanes
  int tiles;          // gridDim.x = ceil(C / tile_channels)
  int row_blocks;     // gridDim.y = G = ceil(M / chunk)
};

// Where a thread works: its first channel, its row lane, and its rows [begin, end) with stride row_lanes.
struct Place {
  int c0;
  int row_lane;
  bool active;  // owns channels (c0 < C) and a row lane (< row_lanes)
  int64_t begin;
  int64_t end;
};

template <int kVec>
__device__ __forceinline__ Place place_make(const Tiling& t) {
  Place p;
  const int lane = static_cast<int>(threadIdx.x) % t.lanes;
  p.row_lane = static_cast<int>(threadIdx.x) / t.lanes;
  p.c0 = static_cast<int>(blockIdx.x) * t.tile_channels + lane * kVec;
  p.active = p.row_lane < t.row_lanes && p.c0 < t.channels;
  const int64_t block_begin = static_cast<int64_t>(blockIdx.y) * t.chunk;
  p.begin = block_begin + p.row_lane;
  p.end = min(block_begin + t.chunk, t.rows);
  return p;
}

// Rows in row block j (the combine kernels recompute the per-block counts from the geometry).
__device__ __forceinline__ int64_t row_block_count(const Tiling& t, int64_t j) {
  return min(t.chunk, t.rows - j * t.chunk);
}

// Element formats: how a 16-bit activation is stored, decoded to and encoded from float32 (round to nearest).
struct Bf16Format {
  static __device__ __forceinline__ float decode(uint32_t bits) { return __uint_as_float(bits << 16); }
  static __device__ __forceinline__ uint32_t encode(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
};
struct HalfFormat {
  static __device__ __forceinline__ float decode(uint32_t bits) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
  static __device__ __forceinline__ uint32_t encode(float v) { return __half_as_ushort(__float2half_rn(v)); }
};

template <class E, int kVec>
__device__ __forceinline__ void vec_load(const uint16_t* __restrict__ p, float (&v)[kVec]) {
  if constexpr (kVec == 8) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // little-endian: element 2k is the low half of word k
      v[2 * k] = E::decode(w[k] & 0xffffu);
      v[2 * k + 1] = E::decode(w[k] >> 16);
    }
  } else {
    v[0] = E::decode(static_cast<uint32_t>(__ldg(p)));
  }
}

template <class E, int kVec>
__device__ __forceinline__ void vec_store(uint16_t* __restrict__ p, const float (&v)[kVec]) {
  if constexpr (kVec == 8) {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = E::encode(v[2 * k]) | (E::encode(v[2 * k + 1]) << 16);
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  } else {
    *p = static_cast<uint16_t>(E::encode(v[0]));
  }
}

// y before rounding to the storage format. The ReLU keeps NaN (as torch.relu does) and maps negatives to +0. The
// one definition used by the forward and by the backward's mask.
template <bool kRelu>
__device__ __forceinline__ float bn_output(float x, float scale, float shift) {
  const float v = fmaf(x, scale, shift);
  return kRelu ? (v < 0.f ? 0.f : v) : v;
}

// The backward's ReLU mask: y (as stored) > 0.
template <class E>
__device__ __forceinline__ bool relu_passes(float x, float scale, float shift) {
  return E::decode(E::encode(bn_output<true>(x, scale, shift))) > 0.f;
}

// Chan et al.'s merge of (mean, M2, n) with (mean_b, M2_b, n_b); n_b = 0 leaves a unchanged.
__device__ __forceinline__ void chan_merge(float& mean, float& m2, float& n, float mean_b, float m2_b, float n_b) {
  if (n_b == 0.f) return;
  if (n == 0.f) {
    mean = mean_b;
    m2 = m2_b;
    n = n_b;
    return;
  }
  const float total = n + n_b;
  const float delta = mean_b - mean;
  const float frac = n_b / total;
  mean = fmaf(delta, frac, mean);
  m2 = m2 + m2_b + delta * delta * n * frac;
  n = total;
}

// Largest power of two < row_lanes, as the first stride of the row-lane tree (0 when row_lanes == 1).
__device__ __forceinline__ int tree_first_stride(int row_lanes) {
  int s = 1;
  while (s < row_lanes) s <<= 1;
  return s >> 1;
}

// The row-lane tree of a block's reduction, in a fixed order: at each stride s an active thread in the lower half
// calls merge(other), which folds the shared slots of thread `other` (s row lanes further) into its own; row lane 0
// of each column ends with the block's total.
template <class Merge>
__device__ __forceinline__ void row_lanes_merge(const Place& p, const Tiling& t, Merge merge) {
  const int tid = static_cast<int>(threadIdx.x);
  for (int s = tree_first_stride(t.row_lanes); s > 0; s >>= 1) {
    if (p.active && p.row_lane < s && p.row_lane + s < t.row_lanes) merge(tid + s * t.lanes);
    __syncthreads();
  }
}

// Row lane 0 of each column stores its kVec channels' block totals (a, b), read from shared slots laid out
// [k][thread], into partial (C, G) float2.
template <int kVec>
__device__ __forceinline__ void partial_store(float2* __restrict__ partial, const Place& p, const Tiling& t,
                                              const float* a, const float* b) {
  if (!p.active || p.row_lane != 0) return;
  const int tid = static_cast<int>(threadIdx.x);
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    partial[static_cast<int64_t>(p.c0 + k) * t.row_blocks + blockIdx.y] =
        make_float2(a[k * kThreads + tid], b[k * kThreads + tid]);
  }
}

// ---- forward ----

// partial: (C, G) float2 [mean, M2] of each channel over the block's rows.
template <class E, int kVec>
__global__ void __launch_bounds__(kThreads) bn_stats_kernel(const uint16_t* __restrict__ x, const Tiling t,
                                                            float2* __restrict__ partial) {
  const Place p = place_make<kVec>(t);
  const int64_t step = t.row_lanes;
  float shift[kVec], sum[kVec], sum_sq[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) shift[k] = sum[k] = sum_sq[k] = 0.f;
  int count = 0;
  if (p.active && p.begin < p.end) {
    vec_load<E, kVec>(x + p.begin * t.channels + p.c0, shift);  // contributes x − x₀ = 0
    count = 1;
    int64_t m = p.begin + step;
    for (; m + (kUnroll - 1) * step < p.end; m += kUnroll * step) {
      float v[kUnroll][kVec];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) vec_load<E, kVec>(x + (m + u * step) * t.channels + p.c0, v[u]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float d = v[u][k] - shift[k];
          sum[k] += d;
          sum_sq[k] = fmaf(d, d, sum_sq[k]);
        }
      }
      count += kUnroll;
    }
    for (; m < p.end; m += step) {
      float v[kVec];
      vec_load<E, kVec>(x + m * t.channels + p.c0, v);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float d = v[k] - shift[k];
        sum[k] += d;
        sum_sq[k] = fmaf(d, d, sum_sq[k]);
      }
      ++count;
    }
  }

  // [k][thread] layout: consecutive threads hit consecutive banks.
  __shared__ float sh_mean[kVec * kThreads];
  __shared__ float sh_m2[kVec * kThreads];
  __shared__ float sh_n[kThreads];
  const int tid = static_cast<int>(threadIdx.x);
  const float n = static_cast<float>(count);
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    const float mean_shifted = count > 0 ? sum[k] / n : 0.f;
    sh_mean[k * kThreads + tid] = shift[k] + mean_shifted;
    sh_m2[k * kThreads + tid] = count > 0 ? fmaxf(fmaf(-sum[k], mean_shifted, sum_sq[k]), 0.f) : 0.f;
  }
  sh_n[tid] = n;
  __syncthreads();
  row_lanes_merge(p, t, [&](int other) {
    const float n_self = sh_n[tid];
    const float n_other = sh_n[other];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      float mean = sh_mean[k * kThreads + tid], m2 = sh_m2[k * kThreads + tid], n_k = n_self;
      chan_merge(mean, m2, n_k, sh_mean[k * kThreads + other], sh_m2[k * kThreads + other], n_other);
      sh_mean[k * kThreads + tid] = mean;
      sh_m2[k * kThreads + tid] = m2;
    }
    sh_n[tid] = n_self + n_other;
  });
  partial_store<kVec>(partial, p, t, sh_mean, sh_m2);
}

// One block per channel: merges the G partials in a fixed order, updates the running stats, writes stats (4, C).
__global__ void __launch_bounds__(kCombineThreads)
    bn_stats_combine_kernel(const float2* __restrict__ partial, const Tiling t, const float* __restrict__ weight,
                            const float* __restrict__ bias, float* __restrict__ running_mean,
                            float* __restrict__ running_var, float* __restrict__ stats, float momentum, float eps) {
  const int c = static_cast<int>(blockIdx.x);
  const int tid = static_cast<int>(threadIdx.x);
  float mean = 0.f, m2 = 0.f, n = 0.f;
  for (int j = tid; j < t.row_blocks; j += kCombineThreads) {
    const float2 pj = partial[static_cast<int64_t>(c) * t.row_blocks + j];
    chan_merge(mean, m2, n, pj.x, pj.y, static_cast<float>(row_block_count(t, j)));
  }
  __shared__ float sh_mean[kCombineThreads], sh_m2[kCombineThreads], sh_n[kCombineThreads];
  sh_mean[tid] = mean;
  sh_m2[tid] = m2;
  sh_n[tid] = n;
  __syncthreads();
  for (int s = kCombineThreads / 2; s > 0; s >>= 1) {
    if (tid < s) {
      chan_merge(mean, m2, n, sh_mean[tid + s], sh_m2[tid + s], sh_n[tid + s]);
      sh_mean[tid] = mean;
      sh_m2[tid] = m2;
      sh_n[tid] = n;
    }
    __syncthreads();
  }
  if (tid != 0) return;
  const double rows = static_cast<double>(t.rows);
  const float var = m2 / static_cast<float>(rows);                 // biased: normalizes this batch
  const float var_unbiased = m2 / static_cast<float>(rows - 1.0);  // what running_var tracks (torch)
  const float invstd = 1.f / sqrtf(var + eps);
  running_mean[c] = (1.f - momentum) * running_mean[c] + momentum * mean;
  running_var[c] = (1.f - momentum) * running_var[c] + momentum * var_unbiased;
  const float scale = weight[c] * invstd;
  const int64_t C = t.channels;
  stats[kBatchNormMean * C + c] = mean;
  stats[kBatchNormInvstd * C + c] = invstd;
  stats[kBatchNormScale * C + c] = scale;
  stats[kBatchNormShift * C + c] = fmaf(-mean, scale, bias[c]);
}

// What the forward applies after the normalization; the backward masks the gradient accordingly.
enum class Tail {
  kNone,     // y = bn(x)
  kRelu,     // y = max(bn(x), 0); the backward recomputes the mask from x (bn_output)
  kAddRelu,  // y = max(bn(x) + r, 0) (a residual block's end); the backward reads the mask from y
};

// y before rounding, r the residual (read only under kAddRelu).
template <Tail kTail>
__device__ __forceinline__ float tail_output(float x, float scale, float shift, float r) {
  if constexpr (kTail == Tail::kAddRelu) {
    const float v = fmaf(x, scale, shift) + r;
    return v < 0.f ? 0.f : v;
  } else {
    return bn_output<kTail == Tail::kRelu>(x, scale, shift);
  }
}

template <class E, int kVec, Tail kTail>
__global__ void __launch_bounds__(kThreads) bn_transform_kernel(const uint16_t* __restrict__ x,
                                                                const uint16_t* __restrict__ r,
                                                                uint16_t* __restrict__ y, const Tiling t,
                                                                const float* __restrict__ stats) {
  const Place p = place_make<kVec>(t);
  if (!p.active) return;
  const int64_t C = t.channels;
  constexpr bool kAdd = kTail == Tail::kAddRelu;
  float scale[kVec], shift[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    scale[k] = stats[kBatchNormScale * C + p.c0 + k];
    shift[k] = stats[kBatchNormShift * C + p.c0 + k];
  }
  const int64_t step = t.row_lanes;
  int64_t m = p.begin;
  for (; m + (kUnroll - 1) * step < p.end; m += kUnroll * step) {
    float v[kUnroll][kVec], rv[kUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      vec_load<E, kVec>(x + (m + u * step) * C + p.c0, v[u]);
      if constexpr (kAdd) vec_load<E, kVec>(r + (m + u * step) * C + p.c0, rv[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) v[u][k] = tail_output<kTail>(v[u][k], scale[k], shift[k], kAdd ? rv[u][k] : 0.f);
      vec_store<E, kVec>(y + (m + u * step) * C + p.c0, v[u]);
    }
  }
  for (; m < p.end; m += step) {
    float v[kVec], rv[kVec];
    vec_load<E, kVec>(x + m * C + p.c0, v);
    if constexpr (kAdd) vec_load<E, kVec>(r + m * C + p.c0, rv);
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = tail_output<kTail>(v[k], scale[k], shift[k], kAdd ? rv[k] : 0.f);
    vec_store<E, kVec>(y + m * C + p.c0, v);
  }
}

// ---- backward ----

// How the backward masks dy by the forward's ReLU: kRelu recomputes y > 0 from x (Tail::kRelu), kOutput reads the
// stored y (Tail::kAddRelu: y depends on the residual too, and is kept anyway as the next layer's input).
enum class Mask { kNone, kRelu, kOutput };

// g = dy, or 0 where the fused ReLU's output was not > 0 (yv: the stored y, read only under kOutput).
template <class E, int kVec, Mask kMask>
__device__ __forceinline__ void masked_grad(float (&g)[kVec], const float (&xv)[kVec], const float (&yv)[kVec],
                                            const float (&scale)[kVec], const float (&shift)[kVec]) {
  if constexpr (kMask == Mask::kRelu) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) g[k] = relu_passes<E>(xv[k], scale[k], shift[k]) ? g[k] : 0.f;
  } else if constexpr (kMask == Mask::kOutput) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) g[k] = yv[k] > 0.f ? g[k] : 0.f;
  }
}

// A thread's rows of dy and x (and y under kOutput), kRows rows loaded before any is used: visit(row, g, xv) for
// each of them in order, g = dy masked by the fused ReLU (masked_grad), xv = x.
template <class E, int kVec, Mask kMask, int kRows, class Visit>
__device__ __forceinline__ void grad_rows_walk(const uint16_t* __restrict__ dy, const uint16_t* __restrict__ x,
                                               const uint16_t* __restrict__ y, const Place& p, const Tiling& t,
                                               const float (&scale)[kVec], const float (&shift)[kVec], Visit visit) {
  constexpr bool kReadY = kMask == Mask::kOutput;
  const int64_t C = t.channels;
  const int64_t step = t.row_lanes;
  int64_t m = p.begin;
  for (; m + (kRows - 1) * step < p.end; m += kRows * step) {
    float g[kRows][kVec], xv[kRows][kVec], yv[kRows][kVec];
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      vec_load<E, kVec>(dy + (m + u * step) * C + p.c0, g[u]);
      vec_load<E, kVec>(x + (m + u * step) * C + p.c0, xv[u]);
      if constexpr (kReadY) vec_load<E, kVec>(y + (m + u * step) * C + p.c0, yv[u]);
    }
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      masked_grad<E, kVec, kMask>(g[u], xv[u], yv[u], scale, shift);
      visit(m + u * step, g[u], xv[u]);
    }
  }
  for (; m < p.end; m += step) {
    float g[kVec], xv[kVec], yv[kVec];
    vec_load<E, kVec>(dy + m * C + p.c0, g);
    vec_load<E, kVec>(x + m * C + p.c0, xv);
    if constexpr (kReadY) vec_load<E, kVec>(y + m * C + p.c0, yv);
    masked_grad<E, kVec, kMask>(g, xv, yv, scale, shift);
    visit(m, g, xv);
  }
}

// partial: (C, G) float2 [Σg, Σg·(x − mean)] of each channel over the block's rows. Under kOutput it also stores g
// (the masked dy: the residual's gradient, and the elementwise kernel's input) to g_out.
template <class E, int kVec, Mask kMask, int kRows>
__global__ void __launch_bounds__(kThreads)
    bn_backward_reduce_kernel(const uint16_t* __restrict__ dy, const uint16_t* __restrict__ x,
                              const uint16_t* __restrict__ y, uint16_t* __restrict__ g_out, const Tiling t,
                              const float* __restrict__ stats, float2* __restrict__ partial) {
  const Place p = place_make<kVec>(t);
  const int64_t C = t.channels;
  float mean[kVec], scale[kVec], shift[kVec], sum_g[kVec], sum_gx[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) mean[k] = scale[k] = shift[k] = sum_g[k] = sum_gx[k] = 0.f;
  if (p.active) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      mean[k] = stats[kBatchNormMean * C + p.c0 + k];
      if (kMask == Mask::kRelu) {
        scale[k] = stats[kBatchNormScale * C + p.c0 + k];
        shift[k] = stats[kBatchNormShift * C + p.c0 + k];
      }
    }
    const auto sum = [&](int64_t m, const float (&g)[kVec], const float (&xv)[kVec]) {
      if constexpr (kMask == Mask::kOutput) vec_store<E, kVec>(g_out + m * C + p.c0, g);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        sum_g[k] += g[k];
        sum_gx[k] = fmaf(g[k], xv[k] - mean[k], sum_gx[k]);
      }
    };
    grad_rows_walk<E, kVec, kMask, kRows>(dy, x, y, p, t, scale, shift, sum);
  }

  __shared__ float sh_g[kVec * kThreads];
  __shared__ float sh_gx[kVec * kThreads];
  const int tid = static_cast<int>(threadIdx.x);
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    sh_g[k * kThreads + tid] = sum_g[k];
    sh_gx[k * kThreads + tid] = sum_gx[k];
  }
  __syncthreads();
  row_lanes_merge(p, t, [&](int other) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      sh_g[k * kThreads + tid] += sh_g[k * kThreads + other];
      sh_gx[k * kThreads + tid] += sh_gx[k * kThreads + other];
    }
  });
  partial_store<kVec>(partial, p, t, sh_g, sh_gx);
}

// One block per channel: fixed-order sums of the partials → dweight, dbias and coef (3, C) [k1, kx, k0] with
// dx = k1·g + kx·(x − mean) + k0 = w·invstd·(g − Σg/M − x̂·Σ(g·x̂)/M).
__global__ void __launch_bounds__(kCombineThreads)
    bn_backward_combine_kernel(const float2* __restrict__ partial, const Tiling t, const float* __restrict__ weight,
                               const float* __restrict__ stats, float* __restrict__ dweight,
                               float* __restrict__ dbias, float* __restrict__ coef) {
  const int c = static_cast<int>(blockIdx.x);
  const int tid = static_cast<int>(threadIdx.x);
  float sum_g = 0.f, sum_gx = 0.f;
  for (int j = tid; j < t.row_blocks; j += kCombineThreads) {
    const float2 pj = partial[static_cast<int64_t>(c) * t.row_blocks + j];
    sum_g += pj.x;
    sum_gx += pj.y;
  }
  __shared__ float sh_g[kCombineThreads], sh_gx[kCombineThreads];
  sh_g[tid] = sum_g;
  sh_gx[tid] = sum_gx;
  __syncthreads();
  for (int s = kCombineThreads / 2; s > 0; s >>= 1) {
    if (tid < s) {
      sh_g[tid] += sh_g[tid + s];
      sh_gx[tid] += sh_gx[tid + s];
    }
    __syncthreads();
  }
  if (tid != 0) return;
  const int64_t C = t.channels;
  const float inv_rows = static_cast<float>(1.0 / static_cast<double>(t.rows));
  const float invstd = stats[kBatchNormInvstd * C + c];
  const float sum_g_xhat = sh_gx[0] * invstd;
  const float k1 = weight[c] * invstd;
  dweight[c] = sum_g_xhat;
  dbias[c] = sh_g[0];
  coef[0 * C + c] = k1;
  coef[1 * C + c] = -k1 * invstd * sum_g_xhat * inv_rows;
  coef[2 * C + c] = -k1 * sh_g[0] * inv_rows;
}

// dx from g (dy, masked here under kRelu; under Tail::kAddRelu g arrives masked, from the reduce kernel: kNone).
template <class E, int kVec, Mask kMask, int kRows>
__global__ void __launch_bounds__(kThreads)
    bn_backward_elemt_kernel(const uint16_t* __restrict__ dy, const uint16_t* __restrict__ x,
                             uint16_t* __restrict__ dx, const Tiling t, const float* __restrict__ stats,
                             const float* __restrict__ coef) {
  const Place p = place_make<kVec>(t);
  if (!p.active) return;
  const int64_t C = t.channels;
  float mean[kVec], scale[kVec], shift[kVec], k1[kVec], kx[kVec], k0[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    mean[k] = stats[kBatchNormMean * C + p.c0 + k];
    scale[k] = kMask == Mask::kRelu ? stats[kBatchNormScale * C + p.c0 + k] : 0.f;
    shift[k] = kMask == Mask::kRelu ? stats[kBatchNormShift * C + p.c0 + k] : 0.f;
    k1[k] = coef[0 * C + p.c0 + k];
    kx[k] = coef[1 * C + p.c0 + k];
    k0[k] = coef[2 * C + p.c0 + k];
  }
  const auto store = [&](int64_t m, float (&g)[kVec], const float (&xv)[kVec]) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) g[k] = fmaf(k1[k], g[k], fmaf(kx[k], xv[k] - mean[k], k0[k]));
    vec_store<E, kVec>(dx + m * C + p.c0, g);
  };
  grad_rows_walk<E, kVec, kMask, kRows>(dy, x, nullptr, p, t, scale, shift, store);
}

// ---- launchers (raw pointers, explicit stream) ----

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// The process's launch choice (batch_norm_launch_set); 0 fields follow the rules below.
std::atomic<int> g_rows_in_flight{0};
std::atomic<int> g_blocks_per_sm{0};

// Blocks of `kernel` one SM holds at kThreads threads (its registers and static shared memory decide), per device.
int occupancy_of(const void* kernel) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> known;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(kernel, device);
  const auto it = known.find(key);
  if (it != known.end()) return it->second;
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, 0));
  return known[key] = std::max(blocks, 1);
}

// The grid's blocks per SM for the kernels of one call, which share one tiling: the fewest any of them holds at
// once, so that each runs its grid in one wave (a grid of 4 blocks per SM for a kernel that holds 3 runs a second
// wave on a quarter of the work, one block an SM: measured as half of HBM's bandwidth).
int blocks_per_sm_for(std::initializer_list<const void*> kernels) {
  if (const int chosen = g_blocks_per_sm.load()) return chosen;
  int blocks = std::numeric_limits<int>::max();
  for (const void* k : kernels) blocks = std::min(blocks, occupancy_of(k));
  return blocks;
}

// vec: 8 when C % 8 == 0 and every pointer the kernels touch is 16-byte aligned, else 1.
Tiling tiling_make(int64_t rows, int64_t channels, int vec, int sms, int blocks_per_sm) {
  Tiling t{};
  t.rows = rows;
  t.channels = static_cast<int>(channels);
  t.tile_channels = static_cast<int>(std::min<int64_t>(channels, kMaxTileChannels));
  t.lanes = (t.tile_channels + vec - 1) / vec;
  t.row_lanes = kThreads / t.lanes;
  t.tiles = static_cast<int>((channels + t.tile_channels - 1) / t.tile_channels);
  const int64_t target_blocks = static_cast<int64_t>(sms) * blocks_per_sm;
  const int64_t max_row_blocks = (rows + t.row_lanes - 1) / t.row_lanes;  // ≥ 1 row per row lane
  const int64_t want = std::clamp<int64_t>((target_blocks + t.tiles - 1) / t.tiles, 1, max_row_blocks);
  int64_t chunk = (rows + want - 1) / want;
  chunk = (chunk + t.row_lanes - 1) / t.row_lanes * t.row_lanes;  // whole rounds of row lanes
  t.chunk = chunk;
  t.row_blocks = static_cast<int>((rows + chunk - 1) / chunk);
  return t;
}

// What a launcher needs besides the kernels' pointers: the shape, the vector width, where the scratch goes.
struct Shape {
  int64_t rows;
  int64_t channels;
  int vec;
  int sms;
  at::TensorOptions float_options;  // of the (C, G) float2 partials
};

// f(std::integral_constant<int, kVec>) with the call's vector width as a compile-time constant.
template <class F>
void with_vec(int vec, F f) {
  if (vec == 8) {
    f(std::integral_constant<int, 8>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

float2* partial_make(at::Tensor& holder, const Shape& s, const Tiling& t) {
  holder = at::empty({s.channels, t.row_blocks, 2}, s.float_options);  // (C, G) float2
  return reinterpret_cast<float2*>(holder.data_ptr<float>());
}

template <class E, int kVec, Tail kTail>
void forward_launch_typed(const Shape& s, const uint16_t* x, const uint16_t* r, uint16_t* y, const float* weight,
                          const float* bias, float* running_mean, float* running_var, float* stats, float momentum,
                          float eps, cudaStream_t stream) {
  const auto stats_kernel = bn_stats_kernel<E, kVec>;
  const auto transform_kernel = bn_transform_kernel<E, kVec, kTail>;
  const Tiling t = tiling_make(s.rows, s.channels, kVec, s.sms,
                               blocks_per_sm_for({reinterpret_cast<const void*>(stats_kernel),
                                                  reinterpret_cast<const void*>(transform_kernel)}));
  at::Tensor holder;
  float2* partial = partial_make(holder, s, t);
  const dim3 grid(t.tiles, t.row_blocks);
  stats_kernel<<<grid, kThreads, 0, stream>>>(x, t, partial);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  bn_stats_combine_kernel<<<t.channels, kCombineThreads, 0, stream>>>(partial, t, weight, bias, running_mean,
                                                                       running_var, stats, momentum, eps);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  transform_kernel<<<grid, kThreads, 0, stream>>>(x, r, y, t, stats);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// r: the residual under Tail::kAddRelu, else null.
template <class E>
void forward_launch(const Shape& s, Tail tail, const uint16_t* x, const uint16_t* r, uint16_t* y,
                    const float* weight, const float* bias, float* running_mean, float* running_var, float* stats,
                    float momentum, float eps, cudaStream_t stream) {
  const auto typed = [&](auto vec, auto kTail) {
    forward_launch_typed<E, decltype(vec)::value, decltype(kTail)::value>(s, x, r, y, weight, bias, running_mean,
                                                                          running_var, stats, momentum, eps, stream);
  };
  const auto with_tail = [&](auto vec) {
    switch (tail) {
      case Tail::kNone: return typed(vec, std::integral_constant<Tail, Tail::kNone>{});
      case Tail::kRelu: return typed(vec, std::integral_constant<Tail, Tail::kRelu>{});
      case Tail::kAddRelu: return typed(vec, std::integral_constant<Tail, Tail::kAddRelu>{});
    }
  };
  with_vec(s.vec, with_tail);
}

// The backward's pointers: y and g (the masked dy, written by the reduce kernel) are used under Mask::kOutput only.
struct BackwardArgs {
  const uint16_t* dy;
  const uint16_t* x;
  const uint16_t* y;
  uint16_t* g;
  uint16_t* dx;
  const float* weight;
  const float* stats;
  float* dweight;
  float* dbias;
  float* coef;  // (3, C) scratch
};

// Rows a backward thread loads before using any. Under a ReLU mask a thread keeps each channel's scale and shift
// (or reads y) besides its sums, and 4 rows took 70-80 registers: 3 blocks an SM; 2 rows keep 4.
int backward_rows_in_flight(Mask mask) {
  if (const int chosen = g_rows_in_flight.load()) return chosen;
  return mask == Mask::kNone ? 4 : 2;
}

template <class E, int kVec, Mask kMask, int kRows>
void backward_launch_typed(const Shape& s, const BackwardArgs& a, cudaStream_t stream) {
  constexpr Mask kElemtMask = kMask == Mask::kOutput ? Mask::kNone : kMask;  // under kOutput g is already masked
  const auto reduce_kernel = bn_backward_reduce_kernel<E, kVec, kMask, kRows>;
  const auto elemt_kernel = bn_backward_elemt_kernel<E, kVec, kElemtMask, kRows>;
  const Tiling t = tiling_make(s.rows, s.channels, kVec, s.sms,
                               blocks_per_sm_for({reinterpret_cast<const void*>(reduce_kernel),
                                                  reinterpret_cast<const void*>(elemt_kernel)}));
  at::Tensor holder;
  float2* partial = partial_make(holder, s, t);
  const dim3 grid(t.tiles, t.row_blocks);
  reduce_kernel<<<grid, kThreads, 0, stream>>>(a.dy, a.x, a.y, a.g, t, a.stats, partial);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  bn_backward_combine_kernel<<<t.channels, kCombineThreads, 0, stream>>>(partial, t, a.weight, a.stats, a.dweight,
                                                                          a.dbias, a.coef);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  elemt_kernel<<<grid, kThreads, 0, stream>>>(kMask == Mask::kOutput ? a.g : a.dy, a.x, a.dx, t, a.stats, a.coef);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class E>
void backward_launch(const Shape& s, Mask mask, const BackwardArgs& a, cudaStream_t stream) {
  const int rows_in_flight = backward_rows_in_flight(mask);  // 2 or 4 (batch_norm_launch_set refuses others)
  const auto typed = [&](auto vec, auto kMask, auto rows) {
    backward_launch_typed<E, decltype(vec)::value, decltype(kMask)::value, decltype(rows)::value>(s, a, stream);
  };
  const auto with_rows = [&](auto vec, auto kMask) {
    if (rows_in_flight == 2) {
      typed(vec, kMask, std::integral_constant<int, 2>{});
    } else {
      typed(vec, kMask, std::integral_constant<int, 4>{});
    }
  };
  const auto with_mask = [&](auto vec) {
    switch (mask) {
      case Mask::kNone: return with_rows(vec, std::integral_constant<Mask, Mask::kNone>{});
      case Mask::kRelu: return with_rows(vec, std::integral_constant<Mask, Mask::kRelu>{});
      case Mask::kOutput: return with_rows(vec, std::integral_constant<Mask, Mask::kOutput>{});
    }
  };
  with_vec(s.vec, with_mask);
}

// ---- checks shared by the entries ----

void check_activation(const char* op, const char* what, const at::Tensor& t) {
  TORCH_CHECK(t.defined() && t.is_cuda(), op, ": ", what, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf, op, ": ", what,
              " must be bfloat16 or float16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 4, op, ": ", what, " must be 4-D (N, C, H, W), got ", t.sizes());
}

void check_channel_vector(const char* op, const char* what, const at::Tensor& t, const at::Tensor& x) {
  TORCH_CHECK(t.defined() && t.is_cuda() && t.device() == x.device(), op, ": ", what, " must be on ", x.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", what, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == x.size(1) && t.is_contiguous(), op, ": ", what,
              " must be a contiguous (", x.size(1), ") vector, got ", t.sizes());
}

int64_t rows_of(const char* op, const at::Tensor& x) {
  const int64_t rows = x.size(0) * x.size(2) * x.size(3);
  TORCH_CHECK(rows >= 2, op, ": expected more than 1 value per channel in training, got input ", x.sizes());
  TORCH_CHECK(x.size(1) >= 1 && x.size(1) < (int64_t{1} << 30), op, ": bad channel count ", x.size(1));
  return rows;
}

int sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

const uint16_t* bits_data(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
uint16_t* bits_data_mut(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// A second activation (dy, the residual, y) of x's shape, dtype and device; channels_last-contiguous when asked.
void check_like_x(const char* op, const char* what, const at::Tensor& t, const at::Tensor& x, bool channels_last) {
  check_activation(op, what, t);
  TORCH_CHECK(t.sizes() == x.sizes() && t.device() == x.device() && t.scalar_type() == x.scalar_type(), op, ": ",
              what, " ", t.sizes(), " ", t.scalar_type(), " on ", t.device(), " must match x ", x.sizes(), " ",
              x.scalar_type(), " on ", x.device());
  TORCH_CHECK(!channels_last || t.is_contiguous(at::MemoryFormat::ChannelsLast), op, ": ", what,
              " must be channels_last-contiguous");
}

// The forward of both entries; residual is defined under Tail::kAddRelu only.
std::tuple<at::Tensor, at::Tensor> forward_entry(const char* op, const at::Tensor& x, const at::Tensor& residual,
                                                 const at::Tensor& weight, const at::Tensor& bias,
                                                 const at::Tensor& running_mean, const at::Tensor& running_var,
                                                 double momentum, double eps, Tail tail) {
  check_activation(op, "x", x);
  TORCH_CHECK(x.is_contiguous(at::MemoryFormat::ChannelsLast), op, ": x must be channels_last-contiguous");
  if (tail == Tail::kAddRelu) check_like_x(op, "residual", residual, x, /*channels_last=*/true);
  check_channel_vector(op, "weight", weight, x);
  check_channel_vector(op, "bias", bias, x);
  check_channel_vector(op, "running_mean", running_mean, x);
  check_channel_vector(op, "running_var", running_var, x);
  TORCH_CHECK(momentum >= 0 && momentum <= 1, op, ": momentum must be in [0, 1], got ", momentum);
  TORCH_CHECK(eps > 0, op, ": eps must be > 0, got ", eps);
  const int64_t rows = rows_of(op, x);
  const int64_t channels = x.size(1);

  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::ChannelsLast);  // (N, C, H, W), x's dtype
  at::Tensor stats = at::empty({4, channels}, weight.options());     // (4, C) float32
  const bool add = tail == Tail::kAddRelu;
  const int vec = channels % 8 == 0 && aligned16(x.data_ptr()) && aligned16(y.data_ptr()) &&
                          (!add || aligned16(residual.data_ptr()))
                      ? 8
                      : 1;
  const Shape shape{rows, channels, vec, sm_count(), weight.options()};
  const auto launch = x.scalar_type() == at::kHalf ? forward_launch<HalfFormat> : forward_launch<Bf16Format>;
  launch(shape, tail, bits_data(x), add ? bits_data(residual) : nullptr, bits_data_mut(y), weight.data_ptr<float>(),
         bias.data_ptr<float>(), running_mean.data_ptr<float>(), running_var.data_ptr<float>(),
         stats.data_ptr<float>(), static_cast<float>(momentum), static_cast<float>(eps), stream);
  return {y, stats};
}

// The backward of both entries: (dx, dweight, dbias, g); y is defined and g (the masked dy) returned under
// Mask::kOutput only.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_entry(const char* op, const at::Tensor& dy,
                                                                          const at::Tensor& x, const at::Tensor& y,
                                                                          const at::Tensor& weight,
                                                                          const at::Tensor& stats, Mask mask) {
  check_activation(op, "x", x);
  TORCH_CHECK(x.is_contiguous(at::MemoryFormat::ChannelsLast), op, ": x must be channels_last-contiguous");
  check_like_x(op, "dy", dy, x, /*channels_last=*/false);
  const bool output_mask = mask == Mask::kOutput;
  if (output_mask) check_like_x(op, "y", y, x, /*channels_last=*/true);
  check_channel_vector(op, "weight", weight, x);
  const int64_t channels = x.size(1);
  TORCH_CHECK(stats.defined() && stats.is_cuda() && stats.device() == x.device() &&
                  stats.scalar_type() == at::kFloat && stats.is_contiguous() &&
                  stats.sizes() == at::IntArrayRef({4, channels}),
              op, ": stats must be the contiguous (4, ", channels, ") float32 tensor of the forward");
  const int64_t rows = rows_of(op, x);

  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor dy_cl = dy.contiguous(at::MemoryFormat::ChannelsLast);  // no copy when it already is
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::ChannelsLast);      // (N, C, H, W), x's dtype
  at::Tensor g = output_mask ? at::empty_like(x, at::MemoryFormat::ChannelsLast) : at::Tensor();
  at::Tensor dweight = at::empty({channels}, weight.options());
  at::Tensor dbias = at::empty({channels}, weight.options());
  at::Tensor coef = at::empty({3, channels}, weight.options());  // (3, C) [k1, kx, k0]
  const int vec = channels % 8 == 0 && aligned16(x.data_ptr()) && aligned16(dy_cl.data_ptr()) &&
                          aligned16(dx.data_ptr()) &&
                          (!output_mask || (aligned16(y.data_ptr()) && aligned16(g.data_ptr())))
                      ? 8
                      : 1;
  const BackwardArgs args{bits_data(dy_cl),
                          bits_data(x),
                          output_mask ? bits_data(y) : nullptr,
                          output_mask ? bits_data_mut(g) : nullptr,
                          bits_data_mut(dx),
                          weight.data_ptr<float>(),
                          stats.data_ptr<float>(),
                          dweight.data_ptr<float>(),
                          dbias.data_ptr<float>(),
                          coef.data_ptr<float>()};
  const auto launch = x.scalar_type() == at::kHalf ? backward_launch<HalfFormat> : backward_launch<Bf16Format>;
  launch(Shape{rows, channels, vec, sm_count(), weight.options()}, mask, args, stream);
  return {dx, dweight, dbias, g};
}

}  // namespace

void batch_norm_launch_set(const BatchNormLaunch& launch) {
  TORCH_CHECK(launch.rows_in_flight == 0 || launch.rows_in_flight == 2 || launch.rows_in_flight == 4,
              "batch_norm_launch_set: rows_in_flight must be 0, 2 or 4, got ", launch.rows_in_flight);
  TORCH_CHECK(launch.blocks_per_sm >= 0 && launch.blocks_per_sm <= 8,
              "batch_norm_launch_set: blocks_per_sm must be in [0, 8], got ", launch.blocks_per_sm);
  g_rows_in_flight.store(launch.rows_in_flight);
  g_blocks_per_sm.store(launch.blocks_per_sm);
}

std::tuple<at::Tensor, at::Tensor> batch_norm_forward_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                           const at::Tensor& bias, const at::Tensor& running_mean,
                                                           const at::Tensor& running_var, double momentum,
                                                           double eps, bool relu) {
  return forward_entry("batch_norm_forward_cuda", x, at::Tensor(), weight, bias, running_mean, running_var, momentum,
                       eps, relu ? Tail::kRelu : Tail::kNone);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_backward_cuda(const at::Tensor& dy, const at::Tensor& x,
                                                                        const at::Tensor& weight,
                                                                        const at::Tensor& stats, bool relu) {
  auto [dx, dweight, dbias, g] = backward_entry("batch_norm_backward_cuda", dy, x, at::Tensor(), weight, stats,
                                                relu ? Mask::kRelu : Mask::kNone);
  return {dx, dweight, dbias};
}

std::tuple<at::Tensor, at::Tensor> batch_norm_add_relu_forward_cuda(const at::Tensor& x, const at::Tensor& residual,
                                                                    const at::Tensor& weight, const at::Tensor& bias,
                                                                    const at::Tensor& running_mean,
                                                                    const at::Tensor& running_var, double momentum,
                                                                    double eps) {
  return forward_entry("batch_norm_add_relu_forward_cuda", x, residual, weight, bias, running_mean, running_var,
                       momentum, eps, Tail::kAddRelu);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_add_relu_backward_cuda(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
    const at::Tensor& stats) {
  return backward_entry("batch_norm_add_relu_backward_cuda", dy, x, y, weight, stats, Mask::kOutput);
}

}  // namespace triaccel
