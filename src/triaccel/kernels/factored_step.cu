// Fused factored-second-moment step (Adafactor-style, no first moment), four launches per tensor group:
//   1. row_sum[i] = Σ_j (g_ij² + 1e-30)            one block per row
//   2. col_sum[j] = Σ_i (g_ij² + 1e-30)            one block per 256 consecutive columns, looping over rows
//   3. r ← β2 r + (1−β2) row_sum / C;  c ← β2 c + (1−β2) col_sum / R;  r_mean = mean(r)   one block per tensor
//   4. p ← p·(1 − lr·s·wd) − lr·s · g / (√(r_i c_j / r_mean) / √bc2 + ε)                  element-wise
// Every launch returns at once when *found_inf != 0, so state and parameters stay unchanged on a skipped step.
// Scratch (row/column sums, r_mean) comes from the caching allocator (the graph's pool inside a capture).
#include "triaccel/kernels/factored_step.h"
#include "triaccel/kernels/tensor_checks.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

namespace triaccel {
namespace {

constexpr int kMaxTensors = 24;
constexpr int kThreads = 256;
constexpr int kElemsPerThread = 4;
constexpr int64_t kChunk = kThreads * kElemsPerThread;
constexpr float kFactoredEps = 1e-30f;

struct FactoredLaunchArgs {
  int num_tensors;
  float* param[kMaxTensors];
  const float* grad[kMaxTensors];
  float* v_row[kMaxTensors];
  float* v_col[kMaxTensors];
  float* row_sum[kMaxTensors];
  float* col_sum[kMaxTensors];
  float* r_mean[kMaxTensors];
  const double* counts[kMaxTensors];
  int64_t rows[kMaxTensors];
  int64_t cols[kMaxTensors];
  float weight_decay[kMaxTensors];
  float lr_scale[kMaxTensors];
  int row_start[kMaxTensors + 1];     // phase 1: blocks = rows
  int colblk_start[kMaxTensors + 1];  // phase 2: blocks = ceil(cols / kThreads)
  int elem_start[kMaxTensors + 1];    // phase 4: blocks = ceil(numel / kChunk)
};

__device__ __forceinline__ int find_tensor(const int* start, int n) {
  int t = 0;
  while (t + 1 < n && start[t + 1] <= static_cast<int>(blockIdx.x)) ++t;
  return t;
}

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

__global__ void factored_row_sum_kernel(const __grid_constant__ FactoredLaunchArgs a, const float* found_inf) {
  if (*found_inf != 0.f) return;
  __shared__ float scratch[kThreads / 32];
  const int t = find_tensor(a.row_start, a.num_tensors);
  const int64_t row = static_cast<int64_t>(blockIdx.x) - a.row_start[t];
  const int64_t cols = a.cols[t];
  const float* g = a.grad[t] + row * cols;
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) s += g[j] * g[j] + kFactoredEps;
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) a.row_sum[t][row] = s;
}

__global__ void factored_col_sum_kernel(const __grid_constant__ FactoredLaunchArgs a, const float* found_inf) {
  if (*found_inf != 0.f) return;
  const int t = find_tensor(a.colblk_start, a.num_tensors);
  const int64_t j = (static_cast<int64_t>(blockIdx.x) - a.colblk_start[t]) * kThreads + threadIdx.x;
  const int64_t cols = a.cols[t], rows = a.rows[t];
  if (j >= cols) return;
  const float* g = a.grad[t];
  float s = 0.f;
  for (int64_t i = 0; i < rows; ++i) {
    const float x = g[i * cols + j];
    s += x * x + kFactoredEps;
  }
  a.col_sum[t][j] = s;
}

__global__ void factored_ema_kernel(const __grid_constant__ FactoredLaunchArgs a, const float* found_inf,
                                    AdamStepHyper h) {
  if (*found_inf != 0.f) return;
  __shared__ float scratch[kThreads / 32];
  const int t = blockIdx.x;
  const int64_t rows = a.rows[t], cols = a.cols[t];
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < rows; i += kThreads) {
    const float r = h.beta2 * a.v_row[t][i] + (1.f - h.beta2) * (a.row_sum[t][i] / static_cast<float>(cols));
    a.v_row[t][i] = r;
    s += r;
  }
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
    a.v_col[t][j] = h.beta2 * a.v_col[t][j] + (1.f - h.beta2) * (a.col_sum[t][j] / static_cast<float>(rows));
  }
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) a.r_mean[t][0] = s / static_cast<float>(rows);
}

__global__ void factored_update_kernel(const __grid_constant__ FactoredLaunchArgs a, const float* lr_ptr,
                                       const float* found_inf, AdamStepHyper h) {
  if (*found_inf != 0.f) return;
  const int t = find_tensor(a.elem_start, a.num_tensors);
  const int64_t cols = a.cols[t], n = a.rows[t] * cols;
  const int64_t base = (static_cast<int64_t>(blockIdx.x) - a.elem_start[t]) * kChunk;
  const float lr = *lr_ptr * a.lr_scale[t];
  const float decay = 1.f - lr * a.weight_decay[t];
  const float sqrt_bc2 = sqrtf(static_cast<float>(1.0 - pow(static_cast<double>(h.beta2), a.counts[t][1])));
  const float r_mean = a.r_mean[t][0];
  float* p = a.param[t];
  const float* g = a.grad[t];
#pragma unroll
  for (int e = 0; e < kElemsPerThread; ++e) {
    const int64_t k = base + static_cast<int64_t>(e) * kThreads + threadIdx.x;
    if (k >= n) break;
    const float vhat = a.v_row[t][k / cols] * a.v_col[t][k % cols] / r_mean;
    p[k] = p[k] * decay - lr * g[k] / (sqrtf(vhat) / sqrt_bc2 + h.eps);
  }
}

}  // namespace

void factored_step_cuda(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                        const std::vector<at::Tensor>& v_rows, const std::vector<at::Tensor>& v_cols,
                        const std::vector<float>& weight_decays, const std::vector<float>& lr_scales,
                        const at::Tensor& counts, const std::vector<int64_t>& count_rows, const at::Tensor& lr,
                        const at::Tensor& found_inf, const AdamStepHyper& hyper) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && v_rows.size() == n && v_cols.size() == n && weight_decays.size() == n &&
                  lr_scales.size() == n && count_rows.size() == n,
              "factored_step_cuda: list lengths differ");
  if (n == 0) return;
  const at::Device device = params[0].device();
  tensor_check_cuda("factored_step_cuda", lr, "lr", device, at::kFloat);
  tensor_check_cuda("factored_step_cuda", found_inf, "found_inf", device, at::kFloat);
  TORCH_CHECK(counts.is_cuda() && counts.scalar_type() == at::kDouble && counts.is_contiguous() && counts.dim() == 2 &&
                  counts.size(1) == 2,
              "factored_step_cuda: counts must be (T, 2) float64 on the device");
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float* lr_ptr = lr.data_ptr<float>();
  const float* inf_ptr = found_inf.data_ptr<float>();
  FactoredLaunchArgs args{};
  std::vector<at::Tensor> scratch;  // kept alive until the launches are queued (the allocator is stream-ordered)
  auto flush = [&]() {
    const int k = args.num_tensors;
    if (k == 0) return;
    factored_row_sum_kernel<<<args.row_start[k], kThreads, 0, stream>>>(args, inf_ptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    factored_col_sum_kernel<<<args.colblk_start[k], kThreads, 0, stream>>>(args, inf_ptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    factored_ema_kernel<<<k, kThreads, 0, stream>>>(args, inf_ptr, hyper);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    factored_update_kernel<<<args.elem_start[k], kThreads, 0, stream>>>(args, lr_ptr, inf_ptr, hyper);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    args.num_tensors = 0;
    args.row_start[0] = args.colblk_start[0] = args.elem_start[0] = 0;
    scratch.clear();
  };
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
    const int64_t elem_blocks = (rows * cols + kChunk - 1) / kChunk;
    const int64_t col_blocks = (cols + kThreads - 1) / kThreads;
    TORCH_CHECK(elem_blocks < (1 << 29) && rows < (1 << 29), "factored_step_cuda: tensor too large");
    const int k = args.num_tensors;
    at::Tensor sums = at::empty({rows + cols + 1}, params[i].options());
    scratch.push_back(sums);
    args.param[k] = params[i].data_ptr<float>();
    args.grad[k] = grads[i].data_ptr<float>();
    args.v_row[k] = v_rows[i].data_ptr<float>();
    args.v_col[k] = v_cols[i].data_ptr<float>();
    args.row_sum[k] = sums.data_ptr<float>();
    args.col_sum[k] = sums.data_ptr<float>() + rows;
    args.r_mean[k] = sums.data_ptr<float>() + rows + cols;
    args.counts[k] = counts.data_ptr<double>() + 2 * count_rows[i];
    args.rows[k] = rows;
    args.cols[k] = cols;
    args.weight_decay[k] = weight_decays[i];
    args.lr_scale[k] = lr_scales[i];
    args.row_start[k + 1] = args.row_start[k] + static_cast<int>(rows);
    args.colblk_start[k + 1] = args.colblk_start[k] + static_cast<int>(col_blocks);
    args.elem_start[k + 1] = args.elem_start[k] + static_cast<int>(elem_blocks);
    args.num_tensors = k + 1;
    if (args.num_tensors == kMaxTensors || args.row_start[k + 1] > (1 << 29) || args.elem_start[k + 1] > (1 << 29)) {
      flush();
    }
  }
  flush();
}

}  // namespace triaccel
