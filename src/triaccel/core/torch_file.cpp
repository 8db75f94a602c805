#include "triaccel/core/torch_file.h"

#include "triaccel/core/torch_file_check.h"

#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/serialization/storage_context.h>

#include <memory>
#include <unordered_set>
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

namespace {

constexpr const char* kTensorDir = "data/";  // torch.save's storages: <archive>/data/<key>

using StorageSet = std::unordered_set<const c10::StorageImpl*>;

// The bytes from a storage's start to the end of the tensor's view of it (0 for a view of no elements); false when
// an offset, size or stride is negative or the sum overflows.
bool view_end_byte(const at::Tensor& t, uint64_t* end) {
  *end = 0;
  if (t.storage_offset() < 0) return false;
  auto last = static_cast<uint64_t>(t.storage_offset());  // the last element the view reaches
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t size = t.sizes()[d];
    const int64_t stride = t.strides()[d];
    if (size < 0 || stride < 0) return false;
    if (size == 0) return true;
    uint64_t reach = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(size - 1), static_cast<uint64_t>(stride), &reach) ||
        __builtin_add_overflow(last, reach, &last)) {
      return false;
    }
  }
  return !__builtin_mul_overflow(last + 1, static_cast<uint64_t>(t.element_size()), end);
}

// Every tensor in value must be a dense CPU tensor whose view lies inside a storage made from one of the file's
// records (torch_load_bytes), or views nothing: the unpickler sets sizes, strides and offset as the pickle gives
// them, without comparing them with the storage. Depth is bounded by torch_pickle_check.
void tensors_check(const c10::IValue& value, const StorageSet& records) {
  if (value.isTensor()) {
    const at::Tensor& t = value.toTensor();
    TORCH_CHECK(t.layout() == at::kStrided && t.device().is_cpu(), "a tensor is not a dense CPU tensor");
    uint64_t end = 0;
    const bool valid = view_end_byte(t, &end);
    TORCH_CHECK(valid && (end == 0 || (records.count(t.storage().unsafeGetStorageImpl()) > 0 &&
                                       end <= t.storage().nbytes())),
                "a tensor (sizes ", t.sizes(), ", strides ", t.strides(), ", offset ", t.storage_offset(),
                ") does not lie inside a record of the file");
  } else if (value.isGenericDict()) {
    for (const auto& kv : value.toGenericDict()) {
      tensors_check(kv.key(), records);
      tensors_check(kv.value(), records);
    }
  } else if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) tensors_check(item, records);
  } else if (value.isTuple()) {
    for (const c10::IValue& item : value.toTupleRef().elements()) tensors_check(item, records);
  }
}

}  // namespace

c10::IValue torch_load_bytes(const std::string& bytes) {
  // LibTorch's reader trusts sizes in the file (torch_file_check.h): the container and the pickle are checked first.
  torch_zip_check(bytes);
  caffe2::serialize::PyTorchStreamReader reader(std::make_shared<caffe2::serialize::MemoryReadAdapter>(
      bytes.data(), static_cast<off_t>(bytes.size())));
  {
    auto [pickle, size] = reader.getRecord("data.pkl");
    torch_pickle_check(std::string(static_cast<const char*>(pickle.get()), size));
  }
  // The unpickler sizes a storage from the element count written in the pickle, which may exceed its record (a
  // tensor would then read past the record's buffer); storages made here from the records, at their sizes, take
  // precedence.
  auto storages = std::make_shared<torch::jit::DeserializationStorageContext>();
  StorageSet records;
  for (const std::string& name : reader.getAllRecords()) {
    if (name.rfind(kTensorDir, 0) != 0) continue;
    auto [data, size] = reader.getRecord(name);
    c10::Storage storage(c10::Storage::use_byte_size_t(), size, std::move(data), /*allocator=*/nullptr,
                         /*resizable=*/false);
    records.insert(storage.unsafeGetStorageImpl());
    storages->addStorage(name.substr(std::string(kTensorDir).size()), std::move(storage));
  }
  c10::IValue value = torch::jit::readArchiveAndTensors(
      "data", /*pickle_prefix=*/"", /*tensor_prefix=*/"", /*type_resolver=*/std::nullopt, /*obj_loader=*/std::nullopt,
      /*device=*/std::nullopt, reader, torch::jit::Unpickler::defaultTypeParser, storages);
  tensors_check(value, records);
  return value;
}

}  // namespace triaccel
