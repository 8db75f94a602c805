#include "triaccel/api/api.h"

#include "triaccel/core/context_trace.h"
#include "triaccel/core/device.h"
#include "triaccel/methods/backprop_trainer.h"
#include "triaccel/methods/baoc_plan.h"
#include "triaccel/methods/neuroflux.h"
#include "triaccel/models/registry.h"
#include "triaccel/run/memory_setup.h"
#include "triaccel/train/checkpoint.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>

namespace triaccel::api {

namespace {

// What a session that only looks (a plan, method auto's probe) takes of the caller's hooks: the program's own data
// and model, nothing that reacts to steps.
RunHooks inputs_of(const RunHooks& hooks) {
  RunHooks out;
  out.data = hooks.data;
  out.model = hooks.model;
  return out;
}

// Method auto's candidates on a session that only looks: backprop at its memory plan (`preview`:
// memory_plan_preview's), NeuroFlux at the blocks it would train, each with whether it fits the vram_budget and its
// predicted seconds per epoch (run/memory_setup.h).
std::vector<MethodCandidate> auto_candidates(Session& probe, const Json& preview) {
  return {method_candidate_backprop(preview), method_candidate_neuroflux(probe)};
}

// Method auto: backprop when the program gave its own loss (the only method that takes one), or when there is no
// budget to train within (none, or no GPU); else the candidate predicted fastest among those that fit
// (method_choose); when none fits, the one that needs the least budget: NeuroFlux's run names its minimum, backprop's
// floor is named here (with why NeuroFlux is no way out). Returns the configuration with the method chosen and, in
// `said`, the line that says why. With several processes each rank looks at its own GPU's plan for its share of the
// batch (on that GPU); api::run has the ranks agree.
Config method_resolve(Config c, const RunHooks& hooks, std::string* said) {
  c.execution.method = Method::kBackprop;
  if (hooks.objective) {  // the only method that takes a program's loss
    *said = "method auto: backprop (the program gave its own loss)";
    return c;
  }
  RunHooks look = inputs_of(hooks);
  DistOptions one;  // one process, on this rank's GPU
  one.local_rank = dist_options_for(hooks, /*output=*/true).local_rank;
  look.dist = one;
  Session probe(c, look, /*output=*/false);
  const Json plan = memory_plan_preview(probe);
  if (!probe.device().is_cuda() || plan.is_null() || plan["budget_bytes"].is_null()) {
    *said = "method auto: backprop (the memory plan fits)";
    return c;
  }
  const std::vector<MethodCandidate> candidates = auto_candidates(probe, plan);
  const MethodChoice choice = method_choose(candidates);
  const MethodCandidate& nf = candidates.back();
  const std::string levers = memory_levers_given(c);
  TRIACCEL_CHECK_INPUT(choice.fits || choice.method == Method::kNeuroFlux, option_ref("vram_budget"), " ",
                       c.execution.vram_budget, " is below backprop's floor of ",
                       static_cast<int64_t>(std::ceil(candidates.front().need_bytes)), " bytes for ", c.model.model,
                       levers.empty() ? "" : " " + levers, ", and neuroflux ",
                       nf.not_why.empty() ? c10::str("needs at least ", nf.need_bytes / 1e9, " GB") : nf.not_why,
                       "; raise the budget");
  c.execution.method = choice.method;
  *said = c10::str("method auto: ", enum_name(choice.method), " (", choice.reason, ")");
  return c;
}

// An out-of-memory error that no step's recovery took (a controller's re-plan, an optimizer's state conversion,
// evaluation's set-up): one line naming what was asked for, the budget and the way on, instead of an internal error.
std::string out_of_memory_message(const Session& session, const c10::OutOfMemoryError& e) {
  const std::string what = e.what();
  const size_t at = what.find("Tried to allocate");
  const std::string asked = at == std::string::npos ? error_one_line(e) : what.substr(at, what.find(". ", at) - at);
  const Config& c = session.config();
  std::string out = c.execution.vram_budget.empty()
                        ? str_cat("ran out of GPU memory outside a training step (", asked, "); set ",
                                  option_ref("vram_budget"), " to what this GPU can give the run and the memory "
                                  "planner fits the batch inside it")
                        : str_cat("ran out of GPU memory outside the training steps the memory plan covers, under ",
                                  option_ref("vram_budget"), " ", c.execution.vram_budget, " (", asked, "); raise ",
                                  option_ref("vram_budget"), ", or leave the data's placement and the optimizer to the "
                                  "planner (", option_ref("data_placement"), " auto, ", option_ref("optimizer"),
                                  " sgd)");
  if (std::filesystem::exists(session.out_file(kCheckpointFile))) {
    out += str_cat("; continue from the last checkpoint with ", option_ref("resume"), " ", c.output.out);
  }
  return out;
}

}  // namespace

Json run(const Config& config, const RunHooks& hooks) {
  context_trace("run start");
  Config resolved = config_for_run(config);
  std::string chosen;  // method auto's line, said once every rank has chosen alike
  if (resolved.execution.method == Method::kAuto) resolved = method_resolve(resolved, hooks, &chosen);
  context_trace("method chosen");
  Session session(resolved, hooks);
  context_trace("session built");
  if (!chosen.empty()) {
    method_agree(session.dist(), resolved.execution.method);
    session.printer().line(chosen);
  }
  TRIACCEL_CHECK_INPUT(!hooks.objective || session.config().execution.method == Method::kBackprop,
                       "a loss of the program's own trains with ", option_ref("method"), " backprop (",
                       enum_name(session.config().execution.method), " computes cross-entropy in its own steps); "
                       "leave ", option_ref("method"), " unset or drop the loss");
  try {
    if (session.config().execution.method == Method::kNeuroFlux) return neuroflux_train(session);
    BackpropTrainer trainer(session);
    return trainer.run();
  } catch (const c10::OutOfMemoryError& e) {
    // TRIACCEL_MEMORY_HISTORY (methods/backprop_trainer.h): the allocator's events up to the refused allocation, with
    // its stack, as <it>.fatal (bench/memory_peak.py --ooms).
    if (const char* path = std::getenv("TRIACCEL_MEMORY_HISTORY"); path && *path) {
      memory_history_write(session.device(), str_cat(path, ".fatal"));
    }
    throw UserError(out_of_memory_message(session, e));
  }
}

Json plan(const Config& config, const RunHooks& hooks) {
  TRIACCEL_CHECK_INPUT(config.output.resume.empty(), "plan does not take ", option_ref("resume"),
                       " (it plans a fresh run)");
  Config planned = config;
  // `triaccel plan` is BAOC's format plan unless another optimizer is named, or a vram_budget or a memory lever
  // given by hand asks for the memory plan of the run as configured.
  const bool memory = !config.execution.vram_budget.empty() || !memory_levers_given(config).empty();
  if (!planned.was_given("optimizer") && !memory) planned.optim.optimizer = OptimizerKind::kBaoc;
  Session session(config_for_run(planned), inputs_of(hooks), /*output=*/false);
  const Config& c = session.config();
  Json units = Json::array();
  for (const auto& u : session.model().units()) units.push_back(Json{{"unit", u.name}, {"params", u.parameter_count()}});
  Json out{{"model", c.model.model},
           {"dataset", c.data.dataset},
           {"method", enum_name(c.execution.method)},
           {"optimizer", enum_name(c.optim.optimizer)},
           {"batch_size", c.schedule.batch_size},
           {"params", session.model().parameter_count()},
           {"units", units},
           {"budget_bytes", c.execution.vram_budget_bytes() > 0 ? Json(c.execution.vram_budget_bytes()) : Json(nullptr)},
           {"device", device_long_name(session.device())}};
  if (memory) {
    const Json preview = memory_plan_preview(session);
    if (c.execution.method != Method::kNeuroFlux) out["memory_plan"] = preview;
    // Planned for a GPU wherever it runs: what method auto would choose there, and why.
    const std::vector<MethodCandidate> candidates = auto_candidates(session, preview);
    out["method_candidates"] = method_candidates_json(candidates);
    if (c.execution.method == Method::kAuto) {
      const MethodChoice choice = method_choose(candidates);
      out["method"] = enum_name(choice.method);
      out["method_reason"] = choice.reason;
    }
  }
  if (c.optim.optimizer == OptimizerKind::kBaoc) {
    Json optim = baoc_plan_warmup(session);
    optim["optim_memory_budget"] = c.baoc.optim_memory_budget;
    out["optim_plan"] = optim;
  }
  return out;
}

ReportResult report(const ReportOptions& options) { return report_write(options); }

}  // namespace triaccel::api
