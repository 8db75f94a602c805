// The Tri-Accel control loop, driven by the trainer after every optimizer step (docs/tri-accel.md):
//   every ctrl_every steps: per-unit gradient variance (accumulated inside the step) → PrecisionPolicy → the step's
//                           per-unit autocast precision;
//   at the first window, then at windows at least curv_every steps apart: CurvatureProbe on a fixed batch, of all
//                           units (curv_budget 0) or of the next units round-robin whose measured cost fits a credit
//                           that accrues at curv_budget × training time (so probes stay within that share) → per-unit
//                           η_l = η0 / (1 + α·λ_max,l) as the optimizer's per-tensor lr scales, and λ_max into the
//                           policy (precision promotion above τ_curv).
// The controllers are pure (precision/policy.h); this class owns their state and applies the decisions (side
// effects: the step's precisions, the optimizer's lr scales, graph invalidation). It returns the events to log.
#pragma once

#include "triaccel/core/json.h"
#include "triaccel/curvature/probe.h"
#include "triaccel/models/model.h"
#include "triaccel/precision/policy.h"
#include "triaccel/train/options.h"
#include "triaccel/train/optimizer.h"
#include "triaccel/train/step.h"

#include <ATen/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace triaccel {

class TriAccelDriver {
 public:
  // probe_images/labels: the fixed curvature batch (b_curv samples), on the model's device.
  TriAccelDriver(const TrainOptions& options, Model& model, Optimizer& sgd, TrainStep& step, at::Tensor probe_images,
                 at::Tensor probe_labels);

  // Runs whatever is due after optimizer step `step` (1-based count); returns (event name, fields) to log.
  std::vector<std::pair<std::string, Json>> after_step(int64_t step);

  // The trainer stops training between the steps it is about to run (evaluation, a checkpoint): that time earns no
  // probe credit, since the probe's share is of training time.
  void clock_pause() { last_call_s_ = -1; }

  double probe_seconds() const { return probe_seconds_; }
  int64_t probes() const { return probes_; }

  // Checkpoint support: the controllers' state (EMA, classes, thresholds, λ, α, lr scales).
  Json state_to_json() const;
  void state_from_json(const Json& json);

 private:
  void probe(int64_t step, std::vector<std::pair<std::string, Json>>& events);
  void apply_lr_scales();
  Json unit_names() const;

  const TrainOptions& options_;
  Model& model_;
  Optimizer& sgd_;
  TrainStep& step_;
  at::Tensor probe_images_, probe_labels_;
  PrecisionPolicyOptions policy_options_;
  CurvatureOptions curvature_options_;
  std::vector<int64_t> unit_of_param_;  // sgd.params() index → unit index
  PrecisionState state_;
  std::vector<std::vector<at::Tensor>> warm_start_;  // per unit: the last probe's eigenvectors (not checkpointed)
  std::vector<double> pending_lambda_;  // λ_max from a probe not yet fed to the policy
  std::vector<double> unit_lr_scale_;
  // Time-budgeted probing (curv_budget > 0): each round probes the next units, round-robin from the output end,
  // whose measured (or estimated) cost fits the credit; credit accrues at curv_budget × training time.
  double probe_credit_s_ = 0;
  std::vector<double> unit_cost_s_;    // per unit: wall seconds of its last probe; < 0 unknown
  std::vector<double> unit_lambda_;    // per unit: last λ_max
  std::vector<bool> unit_probed_;      // per unit: probed at least once
  int64_t next_unit_ = 0;              // round-robin position
  double alpha_ = -1;
  int64_t next_probe_step_ = -1;     // < 0: at the first control window
  double last_call_s_ = -1;
  double probe_seconds_ = 0;
  int64_t probes_ = 0;
};

}  // namespace triaccel
