// The memory planner (docs/memory-planner.md): one budget over every consumer of GPU memory, and the fastest way to
// train the requested batch inside it. A pure function of a cost model: no tensors, no device, testable on made-up
// profiles.
//
// The cost model (MemoryModel) prices each consumer in bytes and each lever in seconds, per unit where it is per unit:
//   peak(m, R, placement) = weights + gradients(U) + optimizer state + fixed transients
//                         + data(placement) + the step's input buffers (B samples)
//                         + m · scale · (activations(R) + transient)
//   activations(R, F) = max( Σ_v alive_v,                                    backward's start
//                            max_{u∈R} [ Σ_{v<u} alive_v + input_u + saved_u ],    a recomputed unit's backward
//                            max_{u∈F∖R} [ Σ_{v≤u} alive_v + unpack_u ] )          an FP8 unit's backward
// with B the requested batch, m the micro-batch (B = accumulation steps × m, the last micro-batch shorter when m does
// not divide B), R the recomputed units, F the units whose saved activations are stored in FP8 (train/fp8_saved.h),
// saved_u the activations unit u keeps for backward per sample, fp8_u the same stored in FP8, input_u its input (what
// a recomputed unit keeps instead), alive_v what unit v holds (input_v when recomputed, else fp8_v when in F, else
// saved_v), unpack_u the largest tensor unit u stored in FP8 at its own dtype (backward dequantizes one at a time):
// backward frees the units after u before it recomputes u. `scale` is the correction learned from the
// allocator's readings (1 until measured). U: the update in backward (train/step.h; one micro-batch only), under
// which the gradients alive at once are update_in_backward_grads_bytes instead of every parameter's.
//   step_s(m, R, F, U, placement) = k · overhead_s + B · (per_sample_s · (1 + recompute_share) + Σ_{u∈F∖R} fp8_s_u)
//                                   + stream cost + (U ? update_in_backward_s : 0)
// with k = ceil(B / m) micro-batches, recompute_share the recomputed units' share of the forward FLOPs times the
// forward's share of a training step, and fp8_s_u the price of one quantize pass in forward and one dequantize pass
// in backward over what unit u stores (memory-bound: its bytes at kGpuMemoryBytesPerS, in the same time unit).
//
//   epoch_s = (Σ over the epoch's steps of step_s, a short last step at its own size
//              + forward_share · (ceil(E / m) · overhead_s + E · per_sample_s))   the evaluation of E samples
//             × seconds per unit of the model's time (memory_model_seconds_per_unit: Σ_u flops_u / forward_share
//               FLOPs at kGpuTrainFlopsPerS), the basis NeuroFlux's blocks are priced on too (partitioner.h).
//
// The levers: the micro-batch (any m in [1, B]), each unit's saved activations (kept, stored in FP8 or recomputed),
// the update in backward (at m = B), and the dataset resident on the GPU or streamed from pinned host memory. The solver is exact over that space (up
// to a rounding that only errs towards fitting): for every placement and micro-batch it finds the per-unit choice of
// least time whose peak fits, by dynamic programming over the units in order with the bytes alive so far as the
// state, and returns the fastest plan.
#pragma once

#include "triaccel/core/json.h"
#include "triaccel/data/loader.h"  // DataPlacement

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace triaccel {

// One unit's costs per training sample.
struct UnitCost {
  std::string name;
  double saved_bytes = 0;   // activations kept for backward, at the precision the unit runs in
  double input_bytes = 0;   // the unit's input (kept instead when the unit is recomputed)
  double flops = 0;         // forward FLOPs (the recompute's price, relative to the other units)
  bool recomputable = true; // false: its forward is not repeatable (dropout, stochastic depth)
  double fp8_bytes = 0;     // its saved activations stored in FP8 (0: not offered here, or nothing it saves would be)
  double fp8_s = 0;         // the FP8 storage's price per sample, in per_sample_s's unit
  double fp8_unpack_bytes = 0;  // its largest stored tensor at its own dtype: made again when backward reads it
  // The allocator's peak over the unit's forward and a backward from its output's gradient, above its input (0: not
  // read, off CUDA): what a recomputed unit holds while backward runs it, its transients included.
  double backward_bytes = 0;
};

// A unit's saved activations in a plan.
enum class UnitStore { kKeep, kFp8, kRecompute };

struct MemoryModel {
  std::vector<UnitCost> units;
  // Batch-independent bytes.
  double weights_bytes = 0;      // fp32 parameters
  double grads_bytes = 0;        // fp32 gradients
  double optimizer_bytes = 0;    // optimizer state
  double fixed_bytes = 0;        // weight casts, scaler, metrics, workspaces, allocator slack
  double dataset_bytes = 0;      // the training and test sets resident on the GPU (kDevice)
  double stream_bytes = 0;       // kHost: what stays on the GPU (order, augmentation draws, test set)
  // Per sample of the requested batch (the step's static inputs exist at the full batch).
  double batch_input_bytes = 0;  // the float input and labels of one sample, plus its uint8 staging when streamed
  // Per sample of the micro-batch, besides the units' saved activations.
  double transient_bytes = 0;    // backward's largest transients (a gradient and the one it produces)
  // How the units' saved bytes were read. true (the allocator's growth over each forward, on CUDA): a kept or
  // FP8-stored unit's bytes hold its output, which the next unit reads; a recomputed unit's output is held by its
  // reader, so a unit counts its input only after a recomputed unit (memory_planner.cpp: alive_bytes). false (the
  // autograd graph's records, elsewhere): a unit's records hold what its own backward saves, and a recomputed unit
  // holds its input.
  bool outputs_in_saved = false;
  double activation_scale = 1;   // measured / modelled activations (the allocator's correction)
  // Time.
  double overhead_s = 0;         // per micro-batch, whatever its size (launches, an under-filled GPU)
  double per_sample_s = 1e-6;    // forward + backward of one sample
  double stream_per_sample_s = 0;  // host gather and copy of one sample (kHost)
  double forward_share = 1.0 / 3;  // the forward's share of a training step's time (what a recompute repeats)
  bool allow_host_data = true;   // false: the dataset must stay resident (a loader that cannot stream)
  // The update in backward (train/step.h): the gradients alive at once under it (0: not offered to this run), and
  // its price per step (its per-tensor launches), in per_sample_s's unit.
  double update_in_backward_grads_bytes = 0;
  double update_in_backward_s = 0;
};

struct MemoryPlan {
  bool feasible = false;
  int64_t batch = 0;                 // the requested batch (unchanged by the plan)
  int64_t micro_batch = 0;
  int64_t accumulation = 0;          // micro-batches per optimizer step
  std::vector<bool> recompute;       // per unit
  std::vector<bool> fp8_saved;       // per unit: its saved activations stored in FP8 (never with recompute)
  DataPlacement data_placement = DataPlacement::kDevice;
  bool update_in_backward = false;   // each parameter updated in backward (accumulation 1)
  double predicted_peak_bytes = 0;
  double predicted_step_s = 0;
  int64_t budget_bytes = 0;          // what the plan may reach (0: no limit); JSON: plan_limit_bytes
  double floor_bytes = 0;            // the least peak any plan reaches (micro-batch 1, every unit recomputed, streamed)

  std::vector<std::string> recompute_names(const MemoryModel& model) const;
  std::vector<std::string> fp8_saved_names(const MemoryModel& model) const;
  Json to_json(const MemoryModel& model) const;
  bool operator==(const MemoryPlan& o) const;
};

// The predicted peak and step time of one combination of levers (`fp8_saved` empty: nothing in FP8; a unit in
// `recompute` is recomputed whatever its flag there; `update_in_backward` where the model offers it).
double memory_plan_peak(const MemoryModel& model, int64_t batch, int64_t micro_batch,
                        const std::vector<bool>& recompute, DataPlacement placement,
                        const std::vector<bool>& fp8_saved = {}, bool update_in_backward = false);
double memory_plan_step_s(const MemoryModel& model, int64_t batch, int64_t micro_batch,
                          const std::vector<bool>& recompute, DataPlacement placement,
                          const std::vector<bool>& fp8_saved = {}, bool update_in_backward = false);
// The same at a plan's levers.
double memory_plan_peak(const MemoryModel& model, const MemoryPlan& plan);

// The seconds both methods' predictions are in (method auto compares them): a sample's forward + backward is its
// forward FLOPs (Σ_u flops_u, 2 · parameters · output positions) over forward_share, run at kGpuTrainFlopsPerS, an
// effective rate assumed for a GPU training in 16 bits (convolutions at small images: well below the peak). The
// comparison depends on the ratio of the two predictions only, not on this rate.
constexpr double kGpuTrainFlopsPerS = 1e14;
// The rate FP8 storage's quantize and dequantize passes are priced at, in the same seconds: the bytes they read and
// write (2 · (the stored tensors at their dtype + their FP8 bytes and scales)) over the step time they added when
// measured on an H200, ResNet-18 b96 with every unit stored so (docs/results/memory-planner.md): far below the
// HBM's 4.8 TB/s (the passes, their allocations and a dequantize per node that reads a tensor).
constexpr double kGpuMemoryBytesPerS = 0.85e12;

// The samples of one epoch (per process): the training steps' and the evaluation's.
struct EpochSamples {
  int64_t train = 0;
  int64_t eval = 0;
};

// Seconds one unit of the model's time (per_sample_s: one sample's forward + backward) stands for at `flops_per_s`.
double memory_model_seconds_per_unit(const MemoryModel& model, double flops_per_s = kGpuTrainFlopsPerS);
// The plan's predicted seconds per epoch: every step of the epoch at the plan's levers (memory_plan_step_s: the
// micro-batches' overhead and the recompute included; a short last step at its own size), then the evaluation pass
// over samples.eval at the micro-batch (forward_share of a step per sample and per batch), at `flops_per_s`.
double memory_plan_epoch_s(const MemoryModel& model, const MemoryPlan& plan, const EpochSamples& samples,
                           double flops_per_s = kGpuTrainFlopsPerS);

// Levers the user fixed (the micro_batch, recompute and data_placement options): the search keeps them.
struct PlanConstraints {
  int64_t micro_batch = 0;           // > 0: only this micro-batch (at most the batch)
  std::vector<bool> recompute;       // non-empty: exactly this recompute set
  std::vector<bool> fp8_saved;       // non-empty: these units in FP8 where offered and not recomputed, no others
  bool placement_fixed = false;      // true: only `placement`
  DataPlacement placement = DataPlacement::kDevice;
  // The update_in_backward option: unset, the solver's choice where the model offers it; true, always (the whole
  // batch in one micro-batch); false, never.
  std::optional<bool> update_in_backward;
};

// The fastest plan for `batch` whose predicted peak is at most `budget_bytes` (0: no budget — the whole batch at
// once, nothing recomputed, data resident, unless constrained otherwise). floor_bytes is set either way.
MemoryPlan memory_plan_solve(const MemoryModel& model, int64_t batch, int64_t budget_bytes,
                             const PlanConstraints& constraints = {});

}  // namespace triaccel
