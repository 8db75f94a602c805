// Data parallelism on the CPU (docs/distributed.md): two ranks (threads of this process, each its own Session over
// one Gloo group) train a BatchNorm-free model to the weights one process trains at the same global batch, each
// sample once per epoch across the ranks, with only rank 0 writing; a run stopped on two ranks resumes in one
// process; the options data parallelism does not support yet are refused, naming them.
#include "test_util.h"
#include "triaccel/core/clock.h"
#include "triaccel/core/events.h"
#include "triaccel/models/model.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <thread>
#include <unistd.h>

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

void dp_mlp_register() {
  static const bool once = [] {
    model_register({"dp-mlp", "a BatchNorm-free MLP (tests of data parallelism)", ModelInput::kImage,
                    /*double_backward=*/true, /*local_learning=*/false,
                    [](const ModelOptions& o) -> std::shared_ptr<Model> { return std::make_shared<DpMlp>(o); }});
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
    static int round = 0;
    const int port = 21000 + static_cast<int>((getpid() * 7 + 100 * round++) % 20000);
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

  static std::vector<Json> epochs_of(const std::string& events) {
    std::vector<Json> out;
    for (const auto& e : events_read(events)) {
      if (e["event"] == "epoch") out.push_back(e);
    }
    return out;
  }
};

TEST_F(DataParallelTest, TwoRanksTrainTheWeightsOfOneProcess) {
  test::TempDir one("dp_one"), two("dp_two");
  api::run(mlp_options(one.path()), one_process());
  std::vector<Spans> spans;
  const std::vector<Json> results = run_ranks({mlp_options(two.path()), mlp_options(two.path())}, &spans);

  // Same weights to fp32 tolerance (the sums run in another order); an unreduced or unweighted gradient is off by
  // orders of magnitude more.
  EXPECT_LT(worst_difference(one.file("model.pt"), two.file("model.pt")), 1e-3);
  const auto e1 = epochs_of(one.file("events.jsonl"));
  const auto e2 = epochs_of(two.file("events.jsonl"));
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
  const auto e1 = epochs_of(one.file("events.jsonl"));
  const auto e2 = epochs_of(two.file("events.jsonl"));
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
TEST_F(DataParallelTest, BaocOnTwoRanksMakesTheOneProcessPlans) {
  test::TempDir one("dp_baoc_one"), two("dp_baoc_two");
  const auto configure = [](Config c) { return with_optimizer(std::move(c), "baoc"); };
  api::run(configure(mlp_options(one.path())), one_process());
  const Config c = configure(mlp_options(two.path()));
  const std::vector<Json> results = run_ranks({c, c});
  const auto plans = [](const std::string& events) {
    std::vector<Json> out;
    for (const auto& e : events_read(events)) {
      if (e["event"] == event::kOptimPlan) out.push_back(e);
    }
    return out;
  };
  const auto p1 = plans(one.file("events.jsonl"));
  const auto p2 = plans(two.file("events.jsonl"));
  ASSERT_EQ(p1.size(), 5u);
  ASSERT_EQ(p2.size(), p1.size());
  bool formats_differ = false;  // the budget binds: not every unit keeps fp32 AdamW
  for (size_t i = 0; i < p1.size(); ++i) {
    EXPECT_EQ(p1[i]["step"], p2[i]["step"]) << "plan " << i;
    ASSERT_EQ(p1[i]["units"].size(), p2[i]["units"].size()) << "plan " << i;
    for (size_t u = 0; u < p1[i]["units"].size(); ++u) {  // the signals agree to fp32 rounding, the choices exactly
      const Json &a = p1[i]["units"][u], &b = p2[i]["units"][u];
      EXPECT_EQ(a["unit"], b["unit"]);
      EXPECT_EQ(a["format"], b["format"]) << "plan " << i << ", " << a["unit"];
      EXPECT_EQ(a["bytes"], b["bytes"]) << "plan " << i << ", " << a["unit"];
      EXPECT_NEAR(a["risk"].get<double>(), b["risk"].get<double>(), 1e-6) << "plan " << i << ", " << a["unit"];
    }
    formats_differ = formats_differ || p1[i]["units"].dump().find("adamw-fp32") == std::string::npos ||
                     p1[i]["units"].dump().find("\"sgd") != std::string::npos ||
                     p1[i]["units"].dump().find("adamw-8bit") != std::string::npos ||
                     p1[i]["units"].dump().find("adamw-bf16") != std::string::npos ||
                     p1[i]["units"].dump().find("factored") != std::string::npos ||
                     p1[i]["units"].dump().find("no-momentum") != std::string::npos;
  }
  EXPECT_TRUE(formats_differ) << p1[0]["units"].dump();
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0]["optimizer"], "baoc");
  EXPECT_EQ(results[0]["optim_state_bytes"], results[1]["optim_state_bytes"]);
  const double worst = worst_difference(one.file("model.pt"), two.file("model.pt"));
  std::printf("[ baoc ] two ranks against one process: worst relative weight difference %.3g\n", worst);
  EXPECT_LT(worst, 1e-3);  // 2.8e-6 measured
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
  test::TempDir one("dp_tri_one"), two("dp_tri_two");
  api::run(configure(mlp_options(one.path()), "0"), one_process());
  const Config c = configure(mlp_options(two.path()), "0");
  run_ranks({c, c});
  // The units run bf16 (on the CPU, fp16 decisions too): a rank's gradient of 25 samples and one process's of 51
  // round differently, so the weights are near, not equal (a weight near 0 moves relatively most); the test loss
  // and every decision are one process's.
  const auto e1 = epochs_of(one.file("events.jsonl")), e2 = epochs_of(two.file("events.jsonl"));
  ASSERT_EQ(e2.size(), 2u);
  EXPECT_NEAR(e2[1]["test_loss"].get<double>(), e1[1]["test_loss"].get<double>(), 1e-2);
  const auto decisions = [](const std::string& events, const char* kind, const char* field) {
    std::vector<Json> out;
    for (const auto& e : events_read(events)) {
      if (e["event"] == kind) out.push_back(e[field]);
    }
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
  const auto on_gpu = [](Config c) {
    c.set("device", "cuda");
    c.set("cuda_graphs", "false");
    return c;
  };
  api::run(on_gpu(mlp_options(one.path())), one_process());
  run_ranks({on_gpu(mlp_options(two.path())), on_gpu(mlp_options(two.path()))});
  EXPECT_LT(worst_difference(one.file("model.pt"), two.file("model.pt")), 1e-3);
  const auto e2 = epochs_of(two.file("events.jsonl"));
  ASSERT_EQ(e2.size(), 2u);
  EXPECT_EQ(e2[1]["world_size"], 2);
  test::TempDir zero("dp_gpu_zero");
  Config z = on_gpu(mlp_options(zero.path()));
  z.set("shard_optimizer", "on");
  run_ranks({z, z});
  EXPECT_LT(worst_difference(one.file("model.pt"), zero.file("model.pt")), 1e-3);
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

// Out of memory on one rank is not retried there alone (it would fall out of step with the others): that rank ends
// with one line naming it and the way on, and the other rank, whose collective lost its peer, ends too.
TEST_F(DataParallelTest, OutOfMemoryOnOneRankEndsEveryRankWithALine) {
  test::TempDir out("dp_oom");
  std::vector<std::string> errors;
  run_ranks({mlp_options(out.path()), mlp_options(out.path())}, nullptr,
            [](int rank, RunHooks& hooks) {
              if (rank != 1) return;
              hooks.before_step = [](int64_t step, int64_t) {
                TORCH_CHECK_WITH(OutOfMemoryError, step != 3, "injected by the test");
              };
            },
            &errors);
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_NE(errors[1].find("rank 1 of 2 ran out of GPU memory in training at batch_size 51 (26 per rank); resume "
                           "from the last checkpoint on more GPUs"),
            std::string::npos)
      << errors[1];
  EXPECT_NE(errors[0].find("rank 0 of 2 lost the data-parallel group"), std::string::npos) << errors[0];
}

TEST_F(DataParallelTest, WhatItDoesNotSupportYetIsRefusedByName) {
  test::TempDir out("dp_refuse");
  const auto refused = [&](const char* key, const std::string& value) {
    Config c = mlp_options(out.path());
    c.set("nproc", "2");
    c.set(key, value);
    return test::error_of([&] { c.validate(); });
  };
  EXPECT_NE(refused("method", "auto").find("nproc 2 trains with method backprop or tri-accel only"),
            std::string::npos) << refused("method", "auto");
  EXPECT_EQ(refused("vram_budget", "1GB"), "<no error>");  // each rank plans its share; the ranks agree on readings
  EXPECT_NE(refused("batch_policy", "elastic").find("batch_policy elastic follows one process's memory"),
            std::string::npos) << refused("batch_policy", "elastic");
  EXPECT_NE(refused("inject_faults", "oom@3").find("inject_faults is not supported"), std::string::npos);
  Config baoc = with_optimizer(mlp_options(out.path()), "baoc");
  baoc.set("shard_optimizer", "on");
  EXPECT_NE(test::error_of([&] { baoc.validate(); }).find("shard_optimizer on does not combine with optimizer baoc"),
            std::string::npos);
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
