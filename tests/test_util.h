// Shared helpers for the unit tests: scratch folders, GPU detection, tiny datasets and the fixture of the short
// CPU training runs (TinyMnistTest).
#pragma once

#include "triaccel/models/model.h"

#include <torch/cuda.h>

#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>

namespace triaccel::test {

// A small GPT for fast tests: 2 layers, 2 heads, width 32, context 16, vocabulary 11.
inline ModelOptions gpt_tiny_options() {
  ModelOptions options;
  options.name = "gpt-char";
  options.num_classes = 11;
  options.block_size = 16;
  options.gpt_layers = 2;
  options.gpt_heads = 2;
  options.gpt_embed = 32;
  return options;
}

// A fresh, empty folder under the system temp dir, removed when the object dies.
class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() / ("triaccel_" + tag + "_" + std::to_string(rd()));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string path() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

inline bool gpu_available() { return torch::cuda::is_available(); }

// The repository's root: $TRIACCEL_SOURCE_DIR when set (a test binary run on another machine, e.g. the GPU one),
// else the source folder it was built from.
// (Defined in test_main.cpp, the one file compiled with that folder's path.)
std::string source_dir();

}  // namespace triaccel::test

#define TRIACCEL_SKIP_WITHOUT_GPU() \
  if (!::triaccel::test::gpu_available()) GTEST_SKIP() << "no CUDA GPU"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <gtest/gtest.h>
#include <torch/serialize.h>

#include "triaccel/api/api.h"
#include "triaccel/core/dist.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"
#include "triaccel/run/config.h"
#include "triaccel/models/registry.h"
#include "triaccel/run/session.h"

#include <cstdint>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <map>
#include <thread>
#include <utility>
#include <vector>

namespace triaccel::test {

// Writes an uncompressed IDX file (big-endian header) of uint8 data with the given dims.
inline void idx_write(const std::string& path, uint32_t magic, const std::vector<uint32_t>& dims,
                      const at::Tensor& data_u8) {
  std::ofstream out(path, std::ios::binary);
  auto be32 = [&](uint32_t v) {
    const unsigned char b[4] = {static_cast<unsigned char>(v >> 24), static_cast<unsigned char>(v >> 16),
                                static_cast<unsigned char>(v >> 8), static_cast<unsigned char>(v)};
    out.write(reinterpret_cast<const char*>(b), 4);
  };
  be32(magic);
  for (uint32_t d : dims) be32(d);
  const at::Tensor c = data_u8.contiguous();
  out.write(static_cast<const char*>(c.data_ptr()), c.numel());
}

// A tiny MNIST-layout dataset (random 28×28 images whose mean brightness depends on the label, so it is learnable)
// in dir, readable with --dataset mnist --data dir.
inline void mnist_like_write(const std::string& dir, int64_t n_train, int64_t n_test, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto split = [&](const std::string& prefix, int64_t n) {
    const at::Tensor labels = at::randint(0, 10, {n}, gen, at::kLong);
    const at::Tensor noise = at::randint(0, 100, {n, 28, 28}, gen, at::kLong);
    const at::Tensor images = (noise + labels.view({n, 1, 1}) * 15).clamp(0, 255).to(at::kByte);
    idx_write(dir + "/" + prefix + "-images-idx3-ubyte", 0x803, {static_cast<uint32_t>(n), 28, 28}, images);
    idx_write(dir + "/" + prefix + "-labels-idx1-ubyte", 0x801, {static_cast<uint32_t>(n)}, labels.to(at::kByte));
  };
  split("train", n_train);
  split("t10k", n_test);
}

// A configuration from (key, text) pairs, each set as a user would set it (Config::set: the key counts as given).
inline Config config_of(std::initializer_list<std::pair<const char*, std::string>> options) {
  Config c;
  for (const auto& [key, text] : options) c.set(key, text);
  return c;
}

// A test suite's fixture: a tiny MNIST-layout dataset (384 training, 128 test images) written once per suite, and
// the configuration of a short CPU run on it (small-cnn, 2 epochs of 6 steps at batch 64). The trainer and fault
// tests derive from it.
class TinyMnistTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    data_ = new TempDir("tiny_mnist");
    mnist_like_write(data_->path(), 384, 128, 1);
  }
  static void TearDownTestSuite() {
    delete data_;
    data_ = nullptr;
  }

  static Config options(const std::string& out) {
    return config_of({{"model", "small-cnn"},
                      {"dataset", "mnist"},
                      {"data_dir", data_->path()},
                      {"epochs", "2"},
                      {"batch_size", "64"},  // 6 steps per epoch
                      {"lr", "0.05"},
                      {"warmup_epochs", "0.5"},
                      {"device", "cpu"},
                      {"progress", "off"},
                      {"out", out}});
  }

  // A Tri-Accel loop small enough for these runs: a control window every 2 steps, probes every 4 of 16 samples, k = 2,
  // at most 3 products per eigenvalue; `curv_budget` "0" is the fixed schedule.
  static Config with_tri_accel(Config c, const std::string& curv_budget) {
    for (const auto& [key, text] : {std::pair<const char*, std::string>{"method", "tri-accel"},
                                    {"ctrl_every", "2"},
                                    {"curv_every", "4"},
                                    {"curv_batch", "16"},
                                    {"curv_top_k", "2"},
                                    {"curv_max_iters", "3"},
                                    {"curv_budget", curv_budget}}) {
      c.set(key, text);
    }
    return c;
  }
  // An AdamW-family optimizer with BAOC's cadence for these runs: it plans after 2 steps and again every 3, within
  // 20 % of fp32 AdamW's state (lr 2e-3, weight decay 0.01).
  static Config with_optimizer(Config c, const std::string& optimizer) {
    for (const auto& [key, text] : {std::pair<const char*, std::string>{"optimizer", optimizer},
                                    {"lr", "2e-3"},
                                    {"weight_decay", "0.01"},
                                    {"plan_warmup", "2"},
                                    {"replan_every", "3"},
                                    {"optim_memory_budget", "20%"}}) {
      c.set(key, text);
    }
    return c;
  }

  // Per epoch, the (offset, count) of every batch the trainer reported through RunHooks::on_batch.
  using Spans = std::vector<std::vector<std::pair<int64_t, int64_t>>>;
  static void record_batches(RunHooks& hooks, Spans& spans) {
    hooks.on_batch = [&spans](int64_t epoch, int64_t offset, int64_t count) {
      spans[static_cast<size_t>(epoch)].emplace_back(offset, count);
    };
  }
  // Every epoch's batches tile [0, n): no gap (a lost batch) and no overlap (a repeated one).
  static void expect_every_sample_once(const Spans& spans, int64_t n) {
    for (const auto& epoch : spans) {
      int64_t next = 0;
      for (const auto& [offset, count] : epoch) {
        EXPECT_EQ(offset, next);
        next = offset + count;
      }
      EXPECT_EQ(next, n);
    }
  }

  static inline TempDir* data_ = nullptr;
};

// A file torch.save wrote (our model.pt / exit_model.pt), as the IValue PyTorch's torch.load would see.
inline at::IValue pickle_file_read(const std::string& path) {
  const std::string bytes = file_read_all(path);
  return torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end()));
}

// A state_dict file as name → tensor.
inline std::map<std::string, at::Tensor> state_dict_read(const std::string& path) {
  std::map<std::string, at::Tensor> out;
  for (const auto& kv : pickle_file_read(path).toGenericDict()) out[kv.key().toStringRef()] = kv.value().toTensor();
  return out;
}

// Deterministic cuDNN, no TF32, no autotuning for the scope; the previous settings come back after.
class DeterministicCudnn {
 public:
  DeterministicCudnn() {
    ctx_.setDeterministicCuDNN(true);
    ctx_.setBenchmarkCuDNN(false);
    ctx_.setAllowTF32CuDNN(false);
  }
  ~DeterministicCudnn() {
    ctx_.setDeterministicCuDNN(det_);
    ctx_.setBenchmarkCuDNN(bench_);
    ctx_.setAllowTF32CuDNN(tf32_);
  }
  DeterministicCudnn(const DeterministicCudnn&) = delete;
  DeterministicCudnn& operator=(const DeterministicCudnn&) = delete;

 private:
  at::Context& ctx_ = at::globalContext();
  bool det_ = ctx_.deterministicCuDNN(), bench_ = ctx_.benchmarkCuDNN(), tf32_ = ctx_.allowTF32CuDNN();
};

// Runs body(rank, dist) on two ranks (threads of this process, each its own Dist over one Gloo group whose store is
// at `port` on this host; a broken group fails in a minute); returns each rank's error ("" for none).
inline std::vector<std::string> on_two_ranks(int port, const std::function<void(int, Dist&)>& body) {
  DistOptions base;
  base.world_size = 2;
  base.master_port = port;
  base.timeout = std::chrono::seconds(60);
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        DistOptions o = base;
        o.rank = r;
        Dist dist(o);
        body(r, dist);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  return errors;
}

// The message of the UserError that f throws, or "<no error>".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "<no error>";
}

}  // namespace triaccel::test
