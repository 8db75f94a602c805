// Fused multi-tensor step for the element-wise BAOC formats: one launch updates up to kMaxTensors tensors of one
// format. Per element, with p the parameter, g the gradient, m and v the moments (fp32 math; bf16 storage for
// kAdamW16, rounded to nearest even after the update), s the tensor's lr scale and wd its weight decay:
//   p ← p·(1 − lr·s·wd), then
//   kAdamW32/16:  m ← β1 m + (1−β1) g;  v ← β2 v + (1−β2) g²;  p ← p − (lr·s / bc1) · m / (√v / √bc2 + ε)
//   kNoMomentum:  v ← β2 v + (1−β2) g²;  p ← p − lr·s · g / (√v / √bc2 + ε)
//   kSgdMomentum: m ← β1 m + (1−β1) g;  p ← p − lr·s·k · m / bc1
//   kSgd:         p ← p − lr·s·k · g
// bc1 = 1 − β1^count_m, bc2 = 1 − β2^count_v from the tensor's device-side step counts (advanced by the caller).
// Nothing changes when *found_inf != 0. Tensor pointers travel by value, so a captured graph replays in place.
#include "triaccel/kernels/adam_step.h"
#include "triaccel/kernels/tensor_checks.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

namespace triaccel {
namespace {

constexpr int kMaxTensors = 40;
constexpr int kThreads = 256;
constexpr int kElemsPerThread = 4;
constexpr int64_t kChunk = kThreads * kElemsPerThread;

struct AdamLaunchArgs {
  int num_tensors;
  float* param[kMaxTensors];
  const float* grad[kMaxTensors];
  void* m[kMaxTensors];
  void* v[kMaxTensors];
  const double* counts[kMaxTensors];  // (count_m, count_v) of the tensor
  int64_t numel[kMaxTensors];
  float weight_decay[kMaxTensors];
  float lr_scale[kMaxTensors];
  float sgd_scale[kMaxTensors];
  int block_start[kMaxTensors + 1];
};

__device__ __forceinline__ float load_state(const float* s, int64_t i) { return s[i]; }
__device__ __forceinline__ float load_state(const __nv_bfloat16* s, int64_t i) { return __bfloat162float(s[i]); }
__device__ __forceinline__ void store_state(float* s, int64_t i, float x) { s[i] = x; }
__device__ __forceinline__ void store_state(__nv_bfloat16* s, int64_t i, float x) { s[i] = __float2bfloat16_rn(x); }

template <typename S, int kFormat>
__global__ void adam_step_kernel(const __grid_constant__ AdamLaunchArgs args, const float* __restrict__ lr_ptr,
                                 const float* __restrict__ found_inf_ptr, AdamStepHyper h) {
  if (*found_inf_ptr != 0.f) return;
  int t = 0;
  while (t + 1 < args.num_tensors && args.block_start[t + 1] <= static_cast<int>(blockIdx.x)) ++t;
  __shared__ float bc[2];
  if (threadIdx.x == 0) {
    bc[0] = static_cast<float>(1.0 - pow(static_cast<double>(h.beta1), args.counts[t][0]));
    bc[1] = static_cast<float>(1.0 - pow(static_cast<double>(h.beta2), args.counts[t][1]));
  }
  __syncthreads();
  const int64_t n = args.numel[t];
  const int64_t base = (static_cast<int64_t>(blockIdx.x) - args.block_start[t]) * kChunk;
  float* p = args.param[t];
  const float* g = args.grad[t];
  S* m = static_cast<S*>(args.m[t]);
  S* v = static_cast<S*>(args.v[t]);
  const float lr = *lr_ptr * args.lr_scale[t];
  const float decay = 1.f - lr * args.weight_decay[t];
  const float bc1 = bc[0];
  const float sqrt_bc2 = sqrtf(bc[1]);
  const float k = args.sgd_scale[t];
#pragma unroll
  for (int e = 0; e < kElemsPerThread; ++e) {
    const int64_t i = base + static_cast<int64_t>(e) * kThreads + threadIdx.x;
    if (i >= n) break;
    float pv = p[i] * decay;
    const float gv = g[i];
    if constexpr (kFormat == static_cast<int>(StateFormat::kAdamW32) ||
                  kFormat == static_cast<int>(StateFormat::kAdamW16)) {
      const float mv = h.beta1 * load_state(m, i) + (1.f - h.beta1) * gv;
      const float vv = h.beta2 * load_state(v, i) + (1.f - h.beta2) * gv * gv;
      pv -= (lr / bc1) * mv / (sqrtf(vv) / sqrt_bc2 + h.eps);
      store_state(m, i, mv);
      store_state(v, i, vv);
    } else if constexpr (kFormat == static_cast<int>(StateFormat::kNoMomentum)) {
      const float vv = h.beta2 * load_state(v, i) + (1.f - h.beta2) * gv * gv;
      pv -= lr * gv / (sqrtf(vv) / sqrt_bc2 + h.eps);
      store_state(v, i, vv);
    } else if constexpr (kFormat == static_cast<int>(StateFormat::kSgdMomentum)) {
      const float mv = h.beta1 * load_state(m, i) + (1.f - h.beta1) * gv;
      pv -= lr * k * mv / bc1;
      store_state(m, i, mv);
    } else {
      pv -= lr * k * gv;
    }
    p[i] = pv;
  }
}

template <typename S, int kFormat>
void adam_step_launch(const AdamLaunchArgs& args, const float* lr, const float* found_inf, const AdamStepHyper& h,
                      cudaStream_t stream) {
  const int blocks = args.block_start[args.num_tensors];
  if (blocks == 0) return;
  adam_step_kernel<S, kFormat><<<blocks, kThreads, 0, stream>>>(args, lr, found_inf, h);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_for(StateFormat f, const AdamLaunchArgs& args, const float* lr, const float* found_inf,
                const AdamStepHyper& h, cudaStream_t stream) {
  switch (f) {
    case StateFormat::kAdamW32:
      adam_step_launch<float, static_cast<int>(StateFormat::kAdamW32)>(args, lr, found_inf, h, stream);
      break;
    case StateFormat::kAdamW16:
      adam_step_launch<__nv_bfloat16, static_cast<int>(StateFormat::kAdamW16)>(args, lr, found_inf, h, stream);
      break;
    case StateFormat::kNoMomentum:
      adam_step_launch<float, static_cast<int>(StateFormat::kNoMomentum)>(args, lr, found_inf, h, stream);
      break;
    case StateFormat::kSgdMomentum:
      adam_step_launch<float, static_cast<int>(StateFormat::kSgdMomentum)>(args, lr, found_inf, h, stream);
      break;
    case StateFormat::kSgd:
      adam_step_launch<float, static_cast<int>(StateFormat::kSgd)>(args, lr, found_inf, h, stream);
      break;
    default: TORCH_CHECK(false, "adam_step_cuda: format ", state_format_name(f), " is not element-wise");
  }
}

}  // namespace

void adam_step_cuda(StateFormat format, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                    const std::vector<at::Tensor>& ms, const std::vector<at::Tensor>& vs,
                    const std::vector<float>& weight_decays, const std::vector<float>& lr_scales,
                    const std::vector<float>& sgd_scales, const at::Tensor& counts,
                    const std::vector<int64_t>& count_rows, const at::Tensor& lr, const at::Tensor& found_inf,
                    const AdamStepHyper& hyper) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && ms.size() == n && vs.size() == n && weight_decays.size() == n &&
                  lr_scales.size() == n && sgd_scales.size() == n && count_rows.size() == n,
              "adam_step_cuda: list lengths differ");
  if (n == 0) return;
  const at::Device device = params[0].device();
  tensor_check_cuda("adam_step_cuda", lr, "lr", device, at::kFloat);
  tensor_check_cuda("adam_step_cuda", found_inf, "found_inf", device, at::kFloat);
  tensor_check_cuda("adam_step_cuda", counts, "counts", device, at::kDouble);
  TORCH_CHECK(counts.is_contiguous() && counts.dim() == 2 && counts.size(1) == 2, "adam_step_cuda: counts must be (T, 2)");
  const bool has_m = state_format_has_m(format), has_v = state_format_has_v(format);
  const at::ScalarType state_dtype = format == StateFormat::kAdamW16 ? at::kBFloat16 : at::kFloat;
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AdamLaunchArgs args{};
  auto flush = [&]() {
    launch_for(format, args, lr.data_ptr<float>(), found_inf.data_ptr<float>(), hyper, stream);
    args.num_tensors = 0;
    args.block_start[0] = 0;
  };
  for (size_t i = 0; i < n; ++i) {
    tensor_check_cuda("adam_step_cuda", params[i], "param", device, at::kFloat);
    tensor_check_cuda("adam_step_cuda", grads[i], "grad", device, at::kFloat);
    TORCH_CHECK(same_dense_layout(params[i], grads[i]),
                "adam_step_cuda: param and grad must share a memory layout (tensor ", i, ")");
    if (has_m) {
      tensor_check_cuda("adam_step_cuda", ms[i], "m", device, state_dtype);
      TORCH_CHECK(same_dense_layout(ms[i], params[i]), "adam_step_cuda: m layout");
    }
    if (has_v) {
      tensor_check_cuda("adam_step_cuda", vs[i], "v", device, state_dtype);
      TORCH_CHECK(same_dense_layout(vs[i], params[i]), "adam_step_cuda: v layout");
    }
    TORCH_CHECK(count_rows[i] >= 0 && count_rows[i] < counts.size(0), "adam_step_cuda: bad count row");
    const int64_t numel = params[i].numel();
    const int64_t blocks = (numel + kChunk - 1) / kChunk;
    TORCH_CHECK(blocks < (1 << 30), "adam_step_cuda: tensor too large");
    const int k = args.num_tensors;
    args.param[k] = params[i].data_ptr<float>();
    args.grad[k] = grads[i].data_ptr<float>();
    args.m[k] = has_m ? ms[i].data_ptr() : nullptr;
    args.v[k] = has_v ? vs[i].data_ptr() : nullptr;
    args.counts[k] = counts.data_ptr<double>() + 2 * count_rows[i];
    args.numel[k] = numel;
    args.weight_decay[k] = weight_decays[i];
    args.lr_scale[k] = lr_scales[i];
    args.sgd_scale[k] = sgd_scales[i];
    args.block_start[k + 1] = args.block_start[k] + static_cast<int>(blocks);
    args.num_tensors = k + 1;
    if (args.num_tensors == kMaxTensors || args.block_start[args.num_tensors] > (1 << 30)) flush();
  }
  if (args.num_tensors > 0) flush();
}

}  // namespace triaccel
