// Tri-Accel's curvature component (paper §3.2; docs/tri-accel.md), as a StepController: at the first control window,
// then at windows at least curv_every steps apart, a CurvatureProbe on a fixed batch — of every unit (budget 0, or
// lockstep rounds paced over the run's budget, round_pace_due) or of the next units, round-robin from the output end,
// whose cost fits a credit that accrues at budget × training time (so probes stay within that share of it) — then
// per-unit η_l = η0 / (1 + α·λ_max,l) as the optimizer's per-tensor lr scales (when lr scaling is on), and λ_max of the
// probed units left in the step's context for the precision policy (control/precision/precision_controller.h). Time
// comes from the injected clock only.
#pragma once

#include "triaccel/control/controller.h"
#include "triaccel/control/curvature/curvature_probe.h"
#include "triaccel/core/clock.h"
#include "triaccel/models/model.h"
#include "triaccel/optim/optimizer.h"
#include "triaccel/train/step.h"

#include <ATen/Tensor.h>

#include <memory>
#include <vector>

namespace triaccel {

// The defaults here are the run's (Config's ctrl_every, curv_budget, curv_alpha, curv_lr_mean, curv_lockstep and
// ta_curvature read them).
struct CurvatureControllerOptions {
  int64_t ctrl_every = 50;     // ctrl_every: steps per control window: probes happen at window ends only
  double budget = 0.05;        // curv_budget: share of training time for probes (0: every curvature.every_steps)
  double alpha = -1;           // curv_alpha: α; < 0: 1 / (0.9-quantile of λ_max) once every unit has been probed
  bool lr_scaling = true;      // ta_curvature; false: probe for the precision policy only (ablation)
  bool lr_mean_one = true;     // curv_lr_mean: the lr scales over their parameter-weighted mean (lr_scales_mean_one)
  CurvatureOptions probe;      // k, iterations, batch, T_curv, seed, graphs, clock
  // curv_lockstep: every unit each round, by one CurvatureRound (k = 1; its pass replays a CUDA graph on a GPU); the
  // schedule then plans whole rounds with the last steady round's cost. The Fisher's rounds are lockstep whatever this
  // says (lockstep_rounds()). Off by default for the Hessian: a first round costs more than a short run's share, and
  // its graph's pool is not in the memory plan (docs/tri-accel.md).
  bool lockstep = false;
  // Lockstep rounds with a run of known length (the trainer's total steps; 0: unknown): the budget is the whole run's
  // (round_pace_due) — the rounds it still pays for are spread evenly over the steps left, the first round's cost
  // (its capture, several times a warm round's cost) taken out of it once. Without a known length each round waits
  // for the credit the steps before it accrued, and a run is probed only a few times, most of it in one unprobed
  // stretch (measured: docs/results/tri-accel.md).
  int64_t total_steps = 0;
  // Lockstep rounds in the training step's CUDA-graph pool (CurvatureRound::share_pool): under a --vram-budget,
  // whose plan fills the budget with the steps and leaves no room for a pool of the rounds' own. A round waits for the
  // step's graph (skipped "no step graph" while the step runs eagerly).
  bool share_step_pool = false;
  std::vector<int64_t> probe_samples;  // the dataset indices of the probe batch (for the event)

  // Whether the controller runs lockstep rounds: when asked, and always for the Fisher (it has no per-unit probe).
  bool lockstep_rounds() const { return lockstep || probe.estimator == CurvatureEstimator::kFisher; }
};

// The per-unit lr scales divided by their mean weighted by each unit's parameter count, so that the network's mean
// learning rate stays the schedule's: curvature moves rate from the sharp units to the flat ones instead of only
// lowering it (not the paper's rule, η_l = η₀ / (1 + α·λ_max,l), whose scales are all ≤ 1). Unchanged when the
// weighted mean is not positive.
void lr_scales_mean_one(std::vector<double>* scales, const std::vector<int64_t>& unit_params);

// Lockstep rounds in a run of `total_steps` steps: is a round due at `step`? The budget still to spend is
// budget × the run's projected training time (training_s so far, plus step_s for each step left) less probe_s, what
// the probes spent; it pays for m = ⌊left / round_cost_s⌋ more rounds, spread evenly over the steps from the last
// round to the end: the next is due (total_steps − last_round_step) / (m + 1) steps after the last. Spending runs
// ahead of the credit accrued so far and ends within budget × training time when the projection holds. step_s is the
// rate since the last round: the run's average, slowed by its first epoch (slower than the later ones), projected
// rounds the run then did not pay for and left its last epochs unprobed (measured: docs/results/tri-accel.md).
struct RoundPace {
  double budget = 0;            // share of training time for the rounds
  double training_s = 0;        // training time so far (rounds excluded)
  double step_s = 0;            // training seconds per step lately (<= 0: training_s / step)
  double probe_s = 0;           // the rounds' seconds so far (the first one's included)
  double round_cost_s = 0;      // what a warm round costs (> 0)
  int64_t last_round_step = 0;  // the step of the last round
  int64_t total_steps = 0;      // the run's steps
};
bool round_pace_due(const RoundPace& pace, int64_t step);

// A probe's samples that fit `room_bytes` when it allocates fixed + slope · samples: at most `full`, 0 when not even
// kMinProbeSamples fit. room_bytes < 0 (no limit): `full`.
constexpr int64_t kMinProbeSamples = 2;
int64_t probe_samples_fitting(double fixed_bytes, double slope_bytes, double room_bytes, int64_t full);

class CurvatureController final : public StepController {
 public:
  // probe_images/labels: the fixed curvature batch (b_curv samples), on the model's device.
  CurvatureController(CurvatureControllerOptions options, Model& model, Optimizer& optimizer, TrainStep& step,
                      at::Tensor probe_images, at::Tensor probe_labels);

  const char* state_key() const override { return "tri_accel"; }
  Events after_step(StepContext& ctx) override;
  void pause() override { last_call_s_ = -1; }
  Json state() const override;
  void restore(const Json& state) override;

  double overhead_s() const override { return probe_seconds_; }

 private:
  std::vector<size_t> units_due(int64_t step);  // this round's units at `step`; advances nothing
  std::vector<size_t> units_agreed(StepContext& ctx);
  void probe_record(StepContext& ctx, const std::vector<size_t>& chosen, const std::vector<UnitCurvature>& curv,
                    double seconds, int64_t samples, double probe_bytes, Events& events);
  // Data parallelism: rank 0's probe results (eigenvalues, products, seconds of `chosen`) on every rank.
  void agree_results(const StepContext& ctx, const std::vector<size_t>& chosen, std::vector<UnitCurvature>* curv,
                     double* seconds) const;
  // α (calibrated once every unit has been probed, unless given) and each probed unit's lr scale from its λ_max.
  void lr_scales_update();
  void apply_lr_scales();
  Json round_json() const;  // the last lockstep round's passes, times and graph (null without one)
  // This round's probe: the lockstep round, or curvature_probe of `chosen` on the first `samples` of the probe batch
  // (probed twice at the first round, to plan with the steady cost).
  std::vector<UnitCurvature> probe(const std::vector<size_t>& chosen, int64_t samples, double* seconds);
  // The probe's samples that fit the memory the run's plan leaves (StepContext::memory's room; all of them without
  // a limit or a meter). A probe's memory is set by its earliest unit (the graph it keeps for the double backward
  // runs from there to the loss): the first time a unit is the earliest, two one-product probes of 2 and 4 samples
  // measure its bytes per sample and fixed bytes. Adds their seconds to `seconds`.
  int64_t probe_samples_for(StepContext& ctx, const std::vector<size_t>& chosen, double* seconds);
  // probe() at the samples that fit (`samples`; 0: none fit, nothing probed), measured on the meter where there is
  // one (`probe_bytes`), `seconds` with the measuring probes'. Rank 0's size on every rank.
  std::vector<UnitCurvature> probe_sized(StepContext& ctx, const std::vector<size_t>& chosen, int64_t* samples,
                                         double* probe_bytes, double* seconds);

  CurvatureControllerOptions options_;
  const Clock& clock_;
  Model& model_;
  Optimizer& optimizer_;
  TrainStep& step_;
  at::Tensor probe_images_, probe_labels_;
  std::vector<int64_t> unit_of_param_;  // optimizer.params() index → unit index
  std::vector<std::vector<at::Tensor>> warm_start_;  // per unit: the last probe's eigenvectors (not checkpointed)
  std::vector<double> unit_lr_scale_;
  std::vector<double> unit_cost_s_;    // per unit: seconds of its last probe; < 0 unknown
  std::vector<double> unit_lambda_;    // per unit: last λ_max
  std::vector<bool> unit_probed_;      // per unit: probed at least once
  // Per unit, as the earliest unit of a probe: the bytes it allocates, fixed + per sample (< 0: not measured yet).
  std::vector<double> unit_probe_fixed_, unit_probe_slope_;
  double last_room_bytes_ = -1;        // the room the last probe was sized for (< 0: none)
  int64_t next_unit_ = 0;              // round-robin position
  double alpha_ = -1;
  int64_t next_probe_step_ = -1;       // < 0: at the first control window
  double last_call_s_ = -1;
  double probe_seconds_ = 0;
  int64_t probes_ = 0;
  std::unique_ptr<CurvatureRound> round_;  // lockstep: made at the first round, held for the run
  double round_cost_s_ = -1;              // lockstep: seconds of the last steady round; < 0 unknown
  double training_s_ = 0;                 // training time so far (the clock between calls, probes excluded)
  // The probe credit: budget × training time, less the probes' seconds (what a probe may still spend).
  double credit_s() const { return options_.budget * training_s_ - probe_seconds_; }
  int64_t last_round_step_ = -1;          // lockstep: the step of the last round (< 0: none yet)
  double last_round_training_s_ = -1;     // lockstep: training_s_ at the last round (< 0: not known)
  bool round_due(int64_t step) const;     // lockstep: the first round, then round_pace_due or the credit
  // Lockstep rounds under a budget in a run of known length: paced by round_pace_due, checked at every window.
  bool paced() const { return options_.lockstep && options_.budget > 0 && options_.total_steps > 0; }
};

}  // namespace triaccel
