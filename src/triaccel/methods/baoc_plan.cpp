#include "triaccel/methods/baoc_plan.h"

#include "triaccel/control/optimizer_state/baoc_controller.h"
#include "triaccel/core/errors.h"
#include "triaccel/data/loader.h"
#include "triaccel/optim/baoc_optimizer.h"
#include "triaccel/run/component_options.h"
#include "triaccel/train/loss_scaler.h"
#include "triaccel/train/schedule.h"
#include "triaccel/train/step.h"

#include <cmath>

namespace triaccel {

Json baoc_plan_warmup(Session& session) {
  const Config& config = session.config();
  TORCH_CHECK(config.optim.optimizer == OptimizerKind::kBaoc, "baoc_plan_warmup needs optimizer baoc");
  const c10::Device& device = session.device();
  Loader loader(session.data().train, session.data().mean, session.data().std,
                session.loader_options(LoaderRole::kTrain), device);
  const int64_t warmup = config.baoc.plan_warmup;
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& item : session.model().named_parameters()) named.emplace_back(item.key(), item.value());
  auto optimizer = optimizer_create(OptimizerKind::kBaoc, named, config.optim.optimizer_options());
  LossScalerOptions lso;
  lso.enabled = config.execution.precision == PrecisionMode::kAmpFP16;
  LossScaler scaler(lso, device);
  StepOptions so = step_options(config);
  so.graph_batch_size = config.schedule.batch_size;
  so.objective = session.hooks().objective;
  TrainStep step(session.model(), *optimizer, scaler, so, device);
  BaocControllerOptions bo = baoc_controller_options(config);
  bo.replan_every = 0;  // the warm-up ends with its one plan
  // The budgets are checked first (the controller refuses one no plan can meet), then the warm-up's length.
  BaocController controller(bo, session.model(), static_cast<BaocOptimizer&>(*optimizer),
                            [&step]() { step.invalidate_graph(); }, 1);
  TRIACCEL_CHECK_INPUT(loader.steps_per_epoch() * config.schedule.epochs >= warmup, "the warm-up ended before ",
                       option_ref("plan_warmup"), " ", warmup, " steps: raise ", option_ref("epochs"), " or lower ",
                       option_ref("plan_warmup"));

  const ScheduleOptions schedule = schedule_options(config, loader.steps_per_epoch());
  schedule.validate();
  const int64_t batch = config.schedule.batch_size;
  at::Tensor images = loader.batch_images_empty(batch), labels = loader.batch_labels_empty(batch);
  for (int64_t s = 0; s < warmup; ++s) {
    const int64_t epoch = s / loader.steps_per_epoch();
    const int64_t offset = (s % loader.steps_per_epoch()) * batch;
    if (offset == 0) loader.epoch_begin(epoch);
    const int64_t count = std::min(batch, loader.size() - offset);
    at::Tensor x = count == batch ? images : images.narrow(0, 0, count);
    at::Tensor y = count == batch ? labels : labels.narrow(0, 0, count);
    loader.batch_into(offset, count, x, y);
    step.run(x, y, schedule_lr(schedule, static_cast<double>(s)));
    StepContext ctx;
    ctx.step = s + 1;
    ctx.batch = batch;
    for (const Event& e : controller.after_step(ctx)) {
      if (std::string(e.name) == event::kOptimPlan) return e.fields;
    }
  }
  TORCH_CHECK(false, "baoc_plan_warmup: no plan after ", warmup, " steps");
  return {};
}

}  // namespace triaccel
