#include "triaccel/core/torch_file.h"

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <vector>

namespace triaccel {

std::string torch_save_bytes(const c10::IValue& value) {
  std::vector<char> pickle_bytes;
  const auto pickle_append = [&pickle_bytes](const char* data, size_t size) {
    pickle_bytes.insert(pickle_bytes.end(), data, data + size);
  };
  torch::jit::Pickler pickler(pickle_append, /*tensor_table=*/nullptr, /*type_renamer=*/nullptr,
                              /*memoized_class_types=*/nullptr, /*get_tensor_id=*/nullptr,
                              /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();

  std::string container;
  caffe2::serialize::PyTorchStreamWriter writer([&container](const void* data, size_t size) {
    container.append(static_cast<const char*>(data), size);
    return size;
  });
  torch::jit::writeArchiveAndTensors("data", pickle_bytes.data(), pickle_bytes.size(), pickler.tensorData(), writer);
  writer.writeEndOfFile();
  return container;
}

c10::IValue torch_load_bytes(const std::string& bytes) {
  return torch::jit::pickle_load(std::vector<char>(bytes.begin(), bytes.end()));
}

}  // namespace triaccel
