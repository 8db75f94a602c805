// CUDA graph capture that always leaves the process in a usable state (core/cuda_graph.h).
#include "triaccel/core/cuda_graph.h"

#ifdef TRIACCEL_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <mutex>
#include <optional>
#endif

namespace triaccel {

#ifdef TRIACCEL_WITH_CUDA
std::unique_ptr<at::cuda::CUDAGraph> cuda_graph_capture(const std::function<void()>& body, std::string* error,
                                                        bool relaxed, const at::cuda::MempoolId_t* share_pool) {
  c10::cuda::CUDACachingAllocator::emptyCache();
  auto graph = std::make_unique<at::cuda::CUDAGraph>();
  const c10::DeviceIndex device = c10::cuda::current_device();
  const auto first_line = [](const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    return what.substr(0, what.find('\n'));
  };
  // Gives up a failed capture. When capture_end itself failed (an invalidated capture), ATen 2.11 has not ended the
  // allocator's routing to the graph's pool, and CUDAGraph::reset releases only pools of captures that ended: both are
  // done here. Else the allocator counts a capture under way for good (it then defers frees and stops processing
  // events) and the pool is never freed: an EfficientNet-B0 run at 0.5 GB ran out of memory at any batch two blocks
  // after a failed capture, and a later capture in the same process failed. The pool's id is ours
  // (CUDAGraph::pool() refuses to name it before a capture ended). A shared pool: this capture's use of it is given
  // back the same way; the other graph's keeps it.
  const at::cuda::MempoolId_t pool = share_pool ? *share_pool : at::cuda::graph_pool_handle();
  const auto abandon = [&](bool ended) {
    if (!ended) {
      (void)cudaGetLastError();
      try {  // capture_end threw before handing the stream back: the allocator still counts a capture under way
        c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool);
      } catch (const c10::Error&) {  // already handed back
      }
      bool capture_ended = true;
      try {
        (void)graph->pool();  // throws unless the capture ended, in which case CUDAGraph::reset releases the pool
      } catch (const c10::Error&) {
        capture_ended = false;
      }
      if (!capture_ended) c10::cuda::CUDACachingAllocator::releasePool(device, pool);
      // The default CUDA generator stays in capture mode too (its capture epilogue never ran): the next random op
      // outside a capture failed ("Offset increment outside graph capture", EfficientNet-B0's dropout). It gets a
      // fresh state with the same seed and offset.
      at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator(device);
      const std::lock_guard<std::mutex> lock(gen.mutex());
      auto* impl = at::check_generator<at::CUDAGeneratorImpl>(gen);
      impl->graphsafe_set_state(c10::make_intrusive<at::CUDAGeneratorImpl>(
          device, c10::make_intrusive<at::CUDAGeneratorState>(impl->current_seed(), impl->philox_offset_per_thread())));
    }
    graph.reset();
    c10::cuda::CUDACachingAllocator::emptyCache();
  };
  // Ends the capture: nullopt when it ended (the stream left capture mode and the pool was handed back), else the
  // first line of capture_end's error.
  const auto end = [&]() -> std::optional<std::string> {
    try {
      graph->capture_end();
      return std::nullopt;
    } catch (const c10::Error& e) {
      return first_line(e);
    }
  };
  graph->capture_begin(pool, relaxed ? cudaStreamCaptureModeRelaxed : cudaStreamCaptureModeGlobal);
  try {
    body();
  } catch (const c10::OutOfMemoryError&) {
    abandon(!end().has_value());  // out of memory: not an error to report
    return nullptr;
  } catch (const c10::Error& e) {
    // An operation the capture refused (its error may surface only at a later call). Run eagerly: a step that
    // cannot run at all raises its error again there.
    if (error) *error = first_line(e);
    abandon(!end().has_value());
    return nullptr;
  }
  if (const auto end_error = end()) {
    if (error) *error = *end_error;
    abandon(false);
    return nullptr;
  }
  return graph;
}

void cuda_graph_pool_run(at::cuda::CUDAGraph& graph, const std::function<void()>& body) {
  const c10::DeviceIndex device = c10::cuda::current_device();
  const at::cuda::MempoolId_t pool = graph.pool();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  // Routed by stream, as a capture is: autograd's device thread runs backward on the same stream, other streams (a
  // host-streamed loader's copies) keep the default pool. Routing takes a use of the pool, given back at the end.
  c10::cuda::CUDACachingAllocator::beginAllocateToPool(device, pool,
                                                       [stream](cudaStream_t s) { return s == stream; });
  struct Routed {
    c10::DeviceIndex device;
    at::cuda::MempoolId_t pool;
    ~Routed() {
      c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool);
      c10::cuda::CUDACachingAllocator::releasePool(device, pool);
    }
  } routed{device, pool};
  body();
}
#endif

#ifdef TRIACCEL_WITH_CUDA
CudaGraphPool::CudaGraphPool() : device_(c10::cuda::current_device()), id_(at::cuda::graph_pool_handle()) {}

CudaGraphPool::~CudaGraphPool() {
  for (; uses_ > 0; --uses_) c10::cuda::CUDACachingAllocator::releasePool(device_, id_);
}

void CudaGraphPool::run(const std::function<void()>& body) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  c10::cuda::CUDACachingAllocator::beginAllocateToPool(device_, id_,
                                                       [stream](cudaStream_t s) { return s == stream; });
  ++uses_;  // beginAllocateToPool took a use of the pool; the destructor gives it back
  struct Routed {
    c10::DeviceIndex device;
    at::cuda::MempoolId_t pool;
    ~Routed() { c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool); }
  } routed{device_, id_};
  body();
}
#endif

#ifdef TRIACCEL_WITH_CUDA
void cuda_copy_pinned_async(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous() && dst.nbytes() == src.nbytes() &&
                  dst.scalar_type() == src.scalar_type() && dst.is_cuda() != src.is_cuda() &&
                  (dst.is_cuda() ? src.is_pinned() : dst.is_pinned()),
              "cuda_copy_pinned_async: needs contiguous tensors of one size and dtype, one pinned on the host and one "
              "on a GPU");
  const auto kind = dst.is_cuda() ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
  C10_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), src.nbytes(), kind,
                                 c10::cuda::getCurrentCUDAStream().stream()));
}
#endif

bool cuda_capture_underway() {
#ifdef TRIACCEL_WITH_CUDA
  if (c10::cuda::device_count() == 0) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(), &status));
  return status != cudaStreamCaptureStatusNone;
#else
  return false;
#endif
}

}  // namespace triaccel
