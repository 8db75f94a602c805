// Data parallelism: the ranks an out-of-memory error hit, from every rank's row of the step's stop agreement
// (Session::stop_agreed), as the methods' oom events and lines name them. Used by the backprop trainer and NeuroFlux's
// block trainer after each step.
#pragma once

#include "triaccel/core/json.h"

#include <c10/util/StringUtil.h>

#include <cstddef>
#include <string>
#include <vector>

namespace triaccel {

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
