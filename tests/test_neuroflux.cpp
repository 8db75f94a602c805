// NeuroFlux on the CPU: the memory model against hand-computed bytes, the partitioner against brute force, gradient
// isolation of local learning, and the runner end to end (blocks from the cache, exits, export, resume).
#include "test_util.h"
#include "triaccel/core/device.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/host_workers.h"
#include "triaccel/core/io.h"
#include "triaccel/methods/activation_cache.h"
#include "triaccel/models/aux_head.h"
#include "triaccel/control/memory/memory_profile.h"
#include "triaccel/methods/neuroflux.h"
#include "triaccel/run/config.h"
#include "triaccel/control/memory/partitioner.h"
#include "triaccel/train/checkpoint.h"
#include "triaccel/models/model.h"
#include "triaccel/core/events.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#ifdef TRIACCEL_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Sleep.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

namespace triaccel {
namespace {

constexpr double kF32 = 4;

std::shared_ptr<Model> small_cnn(int64_t in_channels = 1) {
  torch::manual_seed(0);
  ModelOptions mo;
  mo.name = "small-cnn";
  mo.in_channels = in_channels;
  mo.image_size = 28;
  return model_create(mo);
}

TEST(MemoryProfileTest, GraphBytesOfOneConvAreItsOutput) {
  torch::manual_seed(0);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(3, 8, 3).padding(1).bias(false));
  const at::Tensor out = conv(at::zeros({2, 3, 4, 4}));
  double largest = 0;
  // One autograd node (the convolution) whose output is (2, 8, 4, 4) float32; the weight's accumulator is skipped.
  EXPECT_DOUBLE_EQ(autograd_graph_bytes(out, &largest), 2 * 8 * 4 * 4 * kF32);
  EXPECT_DOUBLE_EQ(largest, 2 * 8 * 4 * 4 * kF32);
  EXPECT_DOUBLE_EQ(autograd_graph_bytes(out.detach()), 0);
}

TEST(MemoryProfileTest, SmallCnnUnitsMatchHandComputedBytes) {
  auto model = small_cnn();
  const at::Tensor mean_before = model->named_buffers()["block1.1.running_mean"].clone();
  const MemoryProfile p = memory_profile(*model, {1, 28, 28}, 10, ProfileSource::kModel, c10::Device(c10::kCPU));
  ASSERT_EQ(p.units.size(), 4u);
  // block1: conv 1→32 stride 2 → (32, 14, 14); conv, BN and ReLU each record one such tensor per sample.
  const double block1_out = 32 * 14 * 14 * kF32;  // 25,088 bytes
  EXPECT_EQ(p.units[0].out_shape, (std::vector<int64_t>{32, 14, 14}));
  EXPECT_EQ(p.units[0].out_bytes, 25088);
  EXPECT_EQ(p.units[0].in_bytes, 28 * 28 * 4);
  EXPECT_DOUBLE_EQ(p.units[0].backprop_per_sample, 3 * block1_out);
  EXPECT_DOUBLE_EQ(p.units[0].train.per_sample_bytes, 3 * block1_out + 2 * block1_out);  // + backward transients
  // block2: 32→64 stride 2 → (64, 7, 7) = 12,544 bytes per tensor.
  EXPECT_DOUBLE_EQ(p.units[1].backprop_per_sample, 3 * 64 * 7 * 7 * kF32);
  EXPECT_EQ(p.units[0].params, 32 * 9 + 64);
  // Heads: level 0 = 32 filters (conv 32·32·9 + BN 64 + fc 32·4·10 + 10), level 3 = no conv (fc 32·4·10 + 10).
  ASSERT_EQ(p.units[0].head_params.size(), static_cast<size_t>(kAuxLevels));
  EXPECT_EQ(p.units[0].head_params[0], 32 * 32 * 9 + 64 + 32 * 4 * 10 + 10);
  EXPECT_EQ(p.units[0].head_params[1], 32 * 16 * 9 + 32 + 16 * 4 * 10 + 10);
  EXPECT_EQ(p.units[0].head_params[3], 32 * 4 * 10 + 10);
  EXPECT_TRUE(p.units[3].head_params.empty());  // the classifier has no head
  // Fewer filters, less memory per sample.
  for (int64_t l = 1; l < kAuxLevels; ++l) {
    EXPECT_LT(p.units[0].head_train[l].per_sample_bytes, p.units[0].head_train[l - 1].per_sample_bytes);
  }
  // Backprop keeps every unit's graph: more per sample than any single unit's training.
  double sum = 0;
  for (const auto& u : p.units) sum += u.backprop_per_sample;
  EXPECT_GE(p.backprop_per_sample, sum);
  EXPECT_GE(p.backprop_fixed_bytes, 3 * kF32 * static_cast<double>(model->parameter_count()));
  // Profiling left the BatchNorm statistics alone.
  EXPECT_TRUE(model->named_buffers()["block1.1.running_mean"].equal(mean_before));
  EXPECT_NEAR(static_cast<double>(p.backprop_max_batch(p.backprop_bytes(100) + 1)), 100, 0.5);
}

TEST(MemoryProfileCudaTest, MeasuredAgreesWithTheModelOnTheGpu) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  auto model = small_cnn();
  const c10::Device cuda(c10::kCUDA, 0);
  model->to(cuda);
  const MemoryProfile modelled = memory_profile(*model, {1, 28, 28}, 10, ProfileSource::kModel, cuda);
  const MemoryProfile measured = memory_profile(*model, {1, 28, 28}, 10, ProfileSource::kMeasured, cuda);
  ASSERT_EQ(measured.source, ProfileSource::kMeasured);
  for (size_t u = 0; u + 1 < measured.units.size(); ++u) {
    // The allocator's peak per sample is the same order as the traced graph (cuDNN may keep a little more or less).
    const double ratio = measured.units[u].train.per_sample_bytes / modelled.units[u].train.per_sample_bytes;
    EXPECT_GT(ratio, 0.4) << measured.units[u].name;
    EXPECT_LT(ratio, 2.5) << measured.units[u].name;
  }
  const double bp_ratio = measured.backprop_per_sample / modelled.backprop_per_sample;
  EXPECT_GT(bp_ratio, 0.4);
  EXPECT_LT(bp_ratio, 2.5);
}

// The measured footprint leaves out the unit's parameter gradients (the partitioner counts weights, gradients and
// momenta): ResNet-18's layer4.1 (4.7 M parameters, 18.9 MB of gradients, 4×4 activations) measured 23.6 MB fixed on
// the H100 when they were in, which planned its block 19 MB too high.
TEST(MemoryProfileCudaTest, MeasuredFixedBytesLeaveOutTheGradients) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  const c10::Device cuda(c10::kCUDA, 0);
  ModelOptions mo;
  mo.name = "resnet18";
  mo.in_channels = 3;
  mo.image_size = 32;
  mo.num_classes = 10;
  const auto model = model_create(mo);
  model->to(cuda);
  const MemoryProfile p = memory_profile(*model, {3, 32, 32}, 10, ProfileSource::kMeasured, cuda);
  const UnitProfile& u = p.units[8];
  ASSERT_EQ(u.name, "layer4.1");
  EXPECT_LT(u.train.fixed_bytes, 0.5 * kF32 * static_cast<double>(u.params)) << u.train.fixed_bytes;
}

// A made-up profile: units with given per-sample training bytes and parameter counts (heads cost 10 %, 5 %, ...).
MemoryProfile fake_profile(const std::vector<double>& per_sample, const std::vector<int64_t>& params) {
  MemoryProfile p;
  for (size_t u = 0; u < per_sample.size(); ++u) {
    UnitProfile up;
    up.name = "u" + std::to_string(u);
    up.params = params[u];
    up.in_bytes = static_cast<int64_t>(per_sample[u] / 4);
    up.out_bytes = static_cast<int64_t>(per_sample[u] / 4);
    up.out_shape = {8, 4, 4};
    up.train = Footprint{1000, per_sample[u]};
    if (u + 1 < per_sample.size()) {
      for (int64_t l = 0; l < kAuxLevels; ++l) {
        up.head_params.push_back(1000 >> l);
        up.head_train.push_back(Footprint{0, per_sample[u] * 0.4 / static_cast<double>(1 << l)});
      }
    }
    p.units.push_back(up);
  }
  return p;
}

// Every split into consecutive blocks, each block costed by block_plan: the exhaustive reference.
double brute_force_best(const MemoryProfile& p, const PartitionOptions& o, std::vector<int64_t>* best_batches) {
  const auto n = static_cast<int64_t>(p.units.size());
  double best = std::numeric_limits<double>::infinity();
  for (int64_t mask = 0; mask < (int64_t{1} << (n - 1)); ++mask) {  // bit i set: a split after unit i
    double t = 0;
    std::vector<int64_t> batches;
    int64_t first = 0;
    bool ok = true;
    for (int64_t i = 0; i < n && ok; ++i) {
      if (i == n - 1 || (mask >> i & 1)) {
        const BlockPlan bp = block_plan(p, o, first, i + 1);
        ok = bp.batch > 0;
        t += bp.time_s;
        batches.push_back(bp.batch);
        first = i + 1;
      }
    }
    if (ok && t < best) {
      best = t;
      *best_batches = batches;
    }
  }
  return best;
}

TEST(PartitionerTest, DynamicProgramMatchesBruteForce) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> bytes(2e4, 4e5);
  int feasible = 0, multi_block = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const int n = 2 + trial % 6;
    std::vector<double> ps;
    std::vector<int64_t> params;
    for (int u = 0; u < n; ++u) {
      ps.push_back(bytes(rng));
      params.push_back(static_cast<int64_t>(bytes(rng)) * 10);
    }
    const MemoryProfile p = fake_profile(ps, params);
    PartitionOptions o;
    o.budget_bytes = std::uniform_real_distribution<double>(3e7, 4e8)(rng);
    o.samples = 50000;
    o.epochs = 1 + trial % 3;
    o.max_batch = 1024;
    std::vector<int64_t> brute_batches;
    const double brute = brute_force_best(p, o, &brute_batches);
    if (std::isinf(brute)) {
      EXPECT_THROW(partition_plan(p, o), UserError);
      continue;
    }
    ++feasible;
    const Partition dp = partition_plan(p, o);
    EXPECT_NEAR(dp.time_s, brute, 1e-9 * brute) << "trial " << trial;
    double sum = 0;
    int64_t expect_first = 0;
    for (const auto& b : dp.blocks) {
      EXPECT_EQ(b.first, expect_first);
      expect_first = b.end;
      EXPECT_LE(b.bytes, o.safety * o.budget_bytes);
      EXPECT_GE(b.batch, o.min_batch);
      sum += b.time_s;
    }
    EXPECT_EQ(expect_first, n);
    EXPECT_NEAR(sum, dp.time_s, 1e-9 * sum);
    multi_block += dp.blocks.size() > 1;
  }
  EXPECT_GT(feasible, 20);
  EXPECT_GT(multi_block, 5);  // the cases exercise real splits, not just one block
}

TEST(PartitionerTest, BudgetBelowMinimumNamesTheMinimum) {
  const MemoryProfile p = fake_profile({4e5, 2e5, 1e5}, {100000, 200000, 5000});
  PartitionOptions o;
  o.samples = 1000;
  o.budget_bytes = 1e12;
  const double need = partition_min_budget(p, o);
  o.budget_bytes = need * 1.001;
  EXPECT_NO_THROW(partition_plan(p, o));
  o.budget_bytes = need * 0.99;
  try {
    partition_plan(p, o);
    FAIL() << "expected a UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("is below what NeuroFlux needs"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("at least"), std::string::npos) << e.what();
  }
}

TEST(PartitionerTest, TighterBudgetMeansSmallerBatchesAndFewerHeadFilters) {
  const MemoryProfile p = fake_profile({4e5, 3e5, 2e5, 1e4}, {50000, 100000, 200000, 5000});
  PartitionOptions o;
  o.samples = 50000;
  o.target_batch = 128;
  o.max_batch = 4096;
  int64_t prev_level = -1, prev_batch = std::numeric_limits<int64_t>::max();
  for (double budget : {4e8, 1.2e8, 1e8, 3e7, 1.5e7}) {
    o.budget_bytes = budget;
    const BlockPlan bp = block_plan(p, o, 0, 1);
    ASSERT_GT(bp.batch, 0) << budget;
    EXPECT_GE(bp.head_level, prev_level) << budget;
    EXPECT_LE(bp.batch, prev_batch) << budget;
    prev_level = bp.head_level;
    prev_batch = bp.batch;
  }
  EXPECT_GT(prev_level, 0);  // the tightest budget dropped filters
}

// Three units of 100 k, 200 k and 5 k parameters (heads of 1000 >> level), 0.2 GB, 3 MB of data held.
MemoryProfile three_unit_profile() { return fake_profile({4e5, 2e5, 1e5}, {100000, 200000, 5000}); }
PartitionOptions three_unit_options() {
  PartitionOptions o;
  o.samples = 50000;
  o.budget_bytes = 2e8;
  o.base_bytes = 3e6;
  return o;
}

// Every unit and head stays on the device while a block trains: a block's bytes count the other units' weights and
// their widest heads (an H100 run at 0.3 GB planned ResNet-18's layer1.0 without layer2..4's 44 MB and ran out of
// memory at its planned batch).
TEST(PartitionerTest, ABlockCountsTheOtherUnitsWeightsAndHeads) {
  const MemoryProfile p = three_unit_profile();
  const PartitionOptions o = three_unit_options();
  const BlockPlan bp = block_plan(p, o, 0, 1);
  ASSERT_GT(bp.batch, 0);
  const auto l = static_cast<size_t>(bp.head_level);
  const UnitProfile& u0 = p.units[0];
  const double others = 4.0 * (200000 + 1000) + 4.0 * 5000;  // unit 1 with its widest head; unit 2 has none
  const double own = 12.0 * static_cast<double>(u0.params + u0.head_params[l]) + u0.train.fixed_bytes +
                     u0.head_train[l].fixed_bytes;
  const double per_sample = u0.train.per_sample_bytes + u0.head_train[l].per_sample_bytes +
                            2.5 * static_cast<double>(u0.in_bytes) + 0.5 * static_cast<double>(u0.out_bytes);
  EXPECT_NEAR(bp.bytes, o.base_bytes + others + own + per_sample * static_cast<double>(bp.batch), 1.0);
}

// The block's batch re-planned from the allocator's reading at its start: the modelled reading keeps the plan; more
// held than modelled gives the largest batch that still fits; less never grows the batch.
TEST(PartitionerTest, ReplanFromTheHeldBytesKeepsTheBlockUnderTheBudget) {
  const MemoryProfile p = three_unit_profile();
  const PartitionOptions o = three_unit_options();
  const BlockPlan bp = block_plan(p, o, 1, 2);
  ASSERT_GT(bp.batch, 16);
  const double own_fixed = block_own_fixed_bytes(p, o, bp);
  const double head = static_cast<double>(p.units[1].head_params[static_cast<size_t>(bp.head_level)]);
  // Held when the block starts, as modelled: the data, units 0 and 2 with their widest heads, unit 1 and its head.
  const double modelled_held = o.base_bytes + 4.0 * (100000 + 1000) + 4.0 * 5000 + 4.0 * (200000 + head);
  const double per_sample = (bp.bytes - modelled_held - own_fixed) / static_cast<double>(bp.batch);
  const BlockPlan same = block_replan_for_held(p, o, bp, modelled_held);
  EXPECT_EQ(same.batch, bp.batch);
  EXPECT_NEAR(same.bytes, bp.bytes, 1.0);

  const double held = modelled_held + 0.3 * (o.safety * o.budget_bytes - modelled_held);
  const BlockPlan lower = block_replan_for_held(p, o, bp, held);
  EXPECT_LT(lower.batch, bp.batch);
  EXPECT_GE(lower.batch, 16);
  EXPECT_EQ(lower.batch % 8, 0);
  EXPECT_NEAR(lower.bytes, held + own_fixed + per_sample * static_cast<double>(lower.batch), 1.0);
  EXPECT_LE(lower.bytes, o.safety * o.budget_bytes);
  EXPECT_GT(lower.bytes + 8 * per_sample, o.safety * o.budget_bytes);  // the largest multiple of 8 that fits

  EXPECT_EQ(block_replan_for_held(p, o, bp, 0).batch, bp.batch);
  EXPECT_EQ(block_replan_for_held(p, o, bp, o.budget_bytes).batch, 0);
}

// After an out-of-memory error the batch is re-planned with the per-sample bytes the failure shows, not halved:
// 192 with 0.2 of a 0.3 GB budget held needs ≥ 0.1 GB / 192 a sample, so 0.07 GB of room gives 134 → 128.
TEST(PartitionerTest, OutOfMemoryRetryBatchComesFromTheCorrectedModel) {
  PartitionOptions o;
  o.samples = 50000;
  o.budget_bytes = 3e8;
  EXPECT_EQ(oom_retry_batch(192, 2e8, o), 128);
  EXPECT_EQ(oom_retry_batch(192, 0, o), 168);  // 172.8, a multiple of 8
  EXPECT_EQ(oom_retry_batch(24, 2e8, o), 16);
  EXPECT_EQ(oom_retry_batch(4, 2e8, o), 2);
  EXPECT_EQ(oom_retry_batch(2, 2e8, o), 0);     // nothing below min_batch
  EXPECT_EQ(oom_retry_batch(192, 3e8, o), 0);   // the fixed bytes alone fill the budget
  EXPECT_EQ(oom_retry_batch(17, 0, o), 15);     // below the failed batch even where rounding would not be
}

// The block re-planned from one measured step: the step's bytes replace the profile's per-sample bytes of the units
// and heads. The batch is the largest at most the planned one whose step fits beside the input's modelled copies (a
// step that needs half of what the model says keeps the planned batch; one that needs more shrinks it), and the
// prediction is the allocated peak: the body beside one fp32 copy of the input.
TEST(PartitionerTest, MeasuredStepReplacesTheModelledPerSampleBytes) {
  const MemoryProfile p = three_unit_profile();
  PartitionOptions o = three_unit_options();
  o.max_batch = 100000;
  const BlockPlan bp = block_plan(p, o, 1, 2);
  ASSERT_GT(bp.batch, 16);
  const UnitProfile& u1 = p.units[1];
  const auto l = static_cast<size_t>(bp.head_level);
  const double in = static_cast<double>(u1.in_bytes);
  const double copies = 2.5 * in + 0.5 * static_cast<double>(u1.out_bytes);
  const double act_fixed = u1.train.fixed_bytes + u1.head_train[l].fixed_bytes;
  const double act = u1.train.per_sample_bytes + u1.head_train[l].per_sample_bytes;
  ASSERT_GT(act, 2.5 * in);  // the body, not the input's read, sets the peak
  const double held = 5e7;
  const double fixed = held + block_own_fixed_bytes(p, o, bp);
  const int64_t rows = 32;
  const auto body_at = [&](double per_sample) { return act_fixed + per_sample * static_cast<double>(rows); };
  const auto largest = [&](double per_sample) {
    auto b = static_cast<int64_t>(std::floor((o.safety * o.budget_bytes - fixed) / per_sample));
    return b - b % 8;
  };
  const auto predicted = [&](double per_sample, int64_t batch) {
    return fixed + static_cast<double>(batch) * (in + per_sample);
  };
  const BlockPlan at_held = block_replan_for_held(p, o, bp, held);
  ASSERT_EQ(at_held.batch, largest(act + copies));

  const BlockPlan same = block_replan_measured(p, o, at_held, held, body_at(act), rows, 1);
  EXPECT_EQ(same.batch, at_held.batch);
  EXPECT_NEAR(same.bytes, predicted(act, same.batch), 1.0);
  EXPECT_LT(same.bytes, at_held.bytes);  // the input's read is not beside the body at the peak

  const BlockPlan half = block_replan_measured(p, o, at_held, held, body_at(act / 2), rows, 1);
  EXPECT_EQ(half.batch, at_held.batch);  // never above the planned batch
  EXPECT_NEAR(half.bytes, predicted(act / 2, half.batch), 1.0);

  const BlockPlan more = block_replan_measured(p, o, at_held, held, body_at(act * 1.5), rows, 1);
  EXPECT_EQ(more.batch, largest(act * 1.5 + copies));
  EXPECT_LT(more.batch, at_held.batch);
  EXPECT_NEAR(more.bytes, predicted(act * 1.5, more.batch), 1.0);

  // Two processes share each batch: a process's rows cost each global sample half as much.
  const BlockPlan two = block_replan_measured(p, o, at_held, held, body_at(act * 3), rows, 2);
  EXPECT_EQ(two.batch, largest(act * 1.5 + copies));
  EXPECT_NEAR(two.bytes, predicted(act * 1.5, two.batch), 1.0);

  // A block whose body is smaller than its input's read: the read's copies set the peak.
  const BlockPlan tiny = block_replan_measured(p, o, at_held, held, body_at(in), rows, 1);
  EXPECT_NEAR(tiny.bytes, predicted(2.5 * in, tiny.batch), 1.0);
}

TEST(NeuroFluxTest, UnitGradientDoesNotDependOnLaterUnits) {
  auto model = small_cnn();
  torch::manual_seed(1);
  std::vector<AuxHead> heads{AuxHead(std::vector<int64_t>{32, 14, 14}, 16, 10),
                             AuxHead(std::vector<int64_t>{64, 7, 7}, 16, 10),
                             AuxHead(std::vector<int64_t>{128, 7, 7}, 0, 10)};
  const at::Tensor x = at::randn({8, 1, 28, 28});
  const at::Tensor y = at::randint(0, 10, {8});
  const auto grads = [&]() {
    for (auto& p : model->parameters()) p.mutable_grad().reset();
    for (auto& h : heads) h->zero_grad();
    neuroflux_block_loss(*model, heads, 0, 4, x, y, 0.0).backward();
    return std::make_pair(model->named_parameters()["block1.0.weight"].grad().clone(),
                          model->named_parameters()["block2.0.weight"].grad().clone());
  };
  const auto [b1_before, b2_before] = grads();
  {
    const torch::NoGradGuard no_grad;
    model->named_parameters()["block2.0.weight"].mul_(-3.0);  // change every later unit
    model->named_parameters()["block3.0.weight"].add_(1.0);
    model->named_parameters()["fc.weight"].mul_(5.0);
  }
  const auto [b1_after, b2_after] = grads();
  EXPECT_TRUE(b1_after.equal(b1_before));  // exactly: nothing from later units reaches block1
  EXPECT_GT(b1_before.abs().sum().item<double>(), 0);
  EXPECT_FALSE(b2_after.equal(b2_before));  // while block2's own gradient did change
}

// The probe step that calibrates a block (neuroflux_block_step_bytes) trains nothing: BatchNorm's running statistics,
// which its forward in train mode moves, are put back, the weights are untouched and no gradient is left. On the GPU
// it measures the block under the run's precision: bf16 activations take less than fp32 ones, more rows more bytes.
TEST(NeuroFluxTest, ProbeStepLeavesTheBlockAsItFoundIt) {
  const bool cuda = torch::cuda::is_available();
  const c10::Device device = cuda ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  auto model = small_cnn();
  torch::manual_seed(1);
  std::vector<AuxHead> heads{AuxHead(std::vector<int64_t>{32, 14, 14}, 16, 10),
                             AuxHead(std::vector<int64_t>{64, 7, 7}, 16, 10),
                             AuxHead(std::vector<int64_t>{128, 7, 7}, 0, 10)};
  model->to(device);
  for (auto& h : heads) h->to(device);
  model->train();
  if (cuda) {  // cuBLAS's and cuDNN's handles and workspaces, made by a process's first products, are no block's bytes
    for (PrecisionMode p : {PrecisionMode::kAmpBF16, PrecisionMode::kFP32}) {
      neuroflux_block_step_bytes(*model, heads, 0, 3, {1, 28, 28}, 64, false, p, 0.0, device);
    }
  }
  std::vector<at::Tensor> before;
  for (const auto& t : model->parameters()) before.push_back(t.clone());
  for (const auto& t : model->buffers()) before.push_back(t.clone());
  for (auto& h : heads) {
    for (const auto& t : h->buffers()) before.push_back(t.clone());
  }
  const std::vector<int64_t> in_shape{1, 28, 28};
  const double bf16 = neuroflux_block_step_bytes(*model, heads, 0, 3, in_shape, 64, false, PrecisionMode::kAmpBF16,
                                                 0.0, device);
  size_t i = 0;
  for (const auto& t : model->parameters()) {
    EXPECT_TRUE(t.equal(before[i++]));
    EXPECT_FALSE(t.grad().defined());
  }
  for (const auto& t : model->buffers()) EXPECT_TRUE(t.equal(before[i++]));
  for (auto& h : heads) {
    for (const auto& t : h->buffers()) EXPECT_TRUE(t.equal(before[i++]));
    for (const auto& t : h->parameters()) EXPECT_FALSE(t.grad().defined());
  }
  if (!cuda) return;
  const double fp32 = neuroflux_block_step_bytes(*model, heads, 0, 3, in_shape, 64, false, PrecisionMode::kFP32, 0.0,
                                                 device);
  const double bf16_more = neuroflux_block_step_bytes(*model, heads, 0, 3, in_shape, 128, false,
                                                      PrecisionMode::kAmpBF16, 0.0, device);
  EXPECT_GT(bf16, 0);
  EXPECT_LT(bf16, 0.8 * fp32);
  EXPECT_GT(bf16_more, 1.5 * bf16);
}

TEST(NeuroFluxTest, ExitIsTheSmallestWithinToleranceOfTheFullNetwork) {
  // Exits of a local-learning small-cnn: a deep head can beat the full network's own classifier.
  const std::vector<int64_t> params{1642, 21482, 98026, 94186};
  EXPECT_EQ(exit_choose({75.2, 83.3, 86.6, 81.2}, params, 1.0), 1);
  EXPECT_EQ(exit_choose({75.2, 83.3, 86.6, 81.2}, params, 0.0), 1);   // at least as accurate as the full network
  EXPECT_EQ(exit_choose({75.2, 83.3, 86.6, 81.2}, params, 7.0), 0);   // a looser trade-off: the smallest
  EXPECT_EQ(exit_choose({70.0, 80.0, 86.6, 81.2}, params, 1.0), 3);   // never a larger model for accuracy
  EXPECT_EQ(exit_choose({70.0, 80.0, 86.6, 81.2}, params, 1.5), 1);
}

TEST(NeuroFluxTest, ActivationCacheRoundTripsInBf16) {
  ActivationCache cache(6, {2, 3}, CachePlace::kHost, c10::Device(c10::kCPU));
  const at::Tensor batch = at::arange(4 * 6, at::kFloat).reshape({4, 2, 3}) / 7.0;
  cache.write(2, batch);
  EXPECT_EQ(cache.bytes(), 6 * 6 * 2);
  const at::Tensor back = cache.read(at::tensor({5, 2}, at::kLong));
  EXPECT_EQ(back.scalar_type(), at::kFloat);
  EXPECT_TRUE(back[0].equal(batch[3].to(at::kBFloat16).to(at::kFloat)));
  EXPECT_TRUE(back[1].equal(batch[0].to(at::kBFloat16).to(at::kFloat)));
  EXPECT_TRUE(cache.read_range(2, 1)[0].allclose(batch[0], 1e-2, 1e-2));
  EXPECT_THROW(cache.write(4, batch), c10::Error);
}

// A channels_last cache keeps each row in (H, W, C) order: a channels_last batch goes in as one plain copy and comes
// back channels_last with the same values, whatever the layout of the batch written.
TEST(NeuroFluxTest, ChannelsLastActivationCacheRoundTrips) {
  ActivationCache cache(5, {3, 2, 4}, CachePlace::kHost, c10::Device(c10::kCPU), /*channels_last=*/true);
  const at::Tensor batch = (at::arange(4 * 24, at::kFloat).reshape({4, 3, 2, 4}) / 8.0);
  cache.write(0, batch.contiguous(at::MemoryFormat::ChannelsLast).narrow(0, 0, 2));
  cache.write(2, batch.narrow(0, 2, 2));  // an NCHW batch is permuted on the way in
  const at::Tensor back = cache.read(at::tensor({3, 0, 1}, at::kLong));
  EXPECT_TRUE(back.is_contiguous(at::MemoryFormat::ChannelsLast));
  EXPECT_TRUE(back[0].equal(batch[3]));
  EXPECT_TRUE(back[1].equal(batch[0]));
  EXPECT_TRUE(back[2].equal(batch[1]));
  EXPECT_TRUE(cache.read_range(1, 3).equal(batch.narrow(0, 1, 3)));
}

// A host cache on CUDA: rows go down through two pinned staging buffers without waiting and come back through them.
// Five writes (more than the two buffers) and reads right after: every row is there, in the channels_last layout.
TEST(NeuroFluxTest, StagedHostCacheOnTheGpuKeepsEveryRow) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  const c10::Device cuda(c10::kCUDA, 0);
  ActivationCache cache(10, {3, 2, 2}, CachePlace::kHost, cuda, /*channels_last=*/true);
  const at::Tensor all = at::arange(10 * 12, at::kFloat).reshape({10, 3, 2, 2}) / 4.0;  // exact in bf16
  for (int64_t offset = 0; offset < 10; offset += 2) {
    cache.write(offset, all.narrow(0, offset, 2).to(cuda).contiguous(at::MemoryFormat::ChannelsLast));
  }
  const at::Tensor picked = cache.read(at::tensor({9, 0, 4}, at::kLong));
  EXPECT_TRUE(picked.is_cuda());
  EXPECT_TRUE(picked.cpu().equal(all.index_select(0, at::tensor({9, 0, 4}, at::kLong))));
  EXPECT_TRUE(cache.read_range(3, 7).cpu().equal(all.narrow(0, 3, 7)));
  EXPECT_THROW(cache.read(at::tensor({3, 10}, at::kLong)), c10::Error);  // a row past the end
  EXPECT_THROW(cache.read_range(8, 3), c10::Error);
  cache.write(0, at::zeros({1, 3, 2, 2}, at::TensorOptions().device(cuda)));  // a rewrite is seen too
  EXPECT_EQ(cache.read_range(0, 2).cpu().abs().sum().item<double>(), all[1].abs().sum().item<double>());
}

// The copies run on their own streams: a write's copy must wait for its batch, which the caller's stream computes after
// a long spin here (a copy that did not wait would store the batch's memory before the multiply wrote it); a read on
// a busy caller's stream arrives whole. The block event's transfer counters add up.
TEST(NeuroFluxTest, StagedCopiesWaitForTheCallersStream) {
  TRIACCEL_SKIP_WITHOUT_GPU();
#ifdef TRIACCEL_WITH_CUDA
  const c10::Device cuda(c10::kCUDA, 0);
  ActivationCache cache(64, {4, 8, 8}, CachePlace::kHost, cuda, /*channels_last=*/true);
  const at::Tensor all = at::arange(64 * 256, at::kFloat).reshape({64, 4, 8, 8}).remainder(251) / 2.0;  // exact in bf16
  const at::Tensor on_gpu = all.to(cuda);
  for (int64_t offset = 0; offset < 64; offset += 16) {
    at::cuda::sleep(50 * 1000 * 1000);  // ~20-50 ms of spinning on the caller's stream
    cache.write(offset, on_gpu.narrow(0, offset, 16).mul(1.0).contiguous(at::MemoryFormat::ChannelsLast));
  }
  at::cuda::sleep(50 * 1000 * 1000);
  const at::Tensor back = cache.read_range(0, 64).mul(1.0);
  EXPECT_TRUE(back.cpu().equal(all));
  const ActivationCache::IoStats& io = cache.io_stats();
  EXPECT_EQ(io.bytes_to_host, 64 * 256 * 2);
  EXPECT_EQ(io.bytes_to_device, 64 * 256 * 2);
  EXPECT_GE(io.wait_s, 0.0);
#endif
}

// Prefilled host buffers (faulted in on background threads) are in the pool once the prefill is done, and the next
// caches take them instead of fresh memory.
TEST(NeuroFluxTest, HostPoolPrefillServesTheNextCaches) {
  ActivationCache::host_pool_release();
  const c10::Device cpu(c10::kCPU);
  ActivationCache::host_pool_prefill({100 * 1024, 1100 * 1024});  // one of them big enough for huge pages
  EXPECT_EQ(ActivationCache::host_pool_bytes(), 1200 * 1024 * 2);
  {
    ActivationCache train(1100, {16, 8, 8}, CachePlace::kHost, cpu, true);
    EXPECT_EQ(ActivationCache::host_pool_bytes(), 100 * 1024 * 2);
    ActivationCache hold(90, {16, 8, 8}, CachePlace::kHost, cpu, true);
    EXPECT_EQ(ActivationCache::host_pool_bytes(), 0);
    train.write(1000, at::full({100, 16, 8, 8}, 3.0));
    EXPECT_EQ(train.read_range(1000, 100).sum().item<double>(), 3.0 * 100 * 1024);
  }
  ActivationCache::host_pool_release();
}

// The host workers behind the cache's gathers: every part runs exactly once, on several threads when there are
// several, run after run (the pool is reused), and nothing runs for zero parts.
TEST(NeuroFluxTest, HostWorkersRunEveryPartOnce) {
  EXPECT_EQ(host_parallel_threads(), std::clamp(at::get_num_threads(), 1, 32));
  for (int run = 0; run < 3; ++run) {
    std::vector<std::atomic<int>> hits(1000);
    std::mutex m;
    std::set<std::thread::id> threads;
    host_parallel(1000, [&](int64_t part) {
      hits[static_cast<size_t>(part)].fetch_add(1);
      if (part % 10 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));  // let the others take parts
      const std::lock_guard<std::mutex> lock(m);
      threads.insert(std::this_thread::get_id());
    });
    for (const auto& h : hits) ASSERT_EQ(h.load(), 1);
    if (host_parallel_threads() > 1) EXPECT_GT(threads.size(), 1u);
  }
  int calls = 0;
  host_parallel(0, [&](int64_t) { ++calls; });
  EXPECT_EQ(calls, 0);
}

// A freed host cache's memory is reused by the next one that fits (no fresh pages to fault in), the new cache holds
// what it is given, and host_pool_release frees what is kept.
TEST(NeuroFluxTest, HostCacheMemoryIsReused) {
  ActivationCache::host_pool_release();
  const c10::Device cpu(c10::kCPU);
  {
    ActivationCache big(8, {4, 2, 2}, CachePlace::kHost, cpu);
    big.write(0, at::ones({8, 4, 2, 2}));
    EXPECT_EQ(ActivationCache::host_pool_bytes(), 0);
  }
  EXPECT_EQ(ActivationCache::host_pool_bytes(), 8 * 16 * 2);  // kept
  ActivationCache small(3, {2, 2, 2}, CachePlace::kHost, cpu);
  EXPECT_EQ(ActivationCache::host_pool_bytes(), 0);  // taken by the smaller cache
  const at::Tensor batch = at::arange(3 * 8, at::kFloat).reshape({3, 2, 2, 2});
  small.write(0, batch);
  EXPECT_TRUE(small.read(at::tensor({2, 0}, at::kLong)).equal(batch.index_select(0, at::tensor({2, 0}, at::kLong))));
  ActivationCache::host_pool_release();
  EXPECT_EQ(ActivationCache::host_pool_bytes(), 0);
}

// One cache per split: all three freed buffers are kept (with two, a pass's third new cache found none and faulted
// its pages in again), and a cache big enough to be mapped with huge pages (≥ 2 MB) round-trips and is reused.
TEST(NeuroFluxTest, HostPoolKeepsOneBufferPerSplit) {
  ActivationCache::host_pool_release();
  const c10::Device cpu(c10::kCPU);
  const std::vector<int64_t> row{16, 8, 8};  // 1024 bf16 = 2 KB a row
  {
    ActivationCache train(1100, row, CachePlace::kHost, cpu, /*channels_last=*/true);  // 2.2 MB: mapped
    ActivationCache hold(100, row, CachePlace::kHost, cpu, true);
    ActivationCache test(200, row, CachePlace::kHost, cpu, true);
    const at::Tensor batch = at::arange(1100 * 1024, at::kFloat).reshape({1100, 16, 8, 8}).remainder(97);
    train.write(0, batch);
    EXPECT_TRUE(train.read(at::tensor({1099, 3}, at::kLong)).equal(batch.index_select(0, at::tensor({1099, 3}, at::kLong))));
    EXPECT_TRUE(train.read_range(500, 600).equal(batch.narrow(0, 500, 600)));
  }
  EXPECT_EQ(ActivationCache::host_pool_bytes(), (1100 + 100 + 200) * 2048);
  {
    ActivationCache again(1000, row, CachePlace::kHost, cpu, true);  // takes the mapped buffer
    EXPECT_EQ(ActivationCache::host_pool_bytes(), 300 * 2048);
    const at::Tensor ones = at::ones({1000, 16, 8, 8});
    again.write(0, ones);
    EXPECT_EQ(again.read_range(0, 1000).sum().item<double>(), 1000.0 * 1024);
  }
  ActivationCache::host_pool_release();
  EXPECT_EQ(ActivationCache::host_pool_bytes(), 0);
}

class NeuroFluxRunTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    data_ = new test::TempDir("neuroflux_data");
    test::mnist_like_write(data_->path(), 256, 64, 3);
  }
  static void TearDownTestSuite() { delete data_; }

  static Config options(const std::string& out) {
    Config o;
    o.set("method", "neuroflux");
    o.set("model", "small-cnn");
    o.set("dataset", "mnist");
    o.set("data_dir", data_->path());
    o.set("epochs", "1");
    o.set("batch_size", "32");
    o.set("lr", "0.05");
    o.set("device", "cpu");
    o.set("progress", "off");
    o.set("vram_budget", "8MB");  // forces several blocks for small-cnn on 28×28 (checked below)
    o.set("nf_exit_tolerance", "100");  // any exit qualifies: the smallest one is exported
    o.set("out", out);
    return o;
  }
  static test::TempDir* data_;
};
test::TempDir* NeuroFluxRunTest::data_ = nullptr;

TEST_F(NeuroFluxRunTest, TrainsBlockByBlockFromTheCacheAndExportsTheExit) {
  test::TempDir out("neuroflux_run");
  const Json summary = api::run(options(out.path()));
  const auto events = events_read(out.file("events.jsonl"));
  std::vector<Json> blocks;
  Json plan, exit_event;
  for (const auto& e : events) {
    if (e["event"] == "block") blocks.push_back(e);
    if (e["event"] == event::kBlockPlan) plan = e;
    if (e["event"] == "exit") exit_event = e;
  }
  ASSERT_GE(blocks.size(), 2u) << plan.dump();
  EXPECT_EQ(events.front()["event"], "config");
  EXPECT_EQ(events.back()["event"], "summary");
  EXPECT_EQ(blocks[0]["input"], "data");
  int64_t units_seen = 0;
  for (size_t b = 0; b < blocks.size(); ++b) {
    if (b > 0) EXPECT_EQ(blocks[b]["input"], "cache");
    EXPECT_EQ(blocks[b]["batch"], plan["blocks"][b]["batch"]);
    EXPECT_EQ(blocks[b]["epochs"], 1);
    // 231 training rows (256 minus 25 held out) are no multiple of any planned batch here: the last is filled.
    EXPECT_EQ(blocks[b]["short_steps"], 0) << blocks[b].dump();
    const int64_t batch = blocks[b]["batch"].get<int64_t>();
    EXPECT_EQ(blocks[b]["steps"], (231 + batch - 1) / batch);
    units_seen += static_cast<int64_t>(blocks[b]["units"].size());
  }
  EXPECT_EQ(units_seen, 4);
  // The exit: the smallest prefix (tolerance 100), with fewer parameters than the full network.
  const Json& chosen = exit_event["chosen"];
  EXPECT_EQ(chosen["unit"], "block1");
  EXPECT_EQ(exit_event["exits"].size(), 4u);
  EXPECT_LT(chosen["params"].get<int64_t>(), summary["params"].get<int64_t>());
  EXPECT_GT(chosen["images_per_s"].get<double>(), 0);
  const auto state = test::state_dict_read(out.file(kExitModelFile));
  int64_t params = 0;
  for (const auto& [name, t] : state) {
    EXPECT_TRUE(name.rfind("block1.", 0) == 0 || name.rfind("exit.", 0) == 0) << name;
    if (name.find("running_") == std::string::npos && name.find("num_batches") == std::string::npos) params += t.numel();
  }
  EXPECT_EQ(params, chosen["params"].get<int64_t>());
  EXPECT_TRUE(file_exists(out.file(kExitJsonFile)));
  EXPECT_TRUE(file_exists(out.file("model.pt")));
  // The local heads learned something on the (random-label) data's training split: loss is finite.
  EXPECT_TRUE(std::isfinite(blocks.back()["local"].back()["train_loss"].get<double>()));
}

TEST(NeuroFluxTest, CudnnAutotuneIsOffUnderABudgetUnlessAsked) {
  Config o;
  const ExecutionConfig& e = o.execution;
  EXPECT_TRUE(e.cudnn_autotune_enabled());  // auto, no budget
  o.set("vram_budget", "0.5GB");
  EXPECT_FALSE(e.cudnn_autotune_enabled());
  o.set("cudnn_autotune", "on");
  EXPECT_TRUE(e.cudnn_autotune_enabled());
  o.execution.vram_budget.clear();
  o.set("cudnn_autotune", "auto");
  o.set("method", "tri-accel");  // precision changes would re-tune: heuristics unless asked
  EXPECT_FALSE(e.cudnn_autotune_enabled());
  o.set("cudnn_autotune", "on");
  EXPECT_TRUE(e.cudnn_autotune_enabled());
  o.set("method", "backprop");
  o.set("cudnn_autotune", "off");
  EXPECT_FALSE(e.cudnn_autotune_enabled());
  EXPECT_EQ(Config::from_json(o.to_json()).execution.cudnn_autotune, Toggle::kOff);
  EXPECT_EQ(test::error_of([&] { o.set("cudnn_autotune", "yes"); }),
            "cudnn_autotune must be auto, on or off, got 'yes'");
}

TEST(NeuroFluxTest, ShortBatchesAreWidenedToThePlannedOne) {
  // Training: only the epoch's short last batch at the planned size is filled, from the epoch's first rows.
  EXPECT_EQ(epoch_fill(224, 7, 231, 32, 32), 25);
  EXPECT_EQ(epoch_fill(0, 32, 231, 32, 32), 0);   // a full batch
  EXPECT_EQ(epoch_fill(224, 7, 231, 16, 32), 0);  // after an out-of-memory retry: eager, short
  EXPECT_EQ(epoch_fill(0, 7, 7, 32, 32), 0);      // an epoch smaller than the batch
  // Cache pass: for every split size and batch, each row is scored exactly once and every window has `batch` rows
  // whenever the split has that many.
  for (const int64_t n : {1, 7, 31, 32, 33, 100, 231}) {
    for (const int64_t batch : {1, 8, 32, 64}) {
      std::vector<int> scored(static_cast<size_t>(n), 0);
      for (int64_t offset = 0; offset < n;) {
        const int64_t count = std::min(batch, n - offset);
        const int64_t skip = pass_skip(offset, count, n, batch);
        ASSERT_GE(offset - skip, 0);
        EXPECT_EQ(count + skip, std::min(batch, n)) << "n " << n << " batch " << batch << " offset " << offset;
        for (int64_t r = offset; r < offset + count; ++r) ++scored[static_cast<size_t>(r)];
        offset += count;
      }
      for (int64_t r = 0; r < n; ++r) EXPECT_EQ(scored[static_cast<size_t>(r)], 1) << "row " << r;
    }
  }
}

TEST_F(NeuroFluxRunTest, ResumeAtABlockBoundaryEndsWithTheSameWeights) {
  test::TempDir a("neuroflux_a"), b("neuroflux_b");
  api::run(options(a.path()));
  Config first = options(b.path());
  first.set("max_steps", "1");  // stops after the first block
  const Json stop = api::run(first);
  ASSERT_EQ(stop["reason"], "max_steps");
  EXPECT_FALSE(file_exists(b.file("model.pt")));
  Config resumed = options(b.path());
  resumed.set("resume", b.path());
  api::run(resumed);
  const auto wa = test::state_dict_read(a.file("model.pt"));
  const auto wb = test::state_dict_read(b.file("model.pt"));
  ASSERT_EQ(wa.size(), wb.size());
  for (const auto& [name, t] : wa) EXPECT_TRUE(t.equal(wb.at(name))) << name;
  const auto ea = test::state_dict_read(a.file(kExitModelFile));
  const auto eb = test::state_dict_read(b.file(kExitModelFile));
  for (const auto& [name, t] : ea) EXPECT_TRUE(t.equal(eb.at(name))) << name;
}

// A stop request inside a block (here in block 1's second epoch, whose input comes from the cache) writes a checkpoint
// holding the block's position, momenta and loss sums; the resumed run continues inside the block and ends with the
// same weights, exit and block events as an uninterrupted run.
TEST_F(NeuroFluxRunTest, StopInsideABlockResumesToTheSameWeights) {
  test::TempDir a("neuroflux_a"), b("neuroflux_b");
  Config base = options(a.path());
  base.set("epochs", "2");
  api::run(base);
  std::vector<Json> blocks_a;
  for (const auto& e : events_read(a.file("events.jsonl"))) {
    if (e["event"] == "block") blocks_a.push_back(e);
  }
  ASSERT_GE(blocks_a.size(), 2u);
  const int64_t steps0 = blocks_a[0]["steps"].get<int64_t>(), steps1 = blocks_a[1]["steps"].get<int64_t>();
  const int64_t stop_at = steps0 + steps1 / 2 + 1;  // inside block 1, in its second epoch

  Config first = base;
  first.set("out", b.path());
  int64_t last_step = 0;
  RunHooks hooks;
  hooks.after_step = [&](int64_t step) { last_step = step; };
  hooks.stop_requested = [&] { return last_step >= stop_at ? StopRequest::kTerminate : StopRequest::kNone; };
  const Json stop = api::run(first, hooks);
  ASSERT_EQ(stop["reason"], "sigterm");
  EXPECT_EQ(stop["block_in_progress"], 1);
  EXPECT_EQ(last_step, stop_at);
  EXPECT_FALSE(file_exists(b.file("model.pt")));
  const Checkpoint c = checkpoint_read(b.file(kCheckpointFile));
  ASSERT_TRUE(c.progress.contains("block_in_progress"));
  EXPECT_EQ(c.progress["block_in_progress"]["epoch"], 1);
  EXPECT_EQ(c.progress["step"], stop_at);

  Config resumed = base;
  resumed.set("out", b.path());
  resumed.set("resume", b.path());
  api::run(resumed);
  const auto wa = test::state_dict_read(a.file("model.pt"));
  const auto wb = test::state_dict_read(b.file("model.pt"));
  ASSERT_EQ(wa.size(), wb.size());
  for (const auto& [name, t] : wa) EXPECT_TRUE(t.equal(wb.at(name))) << name;
  std::vector<Json> blocks_b;
  for (const auto& e : events_read(b.file("events.jsonl"))) {
    if (e["event"] == "block") blocks_b.push_back(e);
  }
  ASSERT_EQ(blocks_b.size(), blocks_a.size());
  for (size_t i = 0; i < blocks_a.size(); ++i) {
    EXPECT_EQ(blocks_a[i]["steps"], blocks_b[i]["steps"]) << i;
    EXPECT_EQ(blocks_a[i]["local"], blocks_b[i]["local"]) << i;  // the loss sums survived the stop
  }
}

TEST_F(NeuroFluxRunTest, RunsOnTheGpuWithinItsBudget) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  test::TempDir out("neuroflux_gpu");
  Config o = options(out.path());
  o.set("device", "cuda");
  // 200 MB on top of what earlier tests in this process still hold (on the H200 262 MB were held when this ran after
  // the rest of the suite). The cap counts what the allocator reserves, which after releasing its cache is more than
  // what is allocated where a CUDA graph's pool is still alive (budgeted on allocated bytes this failed on the H100
  // after the curvature and step-graph tests).
  const c10::Device gpu(c10::kCUDA, 0);
  memory_cache_release(gpu);
  const int64_t budget = memory_stats(gpu).reserved_bytes + 200'000'000;
  o.set("vram_budget", std::to_string(budget));
  o.set("precision", "amp-bf16");
  const Json summary = api::run(o);
  EXPECT_LE(summary["peak_vram_gb"].get<double>() * 1e9, static_cast<double>(budget));
  EXPECT_GT(summary["peak_vram_gb"].get<double>(), 0.0);
  Json plan;
  for (const auto& e : events_read(out.file("events.jsonl"))) {
    if (e["event"] == event::kBlockPlan) plan = e;
  }
  EXPECT_EQ(plan["profile"], "measured");
  EXPECT_GT(plan["backprop_max_batch"].get<int64_t>(), 0);
  EXPECT_TRUE(file_exists(out.file(kExitModelFile)));
}

// The block loop's CUDA graph: steps at the planned batch replay a captured graph (new batches copied into its
// static inputs, the lr read on the device) and train the same as eager steps — a graph replaying stale inputs or a
// baked-in lr would end with other local losses. Deterministic cuDNN; a budget, so cuDNN uses its heuristics.
TEST_F(NeuroFluxRunTest, GraphStepsTrainAsEagerStepsOnTheGpu) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  const test::DeterministicCudnn deterministic;
  const c10::Device gpu(c10::kCUDA, 0);
  auto run = [&](bool graphs, std::vector<Json>* blocks) {
    test::TempDir out(graphs ? "neuroflux_graph" : "neuroflux_eager");
    Config o = options(out.path());
    o.set("device", "cuda");
    o.set("precision", "amp-bf16");
    o.set("epochs", "2");
    o.set("nf_max_batch", "16");  // ~14 steps a block-epoch: warm-up, capture, replays and a short last batch
    o.set("cuda_graphs", graphs ? "true" : "false");
    memory_cache_release(gpu);
    o.set("vram_budget", std::to_string(memory_stats(gpu).allocated_bytes + 400'000'000));
    api::run(o);
    for (const auto& e : events_read(out.file("events.jsonl"))) {
      if (e["event"] == "block") blocks->push_back(e);
    }
  };
  std::vector<Json> with_graph, eager;
  run(true, &with_graph);
  run(false, &eager);
  ASSERT_EQ(with_graph.size(), eager.size());
  for (size_t b = 0; b < eager.size(); ++b) {
    EXPECT_TRUE(with_graph[b]["cuda_graph"].get<bool>()) << "block " << b;
    EXPECT_FALSE(eager[b]["cuda_graph"].get<bool>());
    const auto& lg = with_graph[b]["local"];
    const auto& le = eager[b]["local"];
    for (size_t u = 0; u < le.size(); ++u) {
      const double a = lg[u]["train_loss"].get<double>(), e = le[u]["train_loss"].get<double>();
      EXPECT_NEAR(a, e, 1e-4 * std::abs(e)) << "block " << b << " unit " << u;
    }
  }
}

TEST_F(NeuroFluxRunTest, ImpossibleBudgetIsOneClearError) {
  test::TempDir out("neuroflux_tiny_budget");
  Config o = options(out.path());
  o.set("vram_budget", "100KB");
  try {
    api::run(o);
    FAIL() << "expected a UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("at least"), std::string::npos) << e.what();
  }
}

// What --method neuroflux refuses and what method auto leaves NeuroFlux out for are one rule (run/config.h): each
// refused option gives the run's one line, and a configuration NeuroFlux trains gives nothing.
TEST(NeuroFluxTest, ItsRunRefusesWhatMethodAutoLeavesOut) {
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"model", "vit-tiny"}, {"optimizer", "adamw"}, {"precision", "amp-fp16"}, {"micro_batch", "8"},
      {"recompute", "none"}, {"data_placement", "host"}, {"batch_policy", "fixed"}, {"inject_faults", "oom@3"}};
  for (const auto& [key, value] : refused) {
    SCOPED_TRACE(key);
    Config config;
    config.set("model", "small-cnn");
    config.set(key, value);
    const auto refusal = neuroflux_refusal(config);
    ASSERT_TRUE(refusal.has_value());
    EXPECT_FALSE(refusal->reason.empty());
    config.set("method", "neuroflux");
    try {
      config.validate();
      ADD_FAILURE() << "validate() accepted --method neuroflux with " << key;
    } catch (const UserError& e) {
      EXPECT_EQ(std::string(e.what()), UserError(refusal->message).what());
    }
  }
  Config plain;
  plain.set("model", "small-cnn");
  EXPECT_FALSE(neuroflux_refusal(plain).has_value());
}

}  // namespace
}  // namespace triaccel
