#include "triaccel/train/rng.h"

#include <ATen/CPUGeneratorImpl.h>
#ifdef TRIACCEL_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

namespace triaccel {

NamedTensors rng_state(const c10::Device& device) {
  NamedTensors out{{"cpu", at::detail::getDefaultCPUGenerator().get_state()}};
#ifdef TRIACCEL_WITH_CUDA
  if (device.is_cuda()) out.emplace_back("cuda", at::cuda::detail::getDefaultCUDAGenerator(device.index()).get_state());
#endif
  return out;
}

void rng_restore(const NamedTensors& rng, const c10::Device& device) {
  for (const auto& [name, state] : rng) {
    // Generators are shared handles: a copy sets the default generator's state.
    if (name == "cpu") {
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      gen.set_state(state);
    }
#ifdef TRIACCEL_WITH_CUDA
    if (name == "cuda" && device.is_cuda()) {
      at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator(device.index());
      gen.set_state(state);
    }
#endif
  }
}

}  // namespace triaccel
