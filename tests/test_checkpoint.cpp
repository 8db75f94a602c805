// Checkpoints: round trip, and refusal of corrupt, truncated, foreign and mismatched files with a clear message;
// the structure checks that run before LibTorch reads a file (core/torch_file_check.h) and the loader's check that
// every tensor lies inside its record, each on a crafted file that LibTorch alone would over-allocate or over-read.
#include "test_util.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"
#include "triaccel/core/torch_file.h"
#include "triaccel/core/torch_file_check.h"
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

using test::error_of;

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

// The central directory entry of the zip record whose name ends with `suffix`.
size_t zip_entry(const std::string& file, const std::string& suffix) {
  for (size_t at = file.find("PK\x01\x02"); at != std::string::npos; at = file.find("PK\x01\x02", at + 1)) {
    const size_t name_len = static_cast<uint8_t>(file[at + 28]) | static_cast<uint8_t>(file[at + 29]) << 8;
    const std::string name = file.substr(at + 46, name_len);
    if (name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      return at;
    }
  }
  ADD_FAILURE() << "no zip record " << suffix;
  return 0;
}

// `good` with `from` replaced by `to` (same length: the zip offsets stay valid, and LibTorch checks no CRC).
std::string replaced(const std::string& good, const std::string& from, const std::string& to) {
  EXPECT_EQ(from.size(), to.size());
  const size_t at = good.find(from);
  EXPECT_NE(at, std::string::npos) << "pattern not in the file";
  std::string bad = good;
  if (at != std::string::npos) bad.replace(at, from.size(), to);
  return bad;
}

std::string load_error(const std::string& bytes) {
  try {
    torch_load_bytes(bytes);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no error>";
}

TEST(CheckpointTest, ContainerChecksRefuseSizesTheFileDoesNotHold) {
  test::TempDir dir("ckpt_zip");
  checkpoint_write(dir.file("checkpoint.pt"), sample_checkpoint());
  const std::string good = file_read_all(dir.file("checkpoint.pt"));
  EXPECT_NO_THROW(torch_zip_check(good));
  const auto bytes = torch::pickle_save(torch::ones({3}));  // LibTorch's own writer passes too
  EXPECT_NO_THROW(torch_load_bytes(std::string(bytes.begin(), bytes.end())));

  // data.pkl marked deflate-compressed: LibTorch would allocate its declared size before inflating.
  const size_t pkl = zip_entry(good, "/data.pkl");
  std::string compressed = good;
  compressed[pkl + 10] = 8;
  EXPECT_NE(load_error(compressed).find("'archive/data.pkl' is compressed (method 8)"), std::string::npos)
      << load_error(compressed);
  // A stored record whose uncompressed size (268 MB) is not its stored size.
  std::string huge = good;
  huge.replace(pkl + 24, 4, "\xf0\xff\xff\x0f");
  EXPECT_NE(load_error(huge).find("is stored with"), std::string::npos) << load_error(huge);
  // Bytes after the end record (4,200 zeros, as a disk might leave): LibTorch's miniz would read before the buffer.
  EXPECT_NE(load_error(good + std::string(4200, '\0')).find("the zip end record is followed by 4200 bytes"),
            std::string::npos)
      << load_error(good + std::string(4200, '\0'));
  // Truncated by one byte: the container check refuses it before LibTorch reads anything.
  EXPECT_NE(load_error(good.substr(0, good.size() - 1)).find("no end of central directory record"),
            std::string::npos);
}

TEST(CheckpointTest, PickleChecksRefuseLengthsMemoIndicesAndNesting) {
  using namespace std::string_literals;
  const auto error = [](const std::string& pickle) {
    try {
      torch_pickle_check(pickle);
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("<no error>");
  };
  EXPECT_EQ(error("\x80\x02}q\x00X\x01\x00\x00\x00" "aK\x01s."s), "<no error>");  // {'a': 1}
  // A 4-byte string length of 268 MB with 3 bytes left (LibTorch reserves and zero-fills it first), an 8-byte one.
  EXPECT_NE(error("\x80\x02X\xf0\xff\xff\x0f" "abc"s).find("declares 268435440 bytes, 3 are left"), std::string::npos);
  EXPECT_NE(error("\x80\x02\x8d\xf0\xff\xff\xff\xff\xff\x01\x01" "abc."s).find("declares"), std::string::npos);
  // A memo index far ahead (LibTorch resizes its memo table to it), and one never stored.
  EXPECT_NE(error("\x80\x02}r\xf0\xff\xff\x0f."s).find("memo index 268435440 skips ahead of the 0 stored"),
            std::string::npos);
  EXPECT_NE(error("\x80\x02}h\x00."s).find("was never stored"), std::string::npos);
  // Nesting: kPickleMaxDepth lists inside each other are fine, one more is refused; a list inside itself too.
  const auto nested = [](size_t depth) {
    return "\x80\x02"s + std::string(depth, ']') + std::string(depth - 1, 'a') + ".";
  };
  EXPECT_EQ(error(nested(kPickleMaxDepth)), "<no error>");
  EXPECT_NE(error(nested(kPickleMaxDepth + 1)).find("more than 1000 deep"), std::string::npos);
  EXPECT_NE(error("\x80\x02]q\x00h\x00" "a."s).find("inside itself"), std::string::npos);
  EXPECT_NE(error("\x80\x02]"s).find("without its STOP"), std::string::npos);
  EXPECT_NE(error("\x80\x02\xff."s).find("is not a pickle opcode"), std::string::npos);
}

TEST(CheckpointTest, TensorsMustLieInsideTheirRecordAndBeContiguous) {
  test::TempDir dir("ckpt_view");
  const std::string path = dir.file("checkpoint.pt");
  checkpoint_write(path, sample_checkpoint());
  const std::string good = file_read_all(path);
  // conv.weight (4, 3, 3, 3), strides (27, 9, 3, 1), as the pickle writes them (BININT1 each).
  const std::string sizes("(K\x04K\x03K\x03K\x03t", 10);
  const std::string strides("(K\x1bK\x09K\x03K\x01t", 10);
  // 64 rows of 27 floats in a record of 4 rows: LibTorch sets the view without comparing it with the storage.
  file_write_atomic(path, replaced(good, sizes + strides, std::string("(K\x40K\x03K\x03K\x03t", 10) + strides));
  EXPECT_NE(error_of([&] { checkpoint_read(path); }).find("does not lie inside a record of the file"),
            std::string::npos)
      << error_of([&] { checkpoint_read(path); });
  // A stride of 0 (an expanded view) stays inside the record but is not what checkpoint_write stores.
  file_write_atomic(path, replaced(good, sizes + strides, sizes + std::string("(K\x00K\x09K\x03K\x01t", 10)));
  EXPECT_NE(error_of([&] { checkpoint_read(path); }).find("tensor 'conv.weight' of entry 'model' is not contiguous"),
            std::string::npos)
      << error_of([&] { checkpoint_read(path); });
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
