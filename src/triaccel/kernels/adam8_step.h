// Fused multi-tensor AdamW step with 8-bit block-wise quantized states (kAdamW8, optim/quant8.h): one CUDA block
// per 256-element quantization block dequantizes m and v, updates them and the parameter in float32, and
// re-quantizes them with the block's new absmax. lr, found_inf and step counts are read on the device.
// The reference for the math is baoc_tensor_step_reference (optim/baoc_optimizer.h).
#pragma once

#include "triaccel/kernels/adam_step.h"

#include <ATen/Tensor.h>

#include <cstdint>
#include <vector>

namespace triaccel {

constexpr int64_t kQuantBlock = 256;  // elements per absmax block of the 8-bit states (one CUDA block each)

// params, grads: float32 contiguous; m_codes, v_codes: (numel) uint8; m_absmax, v_absmax:
// (ceil(numel / kQuantBlock)) bfloat16; map_signed, map_unsigned: (256) float32 on the device. counts: (T, 2)
// float64 contiguous; count_rows[i] is tensor i's row, in counts and in lr_scales ((T) float32 on the device, read at
// every launch).
void adam8_step_cuda(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& m_codes, const std::vector<at::Tensor>& v_codes,
                     const std::vector<at::Tensor>& m_absmax, const std::vector<at::Tensor>& v_absmax,
                     const std::vector<float>& weight_decays, const at::Tensor& lr_scales,
                     const at::Tensor& counts, const std::vector<int64_t>& count_rows, const at::Tensor& map_signed,
                     const at::Tensor& map_unsigned, const at::Tensor& lr, const at::Tensor& found_inf,
                     const AdamStepHyper& hyper);

}  // namespace triaccel
