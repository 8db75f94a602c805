// Fused multi-tensor SGD: one launch updates one TensorPack of tensors (multi_tensor_apply.cuh; more launches for
// longer lists). Per element, with g the gradient, p the parameter, m the momentum buffer (all fp32):
//   d = g + wd·p;  m = μ·m + d;  d = nesterov ? d + μ·m : m;  p = p − lr·s·d   (s: the tensor's lr scale)
// skipped entirely when *found_inf != 0. The tensor list travels by value in the kernel's parameters, so a
// captured CUDA graph replays with the same pointers (the caller keeps grads and buffers at fixed addresses).
#include "triaccel/kernels/sgd_step.h"
#include "triaccel/kernels/multi_tensor_apply.cuh"
#include "triaccel/kernels/tensor_checks.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

namespace triaccel {
namespace {

constexpr int kThreads = 256;
constexpr int kElemsPerThread = 8;
constexpr int64_t kChunk = kThreads * kElemsPerThread;  // elements per block
constexpr int kBlockLimit = 1 << 30;                    // blocks per launch

struct SgdRecord {
  float* param;
  const float* grad;
  float* mom;
  int64_t numel;
  float weight_decay;
  const float* lr_scale;  // multiplier of *lr on the device (Tri-Accel curvature scaling; 1 otherwise)
};
using SgdPack = TensorPack<SgdRecord, 1>;  // one phase: ceil(numel / kChunk) blocks per tensor

__device__ __forceinline__ void sgd_update(float& p, float g, float& m, float wd, float lr, float mu,
                                           bool nesterov) {
  float d = g + wd * p;
  m = mu * m + d;
  d = nesterov ? d + mu * m : m;
  p = p - lr * d;
}

__global__ void sgd_step_kernel(const __grid_constant__ SgdPack pack, const float* __restrict__ lr_ptr,
                                const float* __restrict__ found_inf_ptr, float mu, bool nesterov) {
  if (*found_inf_ptr != 0.f) return;
  const int t = tensor_pack_find(pack.block_start[0], pack.count);
  const SgdRecord& rec = pack.rec[t];
  const int64_t n = rec.numel;
  const int64_t base = (static_cast<int64_t>(blockIdx.x) - pack.block_start[0][t]) * kChunk;
  float* p = rec.param;
  const float* g = rec.grad;
  float* m = rec.mom;
  const float wd = rec.weight_decay;
  const float lr = *lr_ptr * *rec.lr_scale;
  const bool aligned = ((reinterpret_cast<uintptr_t>(p) | reinterpret_cast<uintptr_t>(g) |
                         reinterpret_cast<uintptr_t>(m)) & 15) == 0;
  if (aligned && base + kChunk <= n) {
    // Full chunk, 16-byte accesses: each thread handles kElemsPerThread / 4 float4s, strided across the block.
#pragma unroll
    for (int k = 0; k < kElemsPerThread / 4; ++k) {
      const int64_t i = base + (static_cast<int64_t>(k) * kThreads + threadIdx.x) * 4;
      float4 pv = *reinterpret_cast<const float4*>(p + i);
      const float4 gv = *reinterpret_cast<const float4*>(g + i);
      float4 mv = *reinterpret_cast<const float4*>(m + i);
      sgd_update(pv.x, gv.x, mv.x, wd, lr, mu, nesterov);
      sgd_update(pv.y, gv.y, mv.y, wd, lr, mu, nesterov);
      sgd_update(pv.z, gv.z, mv.z, wd, lr, mu, nesterov);
      sgd_update(pv.w, gv.w, mv.w, wd, lr, mu, nesterov);
      *reinterpret_cast<float4*>(p + i) = pv;
      *reinterpret_cast<float4*>(m + i) = mv;
    }
  } else {
    for (int64_t i = base + threadIdx.x; i < base + kChunk && i < n; i += kThreads) {
      float pv = p[i];
      float mv = m[i];
      sgd_update(pv, g[i], mv, wd, lr, mu, nesterov);
      p[i] = pv;
      m[i] = mv;
    }
  }
}

void sgd_step_launch(const SgdPack& pack, const float* lr, const float* found_inf, float mu, bool nesterov,
                     cudaStream_t stream) {
  const int blocks = pack.block_start[0][pack.count];
  if (blocks == 0) return;
  sgd_step_kernel<<<blocks, kThreads, 0, stream>>>(pack, lr, found_inf, mu, nesterov);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void sgd_step_cuda(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                   const std::vector<at::Tensor>& momenta, const std::vector<float>& weight_decays,
                   const at::Tensor& lr_scales, const std::vector<int64_t>& scale_rows, const at::Tensor& lr,
                   const at::Tensor& found_inf, float momentum, bool nesterov) {
  TORCH_CHECK(params.size() == grads.size() && params.size() == momenta.size() &&
                  params.size() == weight_decays.size() && params.size() == scale_rows.size(),
              "sgd_step_cuda: list lengths differ");
  if (params.empty()) return;
  const at::Device device = params[0].device();
  tensor_check_cuda("sgd_step_cuda", lr, "lr", device, at::kFloat);
  tensor_check_cuda("sgd_step_cuda", found_inf, "found_inf", device, at::kFloat);
  TORCH_CHECK(lr.numel() == 1 && found_inf.numel() == 1, "sgd_step_cuda: lr and found_inf must be scalars");
  lr_scales_check("sgd_step_cuda", lr_scales, device, /*rows=*/-1);  // scale_rows are checked against it below
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  const float* lr_ptr = lr.data_ptr<float>();
  const float* found_inf_ptr = found_inf.data_ptr<float>();
  auto packer = make_tensor_packer<SgdRecord, 1>("sgd_step_cuda", kBlockLimit, [&](const SgdPack& pack) {
    sgd_step_launch(pack, lr_ptr, found_inf_ptr, momentum, nesterov, stream);
  });
  for (size_t i = 0; i < params.size(); ++i) {
    tensor_check_cuda("sgd_step_cuda", params[i], "param", device, at::kFloat);
    tensor_check_cuda("sgd_step_cuda", grads[i], "grad", device, at::kFloat);
    tensor_check_cuda("sgd_step_cuda", momenta[i], "momentum buffer", device, at::kFloat);
    TORCH_CHECK(same_dense_layout(params[i], grads[i]) && same_dense_layout(params[i], momenta[i]),
                "sgd_step_cuda: param, grad and momentum buffer must share a memory layout (tensor ", i, ")");
    TORCH_CHECK(scale_rows[i] >= 0 && scale_rows[i] < lr_scales.size(0), "sgd_step_cuda: bad scale row");
    SgdRecord rec;
    rec.param = params[i].data_ptr<float>();
    rec.grad = grads[i].data_ptr<float>();
    rec.mom = momenta[i].data_ptr<float>();
    rec.numel = params[i].numel();
    rec.weight_decay = weight_decays[i];
    rec.lr_scale = lr_scales.data_ptr<float>() + scale_rows[i];
    packer.add(rec, {(rec.numel + kChunk - 1) / kChunk});
  }
  packer.finish();
}

}  // namespace triaccel
