// The library's entry points: what the command line (tools/triaccel.cpp), the Python module and C++ users call.
// Each takes a Config (run/config.h: every option by its key, with its defaults) and returns JSON.
#pragma once

#include "triaccel/core/json.h"
#include "triaccel/report/report.h"
#include "triaccel/run/config.h"
#include "triaccel/run/session.h"

namespace triaccel::api {

// Trains with the configured method (backprop, Tri-Accel or NeuroFlux), resuming when `resume` is set; returns the
// summary event's fields (the stop event's when it stopped early: max_steps, or RunHooks::stop_requested, whose
// reason is "sigint" or "sigterm"). UserError for bad input.
Json run(const Config& config, const RunHooks& hooks = {});

// The plan a run of this configuration would follow, computed without writing any file: the model (parameters,
// units), the memory budget and, with optimizer baoc (the default here unless `optimizer` is given), the
// optimizer-state plan (BAOC needs gradient statistics, so that part warms up plan_warmup steps in memory first:
// they change the weights of a model passed through hooks.model). Of `hooks` it uses the data and model only.
Json plan(const Config& config, const RunHooks& hooks = {});

// One self-contained HTML page and a CSV table of the runs (report/report.h).
ReportResult report(const ReportOptions& options);

}  // namespace triaccel::api
