#include "triaccel/run/step_recovery.h"

#include "triaccel/core/bytes.h"
#include "triaccel/core/device.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/events.h"
#include "triaccel/run/step_agreement.h"

#include <algorithm>
#include <limits>

namespace triaccel {

Json OomReading::fields() const {
  return Json{{"allocated_gb", allocated_gb}, {"reserved_gb", reserved_gb}, {"error", error}};
}

OomReading oom_reading(const c10::OutOfMemoryError& e, const c10::Device& device) {
  const MemoryStats m = memory_stats(device);
  std::string what = e.what_without_backtrace();
  what = what.substr(0, std::min(what.find('\n'), size_t{400}));
  return OomReading{static_cast<double>(m.allocated_bytes) / kGB, static_cast<double>(m.reserved_bytes) / kGB, what};
}

StepOutcome StepRecovery::run(int64_t count, const RecoverableStep& step) {
  agreed_.reset();
  StepOutcome out;
  try {
    step.body();
  } catch (const c10::OutOfMemoryError& e) {
    out.own = oom_reading(e, session_.device());
  }
  const StepFailure failure = out.own ? step.failure() : StepFailure{};
  if (!session_.dist().active()) {
    out.out_of_memory = out.own.has_value();
    out.beside_pool = failure.beside_pool;
    out.in_pool_warmup = failure.in_pool_warmup;
    out.batch = failure.batch;
    return out;
  }
  // The other ranks' steps went on: the rank that ran out makes its step's collectives (every rank skips the update).
  RankStepOutcome own;
  if (out.own) {
    own.out_of_memory = true;
    own.must_stop = !step.failed_collectives();
    own.beside_pool = failure.beside_pool;
    own.in_pool_warmup = failure.in_pool_warmup;
    own.batch = failure.batch;
    own.allocated_gb = out.own->allocated_gb;
    own.reserved_gb = out.own->reserved_gb;
  }
  const StepAgreement agreed = step_agreement(session_, count, own);
  if (!agreed.out_of_memory()) {
    agreed_ = agreed.stop;
    return out;
  }
  out.out_of_memory = true;
  out.must_stop = agreed.must_stop();
  out.beside_pool = agreed.beside_pool();
  out.in_pool_warmup = agreed.in_pool_warmup();
  out.batch = agreed.batch_agreed(std::numeric_limits<int64_t>::max());
  out.ranks = agreed.oom_ranks();
  out.who = agreed.oom_who();
  return out;
}

void StepRecovery::stop(int64_t step, Json fields, const std::string& message) {
  fields["action"] = "stopped";
  session_.event(event::kOom, step, fields);
  throw UserError(message);
}

}  // namespace triaccel
