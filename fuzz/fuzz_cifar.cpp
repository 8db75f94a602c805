// libFuzzer target: the CIFAR binary reader (data/cifar_format.h). The first input byte picks CIFAR-10,
// CIFAR-100 fine or coarse labels; the rest is one file. The reader must fill every record with labels in range or
// throw UserError; anything else is a bug.
#include "fuzz_input.h"
#include "triaccel/core/errors.h"
#include "triaccel/data/cifar_format.h"

#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const triaccel::CifarLabel kinds[] = {triaccel::CifarLabel::kCifar10, triaccel::CifarLabel::kCifar100Fine,
                                        triaccel::CifarLabel::kCifar100Coarse};
  const triaccel::CifarLabel kind = kinds[data[0] % 3];
  static const std::string path = triaccel::fuzz::scratch_path("cifar.bin");
  triaccel::fuzz::scratch_write(path, data + 1, size - 1);
  try {
    const std::vector<std::string> files{path};
    const triaccel::CifarScan scan = triaccel::cifar_scan(files, kind);
    std::vector<uint8_t> images(static_cast<size_t>(scan.total * triaccel::kCifarImageBytes));
    std::vector<int64_t> labels(static_cast<size_t>(scan.total), -1);
    triaccel::cifar_read_into(files, kind, scan, images.data(), labels.data());
    for (const int64_t label : labels) {
      if (label < 0 || label >= scan.num_classes) __builtin_trap();
    }
  } catch (const triaccel::UserError&) {
  }
  return 0;
}
