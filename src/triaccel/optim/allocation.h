// BAOC's allocation: pick one option per unit minimizing the total risk subject to total bytes ≤ memory budget and
// total time ≤ time budget: a multiple-choice knapsack with two constraints, solved exactly by dynamic programming
// over discretized memory × time. Costs are rounded UP to their bucket, so every plan the DP returns fits the real
// budgets; when the costs are multiples of the bucket sizes (e.g. a budget of at most memory_buckets bytes) the
// result is the exact optimum (tested against brute force).
#pragma once

#include <cstdint>
#include <vector>

namespace triaccel {

struct AllocationOption {
  double risk = 0;
  int64_t bytes = 0;
  double time = 0;  // any unit (seconds in the format plan)
};

struct AllocationProblem {
  std::vector<std::vector<AllocationOption>> units;  // units[u]: its options (at most 255)
  int64_t memory_budget = 0;
  double time_budget = -1;     // < 0: no time constraint
  int64_t memory_buckets = 4000;
  int64_t time_buckets = 200;
};

struct AllocationResult {
  bool feasible = false;
  std::vector<int> choice;  // option index per unit (empty when infeasible)
  double risk = 0;
  int64_t bytes = 0;
  double time = 0;
  int64_t min_bytes = 0;    // Σ of each unit's cheapest option (what any plan needs)
  double min_time = 0;      // Σ of each unit's fastest option
};

AllocationResult allocation_solve(const AllocationProblem& problem);

// Exhaustive search (tests, tiny problems): the exact optimum under the real (undiscretized) budgets.
AllocationResult allocation_brute_force(const AllocationProblem& problem);

}  // namespace triaccel
