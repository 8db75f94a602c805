// NeuroFlux memory profile: what training one unit (with its auxiliary head) costs in memory, as a function of the
// batch size B:  bytes(B) = fixed + B · per_sample.
// Two sources, same shape of answer:
//  - modelled (any device, used on the CPU and in tests): a shape trace. The unit runs forward on a zero batch at
//    two sizes with autograd on; every tensor the autograd graph records (each node's outputs, found from the
//    output's grad_fn) is summed; per_sample is the difference per added sample, so batch-independent tensors
//    (weights' views, BN statistics) fall out. Backward transients are modelled as two copies of the largest
//    tensor (its gradient and the gradient it produces).
//  - measured (CUDA): the caching allocator's peak over one forward + backward at two batch sizes, minus what was
//    allocated before (the input is allocated before; the backward starts from a gradient of the output's shape and
//    type, as the next unit or the head sends it), minus the parameters' gradients; a linear fit through the two
//    points. Neither source counts the unit's input or its parameters' gradients: the partitioner does.
// Parameters cost 3 × their fp32 bytes while training (weights, gradients, SGD momentum).
// Invariant: profiling leaves the model's weights and buffers exactly as it found them.
#pragma once

#include "triaccel/models/model.h"

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace triaccel {

struct Footprint {
  double fixed_bytes = 0;       // batch-independent part (workspaces, weight casts)
  double per_sample_bytes = 0;  // grows with the batch
  double at(int64_t batch) const { return fixed_bytes + per_sample_bytes * static_cast<double>(batch); }
};

struct UnitProfile {
  std::string name;
  int64_t params = 0;                  // parameter count
  std::vector<int64_t> in_shape;       // one sample's input shape
  std::vector<int64_t> out_shape;      // one sample's output shape
  int64_t in_bytes = 0;                // one sample's input, fp32
  int64_t out_bytes = 0;               // one sample's output, fp32
  Footprint train;                     // training the unit alone (input detached)
  std::vector<int64_t> head_params;    // per aux-head level (kAuxLevels entries; empty for the last unit)
  std::vector<Footprint> head_train;   // per aux-head level: training the head on the unit's output
  double backprop_per_sample = 0;      // what the unit keeps per sample for a whole-network backward
};

enum class ProfileSource { kModel, kMeasured };

struct MemoryProfile {
  ProfileSource source = ProfileSource::kModel;
  std::vector<UnitProfile> units;
  double backprop_fixed_bytes = 0;     // whole-network training at batch B = fixed + B · per_sample
  double backprop_per_sample = 0;

  // Bytes backprop needs at batch B (parameters, gradients and momentum included).
  double backprop_bytes(int64_t batch) const;
  // Largest batch backprop fits in `budget` bytes (0 when none).
  int64_t backprop_max_batch(double budget) const;
};

// Sum of the bytes of every tensor the autograd graph behind `output` records (excluding parameters' accumulators);
// `max_bytes` receives the largest one. Exposed for tests.
double autograd_graph_bytes(const at::Tensor& output, double* max_bytes = nullptr);
// The same tensors' bytes one by one, in the walk's order (the same order for the same graph at another batch).
std::vector<double> autograd_graph_tensor_bytes(const at::Tensor& output);
// The largest tensor's bytes per sample, from one graph traced at two batch sizes: each tensor's growth per added
// sample, so that a tensor the batch does not size (a weight's 16-bit cast) counts for nothing. Graphs of different
// shapes: the larger trace's largest tensor over its batch.
double largest_tensor_per_sample(const std::vector<double>& small, int64_t small_batch,
                                 const std::vector<double>& large, int64_t large_batch);

// Drops the parameters' gradients (their memory goes back to the allocator).
void grads_release(const std::vector<at::Tensor>& params);

// The allocator's peak over `step` (a forward and a backward on an input the caller allocated before it) above what
// was allocated before, less the bytes of the gradients of `params`, which are released afterwards. Meaningful on
// CUDA only (no allocator readings elsewhere). The peak stays readable in memory_stats until the next reset.
double step_peak_bytes(const std::function<void()>& step, const std::vector<at::Tensor>& params,
                       const c10::Device& device);

// Profiles every unit of `model` (and its aux heads at every level) for inputs of one sample's shape
// `sample_shape` (C, H, W). kMeasured needs a CUDA device. The model may live on any device.
MemoryProfile memory_profile(Model& model, const std::vector<int64_t>& sample_shape, int64_t num_classes,
                             ProfileSource source, const c10::Device& device);

}  // namespace triaccel
