// The text corpus checks and split, no LibTorch (text_format.h).
#include "triaccel/data/text_format.h"

#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"

#include <array>

namespace triaccel {

namespace {

constexpr double kTrainShare = 0.9;

}  // namespace

std::string text_vocab(const std::string& text) {
  std::array<bool, 256> present{};
  for (const char c : text) present[static_cast<unsigned char>(c)] = true;
  std::string vocab;
  for (int b = 0; b < 256; ++b) {
    if (present[b]) vocab.push_back(static_cast<char>(b));
  }
  return vocab;
}

TextCorpus text_load(const std::string& path, const std::string& name, int64_t block_size) {
  TRIACCEL_CHECK_INPUT(block_size >= 1, option_ref("block_size") + " must be >= 1, got ", block_size);
  TextCorpus out;
  out.text = file_read_all(path);
  const std::string& text = out.text;
  TRIACCEL_CHECK_INPUT(!text.empty(), name, ": ", path, " is empty; expected a plain-text corpus (input.txt)");
  const size_t nul = text.find('\0');
  TRIACCEL_CHECK_INPUT(nul == std::string::npos, name, ": ", path, " has a NUL byte at offset ", nul,
                       ", so it is not plain text; expected a plain-text corpus (input.txt)");
  const int64_t len = static_cast<int64_t>(text.size());
  out.train_len = static_cast<int64_t>(static_cast<double>(len) * kTrainShare);
  out.val_len = len - out.train_len;
  TRIACCEL_CHECK_INPUT(out.train_len >= block_size + 1 && out.val_len >= block_size + 1, name, ": ", path, " has ",
                       len, " characters, too few for one window of ", block_size + 1,
                       " in each split (90 % train / 10 % validation); use a longer file or a smaller " + option_ref("block_size"));
  out.vocab = text_vocab(text);
  return out;
}

}  // namespace triaccel
