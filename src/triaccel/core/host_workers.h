// A small pool of host threads for memory-bound copies that must use every core: NeuroFlux's host cache gathers
// (rows at random offsets into a pinned staging buffer). ATen's at::parallel_for cannot be used from our code: with
// LibTorch's OpenMP backend it is a header template whose `#pragma omp parallel` only runs in parallel in a
// translation unit compiled with -fopenmp (ours runs it on one thread), and ATen's own index_select gathers rows
// barely faster with all threads than with one (methods/activation_cache.cpp: gather_rows).
#pragma once

#include <cstdint>
#include <functional>

namespace triaccel {

// Runs fn(part) for every part in [0, parts) on the pool's threads and the calling thread, and returns when all are
// done. Parts are handed out in order, one at a time. The pool has at::get_num_threads() - 1 threads (at most 31),
// started on first use; with one thread, or one part, fn runs here. Not reentrant: one caller at a time (a mutex
// serializes callers).
void host_parallel(int64_t parts, const std::function<void(int64_t)>& fn);

// Threads that run parts, the caller included.
int host_parallel_threads();

}  // namespace triaccel
