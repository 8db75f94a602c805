// core/dist: the torchrun-style environment read into ranks (and refused, naming the variable, when malformed), one
// process as a no-op, and two ranks (threads, each its own Dist over one TCPStore) summing and broadcasting through
// c10d's ProcessGroupGloo.
#include "test_util.h"
#include "triaccel/core/dist.h"
#include "triaccel/core/errors.h"
#include "triaccel/run/step_agreement.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <cstdlib>
#include <optional>
#include <thread>

namespace triaccel {
namespace {

// Sets the variables for one test and restores the previous values after it.
class EnvScope {
 public:
  EnvScope(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const auto& [name, value] : vars) {
      const char* old = std::getenv(name);
      saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
      if (value) setenv(name, value, 1); else unsetenv(name);
    }
  }
  ~EnvScope() {  // in reverse: a variable set twice in one scope gets its value from before the scope back
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second) setenv(it->first.c_str(), it->second->c_str(), 1); else unsetenv(it->first.c_str());
    }
  }
 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

TEST(DistTest, RanksComeFromTheEnvironment) {
  {
    const EnvScope env({{"WORLD_SIZE", nullptr}, {"RANK", nullptr}, {"MASTER_PORT", nullptr}, {"MASTER_ADDR", nullptr}});
    const DistOptions o = dist_options_from_env();
    EXPECT_EQ(o.world_size, 1);
    EXPECT_EQ(o.rank, 0);
  }
  {
    const EnvScope env({{"WORLD_SIZE", "4"}, {"RANK", "3"}, {"MASTER_PORT", "23456"}, {"MASTER_ADDR", "node7"}});
    const DistOptions o = dist_options_from_env();
    EXPECT_EQ(o.world_size, 4);
    EXPECT_EQ(o.rank, 3);
    EXPECT_EQ(o.master_port, 23456);
    EXPECT_EQ(o.master_addr, "node7");
  }
  for (const auto& [name, value] : std::vector<std::pair<const char*, const char*>>{
           {"RANK", "4"}, {"WORLD_SIZE", "two"}, {"MASTER_PORT", "70000"}}) {
    const EnvScope env({{"WORLD_SIZE", "4"}, {"RANK", "0"}, {"MASTER_PORT", "29500"}, {name, value}});
    try {
      dist_options_from_env();
      FAIL() << name << "=" << value << " was accepted";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  }
}

TEST(DistTest, TheEnvironmentIsRestoredAfterEachScope) {
  EXPECT_EQ(std::getenv("WORLD_SIZE"), nullptr) << "an earlier test left WORLD_SIZE set: every later run would wait "
                                                   "for ranks that never come";
  EXPECT_EQ(std::getenv("RANK"), nullptr);
}

TEST(DistTest, OneProcessIsANoOp) {
  Dist dist(DistOptions{});
  EXPECT_FALSE(dist.active());
  std::vector<at::Tensor> t{torch::full({3}, 2.0f)};
  dist.all_reduce_sum(t);
  dist.all_reduce_sum_start(t[0]).wait();
  dist.broadcast(t);
  dist.barrier();
  EXPECT_TRUE(torch::equal(t[0], torch::full({3}, 2.0f)));
}

// Two ranks: rank r holds (r + 1) in a tensor of 4 and r·10 in one of 2 (tensors of different sizes in one call);
// after the sum every rank holds 3 and 10 (and so for two sums started at once); a maximum gives each number's
// largest; after a broadcast from rank 1 every rank holds rank 1's values, also in a channels_last tensor (a CNN's
// weight on the GPU: sent in memory order, its layout kept).
TEST(DistTest, TwoGlooRanksSumAndBroadcast) {
  std::vector<std::vector<at::Tensor>> sums(2), casts(2), started(2), layouts(2);
  std::vector<std::vector<double>> maxima(2);
  // ctest -j runs test binaries side by side: a port of this process's own.
  const auto errors = test::on_two_ranks(free_local_port(), [&](int r, Dist& dist) {
    std::vector<at::Tensor> t{torch::full({4}, static_cast<float>(r + 1)), torch::full({2}, 10.0f * r)};
    dist.all_reduce_sum(t);
    sums[r] = t;
    // Two sums in flight at once (as gradient buckets during backward), waited for in reverse order.
    at::Tensor a1 = torch::full({5}, static_cast<float>(r + 1)), a2 = torch::full({1000}, 2.0f * r);
    DistWork w1 = dist.all_reduce_sum_start(a1);
    DistWork w2 = dist.all_reduce_sum_start(a2);
    w2.wait();
    w1.wait();
    w1.wait();  // a second wait does nothing
    started[r] = {a1, a2};
    maxima[r] = dist.all_reduce_max({static_cast<double>(r), 5.0 - r, -1.0});
    std::vector<at::Tensor> b{torch::full({3}, static_cast<float>(7 * r))};
    dist.broadcast(b, 1);
    casts[r] = b;
    std::vector<at::Tensor> w{(torch::arange(2 * 3 * 2 * 2, torch::kFloat).view({2, 3, 2, 2}) + 100 * r)
                                  .contiguous(at::MemoryFormat::ChannelsLast)};
    dist.broadcast(w, 1);
    layouts[r] = w;
    dist.barrier();
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(errors[r].empty()) << "rank " << r << ": " << errors[r];
    EXPECT_TRUE(torch::equal(sums[r][0], torch::full({4}, 3.0f))) << r;
    EXPECT_TRUE(torch::equal(sums[r][1], torch::full({2}, 10.0f))) << r;
    EXPECT_TRUE(torch::equal(casts[r][0], torch::full({3}, 7.0f))) << r;
    EXPECT_TRUE(torch::equal(layouts[r][0], torch::arange(24, torch::kFloat).view({2, 3, 2, 2}) + 100)) << r;
    EXPECT_TRUE(layouts[r][0].is_contiguous(at::MemoryFormat::ChannelsLast)) << r;
    EXPECT_TRUE(torch::equal(started[r][0], torch::full({5}, 3.0f))) << r;
    EXPECT_TRUE(torch::equal(started[r][1], torch::full({1000}, 2.0f))) << r;
    EXPECT_EQ(maxima[r], (std::vector<double>{1.0, 5.0, -1.0})) << r;
  }
}

// The rendezvous port is picked below the kernel's ephemeral range (32768 and up), where no outgoing connection or
// port-0 listener can take it before the store binds it (EADDRINUSE on two H200s when it was the kernel's pick).
TEST(DistTest, TheRendezvousPortIsBelowTheEphemeralRange) {
  for (int i = 0; i < 20; ++i) {
    const int port = free_local_port();
    EXPECT_GE(port, 20000);
    EXPECT_LT(port, 32768);
  }
}

// rows_gather through the store: every rank gets every rank's row in rank order, round after round (rows of other
// lengths too), and the store keeps only the last two rounds' rows, the count and the last round's mark.
TEST(DistTest, RowsGatherGivesEveryRanksRowInRankOrderEachRound) {
  std::vector<std::vector<std::vector<std::vector<double>>>> seen(2);
  bool old_mark_left = true, last_keys_left = false;
  int64_t count = 0;
  const int port = free_local_port();
  const auto errors = test::on_two_ranks(port, [&](int r, Dist& dist) {
    for (int round = 0; round < 30; ++round) {
      std::vector<double> own(static_cast<size_t>(1 + r + round % 3), 0.0);
      for (size_t j = 0; j < own.size(); ++j) own[j] = 1000.0 * round + 10.0 * r + static_cast<double>(j);
      seen[static_cast<size_t>(r)].push_back(dist.rows_gather(own));
    }
    dist.barrier();
    if (r == 0) {  // a client of the rendezvous store of its own: which rounds' keys are left
      c10d::TCPStoreOptions so;
      so.port = static_cast<uint16_t>(port);
      so.isServer = false;
      so.timeout = std::chrono::seconds(10);
      c10d::TCPStore store("127.0.0.1", so);
      old_mark_left = store.check({"rows/all0"});  // round 28's
      last_keys_left = store.check({"rows/0/0", "rows/0/1", "rows/1/0", "rows/1/1", "rows/all1"});
      count = store.add("rows/in", 0);
    }
    dist.barrier();
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(errors[r].empty()) << "rank " << r << ": " << errors[r];
    ASSERT_EQ(seen[r].size(), 30u);
    for (int round = 0; round < 30; ++round) {
      const auto& rows = seen[r][static_cast<size_t>(round)];
      ASSERT_EQ(rows.size(), 2u);
      for (int q = 0; q < 2; ++q) {
        ASSERT_EQ(rows[q].size(), static_cast<size_t>(1 + q + round % 3)) << "round " << round << " row " << q;
        for (size_t j = 0; j < rows[q].size(); ++j) {
          EXPECT_EQ(rows[q][j], 1000.0 * round + 10.0 * q + static_cast<double>(j));
        }
      }
    }
  }
  EXPECT_FALSE(old_mark_left);  // each round's last rank in deleted the round before's mark
  EXPECT_TRUE(last_keys_left);  // rounds 28 and 29's rows, round 29's mark
  EXPECT_EQ(count, 60);         // 2 ranks × 30 rounds
}

// Under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True) the store outlives a restart of the workers: an
// attempt's keys live under its own prefix (TORCHELASTIC_RESTART_COUNT), so the keys a former attempt left at the same
// names (here: round 0's count) are not read as this attempt's (without the prefix the round never completes and the
// ranks lose the group at the timeout).
TEST(DistTest, ARestartedAttemptUnderTheAgentsStoreReadsOnlyItsOwnKeys) {
  const int port = free_local_port();
  c10d::TCPStoreOptions agent;
  agent.port = static_cast<uint16_t>(port);
  agent.isServer = true;
  agent.timeout = std::chrono::seconds(30);
  c10d::TCPStore store("127.0.0.1", agent);
  store.add("rows/in", 2);  // a former attempt's count of round 0: read as this one's, no rank would be the last in
  const EnvScope env({{"TORCHELASTIC_RESTART_COUNT", "1"}});
  std::vector<std::vector<std::vector<double>>> rows(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        DistOptions o;
        o.world_size = 2;
        o.rank = r;
        o.master_port = port;
        o.rank0_serves_store = false;
        o.timeout = std::chrono::seconds(5);
        Dist dist(o);
        rows[static_cast<size_t>(r)] = dist.rows_gather({static_cast<double>(r)});
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(errors[r].empty()) << "rank " << r << ": " << errors[r];
    EXPECT_EQ(rows[r], (std::vector<std::vector<double>>{{0.0}, {1.0}})) << "rank " << r;
  }
}

// The ranks' step outcomes travel as rows of numbers; every rank reads the same recovery from them: who ran out, the
// smallest proposed batch, whether a rank that ran out must stop or ran out beside the graph's pool. Flags of a rank
// that did not run out count for nothing.
TEST(StepAgreementTest, EveryRankReadsTheSameRecoveryFromTheRows) {
  RankStepOutcome fine;
  fine.batch = 64;
  fine.beside_pool = true;  // not out of memory: ignored
  fine.must_stop = true;
  RankStepOutcome beside;
  beside.out_of_memory = true;
  beside.beside_pool = true;
  beside.batch = 32;
  beside.allocated_gb = 1.5;
  beside.reserved_gb = 2.25;
  StepAgreement a;
  for (const RankStepOutcome& r : {fine, beside}) a.ranks.push_back(RankStepOutcome::from_row(r.to_row()));
  EXPECT_TRUE(a.out_of_memory());
  EXPECT_TRUE(a.beside_pool());
  EXPECT_FALSE(a.must_stop());
  EXPECT_EQ(a.batch_agreed(64), 32);
  EXPECT_EQ(a.batch_agreed(16), 16);
  EXPECT_EQ(a.oom_who(), "rank 1 of 2");
  EXPECT_EQ(a.oom_ranks(), Json::parse(R"([{"rank": 1, "allocated_gb": 1.5, "reserved_gb": 2.25}])"));

  RankStepOutcome stopped;
  stopped.out_of_memory = true;
  stopped.must_stop = true;
  stopped.batch = 48;
  a.ranks.push_back(RankStepOutcome::from_row(stopped.to_row()));
  EXPECT_TRUE(a.must_stop());
  EXPECT_EQ(a.oom_who(), "ranks 1, 2 of 3");
  EXPECT_EQ(a.oom_ranks().size(), 2u);

  StepAgreement none;
  none.ranks = {fine, fine};
  EXPECT_FALSE(none.out_of_memory());
  EXPECT_FALSE(none.beside_pool());
  EXPECT_FALSE(none.must_stop());
  EXPECT_TRUE(none.oom_ranks().empty());
}

// The pool's out-of-memory error (a warm-up step routed into the capture's pool) is re-planned as the pool's only when
// every rank that ran out ran out there: one rank's ordinary error is the model's.
TEST(StepAgreementTest, APoolWarmUpErrorIsThePoolsOnlyWhenEveryRankThatRanOutHadIt) {
  RankStepOutcome fine;
  fine.in_pool_warmup = true;  // not out of memory: ignored
  RankStepOutcome pool;
  pool.out_of_memory = true;
  pool.in_pool_warmup = true;
  RankStepOutcome model;
  model.out_of_memory = true;
  StepAgreement a;
  for (const RankStepOutcome& r : {fine, pool}) a.ranks.push_back(RankStepOutcome::from_row(r.to_row()));
  EXPECT_TRUE(a.in_pool_warmup());
  a.ranks.push_back(RankStepOutcome::from_row(model.to_row()));
  EXPECT_FALSE(a.in_pool_warmup());
  StepAgreement none;
  none.ranks = {fine, fine};
  EXPECT_FALSE(none.in_pool_warmup());
}

}  // namespace
}  // namespace triaccel
