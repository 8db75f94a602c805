// A training step body run through a CUDA graph: eager for a few warm-up steps at the graph's batch size (cuDNN
// picks its algorithms, allocations settle), then captured once with the caller's input tensors as the graph's
// static inputs, and replayed; steps of any other batch size run eagerly. The trainer's whole step (train/step.h)
// and NeuroFlux's block steps (methods/neuroflux.cpp) both run through it.
//
// Recovery: a capture that fails (out of memory: the graph's private pool did not fit, e.g. under a --vram-budget;
// or an operation a capture refuses) captures nothing, so that step runs eagerly, and the batch size is refused:
// it runs eagerly from then on. With `relaxed_retry`, a capture refused by an error is first retried once, after a
// full warm-up, in relaxed capture mode (core/cuda_graph.h). Off CUDA, or with `enabled` false, every step is eager.
//
// Invariants: one graph at a time (a new batch size frees the old graph and its pool first, so a budget never
// holds two pools); what the body reads besides its two inputs must keep its address while the graph lives. With
// `eager_in_pool`, an eager step of another batch size while a graph is captured allocates from the graph's pool
// (core/cuda_graph.h: cuda_graph_pool_run): so the body may create no lasting state that its captured work does not
// create too — anything that changes the step's work drops the graph first (invalidate).
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace triaccel {

struct StepGraphOptions {
  bool enabled = true;            // false: every step eager (the CPU, or --cuda-graphs false)
  int64_t batch = 0;              // the batch size to capture (0: none); set_batch changes it later
  int64_t warmup_steps = 3;       // eager steps at the graph's batch size before the capture
  bool relaxed_retry = false;     // retry a capture refused by an error once in relaxed mode (NeuroFlux's blocks)
  // The last warm-up step before a capture allocates from the pool the capture then uses (core/cuda_graph.h:
  // CudaGraphPool), so the capture reuses that step's freed blocks instead of needing a pool beside the eager steps'
  // cached ones. Not the body's first run. Only for a body whose warm-up leaves in the pool nothing but what its
  // captured run makes too (TrainStep: its gradients, released before the capture).
  bool warmup_in_pool = false;
  std::function<void()> during_capture;  // tests: called inside the capture before the body (e.g. to fail it)
  std::function<void()> during_pool_warmup;  // tests: called inside the last warm-up's pool run (e.g. to fail it)
  // Before a replay and before a capture: e.g. release gradients an eager step left (the graph's live in its pool).
  std::function<void()> before_replay;
  // Eager steps of another batch size while a graph is captured take their memory from the graph's private pool
  // (the epoch's short last batch under a budget did not fit beside it). Only for a body whose eager run leaves
  // nothing in the pool that outlives the next replay but what before_replay releases (TrainStep: its gradients).
  bool eager_in_pool = false;
  // Several ranks whose captured step holds collectives (NCCL's): a collective captured on one rank must be captured
  // on every rank and its graph replayed on every rank (NCCL's documented rule for graph-captured operations). Called
  // on every rank after each capture with its outcome (0: captured, 1: out of memory, 2: refused by an error);
  // returns the worst outcome over the ranks, which every rank then takes as its own.
  std::function<int(int)> agree_capture;
};

class StepGraph {
 public:
  using Body = std::function<void(const at::Tensor& x, const at::Tensor& y)>;

  explicit StepGraph(StepGraphOptions options);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // One step of `body` on (x, y): a replay when captured and x has the graph's batch size (x and y are copied into
  // the static inputs unless they are them), else warm-up, capture or an eager step.
  void run(const Body& body, const at::Tensor& x, const at::Tensor& y);

  // Runs `fn` with its allocations on the current stream taken from the captured graph's private pool (or, between
  // invalidate and the next capture, the dropped graph's; just `fn` when there is none, off CUDA, or without
  // eager_in_pool): an evaluation between two epochs, or the memory model's trace after a precision move, reuses the
  // memory the replays use as scratch. `fn` must leave nothing allocated that outlives it.
  void in_pool(const std::function<void()>& fn);

  // A second graph in the captured step graph's private pool (Tri-Accel's curvature pass under a --vram-budget, whose
  // plan leaves no room for a pool of the pass's own): its scratch is memory the step's replays use as scratch, so
  // the two need about the larger scratch, not both. Contract, as in_pool's: `fn` keeps nothing it allocates (its
  // lasting state lives outside the pool and is written in place), and a replay of either graph overwrites the
  // other's scratch. The side graph goes with the step's graph (a new batch size, invalidate, drop, refuse) and a new
  // side capture replaces it. Returns a handle > 0 for side_replay; 0 when no step graph is captured or the capture
  // failed (nothing captured).
  int64_t side_capture(const std::function<void()>& fn);
  // Replays the side graph `handle`; false (nothing run) when it is gone.
  bool side_replay(int64_t handle);

  // The batch size whose steps are captured (0: none). A new size drops the graph; it is captured after one eager
  // step at that size.
  void set_batch(int64_t batch);
  int64_t batch() const { return batch_; }
  // Whether run() at this batch size would run the body eagerly: no graph to replay, and no capture due.
  bool runs_eagerly(int64_t batch) const;
  // Drops a captured graph (the step's work changed: precisions, lr scales); it is captured again after one eager
  // step (with warmup_in_pool, that step and the capture take their memory from the dropped graph's pool). During the
  // warm-up it changes nothing.
  void invalidate();
  // Frees the graph, its pool and inputs; steps at the batch size warm up and capture again from the start.
  void drop();
  // The batch size runs eagerly from now on (an eager step at it ran out of memory: its graph will not fit either).
  void refuse();
  // Replays the captured graph on its static inputs as they are, whatever they hold (data parallel: a rank whose step
  // failed before its input makes the step's captured collectives with the other ranks' replays); false, running
  // nothing, when none is captured.
  bool replay_as_is();
  // Lifts a refusal (the step's memory changed: a new memory plan); the batch size warms up and captures again.
  void allow();
  // Every step eager from now on, at any batch size (the memory planner gave up on the graph: its pool does not fit
  // beside the smallest plan). Frees a captured graph.
  void disable();

  // How the last run() ran the body: eagerly (a warm-up or an uncaptured size), captured it, or replayed the graph
  // (a replay allocates nothing: its memory was measured when it was captured).
  enum class Ran { kNone, kEager, kCaptured, kReplayed };
  Ran last_ran() const { return last_ran_; }

  bool captured() const;
  int64_t captures() const { return captures_; }
  int64_t capture_ooms() const { return capture_ooms_; }
  // Warm-up steps routed into the capture's pool (warmup_in_pool) that ran out of memory: the pool's own blocks cut
  // for other sizes, which a routed step cannot give back (the caching allocator frees cached blocks only while no
  // routing is under way), not the step's size — a 25 % reserve over what was allocated, measured (GPT-char at
  // 0.895 GB on the H100: 634 MB allocated in 793 MB reserved when a 138 MB block was refused).
  int64_t pool_ooms() const { return pool_ooms_; }
  // Whether the last run() ran out of memory in such a warm-up step (StepFailure::in_pool_warmup).
  bool ran_out_in_pool() const { return ran_out_in_pool_; }
  const std::string& capture_error() const { return capture_error_; }  // the first capture error's first line
  bool relaxed() const { return relaxed_; }

 private:
  bool capture(const Body& body, const at::Tensor& x, const at::Tensor& y);
  void warm_up(const Body& body, const at::Tensor& x, const at::Tensor& y);  // one warm-up step (warmup_in_pool)
  void pool_release();  // gives back the pool the last warm-up ran in, if the capture has not taken it
  // What run() does at a batch size: eagerly in the graph's pool (not the captured size, refused, or disabled),
  // eagerly as a warm-up step, a capture, or a replay. run() and runs_eagerly() both decide by it.
  enum class Way { kOtherSize, kWarmUp, kCapture, kReplay };
  Way way(int64_t batch) const;

  StepGraphOptions options_;
  int64_t batch_ = 0;
  int64_t refused_batch_ = 0;
  int64_t eager_steps_ = 0;  // eager steps at batch_ since the graph was last dropped
  int64_t captures_ = 0;
  int64_t capture_ooms_ = 0;
  int64_t pool_ooms_ = 0;
  bool ran_out_in_pool_ = false;
  int64_t side_handles_ = 0;  // side captures so far (the last one's handle)
  std::string capture_error_;
  bool relaxed_ = false;
  Ran last_ran_ = Ran::kNone;
  int64_t bodies_run_ = 0;  // eager runs of the body so far (a capture's run not counted)
  struct Graph;
  std::unique_ptr<Graph> graph_;
  struct Pool;                     // the capture's pool, held from the last warm-up step (warmup_in_pool)
  std::unique_ptr<Pool> next_pool_;
  // warmup_in_pool: the graph invalidate() dropped, never replayed again; its pool is the next warm-up's and capture's.
  std::unique_ptr<Graph> stale_;
};

}  // namespace triaccel
