#include "triaccel/run/session.h"

#include "triaccel/core/context_trace.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"
#include "triaccel/models/registry.h"

#include <ATen/Context.h>
#include <torch/cuda.h>
#include <torch/utils.h>
#include <torch/version.h>
#ifdef TRIACCEL_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <exception>
#include <filesystem>
#include <mutex>

namespace triaccel {

struct Session::DeviceScope {
#ifdef TRIACCEL_WITH_CUDA
  // All work on one non-default stream (graph capture needs one, and the legacy stream serializes everything).
  std::optional<c10::cuda::CUDAStreamGuard> stream;
#endif
};

namespace {

const Config& validated(const Config& config) {
  config.validate();
  return config;
}

// The rank's device: with several ranks on CUDA, the GPU of its local rank (also for a one-process session of a rank,
// local_rank > 0 with world_size 1: method auto's look at the plan, on the rank's GPU).
c10::Device rank_device(const Config& config, const DistOptions& dist) {
  const c10::Device device = device_resolve(config.execution.device);
  if ((dist.world_size <= 1 && dist.local_rank == 0) || !device.is_cuda()) return device;
  const int64_t gpus = torch::cuda::device_count();
  TRIACCEL_CHECK_INPUT(dist.local_rank < gpus, "rank ", dist.rank, " has LOCAL_RANK ", dist.local_rank, " but ", gpus,
                       " GPU", gpus == 1 ? " is" : "s are", " visible; start at most ", gpus, " processes on this "
                       "host (", option_ref("nproc"), ")");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(dist.local_rank));
}

// A torchrun restart (`restart` > 0: the agent restarted the group after a rank was lost) continues from the
// checkpoint in OUT, the last one the lost attempt wrote; nullopt when OUT holds none (the run starts afresh). Every
// rank reads it there, so with several hosts OUT must be on a filesystem they share (as `resume` on several ranks
// assumes). It must hold this run's configuration (every identity key equal, config_identity_keys): UserError naming
// the first key that differs and the fix.
std::optional<Checkpoint> checkpoint_for_restart(const Config& config, int restart, std::string* file) {
  const std::string path = checkpoint_path(config.output.out);
  if (!file_exists(path)) return std::nullopt;
  Checkpoint ckpt = checkpoint_read(path);
  Json here = config.to_json();
  Json there = Config::from_json(ckpt.config).to_json();
  for (const auto& key : config_identity_keys()) {
    TRIACCEL_CHECK_INPUT(here[key] == there[key], "torchrun restart ", restart, ": ", path, " is another run's "
                         "checkpoint (", option_ref(key), " ", there[key].dump(), " there, ", here[key].dump(),
                         " in this run), which this restart would resume from; give the run an ", option_ref("out"),
                         " of its own, or remove that checkpoint to start afresh");
  }
  *file = path;
  return ckpt;
}

// The step a checkpoint resumes at; -1 for a fresh start.
int64_t start_step(const std::optional<Checkpoint>& ckpt) {
  return ckpt ? ckpt->progress.value("step", int64_t{0}) : -1;
}

std::string start_said(int64_t step) { return step < 0 ? "afresh" : str_cat("from step ", step); }

// Every rank starts at the same point: the ranks compare, through the rendezvous store, the step each one's checkpoint
// resumes at and whether it could read one, so that a rank that read another checkpoint (`out` not shared between
// hosts), none, or a broken one stops every rank with a line, where the others would wait in the first collective.
// Rethrows `unreadable` (this rank's error reading the checkpoint). A no-op with one process.
void checkpoint_agree(Dist& dist, const std::optional<Checkpoint>& ckpt, const std::exception_ptr& unreadable,
                      const std::string& file) {
  if (!dist.active()) return;
  const int64_t step = start_step(ckpt);
  const std::vector<std::vector<double>> rows =
      dist.rows_gather({unreadable ? 1.0 : 0.0, static_cast<double>(step)});
  if (unreadable) std::rethrow_exception(unreadable);
  for (size_t r = 0; r < rows.size(); ++r) {
    TRIACCEL_CHECK_INPUT(rows[r].at(0) == 0, "rank ", r, " could not read the checkpoint to resume from (its own "
                         "line says why); every rank stopped");
    const auto other = static_cast<int64_t>(rows[r].at(1));
    TRIACCEL_CHECK_INPUT(other == step, "rank ", r, " starts ", start_said(other), " and rank ", dist.rank(), " ",
                         start_said(step), ": every rank must read the same checkpoint", file.empty() ? "" : " (",
                         file, file.empty() ? "" : ")", "; put ", option_ref("out"), " on a filesystem every host "
                         "shares");
  }
}

}  // namespace

std::mutex& model_build_mutex() {
  static std::mutex m;
  return m;
}

Config config_for_run(const Config& given) {
  if (given.output.resume.empty()) {
    Config c = given;
    c.resolve();
    return c;
  }
  const std::string path = checkpoint_path(given.output.resume);
  TRIACCEL_CHECK_INPUT(file_exists(path), option_ref("resume"), " ", given.output.resume, ": no checkpoint at ", path,
                       " (train with ", option_ref("out"), " first)");
  const Checkpoint ckpt = checkpoint_read(path);
  Json merged = Config::from_json(ckpt.config).to_json();
  const Json given_json = given.to_json();
  const auto& identity = config_identity_keys();
  for (const auto& key : given.given) {
    if (key == "resume") continue;
    if (std::find(identity.begin(), identity.end(), key) != identity.end()) {
      TRIACCEL_CHECK_INPUT(given_json[key] == merged[key], option_ref(key), " ", given_json[key].dump(),
                           " differs from the checkpoint's ", merged[key].dump(), " (", path,
                           "); drop it to resume, or start a new run");
      continue;
    }
    merged[key] = given_json[key];
  }
  Config out = Config::from_json(merged);
  out.given = given.given;
  out.output.resume = given.output.resume;
  if (!given.was_given("out")) {
    std::error_code ec;
    out.output.out = std::filesystem::is_directory(given.output.resume, ec)
                         ? given.output.resume
                         : std::filesystem::path(given.output.resume).parent_path().string();
  }
  // A resumed run continues to the end unless the user sets a new limit.
  if (!given.was_given("max_steps")) out.schedule.max_steps = 0;
  // It resumes in as many processes as asked now (one unless given): a checkpoint holds no per-rank state.
  if (!given.was_given("nproc")) out.execution.nproc = 1;
  return out;
}

Session::Session(const Config& config, const RunHooks& hooks, bool output)
    : config_(validated(config)),
      hooks_(hooks),
      dist_options_(dist_options_for(hooks, output)),
      clock_(hooks.clock ? *hooks.clock : steady_clock()),
      t_start_(clock_.now_s()),
      t_checkpoint_(t_start_),
      device_(rank_device(config_, dist_options_)),
      cudnn_benchmark_before_(at::globalContext().benchmarkCuDNN()),
      device_scope_(std::make_unique<DeviceScope>()),
      printer_(dist_options_.rank == 0 ? config_.output.progress : ProgressMode::kOff, hooks.spell_option) {
  context_trace("session start");
  const int world = dist_options_.world_size;
  config_.validate_world(world);
  // (A session without output — `plan` — previews nproc processes from this one.)
  TRIACCEL_CHECK_INPUT(!output || config_.execution.nproc == 1 || config_.execution.nproc == world, option_ref("nproc"), " ",
                       config_.execution.nproc, " but this process is one of ", world,
                       " (WORLD_SIZE); the command line starts the processes of ", option_ref("nproc"),
                       " itself: run it without a launcher, or leave ", option_ref("nproc"), " 1 under torchrun");
  const DistBackend backend = config_.execution.dist_backend;
  TRIACCEL_CHECK_INPUT(backend != DistBackend::kNccl || (device_.is_cuda() && Dist::nccl_built()),
                       option_ref("dist_backend"), " nccl needs CUDA devices and a CUDA build of triaccel (this run is "
                       "on ", device_long_name(device_), "); use gloo or auto");
  if (device_.is_cuda() && backend != DistBackend::kGloo && Dist::nccl_built()) {
    dist_options_.cuda_device = device_.index();
  }
  dist_ = std::make_unique<Dist>(dist_options_);  // blocks until every rank has joined
  context_trace("process group joined");
  if (output && !config_.output.profile_steps.empty()) {
    const std::string name = world == 1 ? "profile.json" : str_cat("profile_rank", dist_->rank(), ".json");
    profiler_ = std::make_unique<StepProfiler>(*profile_steps_parse(config_.output.profile_steps, "profile_steps"),
                                               out_file(name), device_);
  }
  output = output && dist_->rank() == 0;
  if (output) {
    directory_prepare_writable(config_.output.out, "out");
    // Temporary files of a process killed mid-write (the files they were to replace are intact).
    for (const char* name : {kCheckpointFile, "model.pt", "exit_model.pt", "exit.json"}) {
      file_remove_stale_temps(out_file(name));
    }
  }
  const int restart = dist_options_.restart;
  std::exception_ptr unreadable;  // this rank's error reading the checkpoint: raised once the ranks have compared
  bool restarted = false;  // resuming from OUT's checkpoint after a torchrun restart
  try {
    if (restart > 0) checkpoint_ = checkpoint_for_restart(config_, restart, &checkpoint_file_);
    restarted = checkpoint_.has_value();
    if (!checkpoint_) {
      checkpoint_ = checkpoint_for_resume(config_.output.resume, config_.model.model, &checkpoint_file_);
    }
  } catch (const UserError&) {
    if (!dist_->active()) throw;
    unreadable = std::current_exception();
  }
  checkpoint_agree(*dist_, checkpoint_, unreadable, checkpoint_file_);
  if (checkpoint_) elapsed_before_ = checkpoint_->progress.value("elapsed_s", 0.0);
  if (restarted) {
    printer_.line(str_cat("torchrun restart ", restart, ": resuming from ", checkpoint_file_, " at step ",
                          start_step(checkpoint_)));
  } else if (restart > 0 && !checkpoint_) {
    printer_.line(str_cat("torchrun restart ", restart, ": no checkpoint in ", config_.output.out,
                          ", starting afresh"));
  }

#ifdef TRIACCEL_WITH_CUDA
  if (device_.is_cuda()) {
    // The rank's GPU is made current first: taking a stream of another device than the current one (device 0 in a
    // fresh process) leaves every rank but rank 0 with a CUDA context on GPU 0 as well, hundreds of MiB of GPU 0's
    // memory each (TRIACCEL_TRACE_CONTEXTS lists them; measured: docs/results/data-parallel.md).
    c10::cuda::set_device(device_.index());
    if (config_.execution.vram_budget_bytes() > 0) expandable_.emplace(device_);
    device_scope_->stream.emplace(c10::cuda::getStreamFromPool(false, device_.index()));
    // cuDNN autotuning tries algorithms with workspaces of gigabytes; under a vram_budget those tries fill the budget
    // (the elastic batch then reads them as the step's need) and can run out of memory: heuristics instead.
    at::globalContext().setBenchmarkCuDNN(config_.execution.cudnn_autotune_enabled());
  }
#endif
  context_trace("stream guard");
  if (hooks_.data) {
    TRIACCEL_CHECK_INPUT(config_.data.dataset == "tensors", option_ref("dataset"), " is '", config_.data.dataset,
                         "' but the program passed images of its own; leave ", option_ref("dataset"), " unset");
    data_ = *hooks_.data;
  } else {
    data_ = dataset_load(config_.data.dataset, config_.data.data_dir, config_.data.block_size);
  }
  context_trace("data loaded");
  model_options_.name = config_.model.model;
  model_options_.num_classes = data_.train.num_classes;
  model_options_.in_channels = data_.train.images.dim() >= 2 ? data_.train.channels() : 1;
  model_options_.image_size = image_size();
  model_options_.gpt_layers = config_.model.gpt_layers;
  model_options_.gpt_heads = config_.model.gpt_heads;
  model_options_.gpt_embed = config_.model.gpt_embed;
  if (data_.train.kind == DatasetKind::kTokens) model_options_.block_size = data_.train.images.size(1);  // vocab = classes
  {
    const std::lock_guard<std::mutex> lock(model_build_mutex());
    torch::manual_seed(config_.execution.seed);
    model_ = hooks_.model ? hooks_.model(model_options_) : model_create(model_options_);
    TORCH_CHECK(model_ != nullptr, "the model hook returned no model");
  }
  model_->to(device_);
  context_trace("model on the device");
  layout_params(*model_);
  model_->train();
  module_state_broadcast(*dist_, {model_.get()});  // every rank starts from rank 0's weights
}

void module_state_broadcast(Dist& dist, const std::vector<const torch::nn::Module*>& modules) {
  if (!dist.active()) return;
  std::vector<at::Tensor> state;
  for (const torch::nn::Module* m : modules) {
    for (const auto& p : m->parameters()) state.push_back(p.data());
    for (const auto& b : m->buffers()) state.push_back(b);
  }
  const torch::NoGradGuard no_grad;
  dist.broadcast(state, 0);
}

void method_agree(Dist& dist, Method chosen) {
  if (!dist.active()) return;
  const double neuroflux = dist.all_reduce_sum({chosen == Method::kNeuroFlux ? 1.0 : 0.0})[0];
  const int world = dist.world_size();
  const auto n = static_cast<int>(neuroflux);
  TRIACCEL_CHECK_INPUT(n == 0 || n == world, option_ref("method"), " auto chose neuroflux on ", n, " of ", world,
                       " processes and backprop on the others (backprop's memory plan fits some GPUs and not others); "
                       "name the method: ", option_ref("method"), " neuroflux, or backprop with a larger ",
                       option_ref("vram_budget"));
}

DistOptions dist_options_for(const RunHooks& hooks, bool output) {
  if (hooks.dist) return *hooks.dist;
  return output ? dist_options_from_env() : DistOptions{};
}

std::function<int(int)> capture_agreement(Dist& dist) {
  return [&dist](int own) { return static_cast<int>(dist.all_reduce_max({static_cast<double>(own)})[0]); };
}

Session::~Session() {
  memory_cap_.reset();
  cublas_workspaces_release(device_);
  at::globalContext().setBenchmarkCuDNN(cudnn_benchmark_before_);
}

void Session::profile_step(int64_t step) {
  if (profiler_ && profiler_->at_step(step)) profile_written();
}

void Session::profile_end() {
  if (profiler_ && profiler_->finish()) profile_written();
}

void Session::profile_written() {
  const auto [first, end] = profiler_->traced();
  const std::string file = std::filesystem::path(profiler_->path()).filename().string();
  event(event::kProfile, end, Json{{"steps", Json::array({first, end})}, {"file", file},
                                   {"world_size", dist_->world_size()}});
  printer_.line(str_cat("timeline of steps ", first, " to ", end - 1, " written: ", profiler_->path(),
                        dist_->world_size() > 1 ? " (and one file per other process)" : ""));
}

double Session::now() const { return elapsed_before_ + (clock_.now_s() - t_start_); }

const char* stop_reason(StopRequest r) {
  switch (r) {
    case StopRequest::kInterrupt: return "sigint";
    case StopRequest::kTerminate: return "sigterm";
    case StopRequest::kNone: break;
  }
  return "";
}

std::string stop_line(const std::string& reason, int64_t step, const std::string& out, const std::string& where) {
  const std::string why = reason == "max_steps" ? "(" + option_ref("max_steps") + ")"
                                                : "by " + std::string(reason == "sigint" ? "SIGINT" : "SIGTERM");
  return str_cat("stopped ", where.empty() ? "" : where + " ", "at step ", step, " ", why,
                 ", checkpoint written; continue with ", option_ref("resume"), " ", out);
}

bool Session::checkpoint_due(int64_t step) const {
  const OutputConfig& o = config_.output;
  if (o.checkpoint_every > 0 && step % o.checkpoint_every == 0) return true;
  return o.checkpoint_minutes > 0 && clock_.now_s() - t_checkpoint_ >= o.checkpoint_minutes * 60.0;
}

void Session::checkpoint_written() { t_checkpoint_ = clock_.now_s(); }

std::pair<StopRequest, bool> Session::stop_agreed(int64_t step, const std::vector<double>& row,
                                                  std::vector<std::vector<double>>* rows) {
  const StopRequest own = stop_requested();
  const bool due = step >= 0 && checkpoint_due(step);
  Dist& dist = *dist_;
  if (!dist.active()) {
    if (rows) *rows = {row};
    return {own, due};
  }
  TRIACCEL_PROFILE_RANGE("triaccel::stop_agreement");
  // Gathered through the rendezvous store: a Gloo all-reduce of these few numbers costs each rank's host milliseconds
  // a step, enough to set the pace of short steps such as NeuroFlux's block steps (measured:
  // docs/results/data-parallel.md).
  std::vector<double> mine{own == StopRequest::kInterrupt ? 1.0 : 0.0, own == StopRequest::kTerminate ? 1.0 : 0.0,
                           dist.rank() == 0 && due ? 1.0 : 0.0};
  mine.insert(mine.end(), row.begin(), row.end());
  std::vector<std::vector<double>> gathered = dist.rows_gather(mine);
  bool interrupt = false, terminate = false, checkpoint = false;
  for (auto& r : gathered) {
    TORCH_CHECK(r.size() == mine.size(), "stop agreement: a rank sent ", r.size(), " numbers, this one ", mine.size());
    interrupt = interrupt || r[0] > 0;
    terminate = terminate || r[1] > 0;
    checkpoint = checkpoint || r[2] > 0;
    r.erase(r.begin(), r.begin() + 3);
  }
  if (rows) *rows = std::move(gathered);
  return {terminate ? StopRequest::kTerminate : interrupt ? StopRequest::kInterrupt : StopRequest::kNone, checkpoint};
}

int64_t Session::image_size() const {
  if (data_.train.kind != DatasetKind::kImage) return 0;
  return config_.data.image_size > 0 ? config_.data.image_size : data_.train.height();
}

LoaderOptions Session::loader_options(LoaderRole role) const {
  LoaderOptions lo;
  lo.batch_size = role == LoaderRole::kEval ? config_.execution.eval_batch_size : config_.schedule.batch_size;
  lo.shuffle = role == LoaderRole::kTrain;
  lo.augment = role == LoaderRole::kTrain && config_.augment_enabled();
  lo.cutout = role == LoaderRole::kTrain ? config_.data.cutout : 0;
  lo.image_size = config_.data.image_size;
  lo.channels_last = device_.is_cuda() && config_.execution.channels_last;
  lo.seed = config_.execution.seed;
  return lo;
}

void Session::layout_params(torch::nn::Module& module) const {
  if (!(device_.is_cuda() && config_.execution.channels_last)) return;
  const torch::NoGradGuard no_grad;
  for (auto& p : module.parameters()) {
    if (p.dim() == 4) p.set_data(p.contiguous(at::MemoryFormat::ChannelsLast));
  }
}

std::string Session::out_file(const std::string& name) const {
  return (std::filesystem::path(config_.output.out) / name).string();
}

void Session::events_open(const Json& extra) {
  if (!writer()) return;
  const std::string path = out_file("events.jsonl");
  const bool append = checkpoint_.has_value() && file_exists(path);
  events_ = std::make_unique<EventLog>(path, append);
  Json unit_names = Json::array();
  for (const auto& u : model_->units()) unit_names.push_back(u.name);
  Json resolved{{"options", config_.to_json()},
                {"device", device_long_name(device_)},
                {"params", model_->parameter_count()},
                {"units", unit_names},
                {"world_size", dist_->world_size()}};
  for (const auto& [k, v] : extra.items()) resolved[k] = v;
  resolved["torch_version"] = TORCH_VERSION;
  const int64_t step = checkpoint_ ? checkpoint_->progress.value("step", int64_t{0}) : 0;
  if (append) {
    Json fields{{"from", checkpoint_file_}};
    if (checkpoint_->progress.contains("blocks_done")) fields["blocks_done"] = checkpoint_->progress["blocks_done"];
    fields["config"] = resolved;
    event(event::kResume, step, fields);
  } else {
    event(event::kConfig, step, resolved);
  }
}

void Session::memory_cap(int64_t bytes) {
  memory_cap_.reset();
  memory_cap_.emplace(device_, bytes);
}

}  // namespace triaccel
