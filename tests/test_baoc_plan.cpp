// BAOC planning: the exact allocation against brute force on random small instances, the risk model's
// monotonicity, budget parsing and its errors, signals from gradient streams, and a plan for the small CNN.
#include "test_util.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"
#include "triaccel/models/model.h"
#include "triaccel/optim/allocation.h"
#include "triaccel/control/optimizer_state/baoc_controller.h"
#include "triaccel/optim/baoc_optimizer.h"
#include "triaccel/control/optimizer_state/format_plan.h"
#include "triaccel/optim/risk.h"
#include "triaccel/optim/quant8.h"
#include "triaccel/optim/signals.h"
#include "triaccel/optim/state_format.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <random>
#include <set>

namespace triaccel {
namespace {

AllocationProblem random_problem(std::mt19937& rng, bool timed) {
  std::uniform_int_distribution<int> units(1, 5), options(1, 4), bytes(0, 40), time(0, 9);
  std::uniform_real_distribution<double> risk(0, 1);
  AllocationProblem p;
  const int n = units(rng);
  for (int u = 0; u < n; ++u) {
    std::vector<AllocationOption> opts;
    const int k = options(rng);
    for (int j = 0; j < k; ++j) opts.push_back({risk(rng), bytes(rng), static_cast<double>(time(rng))});
    p.units.push_back(opts);
  }
  p.memory_budget = std::uniform_int_distribution<int>(0, 40 * n)(rng);
  if (timed) {
    p.time_budget = std::uniform_int_distribution<int>(1, 9 * n)(rng);
    p.time_buckets = static_cast<int64_t>(p.time_budget);  // one bucket per time unit: the DP is exact
  }
  return p;
}

TEST(AllocationTest, DynamicProgramEqualsBruteForceOnRandomInstances) {
  std::mt19937 rng(7);
  int feasible = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const AllocationProblem p = random_problem(rng, trial % 2 == 1);
    const AllocationResult dp = allocation_solve(p), bf = allocation_brute_force(p);
    ASSERT_EQ(dp.feasible, bf.feasible) << "trial " << trial;
    if (!bf.feasible) continue;
    ++feasible;
    EXPECT_NEAR(dp.risk, bf.risk, 1e-9) << "trial " << trial;
    EXPECT_LE(dp.bytes, p.memory_budget);
    if (p.time_budget >= 0) EXPECT_LE(dp.time, p.time_budget + 1e-9);
  }
  EXPECT_GT(feasible, 100);  // the instances are not all trivially infeasible
}

TEST(AllocationTest, CoarseBucketsStayWithinTheRealBudget) {
  std::mt19937 rng(8);
  for (int trial = 0; trial < 100; ++trial) {
    AllocationProblem p = random_problem(rng, true);
    for (auto& opts : p.units) for (auto& o : opts) o.bytes *= 1000003;  // large, not multiples of a bucket
    p.memory_budget *= 1000003;
    p.time_buckets = 7;
    const AllocationResult dp = allocation_solve(p), bf = allocation_brute_force(p);
    if (dp.feasible) {
      EXPECT_TRUE(bf.feasible);
      EXPECT_LE(dp.bytes, p.memory_budget);
      EXPECT_LE(dp.time, p.time_budget + 1e-9);
      EXPECT_GE(dp.risk, bf.risk - 1e-9);
    }
  }
}

TEST(RiskTest, Monotonicity) {
  UnitSignals base;
  base.params = 100;
  base.cos_successive = 0.5;
  base.cos_momentum = 0.6;
  base.snr = 0.1;
  base.precond_error = 0.3;
  base.factor_error = 0.2;
  base.quant_error_bf16 = 0.004;
  base.quant_error_8bit = 0.03;
  EXPECT_EQ(risk_unit_format(StateFormat::kAdamW32, base), 0.0);
  UnitSignals worse = base;
  worse.quant_error_8bit = 0.1;
  EXPECT_GT(risk_unit_format(StateFormat::kAdamW8, worse), risk_unit_format(StateFormat::kAdamW8, base));
  worse = base;
  worse.quant_error_bf16 = 0.01;
  EXPECT_GT(risk_unit_format(StateFormat::kAdamW16, worse), risk_unit_format(StateFormat::kAdamW16, base));
  // Lower directional stability ⇒ more risk without momentum (no-momentum, factored, plain SGD).
  worse = base;
  worse.cos_successive = 0.1;
  for (StateFormat f : {StateFormat::kNoMomentum, StateFormat::kFactored, StateFormat::kSgd}) {
    EXPECT_GT(risk_unit_format(f, worse), risk_unit_format(f, base)) << state_format_name(f);
  }
  worse = base;
  worse.cos_momentum = 0.2;
  EXPECT_GT(risk_unit_format(StateFormat::kNoMomentum, worse), risk_unit_format(StateFormat::kNoMomentum, base));
  // Higher signal-to-noise ⇒ momentum matters less.
  UnitSignals better = base;
  better.snr = 2;
  EXPECT_LT(risk_unit_format(StateFormat::kNoMomentum, better), risk_unit_format(StateFormat::kNoMomentum, base));
  // More anisotropy ⇒ more risk for a scalar preconditioner; worse rank-1 fit ⇒ more risk factored.
  worse = base;
  worse.precond_error = 0.6;
  EXPECT_GT(risk_unit_format(StateFormat::kSgdMomentum, worse), risk_unit_format(StateFormat::kSgdMomentum, base));
  worse = base;
  worse.factor_error = 0.5;
  EXPECT_GT(risk_unit_format(StateFormat::kFactored, worse), risk_unit_format(StateFormat::kFactored, base));
  // Momentum-free formats are never less risky than their momentum counterparts on the same signals.
  EXPECT_GE(risk_unit_format(StateFormat::kSgd, base), risk_unit_format(StateFormat::kSgdMomentum, base));
  // Weighting: by default every unit weighs the same (1 / units); unit_floor 0.5: half by the share of parameters,
  // half equal. Of 1000 parameters in 5 units, a unit of 100 weighs 0.2 by default and 0.5·0.1 + 0.5·0.2 = 0.15
  // at 0.5, one of 200 weighs 0.2 either way; with unit_floor 0, by size only (0.1 and 0.2).
  UnitSignals big = base;
  big.params = 200;
  const double r8 = risk_unit_format(StateFormat::kAdamW8, base);
  ASSERT_GT(r8, 0);
  EXPECT_NEAR(risk_weighted(StateFormat::kAdamW8, base, 1000, 5), 0.2 * r8, 1e-12);
  EXPECT_NEAR(risk_weighted(StateFormat::kAdamW8, big, 1000, 5), 0.2 * r8, 1e-12);
  RiskOptions half;
  half.unit_floor = 0.5;
  EXPECT_NEAR(risk_weighted(StateFormat::kAdamW8, base, 1000, 5, half), 0.15 * r8, 1e-12);
  EXPECT_NEAR(risk_weighted(StateFormat::kAdamW8, big, 1000, 5, half), 0.2 * r8, 1e-12);
  RiskOptions by_size;
  by_size.unit_floor = 0;
  EXPECT_NEAR(risk_weighted(StateFormat::kAdamW8, big, 1000, 5, by_size),
              2 * risk_weighted(StateFormat::kAdamW8, base, 1000, 5, by_size), 1e-12);
}

// The SGD formats' error and the factored format's error use one metric (the relative distance of the format's
// update from AdamW's). After one step from zero state m̂ = g and v̂ = g², so AdamW's update is sign(g):
// - g = outer(r, c): v̂ is exactly rank-1, the factorization is exact, a scalar per tensor is far off;
// - |g| constant: a scalar is exact, and so is the factorization (a constant matrix is rank-1).
TEST(SignalsTest, ScalarAndRankOneErrorsShareAMetric) {
  auto signals_after_one_step = [](const at::Tensor& g) {
    at::Tensor w = torch::zeros(g.sizes()).set_requires_grad(true);
    BaocOptimizer opt({{"w", w}}, BaocOptions{0.9, 0.999, 1e-8, 0.0});
    w.mutable_grad() = g.clone();
    opt.step(torch::full({1}, 1e-3), torch::zeros({1}));
    return baoc_signals(opt, torch::zeros({1, kStreamColumns}, torch::kDouble), {0}, 1, {}).at(0);
  };
  const at::Tensor rank1 = torch::outer(torch::linspace(1, 4, 16), torch::linspace(0.5, 2, 12));
  const UnitSignals a = signals_after_one_step(rank1);
  EXPECT_LT(a.factor_error, 1e-6);
  EXPECT_GT(a.precond_error, 0.2);  // sign(g) vs g / rms(g)
  torch::manual_seed(7);
  const at::Tensor flat = 0.3 * torch::sign(torch::randn({16, 12}));
  const UnitSignals b = signals_after_one_step(flat);
  EXPECT_LT(b.precond_error, 1e-6);
  EXPECT_LT(b.factor_error, 1e-6);
  // On the rank-1 gradient the model now prefers factored to plain SGD (momentum loss equal for both).
  EXPECT_LT(risk_unit_format(StateFormat::kFactored, a), risk_unit_format(StateFormat::kSgd, a));
}

// The moments' sums as the whole-tensor formulas give them: float64 copies of everything at once (what
// moment_sums computed before it went chunk by chunk; its temporaries were ~100 bytes an element of the largest tensor).
MomentSums moment_sums_whole(const at::Tensor& m32, const at::Tensor& v32, const at::Tensor& ms, const at::Tensor& mu,
                             double bc1, double bc2, double eps) {
  const auto dir = [eps](const at::Tensor& m, const at::Tensor& v) { return m / (v.sqrt() + eps); };
  const auto sum = [](const at::Tensor& t) { return t.sum().item<double>(); };
  const at::Tensor m = m32.to(at::kDouble), v = v32.to(at::kDouble);
  const at::Tensor mh = m / bc1, vh = v / bc2, u = dir(mh, vh);
  MomentSums out;
  out.u_sq = sum(u * u);
  out.du_scalar = sum((u - mh / (std::sqrt(vh.mean().item<double>()) + eps)).pow(2));
  const at::Tensor m16 = m.to(at::kBFloat16).to(at::kDouble), v16 = v.to(at::kBFloat16).to(at::kDouble);
  out.du_bf16 = sum((u - dir(m16 / bc1, v16 / bc2)).pow(2));
  const int64_t n = m32.numel();
  const at::Tensor m8 = quant8_decode(quant8_encode(m32.reshape({-1}), ms), ms, {n}).to(at::kDouble);
  const at::Tensor v8 = quant8_decode(quant8_encode(v32.reshape({-1}), mu), mu, {n}).to(at::kDouble);
  out.du_8bit = sum((u.reshape({-1}) - dir(m8 / bc1, v8 / bc2)).pow(2));
  const auto [rows, cols] = state_format_factor_shape(m32.sizes().vec());
  if (rows > 0) {
    const at::Tensor v2 = vh.reshape({rows, cols});
    const at::Tensor r = v2.mean(1), c = v2.mean(0);
    out.du_factor = sum((u - dir(mh, (at::outer(r, c) / r.mean()).reshape(vh.sizes()))).pow(2));
  }
  out.mh_sq = sum(mh * mh);
  out.noise = sum((vh - mh * mh).clamp_min(0));
  const at::Tensor logv = (vh + 1e-30).log();
  out.logv = sum(logv);
  out.logv_sq = sum(logv * logv);
  out.elems = static_cast<double>(n);
  return out;
}

TEST(SignalsTest, MomentSumsChunkByChunkEqualTheWholeTensorFormulas) {
  torch::manual_seed(3);
  const at::Tensor ms = quant8_map(true), mu = quant8_map(false);
  // Rows that straddle chunks, a channels_last weight (its logical order is not its memory order), a leading
  // size-1 dimension, a vector; every size over several chunks of 256.
  struct Case {
    std::vector<int64_t> shape;
    bool channels_last;
  };
  for (const Case& k : {Case{{37, 29}, false}, Case{{16, 12, 3, 3}, true}, Case{{1, 40, 24}, false},
                        Case{{700}, false}}) {
    SCOPED_TRACE(::testing::PrintToString(k.shape));
    // Moments of spread magnitudes (so the 8-bit and the factored errors are not zero), each row its own scale.
    at::Tensor m = torch::randn(k.shape) * torch::exp(2 * torch::randn(k.shape));
    at::Tensor v = torch::randn(k.shape).pow(2) * torch::exp(torch::randn(k.shape)) + 1e-6;
    if (k.channels_last) {
      m = m.contiguous(at::MemoryFormat::ChannelsLast);
      v = v.contiguous(at::MemoryFormat::ChannelsLast);
    }
    const double bc1 = 0.4, bc2 = 0.07, eps = 1e-8;
    const MomentSums want = moment_sums_whole(m, v, ms, mu, bc1, bc2, eps);
    EXPECT_GT(want.du_8bit, 1e-6 * want.u_sq);
    if (k.shape.size() > 1) EXPECT_GT(want.du_factor, 1e-3 * want.u_sq);
    for (const int64_t chunk : {int64_t{256}, int64_t{512}, kSignalChunkElements}) {
      SCOPED_TRACE(chunk);
      const MomentSums got = moment_sums(m, v, ms, mu, bc1, bc2, eps, chunk);
      for (double MomentSums::*f : {&MomentSums::u_sq, &MomentSums::du_scalar, &MomentSums::du_bf16,
                                    &MomentSums::du_8bit, &MomentSums::du_factor, &MomentSums::mh_sq,
                                    &MomentSums::noise, &MomentSums::logv, &MomentSums::logv_sq}) {
        EXPECT_NEAR(got.*f, want.*f, 1e-10 * std::max(1.0, std::abs(want.*f)));
      }
      EXPECT_EQ(got.elems, want.elems);
    }
  }
  EXPECT_THROW(moment_sums(torch::ones({8}), torch::ones({8}), ms, mu, 1, 1, 1e-8, 100), c10::Error);
}

TEST(PlannerTest, BudgetsParse) {
  EXPECT_EQ(optim_memory_budget_parse("15%", 1000), 150);
  EXPECT_EQ(optim_memory_budget_parse("200MB", 1000), 200000000);
  EXPECT_EQ(optim_memory_budget_parse("1.5KiB", 1000), 1536);
  EXPECT_THROW(optim_memory_budget_parse("abc%", 1000), UserError);
  EXPECT_THROW(optim_memory_budget_parse("150%", 1000), UserError);
  EXPECT_DOUBLE_EQ(optim_time_budget_parse("1.1x", 2.0), 2.2);
  EXPECT_LT(optim_time_budget_parse("none", 2.0), 0);
  EXPECT_LT(optim_time_budget_parse("", 2.0), 0);
  EXPECT_THROW(optim_time_budget_parse("fast", 2.0), UserError);
}

TEST(PlannerTest, ChoosesTheLowRiskCheapFormatsAndSaysTheMinimumWhenTheBudgetIsTooSmall) {
  // Two equal units: A quantizes badly, B has unstable gradients (momentum matters).
  std::vector<FormatPlanUnit> units = {{"A", {{100, 10}}}, {"B", {{100, 10}}}};
  UnitSignals a, b;
  a.quant_error_8bit = 0.5;
  a.cos_successive = a.cos_momentum = 1;  // stable: momentum-free formats cost nothing
  a.factor_error = 0.01;
  a.precond_error = 0.5;  // a scalar preconditioner would turn its update a lot
  b.precond_error = 0.5;
  b.quant_error_bf16 = 0.005;
  b.quant_error_8bit = 0.01;
  b.cos_successive = b.cos_momentum = -0.5;
  b.factor_error = 0.01;
  FormatPlanOptions o;
  o.memory_budget = "20%";  // 3200 bytes: too little for bf16 on B (4000)
  const FormatPlan plan = format_plan_solve(units, {a, b}, o);
  ASSERT_EQ(plan.units.size(), 2u);
  EXPECT_EQ(plan.adamw_fp32_bytes, 16000);
  EXPECT_LE(plan.bytes, 3200);
  EXPECT_EQ(plan.units[0].format, StateFormat::kFactored);  // cheap and (almost) riskless for the stable unit
  EXPECT_EQ(plan.units[1].format, StateFormat::kAdamW8);   // keeps momentum, quantizes well
  const Json j = format_plan_to_json(plan);
  EXPECT_EQ(j["units"][1]["format"], "adamw-8bit");
  EXPECT_EQ(j["adamw_fp32_bytes"], 16000);

  o.formats = {StateFormat::kAdamW32, StateFormat::kAdamW8};
  o.memory_budget = "10%";
  try {
    format_plan_solve(units, {a, b}, o);
    FAIL() << "expected a UserError";
  } catch (const UserError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("at least 4032 bytes"), std::string::npos) << msg;  // 2 × (2·1000 + 2·2·4 blocks)
    EXPECT_NE(msg.find("optim_memory_budget 10% (1600 bytes) is below the cheapest plan"), std::string::npos) << msg;
  }
}

TEST(PlannerTest, LookupUnitsKeepPerElementMoments) {
  // Unit A is stable (momentum-free formats cost nothing) and quantizes badly: as a plain unit it goes factored;
  // as a lookup unit (an embedding table) only fp32 / bf16 / 8-bit are offered, and 8-bit is what fits.
  std::vector<FormatPlanUnit> units = {{"A", {{100, 10}}}, {"B", {{100, 10}}}};
  UnitSignals a, b;
  a.quant_error_8bit = 0.5;
  a.cos_successive = a.cos_momentum = 1;
  a.factor_error = 0.01;
  a.precond_error = 0.5;  // plain SGD would turn its update a lot
  b.quant_error_8bit = 0.01;
  b.cos_successive = b.cos_momentum = -0.5;
  b.precond_error = 0.5;
  b.factor_error = 0.01;
  FormatPlanOptions o;
  o.memory_budget = "30%";  // 4800 bytes: both 8-bit (2 × 2016) fit, bf16 (4000) + anything does not
  EXPECT_EQ(format_plan_solve(units, {a, b}, o).units[0].format, StateFormat::kFactored);
  units[0].lookup = true;
  const FormatPlan plan = format_plan_solve(units, {a, b}, o);
  EXPECT_EQ(plan.units[0].format, StateFormat::kAdamW8);
  EXPECT_EQ(plan.units[1].format, StateFormat::kAdamW8);
  EXPECT_TRUE(format_plan_to_json(plan)["units"][0]["lookup"].get<bool>());
  // A menu without per-element formats is honoured (a uniform run stays uniform).
  o.formats = {StateFormat::kSgd};
  EXPECT_EQ(format_plan_solve(units, {a, b}, o).units[0].format, StateFormat::kSgd);
  EXPECT_EQ(format_plan_unit_menu(units[0], state_formats_all()),
            (std::vector<StateFormat>{StateFormat::kAdamW32, StateFormat::kAdamW16, StateFormat::kAdamW8}));
  EXPECT_EQ(format_plan_unit_menu(units[1], state_formats_all()), state_formats_all());
}

TEST(PlannerTest, MeasuredStepTimesDecideUnderATimeBudget) {
  test::TempDir dir("optim_time_table");
  // A bench_optim_step result in which 8-bit is the slowest format (per 1000 elements, CUDA-graph medians).
  Json rows = Json::array();
  const std::vector<std::pair<std::string, double>> ms = {{"adamw-fp32", 1.0}, {"adamw-bf16", 0.8}, {"adamw-8bit", 1.5},
                                                          {"factored", 0.5},   {"no-momentum", 0.8}, {"sgd-momentum", 0.8},
                                                          {"sgd", 0.4}};
  for (const auto& [name, t] : ms) rows.push_back(Json{{"format", name}, {"graph", Json{{"median_ms", t}}}});
  rows.push_back(Json{{"system", "libtorch"}, {"time", Json{{"median_ms", 3.0}}}});
  const std::string path = dir.file("optim_step.json");
  file_write_atomic(path, Json{{"bench", "optim_step"}, {"params", 1000}, {"rows", rows}}.dump());
  FormatPlanOptions o;
  o.time_model = step_time_model_from_bench(path);
  EXPECT_DOUBLE_EQ(o.time_model.seconds(StateFormat::kAdamW8, 1000), 1.5e-3);
  std::vector<FormatPlanUnit> units = {{"A", {{100, 10}}}};
  UnitSignals s;
  s.quant_error_8bit = 0.001;  // 8-bit is nearly free in risk
  s.factor_error = 0.3;
  s.precond_error = 0.3;
  s.cos_successive = s.cos_momentum = 0;
  o.memory_budget = "30%";
  EXPECT_EQ(format_plan_solve(units, {s}, o).units[0].format, StateFormat::kAdamW8);
  o.time_budget = "1.2x";  // 1.2 ms: 8-bit (1.5 ms) no longer fits
  const FormatPlan timed = format_plan_solve(units, {s}, o);
  EXPECT_NE(timed.units[0].format, StateFormat::kAdamW8);
  EXPECT_LE(timed.time_s, 1.2e-3 + 1e-12);
  EXPECT_EQ(format_plan_to_json(timed)["time_model"], path);
  file_write_atomic(path, Json{{"bench", "optim_step"}, {"params", 1000}, {"rows", Json::array()}}.dump());
  EXPECT_THROW(step_time_model_from_bench(path), UserError);
  EXPECT_THROW(step_time_model_from_bench(dir.file("missing.json")), UserError);
}

TEST(SignalsTest, StableGradientsScoreHigherDirectionalStabilityThanNoise) {
  torch::manual_seed(11);
  at::Tensor stable = torch::zeros({64, 32}).set_requires_grad(true);
  at::Tensor noisy = torch::zeros({64, 32}).set_requires_grad(true);
  BaocOptimizer opt({{"stable", stable}, {"noisy", noisy}}, BaocOptions{});
  opt.stream_stats_enable(true);
  const at::Tensor direction = torch::randn({64, 32});
  for (int step = 0; step < 20; ++step) {
    stable.mutable_grad() = direction + 0.1 * torch::randn({64, 32});
    noisy.mutable_grad() = torch::randn({64, 32});
    opt.step(torch::full({1}, 1e-3), torch::zeros({1}));
  }
  const auto s = baoc_signals(opt, opt.stream_stats_take(), {0, 1}, 2);
  EXPECT_GT(s[0].cos_successive, 0.9);
  EXPECT_LT(std::abs(s[1].cos_successive), 0.1);
  EXPECT_GT(s[0].cos_momentum, s[1].cos_momentum);
  EXPECT_GT(s[0].snr, s[1].snr);
  EXPECT_GT(risk_unit_format(StateFormat::kNoMomentum, s[1]), risk_unit_format(StateFormat::kNoMomentum, s[0]));
  // Quantization errors are measured and ordered: 8-bit loses more than bf16.
  EXPECT_GT(s[1].quant_error_8bit, s[1].quant_error_bf16);
  EXPECT_GT(s[1].quant_error_bf16, 0);
  EXPECT_EQ(s[0].params, 64 * 32);
}

// A meter that counts the transients run through it (measure), the plan's signals and conversions among them.
class CountingMeter : public MemoryMeter {
 public:
  int measured = 0;
  MemoryStats window() override { return {}; }
  void restart() override {}
  double measure(const std::function<void()>& fn) override {
    ++measured;
    fn();
    return 0;
  }
};

// The small CNN's plan at 15 %: within the budget, formats mixed; the plan's work runs as a measured transient
// (apart from the steps' readings), and what the plan frees of the warm-up's priced state is reported to the memory
// planner: the fp32 AdamW moments beyond the plan's (with re-plans, beyond the budget a later plan may fill) and,
// without re-plans, the statistics window's previous gradients.
TEST(SignalsTest, SmallCnnPlanAtFifteenPercentFitsAndMixesFormats) {
  for (const int64_t replan_every : {0, 3}) {
    SCOPED_TRACE(replan_every);
    torch::manual_seed(12);
    ModelOptions mo;
    mo.name = "small-cnn";
    mo.in_channels = 1;
    mo.image_size = 28;
    const auto model = model_create(mo);
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (const auto& item : model->named_parameters()) named.emplace_back(item.key(), item.value());
    BaocOptimizer opt(named, BaocOptions{});
    BaocControllerOptions to;
    to.memory_budget = "15%";
    to.plan_warmup = 6;
    to.replan_every = replan_every;
    int invalidations = 0;
    CountingMeter meter;
    BaocController controller(to, *model, opt, [&]() { ++invalidations; }, 1);
    EXPECT_TRUE(opt.stream_stats_enabled());
    const at::Tensor x = torch::randn({32, 1, 28, 28});
    const at::Tensor y = torch::randint(0, 10, {32});
    Json plan;
    for (int64_t step = 1; step <= 6; ++step) {
      for (auto& p : opt.params()) p.mutable_grad() = at::Tensor();
      at::cross_entropy_loss(model->forward(x), y).backward();
      opt.step(torch::full({1}, 1e-3), torch::zeros({1}));
      StepContext ctx;
      ctx.step = step;
      ctx.memory = &meter;
      if (step < 6) EXPECT_EQ(controller.state_bytes_freed(), 0);  // the warm-up holds what was priced
      for (const Event& e : controller.after_step(ctx)) {
        if (std::string(e.name) == event::kOptimPlan) plan = e.fields;
      }
    }
    ASSERT_FALSE(plan.is_null());
    EXPECT_EQ(meter.measured, 1);
    const int64_t n = model->parameter_count();
    if (replan_every == 0) {
      EXPECT_FALSE(opt.stream_stats_enabled());
      EXPECT_EQ(controller.state_bytes_freed(), 8 * n - opt.state_bytes() + 4 * n);
    } else {
      EXPECT_TRUE(opt.stream_stats_enabled());  // the window before the re-plan at step 9
      EXPECT_EQ(controller.state_bytes_freed(), 8 * n - plan["budget_bytes"].get<int64_t>());
    }
    EXPECT_LE(plan["total_bytes"].get<int64_t>(), plan["budget_bytes"].get<int64_t>());
    EXPECT_EQ(plan["adamw_fp32_bytes"].get<int64_t>(), 8 * model->parameter_count());
    EXPECT_EQ(plan["state_bytes"].get<int64_t>(), opt.state_bytes());
    EXPECT_EQ(opt.state_bytes(), plan["total_bytes"].get<int64_t>());
    std::set<std::string> formats;
    for (const auto& u : plan["units"]) formats.insert(u["format"].get<std::string>());
    EXPECT_GE(formats.size(), 2u) << plan.dump();
    EXPECT_GE(invalidations, 2);  // statistics off, state converted
  }
}

}  // namespace
}  // namespace triaccel
