#include "triaccel/api/api.h"

#include "triaccel/core/context_trace.h"
#include "triaccel/methods/backprop_trainer.h"
#include "triaccel/methods/baoc_plan.h"
#include "triaccel/methods/neuroflux.h"
#include "triaccel/models/registry.h"
#include "triaccel/run/memory_setup.h"

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

// Method auto: backprop when the program gave its own loss (the only method that takes one) or the memory planner fits
// the budget (or there is none, or no GPU), else NeuroFlux for a model it trains; a model it does not train gets the
// planner's floor. Returns the configuration with the method chosen and, in `said`, the line that says why. With
// several processes each rank looks at its own GPU's plan for its share of the batch (on that GPU); api::run has the
// ranks agree.
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
  const bool fits = !probe.device().is_cuda() || plan.is_null() || plan["feasible"].get<bool>();
  if (!fits) {
    TRIACCEL_CHECK_INPUT(model_entry(c.model.model).local_learning, option_ref("vram_budget"), " ",
                         c.execution.vram_budget, " is below backprop's floor of ", plan["floor_bytes"].get<int64_t>(),
                         " bytes for ", c.model.model, ", and neuroflux trains CNNs only; raise the budget");
    c.execution.method = Method::kNeuroFlux;
  }
  *said = fits ? "method auto: backprop (the memory plan fits)"
               : c10::str("method auto: neuroflux (backprop's floor is ", plan["floor_bytes"].get<int64_t>(),
                          " bytes, above ", option_ref("vram_budget"), " ", c.execution.vram_budget, ")");
  return c;
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
  if (session.config().execution.method == Method::kNeuroFlux) return neuroflux_train(session);
  BackpropTrainer trainer(session);
  return trainer.run();
}

Json plan(const Config& config, const RunHooks& hooks) {
  TRIACCEL_CHECK_INPUT(config.output.resume.empty(), "plan does not take ", option_ref("resume"),
                       " (it plans a fresh run)");
  Config planned = config;
  // `triaccel plan` is BAOC's format plan unless another optimizer is named, or a vram_budget asks for the memory plan
  // of the run as configured.
  const bool memory = !config.execution.vram_budget.empty();
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
  if (memory && c.execution.method != Method::kNeuroFlux) out["memory_plan"] = memory_plan_preview(session);
  if (c.optim.optimizer == OptimizerKind::kBaoc) {
    Json optim = baoc_plan_warmup(session);
    optim["optim_memory_budget"] = c.baoc.optim_memory_budget;
    out["optim_plan"] = optim;
  }
  return out;
}

ReportResult report(const ReportOptions& options) { return report_write(options); }

}  // namespace triaccel::api
