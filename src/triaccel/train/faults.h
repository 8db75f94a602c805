// Fault injection for reliability tests (--inject-faults; docs/reliability.md). A plan says which attempt of which
// optimizer step meets which fault; the trainer asks fault_at() before every attempt and raises the fault there:
//   oom       an out-of-memory error from the allocator (CUDA: a real caching-allocator failure; CPU: thrown)
//   nan-grad  a NaN written into the first gradient after backward (before the non-finite check)
//   inf-grad  the same with +inf
//   nan-loss  the loss multiplied by NaN (so every gradient is NaN too)
// Spec grammar (comma-separated):
//   explicit:  KIND@STEP[xN]    e.g. "oom@5,nan-grad@9,inf-grad@12,nan-loss@20x3"
//   random:    random:seed=S[,oom=P][,nan-grad=P][,inf-grad=P][,nan-loss=P][,burst=N]
//   mixed:     explicit items, then the random plan: "oom@40,oom@250,random:seed=3,nan-grad=0.01" (an explicit
//              item owns its step; the random plan covers the others)
// STEP counts optimizer steps done so far (the fault hits the attempt that would make step STEP+1). A skipped or
// out-of-memory attempt does not advance the step, so the retry of the same samples is attempt 1, 2, ...; xN (and
// burst=N for random nan-loss) makes the fault hit attempts 0..N-1 of that step: a burst of N failures in a row.
// In random mode each step draws each kind independently from a hash of (seed, step, kind) — the same plan on every
// run and after a resume — and the first kind that fires (in the order above) is the step's fault.
// Invariants: pure (no state, no clock); an empty spec plans nothing and costs one empty() check per step.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace triaccel {

enum class FaultKind { kNone, kOom, kNanGrad, kInfGrad, kNanLoss };

const char* fault_kind_name(FaultKind kind);  // "none", "oom", "nan-grad", "inf-grad", "nan-loss"

struct FaultEvent {
  FaultKind kind = FaultKind::kNone;
  int64_t step = 0;   // optimizer steps done before the faulted attempt
  int64_t count = 1;  // consecutive attempts of that step that fail
};

class FaultPlan {
 public:
  FaultPlan() = default;
  // UserError naming the bad item for a malformed spec.
  explicit FaultPlan(const std::string& spec);

  bool empty() const { return explicit_.empty() && !random_; }
  // The fault for attempt `attempt` (0 = first try) of the step after `step` steps; kNone when none.
  FaultKind fault_at(int64_t step, int64_t attempt) const;

 private:
  std::vector<FaultEvent> explicit_;
  bool random_ = false;
  uint64_t seed_ = 0;
  double p_[5] = {0, 0, 0, 0, 0};  // indexed by FaultKind
  int64_t burst_ = 1;
};

}  // namespace triaccel
