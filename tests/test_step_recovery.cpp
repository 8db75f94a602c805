// StepRecovery (run/step_recovery.h), the out-of-memory recovery of both methods' steps, on Sessions of the tiny
// dataset that train nothing: bodies that run or throw, in one process and on two ranks (threads of this process over
// one Gloo group), and the outcome each rank reads.
#include "test_util.h"
#include "triaccel/core/events.h"
#include "triaccel/run/step_recovery.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace triaccel {
namespace {

class StepRecoveryTest : public test::TinyMnistTest {
 protected:
  // The oom events of a run's events.jsonl, in order.
  static std::vector<Json> ooms_read(const std::string& events) {
    std::vector<Json> out;
    for (const Json& e : events_read(events)) {
      if (e["event"] == event::kOom) out.push_back(e);
    }
    return out;
  }
};

[[noreturn]] void recovery_oom_throw() {
  TORCH_CHECK_WITH(OutOfMemoryError, false, "tried to allocate 1 PiB\nthe allocator's second line");
}

// In one process: a body that runs leaves nothing to recover and asks nothing of the method; one that runs out of
// memory is the retry outcome with the reading (the error's first line) and what the method made of the failure, no
// collective and no agreed stop; any other error is not caught. stop() writes the oom event with action "stopped"
// last and ends with the line.
TEST_F(StepRecoveryTest, OneProcessRetriesWithTheReadingAndWhatTheMethodMadeOfIt) {
  test::TempDir out("step_recovery_one");
  RunHooks hooks;
  hooks.dist = DistOptions{};
  Session session(config_for_run(options(out.path())), hooks);
  session.events_open(Json::object());
  StepRecovery recovery(session);
  int failures = 0, collectives = 0;
  RecoverableStep step;
  step.failure = [&] {
    ++failures;
    return StepFailure{true, 24, true};
  };
  step.failed_collectives = [&] {
    ++collectives;
    return true;
  };

  step.body = [] {};
  const StepOutcome ran = recovery.run(1, step);
  EXPECT_FALSE(ran.out_of_memory);
  EXPECT_FALSE(ran.own.has_value());
  EXPECT_EQ(failures, 0);

  step.body = [] { recovery_oom_throw(); };
  const StepOutcome oom = recovery.run(1, step);
  EXPECT_TRUE(oom.out_of_memory);
  EXPECT_FALSE(oom.must_stop);
  EXPECT_TRUE(oom.beside_pool);
  EXPECT_TRUE(oom.in_pool_warmup);
  EXPECT_EQ(oom.batch, 24);
  ASSERT_TRUE(oom.own.has_value());
  EXPECT_EQ(oom.own->fields(),
            Json::parse(R"({"allocated_gb": 0.0, "reserved_gb": 0.0, "error": "tried to allocate 1 PiB"})"));
  EXPECT_TRUE(oom.ranks.is_null());
  EXPECT_EQ(failures, 1);
  EXPECT_EQ(collectives, 0);
  EXPECT_FALSE(recovery.agreed().has_value());

  step.body = [] { TORCH_CHECK(false, "not out of memory"); };
  EXPECT_THROW(recovery.run(1, step), c10::Error);
  EXPECT_EQ(failures, 1);

  EXPECT_EQ(test::error_of([&] { recovery.stop(7, Json{{"batch", 64}, {"retry_batch", 0}}, "no batch fits"); }),
            "no batch fits");
  const std::vector<Json> ooms = ooms_read(out.file("events.jsonl"));
  ASSERT_EQ(ooms.size(), 1u);
  std::vector<std::string> keys;
  for (const auto& [key, value] : ooms[0].items()) keys.push_back(key);
  EXPECT_EQ(keys, (std::vector<std::string>{"event", "step", "time_s", "batch", "retry_batch", "action"}));
  EXPECT_EQ(ooms[0]["step"], 7);
  EXPECT_EQ(ooms[0]["action"], "stopped");
}

// On two ranks every rank reads the same outcome: rank 1 runs out of memory and makes its collectives while rank 0's
// step runs; both retry at the batch rank 1 proposes (rank 0's own batch counts for nothing), name rank 1 with its
// reading, and agree no stop; a step that runs on both agrees the stop request; a rank whose update had begun when it
// ran out (its collectives say so) makes every rank stop.
TEST_F(StepRecoveryTest, TwoRanksReadTheSameOutcome) {
  test::TempDir out("step_recovery_two");
  const Config config = config_for_run(options(out.path()));
  const int port = free_local_port();
  std::vector<std::vector<StepOutcome>> outcomes(2);
  std::vector<std::vector<bool>> agreed(2);
  std::vector<int> collectives(2, 0);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        RunHooks hooks;
        DistOptions d;
        d.rank = r;
        d.world_size = 2;
        d.master_port = port;
        d.timeout = std::chrono::seconds(60);
        hooks.dist = d;
        Session session(config, hooks);
        StepRecovery recovery(session);
        bool update_begun = false;
        RecoverableStep step;
        step.body = [r] {
          if (r == 1) recovery_oom_throw();
        };
        step.failure = [] { return StepFailure{false, 16}; };
        step.failed_collectives = [&] {
          ++collectives[static_cast<size_t>(r)];
          return !update_begun;
        };
        const auto record = [&](const StepOutcome& o) {
          outcomes[static_cast<size_t>(r)].push_back(o);
          agreed[static_cast<size_t>(r)].push_back(recovery.agreed().has_value());
        };
        record(recovery.run(1, step));
        const RecoverableStep failed = step;
        step.body = [] {};
        record(recovery.run(1, step));
        update_begun = true;
        record(recovery.run(2, failed));
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(r);
    ASSERT_EQ(errors[static_cast<size_t>(r)], "");
    const std::vector<StepOutcome>& o = outcomes[static_cast<size_t>(r)];
    ASSERT_EQ(o.size(), 3u);
    EXPECT_TRUE(o[0].out_of_memory);
    EXPECT_FALSE(o[0].must_stop);
    EXPECT_FALSE(o[0].beside_pool);
    EXPECT_EQ(o[0].batch, 16);
    EXPECT_EQ(o[0].own.has_value(), r == 1);
    EXPECT_EQ(o[0].ranks, Json::parse(R"([{"rank": 1, "allocated_gb": 0.0, "reserved_gb": 0.0}])"));
    EXPECT_EQ(o[0].who, "rank 1 of 2");
    EXPECT_FALSE(agreed[static_cast<size_t>(r)][0]);
    EXPECT_FALSE(o[1].out_of_memory);
    EXPECT_TRUE(agreed[static_cast<size_t>(r)][1]);
    EXPECT_TRUE(o[2].out_of_memory);
    EXPECT_TRUE(o[2].must_stop);
    EXPECT_FALSE(agreed[static_cast<size_t>(r)][2]);
  }
  EXPECT_EQ(collectives[0], 0);
  EXPECT_EQ(collectives[1], 2);
}

}  // namespace
}  // namespace triaccel
