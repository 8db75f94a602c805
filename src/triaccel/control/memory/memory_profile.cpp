// NeuroFlux memory profile; see memory_profile.h.
#include "triaccel/control/memory/memory_profile.h"

#include "triaccel/core/autograd_walk.h"
#include "triaccel/core/device.h"
#include "triaccel/models/aux_head.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

namespace triaccel {
namespace {

constexpr int64_t kTraceBatchSmall = 2;  // BatchNorm in train mode needs > 1 value per channel
constexpr int64_t kTraceBatchLarge = 4;
constexpr int64_t kMeasureBatchSmall = 16;
constexpr int64_t kMeasureBatchLarge = 64;
constexpr double kStateCopies = 3;  // weights + gradients + momentum

std::vector<int64_t> with_batch(int64_t batch, const std::vector<int64_t>& shape) {
  std::vector<int64_t> out{batch};
  out.insert(out.end(), shape.begin(), shape.end());
  return out;
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// A line through (b1, y1), (b2, y2); the intercept is clamped at 0 (noise can push it below).
Footprint line_fit(int64_t b1, double y1, int64_t b2, double y2) {
  Footprint f;
  f.per_sample_bytes = std::max(0.0, (y2 - y1) / static_cast<double>(b2 - b1));
  f.fixed_bytes = std::max(0.0, y1 - f.per_sample_bytes * static_cast<double>(b1));
  return f;
}

// Modelled: the autograd graph of fn(zero batch) at two batch sizes; transients = 2 × the largest tensor.
Footprint trace_footprint(const std::function<at::Tensor(int64_t)>& fn, double* graph_per_sample) {
  double max_small = 0, max_large = 0;
  const double small = autograd_graph_bytes(fn(kTraceBatchSmall), &max_small);
  const double large = autograd_graph_bytes(fn(kTraceBatchLarge), &max_large);
  Footprint graph = line_fit(kTraceBatchSmall, small, kTraceBatchLarge, large);
  const Footprint largest = line_fit(kTraceBatchSmall, max_small, kTraceBatchLarge, max_large);
  if (graph_per_sample) *graph_per_sample = graph.per_sample_bytes;
  graph.per_sample_bytes += 2 * largest.per_sample_bytes;
  graph.fixed_bytes += 2 * largest.fixed_bytes;
  return graph;
}

// Measured: allocator peak above what was allocated before, over fn(input) + a backward from a gradient of the
// output's shape and type (what the next unit or the head sends back), at two batch sizes. The input is allocated
// before the window (its bytes are the caller's to count) and the parameters' gradients are taken out (the
// partitioner counts weights, gradients and momenta itself).
Footprint measure_footprint(const std::vector<int64_t>& in_shape, const std::function<at::Tensor(const at::Tensor&)>& fn,
                            const std::vector<at::Tensor>& params, const c10::Device& device) {
  double y[2] = {0, 0};
  const int64_t batches[2] = {kMeasureBatchSmall, kMeasureBatchLarge};
  for (int repeat = 0; repeat < 2; ++repeat) {  // the first pass lets cuDNN pick its algorithms
    for (int i = 0; i < 2; ++i) {
      const at::Tensor x = at::zeros(with_batch(batches[i], in_shape), at::TensorOptions().dtype(at::kFloat).device(device));
      y[i] = step_peak_bytes(
          [&] {
            at::Tensor out = fn(x);
            out.backward(at::ones_like(out));
          },
          params, device);
    }
  }
  return line_fit(batches[0], y[0], batches[1], y[1]);
}

}  // namespace

void grads_release(const std::vector<at::Tensor>& params) {
  for (const auto& p : params) {
    if (p.grad().defined()) const_cast<at::Tensor&>(p).mutable_grad().reset();
  }
}

double step_peak_bytes(const std::function<void()>& step, const std::vector<at::Tensor>& params,
                       const c10::Device& device) {
  double grad_bytes = 0;
  for (const auto& p : params) grad_bytes += p.requires_grad() ? static_cast<double>(p.numel() * p.element_size()) : 0;
  device_synchronize(device);
  const int64_t before = memory_stats(device).allocated_bytes;
  memory_stats_reset_peak(device);
  step();
  device_synchronize(device);
  const double bytes = static_cast<double>(memory_stats(device).peak_allocated_bytes - before) - grad_bytes;
  grads_release(params);
  return bytes;
}

std::vector<double> autograd_graph_tensor_bytes(const at::Tensor& output) {
  std::vector<double> bytes;
  autograd_graph_visit(output, [&](torch::autograd::Node& node) {
    if (node.name().find("AccumulateGrad") != std::string::npos) return;  // a parameter, not an activation
    for (uint32_t i = 0; i < node.num_inputs(); ++i) {
      const auto& meta = node.input_metadata(i);
      double numel = 1;
      for (const auto& d : meta.shape_as_dim_vector()) numel *= static_cast<double>(d.expect_int());
      bytes.push_back(numel * static_cast<double>(meta.dtype().itemsize()));
    }
  });
  return bytes;
}

double autograd_graph_bytes(const at::Tensor& output, double* max_bytes) {
  const std::vector<double> bytes = autograd_graph_tensor_bytes(output);
  if (max_bytes) *max_bytes = bytes.empty() ? 0.0 : *std::max_element(bytes.begin(), bytes.end());
  return std::accumulate(bytes.begin(), bytes.end(), 0.0);
}

double largest_tensor_per_sample(const std::vector<double>& small, int64_t small_batch,
                                 const std::vector<double>& large, int64_t large_batch) {
  if (small.size() != large.size()) {
    return large.empty() ? 0.0 : *std::max_element(large.begin(), large.end()) / static_cast<double>(large_batch);
  }
  double largest = 0;
  for (size_t i = 0; i < large.size(); ++i) {
    largest = std::max(largest, (large[i] - small[i]) / static_cast<double>(large_batch - small_batch));
  }
  return largest;
}

double MemoryProfile::backprop_bytes(int64_t batch) const {
  return backprop_fixed_bytes + backprop_per_sample * static_cast<double>(batch);
}

int64_t MemoryProfile::backprop_max_batch(double budget) const {
  if (backprop_per_sample <= 0) return 0;
  const double b = std::floor((budget - backprop_fixed_bytes) / backprop_per_sample);
  return b < 1 ? 0 : static_cast<int64_t>(std::min(b, 1e9));
}

MemoryProfile memory_profile(Model& model, const std::vector<int64_t>& sample_shape, int64_t num_classes,
                             ProfileSource source, const c10::Device& device) {
  TORCH_CHECK(source == ProfileSource::kModel || device.is_cuda(), "a measured memory profile needs a CUDA device");
  // Profiling runs BatchNorm in train mode on zero batches: keep the running statistics as they were.
  const BuffersKept kept(model.buffers());
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  const bool was_training = model.is_training();
  model.train();

  MemoryProfile profile;
  profile.source = source;
  std::vector<int64_t> shape = sample_shape;
  double params_total = 0, fixed_total = 0, graph_total = 0, largest_transient = 0;
  const auto& units = model.units();
  for (size_t u = 0; u < units.size(); ++u) {
    const Unit& unit = units[u];
    UnitProfile up;
    up.name = unit.name;
    up.params = unit.parameter_count();
    up.in_shape = shape;
    up.in_bytes = numel_of(shape) * 4;
    {
      const torch::NoGradGuard no_grad;
      const at::Tensor out = unit.forward(at::zeros(with_batch(kTraceBatchSmall, shape), opts));
      up.out_shape = std::vector<int64_t>(out.sizes().begin() + 1, out.sizes().end());
    }
    up.out_bytes = numel_of(up.out_shape) * 4;
    const auto unit_fn = [&](int64_t b) { return unit.forward(at::zeros(with_batch(b, shape), opts)); };
    double graph_per_sample = 0;
    Footprint traced = trace_footprint(unit_fn, &graph_per_sample);
    up.backprop_per_sample = graph_per_sample;
    up.train = source == ProfileSource::kModel
                   ? traced
                   : measure_footprint(shape, [&](const at::Tensor& x) { return unit.forward(x); }, unit.parameters(),
                                       device);
    largest_transient = std::max(largest_transient, traced.per_sample_bytes - graph_per_sample);
    if (u + 1 < units.size()) {
      for (int64_t level = 0; level < kAuxLevels; ++level) {
        AuxHead head(up.out_shape, aux_filters(up.out_shape[0], level), num_classes);
        head->to(device);
        head->train();
        const auto head_fn = [&](int64_t b) { return head->forward(at::zeros(with_batch(b, up.out_shape), opts)); };
        up.head_params.push_back(head->parameter_count());
        up.head_train.push_back(
            source == ProfileSource::kModel
                ? trace_footprint(head_fn, nullptr)
                : measure_footprint(up.out_shape, [&](const at::Tensor& x) { return head->forward(x); },
                                    head->parameters(), device));
      }
    }
    params_total += static_cast<double>(up.params);
    fixed_total += traced.fixed_bytes;
    graph_total += graph_per_sample;
    shape = up.out_shape;
    profile.units.push_back(std::move(up));
  }

  // Whole-network backprop: every unit's graph is alive at once, plus the input batch and the backward transients.
  const double input_bytes = static_cast<double>(numel_of(sample_shape) * 4);
  if (source == ProfileSource::kModel) {
    profile.backprop_fixed_bytes = kStateCopies * 4 * params_total + fixed_total;
    profile.backprop_per_sample = graph_total + largest_transient + input_bytes;
  } else {
    const Footprint f =
        measure_footprint(sample_shape, [&](const at::Tensor& x) { return model.forward(x); }, model.parameters(), device);
    profile.backprop_fixed_bytes = f.fixed_bytes + 2 * 4 * params_total;  // + gradients and momenta
    profile.backprop_per_sample = f.per_sample_bytes + input_bytes;
  }

  grads_release(model.parameters());
  model.train(was_training);
  return profile;
}

}  // namespace triaccel
