// The memory plan controller (control/memory/memory_plan_controller.h) and the precision controller under a budget:
// promotions paid for within the plan, calibration of the scale and fixed bytes from readings, the ranks' agreement.
#include "memory_test_util.h"

namespace triaccel {
namespace {

using namespace memory_test;

// A made-up three-unit model whose fp32 units keep twice the activations of 16-bit ones (40 bytes per sample, not 20).
MemoryModel promotion_model(const std::vector<Precision>& p) {
  std::vector<double> saved;
  for (Precision q : p) saved.push_back(q == Precision::kFP32 ? 40 : 20);
  MemoryModel m = made_up(saved, {2, 2, 2}, {1, 5, 5});
  m.dataset_bytes = 0;
  m.allow_host_data = false;
  return m;
}

// The planner in the loop, on made-up models: a Tri-Accel run without a budget keeps its first (16-bit) peak as the
// limit, so a unit promoted to fp32 (twice the activations) is paid for by recomputing it rather than by a higher
// peak; an out-of-memory error raises the activation scale and the limit with it; each change reaches the step
// engine and the events, and the scale survives a checkpoint.
TEST(MemoryPlanControllerTest, PaysForAPromotionWithinTheFirstPeak) {
  UnitRig rig(false, StepOptions{}, torch::kCPU);
  TrainStep& step = rig.step;
  step.set_unit_precisions({Precision::kBF16, Precision::kBF16, Precision::kBF16});
  const auto model_for = promotion_model;
  MemoryModel first = model_for(step.unit_precisions());
  MemoryPlanLimits limits;
  limits.batch = 16;
  limits.limit_from_first_model = true;
  limits.budget_bytes = static_cast<int64_t>(memory_plan_solve(first, 16, 0).predicted_peak_bytes);
  const MemoryPlan plan = memory_plan_solve(first, 16, limits.budget_bytes);
  MemoryPlanController c(first, plan, limits, step, model_for);
  EXPECT_EQ(step.micro_batch(), 0);
  EXPECT_TRUE(step.recompute().empty());
  StepContext ctx;
  ctx.step = 10;  // past calibration
  EXPECT_TRUE(c.after_step(ctx).empty());  // nothing changed

  step.set_unit_precisions({Precision::kFP32, Precision::kBF16, Precision::kBF16});
  const Events events = c.after_step(ctx);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].fields["reason"], "precision");
  EXPECT_EQ(c.plan().micro_batch, 16);
  EXPECT_EQ(step.recompute(), (std::vector<bool>{true, false, false}));  // the promoted unit is recomputed
  EXPECT_LE(c.plan().predicted_peak_bytes, limits.budget_bytes);

  // Out of memory: scale 1.25, the limit scales with it (the same plan still fits).
  Event oom = c.on_out_of_memory();
  EXPECT_EQ(oom.fields["reason"], "oom");
  EXPECT_DOUBLE_EQ(oom.fields["activation_scale"].get<double>(), 1.25);
  EXPECT_EQ(c.plan().recompute, (std::vector<bool>{true, false, false}));
  // All units fp32: recomputing the first no longer fits under the 16-bit peak (2 + 40 + 40 kept when backward
  // starts); recomputing the first two does (u1's backward: 2 + 2 + 40), cheaper than splitting the batch.
  step.set_unit_precisions({Precision::kFP32, Precision::kFP32, Precision::kFP32});
  c.after_step(ctx);
  EXPECT_EQ(c.plan().micro_batch, 16);
  EXPECT_EQ(step.recompute(), (std::vector<bool>{true, true, false}));
  EXPECT_EQ(c.state()["activation_scale"], 1.25);
  // The scale persists in the checkpoint: a restored controller plans with it.
  MemoryPlanController again(first, plan, limits, step, model_for);
  again.restore(c.state());
  EXPECT_DOUBLE_EQ(again.model().activation_scale, 1.25);
}

// An out-of-memory error in the warm-up step routed into the capture's pool is the pool's: under a budget the plan's
// share shrinks by kCaptureShareStep and the scale stays; with no cap to take a share of, it is the model's error.
TEST(MemoryPlanControllerTest, ThePoolsOutOfMemoryShrinksTheShareWhereThereIsACap) {
  UnitRig rig(false, StepOptions{}, torch::kCPU);
  const MemoryModel m = promotion_model({Precision::kBF16, Precision::kBF16, Precision::kBF16});
  MemoryPlanLimits limits;
  limits.batch = 16;
  limits.cap_bytes = static_cast<int64_t>(2 * memory_plan_solve(m, 16, 0).predicted_peak_bytes);
  limits.budget_bytes = static_cast<int64_t>(limits.cap_share * static_cast<double>(limits.cap_bytes));
  MemoryPlanController capped(m, memory_plan_solve(m, 16, limits.budget_bytes), limits, rig.step, promotion_model);
  const Event pool = capped.on_pool_out_of_memory();
  EXPECT_EQ(pool.fields["reason"], "pool_oom");
  EXPECT_DOUBLE_EQ(capped.state()["cap_share"].get<double>(), 0.9 * kCaptureShareStep);
  EXPECT_DOUBLE_EQ(capped.model().activation_scale, 1.0);

  limits.cap_bytes = 0;
  MemoryPlanController uncapped(m, memory_plan_solve(m, 16, limits.budget_bytes), limits, rig.step, promotion_model);
  EXPECT_EQ(uncapped.on_pool_out_of_memory().fields["reason"], "oom");
  EXPECT_DOUBLE_EQ(uncapped.model().activation_scale, kOomScaleStep);
}

// Without a budget the limit is the 16-bit peak the calibration steps measured: a promoted plan that peaks above its
// prediction (here the fp32 unit keeps 60 % more than modelled; three recomputed fp32 units did on the H100) has
// the scale refit on its reading, and the plan recomputes more to stay under that peak, where the limit priced at the
// refit scale rose with it and let the peak follow.
TEST(MemoryPlanControllerTest, APromotedPlanAboveItsPredictionKeepsTheCalibratedLimit) {
  UnitRig rig(false, StepOptions{}, torch::kCPU);
  TrainStep& step = rig.step;
  step.set_unit_precisions({Precision::kBF16, Precision::kBF16, Precision::kBF16});
  const MemoryModel first = promotion_model(step.unit_precisions());
  MemoryPlanLimits limits;
  limits.batch = 16;
  limits.limit_from_first_model = true;
  limits.budget_bytes = static_cast<int64_t>(memory_plan_solve(first, 16, 0).predicted_peak_bytes);
  MemoryPlanController c(first, memory_plan_solve(first, 16, limits.budget_bytes), limits, step, promotion_model);
  double true_scale = 1.0;
  const auto truth = [&](const MemoryPlan& p) {
    MemoryModel t = promotion_model(step.unit_precisions());
    t.activation_scale = true_scale;
    return memory_plan_peak(t, p.batch, p.micro_batch, p.recompute, p.data_placement);
  };
  FakeMeter meter;
  meter.peak = [&] { return truth(c.plan()); };
  StepContext ctx;
  ctx.memory = &meter;
  std::vector<std::string> reasons;
  const auto steps = [&](int from, int to) {
    for (int s = from; s <= to; ++s) {
      ctx.step = s;
      for (const Event& e : c.after_step(ctx)) reasons.push_back(e.fields["reason"].get<std::string>());
    }
  };
  steps(1, 8);  // calibrated on the 16-bit model, which the meter reads as modelled
  const int64_t calibrated = c.limit_bytes();
  EXPECT_NEAR(static_cast<double>(calibrated), static_cast<double>(limits.budget_bytes), 1.0);
  step.set_unit_precisions({Precision::kFP32, Precision::kBF16, Precision::kBF16});
  true_scale = 1.6;  // the promoted plan keeps more than its prediction
  reasons.clear();
  steps(9, 16);
  ASSERT_FALSE(reasons.empty());
  EXPECT_EQ(reasons[0], "precision");
  EXPECT_GT(c.model().activation_scale, 1.5);  // refit on the promoted plan's reading
  EXPECT_EQ(c.limit_bytes(), calibrated);
  EXPECT_LE(truth(c.plan()), static_cast<double>(calibrated));
  EXPECT_EQ(c.state()["limit_scale"].get<double>(), 1.0);
  std::printf("[ made-up ] limit %ld, promoted plan's true peak %.0f, recompute u0 u1 u2: %d %d %d, reasons:",
              static_cast<long>(calibrated), truth(c.plan()), static_cast<int>(c.plan().recompute[0]),
              static_cast<int>(c.plan().recompute[1]), static_cast<int>(c.plan().recompute[2]));
  for (const auto& r : reasons) std::printf(" %s", r.c_str());
  std::printf("\n");
  // A model corrected past any plan under that peak (a resumed run's state at scale 50): the plan at the floor, not
  // "no way to train" (there is no budget).
  Json state = c.state();
  state["activation_scale"] = 50.0;
  EXPECT_NO_THROW(c.restore(state));
  EXPECT_TRUE(c.plan().feasible);
  EXPECT_GT(c.plan().predicted_peak_bytes, static_cast<double>(calibrated));
  EXPECT_NEAR(c.plan().predicted_peak_bytes, c.plan().floor_bytes, 1.0);
  EXPECT_EQ(c.limit_bytes(), calibrated);
  // Every unit back in 16 bits: priced at the scale the 16-bit steps measured (the limit's, 1), not at the 50 the
  // state brought: nothing recomputed, the whole batch at once (at scale 50 every unit is recomputed).
  step.set_unit_precisions({Precision::kBF16, Precision::kFP16, Precision::kBF16});
  steps(17, 18);
  EXPECT_EQ(c.plan().recompute, std::vector<bool>(3, false));
  EXPECT_EQ(c.plan().micro_batch, 16);
  EXPECT_EQ(std::count(step.recompute().begin(), step.recompute().end(), true), 0);
  EXPECT_EQ(c.plan_fields("test")["plan_limit_bytes"].get<int64_t>(), calibrated);
}

// The planner answers whether a promotion fits: under the 16-bit peak of PaysForAPromotionWithinTheFirstPeak's
// made-up model one fp32 unit fits (recomputed); under a budget between the 16-bit and the all-fp32 floors three
// do not, though the 16-bit model fits there.
TEST(MemoryPlanControllerTest, FitsAnswersForPrecisionsNotYetApplied) {
  UnitRig rig(false, StepOptions{}, torch::kCPU);
  rig.step.set_unit_precisions({Precision::kBF16, Precision::kBF16, Precision::kBF16});
  const auto model_for = promotion_model;
  const MemoryModel first = model_for(rig.step.unit_precisions());
  MemoryPlanLimits limits;
  limits.batch = 16;
  limits.budget_bytes = static_cast<int64_t>(memory_plan_solve(first, 16, 0).predicted_peak_bytes);
  const MemoryPlan plan = memory_plan_solve(first, 16, limits.budget_bytes);
  const MemoryPlanController c(first, plan, limits, rig.step, model_for);
  using P = Precision;
  EXPECT_TRUE(c.fits({P::kFP32, P::kBF16, P::kBF16}));
  EXPECT_TRUE(c.fits({P::kFP16, P::kBF16, P::kBF16}));
  const MemoryModel all_fp32 = model_for({P::kFP32, P::kFP32, P::kFP32});
  const double fp32_floor = memory_plan_solve(all_fp32, 16, 1).floor_bytes;  // the least any plan needs
  const double first_floor = memory_plan_solve(first, 16, 1).floor_bytes;
  ASSERT_LT(first_floor, fp32_floor);
  limits.budget_bytes = static_cast<int64_t>((first_floor + fp32_floor) / 2);
  ASSERT_TRUE(memory_plan_solve(first, 16, limits.budget_bytes).feasible);  // the 16-bit model still fits
  const MemoryPlanController tight(first, memory_plan_solve(first, 16, limits.budget_bytes), limits, rig.step,
                                   model_for);
  EXPECT_FALSE(tight.fits({P::kFP32, P::kFP32, P::kFP32}));
  EXPECT_EQ(rig.step.unit_precisions(), (std::vector<P>{P::kBF16, P::kBF16, P::kBF16}));  // asking applies nothing
  // A trace of the promoted model that runs out of memory (under a budget, beside the run's tensors) answers "does
  // not fit" instead of ending the run.
  const MemoryPlanController no_room(first, plan, limits, rig.step, [&](const std::vector<Precision>& p) {
    if (p[0] == P::kFP32) TORCH_CHECK_WITH(OutOfMemoryError, false, "made-up: the trace did not fit");
    return model_for(p);
  });
  EXPECT_FALSE(no_room.fits({P::kFP32, P::kBF16, P::kBF16}));
  EXPECT_TRUE(no_room.fits({P::kFP16, P::kBF16, P::kBF16}));
}

// Tri-Accel's precision controller over UnitRig's three units, deciding at every step from fixed variance thresholds
// (and τ_curv when given), with a memory check that counts its questions and answers `accept`.
struct PrecisionRig {
  struct Seeded {
    Seeded() { torch::manual_seed(5); }
  } seeded;
  UnitRig rig{false, StepOptions{}, torch::kCPU};
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
  PrecisionController c;
  int asked = 0;
  std::vector<Precision> last_asked;
  bool accept = true;

  PrecisionRig(double tau_low, double tau_high, double tau_curv = -1)
      : c(options(tau_low, tau_high, tau_curv), 1, rig.net, rig.sgd, rig.step, torch::kCPU) {}
  static PrecisionPolicyOptions options(double tau_low, double tau_high, double tau_curv) {
    PrecisionPolicyOptions po;
    po.tau_low = tau_low;
    po.tau_high = tau_high;
    po.tau_curv = tau_curv;
    return po;
  }
  void check(bool hold_curvature = false) {
    c.set_memory_check(
        [this](const std::vector<Precision>& p) {
          ++asked;
          last_asked = p;
          return accept;
        },
        hold_curvature);
  }
  // One step and the controller's window after it.
  Events window(int64_t step, std::vector<double> lambda_max = {}) {
    rig.step.run(at::randn({12, 12}, gen), at::randint(0, 5, {12}, gen), 0.05);
    StepContext ctx;
    ctx.step = step;
    ctx.unit_lambda_max = std::move(lambda_max);
    return c.after_step(ctx);
  }
  std::vector<std::string> reasons(const Events& events) const {
    std::vector<std::string> out;
    for (const auto& r : events.at(0).fields.at("reason")) out.push_back(r.get<std::string>());
    return out;
  }
};

// Thresholds of 0 put every unit in fp32 by the variance rule: a check that refuses fp32 keeps them where they were,
// the event says "memory" for each, and the same refused decision is not traced again at the next window. A check
// that accepts gives fp32 and "high variance".
TEST(PrecisionControllerTest, APromotionNoPlanFitsIsRefusedAndNamed) {
  for (const bool accept : {false, true}) {
    PrecisionRig t(0, 0);
    t.accept = accept;
    t.check();
    t.window(1);
    const Events events = t.window(2);
    ASSERT_EQ(events.size(), 1u);
    const Precision want = accept ? Precision::kFP32 : Precision::kBF16;
    EXPECT_EQ(t.rig.step.unit_precisions(), std::vector<Precision>(3, want)) << "accept " << accept;
    EXPECT_EQ(t.reasons(events), std::vector<std::string>(3, accept ? "high variance" : "memory"));
    EXPECT_EQ(t.asked, 1) << "accept " << accept;
    EXPECT_EQ(t.last_asked, std::vector<Precision>(3, Precision::kFP32));
  }
}

// Under a budget's plan (a memory check holding curvature) a promotion by curvature is held where it was, named
// "memory", and not even asked for; with a plan without a budget (the check alone) the same λ_max promote units 0
// and 2 to fp32, named "curvature", once the check says they fit.
TEST(PrecisionControllerTest, UnderABudgetCurvaturePromotionsAreHeld) {
  for (const bool budget : {true, false}) {
    PrecisionRig t(0, 1e30, 1.0);  // every unit bf16 by its variance; λ_max above 1 promotes
    t.check(budget);
    const Events events = t.window(1, {5.0, 0.5, 5.0});
    ASSERT_EQ(events.size(), 1u);
    const Precision promoted = budget ? Precision::kBF16 : Precision::kFP32;
    EXPECT_EQ(t.rig.step.unit_precisions(), (std::vector<Precision>{promoted, Precision::kBF16, promoted}))
        << "budget " << budget;
    const std::string why = budget ? "memory" : "curvature";
    EXPECT_EQ(t.reasons(events), (std::vector<std::string>{why, "variance", why}));
    EXPECT_EQ(t.asked, budget ? 0 : 1);
  }
}

// A promotion the check accepted whose step then ran out of memory (the trainer calls revert_raise before
// re-planning): the units go back to bf16, the decision is refused from then on without asking the check again, and
// the next window names them "memory"; a second revert has nothing to put back.
TEST(PrecisionControllerTest, APromotionThatRanOutOfMemoryIsPutBackAndRefused) {
  PrecisionRig t(0, 0);
  t.check();
  EXPECT_FALSE(t.c.revert_raise()) << "nothing raised yet";
  t.window(1);  // thresholds of 0: every unit to fp32 at the first window
  ASSERT_EQ(t.rig.step.unit_precisions(), std::vector<Precision>(3, Precision::kFP32));
  EXPECT_TRUE(t.c.revert_raise());
  EXPECT_EQ(t.rig.step.unit_precisions(), std::vector<Precision>(3, Precision::kBF16));
  EXPECT_FALSE(t.c.revert_raise()) << "put back twice";
  const Events events = t.window(2);
  EXPECT_EQ(t.rig.step.unit_precisions(), std::vector<Precision>(3, Precision::kBF16));
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(t.reasons(events), std::vector<std::string>(3, "memory"));
  EXPECT_EQ(t.asked, 1) << "the refused promotion was traced again";
  EXPECT_FALSE(t.c.revert_raise()) << "a window that raised nothing";
}

// The calibration tests' rig: a made-up model whose true run needs `true_scale` of the modelled activations and 30
// bytes the model missed, a controller planning it under 2000 bytes, and a meter that reads the truth of the plan in
// force.
struct CalibrationRig {
  UnitRig rig{false, StepOptions{}, torch::kCPU};
  MemoryModel m = [] {
    MemoryModel made = made_up({100, 60, 20}, {2, 10, 6}, {1, 5, 5});
    made.dataset_bytes = 0;
    made.allow_host_data = false;
    return made;
  }();
  MemoryPlanLimits limits = limits_at(2000);
  MemoryPlanController c{m, memory_plan_solve(m, 16, limits.budget_bytes), limits, rig.step,
                         [this](const std::vector<Precision>&) { return m; }};
  double true_scale = 0.5;
  FakeMeter meter;
  StepContext ctx;
  std::vector<std::string> reasons;  // of the events after_step returned

  explicit CalibrationRig(int64_t budget = 2000) : limits(limits_at(budget)) {
    meter.peak = [this] { return truth(c.plan()); };
    ctx.memory = &meter;
  }
  static MemoryPlanLimits limits_at(int64_t budget) {
    MemoryPlanLimits l;
    l.batch = 16;
    l.budget_bytes = budget;
    return l;
  }
  double truth(const MemoryPlan& p) const {
    MemoryModel t = m;
    t.activation_scale = true_scale;
    t.fixed_bytes += 30;
    return memory_plan_peak(t, p.batch, p.micro_batch, p.recompute, p.data_placement);
  }
  void steps(int from, int to) {
    for (int s = from; s <= to; ++s) {
      ctx.step = s;
      for (const Event& e : c.after_step(ctx)) reasons.push_back(e.fields["reason"].get<std::string>());
    }
  }
};

// Calibration on made-up readings: after the calibration steps (the session's first step is not read) the plan's
// prediction equals the truth and the plan fits it.
TEST(MemoryPlanControllerTest, CalibratesScaleAndFixedBytesFromReadings) {
  CalibrationRig r;
  r.steps(1, 8);
  const MemoryPlan& plan = r.c.plan();
  EXPECT_EQ(r.meter.windows, 8);  // every eager step: the first one's taken but not read, then 5 readings, then the plan's
  EXPECT_NEAR(plan.predicted_peak_bytes, r.truth(plan), 0.02 * r.truth(plan));
  // After calibration the plan's own steps measure it (what the prediction is checked against in the results).
  EXPECT_DOUBLE_EQ(r.c.plan_measured_peak_bytes(), static_cast<double>(static_cast<int64_t>(r.truth(plan))));
  EXPECT_LE(r.truth(plan), r.limits.budget_bytes);
  EXPECT_LT(r.c.model().activation_scale, 0.9);  // it learned the model over-predicts
}

// A reading far under its prediction lowers the scale by kCalibrationDownStep a step, not to the fit (which the next,
// bolder plan ran out of memory with on the H100); after an out-of-memory error the readings never take the scale
// back below the scale that error left.
TEST(MemoryPlanControllerTest, CalibrationStepsTheScaleDownAndNeverBelowAnOutOfMemory) {
  CalibrationRig r;
  r.true_scale = 0.1;
  ASSERT_DOUBLE_EQ(r.c.model().activation_scale, 1);
  r.steps(1, 2);  // the first step is not read; the second is
  EXPECT_DOUBLE_EQ(r.c.model().activation_scale, kCalibrationDownStep);
  r.steps(3, 3);
  EXPECT_DOUBLE_EQ(r.c.model().activation_scale, kCalibrationDownStep * kCalibrationDownStep);
  r.c.on_out_of_memory();
  const double after_oom = kCalibrationDownStep * kCalibrationDownStep * kOomScaleStep;
  EXPECT_DOUBLE_EQ(r.c.model().activation_scale, after_oom);
  r.steps(4, 6);
  EXPECT_DOUBLE_EQ(r.c.model().activation_scale, after_oom);
}

// An out-of-memory error whose attempt allocated past what the plan may fill raises the scale at least to what puts
// the failed plan kOomReadingMargin above that reading, by kOomScaleStep at least and kOomScaleMaxStep at most; the
// plan after it is priced near its truth. A reading under the limit (the cap's margin went first), or none, takes
// the blind step.
TEST(MemoryPlanControllerTest, AnOutOfMemoryReadingPastTheLimitSetsTheScaleItShows) {
  for (const double true_scale : {1.8, 3.5}) {
    CalibrationRig r;
    r.true_scale = true_scale;
    const MemoryPlan failed = r.c.plan();
    const double read = 0.97 * r.truth(failed);  // the refused allocation is not in the reading
    ASSERT_GE(read, r.limits.budget_bytes) << true_scale;
    r.c.on_out_of_memory(read);
    const MemoryModel after = r.c.model();
    if (true_scale < 2) {
      EXPECT_NEAR(memory_plan_peak(after, failed), (1 + kOomReadingMargin) * read, 1e-6);
      EXPECT_GT(after.activation_scale, kOomScaleStep);  // more than the blind step: no second error
      EXPECT_NEAR(r.c.plan().predicted_peak_bytes, r.truth(r.c.plan()), 0.05 * r.truth(r.c.plan()));
    } else {
      EXPECT_DOUBLE_EQ(after.activation_scale, kOomScaleMaxStep);
    }
  }
  // A budget far above the plan (every unit kept, the whole batch: 3,326 bytes predicted under 5,000): a reading of
  // 4,900 would ask for 1.57× the scale, but it came under the limit.
  for (const double read : {0.0, 4900.0}) {
    CalibrationRig roomy(5000);
    ASSERT_LT(roomy.c.plan().predicted_peak_bytes, 3400);
    roomy.c.on_out_of_memory(read);
    EXPECT_DOUBLE_EQ(roomy.c.model().activation_scale, kOomScaleStep) << read;
  }
}

// The scale an out-of-memory error left holds the model above what the readings fit (it keeps the failed plan out
// of reach): the plan stays, and its prediction is its own reading, not the floored model's (GPT-char at 0.5 GB on
// the H100 was predicted 0.434 GB and peaked at 0.391).
TEST(MemoryPlanControllerTest, APlanHeldAboveItsReadingsByAnOutOfMemoryPredictsItsOwnPeak) {
  CalibrationRig r;
  r.steps(1, 1);
  r.c.on_out_of_memory();
  ASSERT_DOUBLE_EQ(r.c.model().activation_scale, kOomScaleStep);
  r.reasons.clear();
  r.steps(2, 6);  // the five calibration readings, no step after them (a captured step's replays read nothing)
  EXPECT_DOUBLE_EQ(r.c.model().activation_scale, kOomScaleStep);  // the floor holds
  // The corrected prediction is logged when it is made (the events are what the results read; grid runs #81, #129,
  // #138 at 62ac2b7 had it only in the controller, their last event 17-20 % above their steps' peak).
  ASSERT_FALSE(r.reasons.empty());
  EXPECT_EQ(r.reasons[0], "remeasured");
  const MemoryPlan& plan = r.c.plan();
  MemoryModel floored = r.c.model();
  EXPECT_GT(memory_plan_peak(floored, plan.batch, plan.micro_batch, plan.recompute, plan.data_placement),
            1.2 * r.truth(plan));  // what the floored model alone would predict
  EXPECT_NEAR(plan.predicted_peak_bytes, r.truth(plan), 1.0);  // the meter reads whole bytes
}

// After calibration a plan whose own peak is off its prediction by more than 5 %: over-predicted, the plan stays and
// its prediction is corrected, the model's scale kept (a refit down on one plan's low reading under-predicted the
// next plans); under-predicted past the limit, the scale is refit on its reading (a few times at most) and a new plan
// fits. A plan within 5 % changes nothing.
TEST(MemoryPlanControllerTest, APlanOffItsPredictionAfterCalibrationIsRecalibrated) {
  CalibrationRig r;
  r.steps(1, 8);  // calibrated on the true model
  ASSERT_NEAR(r.c.plan().predicted_peak_bytes, r.truth(r.c.plan()), 0.02 * r.truth(r.c.plan()));
  r.reasons.clear();
  r.steps(9, 12);  // within 5 %: nothing more
  EXPECT_TRUE(r.reasons.empty());
  const MemoryPlan kept = r.c.plan();
  r.true_scale = 0.3;  // what the calibration saw no longer holds (a plan that recomputes other units)
  r.steps(13, 20);
  EXPECT_EQ(r.reasons, std::vector<std::string>{"remeasured"});
  EXPECT_TRUE(r.c.plan() == kept);
  EXPECT_NEAR(r.c.plan().predicted_peak_bytes, r.truth(r.c.plan()), 1.0);  // the meter reads whole bytes
  EXPECT_NEAR(r.c.model().activation_scale, 0.5, 0.05);                      // the calibrated scale, kept
  r.reasons.clear();
  r.true_scale = 2.0;  // under-predicted: the plan no longer fits its limit
  r.steps(21, 30);
  ASSERT_FALSE(r.reasons.empty());
  EXPECT_EQ(r.reasons[0], "recalibrated");
  EXPECT_FALSE(r.c.plan() == kept);
  EXPECT_LE(r.truth(r.c.plan()), r.limits.budget_bytes);
  EXPECT_NEAR(r.c.plan().predicted_peak_bytes, r.truth(r.c.plan()), kPredictionTolerance * r.truth(r.c.plan()));
}

// BAOC's warm-up holds fp32 AdamW state (700 bytes here) and its format plan keeps a quarter of the moments: the
// rig's controller is told the bytes freed (set_optimizer_freed) and its meter reads the truth of the state held.
struct OptimizerRig {
  UnitRig rig{false, StepOptions{}, torch::kCPU};
  MemoryModel m = [] {
    MemoryModel made = made_up({100, 60, 20}, {2, 10, 6}, {1, 5, 5});
    made.dataset_bytes = 0;
    made.allow_host_data = false;
    made.optimizer_bytes = 700;
    return made;
  }();
  MemoryPlanLimits limits;
  std::unique_ptr<MemoryPlanController> c;
  double true_optimizer = 700, freed = 0;
  FakeMeter meter;
  StepContext ctx;
  std::vector<std::string> reasons;

  explicit OptimizerRig(int64_t budget) {
    limits.batch = 16;
    limits.budget_bytes = budget;
    c = std::make_unique<MemoryPlanController>(m, memory_plan_solve(m, 16, budget), limits, rig.step,
                                               [this](const std::vector<Precision>&) { return m; });
    c->set_optimizer_freed([this] { return freed; });
    meter.peak = [this] { return truth(c->plan()); };
    ctx.memory = &meter;
  }
  // The run needs half the modelled activations and 30 bytes the model missed, beside the state it holds now.
  double truth(const MemoryPlan& p) const {
    MemoryModel t = m;
    t.activation_scale = 0.5;
    t.fixed_bytes += 30;
    t.optimizer_bytes = true_optimizer;
    return memory_plan_peak(t, p.batch, p.micro_batch, p.recompute, p.data_placement);
  }
  void steps(int from, int to) {
    for (int s = from; s <= to; ++s) {
      ctx.step = s;
      for (const Event& e : c->after_step(ctx)) reasons.push_back(e.fields["reason"].get<std::string>());
    }
  }
};

// After BAOC's format plan the model's optimizer bytes are the first model's less what the plan freed; under a
// budget that bound during the warm-up the plan gives the room to the activations (here: every unit kept instead of
// recomputed); its prediction holds for the steps after the plan, which are what it is checked against (not the
// warm-up's steps, which held more: grid runs #2, #36, #41, #56, #105, #117 read 10-37 % above their predictions so).
// A later precision decision keeps the state as it is now.
TEST(MemoryPlanControllerTest, AnOptimizerStateAFormatPlanShrankGivesItsRoomToTheActivations) {
  for (const int64_t budget : {2000, 5000}) {  // the budget binds in the warm-up; it never binds
    SCOPED_TRACE(budget);
    OptimizerRig r(budget);
    r.steps(1, 8);  // calibrated on the warm-up
    const MemoryPlan warmup = r.c->plan();
    const double warmup_peak = r.c->plan_measured_peak_bytes();
    ASSERT_NEAR(warmup.predicted_peak_bytes, r.truth(warmup), 0.02 * r.truth(warmup));
    const bool bound = std::find(warmup.recompute.begin(), warmup.recompute.end(), true) != warmup.recompute.end();
    ASSERT_EQ(bound, budget == 2000) << "the warm-up's plan recomputes a unit only under the tight budget";

    r.reasons.clear();
    r.freed = 600;  // the plan step: the step held the warm-up's state, the plan left 100 bytes
    r.steps(9, 9);
    EXPECT_EQ(r.reasons, std::vector<std::string>{"optimizer_state"});
    EXPECT_DOUBLE_EQ(r.c->model().optimizer_bytes, 100);
    r.true_optimizer = 100;
    r.reasons.clear();
    r.steps(10, 14);
    EXPECT_TRUE(r.reasons.empty()) << r.reasons.front();  // the prediction holds: nothing to correct
    const MemoryPlan& after = r.c->plan();
    EXPECT_EQ(after.recompute, std::vector<bool>(3, false));
    EXPECT_EQ(after.micro_batch, 16);
    EXPECT_NEAR(after.predicted_peak_bytes, r.truth(after), 0.02 * r.truth(after));
    // Measured anew: the steps after the plan, not the warm-up's higher peak.
    EXPECT_DOUBLE_EQ(r.c->plan_measured_peak_bytes(), static_cast<double>(static_cast<int64_t>(r.truth(after))));
    if (!bound) {  // the same plan, 600 bytes less state: its steps peak lower than the warm-up's did
      EXPECT_TRUE(after == warmup);
      EXPECT_LT(r.c->plan_measured_peak_bytes(), warmup_peak - 500);
    }

    r.rig.step.set_unit_precisions({Precision::kFP32, Precision::kBF16, Precision::kBF16});
    r.steps(15, 15);
    EXPECT_DOUBLE_EQ(r.c->model().optimizer_bytes, 100) << "a precision decision re-priced the state as first planned";
  }
}

// A plan whose steps read below the model's price (here the scale an out-of-memory error floored at 1.25× the fit)
// prices the plan the format plan's room allows as the model's difference from that reading, not the model's price
// alone (grid run #2 on the H100: 1,071 MB predicted, 971 read; the old plan had read 876 under 964).
TEST(MemoryPlanControllerTest, AFormatPlansNewPlanIsPricedFromWhatTheOldOneRead) {
  for (const int64_t budget : {2000, 5000}) {
    SCOPED_TRACE(budget);
    OptimizerRig r(budget);
    r.steps(1, 8);
    r.c->on_out_of_memory();  // the scale 1.25× what the readings fit: every price above its truth
    r.steps(9, 10);
    const MemoryPlan before = r.c->plan();
    ASSERT_GT(memory_plan_peak(r.c->model(), before), 1.05 * r.truth(before));
    r.freed = 600;
    r.reasons.clear();
    r.steps(11, 11);
    ASSERT_EQ(r.reasons.back(), "optimizer_state");
    r.true_optimizer = 100;
    const MemoryPlan& after = r.c->plan();
    EXPECT_GT(memory_plan_peak(r.c->model(), after), 1.05 * r.truth(after)) << "the model alone is off";
    EXPECT_NEAR(after.predicted_peak_bytes, r.truth(after), kPredictionTolerance * r.truth(after));
    EXPECT_GE(after.predicted_peak_bytes, r.truth(after) - 1) << "priced below what it reads";
  }
}

// A store port for the next two-rank test of this file: one free now (ctest -j runs test binaries side by side).
int next_port() { return free_local_port(); }

// Data parallelism: two ranks whose traces differ (rank 1's unit 1 keeps more, its unit 2 cannot be recomputed, its
// fixed bytes are higher) agree on one model, each number the larger, the flag the stricter.
TEST(MemoryPlanControllerTest, RanksAgreeOnTheLargerModel) {
  std::vector<MemoryModel> models(2);
  const auto errors = test::on_two_ranks(next_port(), [&](int r, Dist& dist) {
    MemoryModel m = made_up({100, r == 0 ? 60.0 : 75.0, 20}, {2, 10, 6}, {1, 5, 5});
    m.fixed_bytes = r == 0 ? 500 : 400;
    m.units[2].recomputable = r == 0;
    memory_model_agree(m, [&](std::vector<double> v) { return dist.all_reduce_max(std::move(v)); });
    models[static_cast<size_t>(r)] = m;
  });
  EXPECT_EQ(errors, (std::vector<std::string>{"", ""}));
  for (const MemoryModel& m : models) {
    EXPECT_EQ(m.units[1].saved_bytes, 75);
    EXPECT_EQ(m.units[0].saved_bytes, 100);
    EXPECT_EQ(m.fixed_bytes, 500);
    EXPECT_TRUE(m.units[0].recomputable);
    EXPECT_FALSE(m.units[2].recomputable);
  }
}

// Data parallelism: two ranks whose allocators read differently (rank 1's run needs 1.5 × the modelled activations,
// rank 0's 0.5 ×) calibrate alike when they agree on the worst reading each step: one plan (micro-batch, recompute),
// one model, within the budget on the rank that needs more. Alone, each rank's calibration makes a plan of its own.
TEST(MemoryPlanControllerTest, TwoRanksWithDifferentReadingsAgreeOnOnePlan) {
  const double scales[2] = {0.5, 1.5};
  std::vector<MemoryPlan> alone(2);
  for (size_t r = 0; r < 2; ++r) {
    CalibrationRig rig;
    rig.true_scale = scales[r];
    rig.steps(1, 8);
    alone[r] = rig.c.plan();
  }
  ASSERT_FALSE(alone[0] == alone[1]) << "the readings must lead to different plans for the agreement to matter";

  std::vector<MemoryPlan> agreed(2);
  std::vector<double> scale(2), fits(2);
  const auto errors = test::on_two_ranks(next_port(), [&](int r, Dist& dist) {
    CalibrationRig rig;
    rig.true_scale = scales[r];
    rig.c.set_agree([&](std::vector<double> v) { return dist.all_reduce_max(std::move(v)); });
    rig.steps(1, 8);
    agreed[static_cast<size_t>(r)] = rig.c.plan();
    scale[static_cast<size_t>(r)] = rig.c.model().activation_scale;
    fits[static_cast<size_t>(r)] = rig.truth(rig.c.plan()) <= static_cast<double>(rig.limits.budget_bytes);
  });
  ASSERT_EQ(errors, (std::vector<std::string>{"", ""}));
  EXPECT_TRUE(agreed[0] == agreed[1]);
  EXPECT_TRUE(agreed[1] == alone[1]);  // the worst rank's plan
  EXPECT_EQ(scale[0], scale[1]);
  EXPECT_EQ(fits, (std::vector<double>{1, 1}));
}

}  // namespace
}  // namespace triaccel
