#include "triaccel/core/dist.h"

#include "triaccel/core/errors.h"
#include "triaccel/core/flat_view.h"

#include <ATen/ATen.h>

// The wheel's libtorch is built with Gloo; its c10d header declares ProcessGroupGloo only under this macro.
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef TRIACCEL_WITH_NCCL
// The wheel's libtorch_cuda carries ProcessGroupNCCL; its header needs this macro and NCCL's nccl.h (the
// nvidia-nccl wheel's, the version libtorch loads).
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cstdlib>
#include <exception>
#include <limits>
#include <random>

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
  o.local_rank = env_int("LOCAL_RANK", o.rank, 0, std::numeric_limits<int>::max());
  o.master_port = env_int("MASTER_PORT", o.master_port, 1, 65535);
  if (const char* addr = std::getenv("MASTER_ADDR"); addr != nullptr && *addr != '\0') o.master_addr = addr;
  const char* agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  o.rank0_serves_store = !(agent_store != nullptr && std::string(agent_store) == "True");
  o.restart = env_int("TORCHELASTIC_RESTART_COUNT", 0, 0, std::numeric_limits<int>::max());
  return o;
}

struct Dist::Group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Store> rows;  // rows_gather's keys under "rows/" (Dist::rows_gather)
  int64_t rows_round = 0;                // rows_gather's calls so far
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
  c10::intrusive_ptr<c10d::Backend> nccl;  // null: CUDA tensors through the host
};

bool Dist::nccl_built() {
#ifdef TRIACCEL_WITH_NCCL
  return true;
#else
  return false;
#endif
}

bool Dist::nccl() const { return group_ && group_->nccl; }

Dist::Dist(const DistOptions& options) : options_(options) {
  TRIACCEL_CHECK_INPUT(options_.world_size >= 1 && options_.rank >= 0 && options_.rank < options_.world_size,
                       "rank ", options_.rank, " is outside a world of ", options_.world_size);
  if (!active()) return;
  group_ = std::make_unique<Group>();
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(options_.master_port);
    so.isServer = options_.rank == 0 && options_.rank0_serves_store;
    so.numWorkers = options_.world_size;
    so.timeout = options_.timeout;
    group_->store = c10::make_intrusive<c10d::TCPStore>(options_.master_addr, so);
    if (!options_.rank0_serves_store) {
      // torchrun's agent keeps its store while it restarts the workers (--max-restarts): each attempt's keys (Gloo's,
      // NCCL's, rows_gather's) under a prefix of its own, as PyTorch's env:// rendezvous does, so that a restarted
      // group does not read the last attempt's.
      group_->store = c10::make_intrusive<c10d::PrefixStore>(str_cat("/worker/attempt_", options_.restart),
                                                             group_->store);
    }
    group_->rows = c10::make_intrusive<c10d::PrefixStore>("rows", group_->store);
    auto go = c10d::ProcessGroupGloo::Options::create();
    go->timeout = options_.timeout;
    go->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(options_.master_addr));
    group_->gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("gloo", group_->store), options_.rank, options_.world_size, go);
#ifdef TRIACCEL_WITH_NCCL
    if (options_.cuda_device >= 0) {
      auto no = c10d::ProcessGroupNCCL::Options::create();
      no->timeout = options_.timeout;
      group_->nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          c10::make_intrusive<c10d::PrefixStore>("nccl", group_->store), options_.rank, options_.world_size, no);
    }
#endif
  } catch (const c10::Error& e) {
    throw UserError(str_cat("rank ", options_.rank, " of ", options_.world_size, " could not join the group at ",
                            options_.master_addr, ":", options_.master_port, " (MASTER_ADDR, MASTER_PORT): ",
                            e.what_without_backtrace()));
  }
}

Dist::~Dist() {
  if (!group_ || !group_->nccl) return;
  // NCCL's communicators end explicitly (else c10d warns at exit): flushed on a normal end, aborted while an error
  // unwinds (a peer may be gone, and a flush would wait for it).
  try {
    if (std::uncaught_exceptions() > 0) {
      group_->nccl->abort();
    } else {
      group_->nccl->shutdown();
    }
  } catch (const std::exception&) {  // a destructor does not throw; the run's own error is already on its way
  }
}

namespace {

// A group that broke (a rank ended, the network failed), as one line naming this rank.
UserError group_lost(const DistOptions& o, const std::exception& e) {
  return UserError(str_cat("rank ", o.rank, " of ", o.world_size, " lost the data-parallel group (another rank ",
                           "ended, or the connection between them failed): ", error_one_line(e)));
}

// Waits for a collective (c10d::DistBackendError, or Gloo's own I/O exception, become group_lost).
void collective_wait(const DistOptions& o, const c10::intrusive_ptr<c10d::Work>& work) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    throw group_lost(o, e);
  }
}

// Starts a collective.
template <typename F>
c10::intrusive_ptr<c10d::Work> collective_start(const DistOptions& o, F&& start) {
  try {
    return start();
  } catch (const std::exception& e) {
    throw group_lost(o, e);
  }
}

template <typename F>
void run_collective(const DistOptions& o, F&& start) {
  collective_wait(o, collective_start(o, std::forward<F>(start)));
}

// Runs `collective` on `t`, through a host copy when `t` is on a GPU (the Gloo group reduces host memory).
template <typename F>
void on_host(at::Tensor& t, F&& collective) {
  if (!t.is_cuda()) {
    collective(t);
    return;
  }
  at::Tensor host = t.cpu();
  collective(host);
  t.copy_(host);
}

// Runs `collective(group, {t})` for each tensor t: on NCCL's group for a CUDA tensor where there is one, else on
// Gloo's, through a host copy for a CUDA tensor.
template <typename Group, typename F>
void each_tensor(const DistOptions& o, Group& group, std::vector<at::Tensor>& tensors, const char* what,
                 F&& collective) {
  for (at::Tensor& given : tensors) {
    // A dense tensor in another layout (a channels_last weight) as its storage's elements in memory order: every rank
    // holds the same layout, so element-wise collectives match element for element.
    at::Tensor t = given.is_contiguous() ? given : memory_flat(given, what);
    if (t.is_cuda() && group.nccl) {
      std::vector<at::Tensor> one{t};
      run_collective(o, [&] { return collective(*group.nccl, one); });
      continue;
    }
    on_host(t, [&](at::Tensor& h) {
      std::vector<at::Tensor> one{h};
      run_collective(o, [&] { return collective(*group.gloo, one); });
    });
  }
}

}  // namespace

// One collective per tensor (c10d's list form means one tensor per device, all of one size); buckets come with the
// gradient reduction that overlaps backward.
void Dist::all_reduce_sum(std::vector<at::Tensor>& tensors) {
  if (!active()) return;
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::SUM;
  o.timeout = options_.timeout;
  each_tensor(options_, *group_, tensors, "all_reduce_sum",
              [&](c10d::Backend& pg, std::vector<at::Tensor>& one) { return pg.allreduce(one, o); });
}

DistWork Dist::all_reduce_sum_start(const at::Tensor& t) {
  if (!active()) return DistWork();
  TORCH_CHECK(t.is_contiguous(), "Dist::all_reduce_sum_start: a non-contiguous tensor");
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::SUM;
  o.timeout = options_.timeout;
  const bool nccl = t.is_cuda() && group_->nccl;
  // c10d takes the tensors by reference; the list lives with the work until its wait.
  auto tensors = std::make_shared<std::vector<at::Tensor>>(1, nccl || !t.is_cuda() ? t : t.cpu());
  c10d::Backend& pg = nccl ? *group_->nccl : static_cast<c10d::Backend&>(*group_->gloo);
  const c10::intrusive_ptr<c10d::Work> work =
      collective_start(options_, [&] { return pg.allreduce(*tensors, o); });
  return DistWork([options = options_, work, tensors, t] {
    collective_wait(options, work);
    if (!(*tensors)[0].is_same(t)) t.copy_((*tensors)[0]);  // the host copy back to the GPU
  });
}

namespace {

// `op` over the ranks of host numbers (float64) through Gloo, in place; returns them.
std::vector<double> host_all_reduce(const DistOptions& options, c10d::ProcessGroupGloo& gloo,
                                    std::vector<double> values, c10d::ReduceOp::RedOpType op) {
  std::vector<at::Tensor> t{at::tensor(values, at::kDouble)};
  c10d::AllreduceOptions o;
  o.reduceOp = op;
  o.timeout = options.timeout;
  run_collective(options, [&] { return gloo.allreduce(t, o); });
  const double* p = t[0].data_ptr<double>();
  return std::vector<double>(p, p + values.size());
}

}  // namespace

std::vector<double> Dist::all_reduce_sum(std::vector<double> values) {
  if (!active() || values.empty()) return values;
  return host_all_reduce(options_, *group_->gloo, std::move(values), c10d::ReduceOp::SUM);
}

std::vector<double> Dist::all_reduce_max(std::vector<double> values) {
  if (!active() || values.empty()) return values;
  return host_all_reduce(options_, *group_->gloo, std::move(values), c10d::ReduceOp::MAX);
}

namespace {

// Whether `port` (0: the kernel's pick) binds on 127.0.0.1 now; the bound port in *bound.
bool port_binds(int port, int* bound) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  TRIACCEL_CHECK_INPUT(fd >= 0, "data parallel: cannot open a socket to pick a rendezvous port (", std::strerror(errno),
                       ")");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof(addr);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  close(fd);
  if (ok) *bound = ntohs(addr.sin_port);
  return ok;
}

}  // namespace

int free_local_port() {
  // Below Linux's ephemeral range (32768-60999): the kernel hands those to every outgoing connection and port-0
  // listener (Gloo's, NCCL's bootstrap), and one of them can take a port picked there between the pick and the
  // store's bind (which then fails with EADDRINUSE). A random port in 20000-32767 that binds now; the kernel's pick
  // after 64 taken ones.
  std::random_device seed;
  std::mt19937 draw(seed());
  std::uniform_int_distribution<int> in_range(20000, 32767);
  int bound = 0;
  for (int i = 0; i < 64; ++i) {
    if (port_binds(in_range(draw), &bound)) return bound;
  }
  TRIACCEL_CHECK_INPUT(port_binds(0, &bound), "data parallel: cannot bind a local rendezvous port (",
                       std::strerror(errno), ")");
  return bound;
}

std::vector<double> Dist::rank0_values(std::vector<double> values) {
  if (!active() || values.empty()) return values;
  if (rank() != 0) std::fill(values.begin(), values.end(), 0.0);
  return all_reduce_sum(std::move(values));
}

void Dist::broadcast(std::vector<at::Tensor>& tensors, int root) {
  if (!active()) return;
  c10d::BroadcastOptions o;
  o.rootRank = root;
  o.timeout = options_.timeout;
  each_tensor(options_, *group_, tensors, "broadcast",
              [&](c10d::Backend& pg, std::vector<at::Tensor>& one) { return pg.broadcast(one, o); });
}

void Dist::send(at::Tensor& t, int dst, int tag) {
  TORCH_CHECK(!t.is_cuda() && t.is_contiguous(), "Dist::send: the tensor must be a contiguous host tensor");
  if (!active()) return;
  std::vector<at::Tensor> one{t};
  run_collective(options_, [&] { return group_->gloo->send(one, dst, tag); });
}

void Dist::recv(at::Tensor& t, int src, int tag) {
  TORCH_CHECK(!t.is_cuda() && t.is_contiguous(), "Dist::recv: the tensor must be a contiguous host tensor");
  if (!active()) return;
  std::vector<at::Tensor> one{t};
  run_collective(options_, [&] { return group_->gloo->recv(one, src, tag); });
}

// Keys: each round's rows at "<round % 2>/<rank>", one count of arrivals over all rounds ("in"), and each round's
// mark at "all<round % 2>". A round's keys are reused two rounds later: no rank writes round r + 2's row before
// every rank came into round r + 1, so after every rank read round r's rows. The last rank in removes the round
// before's mark before it sets this one's, and no rank waits on a mark before that: the store stays at 2 × world + 2
// keys and a rank makes four round trips (set, add, wait, get), the last one in five.
std::vector<std::vector<double>> Dist::rows_gather(const std::vector<double>& own) {
  if (!active()) return {own};
  c10d::Store& store = *group_->rows;
  const int64_t round = group_->rows_round++;
  const int64_t parity = round % 2;
  std::vector<std::string> row_keys;
  for (int r = 0; r < world_size(); ++r) row_keys.push_back(str_cat(parity, "/", r));
  std::vector<std::vector<uint8_t>> bytes;
  try {
    std::vector<uint8_t> mine(own.size() * sizeof(double));
    if (!own.empty()) std::memcpy(mine.data(), own.data(), mine.size());
    store.set(row_keys[static_cast<size_t>(rank())], mine);
    const std::string mark = str_cat("all", parity);
    if (store.add("in", 1) == static_cast<int64_t>(world_size()) * (round + 1)) {
      if (round > 0) store.deleteKey(str_cat("all", 1 - parity));
      store.set(mark, std::vector<uint8_t>{1});
    } else {
      store.wait({mark});
    }
    bytes = store.multiGet(row_keys);
  } catch (const std::exception& e) {
    throw group_lost(options_, e);
  }
  std::vector<std::vector<double>> rows(bytes.size());
  for (size_t r = 0; r < bytes.size(); ++r) {
    rows[r].resize(bytes[r].size() / sizeof(double));
    if (!rows[r].empty()) std::memcpy(rows[r].data(), bytes[r].data(), rows[r].size() * sizeof(double));
  }
  return rows;
}

void Dist::barrier() {
  if (active()) run_collective(options_, [&] { return group_->gloo->barrier(); });
}

}  // namespace triaccel
