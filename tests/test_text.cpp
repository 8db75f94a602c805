// Tests for the text dataset (data/text.cpp), the loader's token pass-through, the loss/accuracy flattening of
// TrainStep and the trainer, and the model/dataset checks of Config. Every text file is written by the test.
// The learning test trains a tiny GPT on a repetitive text and requires the validation cross-entropy to fall below
// the text's unigram entropy, which a model that ignores the context (or does not train) cannot reach.
#include "test_util.h"

#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"
#include "triaccel/data/dataset.h"
#include "triaccel/data/loader.h"
#include "triaccel/models/model.h"
#include "triaccel/models/registry.h"
#include "triaccel/train/loss_scaler.h"
#include "triaccel/run/config.h"
#include "triaccel/optim/sgd.h"
#include "triaccel/train/step.h"
#include "triaccel/methods/backprop_trainer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>

namespace triaccel {
namespace {

void text_write(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

std::string text_repeated(const std::string& phrase, int64_t times) {
  std::string text;
  for (int64_t i = 0; i < times; ++i) text += phrase;
  return text;
}

// A text of exactly n characters with several distinct characters.
std::string text_sample(int64_t n) {
  const std::string alphabet = "First Citizen:\nBefore we proceed any further, hear me speak.\n";
  std::string text;
  for (int64_t i = 0; i < n; ++i) text.push_back(alphabet[static_cast<size_t>((i * 7) % alphabet.size())]);
  return text;
}

using test::error_of;

TEST(Text, VocabularyIsSortedDistinctBytesAndRoundTrips) {
  const std::string text = "hello, world!\nHELLO";
  const std::string vocab = text_vocab(text);
  EXPECT_EQ(vocab, std::string("\n !,EHLOdehlorw"));
  const at::Tensor ids = text_encode(text, vocab);
  EXPECT_EQ(ids.numel(), static_cast<int64_t>(text.size()));
  EXPECT_EQ(ids[0].item<int64_t>(), static_cast<int64_t>(vocab.find('h')));
  EXPECT_EQ(text_decode(ids, vocab), text);
  EXPECT_THROW(text_encode("hex", vocab), UserError);  // 'x' is not in the vocabulary
}

TEST(Text, SplitsAndWindows) {
  test::TempDir dir("text_split");
  const std::string text = text_sample(1000);
  text_write(dir.file("input.txt"), text);
  const DatasetSplits data = dataset_load("tinyshakespeare", dir.path(), 8);
  // 900 training characters → (900 - 1) / 8 = 112 windows; 100 validation characters → 99 / 8 = 12 windows.
  EXPECT_EQ(data.train.kind, DatasetKind::kTokens);
  EXPECT_EQ(data.train.images.sizes(), (std::vector<int64_t>{112, 8}));
  EXPECT_EQ(data.train.labels.sizes(), (std::vector<int64_t>{112, 8}));
  EXPECT_EQ(data.test.images.sizes(), (std::vector<int64_t>{12, 8}));
  EXPECT_EQ(data.train.num_classes, static_cast<int64_t>(text_vocab(text).size()));
  EXPECT_EQ(data.train.vocab, text_vocab(text));
  EXPECT_TRUE(data.mean.empty());
  // Window i: inputs = text[8i, 8i + 8), targets = text[8i + 1, 8i + 9).
  for (int64_t i : {0, 1, 57, 111}) {
    EXPECT_EQ(text_decode(data.train.images[i], data.train.vocab), text.substr(8 * i, 8)) << i;
    EXPECT_EQ(text_decode(data.train.labels[i], data.train.vocab), text.substr(8 * i + 1, 8)) << i;
  }
  EXPECT_EQ(text_decode(data.test.images[0], data.test.vocab), text.substr(900, 8));
  EXPECT_EQ(text_decode(data.test.labels[11], data.test.vocab), text.substr(900 + 88 + 1, 8));
}

TEST(Text, ErrorsNameTheFileAndTheFix) {
  test::TempDir dir("text_errors");
  std::string msg = error_of([&] { dataset_load("tinyshakespeare", dir.path(), 8); });
  EXPECT_NE(msg.find("input.txt"), std::string::npos) << msg;
  EXPECT_NE(msg.find("data_dir"), std::string::npos) << msg;
  // No default folder outside the repository: without one the error says what to pass.
  msg = error_of([&] { dataset_load("tinyshakespeare", "", 8); });
  EXPECT_NE(msg.find("tinyshakespeare has no standard location: pass data_dir"), std::string::npos) << msg;

  text_write(dir.file("input.txt"), "");
  msg = error_of([&] { dataset_load("tinyshakespeare", dir.path(), 8); });
  EXPECT_NE(msg.find("is empty"), std::string::npos) << msg;

  text_write(dir.file("input.txt"), std::string("abc\0def", 7) + text_sample(200));
  msg = error_of([&] { dataset_load("tinyshakespeare", dir.path(), 8); });
  EXPECT_NE(msg.find("NUL byte at offset 3"), std::string::npos) << msg;

  text_write(dir.file("input.txt"), text_sample(50));  // 5 validation characters < one window of 9
  msg = error_of([&] { dataset_load("tinyshakespeare", dir.path(), 8); });
  EXPECT_NE(msg.find("block_size"), std::string::npos) << msg;
  EXPECT_NO_THROW(dataset_load("tinyshakespeare", dir.path(), 4));  // 45 / 5 characters: enough for block 4
}

TEST(Text, LoaderPassesTokensThroughAndVisitsEveryWindowOnce) {
  test::TempDir dir("text_loader");
  text_write(dir.file("input.txt"), text_sample(1000));
  const DatasetSplits data = dataset_load("tinyshakespeare", dir.path(), 8);
  LoaderOptions lo;
  lo.batch_size = 10;
  lo.seed = 3;
  Loader loader(data.train, data.mean, data.std, lo, c10::Device(c10::kCPU));
  EXPECT_EQ(loader.size(), 112);
  loader.epoch_begin(1);
  std::vector<at::Tensor> inputs, targets;
  for (int64_t offset = 0; offset < loader.size(); offset += 10) {
    auto [x, y] = loader.batch(offset, std::min<int64_t>(10, loader.size() - offset));
    EXPECT_EQ(x.scalar_type(), at::kLong);
    EXPECT_EQ(y.dim(), 2);
    inputs.push_back(x);
    targets.push_back(y);
  }
  const at::Tensor x = at::cat(inputs), y = at::cat(targets);
  EXPECT_FALSE(torch::equal(x, data.train.images));  // shuffled
  // Each window exactly once, each input still paired with its own targets: sorting by the first input token
  // and comparing whole rows would be ambiguous, so match every row of the epoch to a dataset row.
  std::map<std::string, std::string> pairs;
  for (int64_t i = 0; i < data.train.size(); ++i) {
    pairs[text_decode(data.train.images[i], data.train.vocab)] = text_decode(data.train.labels[i], data.train.vocab);
  }
  std::multiset<std::string> seen;
  for (int64_t i = 0; i < x.size(0); ++i) {
    const std::string in = text_decode(x[i], data.train.vocab);
    seen.insert(in);
    ASSERT_TRUE(pairs.count(in));
    EXPECT_EQ(pairs[in], text_decode(y[i], data.train.vocab));
  }
  std::multiset<std::string> expected;
  for (int64_t i = 0; i < data.train.size(); ++i) expected.insert(text_decode(data.train.images[i], data.train.vocab));
  EXPECT_EQ(seen, expected);
  // Same seed and epoch → same order.
  Loader again(data.train, data.mean, data.std, lo, c10::Device(c10::kCPU));
  again.epoch_begin(1);
  EXPECT_TRUE(torch::equal(again.batch(0, 10).first, inputs[0]));

  lo.augment = true;
  EXPECT_THROW(Loader(data.train, data.mean, data.std, lo, c10::Device(c10::kCPU)), UserError);
}

TEST(Text, OptionsRejectModelDatasetMismatches) {
  Config o;
  o.set("model", "gpt-char");
  o.set("dataset", "fashion-mnist");
  std::string msg = error_of([&] { o.validate(); });
  EXPECT_NE(msg.find("reads text"), std::string::npos) << msg;
  o.set("model", "resnet18");
  o.set("dataset", "tinyshakespeare");
  msg = error_of([&] { o.validate(); });
  EXPECT_NE(msg.find("use model gpt-char"), std::string::npos) << msg;
  o.set("model", "gpt-char");
  EXPECT_NO_THROW(o.validate());
  o.set("augment", "on");
  EXPECT_NE(error_of([&] { o.validate(); }).find("augment on applies to images only"), std::string::npos);
  o.set("augment", "auto");
  o.set("tta", "flip");
  EXPECT_NE(error_of([&] { o.validate(); }).find("tta flip applies to images only"), std::string::npos);
  o.set("tta", "off");
  // Tri-Accel on the GPT: the Fisher's rounds (the default estimator) need no double backward; the Hessian's do.
  o.set("method", "tri-accel");
  o.resolve();
  EXPECT_NO_THROW(o.validate());
  o.set("curv_estimator", "hessian");
  EXPECT_NE(error_of([&] { o.validate(); }).find("use curv_estimator fisher"), std::string::npos);
  o.set("curv_estimator", "fisher");
  o.set("method", "backprop");
  o.set("block_size", "0");
  EXPECT_NE(error_of([&] { o.validate(); }).find("block_size must be in [1, 8192], got 0"), std::string::npos);
}

// A model of ModelInput::kAny (a torch.nn.Module from Python) reads what the dataset holds: text and images alike,
// where an image model is refused text and the GPT images (above).
TEST(Text, AModelOfAnyInputTakesTextAndImages) {
  static const bool registered = [] {
    model_register({"any-input", "a model that reads what the dataset holds (tests)", ModelInput::kAny,
                    /*double_backward=*/true, /*local_learning=*/false,
                    [](const ModelOptions& options) {  // a real model, for tests that build every registered one
                      ModelOptions small = options;
                      small.name = "small-cnn";
                      return model_create(small);
                    }});
    return true;
  }();
  ASSERT_TRUE(registered);
  Config o;
  o.set("model", "any-input");
  o.set("dataset", "tinyshakespeare");
  EXPECT_NO_THROW(o.validate());
  o.set("dataset", "fashion-mnist");
  EXPECT_NO_THROW(o.validate());
  o.set("dataset", "tinyshakespeare");
  o.set("augment", "on");  // still an image-only option on text
  EXPECT_NE(error_of([&] { o.validate(); }).find("augment on applies to images only"), std::string::npos);
}

// Mean cross-entropy (nats per character) of the model on every window of a split.
double eval_loss(Model& model, const Dataset& split) {
  torch::NoGradGuard no_grad;
  model.eval();
  const at::Tensor logits = model.forward(split.images);  // (N, T, V)
  model.train();
  return at::cross_entropy_loss(logits.flatten(0, 1), split.labels.flatten()).item<double>();
}

TEST(Text, TinyGptLearnsBelowTheUnigramEntropy) {
  test::TempDir dir("text_learn");
  const std::string text = text_repeated("to be, or not to be: that is the question. ", 50);  // 2,150 characters
  text_write(dir.file("input.txt"), text);
  const DatasetSplits data = dataset_load("tinyshakespeare", dir.path(), 16);

  // Unigram entropy of the text: the best loss without context.
  std::map<char, double> counts;
  for (const char c : text) counts[c] += 1;
  double unigram = 0;
  for (const auto& [c, n] : counts) unigram -= n / text.size() * std::log(n / text.size());
  ASSERT_GT(unigram, 2.0);  // ~2.6 nats for this text

  torch::manual_seed(0);
  ModelOptions mo;
  mo.name = "gpt-char";
  mo.num_classes = data.train.num_classes;
  mo.block_size = 16;
  mo.gpt_layers = 2;
  mo.gpt_heads = 2;
  mo.gpt_embed = 32;
  auto model = model_create(mo);
  model->train();
  const double initial = eval_loss(*model, data.test);
  EXPECT_NEAR(initial, std::log(static_cast<double>(data.train.num_classes)), 0.3);  // uniform at init

  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& item : model->named_parameters()) named.emplace_back(item.key(), item.value());
  SgdOptions so;
  so.weight_decay = 0;
  Sgd sgd(named, so);
  LossScaler scaler(LossScalerOptions{}, c10::Device(c10::kCPU));
  StepOptions step_options;
  TrainStep step(*model, sgd, scaler, step_options, c10::Device(c10::kCPU));
  LoaderOptions lo;
  lo.batch_size = 16;
  Loader loader(data.train, data.mean, data.std, lo, c10::Device(c10::kCPU));
  for (int64_t epoch = 0; epoch < 12; ++epoch) {
    loader.epoch_begin(epoch);
    step.metrics_reset();
    for (int64_t offset = 0; offset < loader.size(); offset += lo.batch_size) {
      const int64_t count = std::min(lo.batch_size, loader.size() - offset);
      auto [x, y] = loader.batch(offset, count);
      step.run(x, y, 0.3);
    }
  }
  const double final_loss = eval_loss(*model, data.test);
  RecordProperty("final_loss_x1000", static_cast<int>(1000 * final_loss));
  RecordProperty("unigram_x1000", static_cast<int>(1000 * unigram));
  EXPECT_LT(final_loss, 0.8 * unigram) << "initial " << initial << ", unigram entropy " << unigram;
  // The step's accumulators are per sample: token accuracy in [0, 1] per sample, loss per token.
  const double samples = static_cast<double>(loader.size());
  EXPECT_LE(step.correct_sum().item<double>(), samples + 1e-3);
  EXPECT_GT(step.correct_sum().item<double>() / samples, 0.3);
  EXPECT_LT(step.loss_sum().item<double>() / samples, unigram);
}

TEST(Text, TrainRunReportsTokenMetrics) {
  test::TempDir dir("text_run");
  text_write(dir.file("input.txt"), text_sample(1000));
  test::TempDir out("text_run_out");
  Config o;
  o.set("model", "gpt-char");
  o.set("dataset", "tinyshakespeare");
  o.set("data_dir", dir.path());
  o.set("block_size", "8");
  o.set("batch_size", "64");
  o.set("lr", "0.05");
  o.set("device", "cpu");
  o.set("progress", "off");
  o.set("out", out.path());
  const Json summary = api::run(o);
  EXPECT_EQ(summary.at("model"), "gpt-char");
  EXPECT_EQ(summary.at("params").get<int64_t>(), 10795776 - 256 * 384 + 8 * 384 - 2 * 384 * (65 - 27));
  const double acc = summary.at("test_acc").get<double>();
  EXPECT_GE(acc, 0.0);
  EXPECT_LE(acc, 100.0);
  const double loss = summary.at("test_loss").get<double>();
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_LT(loss, 2.0 * std::log(27.0));
  const std::string events = file_read_all(out.file("events.jsonl"));
  EXPECT_NE(events.find("\"val_loss\""), std::string::npos);
  EXPECT_TRUE(file_exists(out.file("model.pt")));
}

}  // namespace
}  // namespace triaccel
