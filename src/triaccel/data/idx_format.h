// IDX file formats without LibTorch (the dataset reader idx.cpp and the fuzz target fuzz/fuzz_idx.cpp share it):
// an images file (magic 0x00000803, big-endian dims N, H, W, then N*H*W pixel bytes) and a labels file (magic
// 0x00000801, big-endian dim N, then N label bytes), each plain or gzip-compressed (gzip recognised by its magic
// bytes 1f 8b, never by the file name).
// Invariants: a file is read whole (a gzip stream is decompressed into memory, at most 1 GiB) before it is parsed,
// so every header field is compared with the real byte count before anything is sized from it; a gzip stream that
// is truncated or fails its checksum is an error, never short data; every label is checked against num_classes.
// Errors are UserError naming the file, the offset (of the decompressed data) and the expected value.
#pragma once

#include <cstdint>
#include <string>

namespace triaccel {

struct IdxImagesHeader {
  uint32_t count;
  uint32_t height;
  uint32_t width;
};

// Both files of a split, read and validated: header.count images of header.height × header.width pixels and as
// many labels, each in [0, num_classes).
struct IdxSplit {
  IdxImagesHeader header{};
  std::string images;  // the whole images file, decompressed; pixels start at kIdxImagesHeaderBytes
  std::string labels;  // the whole labels file, decompressed; labels start at kIdxLabelsHeaderBytes
  const uint8_t* pixels() const;
  const uint8_t* label_bytes() const;
};

constexpr size_t kIdxImagesHeaderBytes = 16;
constexpr size_t kIdxLabelsHeaderBytes = 8;

IdxSplit idx_load(const std::string& images_path, const std::string& labels_path, int64_t num_classes);

}  // namespace triaccel
