#include "triaccel/api/api.h"

#include "triaccel/methods/backprop.h"
#include "triaccel/methods/baoc_plan.h"
#include "triaccel/methods/neuroflux.h"

namespace triaccel::api {

Json run(const Config& config, const RunHooks& hooks) {
  Session session(config_for_run(config), hooks);
  if (session.config().execution.method == Method::kNeuroFlux) return neuroflux_train(session);
  Trainer trainer(session);
  return trainer.run();
}

Json plan(const Config& config) {
  TRIACCEL_CHECK_INPUT(config.output.resume.empty(), "plan does not take ", option_ref("resume"),
                       " (it plans a fresh run)");
  Config planned = config;
  // `triaccel plan` is BAOC's planner unless another optimizer is named.
  if (!planned.was_given("optimizer")) planned.optim.optimizer = OptimizerKind::kBaoc;
  Session session(config_for_run(planned), RunHooks{}, /*output=*/false);
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
  if (c.optim.optimizer == OptimizerKind::kBaoc) {
    Json optim = baoc_plan_warmup(session);
    optim["optim_memory_budget"] = c.baoc.optim_memory_budget;
    out["optim_plan"] = optim;
  }
  return out;
}

ReportResult report(const ReportOptions& options) { return report_write(options); }

}  // namespace triaccel::api
