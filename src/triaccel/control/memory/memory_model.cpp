// The memory planner's cost model of a run; see memory_model.h.
#include "triaccel/control/memory/memory_model.h"

#include "triaccel/control/memory/memory_profile.h"
#include "triaccel/core/device.h"
#include "triaccel/models/linear.h"
#include "triaccel/train/fp8_linear.h"
#include "triaccel/train/fp8_saved.h"
#include "triaccel/train/rng.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/autograd.h>
#include <torch/utils.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <numeric>
#include <optional>

namespace triaccel {
namespace {

constexpr int64_t kTraceSmall = 2;  // BatchNorm in train mode needs > 1 value per channel
constexpr int64_t kTraceLarge = 4;

at::Tensor batch_of(const at::Tensor& sample, int64_t batch) {
  std::vector<int64_t> shape{batch};
  shape.insert(shape.end(), sample.sizes().begin(), sample.sizes().end());
  return sample.unsqueeze(0).expand(shape).contiguous();
}

int64_t bytes_per_sample(const at::Tensor& t) {
  return t.numel() / std::max<int64_t>(1, t.size(0)) * static_cast<int64_t>(t.element_size());
}

// Output positions of one sample: H·W of an image map, T of a token sequence, 1 of a vector.
double positions(const at::Tensor& out) {
  if (out.dim() >= 4) return static_cast<double>(out.size(2) * out.size(3));
  if (out.dim() == 3) return static_cast<double>(out.size(1));
  return 1;
}

// The step's FP8 linear layers (an amp-fp8 run's, a Tri-Accel unit's at fp8: train/step.cpp) for the traces, with
// scales of their own (the run's are not touched): an FP8 layer keeps its input for backward in 1 byte where a 16-bit
// one keeps 2. Here a layer takes FP8 only where it would at every batch, its rows per sample a multiple of
// _scaled_mm's 16 (GPT-char's 256 tokens): ViT-Tiny's 65 tokens take it at some micro-batches only, so they are priced
// at 16 bits, an upper bound. Unpriced, a Tri-Accel GPT-char run without a budget (its limit AMP bf16's peak) paid
// for its fp32 head by recomputing blocks.0 all run, at 5.83 GB against the limit's 6.71 (H200,
// bench/results/h200/tri_accel_fp8_a007584).
class TraceFp8Linears final : public LinearOverride {
 public:
  at::Tensor forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) override {
    if (x.dim() < 2 || x.size(0) == 0 || x.size(-1) == 0 ||
        (x.numel() / x.size(-1) / x.size(0)) % kFp8ScaledMmMultiple != 0) {
      return at::Tensor();
    }
    return linears_.forward(x, weight, bias);
  }

 private:
  Fp8Linears linears_{Fp8ScaleOptions{}};
};

// Unit u's forward as the step runs it: its precision's autocast (unit_forward_at), its linear layers in FP8 where the
// step's would be.
at::Tensor traced_unit_forward(const MemoryModelInputs& in, const Unit& unit, size_t u, const c10::Device& device,
                               const at::Tensor& x, TraceFp8Linears& fp8) {
  const std::optional<Precision> precision = unit_precision_at(in.unit_precisions, u, device);
  const LinearOverrideScope scope(fp8_linears(unit_mode(precision, in.precision)) ? &fp8 : nullptr);
  return unit_forward_at(precision, in.precision, device, x, unit.forward);
}

// The allocator's peak over forward + backward of the whole model at two batches: its slope over the modelled
// activations per sample (the units' saved bytes and backward's transients) is the starting activation scale. The
// gradients come back as new tensors (autograd::grad): the parameters' .grad are untouched. At small batches the
// parameters' gradients, which backward makes while it frees the activations, move the peak and the slope misses what
// a training batch reads (H200, bench/results/h200/scale_trace_09d94bb; eager steps' implied scale, then the scale
// traced at 2/4, 8/16 and 32/64): ViT-Tiny fp32 at 256 samples 0.989: 0.883, 0.999, 0.970; amp-bf16 1.034: 1.000,
// 1.081, 1.018; ResNet-18 amp-bf16 at 96 0.893: 1.000, 0.858, 0.891; GPT-char fp32 at 64 0.992: 1.026, 1.001, 1.000.
// kScaleTraceBatches in order, the next where one does not fit (a budget's cap); out of memory in all of them (a cap
// below even the smallest): the scale stays 1 and calibration corrects it later. The cached blocks of the larger
// traces go back to the device before the plan counts what is reserved.
constexpr std::array<std::pair<int64_t, int64_t>, 3> kScaleTraceBatches{
    {{32, 64}, {8, 16}, {kTraceSmall, kTraceLarge}}};

double measured_activation_scale(Model& model, const at::Tensor& sample, const MemoryModelInputs& in,
                                 const MemoryModel& m, const c10::Device& device, TraceFp8Linears& fp8) {
  double modelled = m.transient_bytes;
  for (const UnitCost& u : m.units) modelled += u.saved_bytes;
  if (modelled <= 0) return 1;
  std::vector<at::Tensor> params;
  for (const auto& p : model.parameters()) {
    if (p.requires_grad()) params.push_back(p);
  }
  const auto& units = model.units();
  const auto peak_of = [&](int64_t batch) {
    at::Tensor x = batch_of(sample, batch);  // allocated before the reading; freed once unit 0 has run
    return step_peak_bytes(
        [&] {
          for (size_t u = 0; u < units.size(); ++u) x = traced_unit_forward(in, units[u], u, device, x, fp8);
          (void)torch::autograd::grad({x.to(at::kFloat).sum()}, params, {}, /*retain_graph=*/false,
                                      /*create_graph=*/false, /*allow_unused=*/true);
        },
        {}, device);  // the gradients come back as new tensors: none held in .grad to take out
  };
  const double scale = activation_scale_from_traces(scale_trace_batches(), peak_of, modelled,
                                                    [&device] { memory_cache_release(device); });
  memory_cache_release(device);
  return scale;
}

// A unit's forward at one batch, the bytes it leaves allocated (on CUDA; elsewhere its autograd graph's).
using UnitRun = std::function<double(const at::Tensor& x)>;

// The same forward with what it saves stored in FP8 (UnitCost::fp8_bytes, fp8_s in seconds, fp8_unpack_bytes): on
// CUDA the allocator's growth again (the unit's output counted at its own dtype, as the kept trace counts it: alive
// until the next unit has run, which in the step frees it only when that unit stores it in FP8 too — an over-count,
// never an under-count), elsewhere the saved bytes less what the store took in, plus what it keeps. Backward
// dequantizes one stored tensor at a time: the largest is made again beside the unit's bytes. The price: a quantize
// pass (read the tensor, write its bytes) and a dequantize pass (the reverse), memory-bound; in seconds here, in the
// model's unit once every unit is traced. Not offered (fp8_bytes 0) when the store keeps nothing.
void fp8_saved_trace(const UnitRun& run, const at::Tensor& small, const at::Tensor& large, bool allocator,
                     UnitCost* c) {
  struct Reading {
    double graph, original, kept, largest;
  };
  const auto stored = [&run](const at::Tensor& x) {
    Fp8SavedStore store;
    double graph = 0;
    {
      const Fp8SavedScope scope(store);
      graph = run(x);
    }
    return Reading{graph, static_cast<double>(store.original_bytes()), static_cast<double>(store.stored_bytes()),
                   static_cast<double>(store.largest_original_bytes())};
  };
  const Reading a = stored(small), b = stored(large);
  const double per = static_cast<double>(kTraceLarge - kTraceSmall);
  const double original = (b.original - a.original) / per, kept = (b.kept - a.kept) / per;
  const double bytes = allocator ? (b.graph - a.graph) / per : c->saved_bytes - original + kept;
  if (kept > 0 && bytes > 0) {
    c->fp8_bytes = bytes;
    c->fp8_s = 2 * (original + kept) / kGpuMemoryBytesPerS;
    c->fp8_unpack_bytes = b.largest / static_cast<double>(kTraceLarge);
  }
}

// The allocator's peak over unit u's forward and a backward from a gradient of its output's shape, above what was
// allocated before (the input, the caller's). The gradient is taken for the input alone where it is floating (the
// parameters' gradients are held by the step, not per sample), else for the unit's parameters; 0 when none needs
// one.
double unit_backward_peak(const MemoryModelInputs& in, const Unit& unit, size_t u, const c10::Device& device,
                          const at::Tensor& input, TraceFp8Linears& fp8) {
  at::Tensor x = input.detach();
  std::vector<at::Tensor> wrt;
  if (at::isFloatingType(x.scalar_type())) {
    x.requires_grad_(true);
    wrt.push_back(x);
  } else {
    for (const auto& p : unit.parameters()) {
      if (p.requires_grad()) wrt.push_back(p);
    }
  }
  if (wrt.empty()) return 0.0;
  bool graph = true;
  const double peak = step_peak_bytes(
      [&] {
        const at::Tensor out = traced_unit_forward(in, unit, u, device, x, fp8);
        graph = out.requires_grad();
        if (graph) {
          (void)torch::autograd::grad({out}, wrt, {at::ones_like(out)}, /*retain_graph=*/false,
                                      /*create_graph=*/false, /*allow_unused=*/true);
        }
      },
      {}, device);
  return graph ? peak : 0.0;
}

// UnitCost::backward_bytes: unit_backward_peak's slope over the trace's two batches, after a first pass unread
// (backward runs on autograd's thread, whose first product makes that thread's cuBLAS workspace). 0 (unread: the
// unit keeps the saved + transient price) where the unit cannot run so (a Python unit that starts with an in-place op
// on its input, which a leaf that needs a gradient refuses) or the trace does not fit.
double backward_trace(const MemoryModelInputs& in, const Unit& unit, size_t u, const c10::Device& device,
                      const at::Tensor& small, const at::Tensor& large, TraceFp8Linears& fp8) {
  try {
    (void)unit_backward_peak(in, unit, u, device, small, fp8);
    const double a = unit_backward_peak(in, unit, u, device, small, fp8);
    const double b = unit_backward_peak(in, unit, u, device, large, fp8);
    return std::max(0.0, (b - a) / static_cast<double>(kTraceLarge - kTraceSmall));
  } catch (const std::exception&) {  // c10::Error, or a Python unit's error as the module hands it back
    return 0;
  }
}

// One unit's costs, traced at the batches `small` and `large` (the previous unit's outputs at kTraceSmall and
// kTraceLarge), with its outputs at both and the largest tensor per sample its graph records.
struct UnitTrace {
  UnitCost cost;
  at::Tensor out_small, out_large;
  double largest = 0;
};

UnitTrace unit_trace(const MemoryModelInputs& in, const Unit& unit, size_t u, const c10::Device& device,
                     const at::Tensor& small, const at::Tensor& large, bool fp8_store, TraceFp8Linears& fp8) {
  const auto run = [&](at::Tensor x, std::vector<double>* tensors) {
    // On CUDA the allocator counts what the forward keeps (each saved tensor once, at its real dtype); elsewhere
    // the autograd graph's recorded outputs stand in for it. Each unit as the step runs it (traced_unit_forward).
    const bool measured = device.is_cuda() && tensors != nullptr;
    if (measured) device_synchronize(device);
    const double before = measured ? static_cast<double>(memory_stats(device).allocated_bytes) : 0;
    at::Tensor out = traced_unit_forward(in, unit, u, device, x, fp8);
    double graph = 0;
    if (tensors) {
      *tensors = autograd_graph_tensor_bytes(out);
      graph = std::accumulate(tensors->begin(), tensors->end(), 0.0);
    }
    if (measured) {
      device_synchronize(device);
      graph = static_cast<double>(memory_stats(device).allocated_bytes) - before;
    }
    return std::make_pair(out.detach(), graph);
  };
  UnitTrace t;
  UnitCost& c = t.cost;
  c.name = unit.name;
  c.input_bytes = static_cast<double>(bytes_per_sample(large));
  if (device.is_cuda()) {
    // A library's first call on a stream keeps a workspace from the allocator (cuBLAS: 32 MiB a stream on Hopper; a
    // run's fresh stream has none): made here, before the readings, it is not counted as the small trace's saving.
    const torch::NoGradGuard no_grad;
    (void)run(small, nullptr);
  }
  std::vector<double> tensors_small, tensors_large;
  auto [out_small, graph_small] = run(small, &tensors_small);
  auto [out_large, graph_large] = run(large, &tensors_large);
  c.saved_bytes = std::max(0.0, (graph_large - graph_small) / static_cast<double>(kTraceLarge - kTraceSmall));
  // Per sample: a weight's 16-bit cast (4.7 MB for ResNet-18's layer4.1 at any batch) is no sample's backward
  // transient. Counted over the trace's 4 samples it would make the transient term about half of ResNet-18's
  // modelled activations, and the calibration would take that back by roughly halving the scale of every other
  // per-sample byte: a unit promoted to fp32 would be priced at half of what its activations grow.
  t.largest = largest_tensor_per_sample(tensors_small, kTraceSmall, tensors_large, kTraceLarge);
  c.flops = 2.0 * static_cast<double>(unit.parameter_count()) * positions(out_large);
  {
    // Repeatable? A unit that draws random numbers in training (dropout, stochastic depth) gives another output
    // for the same input. Asked of its 16-bit forward twice: FP8 layers' delayed scales move between two calls.
    const torch::NoGradGuard no_grad;
    const auto plain = [&] {
      return unit_forward_at(unit_precision_at(in.unit_precisions, u, device), in.precision, device, large,
                             unit.forward);
    };
    const at::Tensor once = plain(), again = plain();
    c.recomputable = again.sizes() == once.sizes() &&
                     at::allclose(again.to(at::kFloat), once.to(at::kFloat), 1e-3, 1e-3);
  }
  if (device.is_cuda() && c.recomputable) {
    c.backward_bytes = backward_trace(in, unit, u, device, small, large, fp8);
  }
  const UnitRun measure = [&](const at::Tensor& x) { std::vector<double> tensors; return run(x, &tensors).second; };
  if (fp8_store) fp8_saved_trace(measure, small, large, device.is_cuda(), &c);
  t.out_small = out_small;
  t.out_large = out_large;
  return t;
}

}  // namespace

std::vector<std::pair<int64_t, int64_t>> scale_trace_batches() {
  if (const char* v = std::getenv("TRIACCEL_SCALE_TRACE"); v != nullptr && *v != '\0') {
    long long s = 0, l = 0;
    if (std::sscanf(v, "%lld,%lld", &s, &l) == 2 && s >= kTraceSmall && l > s) return {{s, l}};
  }
  return {kScaleTraceBatches.begin(), kScaleTraceBatches.end()};
}

double activation_scale_from_traces(const std::vector<std::pair<int64_t, int64_t>>& pairs,
                                    const std::function<double(int64_t)>& peak_of, double modelled_per_sample,
                                    const std::function<void()>& release) {
  if (modelled_per_sample <= 0) return 1;
  for (const auto& [small_batch, large_batch] : pairs) {
    try {
      double slope = 0;
      for (int pass = 0; pass < 2; ++pass) {
        const double small = peak_of(small_batch), large = peak_of(large_batch);
        slope = (large - small) / static_cast<double>(large_batch - small_batch);
      }
      if (slope <= 0) return 1;
      return std::clamp(slope / modelled_per_sample, kMeasuredScaleMin, kMeasuredScaleMax);
    } catch (const c10::OutOfMemoryError&) {
      release();  // what the failed trace cached goes back before the smaller one
    }
  }
  return 1;
}

MemoryModel memory_model_build(Model& model, const at::Tensor& sample, const MemoryModelInputs& in,
                               const c10::Device& device) {
  const auto& units = model.units();
  TORCH_CHECK(in.unit_precisions.empty() || in.unit_precisions.size() == units.size(), "memory_model_build: ",
              in.unit_precisions.size(), " precisions for ", units.size(), " units");
  // Tracing runs BatchNorm in train mode and may draw random numbers (dropout): everything is put back.
  const NamedTensors rng = rng_state(device);
  const BuffersKept kept(model.buffers());
  const bool was_training = model.is_training();
  model.train();

  MemoryModel m;
  const int64_t n = model.parameter_count();
  bool any16 = in.precision != PrecisionMode::kFP32;
  for (Precision p : in.unit_precisions) any16 = any16 || p != Precision::kFP32;
  m.weights_bytes = 4.0 * static_cast<double>(n);
  m.grads_bytes = 4.0 * static_cast<double>(n);
  m.optimizer_bytes = static_cast<double>(in.optimizer_state_bytes + in.optimizer_transient_bytes);
  const double workspaces = in.budgeted ? kGpuFixedTransientBytesBudgeted : kGpuFixedTransientBytes;
  // 16-bit units: the weights' casts, which their backward keeps (no autocast cache: a cast per use).
  m.fixed_bytes = (any16 ? 2.0 * static_cast<double>(n) : 0.0) + (in.for_gpu ? workspaces : 0.0) +
                  static_cast<double>(in.grad_reduce_bytes) + kLossScalerBytes;
  m.dataset_bytes = static_cast<double>(in.dataset_device_bytes);
  m.stream_bytes = static_cast<double>(in.dataset_stream_bytes);
  m.batch_input_bytes = static_cast<double>(in.sample_input_bytes);
  m.allow_host_data = in.allow_host_data;
  m.outputs_in_saved = device.is_cuda();  // the allocator's growth below, else the autograd graph's records
  m.overhead_s = in.for_gpu ? kGpuOverheadSamples : 1.0;
  m.per_sample_s = 1.0;
  m.stream_per_sample_s = kStreamSampleCost;

  // Unit by unit, each fed the previous unit's output at batch kTraceSmall and kTraceLarge.
  at::Tensor small = batch_of(sample, kTraceSmall), large = batch_of(sample, kTraceLarge);
  double largest = 0;
  const bool fp8 = in.fp8_saved && fp8_saved_available();
  TraceFp8Linears fp8_linears_traced;  // outlives every graph the traces record (their backward reads its scales)
  for (size_t u = 0; u < units.size(); ++u) {
    UnitTrace t = unit_trace(in, units[u], u, device, small, large, fp8, fp8_linears_traced);
    largest = std::max(largest, t.largest);
    m.units.push_back(std::move(t.cost));
    small = t.out_small;
    large = t.out_large;
  }
  m.transient_bytes = 2 * largest;  // backward: a gradient of the largest tensor and the one it produces
  const double seconds_per_unit = memory_model_seconds_per_unit(m);
  for (UnitCost& c : m.units) c.fp8_s = seconds_per_unit > 0 ? c.fp8_s / seconds_per_unit : 0;
  if (in.update_in_backward) {
    // The gradients alive at once when each parameter is updated as backward makes its gradient: the one being
    // updated and one more (a parameter whose gradient waits for another use, a tied weight). The price: a
    // non-finite check and an update launched per parameter instead of one of each over all of them.
    int64_t first = 0, second = 0;
    for (const auto& p : model.parameters()) {
      const int64_t k = p.numel();
      second = std::max(second, std::min(first, k));
      first = std::max(first, k);
    }
    m.update_in_backward_grads_bytes = 4.0 * static_cast<double>(first + second);
    const double launches = 2.0 * static_cast<double>(model.parameters().size());
    m.update_in_backward_s = seconds_per_unit > 0 ? launches * kGpuLaunchS / seconds_per_unit : 0;
  }
  if (in.measure_scale && device.is_cuda()) {
    m.activation_scale = measured_activation_scale(model, sample, in, m, device, fp8_linears_traced);
  }

  for (auto& p : model.parameters()) p.mutable_grad() = at::Tensor();
  model.train(was_training);
  rng_restore(rng, device);
  return m;
}

void memory_model_agree(MemoryModel& model,
                        const std::function<std::vector<double>(std::vector<double>)>& max_over_ranks) {
  // Every number in one list, each a quantity whose largest value is the safe one (flags as "forbidden" = 1).
  std::vector<double*> fields = {&model.weights_bytes, &model.grads_bytes,      &model.optimizer_bytes,
                                 &model.fixed_bytes,   &model.dataset_bytes,    &model.stream_bytes,
                                 &model.batch_input_bytes, &model.transient_bytes, &model.activation_scale,
                                 &model.overhead_s,    &model.per_sample_s,     &model.stream_per_sample_s,
                                 &model.forward_share};
  for (UnitCost& u : model.units) {
    fields.push_back(&u.saved_bytes);
    fields.push_back(&u.input_bytes);
    fields.push_back(&u.flops);
    fields.push_back(&u.fp8_bytes);
    fields.push_back(&u.fp8_s);
    fields.push_back(&u.fp8_unpack_bytes);
    fields.push_back(&u.backward_bytes);
  }
  std::vector<double> values;
  for (const double* f : fields) values.push_back(*f);
  for (const UnitCost& u : model.units) values.push_back(u.recomputable ? 0.0 : 1.0);
  values.push_back(model.allow_host_data ? 0.0 : 1.0);
  values = max_over_ranks(std::move(values));
  TORCH_CHECK(values.size() == fields.size() + model.units.size() + 1, "memory_model_agree: ", values.size(),
              " numbers back");
  size_t k = 0;
  for (double* f : fields) *f = values[k++];
  for (UnitCost& u : model.units) u.recomputable = values[k++] == 0.0;
  model.allow_host_data = values[k] == 0.0;
}

double memory_model_eval_per_sample(const MemoryModel& model) {
  double widest = 0;
  for (const UnitCost& u : model.units) widest = std::max(widest, u.input_bytes);
  return model.activation_scale * (3 * widest + model.transient_bytes / 2);
}

int64_t memory_model_eval_batch(const MemoryModel& model, int64_t cap_bytes, int64_t held_bytes, int64_t micro_batch,
                                int64_t asked) {
  const double per_sample = memory_model_eval_per_sample(model);
  const double room = static_cast<double>(cap_bytes - held_bytes);
  const int64_t fresh = per_sample > 0 && room > 0 ? static_cast<int64_t>(room / per_sample) : 0;
  return std::clamp<int64_t>(std::max(fresh, micro_batch), 1, asked);
}

}  // namespace triaccel
