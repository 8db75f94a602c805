// NeuroFlux's memory set-up, the block-wise counterpart of memory_setup.h (backprop's): from the run's configuration
// and the model's memory profile (control/memory/memory_profile.h), the budget the block partition plans against
// and the partitioner's options (control/memory/partitioner.h: the planner over blocks; where the data lives is its
// neuroflux_data).
// NeuroFlux (methods/neuroflux.cpp) plans its blocks with it; nothing here allocates.
#pragma once

#include "triaccel/control/memory/memory_profile.h"
#include "triaccel/control/memory/partitioner.h"
#include "triaccel/run/config.h"

#include <cstdint>

namespace triaccel {

struct BlockMemorySetup {
  bool explicit_budget = false;  // a vram_budget was given
  // The budget the blocks plan against: the vram_budget, or without one the memory backprop would use at batch_size
  // with the run's resident data (NeuroFlux then trains in what backprop would take).
  double budget_bytes = 0;
  PartitionOptions options;      // the partitioner's, with the budget, the resident bytes and the training samples
  int64_t backprop_batch = 0;    // the largest batch backprop could train in the same budget (for the summary)
};

// `for_gpu`: the blocks train on a GPU (the run's device, or method auto's preview, which plans for one wherever it
// runs, as neuroflux_data's placement does); else the CPU's speeds. `resident_bytes`: what stays on the device whatever
// the blocks (the datasets' resident part, staging buffers); `train_samples`: the samples the blocks train on.
BlockMemorySetup block_memory_setup(const Config& config, bool for_gpu, const MemoryProfile& profile,
                                    double resident_bytes, int64_t train_samples);

}  // namespace triaccel
