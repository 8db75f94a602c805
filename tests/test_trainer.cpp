// The trainer end to end on the CPU, on a tiny MNIST-layout dataset the test writes itself: events.jsonl layout,
// learning, and bit-exact resume (a run stopped mid-epoch and resumed ends with exactly the weights, and the same
// per-epoch losses, as an uninterrupted run).
#include "test_util.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"
#include "triaccel/train/telemetry.h"
#include "triaccel/train/trainer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

namespace triaccel {
namespace {

class TrainerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    data_ = new test::TempDir("trainer_data");
    test::mnist_like_write(data_->path(), 384, 128, 1);
  }
  static void TearDownTestSuite() { delete data_; }

  TrainOptions options(const std::string& out) const {
    TrainOptions o;
    o.model = "small-cnn";
    o.dataset = "mnist";
    o.data_dir = data_->path();
    o.epochs = 2;
    o.batch_size = 64;  // 6 steps per epoch
    o.lr = 0.05;
    o.warmup_epochs = 0.5;
    o.device = "cpu";
    o.progress = "off";
    o.out = out;
    return o;
  }

  static std::map<std::string, at::Tensor> load_state(const std::string& path) {
    const std::string bytes = file_read_all(path);
    const auto dict = torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end())).toGenericDict();
    std::map<std::string, at::Tensor> out;
    for (const auto& kv : dict) out[kv.key().toStringRef()] = kv.value().toTensor();
    return out;
  }

  static test::TempDir* data_;
};
test::TempDir* TrainerTest::data_ = nullptr;

TEST_F(TrainerTest, EventsLayoutAndLearning) {
  test::TempDir out("run");
  const Json summary = train_run(options(out.path()));
  const auto events = events_read(out.file("events.jsonl"));
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.front()["event"], "config");
  EXPECT_EQ(events.back()["event"], "summary");
  int epochs = 0;
  for (const auto& e : events) {
    EXPECT_TRUE(e.contains("step") && e.contains("time_s")) << e.dump();
    if (e["event"] == "epoch") ++epochs;
  }
  EXPECT_EQ(epochs, 2);
  for (const char* key : {"test_acc", "epoch_s", "peak_vram_gb", "eff_score", "params", "method", "model", "dataset"}) {
    EXPECT_TRUE(events.back().contains(key)) << key;
  }
  EXPECT_EQ(summary["steps"], 12);
  EXPECT_EQ(summary["model"], "small-cnn");
  // Labels shift the image brightness: chance is 10 %, a working trainer learns far more in 12 steps.
  EXPECT_GT(summary["test_acc"].get<double>(), 40.0) << summary.dump();
  EXPECT_TRUE(std::filesystem::exists(out.file("model.pt")));
  EXPECT_TRUE(std::filesystem::exists(out.file("checkpoint.pt")));
}

TEST_F(TrainerTest, ResumeMidEpochIsBitExact) {
  test::TempDir a("run_a"), b("run_b");
  train_run(options(a.path()));

  TrainOptions first = options(b.path());
  first.max_steps = 4;  // stops inside epoch 1 (6 steps per epoch)
  const Json stop = train_run(first);
  EXPECT_EQ(stop["reason"], "max_steps");
  EXPECT_FALSE(std::filesystem::exists(b.file("model.pt")));

  TrainOptions again = options(b.path());
  again.resume = b.path();
  train_run(resume_options(again, {"resume"}));

  const auto wa = load_state(a.file("model.pt"));
  const auto wb = load_state(b.file("model.pt"));
  ASSERT_EQ(wa.size(), wb.size());
  for (const auto& [name, t] : wa) {
    ASSERT_TRUE(wb.count(name)) << name;
    EXPECT_TRUE(torch::equal(t, wb.at(name))) << name << " differs after resume";
  }
  // Per-epoch test losses equal exactly, and epoch 2 (trained entirely after the resume) has the same train loss.
  std::vector<Json> ea, eb;
  for (const auto& e : events_read(a.file("events.jsonl"))) if (e["event"] == "epoch") ea.push_back(e);
  for (const auto& e : events_read(b.file("events.jsonl"))) if (e["event"] == "epoch") eb.push_back(e);
  ASSERT_EQ(ea.size(), 2u);
  ASSERT_EQ(eb.size(), 2u);
  EXPECT_EQ(ea[0]["test_loss"], eb[0]["test_loss"]);
  EXPECT_EQ(ea[1]["test_loss"], eb[1]["test_loss"]);
  EXPECT_EQ(ea[1]["train_loss"], eb[1]["train_loss"]);
}

TEST_F(TrainerTest, ResumeRefusesAChangedIdentity) {
  test::TempDir b("run_c");
  TrainOptions first = options(b.path());
  first.max_steps = 2;
  train_run(first);
  TrainOptions again = options(b.path());
  again.resume = b.path();
  again.model = "resnet18";
  try {
    resume_options(again, {"resume", "model"});
    FAIL() << "expected UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("--model \"resnet18\" differs from the checkpoint's \"small-cnn\""),
              std::string::npos)
        << e.what();
  }
}

// On a GPU: ResNet-18 (1×1 downsample convs, channels_last) with the step captured in a CUDA graph trains like
// the eager step (same losses up to cuDNN algorithm differences) and the graph really was captured and replayed.
TEST_F(TrainerTest, CudaGraphStepMatchesEagerStep) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  for (const char* precision : {"fp32", "amp-bf16", "amp-fp16"}) {
    test::TempDir graph_dir("run_graph"), eager_dir("run_eager");
    TrainOptions o = options(graph_dir.path());
    o.model = "resnet18";
    o.device = "cuda";
    o.precision = precision_mode_parse(precision);
    const Json with_graph = train_run(o);
    o.out = eager_dir.path();
    o.cuda_graphs = false;
    const Json eager = train_run(o);
    std::vector<Json> eg, ee;
    for (const auto& e : events_read(graph_dir.file("events.jsonl"))) if (e["event"] == "epoch") eg.push_back(e);
    for (const auto& e : events_read(eager_dir.file("events.jsonl"))) if (e["event"] == "epoch") ee.push_back(e);
    ASSERT_EQ(eg.size(), 2u);
    EXPECT_TRUE(eg[1]["cuda_graph"].get<bool>()) << precision;
    EXPECT_FALSE(ee[1]["cuda_graph"].get<bool>()) << precision;
    const double lg = eg[1]["train_loss"].get<double>(), le = ee[1]["train_loss"].get<double>();
    EXPECT_NEAR(lg, le, 0.02 * le) << precision;
    EXPECT_EQ(with_graph["skipped_steps"].get<double>(), eager["skipped_steps"].get<double>()) << precision;
    EXPECT_GT(with_graph["peak_vram_gb"].get<double>(), 0.0);
  }
}

}  // namespace
}  // namespace triaccel
