#include "triaccel/run/block_memory_setup.h"

#include "triaccel/run/component_options.h"

namespace triaccel {

BlockMemorySetup block_memory_setup(const Config& config, bool for_gpu, const MemoryProfile& profile,
                                    double resident_bytes, int64_t train_samples) {
  BlockMemorySetup out;
  out.explicit_budget = config.execution.vram_budget_bytes() > 0;
  // Backprop keeps the whole training split (held-out part included) and the test split resident.
  out.budget_bytes = out.explicit_budget ? static_cast<double>(config.execution.vram_budget_bytes())
                                         : profile.backprop_bytes(config.schedule.batch_size) + resident_bytes;
  PartitionOptions& po = out.options;
  po = partition_options(config);
  po.budget_bytes = out.budget_bytes;
  po.base_bytes = resident_bytes;
  po.samples = train_samples;
  if (!for_gpu) {  // the CPU: slower, saturated at small batches, and its "host cache" is just memory
    po.bytes_per_s = 5e9;
    po.sat_batch = 32;
    po.host_bytes_per_s = 0;
  }
  out.backprop_batch = profile.backprop_max_batch(po.safety * out.budget_bytes - resident_bytes);
  return out;
}

}  // namespace triaccel
