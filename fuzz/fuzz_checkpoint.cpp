// libFuzzer target: the checkpoint reader (train/checkpoint.h) and under it torch_load_bytes (core/torch_file.h): a
// torch.save zip container, its pickle, and our format, version, entry and checksum checks. Contracts checked:
// torch_load_bytes returns a value or throws a std::exception, and every tensor it returns views memory that is
// really there (each tensor's bytes are copied here by instrumented code, so ASan sees a read past a buffer, which
// it would not inside LibTorch); checkpoint_read returns a checkpoint or throws UserError. Any other exception,
// crash or sanitizer report is a bug. LibTorch itself is not instrumented (pip's build): a crash inside its zip or
// pickle reader still shows up, and libFuzzer's -malloc_limit_mb catches an allocation sized from the input.
// Seed: TRIACCEL_FUZZ_WRITE_SEED=FILE makes the target write a small valid checkpoint to FILE and exit.
#include "fuzz_input.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/torch_file.h"
#include "triaccel/train/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

// Copies every byte that a tensor in value may read: its view must lie inside its storage, and the storage's bytes
// must be readable (an instrumented memcpy: ASan checks the whole range). The 128-bit sum cannot overflow for a
// tensor the loader accepted (its own sum fits in 64 bits); if it did, UBSan would report it.
void touch_tensors(const c10::IValue& value) {
  if (value.isTensor()) {
    const at::Tensor& t = value.toTensor();
    __int128 last = t.storage_offset();
    for (int64_t d = 0; d < t.dim(); ++d) {
      if (t.size(d) == 0) return;
      last += static_cast<__int128>(t.size(d) - 1) * t.stride(d);
    }
    const size_t nbytes = t.storage().nbytes();
    if (last < 0 || (last + 1) * t.element_size() > static_cast<__int128>(nbytes)) __builtin_trap();
    std::vector<char> copy(nbytes);
    std::memcpy(copy.data(), t.storage().data(), nbytes);
  } else if (value.isGenericDict()) {
    for (const auto& kv : value.toGenericDict()) touch_tensors(kv.value());
  } else if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) touch_tensors(item);
  } else if (value.isTuple()) {
    for (const c10::IValue& item : value.toTupleRef().elements()) touch_tensors(item);
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* seed = std::getenv("TRIACCEL_FUZZ_WRITE_SEED")) {
    triaccel::Checkpoint c;
    c.config = triaccel::Json{{"model", "small-cnn"}, {"lr", 0.1}};
    c.model_arch = "small-cnn";
    c.model = {{"conv.weight", at::arange(12, at::kFloat).reshape({2, 2, 3})},
               {"bn.num_batches_tracked", at::full({}, 5, at::kLong)}};
    c.optimizer = {{"conv.weight.momentum", at::ones({2, 2, 3})}};
    c.scaler = {{"scale", at::full({1}, 1024.f)}};
    c.rng = {{"cpu", at::zeros({8}, at::kByte)}};
    c.progress = triaccel::Json{{"step", 12}, {"epoch", 1}};
    triaccel::checkpoint_write(seed, c);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = triaccel::fuzz::scratch_path("checkpoint.pt");
  triaccel::fuzz::scratch_write(path, data, size);
  try {
    touch_tensors(triaccel::torch_load_bytes(std::string(reinterpret_cast<const char*>(data), size)));
  } catch (const std::exception&) {
  }
  try {
    const triaccel::Checkpoint c = triaccel::checkpoint_read(path);
    if (c.model_arch.empty() && c.model.empty() && c.config.is_null()) return 0;
  } catch (const triaccel::UserError&) {
  }
  return 0;
}
