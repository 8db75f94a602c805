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

void state_dict_write(const std::vector<std::pair<std::string, at::Tensor>>& state,
                      const std::vector<at::Tensor>& parameters, const std::string& path) {
  std::unordered_set<const c10::TensorImpl*> is_parameter;
  for (const auto& parameter : parameters) is_parameter.insert(parameter.unsafeGetTensorImpl());

  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [name, tensor] : state) {
    at::Tensor value = tensor.detach().to(at::kCPU);
    if (is_parameter.count(tensor.unsafeGetTensorImpl()) != 0) value = value.to(at::kFloat);
    dict.insert(name, value.clone(at::MemoryFormat::Contiguous));
  }

  file_write_atomic(path, torch_save_bytes(dict));
}

void model_export_state_dict(const Model& model, const std::string& path) {
  state_dict_write(model_state(model), model.parameters(/*recurse=*/true), path);
}

}  // namespace triaccel
