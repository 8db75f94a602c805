// Fused batch assembly on the GPU: gather samples by index from the resident uint8 dataset, random crop with zero
// padding, horizontal flip, scale to [0, 1], per-channel normalization and cutout, written straight into the output
// tensor in whatever memory format it has (NCHW or channels_last). Reference: augment_reference (data/loader.h).
#pragma once

#include <ATen/Tensor.h>

#include <vector>

namespace triaccel {

// images: (N, C, H, W) uint8 contiguous; index: (B) int64; shift: (B, 2) int64 crop offsets (dy, dx) in
// [0, 2·pad] (undefined = no crop, i.e. dy = dx = pad); flip: (B) uint8 (undefined = no flip);
// cutout: (B, 2) int64 square centres (cy, cx) in output coordinates (undefined = no cutout), cutout_size: the
// square's side in [0, min(H, W)]: rows [cy − size/2, cy − size/2 + size), same for columns, clipped, are set to 0
// after normalization (LoaderOptions::cutout); mean, std: C values (C ≤ 4); out: (B, C, H, W) float32, dense, on
// the same device.
void augment_cuda(const at::Tensor& images, const at::Tensor& index, const at::Tensor& shift,
                  const at::Tensor& flip, int64_t pad, const at::Tensor& cutout, int64_t cutout_size,
                  const std::vector<float>& mean, const std::vector<float>& std, at::Tensor& out);

}  // namespace triaccel
