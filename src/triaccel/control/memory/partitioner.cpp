// NeuroFlux partitioner; see partitioner.h.
#include "triaccel/control/memory/partitioner.h"

#include "triaccel/core/bytes.h"
#include "triaccel/core/errors.h"
#include "triaccel/models/aux_head.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace triaccel {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kForwardShare = 1.0 / 3.0;  // a forward pass is about a third of a training step's work
// The block's input batch while a step runs, in fp32 copies: the batch read from the cache (fp32), its copy in the CUDA
// graph's static input and the bf16 staging rows the read came through (released when the step's stream passes them).
constexpr double kInputCopies = 2.5;

struct BlockCost {
  double held = 0;   // base + the other units' and heads' weights: allocated before the block starts
  double own = 0;    // the block's weights, gradients and momenta, its units' and heads' fixed bytes
  double weights = 0;  // of `own`: the block's weights (allocated before it starts too)
  double activations_fixed = 0;  // of `own`: the units' and heads' batch-independent bytes (the profile's fixed)
  double per_sample = 0;
  double input_per_sample = 0;  // of `per_sample`: the input batch's copies and the output's cache rows
  double work = 0;  // per-sample bytes of the block's units in one training step (heads excluded: see partitioner.h)
  double fixed() const { return held + own; }
};

double widest_head_params(const UnitProfile& up) {
  double most = 0;
  for (int64_t h : up.head_params) most = std::max(most, static_cast<double>(h));
  return most;
}

BlockCost block_cost(const MemoryProfile& p, const PartitionOptions& o, int64_t first, int64_t end, int64_t level) {
  BlockCost c;
  c.held = o.base_bytes;
  for (int64_t u = 0; u < static_cast<int64_t>(p.units.size()); ++u) {
    if (u >= first && u < end) continue;
    const UnitProfile& up = p.units[static_cast<size_t>(u)];
    c.held += 4 * (static_cast<double>(up.params) + widest_head_params(up));
  }
  for (int64_t u = first; u < end; ++u) {
    const UnitProfile& up = p.units[static_cast<size_t>(u)];
    double params = static_cast<double>(up.params);
    c.activations_fixed += up.train.fixed_bytes;
    c.per_sample += up.train.per_sample_bytes;
    c.work += up.train.per_sample_bytes;
    if (!up.head_train.empty()) {
      const auto l = static_cast<size_t>(level);
      params += static_cast<double>(up.head_params[l]);
      c.activations_fixed += up.head_train[l].fixed_bytes;
      c.per_sample += up.head_train[l].per_sample_bytes;
    }
    c.own += 3 * 4 * params;
    c.weights += 4 * params;
  }
  c.own += c.activations_fixed;
  c.input_per_sample = kInputCopies * static_cast<double>(p.units[static_cast<size_t>(first)].in_bytes) +
                       0.5 * static_cast<double>(p.units[static_cast<size_t>(end - 1)].out_bytes);
  c.per_sample += c.input_per_sample;
  return c;
}

// The largest batch with fixed + B · per_sample under safety × budget, capped at max_batch (and the epoch), rounded
// down to a multiple of 8 from 16 up; 0 below min_batch.
int64_t batch_in_room(double fixed, double per_sample, const PartitionOptions& o) {
  const double room = o.safety * o.budget_bytes - fixed;
  if (room <= 0 || per_sample <= 0) return 0;
  double b = std::floor(room / per_sample);
  b = std::min(b, static_cast<double>(std::min(o.max_batch, std::max<int64_t>(o.samples, o.min_batch))));
  auto batch = static_cast<int64_t>(b);
  if (batch >= 16) batch -= batch % 8;
  return batch >= o.min_batch ? batch : 0;
}

int64_t batch_that_fits(const BlockCost& c, const PartitionOptions& o) {
  return batch_in_room(c.fixed(), c.per_sample, o);
}

// Output positions of one sample: H·W of a (C, H, W) map, 1 of a vector.
double out_positions(const std::vector<int64_t>& shape) {
  return shape.size() >= 3 ? static_cast<double>(shape[shape.size() - 2] * shape.back()) : 1.0;
}

// Forward FLOPs of one sample through unit u and, when it has one, its head at `level`.
double unit_head_flops(const UnitProfile& up, int64_t level) {
  const double positions = out_positions(up.out_shape);
  double flops = 2.0 * static_cast<double>(up.params) * positions;
  if (up.head_params.empty()) return flops;
  const int64_t channels = up.out_shape.empty() ? 0 : up.out_shape[0];
  const int64_t k = up.out_shape.size() >= 3 ? aux_filters(channels, level) : 0;
  const double conv = 9.0 * static_cast<double>(channels * k);
  const double rest = std::max(0.0, static_cast<double>(up.head_params[static_cast<size_t>(level)]) - conv);
  return flops + 2.0 * conv * positions + 2.0 * rest;  // the conv at every position; BN and the linear once
}

}  // namespace

void PartitionOptions::validate() const {
  TORCH_CHECK(budget_bytes > 0, "partition budget must be > 0, got ", budget_bytes);
  TORCH_CHECK(safety > 0 && safety <= 1, "partition safety must be in (0, 1], got ", safety);
  TORCH_CHECK(samples > 0 && epochs > 0 && max_batch >= min_batch && min_batch > 0, "bad partition options");
  TORCH_CHECK(bytes_per_s > 0 && sat_batch >= 0 && host_bytes_per_s >= 0, "bad partition time model");
}

BlockPlan block_plan(const MemoryProfile& p, const PartitionOptions& o, int64_t first, int64_t end) {
  BlockPlan best;
  best.first = first;
  best.end = end;
  const bool has_heads = !p.units[static_cast<size_t>(first)].head_train.empty();
  const int64_t levels = has_heads ? kAuxLevels : 1;
  BlockCost cost;
  for (int64_t level = 0; level < levels; ++level) {
    // The widest level that reaches the target batch; failing that, the narrowest (it needs the least memory).
    cost = block_cost(p, o, first, end, level);
    best.batch = batch_that_fits(cost, o);
    best.head_level = level;
    if (best.batch >= o.target_batch) break;
  }
  if (best.batch == 0) return best;
  best.bytes = cost.fixed() + cost.per_sample * static_cast<double>(best.batch);
  const auto n = static_cast<double>(o.samples);
  const double step_work = n * cost.work / o.bytes_per_s;
  best.time_s = static_cast<double>(o.epochs) * step_work * (1 + o.sat_batch / static_cast<double>(best.batch));
  if (first > 0) {
    const UnitProfile& prev = p.units[static_cast<size_t>(first - 1)];
    best.time_s += n * prev.train.per_sample_bytes * kForwardShare / o.bytes_per_s;  // writing the cache
    if (o.host_bytes_per_s > 0) {
      best.time_s += static_cast<double>(o.epochs) * n * 0.5 * static_cast<double>(prev.out_bytes) / o.host_bytes_per_s;
    }
  }
  return best;
}

Partition partition_plan(const MemoryProfile& p, const PartitionOptions& o) {
  o.validate();
  const auto n = static_cast<int64_t>(p.units.size());
  TORCH_CHECK(n > 0, "partition_plan: the profile has no units");
  // best[j]: the fastest partition of units [0, j); from[j]: where its last block starts.
  std::vector<double> best(static_cast<size_t>(n + 1), kInf);
  std::vector<int64_t> from(static_cast<size_t>(n + 1), -1);
  std::vector<std::vector<BlockPlan>> plans(static_cast<size_t>(n + 1), std::vector<BlockPlan>(static_cast<size_t>(n + 1)));
  best[0] = 0;
  for (int64_t j = 1; j <= n; ++j) {
    for (int64_t i = 0; i < j; ++i) {
      if (best[static_cast<size_t>(i)] == kInf) continue;
      const BlockPlan bp = block_plan(p, o, i, j);
      if (bp.batch == 0) continue;
      plans[static_cast<size_t>(i)][static_cast<size_t>(j)] = bp;
      const double t = best[static_cast<size_t>(i)] + bp.time_s;
      if (t < best[static_cast<size_t>(j)]) {
        best[static_cast<size_t>(j)] = t;
        from[static_cast<size_t>(j)] = i;
      }
    }
  }
  if (best[static_cast<size_t>(n)] == kInf) {
    throw UserError(c10::str(option_ref("vram_budget") + " ", bytes_format(o.budget_bytes), " is below what NeuroFlux needs for this model: at least ",
                             bytes_format(partition_min_budget(p, o)), " (one unit per block at batch ", o.min_batch,
                             ", smallest heads)"));
  }
  Partition out;
  out.time_s = best[static_cast<size_t>(n)];
  for (int64_t j = n; j > 0; j = from[static_cast<size_t>(j)]) {
    out.blocks.push_back(plans[static_cast<size_t>(from[static_cast<size_t>(j)])][static_cast<size_t>(j)]);
  }
  std::reverse(out.blocks.begin(), out.blocks.end());
  return out;
}

double partition_min_budget(const MemoryProfile& p, const PartitionOptions& o) {
  // Exact: the partition whose largest block need (at min_batch, cheapest head level) is smallest, by DP.
  const auto n = static_cast<int64_t>(p.units.size());
  std::vector<double> need(static_cast<size_t>(n + 1), kInf);
  need[0] = 0;
  for (int64_t j = 1; j <= n; ++j) {
    for (int64_t i = 0; i < j; ++i) {
      const bool has_heads = !p.units[static_cast<size_t>(i)].head_train.empty();
      double block_need = kInf;
      for (int64_t level = 0; level < (has_heads ? kAuxLevels : 1); ++level) {
        const BlockCost c = block_cost(p, o, i, j, level);
        block_need = std::min(block_need, c.fixed() + c.per_sample * static_cast<double>(o.min_batch));
      }
      need[static_cast<size_t>(j)] = std::min(need[static_cast<size_t>(j)], std::max(need[static_cast<size_t>(i)], block_need));
    }
  }
  return need[static_cast<size_t>(n)] / o.safety;
}

double block_own_fixed_bytes(const MemoryProfile& p, const PartitionOptions& o, const BlockPlan& block) {
  const BlockCost c = block_cost(p, o, block.first, block.end, block.head_level);
  return c.own - c.weights;
}

BlockPlan block_replan_for_held(const MemoryProfile& p, const PartitionOptions& o, const BlockPlan& block,
                                double held_bytes) {
  const BlockCost c = block_cost(p, o, block.first, block.end, block.head_level);
  const double fixed = held_bytes + c.own - c.weights;
  BlockPlan out = block;
  out.batch = std::min(block.batch, batch_in_room(fixed, c.per_sample, o));
  out.bytes = fixed + c.per_sample * static_cast<double>(out.batch);
  return out;
}

BlockPlan block_replan_measured(const MemoryProfile& p, const PartitionOptions& o, const BlockPlan& block,
                                double held_bytes, double body_bytes, int64_t rows, int64_t world) {
  TORCH_CHECK(rows > 0 && world > 0, "block_replan_measured: rows and world must be > 0");
  const BlockCost c = block_cost(p, o, block.first, block.end, block.head_level);
  const double fixed = held_bytes + c.own - c.weights;
  const double body = std::max(0.0, body_bytes - c.activations_fixed) / static_cast<double>(rows * world);
  const double in = static_cast<double>(p.units[static_cast<size_t>(block.first)].in_bytes);
  BlockPlan out = block;
  out.batch = std::min(block.batch, batch_in_room(fixed, body + c.input_per_sample, o));
  out.bytes = fixed + static_cast<double>(out.batch) * (in + std::max(body, kInputCopies * in));
  return out;
}

void partition_epoch_s(const MemoryProfile& p, const PartitionEpochInputs& in, Partition* partition) {
  TORCH_CHECK(in.flops_per_s > 0 && in.epochs > 0, "partition_epoch_s: bad inputs");
  const auto steps = [](int64_t rows, int64_t batch) { return static_cast<double>((rows + batch - 1) / batch); };
  const auto n_blocks = partition->blocks.size();
  const double epochs = static_cast<double>(in.epochs);
  partition->epoch_s = 0;
  for (size_t b = 0; b < n_blocks; ++b) {
    BlockPlan& bp = partition->blocks[b];
    double w = 0;
    for (int64_t u = bp.first; u < bp.end; ++u) w += unit_head_flops(p.units[static_cast<size_t>(u)], bp.head_level);
    const double per_step = (static_cast<double>(bp.batch) + in.overhead_samples) * w / in.flops_per_s;
    const bool last = b + 1 == n_blocks;
    const int64_t pass_rows = in.holdout_samples + in.test_samples + (last ? 0 : in.train_samples);
    double s = steps(in.train_samples, bp.batch) * 3 * per_step + steps(pass_rows, bp.batch) * per_step / epochs;
    if (in.host_bytes_per_s > 0) {
      const double in_b = bp.first > 0 ? 0.5 * static_cast<double>(p.units[static_cast<size_t>(bp.first)].in_bytes) : 0;
      const double out_b = last ? 0 : 0.5 * static_cast<double>(p.units[static_cast<size_t>(bp.end - 1)].out_bytes);
      s += (static_cast<double>(in.train_samples) * in_b + static_cast<double>(pass_rows) * out_b / epochs) /
           in.host_bytes_per_s;
    }
    bp.epoch_s = s;
    partition->epoch_s += s;
  }
}

double NeuroFluxData::resident_bytes() const {
  const double rows = static_cast<double>(train + holdout + test);
  if (host) return 16 * rows + 2.0 * static_cast<double>(max_batch * sample_elements) * 3;
  return rows * (static_cast<double>(sample_elements) + 16);
}

NeuroFluxData neuroflux_data(int64_t train_rows, int64_t test_rows, int64_t sample_elements, int64_t holdout_asked,
                             int64_t max_batch, double budget_bytes, bool gpu) {
  NeuroFluxData d;
  d.holdout = std::min(holdout_asked, train_rows / 10);
  d.train = train_rows - d.holdout;
  d.test = test_rows;
  d.sample_elements = sample_elements;
  d.max_batch = max_batch;
  const double images = static_cast<double>((train_rows + test_rows) * sample_elements);
  d.host = gpu && budget_bytes > 0 && images > kNeuroFluxHostDataShare * budget_bytes;
  return d;
}

int64_t oom_retry_batch(int64_t batch, double fixed_bytes, const PartitionOptions& o) {
  const double room = o.budget_bytes - fixed_bytes;
  if (batch <= o.min_batch || room <= 0) return 0;
  PartitionOptions at_most = o;
  at_most.max_batch = batch - 1;
  return batch_in_room(fixed_bytes, room / static_cast<double>(batch), at_most);
}

}  // namespace triaccel
