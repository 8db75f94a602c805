// A dense tensor as a 1-D view of its storage in memory order.
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/Exception.h>

namespace triaccel {

// The elements of a dense tensor (any layout: a channels_last weight too) in memory order, as a contiguous 1-D view
// of its storage. Two tensors of one layout then match element for element: 8-bit blocks of a state and its
// parameter, a parameter and its slot in a broadcast buffer, a tensor and its copy on another rank. `who` names the
// caller in the error for a tensor with gaps or overlaps.
inline at::Tensor memory_flat(const at::Tensor& t, const char* who) {
  TORCH_CHECK(t.is_non_overlapping_and_dense(), who, ": a tensor with gaps or overlaps in memory");
  return t.as_strided({t.numel()}, {1}, t.storage_offset());
}

}  // namespace triaccel
