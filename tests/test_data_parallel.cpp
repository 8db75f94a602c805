// Data parallelism on the CPU (docs/distributed.md): two ranks (threads of this process, each its own Session over
// one Gloo group) train a BatchNorm-free model to the weights one process trains at the same global batch, each
// sample once per epoch across the ranks, with only rank 0 writing; a run stopped on two ranks resumes in one
// process; the options data parallelism does not support yet are refused, naming them.
#include "test_util.h"
#include "triaccel/core/clock.h"
#include "triaccel/core/dist.h"
#include "triaccel/core/events.h"
#include "triaccel/models/model.h"
#include "triaccel/models/registry.h"
#include "triaccel/train/checkpoint.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#ifdef TRIACCEL_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <memory>
#include <thread>
#include <tuple>
#include <utility>

namespace triaccel {
namespace {

// "dp-mlp": flatten → Linear(784, 32) → ReLU → Linear(32, classes); no BatchNorm (its per-rank batch statistics
// would make the ranks' updates differ from one process's by design, as in PyTorch's DDP).
class DpMlp final : public Model {
 public:
  explicit DpMlp(const ModelOptions& options) : Model("dp-mlp") {
    const int64_t in = options.in_channels * options.image_size * options.image_size;
    auto fc1 = register_module("fc1", torch::nn::Linear(in, 32));
    auto fc2 = register_module("fc2", torch::nn::Linear(32, options.num_classes));
    unit_add("fc1", {fc1}, [fc1](const at::Tensor& x) { return torch::relu(fc1->forward(x.flatten(1))); });
    unit_add("fc2", {fc2}, [fc2](const at::Tensor& x) { return fc2->forward(x); });
  }
};

// Set on a rank's thread: the next training forward of dp-mlp-local's first unit runs out of memory in its backward.
thread_local bool dp_mlp_oom_in_next_backward = false;
// Set on a rank's thread: the next forward of dp-mlp-local's first unit without gradients (an evaluation) runs out of
// memory.
thread_local bool dp_mlp_oom_in_next_eval = false;

// "dp-mlp-local": flatten → Linear(784, 32) → ReLU → Linear(32, 32) → ReLU → Linear(32, classes) in three units, for
// NeuroFlux (local learning): flat unit outputs get aux heads of one Linear each, so nothing has BatchNorm.
// "dp-mlp-buffer": the same with a buffer (ones, multiplying the input), so that an evaluation's broadcast of rank 0's
// buffers sends something.
class DpMlpLocal final : public Model {
 public:
  DpMlpLocal(const ModelOptions& options, bool with_buffer) : Model(with_buffer ? "dp-mlp-buffer" : "dp-mlp-local") {
    const int64_t in = options.in_channels * options.image_size * options.image_size;
    auto fc1 = register_module("fc1", torch::nn::Linear(in, 32));
    auto fc2 = register_module("fc2", torch::nn::Linear(32, 32));
    auto fc3 = register_module("fc3", torch::nn::Linear(32, options.num_classes));
    const at::Tensor ones = with_buffer ? register_buffer("ones", torch::ones({1})) : at::Tensor();
    unit_add("fc1", {fc1}, [fc1, ones](const at::Tensor& x) {
      const bool eval_oom = !at::GradMode::is_enabled() && std::exchange(dp_mlp_oom_in_next_eval, false);
      TORCH_CHECK_WITH(OutOfMemoryError, !eval_oom, "injected by the test in evaluation");
      at::Tensor h = torch::relu(fc1->forward(ones.defined() ? x.flatten(1) * ones : x.flatten(1)));
      if (h.requires_grad() && std::exchange(dp_mlp_oom_in_next_backward, false)) {
        h.register_hook([](const at::Tensor& g) {
          TORCH_CHECK_WITH(OutOfMemoryError, false, "injected by the test in backward");
          return g;
        });
      }
      return h;
    });
    unit_add("fc2", {fc2}, [fc2](const at::Tensor& x) { return torch::relu(fc2->forward(x)); });
    unit_add("fc3", {fc3}, [fc3](const at::Tensor& x) { return fc3->forward(x); });
  }
};

void dp_mlp_register() {
  static const bool once = [] {
    model_register({"dp-mlp", "a BatchNorm-free MLP (tests of data parallelism)", ModelInput::kImage,
                    /*double_backward=*/true, /*local_learning=*/false,
                    [](const ModelOptions& o) -> std::shared_ptr<Model> { return std::make_shared<DpMlp>(o); }});
    model_register({"dp-mlp-local", "a BatchNorm-free MLP in three units (tests of data parallel NeuroFlux)",
                    ModelInput::kImage, /*double_backward=*/true, /*local_learning=*/true,
                    [](const ModelOptions& o) -> std::shared_ptr<Model> {
                      return std::make_shared<DpMlpLocal>(o, /*with_buffer=*/false);
                    }});
    model_register({"dp-mlp-buffer", "dp-mlp-local with a buffer (tests of data parallel evaluation)",
                    ModelInput::kImage, /*double_backward=*/true, /*local_learning=*/true,
                    [](const ModelOptions& o) -> std::shared_ptr<Model> {
                      return std::make_shared<DpMlpLocal>(o, /*with_buffer=*/true);
                    }});
    return true;
  }();
  (void)once;
}

class DataParallelTest : public test::TinyMnistTest {
 protected:
  void SetUp() override { dp_mlp_register(); }

  // 384 training samples at a global batch of 51: 7 batches of 51 (ranks 25 + 26) and one of 27 (13 + 14), so the
  // ranks' shares differ and the gradient weighting matters.
  static Config mlp_options(const std::string& out) {
    Config c = options(out);
    c.set("model", "dp-mlp");
    c.set("batch_size", "51");
    c.set("momentum", "0.9");
    return c;
  }

  static RunHooks one_process() {
    RunHooks h;
    h.dist = DistOptions{};
    return h;
  }

  // Runs `configs[r]` on rank r of a world of configs.size() ranks (threads); returns each rank's result.
  // `customize` may change a rank's hooks; with `errors_out` each rank's error ("" for none) is returned there
  // instead of being expected empty.
  static std::vector<Json> run_ranks(const std::vector<Config>& configs, std::vector<Spans>* spans = nullptr,
                                     const std::function<void(int, RunHooks&)>& customize = nullptr,
                                     std::vector<std::string>* errors_out = nullptr) {
    const int world = static_cast<int>(configs.size());
    const int port = free_local_port();  // a port picked from this process's id once collided (a store timed out)
    std::vector<Json> results(configs.size());
    std::vector<std::string> errors(configs.size());
    std::vector<std::thread> threads;
    if (spans) spans->assign(configs.size(), Spans(2));
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        RunHooks hooks;
        DistOptions d;
        d.rank = r;
        d.local_rank = r;  // its own GPU where there are several
        d.world_size = world;
        d.master_port = port;
        d.timeout = std::chrono::seconds(60);  // a broken group fails a test in a minute, not five
        hooks.dist = d;
        if (spans) record_batches(hooks, (*spans)[static_cast<size_t>(r)]);
        if (customize) customize(r, hooks);
        try {
          results[static_cast<size_t>(r)] = api::run(configs[static_cast<size_t>(r)], hooks);
        } catch (const std::exception& e) {
          errors[static_cast<size_t>(r)] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    if (errors_out) {
      *errors_out = errors;
    } else {
      for (int r = 0; r < world; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
    }
    return results;
  }

  // The largest |a - b| / (|a| + 1e-3) over every tensor of two model.pt files with the same names.
  static double worst_difference(const std::string& a, const std::string& b) {
    const auto wa = test::state_dict_read(a);
    const auto wb = test::state_dict_read(b);
    EXPECT_EQ(wa.size(), wb.size());
    double worst = 0;
    for (const auto& [name, t] : wa) {
      if (!wb.count(name)) {
        ADD_FAILURE() << name << " missing";
        continue;
      }
      const at::Tensor d = (t - wb.at(name)).abs() / (t.abs() + 1e-3);
      worst = std::max(worst, d.max().item<double>());
    }
    return worst;
  }

  // The events of one name in a run's events.jsonl, in order.
  static std::vector<Json> events_named(const std::string& events, const std::string& name) {
    std::vector<Json> out;
    for (const auto& e : events_read(events)) {
      if (e["event"] == name) out.push_back(e);
    }
    return out;
  }

  // The two-GPU tests' runs: on the GPU, steps eager (ranks in threads cannot capture side by side; see below).
  static Config on_gpu(Config c) {
    c.set("device", "cuda");
    c.set("cuda_graphs", "false");
    return c;
  }

  // NeuroFlux on a GPU with its block steps captured, for TwoGpusRetryAnOutOfMemoryBesideOneRanksGraphAsOneGpu.
  static Config neuroflux_oom_on_gpu(const std::string& out) {
    Config c = mlp_options(out);
    c.set("model", "dp-mlp-local");
    c.set("device", "cuda");
    c.set("method", "neuroflux");
    c.set("vram_budget", "1GB");  // as in TwoGpusTrainNeuroFluxsBlocksAsOneGpu
    c.set("nf_profile", "model");
    c.set("nf_exit_tolerance", "100");
    c.set("nf_max_batch", "51");  // 8 steps an epoch (the plan's batch would take the data in one)
    return c;
  }

  // A before_step hook that runs out of memory once, the first time step `at` is about to run.
  static std::function<void(int64_t, int64_t)> oom_once_at(int64_t at) {
    return [at, once = std::make_shared<bool>(true)](int64_t step, int64_t) {
      TORCH_CHECK_WITH(OutOfMemoryError, !(step == at && std::exchange(*once, false)), "injected by the test");
    };
  }

  static void inject_oom_at_step_6(RunHooks& hooks) {  // block 0's seventh step: its graph is captured at the fourth
    hooks.before_step = oom_once_at(6);
  }

  // Backprop on a GPU with its steps captured (each rank its share of the batch of 51), for
  // TwoGpusRetryABackpropOutOfMemoryBesideOneRanksGraphAsOneGpu.
  static Config backprop_oom_on_gpu(const std::string& out) {
    Config c = mlp_options(out);
    c.set("device", "cuda");
    return c;
  }

  // Runs the test `inner` (this binary again, that test alone) as ranks 0 and 1 of two, each a process on its own GPU,
  // with the environment torchrun gives and TRIACCEL_TEST_OUT=out; expects both to exit 0. Two GPUs capturing NCCL's
  // collectives in one process can deadlock.
  static void run_two_gpu_processes(const std::string& inner, const test::TempDir& out) {
    char self[4096] = {};
    ASSERT_GT(readlink("/proc/self/exe", self, sizeof(self) - 1), 0);
    const int port = free_local_port();
    std::string command;
    for (int r = 0; r < 2; ++r) {
      command += c10::str("(TRIACCEL_TEST_FRESH_PROCESS=1 TRIACCEL_TEST_OUT='", out.path(), "' RANK=", r,
                          " LOCAL_RANK=", r, " WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=", port, " timeout 120 '",
                          self, "' --gtest_filter=DataParallelTest.", inner, " > '",
                          out.file(c10::str("rank", r, ".log")), "' 2>&1; echo $? > '",
                          out.file(c10::str("rank", r, ".rc")), "') & ");
    }
    ASSERT_EQ(std::system((command + "wait").c_str()), 0);  // each rank's status in its .rc file
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(file_read_all(out.file(c10::str("rank", r, ".rc"))), "0\n")
          << file_read_all(out.file(c10::str("rank", r, ".log")));
    }
  }

  // The output folder of a rank run by run_two_gpu_processes; null (the test skips) outside it.
  static const char* two_gpu_process_out() {
    return std::getenv("TRIACCEL_TEST_FRESH_PROCESS") == nullptr ? nullptr : std::getenv("TRIACCEL_TEST_OUT");
  }
};

// Every rank starts from rank 0's state of the modules it is given (the Session's model, NeuroFlux's heads):
// parameters and buffers that differ on the two ranks before are rank 0's on both after. The trained-weights tests
// cannot tell (ranks as threads build the same weights from the same seed), so this one sets them apart first.
TEST(ModuleStateBroadcastTest, EveryRankTakesRankZerosParametersAndBuffers) {
  std::vector<std::vector<at::Tensor>> got(2);
  const auto errors = test::on_two_ranks(free_local_port(), [&](int r, Dist& dist) {
    torch::nn::Linear lin(3, 2);
    torch::nn::BatchNorm1d bn(2);
    {
      const torch::NoGradGuard no_grad;
      lin->weight.fill_(r + 1.0);
      lin->bias.fill_(10.0 * r);
      bn->running_mean.fill_(5.0 * r + 1.0);
    }
    module_state_broadcast(dist, {lin.get(), bn.get()});
    got[r] = {lin->weight, lin->bias, bn->running_mean};
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(errors[r].empty()) << "rank " << r << ": " << errors[r];
    EXPECT_TRUE(torch::equal(got[r][0], torch::ones({2, 3}))) << r;
    EXPECT_TRUE(torch::equal(got[r][1], torch::zeros({2}))) << r;
    EXPECT_TRUE(torch::equal(got[r][2], torch::ones({2}))) << r;
  }
}

TEST_F(DataParallelTest, TwoRanksTrainTheWeightsOfOneProcess) {
  test::TempDir one("dp_one"), two("dp_two");
  api::run(mlp_options(one.path()), one_process());
  std::vector<Spans> spans;
  const std::vector<Json> results = run_ranks({mlp_options(two.path()), mlp_options(two.path())}, &spans);

  // Same weights to fp32 tolerance (the sums run in another order); an unreduced or unweighted gradient is off by
  // orders of magnitude more.
  EXPECT_LT(worst_difference(one.file("model.pt"), two.file("model.pt")), 1e-3);
  const auto e1 = events_named(one.file("events.jsonl"), "epoch");
  const auto e2 = events_named(two.file("events.jsonl"), "epoch");
  ASSERT_EQ(e1.size(), 2u);
  ASSERT_EQ(e2.size(), 2u);  // rank 1 wrote no events of its own into the shared folder
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_NEAR(e1[i]["train_loss"].get<double>(), e2[i]["train_loss"].get<double>(), 1e-4);
    EXPECT_NEAR(e1[i]["test_loss"].get<double>(), e2[i]["test_loss"].get<double>(), 1e-4);
    EXPECT_EQ(e2[i]["samples"], 384);
    EXPECT_EQ(e2[i]["world_size"], 2);
  }
  EXPECT_EQ(results[0]["steps"], 16);
  EXPECT_EQ(results[1]["steps"], 16);
  ASSERT_TRUE(e2[1]["rank_peak_vram_gb"].is_array());
  EXPECT_EQ(e2[1]["rank_peak_vram_gb"].size(), 2u);
  ASSERT_TRUE(e2[1]["rank_comm_s"].is_array());  // Gloo: host time, each rank's own
  EXPECT_GT(e2[1]["rank_comm_s"][1].get<double>(), 0.0);
  EXPECT_TRUE(e1[1]["rank_comm_s"].is_null());

  // Each rank trained its half of every batch; together every sample once per epoch, none twice.
  for (size_t epoch = 0; epoch < 2; ++epoch) {
    std::vector<std::pair<int64_t, int64_t>> both;
    for (const Spans& s : spans) both.insert(both.end(), s[epoch].begin(), s[epoch].end());
    std::sort(both.begin(), both.end());
    expect_every_sample_once(Spans{both}, 384);
    ASSERT_EQ(spans[0][epoch].size(), 8u);
    EXPECT_EQ(spans[0][epoch][0], std::make_pair(int64_t{0}, int64_t{25}));
    EXPECT_EQ(spans[1][epoch][0], std::make_pair(int64_t{25}, int64_t{26}));
    EXPECT_EQ(spans[1][epoch][7], std::make_pair(int64_t{357 + 13}, int64_t{14}));
  }
}

// Micro-batches and recomputed units on each rank: a rank's micro-batches accumulate before the one reduction, so
// the weights are still one process's (which runs the whole batch at once).
TEST_F(DataParallelTest, MicroBatchesAndRecomputeOnEachRankKeepTheWeights) {
  test::TempDir one("dp_mb_one"), two("dp_mb_two");
  api::run(mlp_options(one.path()), one_process());
  Config c = mlp_options(two.path());
  c.set("micro_batch", "8");
  c.set("recompute", "fc1");
  run_ranks({c, c});
  EXPECT_LT(worst_difference(one.file("model.pt"), two.file("model.pt")), 1e-3);
}

// The gradient buckets (train/grad_buckets.h): at 0.05 MiB the MLP's gradients make two buckets (fc1's 100 kB weight
// alone, the rest), the first started while backward runs, here with micro-batches and a recomputed unit too; at 0 one
// collective after backward. Both train one process's weights (the default, 25 MiB, is the test above).
TEST_F(DataParallelTest, SmallBucketsAndOneCollectiveAfterBackwardKeepTheWeights) {
  test::TempDir one("dp_bk_one"), small("dp_bk_small"), after("dp_bk_after");
  api::run(mlp_options(one.path()), one_process());
  Config c = mlp_options(small.path());
  c.set("grad_bucket_mb", "0.05");
  c.set("micro_batch", "8");
  c.set("recompute", "fc2");
  run_ranks({c, c});
  EXPECT_LT(worst_difference(one.file("model.pt"), small.file("model.pt")), 1e-3);
  Config d = mlp_options(after.path());
  d.set("grad_bucket_mb", "0");
  run_ranks({d, d});
  EXPECT_LT(worst_difference(one.file("model.pt"), after.file("model.pt")), 1e-3);
}

// A batch of 383 leaves the epoch's last batch one sample: rank 0 has none, runs no backward and starts both buckets
// after it (zeros, weight 0), while rank 1 starts its first bucket from a hook during backward. The collectives still
// match in order, and the weights are one process's.
TEST_F(DataParallelTest, ARankWithoutSamplesSendsZerosInTheSameOrder) {
  test::TempDir one("dp_empty_one"), two("dp_empty_two");
  Config c1 = mlp_options(one.path());
  c1.set("batch_size", "383");
  api::run(c1, one_process());
  Config c = mlp_options(two.path());
  c.set("batch_size", "383");
  c.set("grad_bucket_mb", "0.05");
  std::vector<Spans> spans;
  run_ranks({c, c}, &spans);
  EXPECT_LT(worst_difference(one.file("model.pt"), two.file("model.pt")), 1e-3);
  ASSERT_EQ(spans[1][0].size(), 2u);
  EXPECT_EQ(spans[1][0][1], std::make_pair(int64_t{383}, int64_t{1}));  // rank 1 trained the last sample
  EXPECT_EQ(spans[0][0].size(), 2u);
  EXPECT_EQ(spans[0][0][1].second, 0);  // rank 0's share of it: none
}

// Gradients crossing the ranks in bf16 (grad_compression): the test loss stays at one process's, but the weights are
// not the fp32 reduction's (within 1e-3 of one process, 2e-5 measured): the compression happened.
TEST_F(DataParallelTest, Bf16CompressedGradientsStayNearOneProcess) {
  test::TempDir one("dp_bf16_one"), two("dp_bf16_two");
  api::run(mlp_options(one.path()), one_process());
  Config c = mlp_options(two.path());
  c.set("grad_compression", "bf16");
  run_ranks({c, c});
  const double worst = worst_difference(one.file("model.pt"), two.file("model.pt"));
  EXPECT_GT(worst, 1e-3);  // 0.12 measured (a weight near 0 moves relatively most)
  const auto e1 = events_named(one.file("events.jsonl"), "epoch");
  const auto e2 = events_named(two.file("events.jsonl"), "epoch");
  ASSERT_EQ(e2.size(), 2u);
  EXPECT_NEAR(e2[1]["test_loss"].get<double>(), e1[1]["test_loss"].get<double>(), 2e-3);  // 2e-4 measured
}

// --sync-bn: BatchNorm normalizes with the global batch's statistics (the ranks' shares are 25 and 26, so the
// gradient weights enter its backward), so two ranks train the weights and running statistics of one process, which
// sees the whole batch at once, to fp32 tolerance; with each rank's own statistics (the default) they do not.
TEST_F(DataParallelTest, SyncBatchNormTrainsTheWeightsOfOneProcess) {
  test::TempDir one("dp_sbn_one"), two("dp_sbn_two"), own("dp_sbn_own");
  const auto cnn = [](const std::string& out) {
    Config c = mlp_options(out);
    c.set("model", "small-cnn");
    return c;
  };
  api::run(cnn(one.path()), one_process());
  Config c = cnn(two.path());
  c.set("sync_bn", "true");
  run_ranks({c, c});
  run_ranks({cnn(own.path()), cnn(own.path())});
  EXPECT_LT(worst_difference(one.file("model.pt"), two.file("model.pt")), 1e-3);
  EXPECT_GT(worst_difference(one.file("model.pt"), own.file("model.pt")), 1e-2);

  // A last batch of one sample would leave rank 1 with nothing to synchronize: refused before training, by name.
  c.set("batch_size", "383");
  std::vector<std::string> errors;
  run_ranks({c, c}, nullptr, nullptr, &errors);
  for (const std::string& e : errors) EXPECT_NE(e.find("sync_bn: the last batch of each epoch holds 1 samples"), std::string::npos) << e;
}

// BAOC on two ranks: its statistics come from the reduced gradient and its plan from them and from tables (no clock,
// no allocator reading), so both ranks make the plans one process makes (plans at steps 2, 5, 8, 11, 14; the same
// per-unit formats, the same state bytes on each rank) and train its weights to fp32 tolerance.
// BAOC on two ranks plans from the reduced gradient as one process does: the same formats at the same steps, and
// one process's weights. With its state sharded (ZeRO-1, shard_optimizer on) each rank holds the moments and the
// statistics of its own tensors (fc1's weight on rank 0; its bias and fc2 on rank 1, so unit fc1 spans both ranks)
// and the plans read their sums over the ranks: still one process's plans and weights, and each rank reports its own
// share of the state. A run stopped on two sharded ranks inside a statistics window resumes in one process to the
// same weights and plans: the checkpoint holds every rank's sums and previous gradients.
TEST_F(DataParallelTest, BaocOnTwoRanksMakesTheOneProcessPlans) {
  test::TempDir one("dp_baoc_one"), two("dp_baoc_two"), zero("dp_baoc_zero"), stop("dp_baoc_stop");
  const auto configure = [](Config c) {
    c = with_optimizer(std::move(c), "baoc");
    c.set("optim_formats", "adamw-fp32,adamw-8bit,sgd-momentum,sgd");  // the SGD formats' scales are in play
    return c;
  };
  const Json reference = api::run(configure(mlp_options(one.path())), one_process());
  const Config c = configure(mlp_options(two.path()));
  const std::vector<Json> results = run_ranks({c, c});
  Config sharded = configure(mlp_options(zero.path()));
  sharded.set("shard_optimizer", "on");
  const std::vector<Json> sharded_results = run_ranks({sharded, sharded});
  const auto plans = [](const std::string& events) { return events_named(events, event::kOptimPlan); };
  const auto p1 = plans(one.file("events.jsonl"));
  ASSERT_EQ(p1.size(), 5u);
  bool formats_differ = false;  // the budget binds: not every unit keeps fp32 AdamW
  for (const std::string& dir : {two.path(), zero.path()}) {
    const auto p2 = plans(dir + "/events.jsonl");
    ASSERT_EQ(p2.size(), p1.size()) << dir;
    for (size_t i = 0; i < p1.size(); ++i) {
      EXPECT_EQ(p1[i]["step"], p2[i]["step"]) << "plan " << i;
      ASSERT_EQ(p1[i]["units"].size(), p2[i]["units"].size()) << "plan " << i;
      for (size_t u = 0; u < p1[i]["units"].size(); ++u) {  // the signals agree to fp32 rounding, the choices exactly
        const Json &a = p1[i]["units"][u], &b = p2[i]["units"][u];
        EXPECT_EQ(a["unit"], b["unit"]);
        EXPECT_EQ(a["format"], b["format"]) << dir << ", plan " << i << ", " << a["unit"];
        EXPECT_EQ(a["bytes"], b["bytes"]) << dir << ", plan " << i << ", " << a["unit"];
        EXPECT_NEAR(a["risk"].get<double>(), b["risk"].get<double>(), 1e-6) << dir << ", plan " << i << ", "
                                                                           << a["unit"];
      }
      const std::string units = p1[i]["units"].dump();
      formats_differ = formats_differ || units.find("adamw-fp32") == std::string::npos ||
                       units.find("\"sgd") != std::string::npos || units.find("adamw-8bit") != std::string::npos ||
                       units.find("adamw-bf16") != std::string::npos || units.find("factored") != std::string::npos ||
                       units.find("no-momentum") != std::string::npos;
    }
  }
  EXPECT_TRUE(formats_differ) << p1[0]["units"].dump();
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0]["optimizer"], "baoc");
  EXPECT_EQ(results[0]["optim_state_bytes"], results[1]["optim_state_bytes"]);
  const double worst = worst_difference(one.file("model.pt"), two.file("model.pt"));
  std::printf("[ baoc ] two ranks against one process: worst relative weight difference %.3g\n", worst);
  EXPECT_LT(worst, 1e-3);  // 2.8e-6 measured
  const double worst_sharded = worst_difference(one.file("model.pt"), zero.file("model.pt"));
  std::printf("[ baoc ] two sharded ranks against one process: worst relative weight difference %.3g\n",
              worst_sharded);
  EXPECT_LT(worst_sharded, 1e-3);
  EXPECT_EQ(sharded_results[0]["optim_state_sharded"], true);
  const int64_t whole = reference["optim_state_bytes"].get<int64_t>();
  const int64_t r0 = sharded_results[0]["optim_state_bytes"].get<int64_t>();
  const int64_t r1 = sharded_results[1]["optim_state_bytes"].get<int64_t>();
  EXPECT_EQ(r0 + r1, whole);  // the final formats' bytes, split by owner (fc1's weight ends in plain SGD: 0 bytes)
  EXPECT_GT(r1, 0);
  // Rank 0's checkpoint holds every tensor's SGD scale (each computed by its owner at a conversion).
  const auto sgd_scales = [](const std::string& file) {
    for (const auto& [name, t] : checkpoint_read(file).optimizer) {
      if (name == "baoc.sgd_scales") return t;
    }
    ADD_FAILURE() << "no baoc.sgd_scales in " << file;
    return at::Tensor();
  };
  const at::Tensor s1 = sgd_scales(one.file("checkpoint.pt")), sz = sgd_scales(zero.file("checkpoint.pt"));
  ASSERT_TRUE(s1.defined() && sz.defined());
  EXPECT_TRUE(at::allclose(s1, sz, 1e-4)) << s1 << sz;
  EXPECT_TRUE((s1 != 1).any().item<bool>()) << s1;  // some tensor runs an SGD format

  // A stop inside a statistics window: a warm-up of 4 steps (its window steps 1-4) stopped after step 3 on two sharded
  // ranks. The plan at step 4 reads the window's sums and previous gradients from the checkpoint (every rank's).
  test::TempDir long_one("dp_baoc_long_one");
  const auto long_window = [&](const std::string& out) {
    Config l = configure(mlp_options(out));
    l.set("plan_warmup", "4");
    l.set("replan_every", "4");
    return l;
  };
  api::run(long_window(long_one.path()), one_process());
  Config first = long_window(stop.path());
  first.set("shard_optimizer", "on");
  first.set("max_steps", "3");
  run_ranks({first, first});
  Config again = long_window(stop.path());
  again.set("resume", stop.path());
  const Json resumed = api::run(again, one_process());
  EXPECT_EQ(resumed["steps"], 16);
  EXPECT_LT(worst_difference(long_one.file("model.pt"), stop.file("model.pt")), 1e-3);
  const auto pl = plans(long_one.file("events.jsonl"));
  const auto p3 = plans(stop.file("events.jsonl"));
  ASSERT_EQ(pl.size(), 4u);
  ASSERT_EQ(p3.size(), pl.size());
  for (size_t i = 0; i < pl.size(); ++i) {
    EXPECT_EQ(p3[i]["step"], pl[i]["step"]) << "plan " << i;
    ASSERT_EQ(p3[i]["units"].size(), pl[i]["units"].size()) << "plan " << i;
    for (size_t u = 0; u < pl[i]["units"].size(); ++u) {
      const Json &a = pl[i]["units"][u], &b = p3[i]["units"][u];
      EXPECT_EQ(a["format"], b["format"]) << "resumed, plan " << i << ", " << a["unit"];
      EXPECT_NEAR(a["risk"].get<double>(), b["risk"].get<double>(), 1e-6) << "resumed, plan " << i << ", " << a["unit"];
    }
  }
}

// Tri-Accel on two ranks: the precision policy reads the reduced gradient's statistics, the same on every rank; the
// curvature schedule reads each rank's clock, and the probe's results its own timing, so rank 0's choice of units
// and its eigenvalues are taken by every rank. Here the ranks' measurements disagree as much as they can: rank 0
// grants probes 1 % of its training time, rank 1 all of it (a clock that ran fast in training and slow in probes).
// Left to itself rank 1 would probe at other steps and scale its learning rates differently; both ranks end with the
// same weights bit for bit. With the fixed schedule (curv_budget 0) the two ranks decide as one process does.
TEST_F(DataParallelTest, TriAccelOnTwoRanksDecidesAsOne) {
  const auto configure = [](Config c, const std::string& budget) { return with_tri_accel(std::move(c), budget); };
  const auto weights_of = [](const std::shared_ptr<Model>& m) {
    std::vector<at::Tensor> w;
    for (const auto& p : m->parameters()) w.push_back(p.detach().clone());
    return w;
  };
  {
    test::TempDir two("dp_tri_clock");
    const FixedStepClock clock0(1e-3), clock1(1e-3);
    std::vector<std::shared_ptr<Model>> models(2);
    run_ranks({configure(mlp_options(two.path()), "0.01"), configure(mlp_options(two.path()), "1")}, nullptr,
              [&](int r, RunHooks& h) {
      h.clock = r == 0 ? &clock0 : &clock1;
      h.model = [&models, r](const ModelOptions& o) -> std::shared_ptr<Model> {
        models[static_cast<size_t>(r)] = std::make_shared<DpMlp>(o);
        return models[static_cast<size_t>(r)];
      };
    });
    ASSERT_TRUE(models[0] && models[1]);
    const auto w0 = weights_of(models[0]), w1 = weights_of(models[1]);
    for (size_t i = 0; i < w0.size(); ++i) EXPECT_TRUE(at::equal(w0[i], w1[i])) << "parameter " << i;
    int probes = 0;
    for (const auto& e : events_read(two.file("events.jsonl"))) probes += e["event"] == "curvature" ? 1 : 0;
    EXPECT_GT(probes, 0);
  }
  // Against one process, with the paper's lr scales: at mean 1 (the default, which the ranks above ran) flat units'
  // rates rise above the schedule's and the rounding differences below grew past 5 % of λ by the third probe.
  test::TempDir one("dp_tri_one"), two("dp_tri_two");
  const auto papers = [&](const std::string& out) {
    Config c = configure(mlp_options(out), "0");
    c.set("curv_lr_mean", "false");
    return c;
  };
  api::run(papers(one.path()), one_process());
  const Config c = papers(two.path());
  run_ranks({c, c});
  // The units run bf16 (on the CPU, fp16 decisions too): a rank's gradient of 25 samples and one process's of 51
  // round differently, so the weights are near, not equal (a weight near 0 moves relatively most); the test loss
  // and every decision are one process's.
  const auto e1 = events_named(one.file("events.jsonl"), "epoch");
  const auto e2 = events_named(two.file("events.jsonl"), "epoch");
  ASSERT_EQ(e2.size(), 2u);
  EXPECT_NEAR(e2[1]["test_loss"].get<double>(), e1[1]["test_loss"].get<double>(), 1e-2);
  const auto decisions = [](const std::string& events, const char* kind, const char* field) {
    std::vector<Json> out;
    for (const auto& e : events_named(events, kind)) out.push_back(e[field]);
    return out;
  };
  EXPECT_EQ(decisions(one.file("events.jsonl"), "precision", "precision"),
            decisions(two.file("events.jsonl"), "precision", "precision"));
  EXPECT_EQ(decisions(one.file("events.jsonl"), "curvature", "probed"),
            decisions(two.file("events.jsonl"), "curvature", "probed"));
  const auto l1 = decisions(one.file("events.jsonl"), "curvature", "lambda_max");
  const auto l2 = decisions(two.file("events.jsonl"), "curvature", "lambda_max");
  ASSERT_EQ(l1.size(), l2.size());
  ASSERT_FALSE(l1.empty());
  for (size_t i = 0; i < l1.size(); ++i) {
    for (size_t u = 0; u < l1[i].size(); ++u) {
      if (l1[i][u].is_null()) continue;
      const double a = l1[i][u].get<double>(), b = l2[i][u].get<double>();
      EXPECT_NEAR(a, b, 0.05 * std::abs(a) + 1e-6) << "probe " << i << ", unit " << u;
    }
  }
}

// The same on two GPUs through NCCL, also with the optimizer state sharded (needs two GPUs). The ranks here are
// threads of one process, which cannot capture their steps in CUDA graphs side by side (a capture forbids the other
// thread's unsafe CUDA calls, and the ranks' collectives then wait for each other: measured, an all-reduce timed out
// on two H200s), so the steps run eagerly; the captured step with NCCL's collectives runs in separate processes, in
// bench/run_data_parallel.sh (every two-GPU row there reports cuda_graph true).
TEST_F(DataParallelTest, TwoGpusTrainTheWeightsOfOneGpu) {
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "fewer than two CUDA GPUs";
  test::TempDir one("dp_gpu_one"), two("dp_gpu_two");
  api::run(on_gpu(mlp_options(one.path())), one_process());
  run_ranks({on_gpu(mlp_options(two.path())), on_gpu(mlp_options(two.path()))});
  EXPECT_LT(worst_difference(one.file("model.pt"), two.file("model.pt")), 1e-3);
  const auto e2 = events_named(two.file("events.jsonl"), "epoch");
  ASSERT_EQ(e2.size(), 2u);
  EXPECT_EQ(e2[1]["world_size"], 2);
  test::TempDir zero("dp_gpu_zero");
  Config z = on_gpu(mlp_options(zero.path()));
  z.set("shard_optimizer", "on");
  run_ranks({z, z});
  EXPECT_LT(worst_difference(one.file("model.pt"), zero.file("model.pt")), 1e-3);
}

// BAOC's state sharded on two GPUs (its plans' sums over the ranks through NCCL), against one GPU.
TEST_F(DataParallelTest, TwoGpusShardBaocsStateAsOneGpuPlansIt) {
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "fewer than two CUDA GPUs";
  test::TempDir baoc_one("dp_gpu_baoc_one"), baoc_zero("dp_gpu_baoc_zero");
  api::run(with_optimizer(on_gpu(mlp_options(baoc_one.path())), "baoc"), one_process());
  Config bz = with_optimizer(on_gpu(mlp_options(baoc_zero.path())), "baoc");
  bz.set("shard_optimizer", "on");
  run_ranks({bz, bz});
  EXPECT_LT(worst_difference(baoc_one.file("model.pt"), baoc_zero.file("model.pt")), 1e-3);
}

// NeuroFlux's blocks on two GPUs (the gradient buckets through NCCL), against one GPU.
TEST_F(DataParallelTest, TwoGpusTrainNeuroFluxsBlocksAsOneGpu) {
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "fewer than two CUDA GPUs";
  test::TempDir nf_one("dp_gpu_nf_one"), nf_two("dp_gpu_nf_two");
  const auto nf = [&](const std::string& out) {
    Config c = on_gpu(mlp_options(out));
    c.set("model", "dp-mlp-local");
    c.set("method", "neuroflux");
    // A budget with room to spare and the modelled profile, so that the blocks and their batches cannot depend on what
    // each GPU holds (under 64 MB with the measured profile the ranks' weights differed from one GPU's; their
    // batches were not compared then).
    c.set("vram_budget", "1GB");
    c.set("nf_profile", "model");
    c.set("nf_exit_tolerance", "100");
    return c;
  };
  api::run(nf(nf_one.path()), one_process());
  run_ranks({nf(nf_two.path()), nf(nf_two.path())});
  const auto b1 = events_named(nf_one.file("events.jsonl"), "block");
  const auto b2 = events_named(nf_two.file("events.jsonl"), "block");
  ASSERT_EQ(b1.size(), b2.size());
  for (size_t b = 0; b < b1.size(); ++b) EXPECT_EQ(b1[b]["batch"], b2[b]["batch"]) << b;
  EXPECT_LT(worst_difference(nf_one.file("model.pt"), nf_two.file("model.pt")), 1e-3);
}

// An out-of-memory error on GPU 1 beside its captured step graph (NCCL's all-reduces captured in it), before the
// step's input: GPU 0 replays its graph, so that rank replays its own with its flag set (NCCL needs a captured
// collective on every rank or on none), the flag skips both updates, and every rank's graph goes and is captured again
// after the warm-up: the weights of one GPU that ran out of memory at the same step. The ranks are two processes (this
// binary again, the inner test alone): two GPUs capturing NCCL's collectives in one process can deadlock.
TEST_F(DataParallelTest, TwoGpusRetryAnOutOfMemoryBesideOneRanksGraphAsOneGpuInner) {
  const char* out = two_gpu_process_out();
  if (out == nullptr) GTEST_SKIP() << "run by TwoGpusRetryAnOutOfMemoryBesideOneRanksGraphAsOneGpu";
  RunHooks hooks;  // the rank from the environment, as torchrun gives it
  if (dist_options_from_env().rank == 1) inject_oom_at_step_6(hooks);
  api::run(neuroflux_oom_on_gpu(out), hooks);
}

TEST_F(DataParallelTest, TwoGpusRetryAnOutOfMemoryBesideOneRanksGraphAsOneGpu) {
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "fewer than two CUDA GPUs";
  test::TempDir nf_one("dp_gpu_nf_oom_one"), nf_two("dp_gpu_nf_oom_two");
  RunHooks one = one_process();
  inject_oom_at_step_6(one);
  api::run(neuroflux_oom_on_gpu(nf_one.path()), one);
  run_two_gpu_processes("TwoGpusRetryAnOutOfMemoryBesideOneRanksGraphAsOneGpuInner", nf_two);
  if (HasFailure()) return;
  const auto o1 = events_named(nf_one.file("events.jsonl"), event::kOom);
  const auto o2 = events_named(nf_two.file("events.jsonl"), event::kOom);
  ASSERT_EQ(o1.size(), 1u);
  ASSERT_EQ(o2.size(), 1u);
  EXPECT_EQ(o1[0]["reason"], "beside the CUDA graph's pool");
  EXPECT_EQ(o2[0]["reason"], "beside the CUDA graph's pool");
  EXPECT_EQ(o2[0]["retry_batch"], o1[0]["retry_batch"]);
  EXPECT_EQ(o2[0]["ranks"][0]["rank"], 1);
  const auto b1 = events_named(nf_one.file("events.jsonl"), "block");
  const auto b2 = events_named(nf_two.file("events.jsonl"), "block");
  ASSERT_EQ(b1.size(), b2.size());
  for (size_t b = 0; b < b1.size(); ++b) EXPECT_EQ(b1[b]["steps"], b2[b]["steps"]) << b;
  EXPECT_TRUE(b2[0]["cuda_graph"].get<bool>());  // captured again after the retry
  EXPECT_LT(worst_difference(nf_one.file("model.pt"), nf_two.file("model.pt")), 1e-3);
}

// A backprop step's out-of-memory error on GPU 1 before its input, its graph captured (NCCL's all-reduces in it): GPU 0
// replays its graph, so GPU 1 replays its own with its loss times NaN, which makes both sums NaN and skips both
// updates; both retry the samples at the smaller batch (and capture its graph): the weights of one GPU that ran out
// of memory at the same step, and no skipped step counted.
TEST_F(DataParallelTest, TwoGpusRetryABackpropOutOfMemoryBesideOneRanksGraphAsOneGpuInner) {
  const char* out = two_gpu_process_out();
  if (out == nullptr) GTEST_SKIP() << "run by TwoGpusRetryABackpropOutOfMemoryBesideOneRanksGraphAsOneGpu";
  RunHooks hooks;
  if (dist_options_from_env().rank == 1) inject_oom_at_step_6(hooks);  // steps are captured from the fourth
  api::run(backprop_oom_on_gpu(out), hooks);
}

TEST_F(DataParallelTest, TwoGpusRetryABackpropOutOfMemoryBesideOneRanksGraphAsOneGpu) {
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "fewer than two CUDA GPUs";
  test::TempDir one("dp_gpu_oom_one"), two("dp_gpu_oom_two");
  RunHooks hooks = one_process();
  inject_oom_at_step_6(hooks);
  const Json result_one = api::run(backprop_oom_on_gpu(one.path()), hooks);
  run_two_gpu_processes("TwoGpusRetryABackpropOutOfMemoryBesideOneRanksGraphAsOneGpuInner", two);
  if (HasFailure()) return;
  const auto o1 = events_named(one.file("events.jsonl"), event::kOom);
  const auto o2 = events_named(two.file("events.jsonl"), event::kOom);
  ASSERT_EQ(o1.size(), 1u);
  ASSERT_EQ(o2.size(), 1u);
  EXPECT_EQ(o2[0]["retry_batch"], o1[0]["retry_batch"]);
  EXPECT_EQ(o2[0]["ranks"][0]["rank"], 1);
  const auto e2 = events_named(two.file("events.jsonl"), event::kEpoch);
  ASSERT_FALSE(e2.empty());
  EXPECT_GE(e2[0]["graph_captures"].get<int64_t>(), 2);  // captured before the error and at the retry's batch
  const auto s2 = events_named(two.file("events.jsonl"), "summary");
  ASSERT_EQ(s2.size(), 1u);
  EXPECT_EQ(s2[0]["steps"], result_one["steps"]);
  EXPECT_EQ(s2[0]["skipped_steps"], 0);
  EXPECT_LT(worst_difference(one.file("model.pt"), two.file("model.pt")), 1e-3);
}

TEST_F(DataParallelTest, TwoRanksStoppedResumeInOneProcess) {
  test::TempDir one("dp_ref"), two("dp_stop");
  api::run(mlp_options(one.path()), one_process());
  Config first = mlp_options(two.path());
  first.set("max_steps", "5");  // inside epoch 1 (8 steps per epoch)
  const std::vector<Json> stopped = run_ranks({first, first});
  EXPECT_EQ(stopped[0]["reason"], "max_steps");
  EXPECT_EQ(stopped[1]["reason"], "max_steps");
  Config again = mlp_options(two.path());
  again.set("resume", two.path());
  const Json summary = api::run(again, one_process());
  EXPECT_EQ(summary["steps"], 16);
  EXPECT_EQ(summary["world_size"], 1);
  EXPECT_LT(worst_difference(one.file("model.pt"), two.file("model.pt")), 1e-3);
}

// ZeRO stage 1 (shard_optimizer on): each rank keeps and updates the optimizer state of its half of the parameters
// and broadcasts them after the step. The weights are one process's, for SGD's momentum and AdamW's moments alike;
// each rank reports its own state (fc1's weight is rank 0's, the rest rank 1's: 25 088 and 362 of 25 450
// parameters); and a run stopped on two sharded ranks resumes in one process, from a checkpoint that gathered every
// rank's state (a checkpoint of rank 0's shard alone would restart fc2's moments at zero and miss the weights).
TEST_F(DataParallelTest, ShardedOptimizerStateTrainsTheWeightsOfOneProcess) {
  for (const std::string optimizer : {"sgd", "adamw"}) {
    const auto configure = [&](const std::string& out) {
      Config c = mlp_options(out);
      if (optimizer == "adamw") {
        c.set("optimizer", "adamw");
        c.set("lr", "2e-3");
      }
      c.set("shard_optimizer", "on");
      return c;
    };
    test::TempDir one("dp_zero_one_" + optimizer), two("dp_zero_two_" + optimizer),
        stop("dp_zero_stop_" + optimizer);
    Config single = configure(one.path());
    single.set("shard_optimizer", "auto");  // no effect with one process
    const Json reference = api::run(single, one_process());
    const std::vector<Json> results = run_ranks({configure(two.path()), configure(two.path())});
    EXPECT_LT(worst_difference(one.file("model.pt"), two.file("model.pt")), 1e-3) << optimizer;
    const int64_t full = reference["optim_state_bytes"].get<int64_t>();
    const int64_t per_element = optimizer == "sgd" ? 4 : 8;
    EXPECT_EQ(full, per_element * 25450);
    EXPECT_EQ(results[0]["optim_state_bytes"], per_element * 25088) << optimizer;
    EXPECT_EQ(results[1]["optim_state_bytes"], per_element * 362) << optimizer;
    EXPECT_EQ(results[0]["optim_state_sharded"], true);
    EXPECT_EQ(reference["optim_state_sharded"], false);

    Config first = configure(stop.path());
    first.set("max_steps", "5");
    run_ranks({first, first});
    Config again = configure(stop.path());
    again.set("resume", stop.path());
    again.set("shard_optimizer", "auto");
    const Json resumed = api::run(again, one_process());
    EXPECT_EQ(resumed["steps"], 16);
    EXPECT_LT(worst_difference(one.file("model.pt"), stop.file("model.pt")), 1e-3) << optimizer;
  }
}

// NeuroFlux data parallel: each block's steps split over the ranks (each rank its share of the rows, the gradients
// weighted and summed during backward), and each cache pass too (each rank runs its share of every split's rows,
// passes them to the others and sums the exits' hits), so every rank holds one process's caches and exit scores. Two
// ranks train the weights of one process, block by block from the cache, and choose its exit; a stop that reaches
// one rank only (rank 1's, inside the first block's last epoch) stops both at the same step, and the run resumes in
// one process to the same weights and local losses.
TEST_F(DataParallelTest, NeuroFluxOnTwoRanksTrainsTheWeightsOfOneProcess) {
  const auto configure = [](const std::string& out) {
    Config c = mlp_options(out);
    c.set("model", "dp-mlp-local");
    c.set("method", "neuroflux");
    c.set("vram_budget", "1.5MB");  // several blocks (checked below)
    c.set("nf_exit_tolerance", "100");
    return c;
  };
  test::TempDir one("dp_nf_one"), two("dp_nf_two"), stop("dp_nf_stop");
  const Json reference = api::run(configure(one.path()), one_process());
  const std::vector<Json> results = run_ranks({configure(two.path()), configure(two.path())});
  const auto blocks_of = [](const std::string& events) { return events_named(events, "block"); };
  const auto b1 = blocks_of(one.file("events.jsonl"));
  const auto b2 = blocks_of(two.file("events.jsonl"));
  ASSERT_GE(b1.size(), 2u);
  ASSERT_EQ(b2.size(), b1.size());
  for (size_t b = 0; b < b1.size(); ++b) {
    EXPECT_EQ(b2[b]["units"], b1[b]["units"]) << b;
    EXPECT_EQ(b2[b]["steps"], b1[b]["steps"]) << b;
    // The local losses and accuracies count every rank's rows (summed over the ranks).
    const Json &l1 = b1[b]["local"].back(), &l2 = b2[b]["local"].back();
    EXPECT_NEAR(l2["train_loss"].get<double>(), l1["train_loss"].get<double>(), 1e-4) << b;
    EXPECT_NEAR(l2["train_acc"].get<double>(), l1["train_acc"].get<double>(), 1e-3) << b;
    EXPECT_NEAR(l2["holdout_acc"].get<double>(), l1["holdout_acc"].get<double>(), 1e-6) << b;
    EXPECT_NEAR(l2["test_acc"].get<double>(), l1["test_acc"].get<double>(), 1e-6) << b;
    // Rank 0 ran half of each split's rows (and at most one window of a batch before its share's end per split).
    const auto rows1 = b1[b]["pass_rows"].get<int64_t>(), rows2 = b2[b]["pass_rows"].get<int64_t>();
    EXPECT_LE(rows2, rows1 / 2 + 3 * b2[b]["pass_batch"].get<int64_t>()) << b;
    EXPECT_LT(rows2, rows1) << b;
  }
  const double worst = worst_difference(one.file("model.pt"), two.file("model.pt"));
  std::printf("[ neuroflux ] two ranks against one process: worst relative weight difference %.3g\n", worst);
  EXPECT_LT(worst, 1e-3);
  EXPECT_EQ(results[0]["exit_unit"], reference["exit_unit"]);
  EXPECT_NEAR(results[0]["test_acc"].get<double>(), reference["test_acc"].get<double>(), 1e-6);
  EXPECT_EQ(results[0]["world_size"], 2);

  int64_t steps_seen = 0;
  const std::vector<Config> first{configure(stop.path()), configure(stop.path())};
  const std::vector<Json> stopped = run_ranks(first, nullptr, [&](int rank, RunHooks& hooks) {
    if (rank != 1) return;
    hooks.after_step = [&](int64_t step) { steps_seen = step; };
    hooks.stop_requested = [&] { return steps_seen >= 15 ? StopRequest::kInterrupt : StopRequest::kNone; };
  });
  EXPECT_EQ(stopped[0]["reason"], "sigint");
  EXPECT_EQ(stopped[1]["reason"], "sigint");
  EXPECT_TRUE(stopped[0].contains("block_in_progress")) << stopped[0].dump();
  Config again = configure(stop.path());
  again.set("resume", stop.path());
  const Json resumed = api::run(again, one_process());
  EXPECT_EQ(resumed["steps"], reference["steps"]);
  EXPECT_EQ(resumed["world_size"], 1);
  EXPECT_LT(worst_difference(one.file("model.pt"), stop.file("model.pt")), 1e-3);
  // The block stopped in resumed from every rank's local-loss sums (rank 0's alone would lose half the epoch's).
  const auto b3 = blocks_of(stop.file("events.jsonl"));
  ASSERT_EQ(b3.size(), b1.size());
  for (size_t b = 0; b < b1.size(); ++b) {
    EXPECT_NEAR(b3[b]["local"].back()["train_loss"].get<double>(), b1[b]["local"].back()["train_loss"].get<double>(),
                1e-4) << b;
  }
}

// With BatchNorm (small-cnn), each rank's running statistics come from its own shares, as in DDP; at each block's
// end rank 0's go to every rank, so the cache passes and the exits are one model's: the ranks end with the same
// buffers, bit for bit.
TEST_F(DataParallelTest, NeuroFluxOnTwoRanksEndsWithRankZerosBatchNormStatistics) {
  test::TempDir two("dp_nf_bn");
  Config c = mlp_options(two.path());
  c.set("model", "small-cnn");
  c.set("method", "neuroflux");
  c.set("vram_budget", "8MB");  // several blocks
  c.set("nf_exit_tolerance", "100");
  std::vector<std::shared_ptr<Model>> models(2);
  const std::vector<Json> results = run_ranks({c, c}, nullptr, [&](int r, RunHooks& h) {
    h.model = [&models, r](const ModelOptions& o) {
      models[static_cast<size_t>(r)] = model_create(o);
      return models[static_cast<size_t>(r)];
    };
  });
  ASSERT_TRUE(models[0] && models[1]);
  EXPECT_GE(results[0]["blocks"].get<int64_t>(), 2);
  const auto b0 = models[0]->buffers(), b1 = models[1]->buffers();
  ASSERT_EQ(b0.size(), b1.size());
  ASSERT_FALSE(b0.empty());
  for (size_t i = 0; i < b0.size(); ++i) EXPECT_TRUE(at::equal(b0[i], b1[i])) << "buffer " << i;
}

// A backprop step that runs out of memory on one rank is retried by every rank: the rank that ran out makes the
// step's collectives (what is left of its gradient buckets, NaN in place of its share, so every rank's update is
// skipped), and every rank retries the same samples at the smaller batch, as one process does. Two ranks train one
// process's weights through an error on rank 1 inside backward (some buckets already sent) or on rank 0 before the
// step's input, with no skipped step counted (the loss scaler's update is put back).
TEST_F(DataParallelTest, OutOfMemoryOnOneRankIsRetriedByEveryRank) {
  const auto configure = [](const std::string& out) {
    Config c = mlp_options(out);
    c.set("model", "dp-mlp-local");
    c.set("grad_bucket_mb", "0.002");  // a bucket per layer or two: some start while backward runs
    return c;
  };
  constexpr int64_t kStep = 3;
  const auto before_input = [](RunHooks& hooks) { hooks.before_step = oom_once_at(kStep); };
  test::TempDir one("dp_oom_one"), in_backward("dp_oom_backward"), before("dp_oom_before");
  RunHooks reference = one_process();
  before_input(reference);
  const Json result_one = api::run(configure(one.path()), reference);
  const std::vector<Json> results_backward =
      run_ranks({configure(in_backward.path()), configure(in_backward.path())}, nullptr, [](int rank, RunHooks& hooks) {
        if (rank != 1) return;
        hooks.before_step = [once = std::make_shared<bool>(true)](int64_t step, int64_t) {
          if (step == kStep && std::exchange(*once, false)) dp_mlp_oom_in_next_backward = true;
        };
      });
  const std::vector<Json> results_before =
      run_ranks({configure(before.path()), configure(before.path())}, nullptr, [&](int rank, RunHooks& hooks) {
        if (rank == 0) before_input(hooks);
      });
  const auto ooms_one = events_named(one.file("events.jsonl"), event::kOom);
  ASSERT_EQ(ooms_one.size(), 1u);
  ASSERT_LT(ooms_one[0]["retry_batch"].get<int64_t>(), 51);
  const auto epochs_one = events_named(one.file("events.jsonl"), event::kEpoch);
  for (const auto& [dir, failed_rank, results] :
       {std::tuple<const test::TempDir*, int, const std::vector<Json>*>{&in_backward, 1, &results_backward},
        {&before, 0, &results_before}}) {
    SCOPED_TRACE(dir->path());
    const auto ooms = events_named(dir->file("events.jsonl"), event::kOom);
    ASSERT_EQ(ooms.size(), 1u);
    EXPECT_EQ(ooms[0]["batch"], ooms_one[0]["batch"]);
    EXPECT_EQ(ooms[0]["retry_batch"], ooms_one[0]["retry_batch"]);
    ASSERT_EQ(ooms[0]["ranks"].size(), 1u);
    EXPECT_EQ(ooms[0]["ranks"][0]["rank"], failed_rank);
    for (const Json& r : *results) {
      EXPECT_EQ(r["steps"], result_one["steps"]);
      EXPECT_EQ(r["skipped_steps"], 0);
    }
    const auto epochs = events_named(dir->file("events.jsonl"), event::kEpoch);
    ASSERT_EQ(epochs.size(), epochs_one.size());
    for (size_t e = 0; e < epochs.size(); ++e) {
      EXPECT_NEAR(epochs[e]["train_loss"].get<double>(), epochs_one[e]["train_loss"].get<double>(), 1e-4) << e;
    }
    EXPECT_LT(worst_difference(one.file("model.pt"), dir->file("model.pt")), 1e-3);
  }
}

// An evaluation that runs out of memory on one rank is retried by that rank alone at a smaller batch (each rank's share
// of the test set is fixed; the buffers' broadcast comes before the retries and the sums' reduction after): the test
// loss and accuracy of the same run without the error, and rank 0's events name the rank and its batches.
TEST_F(DataParallelTest, OutOfMemoryInOneRanksEvaluationIsRetriedByThatRankAlone) {
  const auto configure = [](const std::string& out) {
    Config c = mlp_options(out);
    c.set("model", "dp-mlp-buffer");
    c.set("epochs", "1");
    return c;
  };
  test::TempDir plain("dp_eval_plain"), failed("dp_eval_oom");
  run_ranks({configure(plain.path()), configure(plain.path())});
  run_ranks({configure(failed.path()), configure(failed.path())}, nullptr, [](int rank, RunHooks& hooks) {
    if (rank != 1) return;
    hooks.after_step = [](int64_t step) {
      if (step == 8) dp_mlp_oom_in_next_eval = true;  // the epoch's last step (384 samples at 51): its evaluation next
    };
  });
  const auto e0 = events_named(plain.file("events.jsonl"), event::kEpoch);
  const auto e1 = events_named(failed.file("events.jsonl"), event::kEpoch);
  ASSERT_EQ(e0.size(), 1u);
  ASSERT_EQ(e1.size(), 1u);
  EXPECT_NEAR(e1[0]["test_loss"].get<double>(), e0[0]["test_loss"].get<double>(), 1e-5);
  EXPECT_EQ(e1[0]["test_acc"], e0[0]["test_acc"]);
  const auto ooms = events_named(failed.file("events.jsonl"), event::kOom);
  ASSERT_EQ(ooms.size(), 1u);
  EXPECT_EQ(ooms[0]["phase"], "eval");
  EXPECT_EQ(ooms[0]["rank"], 1);
  EXPECT_LT(ooms[0]["retry_batch"].get<int64_t>(), ooms[0]["batch"].get<int64_t>());
}

// Injected faults hit every rank at the same steps (the same plan): an out-of-memory error before the input on both
// ranks, and NaN gradients and losses, retried or skipped by both ranks alike, give one process's weights and counters.
TEST_F(DataParallelTest, InjectedFaultsOnEveryRankGiveOneProcesssWeightsAndCounters) {
  const auto configure = [](const std::string& out) {
    Config c = mlp_options(out);
    c.set("inject_faults", "oom@3,nan-grad@5,nan-loss@9x2");
    return c;
  };
  test::TempDir one("dp_faults_one"), two("dp_faults_two");
  const Json result_one = api::run(configure(one.path()), one_process());
  const std::vector<Json> results = run_ranks({configure(two.path()), configure(two.path())});
  ASSERT_EQ(result_one["oom_retries"], 1);
  ASSERT_EQ(result_one["skip_retries"], 3);
  for (const Json& r : results) {
    for (const char* key : {"steps", "oom_retries", "skip_retries", "skipped_steps", "injected_faults"}) {
      EXPECT_EQ(r[key], result_one[key]) << key;
    }
  }
  EXPECT_LT(worst_difference(one.file("model.pt"), two.file("model.pt")), 1e-3);
}

// With --sync-bn a rank that runs out of memory cannot make up the other ranks' forward collectives: it ends with one
// line naming it and the way on, and the other rank, whose collective lost its peer, ends too.
TEST_F(DataParallelTest, OutOfMemoryOnOneRankWithSyncBatchNormEndsEveryRankWithALine) {
  test::TempDir out("dp_oom_sync_bn");
  Config c = mlp_options(out.path());
  c.set("sync_bn", "true");
  std::vector<std::string> errors;
  run_ranks({c, c}, nullptr,
            [](int rank, RunHooks& hooks) {
              if (rank != 1) return;
              hooks.before_step = [](int64_t step, int64_t) {
                TORCH_CHECK_WITH(OutOfMemoryError, step != 3, "injected by the test");
              };
            },
            &errors);
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_NE(errors[1].find("rank 1 of 2 ran out of GPU memory in training at batch_size 51 (26 per rank) with sync_bn; "
                           "resume from the last checkpoint on more GPUs"),
            std::string::npos)
      << errors[1];
  EXPECT_NE(errors[0].find("rank 0 of 2 lost the data-parallel group"), std::string::npos) << errors[0];
}

// A rank's process makes a CUDA context on its own GPU only. Taking its stream while device 0 was still current made
// every rank but rank 0 a context on GPU 0 as well (518 MiB of it on the H100s). A context cannot be taken back, so
// the check runs in a fresh process: the outer test starts this binary again for the inner one alone.
TEST_F(DataParallelTest, ARankOnGpu1MakesNoContextOnGpu0Inner) {
  if (std::getenv("TRIACCEL_TEST_FRESH_PROCESS") == nullptr) GTEST_SKIP() << "run by ARankOnGpu1MakesNoContextOnGpu0";
#ifdef TRIACCEL_WITH_CUDA
  ASSERT_FALSE(c10::cuda::hasPrimaryContext(0)) << "not a fresh process";
  test::TempDir out("dp_context");
  Config c = on_gpu(mlp_options(out.path()));
  c.set("max_steps", "2");
  RunHooks hooks;
  DistOptions gpu1;  // one process on the GPU of local rank 1, as a rank of its own would be
  gpu1.local_rank = 1;
  hooks.dist = gpu1;
  api::run(c, hooks);
  EXPECT_TRUE(c10::cuda::hasPrimaryContext(1));
  EXPECT_FALSE(c10::cuda::hasPrimaryContext(0));
#endif
}

TEST_F(DataParallelTest, ARankOnGpu1MakesNoContextOnGpu0) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  char self[4096] = {};
  ASSERT_GT(readlink("/proc/self/exe", self, sizeof(self) - 1), 0);
  test::TempDir out("dp_context_log");
  const std::string log = out.file("child.log");
  const std::string command = std::string("TRIACCEL_TEST_FRESH_PROCESS=1 '") + self +
                              "' --gtest_filter=DataParallelTest.ARankOnGpu1MakesNoContextOnGpu0Inner > '" + log +
                              "' 2>&1";
  EXPECT_EQ(std::system(command.c_str()), 0) << file_read_all(log);
}

// Method auto chooses in each process from its own GPU's plan; the ranks must train with one method. On the CPU every
// rank chooses backprop and trains one process's weights; ranks that chose apart (GPUs whose plans differ) stop with
// one line on every rank asking for the method by name.
TEST_F(DataParallelTest, MethodAutoIsOneChoiceForEveryRank) {
  for (const Method rank1 : {Method::kBackprop, Method::kNeuroFlux}) {
    const auto errors = test::on_two_ranks(free_local_port(), [&](int r, Dist& dist) {
      method_agree(dist, r == 0 ? Method::kBackprop : rank1);
    });
    for (int r = 0; r < 2; ++r) {
      if (rank1 == Method::kBackprop) {
        EXPECT_EQ(errors[r], "") << r;
      } else {
        EXPECT_NE(errors[r].find("method auto chose neuroflux on 1 of 2 processes and backprop on the others"),
                  std::string::npos) << r << ": " << errors[r];
      }
    }
  }
  test::TempDir one("dp_auto_one"), two("dp_auto_two");
  api::run(mlp_options(one.path()), one_process());
  Config automatic = mlp_options(two.path());
  automatic.set("method", "auto");
  automatic.set("nproc", "2");
  run_ranks({automatic, automatic});
  EXPECT_LT(worst_difference(one.file("model.pt"), two.file("model.pt")), 1e-3);
  const auto config = events_named(two.file("events.jsonl"), "config");
  ASSERT_EQ(config.size(), 1u);
  EXPECT_EQ(config[0]["options"]["method"], "backprop");
  EXPECT_EQ(config[0]["world_size"], 2);
}

// A NeuroFlux block step that runs out of memory on one rank is retried by every rank: the rank that ran out makes
// the step's collectives (its gradients' share as zeros, and a flag that skips every rank's update), and the ranks
// retry the same samples at the batch that rank proposes. So two ranks train one process's weights and local losses
// through an out-of-memory error on either rank: on rank 1 inside backward (some gradient buckets already sent; rank
// 0's step ran whole and its update and loss sums must not count), on rank 0 before the step's input.
TEST_F(DataParallelTest, NeuroFluxOutOfMemoryOnOneRankIsRetriedByEveryRank) {
  const auto configure = [](const std::string& out) {
    Config c = mlp_options(out);
    c.set("model", "dp-mlp-local");
    c.set("method", "neuroflux");
    c.set("vram_budget", "1.5MB");
    c.set("nf_exit_tolerance", "100");
    c.set("grad_bucket_mb", "0.002");  // a bucket per layer or two: some start while backward runs
    c.set("epochs", "1");  // the block's local losses are its last epoch's: the one with the failed step
    return c;
  };
  constexpr int64_t kStep = 5;  // block 0's sixth step
  const auto before_input = [](RunHooks& hooks) { hooks.before_step = oom_once_at(kStep); };
  test::TempDir one("dp_nf_oom_one"), in_backward("dp_nf_oom_backward"), before("dp_nf_oom_before");
  RunHooks reference = one_process();
  before_input(reference);
  api::run(configure(one.path()), reference);
  run_ranks({configure(in_backward.path()), configure(in_backward.path())}, nullptr, [](int rank, RunHooks& hooks) {
    if (rank != 1) return;
    hooks.before_step = [once = std::make_shared<bool>(true)](int64_t step, int64_t) {
      if (step == kStep && std::exchange(*once, false)) dp_mlp_oom_in_next_backward = true;
    };
  });
  run_ranks({configure(before.path()), configure(before.path())}, nullptr, [&](int rank, RunHooks& hooks) {
    if (rank == 0) before_input(hooks);
  });
  const auto ooms_one = events_named(one.file("events.jsonl"), event::kOom);
  ASSERT_EQ(ooms_one.size(), 1u);
  const auto blocks_one = events_named(one.file("events.jsonl"), "block");
  for (const auto& [dir, failed_rank] : {std::pair<const test::TempDir*, int>{&in_backward, 1}, {&before, 0}}) {
    SCOPED_TRACE(dir->path());
    const auto ooms = events_named(dir->file("events.jsonl"), event::kOom);
    ASSERT_EQ(ooms.size(), 1u);
    EXPECT_EQ(ooms[0]["block"], 0);
    EXPECT_EQ(ooms[0]["batch"], ooms_one[0]["batch"]);
    EXPECT_EQ(ooms[0]["retry_batch"], ooms_one[0]["retry_batch"]);
    ASSERT_EQ(ooms[0]["ranks"].size(), 1u);
    EXPECT_EQ(ooms[0]["ranks"][0]["rank"], failed_rank);
    EXPECT_FALSE(ooms[0].contains("action"));
    const auto blocks = events_named(dir->file("events.jsonl"), "block");
    ASSERT_EQ(blocks.size(), blocks_one.size());
    for (size_t b = 0; b < blocks.size(); ++b) {
      EXPECT_EQ(blocks[b]["steps"], blocks_one[b]["steps"]) << b;
      EXPECT_EQ(blocks[b]["final_batch"], blocks_one[b]["final_batch"]) << b;
      ASSERT_EQ(blocks[b]["local"].size(), blocks_one[b]["local"].size());
      for (size_t u = 0; u < blocks[b]["local"].size(); ++u) {
        EXPECT_NEAR(blocks[b]["local"][u]["train_loss"].get<double>(),
                    blocks_one[b]["local"][u]["train_loss"].get<double>(), 1e-4) << b << " " << u;
      }
    }
    EXPECT_LT(worst_difference(one.file("model.pt"), dir->file("model.pt")), 1e-3);
  }
}

// When no smaller batch fits on the rank that ran out (every step of it runs out), every rank stops with one line
// naming that rank, and rank 0's events end with the oom event that stopped them.
TEST_F(DataParallelTest, NeuroFluxOutOfMemoryThatNoBatchFitsStopsEveryRankWithOneLine) {
  test::TempDir out("dp_nf_oom_stop");
  Config c = mlp_options(out.path());
  c.set("model", "dp-mlp-local");
  c.set("method", "neuroflux");
  c.set("vram_budget", "1.5MB");
  std::vector<std::string> errors;
  run_ranks({c, c}, nullptr,
            [](int rank, RunHooks& hooks) {
              if (rank != 1) return;
              hooks.before_step = [](int64_t, int64_t) {
                TORCH_CHECK_WITH(OutOfMemoryError, false, "injected by the test");
              };
            },
            &errors);
  ASSERT_EQ(errors.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("rank 1 of 2 ran out of GPU memory in NeuroFlux block 0 at batch "), std::string::npos)
        << errors[r];
    EXPECT_NE(errors[r].find("and no smaller batch fits"), std::string::npos) << errors[r];
  }
  const auto ooms = events_named(out.file("events.jsonl"), event::kOom);
  ASSERT_GE(ooms.size(), 2u);
  EXPECT_EQ(ooms.back()["action"], "stopped");
  EXPECT_EQ(ooms.back()["retry_batch"], 0);
  EXPECT_FALSE(ooms.front().contains("action"));
  EXPECT_LT(ooms.back()["batch"].get<int64_t>(), ooms.front()["batch"].get<int64_t>());
}

TEST_F(DataParallelTest, WhatItDoesNotSupportYetIsRefusedByName) {
  test::TempDir out("dp_refuse");
  const auto refused = [&](const char* key, const std::string& value) {
    Config c = mlp_options(out.path());
    c.set("nproc", "2");
    c.set(key, value);
    return test::error_of([&] { c.validate(); });
  };
  EXPECT_EQ(refused("method", "auto"), "<no error>");  // each rank looks at its own GPU; the ranks agree
  Config neuroflux = mlp_options(out.path());  // each block trains data parallel
  neuroflux.set("nproc", "2");
  neuroflux.set("model", "small-cnn");
  neuroflux.set("method", "neuroflux");
  EXPECT_EQ(test::error_of([&] { neuroflux.validate(); }), "<no error>");
  EXPECT_EQ(refused("vram_budget", "1GB"), "<no error>");  // each rank plans its share; the ranks agree on readings
  EXPECT_NE(refused("batch_policy", "elastic").find("batch_policy elastic follows one process's memory"),
            std::string::npos) << refused("batch_policy", "elastic");
  EXPECT_EQ(refused("inject_faults", "oom@3"), "<no error>");  // every rank draws the same faults
  EXPECT_NE(refused("batch_size", "1").find("batch_size 1 is smaller than nproc 2"), std::string::npos);
  const auto refused_with_sync_bn = [&](const char* key, const std::string& value) {
    Config c = mlp_options(out.path());
    c.set("nproc", "2");
    c.set("sync_bn", "true");
    c.set(key, value);
    return test::error_of([&] { c.validate(); });
  };
  EXPECT_NE(refused_with_sync_bn("micro_batch", "8").find("drop micro_batch 8"), std::string::npos);
  EXPECT_NE(refused_with_sync_bn("recompute", "fc1").find("drop recompute fc1"), std::string::npos);
  EXPECT_NE(refused_with_sync_bn("vram_budget", "1GB").find("which a vram_budget may split into micro-batches"),
            std::string::npos);
  // nproc 2 through the API in a process that is no rank: the command line starts ranks, not api::run.
  Config c = mlp_options(out.path());
  c.set("nproc", "2");
  EXPECT_NE(test::error_of([&] { api::run(c, one_process()); }).find("nproc 2 but this process is one of 1"),
            std::string::npos);
}

}  // namespace
}  // namespace triaccel
