// Tensors by name: what checkpoints store (model weights and buffers, optimizer state, loss scaler, RNG states).
#pragma once

#include <ATen/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace triaccel {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Copies `stored` into `live` by name; throws UserError naming the file and the first missing or mismatched
// tensor (another model's checkpoint). `what` is "model", "optimizer", ... for the message.
void named_tensors_load(const NamedTensors& live, const NamedTensors& stored, const std::string& what,
                        const std::string& path);

}  // namespace triaccel
