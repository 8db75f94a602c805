#include "triaccel/train/step_graph.h"

#include "triaccel/core/cuda_graph.h"

#include <algorithm>
#include <optional>
#ifdef TRIACCEL_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#endif

namespace triaccel {

struct StepGraph::Graph {
#ifdef TRIACCEL_WITH_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  std::unique_ptr<at::cuda::CUDAGraph> side;  // side_capture's, in graph's pool
#endif
  int64_t side_handle = 0;  // side's handle (0: none)
  at::Tensor x, y;  // the static inputs: the tensors of the step that was captured
};

struct StepGraph::Pool {
#ifdef TRIACCEL_WITH_CUDA
  CudaGraphPool pool;
#endif
};

StepGraph::StepGraph(StepGraphOptions options) : options_(std::move(options)), batch_(options_.batch) {
#ifndef TRIACCEL_WITH_CUDA
  options_.enabled = false;
#endif
}

StepGraph::~StepGraph() = default;

bool StepGraph::captured() const { return graph_ != nullptr; }

void StepGraph::set_batch(int64_t batch) {
  if (batch == batch_) return;
  batch_ = batch;
  graph_.reset();
  pool_release();
  eager_steps_ = std::max<int64_t>(0, options_.warmup_steps - 1);
}

void StepGraph::invalidate() {
  if (!graph_) return;  // still warming up: the warm-up goes on
  std::unique_ptr<Graph> old = std::move(graph_);
  pool_release();
  eager_steps_ = std::max<int64_t>(0, options_.warmup_steps - 1);
#ifdef TRIACCEL_WITH_CUDA
  if (options_.warmup_in_pool) {
    // The same step at other dtypes or levers needs about the memory the old graph's pool holds: the next warm-up and
    // capture take it from there (the old graph is never replayed again), not from a pool beside it, which would have
    // to find room in the eager pool's partly used pages, and a capture cannot release those when it runs out
    // (Tri-Accel's precision moves under a budget: docs/results/memory-planner.md).
    old->side.reset();
    old->side_handle = 0;
    stale_ = std::move(old);
  }
#endif
}

void StepGraph::drop() {
  graph_.reset();
  pool_release();
  eager_steps_ = 0;
}

void StepGraph::pool_release() {
#ifdef TRIACCEL_WITH_CUDA
  if (!next_pool_ && !stale_) return;
  next_pool_.reset();  // the pool is freeable now unless a graph uses it: its cached blocks go back
  stale_.reset();
  c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

void StepGraph::warm_up(const Body& body, const at::Tensor& x, const at::Tensor& y) {
  ++eager_steps_;
#ifdef TRIACCEL_WITH_CUDA
  // The last warm-up before the capture runs in the capture's pool (core/cuda_graph.h: CudaGraphPool), unless it is
  // the body's first run (which makes lasting state: the optimizer's, lazily made buffers).
  if (options_.warmup_in_pool && eager_steps_ >= options_.warmup_steps && bodies_run_ > 0) {
    // The eager pool's cached blocks go back first: a step whose allocations are routed to a pool cannot release
    // them when it runs out of memory (the caching allocator frees cached blocks only while no capture or routing is
    // under way). What the last eager step left (its gradients, which the body would free at its start, inside the
    // routing) is released before, so that its memory goes back too.
    if (options_.before_replay) options_.before_replay();
    c10::cuda::CUDACachingAllocator::emptyCache();
    const auto routed = [&]() {
      try {
        if (options_.during_pool_warmup) options_.during_pool_warmup();
        body(x, y);
      } catch (const c10::OutOfMemoryError&) {
        ++pool_ooms_;
        ran_out_in_pool_ = true;
        throw;
      }
    };
    if (stale_) {  // after invalidate: in the old graph's pool, which the capture then shares
      cuda_graph_pool_run(*stale_->graph, routed);
      ++bodies_run_;
      return;
    }
    pool_release();
    auto pool = std::make_unique<Pool>();
    pool->pool.run(routed);  // a throw gives the pool back with it
    next_pool_ = std::move(pool);
    ++bodies_run_;
    return;
  }
#endif
  body(x, y);
  ++bodies_run_;
}

void StepGraph::refuse() {
  refused_batch_ = batch_;
  drop();
}

bool StepGraph::replay_as_is() {
  if (!graph_) return false;
#ifdef TRIACCEL_WITH_CUDA
  graph_->graph->replay();
#endif
  return true;
}

void StepGraph::allow() {
  if (refused_batch_ == 0) return;
  refused_batch_ = 0;
  drop();
}

void StepGraph::disable() {
  options_.enabled = false;
  drop();
}

bool StepGraph::capture(const Body& body, const at::Tensor& x, const at::Tensor& y) {
#ifdef TRIACCEL_WITH_CUDA
  auto g = std::make_unique<Graph>();
  g->x = x;  // the caller's tensors become the graph's static inputs (no copy); later steps are copied into them
  g->y = y;
  // What the last eager step left (its gradients) goes back first: the capture's pool cannot reuse those blocks,
  // and under a tight budget the two copies together may not fit (measured: docs/results/memory-planner.md).
  if (options_.before_replay) options_.before_replay();
  std::string error;
  std::optional<at::cuda::MempoolId_t> share;  // the pool the last warm-up ran in: the old graph's or a new one
  if (stale_) {
    share = stale_->graph->pool();
  } else if (next_pool_) {
    share = next_pool_->pool.id();
  }
  g->graph = cuda_graph_capture(
      [&]() {
        if (options_.during_capture) options_.during_capture();
        body(g->x, g->y);
      },
      &error, relaxed_, share ? &*share : nullptr);
  pool_release();  // a captured graph keeps the pool (the old graph gives its use back); a failed capture's goes back
  if (options_.agree_capture) {
    const int own = g->graph ? 0 : error.empty() ? 1 : 2;
    const int all = options_.agree_capture(own);
    if (all != own) {  // another rank's capture failed: this rank's graph goes too, for the same reason
      g->graph.reset();
      if (all == 2 && error.empty()) error = "another rank's capture was refused";
    }
  }
  if (g->graph) {
    graph_ = std::move(g);
    ++captures_;
    return true;
  }
  if (error.empty()) {
    ++capture_ooms_;
  } else if (capture_error_.empty()) {
    capture_error_ = error;
  }
  if (!error.empty() && options_.relaxed_retry && !relaxed_) {
    // A call global mode refuses (EfficientNet-B0 blocks at batch 512 under 0.4-0.5 GB; which call is not
    // established): warm up and capture once more in relaxed mode before the batch size stays eager.
    relaxed_ = true;
    drop();
  } else {
    refuse();
  }
#endif
  return false;
}

int64_t StepGraph::side_capture(const std::function<void()>& fn) {
#ifdef TRIACCEL_WITH_CUDA
  if (!graph_) return 0;
  graph_->side.reset();
  graph_->side_handle = 0;
  const at::cuda::MempoolId_t pool = graph_->graph->pool();
  graph_->side = cuda_graph_capture(fn, nullptr, false, &pool);
  if (!graph_->side) return 0;
  graph_->side_handle = ++side_handles_;
  return graph_->side_handle;
#else
  (void)fn;
  return 0;
#endif
}

bool StepGraph::side_replay(int64_t handle) {
  if (!graph_ || handle == 0 || graph_->side_handle != handle) return false;
#ifdef TRIACCEL_WITH_CUDA
  graph_->side->replay();
#endif
  return true;
}

void StepGraph::in_pool(const std::function<void()>& fn) {
#ifdef TRIACCEL_WITH_CUDA
  // Between invalidate and the capture: the memory the dropped graph holds.
  const Graph* pool_of = graph_ ? graph_.get() : stale_.get();
  if (pool_of && options_.eager_in_pool) {
    cuda_graph_pool_run(*pool_of->graph, fn);
    return;
  }
#endif
  fn();
}

StepGraph::Way StepGraph::way(int64_t batch) const {
  if (!options_.enabled || batch != batch_ || batch == refused_batch_) return Way::kOtherSize;
  if (graph_) return Way::kReplay;
  return eager_steps_ < options_.warmup_steps ? Way::kWarmUp : Way::kCapture;
}

bool StepGraph::runs_eagerly(int64_t batch) const {
  const Way w = way(batch);
  return w == Way::kOtherSize || w == Way::kWarmUp;
}

void StepGraph::run(const Body& body, const at::Tensor& x, const at::Tensor& y) {
  last_ran_ = Ran::kEager;
  ran_out_in_pool_ = false;
  switch (way(x.size(0))) {
    case Way::kOtherSize:
      in_pool([&]() { body(x, y); });
      ++bodies_run_;
      return;
    case Way::kWarmUp:
      warm_up(body, x, y);
      return;
    case Way::kCapture:
      if (!capture(body, x, y)) {
        body(x, y);  // the capture ran nothing: this step runs eagerly
        ++bodies_run_;
        return;
      }
      last_ran_ = Ran::kCaptured;
      break;
    case Way::kReplay:
      // Callers may pass views of the static inputs (new Tensor objects, same memory): compare storage, not identity.
      if (x.data_ptr() != graph_->x.data_ptr()) graph_->x.copy_(x);
      if (y.data_ptr() != graph_->y.data_ptr()) graph_->y.copy_(y);
      if (options_.before_replay) options_.before_replay();
      last_ran_ = Ran::kReplayed;
      break;
  }
#ifdef TRIACCEL_WITH_CUDA
  graph_->graph->replay();
#endif
}

}  // namespace triaccel
