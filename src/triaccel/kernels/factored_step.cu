// Fused factored-second-moment step (Adafactor-style, no first moment), four launches per TensorPack of tensors
// (multi_tensor_apply.cuh; the pack's three phases are the block counts of launches 1, 2 and 4):
//   1. row_sum[i] = Σ_j (g_ij² + 1e-30)            one block per row
//   2. col_sum[j] = Σ_i (g_ij² + 1e-30)            one block per 256 consecutive columns, looping over rows
//   3. r ← β2 r + (1−β2) row_sum / C;  c ← β2 c + (1−β2) col_sum / R;  r_mean = mean(r)   one block per tensor
//   4. p ← p·(1 − lr·s·wd) − lr·s · g / (√(r_i c_j / r_mean) / √bc2 + ε)                  element-wise
// Every launch returns at once when *found_inf != 0, so state and parameters stay unchanged on a skipped step.
// Scratch (row/column sums, r_mean) comes from the caching allocator (the graph's pool inside a capture).
#include "triaccel/kernels/factored_step.h"
#include "triaccel/kernels/multi_tensor_apply.cuh"
#include "triaccel/kernels/tensor_checks.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

namespace triaccel {
namespace {

constexpr int kThreads = 256;
constexpr int kElemsPerThread = 4;
constexpr int64_t kChunk = kThreads * kElemsPerThread;
constexpr float kFactoredEps = 1e-30f;
constexpr int kBlockLimit = 1 << 29;  // blocks per launch

// The pack's phases: blocks per tensor of the row-sum, column-sum and update launches (the EMA has one per tensor).
constexpr int kRowPhase = 0;   // rows
constexpr int kColPhase = 1;   // ceil(cols / kThreads)
constexpr int kElemPhase = 2;  // ceil(rows · cols / kChunk)
constexpr int kFactoredPhases = 3;

struct FactoredRecord {
  float* param;
  const float* grad;
  float* v_row;          // (R)
  float* v_col;          // (C)
  float* row_sum;        // (R) scratch
  float* col_sum;        // (C) scratch
  float* r_mean;         // (1) scratch
  const double* counts;  // (count_m, count_v) of the tensor
  int64_t rows;
  int64_t cols;
  float weight_decay;
  const float* lr_scale;  // on the device: read at every launch
};
using FactoredPack = TensorPack<FactoredRecord, kFactoredPhases>;

__device__ __forceinline__ float block_sum(float x, float* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float r = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) r += scratch[w];
  return r;
}

__global__ void factored_row_sum_kernel(const __grid_constant__ FactoredPack pack, const float* found_inf) {
  if (*found_inf != 0.f) return;
  __shared__ float scratch[kThreads / 32];
  const int t = tensor_pack_find(pack.block_start[kRowPhase], pack.count);
  const FactoredRecord& a = pack.rec[t];
  const int64_t row = static_cast<int64_t>(blockIdx.x) - pack.block_start[kRowPhase][t];
  const int64_t cols = a.cols;
  const float* g = a.grad + row * cols;
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) s += g[j] * g[j] + kFactoredEps;
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) a.row_sum[row] = s;
}

__global__ void factored_col_sum_kernel(const __grid_constant__ FactoredPack pack, const float* found_inf) {
  if (*found_inf != 0.f) return;
  const int t = tensor_pack_find(pack.block_start[kColPhase], pack.count);
  const FactoredRecord& a = pack.rec[t];
  const int64_t j = (static_cast<int64_t>(blockIdx.x) - pack.block_start[kColPhase][t]) * kThreads + threadIdx.x;
  const int64_t cols = a.cols, rows = a.rows;
  if (j >= cols) return;
  const float* g = a.grad;
  float s = 0.f;
  for (int64_t i = 0; i < rows; ++i) {
    const float x = g[i * cols + j];
    s += x * x + kFactoredEps;
  }
  a.col_sum[j] = s;
}

// One block per tensor: blockIdx.x is the tensor.
__global__ void factored_ema_kernel(const __grid_constant__ FactoredPack pack, const float* found_inf,
                                    AdamStepHyper h) {
  if (*found_inf != 0.f) return;
  __shared__ float scratch[kThreads / 32];
  const FactoredRecord& a = pack.rec[blockIdx.x];
  const int64_t rows = a.rows, cols = a.cols;
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < rows; i += kThreads) {
    const float r = h.beta2 * a.v_row[i] + (1.f - h.beta2) * (a.row_sum[i] / static_cast<float>(cols));
    a.v_row[i] = r;
    s += r;
  }
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
    a.v_col[j] = h.beta2 * a.v_col[j] + (1.f - h.beta2) * (a.col_sum[j] / static_cast<float>(rows));
  }
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) a.r_mean[0] = s / static_cast<float>(rows);
}

__global__ void factored_update_kernel(const __grid_constant__ FactoredPack pack, const float* lr_ptr,
                                       const float* found_inf, AdamStepHyper h) {
  if (*found_inf != 0.f) return;
  const int t = tensor_pack_find(pack.block_start[kElemPhase], pack.count);
  const FactoredRecord& a = pack.rec[t];
  const int64_t cols = a.cols, n = a.rows * cols;
  const int64_t base = (static_cast<int64_t>(blockIdx.x) - pack.block_start[kElemPhase][t]) * kChunk;
  const float lr = *lr_ptr * *a.lr_scale;
  const float decay = 1.f - lr * a.weight_decay;
  const float sqrt_bc2 = sqrtf(static_cast<float>(1.0 - pow(static_cast<double>(h.beta2), a.counts[1])));
  const float r_mean = a.r_mean[0];
  float* p = a.param;
  const float* g = a.grad;
#pragma unroll
  for (int e = 0; e < kElemsPerThread; ++e) {
    const int64_t k = base + static_cast<int64_t>(e) * kThreads + threadIdx.x;
    if (k >= n) break;
    const float vhat = a.v_row[k / cols] * a.v_col[k % cols] / r_mean;
    p[k] = p[k] * decay - lr * g[k] / (sqrtf(vhat) / sqrt_bc2 + h.eps);
  }
}

void factored_step_launch(const FactoredPack& pack, const float* lr, const float* found_inf, const AdamStepHyper& h,
                          cudaStream_t stream) {
  const int k = pack.count;
  factored_row_sum_kernel<<<pack.block_start[kRowPhase][k], kThreads, 0, stream>>>(pack, found_inf);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  factored_col_sum_kernel<<<pack.block_start[kColPhase][k], kThreads, 0, stream>>>(pack, found_inf);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  factored_ema_kernel<<<k, kThreads, 0, stream>>>(pack, found_inf, h);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  factored_update_kernel<<<pack.block_start[kElemPhase][k], kThreads, 0, stream>>>(pack, lr, found_inf, h);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void factored_step_cuda(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                        const std::vector<at::Tensor>& v_rows, const std::vector<at::Tensor>& v_cols,
                        const std::vector<float>& weight_decays, const at::Tensor& lr_scales,
                        const at::Tensor& counts, const std::vector<int64_t>& count_rows, const at::Tensor& lr,
                        const at::Tensor& found_inf, const AdamStepHyper& hyper) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && v_rows.size() == n && v_cols.size() == n && weight_decays.size() == n &&
                  count_rows.size() == n,
              "factored_step_cuda: list lengths differ");
  if (n == 0) return;
  const at::Device device = params[0].device();
  tensor_check_cuda("factored_step_cuda", lr, "lr", device, at::kFloat);
  tensor_check_cuda("factored_step_cuda", found_inf, "found_inf", device, at::kFloat);
  TORCH_CHECK(counts.is_cuda() && counts.scalar_type() == at::kDouble && counts.is_contiguous() && counts.dim() == 2 &&
                  counts.size(1) == 2,
              "factored_step_cuda: counts must be (T, 2) float64 on the device");
  lr_scales_check("factored_step_cuda", lr_scales, device, counts.size(0));
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float* lr_ptr = lr.data_ptr<float>();
  const float* inf_ptr = found_inf.data_ptr<float>();
  // Row sums, column sums and r_mean of each tensor, from the stream-ordered caching allocator; kept until every
  // launch that reads them is queued.
  std::vector<at::Tensor> scratch;
  scratch.reserve(n);
  auto packer = make_tensor_packer<FactoredRecord, kFactoredPhases>(
      "factored_step_cuda", kBlockLimit,
      [&](const FactoredPack& pack) { factored_step_launch(pack, lr_ptr, inf_ptr, hyper, stream); });
  for (size_t i = 0; i < n; ++i) {
    tensor_check_cuda("factored_step_cuda", params[i], "param", device, at::kFloat);
    tensor_check_cuda("factored_step_cuda", grads[i], "grad", device, at::kFloat);
    tensor_check_cuda("factored_step_cuda", v_rows[i], "v_row", device, at::kFloat);
    tensor_check_cuda("factored_step_cuda", v_cols[i], "v_col", device, at::kFloat);
    TORCH_CHECK(same_dense_layout(params[i], grads[i]), "factored_step_cuda: param and grad layouts differ (tensor ", i, ")");
    const int64_t rows = v_rows[i].numel(), cols = v_cols[i].numel();
    int64_t d = 0;  // the row dimension: the first after any leading 1s (state_format_factor_shape)
    while (d + 1 < params[i].dim() && params[i].size(d) == 1) ++d;
    TORCH_CHECK(rows * cols == params[i].numel() && params[i].dim() >= 2 && params[i].size(d) == rows &&
                    params[i].stride(d) == cols,
                "factored_step_cuda: tensor ", i, " is not (first non-1 dimension outermost) × rest");
    TORCH_CHECK(count_rows[i] >= 0 && count_rows[i] < counts.size(0), "factored_step_cuda: bad count row");
    const at::Tensor& sums = scratch.emplace_back(at::empty({rows + cols + 1}, params[i].options()));
    FactoredRecord rec;
    rec.param = params[i].data_ptr<float>();
    rec.grad = grads[i].data_ptr<float>();
    rec.v_row = v_rows[i].data_ptr<float>();
    rec.v_col = v_cols[i].data_ptr<float>();
    rec.row_sum = sums.data_ptr<float>();
    rec.col_sum = sums.data_ptr<float>() + rows;
    rec.r_mean = sums.data_ptr<float>() + rows + cols;
    rec.counts = counts.data_ptr<double>() + 2 * count_rows[i];
    rec.rows = rows;
    rec.cols = cols;
    rec.weight_decay = weight_decays[i];
    rec.lr_scale = lr_scales.data_ptr<float>() + count_rows[i];
    packer.add(rec, {rows, (cols + kThreads - 1) / kThreads, (rows * cols + kChunk - 1) / kChunk});
  }
  packer.finish();
}

}  // namespace triaccel
