// Optimizers for a program's own training loop (Python's triaccel.optim, a C++ user's loop): triaccel's AdamW with
// every tensor's state in one format (fp32, bf16, 8-bit, factored, ...), or BAOC choosing a format per unit under an
// optimizer-state memory budget from the gradient statistics of a warm-up (docs/baoc.md), on the same optimizer and
// controller as the engine: the fused CUDA kernels on a GPU, their reference on the CPU.
//
// Weight decay is decoupled and, as everywhere in triaccel, not applied to tensors of dimension <= 1 (norms, biases).
// A parameter with no gradient at a step counts as a zero gradient (its moments decay), unlike torch.optim, which
// skips it. step(lr) reads the learning rate from the host; the step over given tensors reads it from a tensor and
// is what the torch op `triaccel::loop_optimizer_step` runs (python/src/module.cpp), so that torch.compile traces it
// and a CUDA graph can capture it.
#pragma once

#include "triaccel/control/optimizer_state/baoc_controller.h"
#include "triaccel/core/json.h"
#include "triaccel/models/model.h"
#include "triaccel/optim/baoc_optimizer.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace triaccel {

struct LoopOptimizerOptions {
  std::string format = "baoc";  // "baoc", or one state format for every tensor: adamw-fp32, adamw-8bit, ...
  BaocOptions adam;             // betas, eps, weight decay
  BaocControllerOptions baoc;   // memory and time budgets, menu, plan_warmup, replan_every (format "baoc" only)
};

// A unit: its name and its parameters by name (names are the program's, e.g. "layer1.0.conv1.weight").
using LoopUnit = std::pair<std::string, std::vector<std::pair<std::string, at::Tensor>>>;

class LoopOptimizer {
 public:
  // UserError for no parameters, a parameter twice, parameters that are not float32 or not on one device, or a
  // budget no plan meets.
  LoopOptimizer(const std::vector<LoopUnit>& units, LoopOptimizerOptions options);
  ~LoopOptimizer();

  // One update from every parameter's .grad() at learning rate `lr`; BAOC plans after it when it is due.
  void step(double lr);
  // The same update from the tensors the torch op is handed: `params` in the constructor's order, the parameters
  // themselves or copies of them (torch.compile's functionalization may pass copies: their values are taken in and
  // the update is written back to them), `grads` their gradients (undefined: zero), `lr` a one-element tensor (on the
  // parameters' device, so that a captured step reads it when it is replayed). Inside a CUDA-graph capture it is
  // refused while BAOC has a plan to make (a host decision a graph cannot hold). UserError for tensors that do not
  // match the parameters.
  void step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads, const at::Tensor& lr);
  // Host calls of step (a replayed CUDA graph adds none; the bias correction counts on the device).
  int64_t steps() const { return steps_; }

  // What the torch op names this optimizer by: find(handle()) is this optimizer while it lives, nullptr after.
  int64_t handle() const { return handle_; }
  static LoopOptimizer* find(int64_t handle);

  int64_t state_bytes() const { return optimizer_->state_bytes(); }
  int64_t adamw_fp32_bytes() const;        // 8 bytes per parameter element
  std::vector<std::string> formats() const;  // per parameter, in the given order
  const std::vector<std::string>& names() const { return optimizer_->names(); }
  const Json& last_plan() const { return last_plan_; }  // BAOC's latest optim_plan event; null before the first

  // The whole state: the optimizer's tensors (names are the parameters' plus a suffix) and a JSON record of the step
  // count and BAOC's controller. load() takes what state() gave (of an optimizer over the same parameters) and
  // continues exactly; UserError naming what does not match.
  NamedTensors state_tensors();
  Json state_record() const;
  void load(const NamedTensors& tensors, const Json& record);

 private:
  void controller_make(int64_t next_step);
  void update();                      // the optimizer's step from the parameters' .grad and lr_, then BAOC's plan
  bool host_decision_ahead() const;  // BAOC will still plan at some step

  LoopOptimizerOptions options_;
  std::shared_ptr<Model> units_model_;  // the units as a Model (what BAOC plans over); holds no forward
  std::unique_ptr<BaocOptimizer> optimizer_;
  std::unique_ptr<BaocController> controller_;
  at::Tensor lr_, found_inf_;
  int64_t steps_ = 0;
  int64_t handle_ = 0;
  Json last_plan_;
};

}  // namespace triaccel
