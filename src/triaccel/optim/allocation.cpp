#include "triaccel/optim/allocation.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace triaccel {
namespace {

void totals(const AllocationProblem& p, AllocationResult& r) {
  r.risk = 0;
  r.bytes = 0;
  r.time = 0;
  for (size_t u = 0; u < p.units.size(); ++u) {
    const AllocationOption& o = p.units[u][static_cast<size_t>(r.choice[u])];
    r.risk += o.risk;
    r.bytes += o.bytes;
    r.time += o.time;
  }
}

void minima(const AllocationProblem& p, AllocationResult& r) {
  r.min_bytes = 0;
  r.min_time = 0;
  for (const auto& opts : p.units) {
    TORCH_CHECK(!opts.empty() && opts.size() <= 255, "allocation: each unit needs 1 to 255 options");
    int64_t b = std::numeric_limits<int64_t>::max();
    double t = std::numeric_limits<double>::infinity();
    for (const auto& o : opts) {
      b = std::min(b, o.bytes);
      t = std::min(t, o.time);
    }
    r.min_bytes += b;
    r.min_time += t;
  }
}

}  // namespace

AllocationResult allocation_solve(const AllocationProblem& p) {
  AllocationResult r;
  minima(p, r);
  if (p.memory_budget < 0) return r;
  const bool timed = p.time_budget >= 0;
  // Bucket sizes: memory in whole bytes (≥ 1), time in budget / buckets.
  const int64_t mem_bucket = std::max<int64_t>(1, (p.memory_budget + p.memory_buckets - 1) / p.memory_buckets);
  const int64_t mem_cap = p.memory_budget / mem_bucket;
  const int64_t time_cap = timed ? p.time_buckets : 0;
  const double time_bucket = timed && p.time_budget > 0 ? p.time_budget / static_cast<double>(p.time_buckets) : 0;
  const auto mem_cost = [&](int64_t bytes) { return (bytes + mem_bucket - 1) / mem_bucket; };
  const auto time_cost = [&](double t) -> int64_t {
    if (!timed) return 0;
    if (t <= 0) return 0;
    if (time_bucket <= 0) return time_cap + 1;  // a zero budget admits only free options
    return static_cast<int64_t>(std::ceil(t / time_bucket - 1e-9));
  };
  const int64_t width = (mem_cap + 1) * (time_cap + 1);
  const double inf = std::numeric_limits<double>::infinity();
  // dp[m * (time_cap + 1) + t]: the least risk of the units so far using exactly ≤ m memory and ≤ t time buckets
  // (monotone by construction: every cell starts from "any cheaper cell").
  std::vector<double> dp(static_cast<size_t>(width), 0.0), next(static_cast<size_t>(width));
  std::vector<std::vector<uint8_t>> pick(p.units.size(), std::vector<uint8_t>(static_cast<size_t>(width), 255));
  for (size_t u = 0; u < p.units.size(); ++u) {
    std::fill(next.begin(), next.end(), inf);
    for (size_t k = 0; k < p.units[u].size(); ++k) {
      const AllocationOption& o = p.units[u][k];
      const int64_t cm = mem_cost(o.bytes), ct = time_cost(o.time);
      if (cm > mem_cap || ct > time_cap) continue;
      for (int64_t m = cm; m <= mem_cap; ++m) {
        for (int64_t t = ct; t <= time_cap; ++t) {
          const double prev = dp[static_cast<size_t>((m - cm) * (time_cap + 1) + (t - ct))];
          const size_t cell = static_cast<size_t>(m * (time_cap + 1) + t);
          if (prev + o.risk < next[cell]) {
            next[cell] = prev + o.risk;
            pick[u][cell] = static_cast<uint8_t>(k);
          }
        }
      }
    }
    dp.swap(next);
  }
  const size_t full = static_cast<size_t>(width - 1);
  if (!(dp[full] < inf)) return r;
  // Walk back from the full budget.
  r.choice.assign(p.units.size(), 0);
  int64_t m = mem_cap, t = time_cap;
  for (size_t u = p.units.size(); u-- > 0;) {
    const uint8_t k = pick[u][static_cast<size_t>(m * (time_cap + 1) + t)];
    TORCH_CHECK(k != 255, "allocation: broken back-pointer");
    r.choice[u] = k;
    m -= mem_cost(p.units[u][k].bytes);
    t -= time_cost(p.units[u][k].time);
  }
  r.feasible = true;
  totals(p, r);
  return r;
}

AllocationResult allocation_brute_force(const AllocationProblem& p) {
  AllocationResult best;
  minima(p, best);
  std::vector<int> choice(p.units.size(), 0);
  double best_risk = std::numeric_limits<double>::infinity();
  while (true) {
    AllocationResult r;
    r.choice = choice;
    totals(p, r);
    if (r.bytes <= p.memory_budget && (p.time_budget < 0 || r.time <= p.time_budget + 1e-12) && r.risk < best_risk) {
      best_risk = r.risk;
      best.choice = choice;
      best.feasible = true;
    }
    size_t u = 0;
    while (u < choice.size() && ++choice[u] == static_cast<int>(p.units[u].size())) choice[u++] = 0;
    if (u == choice.size()) break;
  }
  if (best.feasible) totals(p, best);
  return best;
}

}  // namespace triaccel
