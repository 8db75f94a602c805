// Checkpoints: everything needed to continue a run bit-exactly — model weights and buffers, optimizer state,
// loss scaler, schedule position and data cursor (progress), RNG states and the resolved configuration.
// Format: one file that Python's torch.load(weights_only=True) reads as a dict (the "model" entry is a
// torchvision-named state_dict), plus a CRC32 over every tensor's bytes and every string, so a corrupt file is
// refused with a clear error instead of resuming from garbage. Written atomically (io.h): a crash mid-write
// leaves the previous checkpoint intact.
#pragma once

#include "triaccel/core/json.h"
#include "triaccel/core/named_tensors.h"

#include <ATen/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace triaccel {

struct Checkpoint {
  Json config;              // TrainOptions::to_json()
  std::string model_arch;   // "resnet18", ...
  NamedTensors model;       // model_state(): parameters and buffers, torchvision names
  NamedTensors optimizer;   // optimizer state by parameter name (+ suffix), e.g. "conv1.weight.momentum"
  NamedTensors scaler;      // loss scaler: scale, growth_tracker, skipped
  NamedTensors rng;         // generator states: "cpu", "cuda"
  Json progress;            // step, epoch, epoch_offset, elapsed_s, epoch times, ...
};

constexpr const char* kCheckpointFormat = "triaccel-checkpoint";
constexpr int64_t kCheckpointVersion = 1;
constexpr const char* kCheckpointFile = "checkpoint.pt";

void checkpoint_write(const std::string& path, const Checkpoint& checkpoint);

// Throws UserError naming the file for: missing, truncated, not a checkpoint, another format version, checksum
// mismatch, missing entries.
Checkpoint checkpoint_read(const std::string& path);

// A run folder → its checkpoint file; a file path stays as it is.
std::string checkpoint_path(const std::string& dir_or_file);

// --resume RESUME: the checkpoint it names (a run folder or a file), checked to hold `model`; nullopt when RESUME is
// empty. `file` receives the checkpoint's path. UserError for a missing, corrupt or other-model checkpoint.
std::optional<Checkpoint> checkpoint_for_resume(const std::string& resume, const std::string& model, std::string* file);


}  // namespace triaccel
