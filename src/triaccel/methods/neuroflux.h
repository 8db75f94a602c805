// NeuroFlux (method neuroflux; docs/neuroflux.md): memory-bounded CNN training by adaptive local learning. On a
// Session: profile the units' memory, partition them into blocks under the budget (control/memory/partitioner.h), then
// train block after block — every unit with its own auxiliary head and a detached input, each block at its own batch
// size, its steps through the same StepGraph as the trainer's (train/step_graph.h) — reading the block's input from the
// activation cache written by the previous block; evaluate every exit on held-out data; export the full model and the
// prefix up to the chosen exit. Output folder (OUT = the `out` option): events.jsonl (config, block_plan, block…, exit,
// summary), checkpoint.pt (after every block, and inside one when checkpoint_every, checkpoint_minutes or a stop
// request asks), model.pt (the full network), exit_model.pt + exit.json (the early-exit model).
#pragma once

#include "triaccel/core/json.h"
#include "triaccel/models/aux_head.h"
#include "triaccel/models/model.h"
#include "triaccel/run/session.h"

#include <cstdint>
#include <vector>

namespace triaccel {

constexpr const char* kExitModelFile = "exit_model.pt";
constexpr const char* kExitJsonFile = "exit.json";

// Trains with NeuroFlux; returns the summary event's fields (the stop event's when stopped by max_steps, checked at
// block boundaries, or by a stop request, after the step in flight). UserError for bad input (e.g. a budget below
// the minimum the model needs).
Json neuroflux_train(Session& session);

// One training step's loss for block [first, end): every unit runs on its predecessor's *detached* output (no
// gradient crosses a unit boundary) and is scored by its own head (heads[u]; the last unit of the model is its own
// classifier); the local cross-entropies are summed. When loss_sum / correct ((end - first) float32 on the device)
// are given, each unit's summed per-sample loss and correct predictions are added to them.
at::Tensor neuroflux_block_loss(const Model& model, const std::vector<AuxHead>& heads, int64_t first, int64_t end,
                                const at::Tensor& x, const at::Tensor& y, double label_smoothing,
                                at::Tensor* loss_sum = nullptr, at::Tensor* correct = nullptr);

// The bytes one training step of block [first, end) needs beyond its input batch: one forward (neuroflux_block_loss)
// and one backward on a zero batch of `rows` samples of one sample's shape `in_shape` under `precision`, without an
// update; the allocator's peak above what was allocated before (the batch among it), less the block's parameter
// gradients (the partitioner's block_replan_measured takes it). -1 when it ran out of memory. Leaves the weights,
// BatchNorm's running statistics and the gradients (none) as it found them; raises *peak_gb to the absolute peak.
// Meaningful on CUDA only (no allocator readings elsewhere: 0).
double neuroflux_block_step_bytes(const Model& model, const std::vector<AuxHead>& heads, int64_t first, int64_t end,
                                  const std::vector<int64_t>& in_shape, int64_t rows, bool channels_last,
                                  PrecisionMode precision, double label_smoothing, const c10::Device& device,
                                  double* peak_gb = nullptr);

// The exported exit: the fewest parameters among the exits whose held-out accuracy is within `tolerance` points
// of the last exit's (the full network's). Exits in unit order; returns an index.
int64_t exit_choose(const std::vector<double>& holdout_acc, const std::vector<int64_t>& params, double tolerance);

// One shape per block: a new batch size costs cuDNN plan building in every convolution of the block (seconds per
// block on EfficientNet-B0 with heuristics), so short batches are widened to the planned one.
// A training step at rows [offset, offset + count) of an epoch of n rows, at `batch` (planned: `planned`): how many
// of the epoch's first rows fill it up to the planned batch (0 unless it is the short last one at the planned batch).
int64_t epoch_fill(int64_t offset, int64_t count, int64_t n, int64_t batch, int64_t planned);
// A cache-pass batch of `count` rows at `offset` of a split's rows before n (the split's size, or the end of this
// rank's share of it), at batch `batch`: the rows that run are [offset - skip, offset + count) — the short last
// batch becomes the window of `batch` rows ending at n — and only [offset, offset + count) are scored and written.
int64_t pass_skip(int64_t offset, int64_t count, int64_t n, int64_t batch);

}  // namespace triaccel
