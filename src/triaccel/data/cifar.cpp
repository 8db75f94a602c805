// CIFAR-10 and CIFAR-100 binary readers: cifar_format.h checks and reads the records (no LibTorch); this file
// allocates the Dataset's tensors once from the checked sizes.
#include "triaccel/data/cifar_format.h"
#include "triaccel/data/dataset.h"

#include <ATen/ATen.h>

namespace triaccel {

Dataset cifar_read(const std::vector<std::string>& files, CifarLabel label_kind) {
  const CifarScan scan = cifar_scan(files, label_kind);
  Dataset out;
  out.name = label_kind == CifarLabel::kCifar10 ? "cifar10" : "cifar100";
  out.num_classes = scan.num_classes;
  out.images = at::empty({scan.total, 3, 32, 32}, at::kByte);  // (N, 3, 32, 32), uint8
  out.labels = at::empty({scan.total}, at::kLong);             // (N), int64
  cifar_read_into(files, label_kind, scan, out.images.data_ptr<uint8_t>(), out.labels.data_ptr<int64_t>());
  return out;
}

}  // namespace triaccel
