// Data parallelism: a row of numbers from every rank, carried by the step's stop agreement (Session::stop_agreed,
// one round trip through the rendezvous store), and the ranks an out-of-memory error hit, as the methods' oom events
// and lines name them. Used by the backprop trainer and NeuroFlux's block trainer after each step.
#pragma once

#include "triaccel/core/json.h"
#include "triaccel/run/session.h"

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace triaccel {

// Every rank's row (in rank order) after the stop agreement for `step`, each rank having given `own` (all rows the
// same width); `agreed` receives the agreement itself. One process: its own row.
inline std::vector<std::vector<double>> stop_agreed_rows(Session& session, int64_t step,
                                                         const std::vector<double>& own,
                                                         std::pair<StopRequest, bool>* agreed) {
  const Dist& dist = session.dist();
  const size_t width = own.size();
  const auto world = static_cast<size_t>(dist.world_size());
  // Each rank fills its own slots of the sum.
  std::vector<double> v(width * world, 0.0);
  std::copy(own.begin(), own.end(), v.begin() + static_cast<std::ptrdiff_t>(width * static_cast<size_t>(dist.rank())));
  *agreed = session.stop_agreed(step, &v);
  std::vector<std::vector<double>> rows(world);
  for (size_t r = 0; r < world; ++r) {
    rows[r].assign(v.begin() + static_cast<std::ptrdiff_t>(r * width),
                   v.begin() + static_cast<std::ptrdiff_t>((r + 1) * width));
  }
  return rows;
}

// The ranks whose row has column 0 set (it ran out of memory): `ranks` as an oom event lists them ({rank,
// allocated_gb, reserved_gb}, from columns `allocated` and `allocated` + 1), `who` as a line names them ("rank 1 of
// 2", "ranks 0, 1 of 2"); `ranks` empty when none did.
struct RanksOutOfMemory {
  Json ranks = Json::array();
  std::string who;
};

inline RanksOutOfMemory ranks_out_of_memory(const std::vector<std::vector<double>>& rows, size_t allocated) {
  RanksOutOfMemory out;
  std::string names;
  for (size_t r = 0; r < rows.size(); ++r) {
    if (rows[r][0] == 0) continue;
    out.ranks.push_back(Json{{"rank", static_cast<int>(r)}, {"allocated_gb", rows[r][allocated]},
                             {"reserved_gb", rows[r][allocated + 1]}});
    names += (names.empty() ? "" : ", ") + std::to_string(r);
  }
  out.who = c10::str(out.ranks.size() > 1 ? "ranks " : "rank ", names, " of ", rows.size());
  return out;
}

}  // namespace triaccel
