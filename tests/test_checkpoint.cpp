// Checkpoints: round trip, and refusal of corrupt, truncated, foreign and mismatched files with a clear message.
#include "test_util.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"
#include "triaccel/train/checkpoint.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>

namespace triaccel {
namespace {

Checkpoint sample_checkpoint() {
  Checkpoint c;
  c.config = Json{{"model", "small-cnn"}, {"lr", 0.1}};
  c.model_arch = "small-cnn";
  c.model = {{"conv.weight", torch::randn({4, 3, 3, 3})}, {"bn.num_batches_tracked", torch::tensor(5, torch::kLong)}};
  c.optimizer = {{"conv.weight.momentum", torch::randn({4, 3, 3, 3})}};
  c.scaler = {{"scale", torch::full({1}, 1024.f)}};
  c.rng = {{"cpu", at::detail::getDefaultCPUGenerator().get_state()}};
  c.progress = Json{{"step", 12}, {"epoch", 1}};
  return c;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "<no error>";
}

TEST(CheckpointTest, RoundTripKeepsEveryTensorAndField) {
  test::TempDir dir("ckpt");
  const Checkpoint c = sample_checkpoint();
  checkpoint_write(dir.file("checkpoint.pt"), c);
  EXPECT_EQ(checkpoint_path(dir.path()), dir.file("checkpoint.pt"));
  const Checkpoint r = checkpoint_read(dir.file("checkpoint.pt"));
  EXPECT_EQ(r.model_arch, "small-cnn");
  EXPECT_EQ(r.progress["step"], 12);
  EXPECT_EQ(r.config["lr"], 0.1);
  ASSERT_EQ(r.model.size(), 2u);
  EXPECT_TRUE(torch::equal(r.model[0].second, c.model[0].second));
  EXPECT_EQ(r.model[1].second.item<int64_t>(), 5);
  EXPECT_TRUE(torch::equal(r.optimizer[0].second, c.optimizer[0].second));
  EXPECT_TRUE(torch::equal(r.rng[0].second, c.rng[0].second));
}

TEST(CheckpointTest, RefusesCorruptTruncatedEmptyAndForeignFiles) {
  test::TempDir dir("ckpt_bad");
  const std::string path = dir.file("checkpoint.pt");
  checkpoint_write(path, sample_checkpoint());
  const std::string good = file_read_all(path);

  // A flipped byte inside tensor data: the zip still opens, the checksum catches it.
  bool caught_any = false;
  for (size_t off = good.size() / 2; off < good.size() / 2 + 64 && !caught_any; ++off) {
    std::string bad = good;
    bad[off] = static_cast<char>(bad[off] ^ 0x5A);
    file_write_atomic(path, bad);
    const std::string msg = error_of([&] { checkpoint_read(path); });
    if (msg != "<no error>") {
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      EXPECT_TRUE(msg.find("corrupt") != std::string::npos || msg.find("not a triaccel checkpoint") != std::string::npos)
          << msg;
      caught_any = true;
    }
  }
  EXPECT_TRUE(caught_any);

  file_write_atomic(path, good.substr(0, good.size() / 3));
  EXPECT_NE(error_of([&] { checkpoint_read(path); }).find("corrupt or truncated"), std::string::npos);

  file_write_atomic(path, "");
  EXPECT_NE(error_of([&] { checkpoint_read(path); }).find("is empty"), std::string::npos);

  EXPECT_NE(error_of([&] { checkpoint_read(dir.file("missing.pt")); }).find("not found"), std::string::npos);

  // A valid pickle that is not ours.
  c10::impl::GenericDict other(c10::StringType::get(), c10::AnyType::get());
  other.insert("format", std::string("something-else"));
  const auto bytes = torch::pickle_save(other);
  file_write_atomic(path, std::string(bytes.begin(), bytes.end()));
  EXPECT_NE(error_of([&] { checkpoint_read(path); }).find("not a triaccel checkpoint"), std::string::npos);
}

TEST(CheckpointTest, LoadingIntoAnotherModelNamesTheTensor) {
  const NamedTensors stored = {{"a", torch::zeros({2, 2})}, {"b", torch::zeros({3})}};
  NamedTensors live = {{"a", torch::ones({2, 2})}, {"b", torch::ones({4})}};
  const std::string msg = error_of([&] { named_tensors_load(live, stored, "model", "x.pt"); });
  EXPECT_NE(msg.find("'b'"), std::string::npos) << msg;
  NamedTensors renamed = {{"a", torch::ones({2, 2})}, {"c", torch::ones({3})}};
  EXPECT_NE(error_of([&] { named_tensors_load(renamed, stored, "model", "x.pt"); }).find("lacks model tensor 'c'"),
            std::string::npos);
  NamedTensors ok = {{"a", torch::ones({2, 2})}, {"b", torch::ones({3})}};
  named_tensors_load(ok, stored, "model", "x.pt");
  EXPECT_EQ(ok[1].second.sum().item<float>(), 0.f);
}

}  // namespace
}  // namespace triaccel
