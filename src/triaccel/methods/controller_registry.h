// The controllers a backprop run builds (docs/architecture.md, "a controller"): one entry per controller, in the order
// they act after a step. Each entry's factory reads the run's configuration and returns its controller, or none when
// the run does not ask for it. A new controller is its own files in control/ and one line in controller_registry.cpp
// (tests/test_trainer.cpp adds one from a test, ControllerRegistration).
#pragma once

#include "triaccel/control/batch/batch_policy.h"
#include "triaccel/control/controller.h"
#include "triaccel/control/memory/memory_planner.h"
#include "triaccel/data/loader.h"
#include "triaccel/optim/optimizer.h"
#include "triaccel/run/config.h"
#include "triaccel/run/memory_setup.h"
#include "triaccel/run/session.h"
#include "triaccel/train/precision.h"
#include "triaccel/train/step.h"

#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace triaccel {

class BaocController;
class MemoryPlanController;
class PrecisionController;

// What a factory may read and build on: the run's parts, and what earlier entries built for later ones to link to.
struct ControllerParts {
  const Config& config;
  Session& session;
  Optimizer& optimizer;
  TrainStep& step;
  Loader& train_loader;
  c10::Device device;
  int64_t next_step = 1;                  // the first step this session trains (a resumed run's next one)
  int64_t total_steps = 0;                // the schedule's steps of the whole run
  const BatchPolicyOptions* batch_rules = nullptr;
  MemorySetup* memory = nullptr;          // the planned memory, or null when it is not planned
  // The memory planner's cost model again for per-unit precisions (a precision decision re-prices the plan).
  std::function<MemoryModel(const std::vector<Precision>&)> memory_model_rebuild;
  // Set by the entries that build them, for later entries and the trainer.
  PrecisionController* precision = nullptr;
  BaocController* baoc = nullptr;
  MemoryPlanController* memory_planner = nullptr;
};

using ControllerFactory = std::function<std::unique_ptr<StepController>(ControllerParts&)>;

struct ControllerEntry {
  std::string name;
  ControllerFactory make;
};

// The entries in order (the built-in ones, then any added).
const std::vector<ControllerEntry>& controller_registry();

// The controllers the registry's entries build for a run, in order.
std::vector<std::unique_ptr<StepController>> controllers_make(ControllerParts& parts);

// Adds an entry after the others for its lifetime (a test's controller; an extension built into the binary).
class ControllerRegistration {
 public:
  explicit ControllerRegistration(ControllerEntry entry);
  ~ControllerRegistration();
  ControllerRegistration(const ControllerRegistration&) = delete;
  ControllerRegistration& operator=(const ControllerRegistration&) = delete;

 private:
  std::string name_;
};

}  // namespace triaccel
