#include "triaccel/core/dist.h"

#include "triaccel/core/errors.h"

// The wheel's libtorch is built with Gloo; its c10d header declares ProcessGroupGloo only under this macro.
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <limits>

namespace triaccel {
namespace {

// The variable's integer value, `fallback` when unset; UserError naming it when it is not an integer in [lo, hi].
int env_int(const char* name, int fallback, int lo, int hi) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  TRIACCEL_CHECK_INPUT(end != text && *end == '\0' && v >= lo && v <= hi, "environment variable ", name, "='", text,
                       "' is not an integer in [", lo, ", ", hi, "]; unset it or fix the launcher");
  return static_cast<int>(v);
}

}  // namespace

DistOptions dist_options_from_env() {
  DistOptions o;
  o.world_size = env_int("WORLD_SIZE", 1, 1, std::numeric_limits<int>::max());
  o.rank = env_int("RANK", 0, 0, o.world_size - 1);
  o.master_port = env_int("MASTER_PORT", o.master_port, 1, 65535);
  if (const char* addr = std::getenv("MASTER_ADDR"); addr != nullptr && *addr != '\0') o.master_addr = addr;
  return o;
}

struct Dist::Group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
};

Dist::Dist(const DistOptions& options) : options_(options) {
  TRIACCEL_CHECK_INPUT(options_.world_size >= 1 && options_.rank >= 0 && options_.rank < options_.world_size,
                       "rank ", options_.rank, " is outside a world of ", options_.world_size);
  if (!active()) return;
  group_ = std::make_unique<Group>();
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(options_.master_port);
    so.isServer = options_.rank == 0;
    so.numWorkers = options_.world_size;
    so.timeout = options_.timeout;
    group_->store = c10::make_intrusive<c10d::TCPStore>(options_.master_addr, so);
    auto go = c10d::ProcessGroupGloo::Options::create();
    go->timeout = options_.timeout;
    go->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(options_.master_addr));
    group_->gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(group_->store, options_.rank, options_.world_size, go);
  } catch (const c10::Error& e) {
    throw UserError(str_cat("rank ", options_.rank, " of ", options_.world_size, " could not join the group at ",
                            options_.master_addr, ":", options_.master_port, " (MASTER_ADDR, MASTER_PORT): ",
                            e.what_without_backtrace()));
  }
}

Dist::~Dist() = default;

// One collective per tensor (c10d's list form means one tensor per device, all of one size); buckets come with the
// gradient reduction that overlaps backward.
void Dist::all_reduce_sum(std::vector<at::Tensor>& tensors) {
  if (!active()) return;
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::SUM;
  o.timeout = options_.timeout;
  for (at::Tensor& t : tensors) {
    TORCH_CHECK(t.is_contiguous(), "Dist::all_reduce_sum: a non-contiguous tensor");
    std::vector<at::Tensor> one{t};
    group_->gloo->allreduce(one, o)->wait();
  }
}

void Dist::broadcast(std::vector<at::Tensor>& tensors, int root) {
  if (!active()) return;
  c10d::BroadcastOptions o;
  o.rootRank = root;
  o.timeout = options_.timeout;
  for (at::Tensor& t : tensors) {
    TORCH_CHECK(t.is_contiguous(), "Dist::broadcast: a non-contiguous tensor");
    std::vector<at::Tensor> one{t};
    group_->gloo->broadcast(one, o)->wait();
  }
}

void Dist::barrier() {
  if (active()) group_->gloo->barrier()->wait();
}

}  // namespace triaccel
