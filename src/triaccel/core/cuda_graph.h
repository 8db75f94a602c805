// CUDA graph capture that always leaves the process in a usable state: on success a graph to replay; on failure
// nothing captured, nothing reserved, the stream out of capture mode and the CUDA error state clear.
#pragma once

#ifdef TRIACCEL_WITH_CUDA
#include <ATen/Tensor.h>
#include <ATen/cuda/CUDAGraph.h>
#endif

#include <functional>
#include <memory>
#include <string>

namespace triaccel {

#ifdef TRIACCEL_WITH_CUDA
// `body` captured in a new CUDA graph on the current stream (a training step: TrainStep, NeuroFlux's block loop; a
// Hessian-vector product: curvature/hvp.h). The eager calls' cached blocks go back to the device first: the graph's
// private pool cannot reuse them, and under a --vram-budget the two together may not fit (nothing can be freed
// while a capture is under way). The capture runs nothing: replay the graph to run the body. Returns nullptr when
// the capture failed — the graph and its pool are freed and the caller runs the body eagerly (where a real fault
// raises its error again). An out-of-memory capture leaves `error` empty; any other failure (an operation a capture
// does not allow) sets it to the error's first line. Either way the stream leaves capture mode, the CUDA error
// state is cleared and no half-made graph is left behind. `relaxed` captures in cudaStreamCaptureModeRelaxed: calls
// that global mode refuses during a capture (from any thread: a cudaFree, an event synchronize) are then allowed
// and simply not recorded. `share_pool`: capture into that pool (another graph's, CUDAGraph::pool()) instead of a
// new one: memory the other graph's capture freed (its scratch) serves this one's, so the two need about the larger
// scratch, not both. Each replay then overwrites what the other freed during its capture: replay them one at a time,
// and keep nothing either allocates between replays but the tensors each holds live. The pool lives while a graph
// in it does.
std::unique_ptr<at::cuda::CUDAGraph> cuda_graph_capture(const std::function<void()>& body,
                                                        std::string* error = nullptr, bool relaxed = false,
                                                        const at::cuda::MempoolId_t* share_pool = nullptr);

// Runs `body` with the current stream's allocations taken from `graph`'s private pool: the memory its replays use
// as scratch serves an eager call between two replays (a step of another batch size, an evaluation) instead of
// memory of its own beside the pool — under a --vram-budget the two may not fit together (measured:
// docs/results/memory-planner.md). The pool grows if it must. Contract: what `body` allocates is dead before the
// graph is replayed again (a replay overwrites the pool), so `body` may create no lasting state — no tensor it keeps,
// no lazily made buffer; a caller's tensors that `body` writes in place are not in the pool and are safe.
void cuda_graph_pool_run(at::cuda::CUDAGraph& graph, const std::function<void()>& body);

// A private memory pool for a graph not yet captured, held from before its capture: an eager call run in it (run)
// leaves its freed blocks cached in the pool, and the capture (cuda_graph_capture with share_pool = &id()) reuses
// them, in the layout that eager call fitted, instead of opening a second pool beside the eager calls' cached blocks
// (which nothing can free while a capture is under way: under a tight --vram-budget the capture ran out of memory
// in free gaps of both pools where the eager step fitted; docs/results/memory-planner.md). An eager call, unlike a
// capture, may release the default pool's cached memory when it runs short. Holds one use of the pool per run();
// the graph captured into it holds its own, so the pool lives while either does. What `run`'s body keeps alive after
// it returns stays in the pool.
class CudaGraphPool {
 public:
  CudaGraphPool();
  ~CudaGraphPool();  // gives this object's uses back
  CudaGraphPool(const CudaGraphPool&) = delete;
  CudaGraphPool& operator=(const CudaGraphPool&) = delete;

  const at::cuda::MempoolId_t& id() const { return id_; }
  // `body` with its allocations on the current stream taken from the pool (the routing ends also when it throws).
  void run(const std::function<void()>& body);

 private:
  c10::DeviceIndex device_;
  at::cuda::MempoolId_t id_;
  int uses_ = 0;
};

// dst = src for two contiguous tensors of the same size and dtype, one in pinned host memory, the other on the
// current CUDA device: one cudaMemcpyAsync on the current stream, recorded as a copy node when the stream is being
// captured (each replay then reads or writes the host memory as it is then). The caller keeps the host tensor alive
// while any copy may run. No caching-allocator bookkeeping: the host tensor must not be freed and reused under it.
void cuda_copy_pinned_async(const at::Tensor& dst, const at::Tensor& src);
#endif

// Whether the current CUDA stream is being captured into a graph (false in a build without CUDA): for code that must
// refuse a host decision inside someone else's capture (api/loop_optimizer.h).
bool cuda_capture_underway();

}  // namespace triaccel
