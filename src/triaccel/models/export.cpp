// Export of a model's state as a PyTorch state_dict file. Invariants: the file is what torch.save writes for a
// dict of tensors (zip container "archive/", pickled plain dict, one storage record per tensor), so Python's
// torch.load(path, weights_only=True) reads it, and so does torch::pickle_load; keys and their order are
// model_state's (torchvision's); every tensor is a compact CPU copy (no shared or oversized storage), parameters
// in float32, buffers in their own dtype; the write is atomic.
//
// torch::pickle_save is not used: it wraps the dict in torch.jit._pickle.restore_type_tag, a global that
// weights_only loading rejects. The same pickler with type tags off writes exactly what torch.save would.
#include "triaccel/models/model.h"

#include "triaccel/core/io.h"

#include <ATen/core/Dict.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>

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

  std::vector<char> pickle_bytes;
  const auto pickle_append = [&pickle_bytes](const char* data, size_t size) {
    pickle_bytes.insert(pickle_bytes.end(), data, data + size);
  };
  torch::jit::Pickler pickler(pickle_append, /*tensor_table=*/nullptr, /*type_renamer=*/nullptr,
                              /*memoized_class_types=*/nullptr, /*get_tensor_id=*/nullptr,
                              /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(state);
  pickler.stop();

  std::string container;
  caffe2::serialize::PyTorchStreamWriter writer([&container](const void* data, size_t size) {
    container.append(static_cast<const char*>(data), size);
    return size;
  });
  torch::jit::writeArchiveAndTensors("data", pickle_bytes.data(), pickle_bytes.size(), pickler.tensorData(), writer);
  writer.writeEndOfFile();
  file_write_atomic(path, container);
}

}  // namespace triaccel
