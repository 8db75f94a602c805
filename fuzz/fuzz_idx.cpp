// libFuzzer target: the IDX reader (data/idx_format.h), plain and gzip. The input is split in two files, images and
// labels, at the offset its first two bytes give (modulo the rest's length); each may be gzip (magic 1f 8b). The
// reader must return a consistent split or throw UserError; anything else (a crash, a sanitizer report, another
// exception type) is a bug.
#include "fuzz_input.h"
#include "triaccel/core/errors.h"
#include "triaccel/data/idx_format.h"

#include <cstring>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const size_t rest = size - 2;
  const size_t cut = rest == 0 ? 0 : ((size_t{data[0]} << 8) | data[1]) % (rest + 1);
  static const std::string images = triaccel::fuzz::scratch_path("images");
  static const std::string labels = triaccel::fuzz::scratch_path("labels");
  triaccel::fuzz::scratch_write(images, data + 2, cut);
  triaccel::fuzz::scratch_write(labels, data + 2 + cut, rest - cut);
  try {
    const triaccel::IdxSplit split = triaccel::idx_load(images, labels, 10);
    // What the tensor reader then copies must lie inside the buffers.
    const size_t pixels = size_t{split.header.count} * split.header.height * split.header.width;
    if (split.images.size() != triaccel::kIdxImagesHeaderBytes + pixels) __builtin_trap();
    if (split.labels.size() != triaccel::kIdxLabelsHeaderBytes + split.header.count) __builtin_trap();
    for (uint32_t i = 0; i < split.header.count; ++i) {
      if (split.label_bytes()[i] >= 10) __builtin_trap();
    }
    if (pixels > 0) {
      volatile uint8_t last = split.pixels()[pixels - 1];  // ASan: the last pixel the copy reads
      (void)last;
    }
  } catch (const triaccel::UserError&) {
  }
  return 0;
}
