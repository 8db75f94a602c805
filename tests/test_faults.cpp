// Fault injection (train/faults.h) and the trainer's fault handling on the CPU: the plan parses and schedules as
// documented; an injected NaN/inf gradient or NaN-loss burst is skipped, logged, counted and retried on the same
// samples, and leaves no trace (the final weights equal a fault-free run's bit for bit); an injected out-of-memory
// error takes the half-batch retry path; a batch that keeps failing is dropped after the retry limit, counted;
// the fp16 loss scaler backs off on a skipped step as GradScaler does.
#include "test_util.h"
#include "triaccel/core/errors.h"
#include "triaccel/models/model.h"
#include "triaccel/train/faults.h"
#include "triaccel/train/loss_scaler.h"
#include "triaccel/optim/sgd.h"
#include "triaccel/train/step.h"
#include "triaccel/core/events.h"
#include "triaccel/methods/backprop_trainer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace triaccel {
namespace {

std::string error_of(const std::string& spec) {
  try {
    FaultPlan plan(spec);
  } catch (const UserError& e) {
    return e.what();
  }
  return "<no error>";
}

TEST(FaultPlanTest, ExplicitSpecSchedulesAttempts) {
  const FaultPlan plan("oom@5,nan-grad@9,inf-grad@12,nan-loss@20x3");
  EXPECT_FALSE(plan.empty());
  EXPECT_EQ(plan.fault_at(5, 0), FaultKind::kOom);
  EXPECT_EQ(plan.fault_at(5, 1), FaultKind::kNone);  // the retry of the same samples is clean
  EXPECT_EQ(plan.fault_at(4, 0), FaultKind::kNone);
  EXPECT_EQ(plan.fault_at(9, 0), FaultKind::kNanGrad);
  EXPECT_EQ(plan.fault_at(12, 0), FaultKind::kInfGrad);
  EXPECT_EQ(plan.fault_at(20, 0), FaultKind::kNanLoss);
  EXPECT_EQ(plan.fault_at(20, 2), FaultKind::kNanLoss);  // a burst of 3 attempts in a row
  EXPECT_EQ(plan.fault_at(20, 3), FaultKind::kNone);
  EXPECT_TRUE(FaultPlan("").empty());
}

TEST(FaultPlanTest, RandomSpecIsDeterministicWithTheStatedRates) {
  const FaultPlan a("random:seed=7,oom=0.02,nan-grad=0.05,nan-loss=0.01,burst=4");
  const FaultPlan b("random:seed=7,oom=0.02,nan-grad=0.05,nan-loss=0.01,burst=4");
  const FaultPlan c("random:seed=8,oom=0.02,nan-grad=0.05,nan-loss=0.01,burst=4");
  int oom = 0, nan_grad = 0, nan_loss = 0, differ = 0;
  for (int64_t step = 0; step < 20000; ++step) {
    const FaultKind k = a.fault_at(step, 0);
    EXPECT_EQ(k, b.fault_at(step, 0));
    differ += k != c.fault_at(step, 0);
    oom += k == FaultKind::kOom;
    nan_grad += k == FaultKind::kNanGrad;
    if (k == FaultKind::kNanLoss) {
      ++nan_loss;
      EXPECT_EQ(a.fault_at(step, 3), FaultKind::kNanLoss);  // burst=4: attempts 0..3
      EXPECT_EQ(a.fault_at(step, 4), FaultKind::kNone);
    } else {
      EXPECT_EQ(a.fault_at(step, 1), FaultKind::kNone);
    }
  }
  // Expected 400, ~980 (0.98 · 0.05 · 20000), ~186; bounds at about 5 standard deviations.
  EXPECT_NEAR(oom, 400, 100);
  EXPECT_NEAR(nan_grad, 980, 160);
  EXPECT_NEAR(nan_loss, 186, 70);
  EXPECT_GT(differ, 500);  // another seed, another plan
}

TEST(FaultPlanTest, MixedSpecExplicitStepsWinOverTheRandomPlan) {
  const FaultPlan plan("oom@3,random:seed=1,nan-grad=1");
  EXPECT_EQ(plan.fault_at(3, 0), FaultKind::kOom);
  EXPECT_EQ(plan.fault_at(3, 1), FaultKind::kNone);  // not the random plan's nan-grad on the retry
  EXPECT_EQ(plan.fault_at(2, 0), FaultKind::kNanGrad);
  EXPECT_EQ(plan.fault_at(4, 0), FaultKind::kNanGrad);
}

TEST(FaultPlanTest, BadSpecsNameTheItem) {
  EXPECT_NE(error_of("oom@y").find("'oom@y' needs an integer >= 0, got 'y'"), std::string::npos) << error_of("oom@y");
  EXPECT_NE(error_of("segfault@3").find("unknown fault 'segfault'"), std::string::npos);
  EXPECT_NE(error_of("oom").find("is not KIND@STEP[xN]"), std::string::npos);
  EXPECT_NE(error_of("oom=0.1").find("is not KIND@STEP[xN]"), std::string::npos);  // KEY=VALUE needs random:
  EXPECT_NE(error_of("nan-loss@3x0").find("needs an integer >= 1"), std::string::npos);
  EXPECT_NE(error_of("oom@3,nan-grad@3").find("two faults at step 3"), std::string::npos);
  EXPECT_NE(error_of("random:oom=0.1").find("needs seed=S"), std::string::npos);
  EXPECT_NE(error_of("random:seed=1,oom=2").find("needs a probability in [0, 1]"), std::string::npos);
  EXPECT_NE(error_of("random:seed=1,oom").find("KEY=VALUE"), std::string::npos);
}

// A c10::Error's one line is its message, options spelled by key, without the context and stack trace lines.
TEST(ErrorLineTest, ALibTorchErrorIsItsMessageWithoutTheStackTrace) {
  std::string line;
  try {
    TORCH_CHECK(false, option_ref("batch_size"), " must be > 0, got 0");
  } catch (const std::exception& e) {
    line = error_one_line(e);
  }
  EXPECT_EQ(line, "batch_size must be > 0, got 0");
  EXPECT_EQ(error_one_line(UserError(option_ref("vram_budget") + " is too small\nsecond line")),
            "vram_budget is too small");
}

// One TrainStep on the CPU with an fp16-style loss scaler: an injected NaN gradient skips the update (parameters,
// momentum and BatchNorm statistics as before), halves the scale and resets the growth tracker; a clean step then
// updates and keeps the scale.
TEST(FaultStepTest, SkippedStepChangesNothingAndBacksOffTheScale) {
  torch::manual_seed(0);
  ModelOptions mo;
  mo.name = "small-cnn";
  mo.num_classes = 10;
  mo.in_channels = 1;
  mo.image_size = 28;
  const std::shared_ptr<Model> model = model_create(mo);
  model->train();
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& item : model->named_parameters()) named.emplace_back(item.key(), item.value());
  Sgd sgd(named, SgdOptions{});
  LossScalerOptions lso;
  lso.enabled = true;
  LossScaler scaler(lso, torch::kCPU);
  StepOptions so;
  so.fault_injection = true;
  TrainStep step(*model, sgd, scaler, so, torch::kCPU);
  const at::Tensor images = torch::randn({8, 1, 28, 28});
  const at::Tensor labels = torch::randint(0, 10, {8}, torch::kLong);
  step.run(images, labels, 0.1);  // one clean step first, so momentum buffers exist
  ASSERT_FALSE(step.last_step_skipped());
  const auto snapshot = [&]() {
    std::vector<at::Tensor> out;
    for (const auto& [name, t] : model_state(*model)) out.push_back(t.clone());
    for (const auto& [name, t] : sgd.state_tensors()) out.push_back(t.clone());
    return out;
  };
  const auto same = [](const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      if (!torch::equal(a[i], b[i])) return false;
    }
    return true;
  };
  for (const FaultKind kind : {FaultKind::kNanGrad, FaultKind::kInfGrad, FaultKind::kNanLoss}) {
    SCOPED_TRACE(fault_kind_name(kind));
    const auto before = snapshot();
    const double scale_before = scaler.scale_tensor().item<double>();
    const double skipped_before = scaler.skipped_steps().item<double>();
    step.set_fault(kind);
    step.run(images, labels, 0.1);
    EXPECT_TRUE(step.last_step_skipped());
    step.skipped_step_restore();
    EXPECT_TRUE(same(before, snapshot())) << "a skipped step changed weights, buffers or momentum";
    EXPECT_EQ(scaler.scale_tensor().item<double>(), scale_before * 0.5);  // GradScaler's backoff
    EXPECT_EQ(scaler.growth_tracker().item<int>(), 0);
    EXPECT_EQ(scaler.skipped_steps().item<double>(), skipped_before + 1);
  }
  step.set_fault(FaultKind::kNone);
  const auto before = snapshot();
  const double scale_before = scaler.scale_tensor().item<double>();
  step.run(images, labels, 0.1);
  EXPECT_FALSE(step.last_step_skipped());
  EXPECT_FALSE(same(before, snapshot()));
  EXPECT_EQ(scaler.scale_tensor().item<double>(), scale_before);
  EXPECT_EQ(scaler.growth_tracker().item<int>(), 1);
}

class FaultTrainerTest : public test::TinyMnistTest {};

// The NaN/inf faults through the trainer: every faulted attempt is skipped and logged as a skip event, the
// same samples are retried, and since a skipped attempt leaves no trace (weights, momentum, BatchNorm statistics,
// RNG, data order), the run ends with exactly the weights of the fault-free run.
TEST_F(FaultTrainerTest, NanFaultsAreSkippedRetriedAndLeaveNoTrace) {
  test::TempDir clean("faults_clean");
  const Json clean_summary = api::run(options(clean.path()));
  test::TempDir faulty("faults_nan");
  Config o = options(faulty.path());
  o.set("inject_faults", "nan-grad@2,inf-grad@4,nan-loss@7x3");
  Spans spans(2);
  RunHooks hooks;
  record_batches(hooks, spans);
  const Json summary = api::run(o, hooks);
  expect_every_sample_once(spans, 384);
  EXPECT_EQ(summary["steps"], clean_summary["steps"]);
  EXPECT_EQ(summary["skipped_steps"], 5.0);
  EXPECT_EQ(summary["skip_retries"], 5);
  EXPECT_EQ(summary["injected_faults"], 5);
  EXPECT_EQ(summary["dropped_samples"], 0);
  EXPECT_EQ(summary["oom_retries"], 0);
  std::vector<std::string> reasons;
  std::vector<int64_t> steps;
  for (const auto& e : events_read(faulty.file("events.jsonl"))) {
    if (e["event"] != "skip") continue;
    reasons.push_back(e["reason"].get<std::string>());
    steps.push_back(e["step"].get<int64_t>());
    EXPECT_EQ(e["action"], "retry");
    EXPECT_EQ(e["injected"], true);
  }
  EXPECT_EQ(reasons, (std::vector<std::string>{"nan-grad", "inf-grad", "nan-loss", "nan-loss", "nan-loss"}));
  EXPECT_EQ(steps, (std::vector<int64_t>{2, 4, 7, 7, 7}));
  const auto wa = test::state_dict_read(clean.file("model.pt"));
  const auto wb = test::state_dict_read(faulty.file("model.pt"));
  ASSERT_EQ(wa.size(), wb.size());
  for (const auto& [name, t] : wa) EXPECT_TRUE(torch::equal(t, wb.at(name))) << name << " differs from the clean run";
}

// An injected out-of-memory error goes through the trainer's real retry path: half the batch on the same samples,
// an oom event marked injected, the counter in the summary.
TEST_F(FaultTrainerTest, InjectedOutOfMemoryRetriesAtHalfTheBatch) {
  test::TempDir out("faults_oom");
  Config o = options(out.path());
  o.set("inject_faults", "oom@2");
  Spans spans(2);
  RunHooks hooks;
  record_batches(hooks, spans);
  const Json summary = api::run(o, hooks);
  expect_every_sample_once(spans, 384);
  EXPECT_EQ(spans[0][2], (std::pair<int64_t, int64_t>{128, 32}));
  EXPECT_EQ(summary["oom_retries"], 1);
  EXPECT_EQ(summary["injected_faults"], 1);
  EXPECT_EQ(summary["steps"], 2 + (384 - 128) / 32 + 384 / 32);
  int oom_events = 0;
  for (const auto& e : events_read(out.file("events.jsonl"))) {
    if (e["event"] != "oom") continue;
    ++oom_events;
    EXPECT_EQ(e["injected"], true);
    EXPECT_EQ(e["retry_batch"], 32);
  }
  EXPECT_EQ(oom_events, 1);
}

// Samples that fail more than the retry limit allows are dropped for the epoch — counted, logged, and the run goes
// on; every other sample is still trained exactly once. nan-loss@1x8: attempts 0..7 at step 1 fail (the limit), so
// the second batch is dropped and the next batch, attempt 8 at the same step count, trains.
TEST_F(FaultTrainerTest, ABatchThatKeepsFailingIsDroppedAndCounted) {
  test::TempDir out("faults_drop");
  Config o = options(out.path());
  o.set("epochs", "1");
  o.set("inject_faults", "nan-loss@1x8");
  Spans spans(1);
  RunHooks hooks;
  record_batches(hooks, spans);
  const Json summary = api::run(o, hooks);
  EXPECT_EQ(summary["dropped_samples"], 64);
  EXPECT_EQ(summary["skip_retries"], 7);
  EXPECT_EQ(summary["skipped_steps"], 8.0);
  EXPECT_EQ(summary["steps"], 5);
  ASSERT_EQ(spans[0].size(), 5u);
  EXPECT_EQ(spans[0][0], (std::pair<int64_t, int64_t>{0, 64}));
  EXPECT_EQ(spans[0][1], (std::pair<int64_t, int64_t>{128, 64}));  // samples 64..127 dropped
  int drops = 0;
  for (const auto& e : events_read(out.file("events.jsonl"))) drops += e["event"] == "skip" && e["action"] == "drop";
  EXPECT_EQ(drops, 1);
}

}  // namespace
}  // namespace triaccel
