// IDX readers for MNIST-style datasets: idx_format.h reads and validates the files (no LibTorch); this file turns
// a validated split into the Dataset's tensors.
#include "triaccel/data/dataset.h"
#include "triaccel/data/idx_format.h"

#include <ATen/ATen.h>

#include <cstring>

namespace triaccel {

Dataset idx_read(const std::string& images_path, const std::string& labels_path, int64_t num_classes) {
  const IdxSplit split = idx_load(images_path, labels_path, num_classes);
  const int64_t n = split.header.count;
  Dataset out;
  out.num_classes = num_classes;
  out.labels = at::empty({n}, at::kLong);  // (N), int64
  int64_t* labels = out.labels.data_ptr<int64_t>();
  const uint8_t* label_bytes = split.label_bytes();
  for (int64_t i = 0; i < n; ++i) labels[i] = label_bytes[i];
  out.images = at::empty({n, 1, int64_t{split.header.height}, int64_t{split.header.width}}, at::kByte);  // (N, 1, H, W)
  std::memcpy(out.images.data_ptr<uint8_t>(), split.pixels(), static_cast<size_t>(out.images.numel()));
  return out;
}

}  // namespace triaccel
