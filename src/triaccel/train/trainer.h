// The trainer: owns the run. Loads data and model, resumes from a checkpoint if asked, runs the epochs through
// TrainStep, evaluates, writes events.jsonl, checkpoints and the exported model.pt, and returns the summary.
// Output folder layout (OUT = --out):
//   OUT/events.jsonl   config (first line), epoch, checkpoint, ... summary (last line)
//   OUT/checkpoint.pt  the latest checkpoint (train/checkpoint.h)
//   OUT/model.pt       the final weights as a torchvision-named state_dict
#pragma once

#include "triaccel/core/json.h"
#include "triaccel/memory/batch_controller.h"
#include "triaccel/train/options.h"

#include <functional>

namespace triaccel {

struct TrainHooks {
  // Called after every optimizer step with the global step count (tests use it to stop or inspect).
  std::function<void(int64_t step)> after_step;
  // Called before every step with the batch about to run; may throw c10::OutOfMemoryError (fault injection).
  std::function<void(int64_t step, int64_t batch)> before_step;
  // Called after every successful step with the samples it trained: [offset, offset + count) of the epoch's order.
  std::function<void(int64_t epoch, int64_t offset, int64_t count)> on_batch;
  // Replaces the measured memory signal of Tri-Accel's batch controller (tests: the CPU has no allocator stats).
  // Called at every control window with the step count and the batch in use.
  std::function<MemorySignal(int64_t step, int64_t batch)> memory_signal;
};

// Runs training; returns the summary event's fields. Throws UserError for bad input.
Json train_run(const TrainOptions& options, const TrainHooks& hooks = {});

// Applies --resume: reads the checkpoint's configuration and overlays the options the user set explicitly.
// `explicit_keys` are TrainOptions JSON keys given on the command line; a key that would change the run's
// identity (model, dataset, batch size, precision, ...) and differs from the checkpoint is refused.
TrainOptions resume_options(const TrainOptions& given, const std::vector<std::string>& explicit_keys);

}  // namespace triaccel
