// Data parallelism: how each rank's training step ended, agreed by every rank after the step in the same round trip
// as the stop request (Session::stop_agreed), so that every rank takes the same recovery. Made after each step of
// either method by StepRecovery (step_recovery.h): an out-of-memory error on any rank is retried, or stops the run, on
// every rank alike.
#pragma once

#include "triaccel/core/json.h"
#include "triaccel/run/session.h"

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace triaccel {

// One rank's step.
struct RankStepOutcome {
  bool out_of_memory = false;  // the step ran out of GPU memory on this rank
  bool must_stop = false;      // ... after its update had begun: no retry (the ranks' weights may differ)
  bool beside_pool = false;    // ... in an eager step beside the captured graph's pool (not the memory plan's error)
  int64_t batch = 0;           // the batch this rank proposes for the next attempt (NeuroFlux; 0: none)
  double allocated_gb = 0;     // the allocator's reading at the failure
  double reserved_gb = 0;
  bool in_pool_warmup = false;  // ... in a warm-up step routed into the capture's pool (not the plan's model)

  std::vector<double> to_row() const {
    return {out_of_memory ? 1.0 : 0.0, must_stop ? 1.0 : 0.0, beside_pool ? 1.0 : 0.0, static_cast<double>(batch),
            allocated_gb, reserved_gb, in_pool_warmup ? 1.0 : 0.0};
  }
  static RankStepOutcome from_row(const std::vector<double>& row) {
    RankStepOutcome o;
    o.out_of_memory = row.at(0) != 0;
    o.must_stop = row.at(1) != 0;
    o.beside_pool = row.at(2) != 0;
    o.batch = static_cast<int64_t>(row.at(3));
    o.allocated_gb = row.at(4);
    o.reserved_gb = row.at(5);
    o.in_pool_warmup = row.at(6) != 0;
    return o;
  }
};

// Every rank's outcome of one step, in rank order (one process: its own), and the stop agreed with it.
struct StepAgreement {
  std::pair<StopRequest, bool> stop{StopRequest::kNone, false};  // the stop request, and whether a checkpoint is due
  std::vector<RankStepOutcome> ranks;

  bool out_of_memory() const {
    return std::any_of(ranks.begin(), ranks.end(), [](const RankStepOutcome& r) { return r.out_of_memory; });
  }
  // A rank that ran out of memory cannot retry its step: the run stops.
  bool must_stop() const {
    return std::any_of(ranks.begin(), ranks.end(),
                       [](const RankStepOutcome& r) { return r.out_of_memory && r.must_stop; });
  }
  bool beside_pool() const {
    return std::any_of(ranks.begin(), ranks.end(),
                       [](const RankStepOutcome& r) { return r.out_of_memory && r.beside_pool; });
  }
  // Every rank that ran out did so in a warm-up step routed into the capture's pool: the pool's error, not the plan's
  // model (one rank's ordinary out-of-memory error is the model's, whatever the others' were).
  bool in_pool_warmup() const {
    return out_of_memory() && std::all_of(ranks.begin(), ranks.end(), [](const RankStepOutcome& r) {
             return !r.out_of_memory || r.in_pool_warmup;
           });
  }
  // The smallest batch a rank that ran out of memory proposes, at most `batch`.
  int64_t batch_agreed(int64_t batch) const {
    for (const RankStepOutcome& r : ranks) {
      if (r.out_of_memory) batch = std::min(batch, r.batch);
    }
    return batch;
  }
  // The ranks that ran out of memory as an oom event lists them ({rank, allocated_gb, reserved_gb}); empty: none.
  Json oom_ranks() const {
    Json out = Json::array();
    for (size_t r = 0; r < ranks.size(); ++r) {
      if (!ranks[r].out_of_memory) continue;
      out.push_back(Json{{"rank", static_cast<int>(r)}, {"allocated_gb", ranks[r].allocated_gb},
                         {"reserved_gb", ranks[r].reserved_gb}});
    }
    return out;
  }
  // The same ranks as a line names them: "rank 1 of 2", "ranks 0, 1 of 2".
  std::string oom_who() const {
    std::string names;
    int count = 0;
    for (size_t r = 0; r < ranks.size(); ++r) {
      if (!ranks[r].out_of_memory) continue;
      names += (names.empty() ? "" : ", ") + std::to_string(r);
      ++count;
    }
    return c10::str(count > 1 ? "ranks " : "rank ", names, " of ", ranks.size());
  }
};

// The agreement after step `step` (the step the caller is about to count): one round trip over the ranks.
inline StepAgreement step_agreement(Session& session, int64_t step, const RankStepOutcome& own) {
  StepAgreement out;
  std::vector<std::vector<double>> rows;
  out.stop = session.stop_agreed(step, own.to_row(), &rows);
  out.ranks.reserve(rows.size());
  for (const auto& row : rows) out.ranks.push_back(RankStepOutcome::from_row(row));
  return out;
}

}  // namespace triaccel
