// train/param_shards (ZeRO stage 1): the owners (contiguous runs of about equal size), the buckets and their staging
// buffer, the broadcast after the step over two Gloo ranks (a channels_last weight, lone parameters in place, several
// parameters through the staging buffer), the checkpoint gather, and an optimizer that updates only what it owns.
#include "test_util.h"
#include "triaccel/core/dist.h"
#include "triaccel/optim/baoc_optimizer.h"
#include "triaccel/optim/sgd.h"
#include "triaccel/train/param_shards.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace triaccel {
namespace {

TEST(ShardOwnersTest, ContiguousRunsOfAboutEqualSize) {
  EXPECT_EQ(shard_owners({100, 100, 100, 100}, 2), (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(shard_owners({100, 100, 100, 100}, 1), (std::vector<int>{0, 0, 0, 0}));
  // A large first parameter: rank 0 takes it alone, rank 1 the rest.
  EXPECT_EQ(shard_owners({1000, 10, 10, 10}, 2), (std::vector<int>{0, 1, 1, 1}));
  // Runs never interleave, and a rank may get none (two parameters on three ranks).
  EXPECT_EQ(shard_owners({10, 1000, 10}, 2), (std::vector<int>{0, 1, 1}));
  EXPECT_EQ(shard_owners({50, 50}, 3), (std::vector<int>{0, 2}));
  EXPECT_EQ(shard_owners({6, 6, 6, 6, 6, 6}, 3), (std::vector<int>{0, 0, 1, 1, 2, 2}));
}

TEST(ShardBucketsTest, ConsecutiveParametersOfOneOwnerUpToTheCap) {
  // 40 bytes: at most 10 float32 elements per bucket; the 12-element parameter alone.
  const auto b = shard_buckets({4, 4, 4, 12, 3, 3}, {0, 0, 0, 0, 1, 1}, 40);
  ASSERT_EQ(b.size(), 4u);
  EXPECT_EQ(b[0].params, (std::vector<size_t>{0, 1}));
  EXPECT_EQ(b[1].params, (std::vector<size_t>{2}));
  EXPECT_EQ(b[2].params, (std::vector<size_t>{3}));
  EXPECT_EQ(b[3].params, (std::vector<size_t>{4, 5}));
  EXPECT_EQ(b[3].owner, 1);
  EXPECT_EQ(shard_staging_bytes(b), 4 * 8);  // the two-parameter buckets; lone ones go in place
  const auto one = shard_buckets({4, 4, 4, 12, 3, 3}, {0, 0, 0, 0, 1, 1}, 0);  // 0: one bucket per owner
  ASSERT_EQ(one.size(), 2u);
  EXPECT_EQ(shard_staging_bytes(one), 4 * 24);
}

// The state the most-loaded rank keeps, and the buckets' cap: a quarter of the state a rank no longer keeps, at most
// 4 MiB.
TEST(ShardSizesTest, TheLargestShardAndAQuarterOfTheSavingAtMost4MiB) {
  const ShardSizes small = shard_sizes({100, 100, 100, 100}, {0, 0, 1, 1}, 8);
  EXPECT_EQ(small.state_bytes, 8 * 200);
  EXPECT_EQ(small.bucket_bytes, 8 * 200 / 4);
  const ShardSizes uneven = shard_sizes({300, 100}, {0, 1}, 4);
  EXPECT_EQ(uneven.state_bytes, 4 * 300);  // rank 0's
  EXPECT_EQ(uneven.bucket_bytes, 4 * 100 / 4);
  const ShardSizes large = shard_sizes({10000000, 10000000}, {0, 1}, 4);
  EXPECT_EQ(large.state_bytes, 40000000);
  EXPECT_EQ(large.bucket_bytes, int64_t{4} << 20);
}

// Five parameters, a channels_last 4-D weight among them; owners {0, 0, 0, 1, 1}; buckets of at most 64 elements:
// rank 0's first two together (staged), its 4-D weight alone (in place), rank 1's two together.
std::vector<at::Tensor> five_params() {
  return {at::zeros({3, 5}), at::zeros({7}), at::zeros({4, 3, 2, 2}).contiguous(at::MemoryFormat::ChannelsLast),
          at::zeros({6, 6}), at::zeros({9})};
}

TEST(ParamShardsTest, OwnersBroadcastTheirParametersAndGatherTheirState) {
  const std::vector<int> owners{0, 0, 0, 1, 1};
  std::vector<std::vector<at::Tensor>> seen(2);
  std::vector<NamedTensors> gathered(2);
  const auto errors = test::on_two_ranks(free_local_port(), [&](int r, Dist& dist) {
    std::vector<at::Tensor> params = five_params();
    ParamShards shards(params, owners, dist, 64 * 4);
    EXPECT_EQ(shards.owned(), r == 0 ? (std::vector<bool>{true, true, true, false, false})
                                     : (std::vector<bool>{false, false, false, true, true}));
    // Each rank "updates" what it owns (parameter i to i + 1 + its element index / 100) and puts garbage elsewhere.
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor value =
          owners[i] == r ? at::arange(params[i].numel(), at::kFloat).div(100).add(static_cast<double>(i) + 1)
                               .view(params[i].sizes())
                         : at::full(params[i].sizes(), -7.0);
      params[i].copy_(value);
    }
    shards.sync();
    seen[static_cast<size_t>(r)] = params;
    // The state of parameters 2 (rank 0's) and 3 (rank 1's): the owner's live values, a zero temporary elsewhere;
    // "opt.count" is the optimizer's own and stays as each rank has it.
    NamedTensors state{{"p2.m", owners[2] == r ? at::full({4, 3, 2, 2}, 5.0) : at::zeros({4, 3, 2, 2})},
                       {"p3.m", owners[3] == r ? at::full({6, 6}, 6.0) : at::zeros({6, 6})},
                       {"opt.count", at::full({1}, static_cast<double>(r))}};
    shards.gather(state, {"p0", "p1", "p2", "p3", "p4"});
    gathered[static_cast<size_t>(r)] = state;
  });
  ASSERT_EQ(errors, (std::vector<std::string>{"", ""}));
  for (int r = 0; r < 2; ++r) {
    const auto& p = seen[static_cast<size_t>(r)];
    for (size_t i = 0; i < p.size(); ++i) {
      const at::Tensor want = at::arange(p[i].numel(), at::kFloat).div(100).add(static_cast<double>(i) + 1)
                                  .view(p[i].sizes());
      EXPECT_TRUE(at::equal(p[i], want)) << "rank " << r << ", parameter " << i;
    }
    EXPECT_TRUE(p[2].is_contiguous(at::MemoryFormat::ChannelsLast));  // updated in place, layout kept
    // Rank 0 (the writer) holds every owner's state; rank 1 keeps its own and receives nothing.
    const auto& s = gathered[static_cast<size_t>(r)];
    EXPECT_TRUE(at::equal(s[0].second, at::full({4, 3, 2, 2}, r == 0 ? 5.0 : 0.0))) << "rank " << r;
    EXPECT_TRUE(at::equal(s[1].second, at::full({6, 6}, 6.0))) << "rank " << r;
    EXPECT_EQ(s[2].second.item<double>(), r);
  }
}

// An optimizer updates only the parameters it owns, keeps state for those alone, and lists every entry (another
// rank's as a host temporary) for the checkpoint gather.
TEST(ParamShardsTest, AnOptimizerUpdatesOnlyWhatItOwns) {
  torch::manual_seed(1);
  const std::vector<std::pair<std::string, at::Tensor>> named{{"a", at::randn({4, 4}).set_requires_grad(true)}, {"b", at::randn({8}).set_requires_grad(true)}};
  const at::Tensor lr = at::full({1}, 0.1f), found_inf = at::zeros({1});
  Sgd sgd(named, SgdOptions{});
  const auto copy = [](const at::Tensor& t) { return t.detach().clone().set_requires_grad(true); };
  BaocOptimizer adamw({{"a", copy(named[0].second)}, {"b", copy(named[1].second)}}, BaocOptions{});
  for (Optimizer* o : std::vector<Optimizer*>{&sgd, &adamw}) {
    const int64_t full = o->state_bytes();
    o->set_owned({false, true});
    EXPECT_TRUE(o->sharded());
    EXPECT_EQ(o->state_bytes(), full * 8 / 24) << "b's 8 of 24 elements";
    const at::Tensor a_before = o->params()[0].clone(), b_before = o->params()[1].clone();
    for (const auto& p : o->params()) p.mutable_grad() = at::ones_like(p);
    o->step(lr, found_inf);
    EXPECT_TRUE(at::equal(o->params()[0], a_before)) << "a is another rank's";
    EXPECT_FALSE(at::equal(o->params()[1], b_before));
    const NamedTensors state = o->state_tensors();
    bool a_listed = false;
    for (const auto& [name, t] : state) {
      if (name.rfind("a.", 0) != 0) continue;
      a_listed = true;
      EXPECT_EQ(t.device().type(), at::kCPU);
      EXPECT_EQ(t.abs().sum().item<double>(), 0.0) << name;
    }
    EXPECT_TRUE(a_listed);
  }
  EXPECT_FALSE(sgd.momenta()[0].defined());
  ASSERT_TRUE(sgd.momenta()[1].defined());
  EXPECT_TRUE(at::allclose(sgd.momenta()[1], at::ones({8})));  // b's first step: momentum = its gradient
}

}  // namespace
}  // namespace triaccel
