// Data parallelism's seam (../DESIGN "Scale-out", docs/architecture.md): a c10d process group over a TCPStore
// rendezvous, from a torchrun-style environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or given explicitly.
// With one process (WORLD_SIZE unset or 1) nothing is created and every collective is a no-op.
// Backends: c10d's ProcessGroupGloo for host tensors (the pip wheel's libtorch carries Gloo; its headers come from
// Debian's libgloo-dev), and, in CUDA builds when DistOptions::cuda_device is set, c10d's ProcessGroupNCCL for CUDA
// tensors: its collectives are ordered on the current stream and do not wait on the host (so a CUDA graph may
// capture them). CUDA tensors without NCCL go through a host copy and Gloo.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace triaccel {

struct DistOptions {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // the rank among this host's processes: its GPU (LOCAL_RANK)
  int cuda_device = -1;  // >= 0: CUDA tensors are reduced by NCCL on this GPU (CUDA builds)
  // Whether rank 0 serves the TCPStore. torchrun's agent serves it itself (TORCHELASTIC_USE_AGENT_STORE=True):
  // then every rank is a client.
  bool rank0_serves_store = true;
  // Which attempt of the group this is: torchrun's TORCHELASTIC_RESTART_COUNT, 0 at the start and n after its n-th
  // restart of the group (--max-restarts). Under torchrun's agent store each attempt keeps its keys apart; a restarted
  // run resumes from the checkpoint in its output folder (Session).
  int restart = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // rendezvous and each collective
};

// The ranks a launcher put in the environment (torchrun's variables: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_RESTART_COUNT). world_size 1 when WORLD_SIZE is unset;
// local_rank defaults to rank.
// UserError naming the variable when one is malformed or out of range (RANK outside [0, WORLD_SIZE)).
DistOptions dist_options_from_env();
// A TCP port free on 127.0.0.1 now, below the kernel's ephemeral range so that no outgoing connection takes it before
// a store binds it moments later (the launcher's rendezvous; tests' ranks in threads). UserError when no socket can
// be bound.
int free_local_port();

// A collective under way (Dist::all_reduce_sum_start): wait() returns once its result is in place — on NCCL, once
// the current stream is ordered after it. A second wait() does nothing; an empty DistWork (one process) waits for
// nothing.
class DistWork {
 public:
  DistWork() = default;
  explicit DistWork(std::function<void()> wait) : wait_(std::move(wait)) {}
  void wait() {
    if (!wait_) return;
    const std::function<void()> w = std::move(wait_);
    wait_ = nullptr;
    w();
  }

 private:
  std::function<void()> wait_;
};

class Dist {
 public:
  // Joins the group: blocks until every rank has (rank 0 serves the store). UserError naming MASTER_ADDR and
  // MASTER_PORT when the rendezvous fails. world_size 1: nothing to join.
  explicit Dist(const DistOptions& options);
  ~Dist();
  Dist(const Dist&) = delete;
  Dist& operator=(const Dist&) = delete;

  int rank() const { return options_.rank; }
  int world_size() const { return options_.world_size; }
  bool active() const { return options_.world_size > 1; }
  // Rank `rank`'s part of `count` samples of a global batch, (first, count) relative to the batch: contiguous parts
  // in rank order whose sizes differ by at most one.
  std::pair<int64_t, int64_t> share(int64_t count, int rank) const {
    const int64_t first = count * rank / world_size();
    const int64_t end = count * (rank + 1) / world_size();
    return {first, end - first};
  }
  // This rank's part.
  std::pair<int64_t, int64_t> share(int64_t count) const { return share(count, rank()); }
  // Whether CUDA tensors go through NCCL (without a host sync).
  bool nccl() const;
  // Whether this build can reduce CUDA tensors with NCCL.
  static bool nccl_built();

  // Sums `tensors` over the ranks, in place on every rank: one collective per tensor.
  void all_reduce_sum(std::vector<at::Tensor>& tensors);
  void all_reduce_sum(at::Tensor& t) {
    std::vector<at::Tensor> one{t};
    all_reduce_sum(one);
  }
  // Starts summing the contiguous `t` over the ranks, in place, and returns at once: the caller goes on (backward,
  // say) while it runs, and must not touch `t` until the returned work's wait(). Collectives start in the same order
  // on every rank. A CUDA tensor without NCCL is copied to the host here and back in wait().
  DistWork all_reduce_sum_start(const at::Tensor& t);
  // Sums host numbers over the ranks (float64), in place; returns them.
  std::vector<double> all_reduce_sum(std::vector<double> values);
  // Each number's largest value over the ranks (float64; the same count on every rank).
  std::vector<double> all_reduce_max(std::vector<double> values);
  // Rank 0's numbers on every rank (float64; the same count on every rank): what a rank measured alone (a clock, an
  // allocator) decided once for all.
  std::vector<double> rank0_values(std::vector<double> values);
  // Every rank's `own` numbers (float64), as rows in rank order, on every rank: through the rendezvous store (each
  // rank writes its row, counts itself in, waits for the last one's mark, reads every row: four round trips, keys
  // reused every other round), not a Gloo collective —
  // a few numbers a step cost a fraction of Gloo's latency (docs/distributed.md; the step's stop agreement,
  // Session::stop_agreed). Every rank calls it the same number of
  // times; the rows may differ in length.
  std::vector<std::vector<double>> rows_gather(const std::vector<double>& own);
  // Every rank gets `root`'s values, in place.
  void broadcast(std::vector<at::Tensor>& tensors, int root = 0);
  // Point to point through Gloo, blocking until done: `t` (a contiguous host tensor) goes to rank `dst`, or receives
  // rank `src`'s (of the same shape and type). Both sides name the same `tag` (≥ 0).
  void send(at::Tensor& t, int dst, int tag);
  void recv(at::Tensor& t, int src, int tag);
  void barrier();

 private:
  struct Group;
  DistOptions options_;
  std::unique_ptr<Group> group_;
};

}  // namespace triaccel
