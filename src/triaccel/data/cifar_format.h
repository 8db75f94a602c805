// CIFAR binary formats without LibTorch (the reader cifar.cpp and the fuzz target fuzz/fuzz_cifar.cpp share it).
// A file is a sequence of fixed-size records: the label byte(s), then 3,072 planar pixel bytes (the R plane, the G
// plane, the B plane, each 32x32 row-major), which is exactly the (C, H, W) layout of one image. CIFAR-10 records
// have 1 label byte; CIFAR-100 records a coarse and a fine label byte.
// Invariants: every file is checked (exists, non-empty, size a multiple of the record size) before anything is
// sized from it; every label byte of every record (both for CIFAR-100) is checked against its class count; a file
// that shrinks while it is read is an error, never short data. Errors are UserError naming file, offset, expectation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace triaccel {

enum class CifarLabel { kCifar10, kCifar100Fine, kCifar100Coarse };

constexpr int64_t kCifarImageBytes = 3 * 32 * 32;  // 3072

struct CifarScan {
  std::vector<int64_t> records;  // per file
  int64_t total = 0;
  int64_t num_classes = 0;       // of the label the reader returns
};

// Checks every file's size; the record counts to allocate for.
CifarScan cifar_scan(const std::vector<std::string>& files, CifarLabel label_kind);

// Reads the files scanned into images (total × 3072 bytes) and labels (total), checking every label.
void cifar_read_into(const std::vector<std::string>& files, CifarLabel label_kind, const CifarScan& scan,
                     uint8_t* images, int64_t* labels);

}  // namespace triaccel
