// libFuzzer target: the character-level text reader's checks and split (data/text_format.h, the tinyshakespeare
// reader's byte layer). The first input byte picks the block size (1 to 64); the rest is input.txt. text_load must
// return a corpus that satisfies text_format.h's invariants, the ones text.cpp relies on when it encodes and cuts
// windows, or throw UserError; anything else is a bug.
#include "fuzz_input.h"
#include "triaccel/core/errors.h"
#include "triaccel/data/text_format.h"

#include <array>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int64_t block_size = 1 + data[0] % 64;
  static const std::string path = triaccel::fuzz::scratch_path("input.txt");
  triaccel::fuzz::scratch_write(path, data + 1, size - 1);
  try {
    const triaccel::TextCorpus c = triaccel::text_load(path, "tinyshakespeare", block_size);
    if (c.text.size() != size - 1 || c.text.find('\0') != std::string::npos) __builtin_trap();
    // The vocabulary: strictly increasing bytes, each present, and every byte of the text in it (text_encode's ids).
    std::array<bool, 256> in_vocab{};
    for (size_t i = 0; i < c.vocab.size(); ++i) {
      if (i > 0 && static_cast<uint8_t>(c.vocab[i - 1]) >= static_cast<uint8_t>(c.vocab[i])) __builtin_trap();
      in_vocab[static_cast<uint8_t>(c.vocab[i])] = true;
    }
    std::array<bool, 256> in_text{};
    for (const char ch : c.text) in_text[static_cast<uint8_t>(ch)] = true;
    if (in_vocab != in_text) __builtin_trap();
    // The split and its windows: text.cpp narrows [0, train_len) and [train_len, len), then cuts count windows of
    // block_size + 1 characters in each.
    if (c.train_len < 0 || c.val_len < 0 || c.train_len + c.val_len != static_cast<int64_t>(c.text.size())) {
      __builtin_trap();
    }
    for (const int64_t len : {c.train_len, c.val_len}) {
      const int64_t count = triaccel::text_window_count(len, block_size);
      if (count < 1 || count * block_size + 1 > len) __builtin_trap();
    }
  } catch (const triaccel::UserError&) {
  }
  return 0;
}
