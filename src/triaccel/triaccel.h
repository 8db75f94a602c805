// The one header a C++ user of the installed package includes (docs/cpp-package.md): #include <triaccel/triaccel.h>
// with target_link_libraries(... triaccel::triaccel). It gives
// - api::run, api::plan, api::report (api/api.h) on a Config (run/config.h: every option by its key, Config::set);
// - Model and its units (models/model.h), to define a model of one's own, and the registry (models/registry.h):
//   model_register({name, description, input, double backward, local learning, create}) makes it a `model` choice;
//   batch_norm_forward (models/batch_norm.h) runs a unit's BatchNorm2d (+ ReLU) through the fused CUDA kernel;
//   linear_forward / linear_override_forward (models/linear.h) run a linear layer as the run's precision does (FP8
//   under amp-fp8).
// Everything else under triaccel/ is installed too, but is the runtime's inside and may change without notice.
#pragma once

#include "triaccel/api/api.h"
#include "triaccel/api/loop_optimizer.h"
#include "triaccel/api/stop_signals.h"
#include "triaccel/core/errors.h"
#include "triaccel/models/batch_norm.h"
#include "triaccel/models/linear.h"
#include "triaccel/models/model.h"
#include "triaccel/models/registry.h"
#include "triaccel/run/config.h"
