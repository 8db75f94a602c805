// Data parallelism's seam (../DESIGN "Scale-out", docs/architecture.md): a c10d process group over a TCPStore
// rendezvous, from a torchrun-style environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or given explicitly.
// With one process (WORLD_SIZE unset or 1) nothing is created and every collective is a no-op.
// Backend: c10d's ProcessGroupGloo, on CPU tensors (the pip wheel's libtorch carries Gloo; its headers come from
// Debian's libgloo-dev). NCCL for CUDA tensors is not wired yet.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace triaccel {

struct DistOptions {
  int rank = 0;
  int world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // rendezvous and each collective
};

// The ranks a launcher put in the environment (torchrun's variables). world_size 1 when WORLD_SIZE is unset.
// UserError naming the variable when one is malformed or out of range (RANK outside [0, WORLD_SIZE)).
DistOptions dist_options_from_env();

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

  // Sums `tensors` (CPU) over the ranks, in place on every rank.
  void all_reduce_sum(std::vector<at::Tensor>& tensors);
  // Every rank gets `root`'s values, in place.
  void broadcast(std::vector<at::Tensor>& tensors, int root = 0);
  void barrier();

 private:
  struct Group;
  DistOptions options_;
  std::unique_ptr<Group> group_;
};

}  // namespace triaccel
