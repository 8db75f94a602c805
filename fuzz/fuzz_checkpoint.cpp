// libFuzzer target: the checkpoint reader (train/checkpoint.h): a torch.save zip container, its pickle, and our
// format, version, entry and checksum checks. checkpoint_read must return a checkpoint or throw UserError; any other
// exception, crash or sanitizer report is a bug. LibTorch itself is not instrumented (pip's build): the sanitizers
// watch our code, and a crash inside LibTorch's zip or pickle reader still shows up as a crash.
// Seed: TRIACCEL_FUZZ_WRITE_SEED=FILE makes the target write a small valid checkpoint to FILE and exit.
#include "fuzz_input.h"
#include "triaccel/core/errors.h"
#include "triaccel/train/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdlib>

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
    const triaccel::Checkpoint c = triaccel::checkpoint_read(path);
    if (c.model_arch.empty() && c.model.empty() && c.config.is_null()) return 0;
  } catch (const triaccel::UserError&) {
  }
  return 0;
}
