// Export of a model's state as a PyTorch state_dict file. Invariants: the file is what torch.save writes for a
// dict of tensors (zip container "archive/", pickled plain dict, one storage record per tensor), so Python's
// torch.load(path, weights_only=True) reads it, and so does torch::pickle_load; keys and their order are
// model_state's (torchvision's); every tensor is a compact CPU copy (no shared or oversized storage), parameters
// in float32, buffers in their own dtype; the write is atomic.
#include "triaccel/models/model.h"

#include "triaccel/core/io.h"
#include "triaccel/core/torch_file.h"

#include <ATen/core/Dict.h>

#include <unordered_set>

namespace triaccel {

void model_export_state_dict(const Model& model, const std::string& path) {
  std::unordered_set<const c10::TensorImpl*> parameters;
  for (const auto& parameter : model.parameters(/*recurse=*/true)) parameters.insert(parameter.unsafeGetTensorImpl());

  c10::Dict<std::string, at::Tensor> state;
  for (const auto& [name, tensor] : model_state(model)) {
    at::Tensor value = tensor.detach().to(at::kCPU);
    if (parameters.count(tensor.unsafeGetTensorImpl()) != 0) value = value.to(at::kFloat);
    state.insert(name, value.clone(at::MemoryFormat::Contiguous));
  }

  file_write_atomic(path, torch_save_bytes(state));
}

}  // namespace triaccel
