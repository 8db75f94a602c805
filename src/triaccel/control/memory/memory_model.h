// The memory planner's cost model of a run (control/memory/memory_planner.h), built from the model's shapes on any
// device: each unit runs forward on a zero batch at two sizes, under the precision it trains in, with autograd on, and
// what it keeps for backward gives its saved activations per sample: on CUDA the allocator's growth over the forward
// (each saved tensor once, at its dtype), elsewhere the tensors its autograd graph records
// (control/memory/memory_profile.h: autograd_graph_bytes, an over-count: several times what the allocator reads;
// docs/results/memory-planner.md); its input's bytes, its forward FLOPs (2 · parameters · output positions) and whether
// it can be recomputed (no dropout) come from the same pass. Weights, gradients, optimizer state (with what the
// optimizer allocates beside it), 16-bit weight casts, the loss scaler and the dataset come from the run's
// configuration. On CUDA, before training, the allocator's peak over the whole model's
// forward + backward at two small batches sets the starting activation scale; what it measures while training corrects
// it (MemoryModel::activation_scale).
//
// Invariant: building the model leaves the weights and buffers exactly as it found them.
#pragma once

#include "triaccel/control/memory/memory_planner.h"
#include "triaccel/models/model.h"
#include "triaccel/train/precision.h"

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace triaccel {

struct MemoryModelInputs {
  PrecisionMode precision = PrecisionMode::kFP32;
  std::vector<Precision> unit_precisions;  // Tri-Accel's per-unit precisions (empty: `precision` for every unit)
  int64_t optimizer_state_bytes = 0;
  // Allocated by the optimizer beside its state at times, and priced all the time (one plan serves the whole run):
  // BAOC's statistics window and its largest conversion between formats (run/memory_setup.h: optimizer_priced).
  int64_t optimizer_transient_bytes = 0;
  int64_t dataset_device_bytes = 0;    // the training and test sets resident on the device
  int64_t dataset_stream_bytes = 0;    // what stays on the device when they are streamed from the host
  int64_t sample_input_bytes = 0;      // one sample of the step's static input and labels
  int64_t sample_staging_bytes = 0;    // the device staging of one streamed sample
  int64_t grad_reduce_bytes = 0;       // data parallelism: the gradient buckets (train/grad_buckets.h), held always
  bool allow_host_data = true;
  bool for_gpu = false;                // price for a GPU (overheads, workspaces) whatever device traces it
  bool budgeted = false;               // a vram_budget: cuBLAS's small workspaces (kGpuFixedTransientBytesBudgeted)
  // On CUDA: measure the whole model's forward + backward at two small batches and start from that activation
  // scale (not while training: the step's memory, graph and gradients are live).
  bool measure_scale = false;
  // Price each unit's saved activations stored in FP8 (train/fp8_saved.h) as well: traced again under an FP8 store
  // where the lever is available here (fp8_saved_available), UnitCost::fp8_bytes and fp8_s; else not offered.
  bool fp8_saved = false;
  // Offer the update in backward (train/step.h; the step can take it: TrainStep::update_in_backward_possible):
  // MemoryModel::update_in_backward_grads_bytes and update_in_backward_s.
  bool update_in_backward = false;
};

// Bounds of the measured starting activation scale (memory_model_build with measure_scale).
constexpr double kMeasuredScaleMin = 0.2;
constexpr double kMeasuredScaleMax = 5;

// The pairs of batches the starting activation scale is traced at, in the order tried: 32 and 64, then 8 and 16, then
// 2 and 4 (memory_model.cpp says why); TRIACCEL_SCALE_TRACE="S,L" (measurement only, docs/measuring.md) gives one pair.
std::vector<std::pair<int64_t, int64_t>> scale_trace_batches();

// The starting activation scale from whole-model peaks: for each pair in order, peak_of (the allocator's peak over one
// forward + backward at that many samples, in bytes; it may throw c10::OutOfMemoryError) at both batches, twice (the
// first pass lets cuDNN settle), the slope over `modelled_per_sample` bytes, within [kMeasuredScaleMin,
// kMeasuredScaleMax]. A pair that runs out of memory calls `release` and the next is tried; a slope of zero or less,
// or every pair out of memory, leaves the scale at 1.
double activation_scale_from_traces(const std::vector<std::pair<int64_t, int64_t>>& pairs,
                                    const std::function<double(int64_t)>& peak_of, double modelled_per_sample,
                                    const std::function<void()>& release);

// Per-micro-batch overhead of a step, in units of one sample's forward + backward: what makes small micro-batches
// slow on a GPU (launches, an under-filled device). ResNet-18's (32×32) throughput at batch 96 and at 512 gives an
// overhead of ~100 samples (docs/results/memory-planner.md); 64 keeps some weight on recompute.
constexpr double kGpuOverheadSamples = 64;
// A small kernel's launch inside a captured step, in seconds (the update in backward's price per launch).
constexpr double kGpuLaunchS = 2.5e-6;
// The host gather and copy of one streamed sample, in the same unit.
constexpr double kStreamSampleCost = 0.05;
// Batch-independent device memory the shapes do not show: cuBLAS and cuDNN workspaces, the CUDA context's share
// of the caching allocator, the graph pool's rounding.
constexpr double kGpuFixedTransientBytes = 48e6;
// The same under a vram_budget, where cuBLAS's workspace is one 4 MiB chunk a stream (core/device.h): priced at
// kGpuFixedTransientBytes there, the calibration's fitted offset comes out tens of MB negative, down to kOffsetMin,
// and the line through the readings pays for the difference with its slope instead (docs/results/memory-planner.md).
constexpr double kGpuFixedTransientBytesBudgeted = 12e6;

// The loss scaler's state (train/loss_scaler.h: seven one-element tensors, each a 512-byte block of the caching
// allocator), held in every precision mode (amp-fp16 scales; the others detect non-finite gradients with it).
constexpr double kLossScalerBytes = 7 * 512;

// `sample`: one input sample (C, H, W) float or (T) int64, on the model's device.
MemoryModel memory_model_build(Model& model, const at::Tensor& sample, const MemoryModelInputs& inputs,
                               const c10::Device& device);

// Data parallelism: every rank's model made the same, each number the largest any rank measured (a unit that cannot
// be recomputed on one rank is not recomputed on any; host data only where every rank allows it). `max_over_ranks`
// (Dist::all_reduce_max) takes the same count of numbers on every rank: the ranks trace the same model.
void memory_model_agree(MemoryModel& model,
                        const std::function<std::vector<double>(std::vector<double>)>& max_over_ranks);

// Bytes per sample an evaluation pass needs (no autograd: the largest unit input and output alive at once).
double memory_model_eval_per_sample(const MemoryModel& model);

// The largest evaluation batch (at most `asked`) that fits beside what the caching allocator holds. `held_bytes`
// (everything reserved, the CUDA graph's pool included) counts as taken: the pool's free blocks were cut for the
// training step's tensors, so an evaluation batch larger than the step's `micro_batch` needs new segments
// (room = cap − held, at eval_per_sample each). Up to `micro_batch` samples it fits in the blocks the step's own
// forward used, whatever the room. At least 1.
int64_t memory_model_eval_batch(const MemoryModel& model, int64_t cap_bytes, int64_t held_bytes, int64_t micro_batch,
                                int64_t asked);

}  // namespace triaccel
