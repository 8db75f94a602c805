// Optimizers for a program's own training loop, as every front end reaches them (Python's triaccel.optim, a C++
// user's loop): methods/loop_optimizer.h holds them; this is their public name.
#pragma once

#include "triaccel/methods/loop_optimizer.h"

namespace triaccel::api {

using LoopOptimizer = triaccel::LoopOptimizer;
using LoopOptimizerOptions = triaccel::LoopOptimizerOptions;
using LoopUnit = triaccel::LoopUnit;

}  // namespace triaccel::api
