// Character-level text datasets (dataset.h: text_read). The vocabulary is the sorted set of distinct bytes of the
// whole file (65 characters for tinyshakespeare); the split is the usual one (first 90 % train, last 10 %
// validation). Invariants: samples are windows of block_size + 1 characters at stride block_size, inputs
// (N, T) int64 = window[0 .. T), targets (N, T) int64 = window[1 .. T]; inputs of different samples never
// overlap; every id is in [0, vocab size). The file is checked (non-empty, text, long enough) before it is used
// (text_format.cpp, without LibTorch, so that fuzz/fuzz_text.cpp can fuzz it).
#include "triaccel/data/dataset.h"
#include "triaccel/data/text_format.h"

#include "triaccel/core/errors.h"

#include <ATen/ATen.h>

#include <array>

namespace triaccel {

namespace {

// Splits ids (len) into (N, T) inputs and targets, windows of T + 1 at stride T.
void text_windows(const at::Tensor& ids, int64_t block_size, at::Tensor& inputs, at::Tensor& targets) {
  const int64_t n = text_window_count(ids.numel(), block_size);
  inputs = ids.narrow(0, 0, n * block_size).view({n, block_size}).clone();
  targets = ids.narrow(0, 1, n * block_size).view({n, block_size}).clone();
}

}  // namespace

at::Tensor text_encode(const std::string& text, const std::string& vocab) {
  std::array<int64_t, 256> id;
  id.fill(-1);
  for (size_t i = 0; i < vocab.size(); ++i) id[static_cast<unsigned char>(vocab[i])] = static_cast<int64_t>(i);
  at::Tensor out = at::empty({static_cast<int64_t>(text.size())}, at::kLong);
  int64_t* data = out.data_ptr<int64_t>();
  for (size_t i = 0; i < text.size(); ++i) {
    const int64_t v = id[static_cast<unsigned char>(text[i])];
    TRIACCEL_CHECK_INPUT(v >= 0, "text_encode: byte ", static_cast<int>(static_cast<unsigned char>(text[i])),
                         " at offset ", i, " is not in the vocabulary");
    data[i] = v;
  }
  return out;
}

std::string text_decode(const at::Tensor& ids_in, const std::string& vocab) {
  const at::Tensor ids = ids_in.to(at::kLong).contiguous().cpu().view({-1});
  const int64_t* data = ids.data_ptr<int64_t>();
  std::string out;
  out.reserve(static_cast<size_t>(ids.numel()));
  for (int64_t i = 0; i < ids.numel(); ++i) {
    TORCH_CHECK(data[i] >= 0 && data[i] < static_cast<int64_t>(vocab.size()), "text_decode: id ", data[i],
                " out of range [0, ", vocab.size(), ")");
    out.push_back(vocab[static_cast<size_t>(data[i])]);
  }
  return out;
}

DatasetSplits text_read(const std::string& path, const std::string& name, int64_t block_size) {
  const TextCorpus corpus = text_load(path, name, block_size);
  DatasetSplits out;
  const std::string& vocab = corpus.vocab;
  const at::Tensor ids = text_encode(corpus.text, vocab);  // (len) int64
  for (Dataset* split : {&out.train, &out.test}) {
    split->name = name;
    split->kind = DatasetKind::kTokens;
    split->num_classes = static_cast<int64_t>(vocab.size());
    split->vocab = vocab;
  }
  text_windows(ids.narrow(0, 0, corpus.train_len), block_size, out.train.images, out.train.labels);
  text_windows(ids.narrow(0, corpus.train_len, corpus.val_len), block_size, out.test.images, out.test.labels);
  return out;
}

}  // namespace triaccel
