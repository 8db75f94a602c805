// BAOC's plan without a run (`triaccel plan`, api::plan): the plan needs gradient-stream statistics, so this warms
// up in memory exactly as a run does — plan_warmup steps of fp32 AdamW on the run's data order through the step
// engine — and returns the optim_plan event's fields; nothing is written to disk.
#pragma once

#include "triaccel/core/json.h"
#include "triaccel/run/session.h"

namespace triaccel {

// The session's configuration must have optimizer baoc. UserError when the run is shorter than the warm-up.
Json baoc_plan_warmup(Session& session);

}  // namespace triaccel
