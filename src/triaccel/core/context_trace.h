// A developer's diagnostic: which GPUs this process holds a CUDA context on, and from when.
#pragma once

namespace triaccel {

// TRIACCEL_TRACE_CONTEXTS=1: one stderr line naming `where` whenever the GPUs this process holds a CUDA context on
// differ from the last call's (a rank's context on another rank's GPU costs that GPU ~0.5 GB). Nothing without the
// variable or without CUDA. Defined in core/device.cpp.
void context_trace(const char* where);

}  // namespace triaccel
