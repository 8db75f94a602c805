// The trainer end to end on the CPU, on a tiny MNIST-layout dataset the test writes itself: events.jsonl layout,
// learning, and bit-exact resume (a run stopped mid-epoch and resumed ends with exactly the weights, and the same
// per-epoch losses, as an uninterrupted run).
#include "test_util.h"
#include "triaccel/core/clock.h"
#include "triaccel/core/cuda_graph.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/events.h"
#include "triaccel/core/io.h"
#include "triaccel/methods/controller_registry.h"
#include "triaccel/models/registry.h"
#include "triaccel/optim/baoc_optimizer.h"
#include "triaccel/optim/sgd.h"
#include "triaccel/train/checkpoint.h"
#include "triaccel/train/step.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#ifdef TRIACCEL_WITH_CUDA
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <set>

namespace triaccel {
namespace {

class TrainerTest : public test::TinyMnistTest {};

TEST_F(TrainerTest, EventsLayoutAndLearning) {
  test::TempDir out("run");
  const Json summary = api::run(options(out.path()));
  const auto events = events_read(out.file("events.jsonl"));
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.front()["event"], "config");
  EXPECT_EQ(events.back()["event"], "summary");
  int epochs = 0;
  for (const auto& e : events) {
    EXPECT_TRUE(e.contains("step") && e.contains("time_s")) << e.dump();
    if (e["event"] == "epoch") ++epochs;
  }
  EXPECT_EQ(epochs, 2);
  for (const char* key : {"test_acc", "epoch_s", "peak_vram_gb", "eff_score", "params", "method", "model", "dataset"}) {
    EXPECT_TRUE(events.back().contains(key)) << key;
  }
  EXPECT_EQ(summary["steps"], 12);
  EXPECT_EQ(summary["model"], "small-cnn");
  // Labels shift the image brightness: chance is 10 %, a working trainer learns far more in 12 steps.
  EXPECT_GT(summary["test_acc"].get<double>(), 40.0) << summary.dump();
  EXPECT_TRUE(std::filesystem::exists(out.file("model.pt")));
  EXPECT_TRUE(std::filesystem::exists(out.file("checkpoint.pt")));
}

// A new controller is its own class and one registry entry (docs/architecture.md, "a controller"): registered from
// here, it runs after every step of a run, its events reach events.jsonl, its state reaches the checkpoint and a
// resumed run restores it; unregistered, a run no longer builds it.
class StepCounter final : public StepController {
 public:
  explicit StepCounter(std::vector<int64_t>* seen) : seen_(seen) {}
  const char* state_key() const override { return "step_counter"; }
  Events after_step(StepContext& ctx) override {
    seen_->push_back(ctx.step);
    ++calls_;
    if (calls_ % 5 == 0) return {Event{"step_counter", Json{{"calls", calls_}}}};
    return {};
  }
  Json state() const override { return Json{{"calls", calls_}}; }
  void restore(const Json& state) override { calls_ = state.value("calls", int64_t{0}); }

 private:
  std::vector<int64_t>* seen_;
  int64_t calls_ = 0;
};

TEST_F(TrainerTest, ARegisteredControllerRunsAfterEveryStepAndResumes) {
  const std::vector<std::string> builtin = {"curvature", "precision", "baoc", "measure_window", "elastic_batch",
                                            "memory_plan"};
  auto names = [] {
    std::vector<std::string> out;
    for (const auto& e : controller_registry()) out.push_back(e.name);
    return out;
  };
  EXPECT_EQ(names(), builtin);  // the order they act in: the memory planner last, after precision decisions
  test::TempDir out("run");
  std::vector<int64_t> seen;
  {
    ControllerRegistration counter({"step_counter", [&seen](ControllerParts&) {
                                      return std::make_unique<StepCounter>(&seen);
                                    }});
    Config first = options(out.path());
    first.set("max_steps", "4");
    api::run(first);
    EXPECT_EQ(seen, (std::vector<int64_t>{1, 2, 3, 4}));
    EXPECT_EQ(checkpoint_read(out.file("checkpoint.pt")).progress["controllers"]["step_counter"]["calls"], 4);

    Config again = options(out.path());
    again.set("resume", out.path());
    api::run(again);  // 12 steps in all: the counter restored at 4 counts on to 12
    EXPECT_EQ(seen.size(), 12u);
    EXPECT_EQ(seen.back(), 12);
    EXPECT_EQ(checkpoint_read(out.file("checkpoint.pt")).progress["controllers"]["step_counter"]["calls"], 12);
    int logged = 0;
    for (const auto& e : events_read(out.file("events.jsonl"))) {
      if (e["event"] == "step_counter") EXPECT_EQ(e["calls"], 5 * ++logged);
    }
    EXPECT_EQ(logged, 2);  // at calls 5 and 10, both after the resume
  }
  EXPECT_EQ(names(), builtin);
  test::TempDir plain("plain");
  Config c = options(plain.path());
  c.set("max_steps", "2");
  api::run(c);
  EXPECT_EQ(seen.size(), 12u);  // no longer built
}

// An out-of-memory error outside a training step (here a controller's, after step 3; on the H200 BAOC's under
// --data-placement device) reaches the user as one line naming the allocation and the way on, not an internal error.
class OutOfMemoryAfterStep final : public StepController {
 public:
  const char* state_key() const override { return "oom_after_step"; }
  Events after_step(StepContext& ctx) override {
    TORCH_CHECK_WITH(OutOfMemoryError, ctx.step != 3,
                     "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 139.80 GiB");
    return {};
  }
};

TEST_F(TrainerTest, AnOutOfMemoryOutsideTheStepIsOneLineForTheUser) {
  test::TempDir out("run_oom");
  const ControllerRegistration failing({"oom_after_step", [](ControllerParts&) {
                                          return std::make_unique<OutOfMemoryAfterStep>();
                                        }});
  Config c = options(out.path());
  c.set("checkpoint_every", "2");
  try {
    api::run(c);
    FAIL() << "the run went on";
  } catch (const UserError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("ran out of GPU memory outside a training step (Tried to allocate 20.00 MiB)"), std::string::npos)
        << m;
    EXPECT_NE(m.find("vram_budget"), std::string::npos) << m;
    EXPECT_NE(m.find("continue from the last checkpoint with resume " + out.path()), std::string::npos) << m;
  }
  EXPECT_EQ(checkpoint_read(out.file("checkpoint.pt")).progress["step"], 2);  // what was saved stays
}

TEST_F(TrainerTest, ResumeMidEpochIsBitExact) {
  test::TempDir a("run_a"), b("run_b");
  api::run(options(a.path()));

  Config first = options(b.path());
  first.set("max_steps", "4");  // stops inside epoch 1 (6 steps per epoch)
  const Json stop = api::run(first);
  EXPECT_EQ(stop["reason"], "max_steps");
  EXPECT_FALSE(std::filesystem::exists(b.file("model.pt")));

  Config again = options(b.path());
  again.set("resume", b.path());
  api::run(again);

  const auto wa = test::state_dict_read(a.file("model.pt"));
  const auto wb = test::state_dict_read(b.file("model.pt"));
  ASSERT_EQ(wa.size(), wb.size());
  for (const auto& [name, t] : wa) {
    ASSERT_TRUE(wb.count(name)) << name;
    EXPECT_TRUE(torch::equal(t, wb.at(name))) << name << " differs after resume";
  }
  // Per-epoch test losses equal exactly, and epoch 2 (trained entirely after the resume) has the same train loss.
  std::vector<Json> ea, eb;
  for (const auto& e : events_read(a.file("events.jsonl"))) if (e["event"] == "epoch") ea.push_back(e);
  for (const auto& e : events_read(b.file("events.jsonl"))) if (e["event"] == "epoch") eb.push_back(e);
  ASSERT_EQ(ea.size(), 2u);
  ASSERT_EQ(eb.size(), 2u);
  EXPECT_EQ(ea[0]["test_loss"], eb[0]["test_loss"]);
  EXPECT_EQ(ea[1]["test_loss"], eb[1]["test_loss"]);
  EXPECT_EQ(ea[1]["train_loss"], eb[1]["train_loss"]);
}

// A stop request (the CLI's SIGINT) after step 4: the step in flight finishes, a checkpoint and a stop event with the
// reason are written, and the resumed run ends with the uninterrupted run's weights bit for bit.
TEST_F(TrainerTest, StopRequestCheckpointsAndResumesBitExactly) {
  test::TempDir a("run_a"), b("run_b");
  api::run(options(a.path()));

  int64_t last_step = 0;
  RunHooks hooks;
  hooks.after_step = [&](int64_t step) { last_step = step; };
  hooks.stop_requested = [&] { return last_step >= 4 ? StopRequest::kInterrupt : StopRequest::kNone; };
  const Json stop = api::run(options(b.path()), hooks);
  EXPECT_EQ(stop["reason"], "sigint");
  EXPECT_EQ(last_step, 4);
  EXPECT_FALSE(std::filesystem::exists(b.file("model.pt")));
  const auto events = events_read(b.file("events.jsonl"));
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events[events.size() - 2]["event"], "checkpoint");
  EXPECT_EQ(events.back()["event"], "stop");
  EXPECT_EQ(events.back()["step"], 4);
  EXPECT_TRUE(events.back()["peak_vram_gb"].is_number());  // judged against a budget (bench/budget_grid.py)
  EXPECT_EQ(events.back().value("dropped_samples", int64_t{-1}), 0);  // -1: missing (a failure, not an abort)
  EXPECT_TRUE(events.back().contains("memory_plan"));  // the summary's brief of the plan in force (null: none)
  EXPECT_EQ(checkpoint_read(b.file(kCheckpointFile)).progress["step"], 4);

  Config again = options(b.path());
  again.set("resume", b.path());
  api::run(again);
  const auto wa = test::state_dict_read(a.file("model.pt"));
  const auto wb = test::state_dict_read(b.file("model.pt"));
  ASSERT_EQ(wa.size(), wb.size());
  for (const auto& [name, t] : wa) EXPECT_TRUE(torch::equal(t, wb.at(name))) << name << " differs after resume";
}

// checkpoint_minutes on the run's clock: a clock that advances 1 s per reading makes the time between checkpoints a
// count of readings, so the checkpoints fall inside the epochs (where steps alone would write them only at epoch
// ends), and 0 turns them off.
TEST_F(TrainerTest, CheckpointsByTimeOnTheRunsClock) {
  const auto mid_epoch_checkpoints = [&](const std::string& minutes) {
    test::TempDir out("run");
    Config c = options(out.path());
    c.set("checkpoint_minutes", minutes);
    const FixedStepClock clock(1.0);
    RunHooks hooks;
    hooks.clock = &clock;
    api::run(c, hooks);
    int n = 0;
    for (const auto& e : events_read(out.file("events.jsonl"))) {
      if (e["event"] == "checkpoint" && e["epoch_offset"].get<int64_t>() != 0) ++n;
    }
    return n;
  };
  EXPECT_EQ(mid_epoch_checkpoints("0"), 0);
  EXPECT_GT(mid_epoch_checkpoints("0.05"), 2);  // every 3 s of this clock: more than once per epoch
}

// The same for the AdamW and BAOC optimizers: BAOC plans after 2 steps and re-plans every 3 (plans at steps 2, 5, 8,
// 11; statistics windows 1–2, 4–5, 7–8, 10–11), so the stop at step 4 falls inside a window and between plans.
TEST_F(TrainerTest, ResumeMidEpochIsBitExactWithAdamWAndBaoc) {
  for (const std::string optimizer : {"adamw", "baoc"}) {
    test::TempDir a("run_opt_a"), b("run_opt_b");
    auto configure = [&](Config o) { return with_optimizer(std::move(o), optimizer); };
    api::run(configure(options(a.path())));
    Config first = configure(options(b.path()));
    first.set("max_steps", "4");
    api::run(first);
    Config again = configure(options(b.path()));
    again.set("resume", b.path());
    api::run(again);
    const auto wa = test::state_dict_read(a.file("model.pt"));
    const auto wb = test::state_dict_read(b.file("model.pt"));
    for (const auto& [name, t] : wa) {
      EXPECT_TRUE(torch::equal(t, wb.at(name))) << optimizer << ": " << name << " differs after resume";
    }
    std::vector<Json> pa, pb;
    for (const auto& e : events_read(a.file("events.jsonl"))) if (e["event"] == event::kOptimPlan) pa.push_back(e);
    for (const auto& e : events_read(b.file("events.jsonl"))) if (e["event"] == event::kOptimPlan) pb.push_back(e);
    if (optimizer == "baoc") {
      ASSERT_EQ(pa.size(), 4u);  // steps 2, 5, 8, 11
      ASSERT_EQ(pb.size(), 4u);
      for (size_t i = 0; i < pa.size(); ++i) {
        EXPECT_EQ(pa[i]["units"], pb[i]["units"]) << "plan " << i;
        EXPECT_LE(pa[i]["total_bytes"].get<int64_t>(), pa[i]["budget_bytes"].get<int64_t>());
      }
      const Json summary = events_read(a.file("events.jsonl")).back();
      EXPECT_EQ(summary["optimizer"], "baoc");
      EXPECT_LE(summary["optim_state_bytes"].get<double>(), 0.2 * summary["adamw_fp32_state_bytes"].get<double>());
    } else {
      EXPECT_TRUE(pa.empty());
    }
  }
}

// On a GPU with CUDA graphs: the peak after --plan-warmup holds a whole step for fp32 AdamW as for BAOC. The graph is
// captured at step 4, before the reset at step 8; both then re-capture (BAOC's plan drops its graph, AdamW's is
// dropped at the reset). Before, AdamW kept replaying the warm-up's graph, its window showed only the static bytes,
// and BAOC, which holds less state, looked as if it needed more memory.
TEST_F(TrainerTest, PeakAfterTheWarmUpHoldsAWholeStepForAdamWAndBaoc) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  for (const std::string optimizer : {"adamw", "baoc"}) {
    test::TempDir out("run_peak_" + optimizer);
    Config o = options(out.path());
    o.set("device", "cuda");
    o.set("optimizer", optimizer);
    o.set("lr", "2e-3");
    o.set("plan_warmup", "8");
    o.set("optim_memory_budget", "15%");
    api::run(o);
    const auto events = events_read(out.file("events.jsonl"));
    const Json& summary = events.back();
    int64_t captures = 0;
    for (const auto& e : events) if (e["event"] == "epoch") captures = e["graph_captures"].get<int64_t>();
    EXPECT_GE(captures, 2) << optimizer << ": no capture after the warm-up";
    const double after = summary["peak_vram_gb"].get<double>(), warmup = summary["peak_vram_warmup_gb"].get<double>();
    // Static bytes: weights, gradients and at most fp32 AdamW's two moments (16 B per parameter) and the resident
    // dataset. One step's activations of the small CNN at batch 64 add more than 5 MB (its first conv's fp32 output
    // alone is 64·32·28·28·4 B = 6.4 MB), which a window of replays of an older graph would not show.
    const double static_gb = 16.0 * events.front()["params"].get<double>() / 1e9 +
                             events.front()["dataset_resident_gb"].get<double>();
    std::printf("[ %s ] peak in the warm-up %.4f GB, after it %.4f GB, static %.4f GB\n", optimizer.c_str(), warmup,
                after, static_gb);
    // Unverified: this assertion has not been shown to fail with the fix of 5540a98 (AdamW re-captures its graph
    // after --plan-warmup) removed; that needs a GPU run, none was made when this note was written (2026-11-21).
    EXPECT_GT(after, static_gb + 0.005) << optimizer << ": the peak after the warm-up shows only the static bytes";
  }
}

// On a GPU the epoch's short last batch (384 = 4 · 80 + 64) and the evaluation run in the captured graph's pool,
// with a budget as without: the graph is captured once for the whole run (under a budget it used to be released
// before each short batch and captured again every epoch), no out-of-memory event, every sample once.
TEST_F(TrainerTest, TheShortBatchAndTheEvaluationRunInTheGraphsPool) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  for (const bool budget : {true, false}) {
    test::TempDir out(budget ? "run_short_budget" : "run_short_free");
    Config o = options(out.path());
    o.set("device", "cuda");
    o.set("batch_size", "80");
    if (budget) o.set("vram_budget", "1GB");
    api::run(o);
    int64_t captures = 0, ooms = 0;
    for (const auto& e : events_read(out.file("events.jsonl"))) {
      if (e["event"] == "epoch") {
        captures = e["graph_captures"].get<int64_t>();
        EXPECT_EQ(e["samples"], 384);
      }
      if (e["event"] == "oom") ++ooms;
    }
    EXPECT_EQ(ooms, 0) << "budget " << budget;
    EXPECT_EQ(captures, 1) << "budget " << budget;
  }
}

// Cutout (with crop and flip) on the 28×28 images: it changes what is trained, a resumed run still ends bit-exactly
// where an uninterrupted one does (the squares are a function of seed and epoch), and --cutout may not change on
// resume.
TEST_F(TrainerTest, ResumeMidEpochIsBitExactWithCutout) {
  test::TempDir plain("run_cut_plain"), a("run_cut_a"), b("run_cut_b");
  auto configure = [](Config o) {
    o.set("augment", "on");
    o.set("cutout", "10");
    return o;
  };
  Config no_cutout = configure(options(plain.path()));
  no_cutout.set("cutout", "0");
  api::run(no_cutout);
  api::run(configure(options(a.path())));
  Config first = configure(options(b.path()));
  first.set("max_steps", "4");
  api::run(first);
  const auto config = events_read(b.file("events.jsonl")).front();
  EXPECT_EQ(config["options"]["cutout"], 10) << config.dump();

  Config changed = options(b.path());
  changed.set("resume", b.path());
  changed.set("cutout", "8");
  try {
    config_for_run(changed);
    FAIL() << "expected UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("cutout 8 differs from the checkpoint's 10"), std::string::npos) << e.what();
  }
  Config again = options(b.path());
  again.set("resume", b.path());
  const Config resumed = config_for_run(again);
  EXPECT_EQ(resumed.data.cutout, 10);
  api::run(resumed);

  const auto wp = test::state_dict_read(plain.file("model.pt"));
  const auto wa = test::state_dict_read(a.file("model.pt"));
  const auto wb = test::state_dict_read(b.file("model.pt"));
  bool differs_from_plain = false;
  for (const auto& [name, t] : wa) {
    ASSERT_TRUE(wb.count(name)) << name;
    EXPECT_TRUE(torch::equal(t, wb.at(name))) << name << " differs after resume";
    differs_from_plain = differs_from_plain || !torch::equal(t, wp.at(name));
  }
  EXPECT_TRUE(differs_from_plain) << "--cutout 10 trained the same weights as no cutout";
}

// --lr-decay linear reaches the trainer: 6 steps an epoch, 3 warm-up steps, 9 decay steps; the epoch event logs the
// lr of the epoch's last step (step 5: 7/9 of the peak on the line, 0.883 of it on the cosine).
TEST_F(TrainerTest, LinearDecayIsTheLoggedRate) {
  test::TempDir out("run_linear");
  Config o = options(out.path());
  o.set("lr_decay", "linear");
  api::run(o);
  std::vector<Json> epochs;
  for (const auto& e : events_read(out.file("events.jsonl"))) if (e["event"] == "epoch") epochs.push_back(e);
  ASSERT_EQ(epochs.size(), 2u);
  EXPECT_NEAR(epochs[0]["lr"].get<double>(), 0.05 * 7.0 / 9.0, 1e-12);
  EXPECT_NEAR(epochs[1]["lr"].get<double>(), 0.05 * 1.0 / 9.0, 1e-12);  // step 11
}

// profile_steps: a Chrome trace of exactly the steps asked for (each one a "triaccel::step" range on the host), a
// `profile` event naming them; a window past the run's end is written at the end with the steps that ran.
TEST_F(TrainerTest, ProfileStepsTracesExactlyThoseSteps) {
  const auto step_ranges = [](const std::string& path) {
    const Json trace = Json::parse(file_read_all(path));
    int n = 0;
    for (const auto& e : trace["traceEvents"]) n += e.value("name", "") == "triaccel::step" && e.value("ph", "") == "X";
    return n;
  };
  const auto profile_event = [](const std::string& events) {
    for (const auto& e : events_read(events)) if (e["event"] == "profile") return e;
    return Json();
  };
  test::TempDir out("run_profile");
  Config o = options(out.path());
  o.set("profile_steps", "3:5");
  api::run(o);
  EXPECT_EQ(step_ranges(out.file("profile.json")), 2);
  const Json e = profile_event(out.file("events.jsonl"));
  EXPECT_EQ(e["steps"], Json::array({3, 5})) << e.dump();
  EXPECT_EQ(e["file"], "profile.json");
  EXPECT_EQ(e["step"], 5);

  test::TempDir past("run_profile_past");
  Config q = options(past.path());
  q.set("profile_steps", "10:100");  // 12 steps in the run
  api::run(q);
  EXPECT_EQ(step_ranges(past.file("profile.json")), 2);
  EXPECT_EQ(profile_event(past.file("events.jsonl"))["steps"], Json::array({10, 12}));

  Config bad = options(past.path());
  bad.set("profile_steps", "7:3");
  EXPECT_NE(test::error_of([&] { config_for_run(bad).validate(); }).find("profile_steps must be FIRST:END"),
            std::string::npos);
}

// The curvature estimator's default: the Fisher where it can run (curv_top_k 1: its lockstep rounds find the top
// eigenvalue only), the Hessian for k > 1; a given estimator stays, and the Fisher with k > 1 is refused.
TEST_F(TrainerTest, TheFisherIsTheDefaultEstimatorWhereItCanRun) {
  test::TempDir out("run_estimator");
  Config o = options(out.path());
  o.set("method", "tri-accel");
  EXPECT_EQ(config_for_run(o).tri_accel.curv_estimator, CurvatureEstimator::kFisher);
  Config k3 = o;
  k3.set("curv_top_k", "3");
  const Config resolved = config_for_run(k3);
  EXPECT_EQ(resolved.tri_accel.curv_estimator, CurvatureEstimator::kHessian);
  EXPECT_NO_THROW(resolved.validate());
  Config hessian = o;
  hessian.set("curv_estimator", "hessian");
  EXPECT_EQ(config_for_run(hessian).tri_accel.curv_estimator, CurvatureEstimator::kHessian);
  k3.set("curv_estimator", "fisher");
  EXPECT_THROW(config_for_run(k3).validate(), UserError);
}

TEST_F(TrainerTest, ResumeRefusesAChangedIdentity) {
  test::TempDir b("run_c");
  Config first = options(b.path());
  first.set("max_steps", "2");
  api::run(first);
  Config again = options(b.path());
  again.set("resume", b.path());
  again.set("model", "resnet18");
  try {
    config_for_run(again);
    FAIL() << "expected UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("model \"resnet18\" differs from the checkpoint's \"small-cnn\""),
              std::string::npos)
        << e.what();
  }
}

// Out of memory (injected at the step's start): the step is retried on the same samples at half the batch, the run
// continues at that batch, and every sample of every epoch is trained exactly once.
TEST_F(TrainerTest, OutOfMemoryRetriesTheSameSamplesAtASmallerBatch) {
  test::TempDir out("run_oom");
  Config o = options(out.path());  // 384 samples, batch 64, 2 epochs
  RunHooks hooks;
  int injected = 0;
  hooks.before_step = [&](int64_t step, int64_t batch) {
    if (step == 2 && batch == 64 && injected++ == 0) {
      throw c10::OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, __LINE__}, "injected out of memory");
    }
  };
  Spans spans(2);
  record_batches(hooks, spans);
  const Json summary = api::run(o, hooks);
  EXPECT_EQ(injected, 1);
  expect_every_sample_once(spans, 384);
  EXPECT_EQ(spans[0][2], (std::pair<int64_t, int64_t>{128, 32}));  // the failed step's samples, retried at 32
  EXPECT_EQ(summary["steps"], 2 + (384 - 128) / 32 + 384 / 32);
  int oom_events = 0;
  for (const auto& e : events_read(out.file("events.jsonl"))) {
    if (e["event"] == "oom") {
      ++oom_events;
      EXPECT_EQ(e["batch"], 64);
      EXPECT_EQ(e["retry_batch"], 32);
    }
  }
  EXPECT_EQ(oom_events, 1);
}

// Tri-Accel's elastic batch, driven by a made-up memory signal (the CPU has no allocator statistics): the batch
// grows while the peak is under rho_low·budget and the predicted peak stays under rho_high·budget, shrinks when the
// peak passes rho_high·budget, every epoch still trains each sample exactly once, and the schedule follows the data
// (position in units of the initial batch), so it ends at the end of the last epoch.
TEST_F(TrainerTest, ElasticBatchFollowsTheMemorySignal) {
  test::TempDir out("run_elastic");
  Config o = options(out.path());  // 384 samples, batch 64, 2 epochs
  o.set("method", "tri-accel");
  o.set("ta_precision", "false");
  o.set("ta_curvature", "false");
  o.set("ctrl_every", "1");
  o.set("vram_budget", "1GB");
  o.set("batch_policy", "elastic");  // the paper's rule (fixed, the default, keeps the batch and plans memory)
  RunHooks hooks;
  hooks.memory_signal = [](int64_t step, int64_t batch) {
    const double per_sample = step >= 6 ? 8e6 : 5e6;  // at step 6 the model "needs" more memory per sample
    MemorySignal m;
    m.static_bytes = 200'000'000;
    m.peak_bytes = m.static_bytes + static_cast<int64_t>(per_sample * static_cast<double>(batch));
    return m;
  };
  Spans spans(2);
  record_batches(hooks, spans);
  const Json summary = api::run(o, hooks);
  expect_every_sample_once(spans, 384);
  std::vector<int64_t> batches;
  std::vector<std::string> reasons;
  Json last_epoch;
  for (const auto& e : events_read(out.file("events.jsonl"))) {
    if (e["event"] == "batch") {
      batches.push_back(e["batch"].get<int64_t>());
      reasons.push_back(e["reason"].get<std::string>());
      EXPECT_DOUBLE_EQ(e["budget_gb"].get<double>(), 1.0);
    }
    if (e["event"] == "epoch") last_epoch = e;
  }
  // 64 → 96 → 128 (0.2 + 128·0.005 = 0.84 GB: hold); per-sample 8 MB from step 6: 128 → 96 → 64 (0.712 GB: hold).
  EXPECT_EQ(batches, (std::vector<int64_t>{96, 128, 128, 128, 128, 96, 64, 64}));
  EXPECT_EQ(reasons.front(), "grow");
  EXPECT_EQ(reasons[5], "shrink");
  EXPECT_EQ(summary["steps"], 8);
  // The last step starts at position 6 + 352/64 = 11.5 of 12: lr = 0.05 · (1 + cos(π·8.5/9)) / 2 ≈ 3.8e-4. A schedule
  // by step count (step 7 of 12) would still be at ≈ 0.03.
  EXPECT_NEAR(last_epoch["lr"].get<double>(), 0.05 * 0.5 * (1 + std::cos(M_PI * 8.5 / 9)), 1e-9);
}

// Lockstep rounds (--curv-lockstep true, k = 1; --curv-estimator fisher runs them too, here with --curv-cudnn off):
// every probe event covers every unit, so α is calibrated at the first and the lr scales leave 1 there. The run's
// length is known, so the rounds its budget pays for are spread evenly over it (round_pace_due): on a clock of 1 ms a
// reading, a 75 % budget and 8 epochs of 6 steps, rounds at steps 2, 14, 26, 38 (at 50 % with the precision
// controller's readings too, 2, 18, 34; the credit advanced by the first round's unpaid share had put those at 2, 22,
// 42, a gap this test refuses). Curvature alone: the precision controller's bf16 convolutions took ~40 s a run here.
TEST_F(TrainerTest, LockstepRoundsProbeEveryUnitEachTime) {
  for (const std::string estimator : {"hessian", "fisher"}) {
    SCOPED_TRACE(estimator);
    test::TempDir out("run_lockstep_" + estimator);
    FixedStepClock clock(1e-3);
    RunHooks hooks;
    hooks.clock = &clock;
    Config o = with_tri_accel(options(out.path()), "0.75");
    o.set("ta_precision", "false");
    o.set("curv_top_k", "1");
    o.set("epochs", "8");
    if (estimator == "hessian") o.set("curv_lockstep", "true");
    if (estimator == "fisher") o.set("curv_cudnn", "off");  // auto keeps cuDNN for small-cnn (no grouped convolutions)
    o.set("curv_estimator", estimator);
    api::run(o, hooks);
    std::vector<int64_t> steps;
    Json last;
    for (const auto& e : events_read(out.file("events.jsonl"))) {
      if (e["event"] != "curvature") continue;
      steps.push_back(e["step"].get<int64_t>());
      last = e;
      EXPECT_TRUE(e["lockstep"].get<bool>());
      EXPECT_EQ(e["estimator"], estimator);
      EXPECT_EQ(e["cudnn"].get<bool>(), estimator == "hessian");
      EXPECT_EQ(e["probed"].size(), 4u);
      for (const auto& l : e["lambda_max"]) EXPECT_FALSE(l.is_null());
      EXPECT_GT(e["round_cost_s"].get<double>(), 0.0);
      EXPECT_GT(e["alpha"].get<double>(), 0.0);
      const auto scales = e["lr_scale"].get<std::vector<double>>();
      EXPECT_LT(*std::min_element(scales.begin(), scales.end()), 1.0);
      std::printf("[ %s ] round at step %ld: %.3f s (planned %.3f), next at %ld, %.3f s of %.3f s training\n",
                  estimator.c_str(), static_cast<long>(e["step"].get<int64_t>()), e["probe_s"].get<double>(),
                  e["round_cost_s"].get<double>(), static_cast<long>(e["next_probe_step"].get<int64_t>()),
                  e["probe_s_total"].get<double>(), e["training_s"].get<double>());
    }
    ASSERT_GE(steps.size(), 3u);
    // An even pace over the whole run: no gap longer than a third of it, a round in its last third, and the rounds
    // within the run's budget plus one round.
    for (size_t i = 1; i < steps.size(); ++i) EXPECT_LE(steps[i] - steps[i - 1], 16);
    EXPECT_GE(steps.back(), 32);
    const double training_per_step = last["training_s"].get<double>() / static_cast<double>(steps.back());
    EXPECT_LE(last["probe_s_total"].get<double>(),
              0.75 * training_per_step * 48 + last["round_cost_s"].get<double>());
  }
}

// GPU, without a memory planner (Tri-Accel's curvature alone, AMP bf16 steps): a probe takes the samples that fit
// under the training steps' own peak, so the run peaks where the same steps without probes do, up to the first
// probe's prediction error (two small probes, a straight line; a probe above it raises the unit's fixed bytes). 128
// probe samples of fp32 double backward need several times what a step of 64 bf16 samples holds; a build that
// ignores the room fails here (its probes carry no room and take all 128). Each run starts without cuBLAS's
// workspaces (32 MiB a stream on Hopper, kept by the process): the second run of a process otherwise starts with the
// first one's (0.145 against 0.076 GB before they were cleared, with the room respected).
TEST_F(TrainerTest, WithoutAPlanAProbeStaysInsideTheStepsPeak) {
  TRIACCEL_SKIP_WITHOUT_GPU();
#ifdef TRIACCEL_WITH_CUDA
  FixedStepClock clock(1e-3);
  RunHooks hooks;
  hooks.clock = &clock;
  const auto gpu_run = [&hooks](Config c) {
    c.set("device", "cuda");
    c.set("precision", "amp-bf16");
    c.set("cudnn_autotune", "off");  // both runs' convolutions alike
    at::cuda::clearCublasWorkspaces();
    return api::run(c, hooks);
  };
  test::TempDir plain_dir("run_room_plain");
  const Json plain = gpu_run(options(plain_dir.path()));
  test::TempDir out("run_room_probed");
  Config probed = with_tri_accel(options(out.path()), "0");
  probed.set("ta_precision", "false");
  probed.set("curv_batch", "128");
  const Json summary = gpu_run(probed);
  int probes = 0;
  std::string seen;  // each probe's samples, bytes and room, for the failure messages
  for (const auto& e : events_read(out.file("events.jsonl"))) {
    if (e["event"] != "curvature" || !e.contains("probed")) continue;
    ++probes;
    ASSERT_TRUE(e["room_bytes"].is_number()) << e.dump();
    const auto samples = e["probe_samples"].get<std::vector<int64_t>>();
    seen += c10::str(" [step ", e["step"].get<int64_t>(), ": ", samples.size(), " samples, ",
                     e["probe_bytes"].get<double>(), " of ", e["room_bytes"].get<double>(), " bytes]");
    EXPECT_GE(samples.size(), 2u);
    EXPECT_LT(samples.size(), 128u) << seen;  // trimmed to the room
  }
  EXPECT_GT(probes, 0);
  // The first probe's error was 1.2–2 MB on the H100 (in a process of other tests, the plain run peaked at 18 MB).
  EXPECT_LE(summary["peak_vram_gb"].get<double>(), plain["peak_vram_gb"].get<double>() * 1.05 + 0.004)
      << "probed " << summary["peak_vram_gb"] << " GB, plain " << plain["peak_vram_gb"] << " GB;" << seen;
#endif
}

// The Tri-Accel loop on the CPU: probes and precision windows happen on schedule, thresholds calibrate, the
// decisions reach the events, and a resumed run restores the controllers' state. Time comes from a clock that
// advances 1 ms per reading, so the time-budgeted probe schedule depends on the work done, not on the machine's load.
TEST_F(TrainerTest, TriAccelLoopRunsAndLogsItsDecisions) {
  test::TempDir out("run_tri");
  FixedStepClock clock(1e-3);
  RunHooks hooks;
  hooks.clock = &clock;
  // The fixed schedule: 12 steps → windows at 2, 4, …, 12; probes at 2 (first window), 6, 10.
  Config o = with_tri_accel(options(out.path()), "0");
  Config checked = o;
  checked.set("curv_checkpoint", "true");
  const Json summary = api::run(checked, hooks);
  int precision_events = 0, curvature_events = 0;
  Json last_precision;
  std::vector<at::Tensor> probed_weights;  // the first unit's weight in each probe's checkpoint
  const std::set<std::string> reasons{"calibrating", "low variance", "variance", "high variance", "curvature", "memory"};
  for (const auto& e : events_read(out.file("events.jsonl"))) {
    if (e["event"] == "precision") {
      ++precision_events;
      last_precision = e;
      EXPECT_EQ(e["step"].get<int64_t>() % 2, 0);
      ASSERT_EQ(e["reason"].size(), 4u);  // why each unit is where it is
      for (const auto& r : e["reason"]) EXPECT_EQ(reasons.count(r.get<std::string>()), 1u) << r;
    }
    if (e["event"] == "curvature") {
      ++curvature_events;
      ASSERT_EQ(e["lambda_max"].size(), 4u);  // one per unit
      // The default's scales are at mean 1 (curv_lr_mean): 1 lies between the sharpest unit's and the flattest's.
      const auto scales = e["lr_scale"].get<std::vector<double>>();
      for (double l : scales) EXPECT_GT(l, 0.0);
      EXPECT_LE(*std::min_element(scales.begin(), scales.end()), 1.0 + 1e-9) << e["lr_scale"];
      EXPECT_GE(*std::max_element(scales.begin(), scales.end()), 1.0 - 1e-9) << e["lr_scale"];
      // What an independent check needs: the probe batch's sample indices and the weights it probed.
      const auto samples = e["probe_samples"].get<std::vector<int64_t>>();
      EXPECT_EQ(samples.size(), 16u);
      EXPECT_EQ(std::set<int64_t>(samples.begin(), samples.end()).size(), 16u);
      const Checkpoint at_probe = checkpoint_read(e["checkpoint"].get<std::string>());
      EXPECT_EQ(at_probe.progress["step"], e["step"]);
      probed_weights.push_back(at_probe.model.front().second);
    }
  }
  ASSERT_EQ(probed_weights.size(), 3u);
  EXPECT_FALSE(at::equal(probed_weights[0], probed_weights[1]));  // each probe's own step's weights
  EXPECT_EQ(precision_events, 6);
  EXPECT_EQ(curvature_events, 3);
  EXPECT_TRUE(last_precision["calibrated"].get<bool>());  // after 3 windows
  EXPECT_LE(last_precision["tau_low"].get<double>(), last_precision["tau_high"].get<double>());
  for (const auto& p : last_precision["applied"]) EXPECT_NE(p.get<std::string>(), "fp16");  // CPU: fp16 runs as bf16
  EXPECT_EQ(summary["precision"], "adaptive");
  EXPECT_GT(summary["probe_share"].get<double>(), 0.0);
  EXPECT_LT(summary["probe_share"].get<double>(), 1.0);

  // With a time budget the probes are spaced out: at most 1 % of training time → fewer probes.
  test::TempDir budget_dir("run_tri_budget");
  Config budgeted = o;
  budgeted.set("out", budget_dir.path());
  budgeted.set("curv_budget", "0.01");
  api::run(budgeted, hooks);
  int budgeted_probes = 0;
  for (const auto& e : events_read(budget_dir.file("events.jsonl"))) {
    if (e["event"] != "curvature") continue;
    ++budgeted_probes;
    EXPECT_GE(e["next_probe_step"].get<int64_t>(), e["step"].get<int64_t>() + o.tri_accel.curv_every);
    // The first budgeted round probes one unit, from the output end, to learn the cost; the others stay unknown.
    EXPECT_EQ(e["probed"], Json::array({"fc"}));
    // ... twice: the first call pays the one-time set-up, the second gives the cost the schedule plans with. One
    // call takes at most k × curv_max_iters = 6 products; two take at least 8 (two per eigenvalue each).
    EXPECT_GT(e["hvp_products"].get<int64_t>(), 6);
    EXPECT_TRUE(e["lambda_max"][0].is_null());
    EXPECT_FALSE(e["lambda_max"][3].is_null());
  }
  EXPECT_EQ(budgeted_probes, 1);  // one unit's probe costs far more than 1 % of the next 10 steps

  // Stop mid-run and resume: the controllers' state comes back from the checkpoint.
  test::TempDir b("run_tri_b");
  Config first = o;
  first.set("out", b.path());
  first.set("max_steps", "7");
  api::run(first, hooks);
  const Checkpoint ckpt = checkpoint_read(b.file("checkpoint.pt"));
  ASSERT_FALSE(ckpt.progress["tri_accel"].is_null());
  EXPECT_EQ(ckpt.progress["tri_accel"]["windows"], 3);
  Config again = o;
  again.set("out", b.path());
  again.set("resume", b.path());
  const Json resumed = api::run(again, hooks);
  EXPECT_EQ(resumed["steps"], 12);
}

// Checkpoints written before the layered redesign (fe31ff2, tests/fixtures/checkpoint_fe31ff2/) still resume, and
// the resumed run ends with the weights that binary's own resume ended with (model.pt and the CRC32 of every tensor,
// recorded by it): one SGD checkpoint at step 5 and one Tri-Accel checkpoint (fixed probe schedule) at step 7, on
// the same tiny dataset this fixture writes. On a CPU like the one that recorded them (same vector ISA, same thread
// count) the weights must be bit for bit the same; elsewhere floating-point reductions round differently, and every
// tensor must agree within 1e-3 of its largest value plus 2e-5 (1 against 2 threads here: 3e-7; Tri-Accel's bf16
// units on an AMD EPYC with AVX512-BF16, whose bf16 products round otherwise: 1.9e-4, and 8.9e-6 on a BatchNorm
// running mean of largest value 1.4e-3; the schedule one step off: 0.24). A change in the step's arithmetic, the data order, the schedule, the controllers' state or the checkpoint's
// reading moves the weights far more. TRIACCEL_TEST_OTHER_CPU=1 takes the other CPU's path here.
TEST_F(TrainerTest, CheckpointsOfTheFormerLayoutResumeToTheSameWeights) {
  for (const std::string kind : {"sgd", "tri_accel"}) {
    const std::string fixture = test::source_dir() + "/tests/fixtures/checkpoint_fe31ff2/" + kind;
    const Json expected = Json::parse(file_read_all(fixture + "/expected.json"));
    const bool same_cpu = at::get_cpu_capability() == expected["cpu"]["capability"].get<std::string>() &&
                          at::get_num_threads() == expected["cpu"]["threads"].get<int>() &&
                          std::getenv("TRIACCEL_TEST_OTHER_CPU") == nullptr;
    test::TempDir run("legacy_" + kind);
    std::filesystem::copy_file(fixture + "/checkpoint.pt", run.file("checkpoint.pt"));
    const Config resume = test::config_of({{"resume", run.path()}, {"data_dir", data_->path()}, {"progress", "off"}});
    const Json summary = api::run(resume);
    EXPECT_EQ(summary["steps"], expected["steps"]) << kind;
    const double acc = summary["test_acc"].get<double>(), want_acc = expected["test_acc"].get<double>();
    if (same_cpu) {
      EXPECT_EQ(acc, want_acc) << kind;
    } else {
      EXPECT_LE(std::abs(acc - want_acc), 100.0 / 128 + 1e-9) << kind << ": more than one test sample apart";
    }
    const auto weights = test::state_dict_read(run.file("model.pt"));
    const auto reference = test::state_dict_read(fixture + "/model.pt");
    ASSERT_EQ(weights.size(), expected["model_crc32"].size()) << kind;
    for (const auto& [name, crc] : expected["model_crc32"].items()) {
      ASSERT_TRUE(weights.count(name) && reference.count(name)) << kind << ": " << name;
      const at::Tensor t = weights.at(name).contiguous();
      if (same_cpu) {
        const auto got = crc32(0L, static_cast<const Bytef*>(t.data_ptr()), static_cast<uInt>(t.nbytes()));
        EXPECT_EQ(got, crc.get<uint64_t>()) << kind << ": " << name << " differs from the former binary's resume";
      } else {
        const at::Tensor ref = reference.at(name).to(t.scalar_type());
        const double scale = std::max(ref.abs().max().item<double>(), 1e-12);
        EXPECT_LE((t - ref).abs().max().item<double>(), 1e-3 * scale + 2e-5)
            << kind << ": " << name << " far from the former binary's resume (another CPU: "
            << at::get_cpu_capability() << ", " << at::get_num_threads() << " threads)";
      }
    }
  }
}

#ifdef TRIACCEL_WITH_CUDA
using test::DeterministicCudnn;

// ResNet-18 (CIFAR stem) from seed 0 on the GPU, conv weights channels_last, with its named parameters.
std::shared_ptr<Model> resnet18_on_gpu(const c10::Device& cuda, std::vector<std::pair<std::string, at::Tensor>>* named) {
  torch::manual_seed(0);
  ModelOptions mo;
  mo.name = "resnet18";
  auto model = model_create(mo);
  model->to(cuda);
  for (auto& p : model->parameters()) {
    if (p.dim() == 4) p.set_data(p.contiguous(at::MemoryFormat::ChannelsLast));
  }
  for (const auto& it : model->named_parameters()) named->emplace_back(it.key(), it.value());
  return model;
}

// Six steps at batch 16: new (seeded) batches written into the same buffers, and lr = lr_unit · (i + 1) at step i.
// Returns copies of the parameters afterwards.
std::vector<at::Tensor> six_steps(TrainStep& step, Model& model, const c10::Device& cuda, double lr_unit) {
  at::Tensor images = torch::empty({16, 3, 32, 32}, torch::TensorOptions().device(cuda))
                          .contiguous(at::MemoryFormat::ChannelsLast);
  at::Tensor labels = torch::empty({16}, torch::TensorOptions().dtype(torch::kLong).device(cuda));
  for (int i = 0; i < 6; ++i) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + i);
    images.copy_(at::randn({16, 3, 32, 32}, gen));
    labels.copy_(torch::randint(0, 10, {16}, gen, torch::kLong));
    step.run(images, labels, lr_unit * (i + 1));
  }
  std::vector<at::Tensor> out;
  for (const auto& p : model.parameters()) out.push_back(p.detach().clone());
  return out;
}

// max over tensors of max|a − b| / max|b|.
double worst_relative_difference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    worst = std::max(worst, ((a[i] - b[i]).abs().max() / b[i].abs().max().clamp_min(1e-12)).item<double>());
  }
  return worst;
}

// Six steps (six_steps, lr unit 0.02) of a fresh ResNet-18 with SGD under `so`, capturing at batch 16 after 2 eager
// steps when `graphs`; the loss scaler on for amp-fp16. The weights after, and what the step says of its graph.
struct SgdSteps {
  std::vector<at::Tensor> weights;
  bool captured = false;
  int64_t capture_ooms = 0;
  std::string capture_error;
};
SgdSteps six_sgd_steps(const c10::Device& cuda, StepOptions so, bool graphs) {
  std::vector<std::pair<std::string, at::Tensor>> named;
  const auto model = resnet18_on_gpu(cuda, &named);
  Sgd sgd(named, SgdOptions{});
  LossScalerOptions lso;
  lso.enabled = so.precision == PrecisionMode::kAmpFP16;
  LossScaler scaler(lso, cuda);
  so.cuda_graphs = graphs;
  so.graph_batch_size = 16;
  so.warmup_steps = 2;
  TrainStep step(*model, sgd, scaler, so, cuda);
  SgdSteps out;
  out.weights = six_steps(step, *model, cuda, 0.02);
  out.captured = step.graph().captured();
  out.capture_ooms = step.graph().capture_ooms();
  out.capture_error = step.graph().capture_error();
  return out;
}
#endif

// A chain of residual units, y = linear(x) + x, each recording the dtype of every input it receives.
class DtypeRecordingModel : public Model {
 public:
  explicit DtypeRecordingModel(size_t n) : Model("dtype-recorder"), seen(n) {
    for (size_t i = 0; i < n; ++i) {
      auto linear = register_module("l" + std::to_string(i), torch::nn::Linear(8, 8));
      unit_add("l" + std::to_string(i), {linear}, [this, linear, i](const at::Tensor& x) {
        seen[i].push_back(x.scalar_type());
        return linear->forward(x) + x;
      });
    }
  }
  std::vector<std::vector<at::ScalarType>> seen;  // per unit: the dtype of each input, in the order received
};

// Per-unit precision: in the step's forward (and in a recomputed unit's second forward, in backward) every unit
// receives its input in its own dtype, whatever its neighbours run at. Without the cast at a unit's entry the residual
// adds promote: after an fp32 unit a bf16 unit would receive fp32, and an fp32 unit after a bf16 one bf16. On the CPU
// fp16 applies as bf16, so the mixes there are fp32 / bf16; on a GPU fp16 is added.
TEST(UnitPrecisionForwardTest, TheStepRunsEveryUnitOnInputInItsOwnDtype) {
  constexpr size_t kUnits = 5;
  const auto check = [](const c10::Device& device, const std::vector<Precision>& precisions, bool recompute) {
    SCOPED_TRACE(testing::Message() << device << (recompute ? " recompute" : ""));
    torch::manual_seed(3);
    DtypeRecordingModel model(kUnits);
    model.to(device);
    model.train();
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (const auto& item : model.named_parameters()) named.emplace_back(item.key(), item.value());
    Sgd sgd(named, SgdOptions{});
    LossScaler scaler(LossScalerOptions{}, device);
    StepOptions so;
    so.precision = PrecisionMode::kAmpBF16;
    so.cuda_graphs = false;
    TrainStep step(model, sgd, scaler, so, device);
    step.set_unit_precisions(precisions);
    std::vector<bool> flags(kUnits, false);
    flags[1] = flags[3] = recompute;
    step.set_recompute(flags);
    const at::Tensor x = torch::randn({2, 8}, torch::TensorOptions().device(device));
    const at::Tensor out = step.forward(x);
    out.to(at::kFloat).sum().backward();
    for (size_t i = 0; i < kUnits; ++i) {
      const at::ScalarType want = precision_dtype(precision_applied(precisions[i], device));
      ASSERT_EQ(model.seen[i].size(), recompute && (i == 1 || i == 3) ? 2u : 1u) << i;
      for (const at::ScalarType got : model.seen[i]) EXPECT_EQ(got, want) << "unit " << i;
    }
  };
  const Precision f32 = Precision::kFP32, b16 = Precision::kBF16, f16 = Precision::kFP16;
  for (const bool recompute : {false, true}) {
    check(c10::Device(c10::kCPU), {f32, b16, b16, f32, b16}, recompute);
    check(c10::Device(c10::kCPU), {b16, f32, b16, b16, f32}, recompute);
    if (test::gpu_available()) check(c10::Device(c10::kCUDA, 0), {f32, f16, b16, f32, f16}, recompute);
  }
}

// On a GPU, with deterministic cuDNN and no TF32: six steps of ResNet-18 (1×1 downsample convs, channels_last)
// where steps 3–6 replay a captured CUDA graph give the same weights as six eager steps, in every precision. The
// batches and the learning rate change every step, so a graph replaying stale inputs or a baked-in lr fails.
TEST(TrainStepCudaTest, GraphReplayMatchesEagerSteps) {
  TRIACCEL_SKIP_WITHOUT_GPU();
#ifdef TRIACCEL_WITH_CUDA
  const DeterministicCudnn deterministic;
  const c10::cuda::CUDAStreamGuard stream(c10::cuda::getStreamFromPool());
  const c10::Device cuda(c10::kCUDA, 0);
  for (PrecisionMode precision : {PrecisionMode::kFP32, PrecisionMode::kAmpBF16, PrecisionMode::kAmpFP16}) {
    StepOptions so;
    so.precision = precision;
    const SgdSteps with_graph = six_sgd_steps(cuda, so, true);
    const SgdSteps eager = six_sgd_steps(cuda, so, false);
    EXPECT_TRUE(with_graph.captured);
    EXPECT_FALSE(eager.captured);
    EXPECT_LT(worst_relative_difference(with_graph.weights, eager.weights), 1e-5) << enum_name(precision);
  }
#endif
}

// A capture that runs out of memory (the graph's private pool beside the eager steps' blocks, under a --vram-budget)
// is not the batch's fault: that step and every later one at the size run eagerly, with the same weights as an
// all-eager run, and the capture is not tried again (it would fail every time, one out-of-memory error per step).
TEST(TrainStepCudaTest, CaptureOutOfMemoryRunsTheStepEagerly) {
  TRIACCEL_SKIP_WITHOUT_GPU();
#ifdef TRIACCEL_WITH_CUDA
  const DeterministicCudnn deterministic;
  const c10::cuda::CUDAStreamGuard stream(c10::cuda::getStreamFromPool());
  const c10::Device cuda(c10::kCUDA, 0);
  int capture_attempts = 0;
  StepOptions so;
  so.precision = PrecisionMode::kAmpBF16;
  so.during_capture = [&capture_attempts]() {
    ++capture_attempts;
    TORCH_CHECK_WITH(OutOfMemoryError, false, "test: no room for the graph's pool");
  };
  const SgdSteps with_failed_graph = six_sgd_steps(cuda, so, true);
  EXPECT_EQ(capture_attempts, 1);  // steps 4-6 did not try again
  const SgdSteps eager = six_sgd_steps(cuda, so, false);
  for (const SgdSteps* run : {&with_failed_graph, &eager}) EXPECT_FALSE(run->captured);
  EXPECT_EQ(with_failed_graph.capture_ooms, 1);
  EXPECT_EQ(eager.capture_ooms, 0);
  EXPECT_LT(worst_relative_difference(with_failed_graph.weights, eager.weights), 1e-5);
#endif
}

// A capture that fails by an error (here a synchronizing read, which a capture refuses, after 64 MB were allocated
// in the graph's pool): the step runs eagerly, the error is named, no out-of-memory is counted, the allocator leaves
// capture mode (the pool's other memory is given back) and a later step can be captured.
TEST(TrainStepCudaTest, CaptureErrorRunsTheStepEagerlyAndFreesThePool) {
  TRIACCEL_SKIP_WITHOUT_GPU();
#ifdef TRIACCEL_WITH_CUDA
  const DeterministicCudnn deterministic;
  const c10::cuda::CUDAStreamGuard stream(c10::cuda::getStreamFromPool());
  const c10::Device cuda(c10::kCUDA, 0);
  const auto reserved = []() {
    c10::cuda::CUDACachingAllocator::emptyCache();
    return c10::cuda::CUDACachingAllocator::getDeviceStats(0).reserved_bytes[0].current;
  };
  StepOptions so;
  so.precision = PrecisionMode::kAmpBF16;
  so.during_capture = [&cuda]() {
    const at::Tensor in_pool = at::ones({16 << 20}, at::TensorOptions().device(cuda));
    (void)in_pool.sum().item<float>();  // not allowed while capturing
  };
  const SgdSteps eager = six_sgd_steps(cuda, so, false);  // first: library workspaces (cuBLAS, cuDNN) stay reserved
  const int64_t after_eager = reserved();
  const SgdSteps with_failed_graph = six_sgd_steps(cuda, so, true);
  for (const SgdSteps* run : {&with_failed_graph, &eager}) {
    EXPECT_FALSE(run->captured);
    EXPECT_EQ(run->capture_ooms, 0);
  }
  EXPECT_FALSE(with_failed_graph.capture_error.empty());
  EXPECT_TRUE(eager.capture_error.empty());
  // Without ending the allocator's routing and releasing the pool, 184 MB stayed reserved here (H100) and the next
  // capture in the process failed; what the failed capture itself allocated in the pool (64 MB) still stays.
  EXPECT_LT(reserved() - after_eager, int64_t{128} << 20);
  EXPECT_LT(worst_relative_difference(with_failed_graph.weights, eager.weights), 1e-5);
  // The CUDA generator left capture mode: a random op outside a capture works.
  EXPECT_NO_THROW(at::randn({16}, at::TensorOptions().device(cuda)).sum().item<float>());
  // The process can capture again.
  StepOptions plain;
  plain.precision = PrecisionMode::kAmpBF16;
  EXPECT_TRUE(six_sgd_steps(cuda, plain, true).captured);
#endif
}

// Relaxed capture mode (NeuroFlux's retry after a capture error): a call global mode refuses inside the capture
// (here a raw cudaMalloc) fails the global capture and is allowed in relaxed mode, whose graph then replays the work.
TEST(TrainStepCudaTest, RelaxedCaptureAllowsWhatGlobalModeRefuses) {
  TRIACCEL_SKIP_WITHOUT_GPU();
#ifdef TRIACCEL_WITH_CUDA
  const c10::cuda::CUDAStreamGuard stream(c10::cuda::getStreamFromPool());
  const auto opts = at::TensorOptions().device(c10::Device(c10::kCUDA, 0));
  const at::Tensor x = at::arange(1024, opts.dtype(at::kFloat));
  at::Tensor y = at::zeros({1024}, opts.dtype(at::kFloat));
  std::vector<void*> raw;
  const auto body = [&]() {
    void* p = nullptr;
    C10_CUDA_CHECK(cudaMalloc(&p, 1 << 20));
    raw.push_back(p);
    y.copy_(x * 2 + 1);
  };
  std::string error;
  EXPECT_EQ(cuda_graph_capture(body, &error, /*relaxed=*/false), nullptr);
  EXPECT_FALSE(error.empty());
  error.clear();
  const auto graph = cuda_graph_capture(body, &error, /*relaxed=*/true);
  ASSERT_NE(graph, nullptr) << error;
  EXPECT_EQ(y.sum().item<double>(), 0.0);  // the capture ran nothing
  graph->replay();
  EXPECT_TRUE(y.equal(x * 2 + 1));
  for (void* p : raw) {
    if (p) C10_CUDA_CHECK(cudaFree(p));
  }
#endif
}

// BAOC inside the captured step: every state format (assigned round-robin over ResNet-18's tensors) and the
// gradient-stream statistics replay from the graph exactly as they run eagerly.
TEST(TrainStepCudaTest, BaocGraphReplayMatchesEagerSteps) {
  TRIACCEL_SKIP_WITHOUT_GPU();
#ifdef TRIACCEL_WITH_CUDA
  const DeterministicCudnn deterministic;
  const c10::cuda::CUDAStreamGuard stream(c10::cuda::getStreamFromPool());
  const c10::Device cuda(c10::kCUDA, 0);
  auto train = [&](bool graphs, bool* captured, at::Tensor* stats) {
    std::vector<std::pair<std::string, at::Tensor>> named;
    const auto model = resnet18_on_gpu(cuda, &named);
    BaocOptimizer opt(named, BaocOptions{});
    std::vector<StateFormat> formats;
    for (size_t i = 0; i < named.size(); ++i) formats.push_back(state_formats_all()[i % state_formats_all().size()]);
    opt.formats_set(formats);
    opt.stream_stats_enable(true);
    LossScaler scaler(LossScalerOptions{}, cuda);
    StepOptions so;
    so.cuda_graphs = graphs;
    so.graph_batch_size = 16;
    so.warmup_steps = 2;
    TrainStep step(*model, opt, scaler, so, cuda);
    auto out = six_steps(step, *model, cuda, 1e-3);
    *captured = step.graph().captured();
    *stats = opt.stream_stats_take();
    EXPECT_EQ(opt.counts().cpu()[0][0].item<double>(), 6.0);
    return out;
  };
  bool captured_graph = false, captured_eager = true;
  at::Tensor stats_graph, stats_eager;
  const auto with_graph = train(true, &captured_graph, &stats_graph);
  const auto eager = train(false, &captured_eager, &stats_eager);
  EXPECT_TRUE(captured_graph);
  EXPECT_FALSE(captured_eager);
  EXPECT_LT(worst_relative_difference(with_graph, eager), 1e-5);
  EXPECT_LT(((stats_graph - stats_eager).abs().max() / stats_eager.abs().max()).item<double>(), 1e-5);
  EXPECT_GT(stats_eager.select(1, kStreamSqCur).sum().item<double>(), 0);
#endif
}

}  // namespace
}  // namespace triaccel
