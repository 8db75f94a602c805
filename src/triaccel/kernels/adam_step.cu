// Fused multi-tensor step for the element-wise update rules (update_rule.h): one launch updates one TensorPack of
// tensors of one rule (multi_tensor_apply.cuh). Per element, with p the parameter, g the gradient, m and v the
// moments (fp32 math; float32 or bfloat16 storage, bfloat16 rounded to nearest even after the update), s the
// tensor's lr scale and wd its weight decay:
//   p ← p·(1 − lr·s·wd), then
//   kAdamW:            m ← β1 m + (1−β1) g;  v ← β2 v + (1−β2) g²;  p ← p − (lr·s / bc1) · m / (√v / √bc2 + ε)
//   kNoMomentum:       v ← β2 v + (1−β2) g²;  p ← p − lr·s · g / (√v / √bc2 + ε)
//   kSgdMomentum:      m ← β1 m + (1−β1) g;  p ← p − lr·s·k · m / bc1
//   kSgd:              p ← p − lr·s·k · g
// bc1 = 1 − β1^count_m, bc2 = 1 − β2^count_v from the tensor's device-side step counts (advanced by the caller).
// Nothing changes when *found_inf != 0. Tensor pointers travel by value, so a captured graph replays in place.
#include "triaccel/kernels/adam_step.h"
#include "triaccel/kernels/multi_tensor_apply.cuh"
#include "triaccel/kernels/tensor_checks.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

namespace triaccel {
namespace {

constexpr int kThreads = 256;
constexpr int kElemsPerThread = 4;
constexpr int64_t kChunk = kThreads * kElemsPerThread;
constexpr int kBlockLimit = 1 << 30;  // blocks per launch

struct AdamRecord {
  float* param;
  const float* grad;
  void* m;               // float or __nv_bfloat16 (the call's state_dtype); null where the rule has no m
  void* v;               // likewise for v
  const double* counts;  // (count_m, count_v) of the tensor
  int64_t numel;
  float weight_decay;
  const float* lr_scale;  // on the device: read at every launch
  float sgd_scale;
};
using AdamPack = TensorPack<AdamRecord, 1>;  // one phase: ceil(numel / kChunk) blocks per tensor

__device__ __forceinline__ float load_state(const float* s, int64_t i) { return s[i]; }
__device__ __forceinline__ float load_state(const __nv_bfloat16* s, int64_t i) { return __bfloat162float(s[i]); }
__device__ __forceinline__ void store_state(float* s, int64_t i, float x) { s[i] = x; }
__device__ __forceinline__ void store_state(__nv_bfloat16* s, int64_t i, float x) { s[i] = __float2bfloat16_rn(x); }

template <typename S, UpdateRule kRule>
__global__ void adam_step_kernel(const __grid_constant__ AdamPack pack, const float* __restrict__ lr_ptr,
                                 const float* __restrict__ found_inf_ptr, AdamStepHyper h) {
  if (*found_inf_ptr != 0.f) return;
  const int t = tensor_pack_find(pack.block_start[0], pack.count);
  const AdamRecord& rec = pack.rec[t];
  __shared__ float bc[2];
  if (threadIdx.x == 0) {
    bc[0] = static_cast<float>(1.0 - pow(static_cast<double>(h.beta1), rec.counts[0]));
    bc[1] = static_cast<float>(1.0 - pow(static_cast<double>(h.beta2), rec.counts[1]));
  }
  __syncthreads();
  const int64_t n = rec.numel;
  const int64_t base = (static_cast<int64_t>(blockIdx.x) - pack.block_start[0][t]) * kChunk;
  float* p = rec.param;
  const float* g = rec.grad;
  S* m = static_cast<S*>(rec.m);
  S* v = static_cast<S*>(rec.v);
  const float lr = *lr_ptr * *rec.lr_scale;
  const float decay = 1.f - lr * rec.weight_decay;
  const float bc1 = bc[0];
  const float sqrt_bc2 = sqrtf(bc[1]);
  const float k = rec.sgd_scale;
#pragma unroll
  for (int e = 0; e < kElemsPerThread; ++e) {
    const int64_t i = base + static_cast<int64_t>(e) * kThreads + threadIdx.x;
    if (i >= n) break;
    float pv = p[i] * decay;
    const float gv = g[i];
    if constexpr (kRule == UpdateRule::kAdamW) {
      const float mv = h.beta1 * load_state(m, i) + (1.f - h.beta1) * gv;
      const float vv = h.beta2 * load_state(v, i) + (1.f - h.beta2) * gv * gv;
      pv -= (lr / bc1) * mv / (sqrtf(vv) / sqrt_bc2 + h.eps);
      store_state(m, i, mv);
      store_state(v, i, vv);
    } else if constexpr (kRule == UpdateRule::kNoMomentum) {
      const float vv = h.beta2 * load_state(v, i) + (1.f - h.beta2) * gv * gv;
      pv -= lr * gv / (sqrtf(vv) / sqrt_bc2 + h.eps);
      store_state(v, i, vv);
    } else if constexpr (kRule == UpdateRule::kSgdMomentum) {
      const float mv = h.beta1 * load_state(m, i) + (1.f - h.beta1) * gv;
      pv -= lr * k * mv / bc1;
      store_state(m, i, mv);
    } else {
      pv -= lr * k * gv;
    }
    p[i] = pv;
  }
}

template <typename S, UpdateRule kRule>
void adam_step_launch_rule(const AdamPack& pack, const float* lr, const float* found_inf, const AdamStepHyper& h,
                           cudaStream_t stream) {
  const int blocks = pack.block_start[0][pack.count];
  if (blocks == 0) return;
  adam_step_kernel<S, kRule><<<blocks, kThreads, 0, stream>>>(pack, lr, found_inf, h);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename S>
void adam_step_launch_storage(UpdateRule rule, const AdamPack& pack, const float* lr, const float* found_inf,
                              const AdamStepHyper& h, cudaStream_t stream) {
  switch (rule) {
    case UpdateRule::kAdamW: adam_step_launch_rule<S, UpdateRule::kAdamW>(pack, lr, found_inf, h, stream); break;
    case UpdateRule::kNoMomentum:
      adam_step_launch_rule<S, UpdateRule::kNoMomentum>(pack, lr, found_inf, h, stream);
      break;
    case UpdateRule::kSgdMomentum:
      adam_step_launch_rule<S, UpdateRule::kSgdMomentum>(pack, lr, found_inf, h, stream);
      break;
    case UpdateRule::kSgd: adam_step_launch_rule<S, UpdateRule::kSgd>(pack, lr, found_inf, h, stream); break;
    default: TORCH_CHECK(false, "adam_step_cuda: unknown update rule ", static_cast<int>(rule));
  }
}

void adam_step_launch(UpdateRule rule, at::ScalarType state_dtype, const AdamPack& pack, const float* lr,
                      const float* found_inf, const AdamStepHyper& h, cudaStream_t stream) {
  // kSgd keeps no state: one instantiation serves both storage types.
  if (state_dtype == at::kBFloat16 && rule != UpdateRule::kSgd) {
    adam_step_launch_storage<__nv_bfloat16>(rule, pack, lr, found_inf, h, stream);
  } else {
    adam_step_launch_storage<float>(rule, pack, lr, found_inf, h, stream);
  }
}

}  // namespace

void adam_step_cuda(UpdateRule rule, at::ScalarType state_dtype, const std::vector<at::Tensor>& params,
                    const std::vector<at::Tensor>& grads,
                    const std::vector<at::Tensor>& ms, const std::vector<at::Tensor>& vs,
                    const std::vector<float>& weight_decays, const at::Tensor& lr_scales,
                    const std::vector<float>& sgd_scales, const at::Tensor& counts,
                    const std::vector<int64_t>& count_rows, const at::Tensor& lr, const at::Tensor& found_inf,
                    const AdamStepHyper& hyper) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && ms.size() == n && vs.size() == n && weight_decays.size() == n &&
                  sgd_scales.size() == n && count_rows.size() == n,
              "adam_step_cuda: list lengths differ");
  if (n == 0) return;
  const at::Device device = params[0].device();
  tensor_check_cuda("adam_step_cuda", lr, "lr", device, at::kFloat);
  tensor_check_cuda("adam_step_cuda", found_inf, "found_inf", device, at::kFloat);
  tensor_check_cuda("adam_step_cuda", counts, "counts", device, at::kDouble);
  TORCH_CHECK(counts.is_contiguous() && counts.dim() == 2 && counts.size(1) == 2, "adam_step_cuda: counts must be (T, 2)");
  lr_scales_check("adam_step_cuda", lr_scales, device, counts.size(0));
  TORCH_CHECK(state_dtype == at::kFloat || state_dtype == at::kBFloat16,
              "adam_step_cuda: moments must be float32 or bfloat16, got ", state_dtype);
  const bool has_m = update_rule_has_m(rule), has_v = update_rule_has_v(rule);
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float* lr_ptr = lr.data_ptr<float>();
  const float* found_inf_ptr = found_inf.data_ptr<float>();
  auto packer = make_tensor_packer<AdamRecord, 1>("adam_step_cuda", kBlockLimit, [&](const AdamPack& pack) {
    adam_step_launch(rule, state_dtype, pack, lr_ptr, found_inf_ptr, hyper, stream);
  });
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
    AdamRecord rec;
    rec.param = params[i].data_ptr<float>();
    rec.grad = grads[i].data_ptr<float>();
    rec.m = has_m ? ms[i].data_ptr() : nullptr;
    rec.v = has_v ? vs[i].data_ptr() : nullptr;
    rec.counts = counts.data_ptr<double>() + 2 * count_rows[i];
    rec.numel = params[i].numel();
    rec.weight_decay = weight_decays[i];
    rec.lr_scale = lr_scales.data_ptr<float>() + count_rows[i];
    rec.sgd_scale = sgd_scales[i];
    packer.add(rec, {(rec.numel + kChunk - 1) / kChunk});
  }
  packer.finish();
}

}  // namespace triaccel
