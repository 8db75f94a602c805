// A Session is what every training method sets up and tears down, in one place: the configuration (validated), the
// data-parallel group (its rank's GPU), the device and its stream, cuDNN's flags (restored when the session ends), the
// seed, the output folder, the checkpoint to resume from, the dataset, the model (on the device, channels_last where
// asked, in train mode), the event log, the run's clock, progress output and the memory cap of a vram_budget (lifted
// when the session ends). A method (methods/backprop_trainer.h, methods/neuroflux.h) builds its own loaders, optimizer
// and loop on top of it.
//
// Output folder layout (OUT = the `out` option):
//   OUT/events.jsonl   config (first line), epoch, checkpoint, ... summary (last line)
//   OUT/checkpoint.pt  the latest checkpoint (train/checkpoint.h)
//   OUT/model.pt       the final weights as a torchvision-named state_dict
#pragma once

#include "triaccel/control/batch/batch_policy.h"
#include "triaccel/core/clock.h"
#include "triaccel/core/device.h"
#include "triaccel/core/dist.h"
#include "triaccel/core/events.h"
#include "triaccel/core/profile.h"
#include "triaccel/data/dataset.h"
#include "triaccel/data/loader.h"
#include "triaccel/models/model.h"
#include "triaccel/run/component_options.h"
#include "triaccel/run/config.h"
#include "triaccel/run/progress.h"
#include "triaccel/train/checkpoint.h"
#include "triaccel/train/grad_buckets.h"
#include "triaccel/train/objective.h"

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace triaccel {

// Seeding and building a model (or NeuroFlux's heads) draw from the process's global generator: ranks in threads of
// one process (tests) hold this while they do, so each builds exactly the weights a process of its own would.
std::mutex& model_build_mutex();

// Data parallelism: every rank takes rank 0's parameters and buffers of `modules` (in place, one broadcast), as
// PyTorch's DDP starts its replicas: the Session's model, NeuroFlux's heads. A no-op with one process.
void module_state_broadcast(Dist& dist, const std::vector<const torch::nn::Module*>& modules);

// Method auto decides in each process, from its own GPU's plan (api::run): every rank must train with the same method.
// A no-op with one process, or when every rank chose `chosen`; else UserError on every rank naming the split and
// the fix (name the method).
void method_agree(Dist& dist, Method chosen);

// StepGraphOptions::agree_capture for a step graph holding NCCL's collectives: the worst capture outcome over the
// ranks (one host collective per capture).
std::function<int(int)> capture_agreement(Dist& dist);

// Why a front end asks a run to stop early (a signal, KeyboardInterrupt in Python). The run finishes the step in
// flight, writes a checkpoint and a stop event with the reason, and returns.
enum class StopRequest { kNone, kInterrupt, kTerminate };
// "sigint", "sigterm" (the stop event's reason); "" for kNone.
const char* stop_reason(StopRequest r);
// The line a run prints when it stops early for `reason` (max_steps, sigint, sigterm) at `step`: what happened and
// how to continue (option names marked with option_ref). `where`: e.g. "after block 2" (NeuroFlux), or empty.
std::string stop_line(const std::string& reason, int64_t step, const std::string& out, const std::string& where = "");

// What a caller can observe or inject while a run trains (tests, the Python module).
struct RunHooks {
  // Called after every optimizer step with the global step count (tests use it to stop or inspect).
  std::function<void(int64_t step)> after_step;
  // Called before every step (NeuroFlux's block steps too) with the batch about to run; may throw
  // c10::OutOfMemoryError (fault injection).
  std::function<void(int64_t step, int64_t batch)> before_step;
  // Called after every successful step with the samples it trained: [offset, offset + count) of the epoch's order.
  std::function<void(int64_t epoch, int64_t offset, int64_t count)> on_batch;
  // Replaces the measured memory signal of Tri-Accel's batch controller (tests: the CPU has no allocator stats).
  // Called at every control window with the step count and the batch in use.
  std::function<MemorySignal(int64_t step, int64_t batch)> memory_signal;
  // Polled after every step: anything but kNone stops the run there with a checkpoint (the CLI: SIGINT, SIGTERM).
  // Must be cheap and must not throw.
  std::function<StopRequest()> stop_requested;
  // The clock every time-dependent decision and measurement reads (nullptr: the steady clock).
  const Clock* clock = nullptr;
  // How progress lines spell the options they name (the CLI: its flags; empty: by key).
  OptionSpelling spell_option;
  // This process's place among data-parallel ranks (tests: ranks in threads); nullopt: from the environment
  // (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT as the launcher or torchrun set them).
  std::optional<DistOptions> dist;
  // The dataset "tensors" (images a program passes: dataset_from_tensors); required with it, refused without it.
  std::shared_ptr<const DatasetSplits> data;
  // Builds the model instead of the registry's builder for the configured `model` name (which must still be
  // registered: its entry says what the model supports). The Python module passes the user's own torch.nn.Module here.
  std::function<std::shared_ptr<Model>(const ModelOptions&)> model;
  // The loss and metric (the Python module's loss= and metric=); null: cross-entropy and accuracy. Backprop only.
  std::shared_ptr<const Objective> objective;
};

// The configuration a run uses: `given` with its dependent defaults resolved (Config::resolve), or, when it resumes
// (the `resume` option), the checkpoint's configuration with the options `given` set explicitly laid over it. An
// option that would change what is trained (config_identity_keys) and differs from the checkpoint is refused; `out`
// defaults to the resumed run's folder and `max_steps` to no limit. UserError naming the file or the option.
Config config_for_run(const Config& given);

// This process's place among the data-parallel ranks: the hooks' (tests), else the environment's (torchrun's
// variables); a session without output (a plan, method auto's look) joins none.
DistOptions dist_options_for(const RunHooks& hooks, bool output);

// Which loader a method asks for: the training order (shuffled, augmented), or a plain pass in order.
enum class LoaderRole { kTrain, kPlain, kEval };

class Session {
 public:
  // Validates the configuration, prepares OUT, reads the checkpoint to resume from (checked to hold this model),
  // sets up the device, seeds, loads the dataset and builds the model. UserError for bad input. A session without
  // `output` (a plan) touches no file: no OUT, no events, no checkpoint.
  // After a torchrun restart (DistOptions::restart > 0) the run resumes from OUT's checkpoint where there is one, the
  // last its lost attempt wrote (checked to hold this configuration, else UserError naming the option that differs),
  // and says so in a line; without one it starts as its command line says. Data parallel, the ranks compare the step
  // they start at (through the rendezvous store) and all stop with a line where they differ: every rank reads OUT, so
  // with several hosts OUT is on a filesystem they share.
  Session(const Config& config, const RunHooks& hooks, bool output = true);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const Config& config() const { return config_; }
  const RunHooks& hooks() const { return hooks_; }
  const c10::Device& device() const { return device_; }
  const Clock& clock() const { return clock_; }
  // The run's time: earlier sessions' time (from the checkpoint) plus this session's.
  double now() const;

  // The checkpoint being resumed (nullopt for a fresh run) and its file.
  const std::optional<Checkpoint>& checkpoint() const { return checkpoint_; }
  const std::string& checkpoint_file() const { return checkpoint_file_; }

  const DatasetSplits& data() const { return data_; }
  LoaderOptions loader_options(LoaderRole role) const;
  // The side of the model's input images after any resize (0 for tokens).
  int64_t image_size() const;

  Model& model() { return *model_; }
  const Model& model() const { return *model_; }
  ModelOptions model_options() const { return model_options_; }
  // channels_last conv weights on CUDA (where the configuration asks), as the model's own are.
  void layout_params(torch::nn::Module& module) const;

  // Opens OUT/events.jsonl (appending when resuming) and writes the config event (or resume, with `from`); the
  // common fields (options, device, params, units, torch version) plus `extra`.
  void events_open(const Json& extra);
  EventLog& events() { return *events_; }
  // Writes an event at `step` on the run's clock (nothing in a session without output).
  void event(const char* name, int64_t step, const Json& fields) {
    if (events_) events_->write(name, step, now(), fields);
  }
  ProgressPrinter& printer() { return printer_; }
  std::string out_file(const std::string& name) const;

  // What the front end asks for after a step (kNone without a stop_requested hook).
  StopRequest stop_requested() const { return hooks_.stop_requested ? hooks_.stop_requested() : StopRequest::kNone; }
  // Whether a periodic checkpoint is due after `step`: every checkpoint_every steps, or checkpoint_minutes after the
  // last one (or the session's start) on the run's clock. checkpoint_written() restarts the time.
  bool checkpoint_due(int64_t step) const;
  void checkpoint_written();
  // The stop request and whether a checkpoint is due after `step` (< 0: not asked), agreed by every rank (a host
  // collective when data parallel: the strongest request any rank has, rank 0's clock for the checkpoint), so the
  // ranks stop and checkpoint at the same step. `row`: the caller's numbers, carried by the same round trip, so a
  // step that needs another agreement makes one, not two; `rows` receives every rank's row in rank order (one
  // process: its own).
  std::pair<StopRequest, bool> stop_agreed(int64_t step = -1, const std::vector<double>& row = {},
                                           std::vector<std::vector<double>>* rows = nullptr);

  // Caps the caching allocator at `bytes` until the session ends (a vram_budget on CUDA).
  void memory_cap(int64_t bytes);

  // The data-parallel group (core/dist.h; one process: inactive, every collective a no-op). Only rank 0 writes
  // files, events and progress (writer()); every rank trains, in lockstep.
  Dist& dist() { return *dist_; }

  // The profile_steps option (core/profile.h): profile_step(s) before each training step (a retried one too),
  // profile_end() before the run's last event; each rank traces its own steps into its own file, rank 0 writes a
  // `profile` event when they are written.
  void profile_step(int64_t step);
  void profile_end();
  bool writer() const { return dist_->rank() == 0; }

 private:
  Config config_;
  RunHooks hooks_;
  DistOptions dist_options_;
  const Clock& clock_;
  double t_start_ = 0;
  double elapsed_before_ = 0;
  double t_checkpoint_ = 0;  // session clock at the last checkpoint (or the start)
  c10::Device device_;
  std::unique_ptr<Dist> dist_;
  bool cudnn_benchmark_before_ = false;
  struct DeviceScope;  // the stream guard
  std::unique_ptr<DeviceScope> device_scope_;
  std::optional<ExpandableSegmentsScope> expandable_;  // under a vram_budget on CUDA: from before the first allocation
  std::optional<Checkpoint> checkpoint_;
  std::string checkpoint_file_;
  DatasetSplits data_;
  ModelOptions model_options_;
  std::shared_ptr<Model> model_;
  std::unique_ptr<EventLog> events_;
  ProgressPrinter printer_;
  std::optional<MemoryCapScope> memory_cap_;
  std::unique_ptr<StepProfiler> profiler_;  // with profile_steps, in a session with output

  void profile_written();
};

}  // namespace triaccel
