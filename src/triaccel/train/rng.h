// The random generators' states, saved in a checkpoint and restored on resume, so that a resumed run draws the
// same numbers (dropout, augmentation that uses the global generator) as an uninterrupted one.
#pragma once

#include "triaccel/core/named_tensors.h"

#include <c10/core/Device.h>

namespace triaccel {

// "cpu": the default CPU generator; "cuda": the device's default generator (on a CUDA device).
NamedTensors rng_state(const c10::Device& device);
// Sets the default generators to the stored states (a "cuda" entry only on a CUDA device).
void rng_restore(const NamedTensors& rng, const c10::Device& device);

}  // namespace triaccel
