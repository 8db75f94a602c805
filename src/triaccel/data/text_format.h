// The character-level text corpus without LibTorch (the reader text.cpp and the fuzz target fuzz/fuzz_text.cpp share
// it): the file's checks, its vocabulary and its 90 % / 10 % split.
// Invariants of a TextCorpus: text is the whole file, non-empty, without a NUL byte; vocab is the sorted set of its
// distinct bytes (a byte's id is its index); train_len + val_len = text.size() and each split holds at least one
// window of block_size + 1 characters, i.e. text_window_count(split length, block_size) >= 1.
#pragma once

#include <cstdint>
#include <string>

namespace triaccel {

struct TextCorpus {
  std::string text;
  std::string vocab;
  int64_t train_len = 0;  // the first 90 % of the characters
  int64_t val_len = 0;    // the rest
};

// Reads and checks the file; UserError (naming name and path) for an empty or binary file or one too short.
TextCorpus text_load(const std::string& path, const std::string& name, int64_t block_size);

std::string text_vocab(const std::string& text);  // sorted distinct bytes

// Windows of block_size + 1 characters at stride block_size in a split of len characters: the last one ends at
// character count * block_size + 1 <= len.
inline int64_t text_window_count(int64_t len, int64_t block_size) { return (len - 1) / block_size; }

}  // namespace triaccel
