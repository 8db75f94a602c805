// CIFAR binary formats: size checks and record reading, no LibTorch (cifar_format.h).
#include "triaccel/data/cifar_format.h"

#include "triaccel/core/errors.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>

namespace triaccel {

namespace {

constexpr int64_t kCifarRecordsPerRead = 1024;                                  // ~3 MB read buffer

struct CifarLabelField {
  const char* name;     // as it appears in error messages
  int64_t offset;       // byte offset inside the record
  int64_t num_classes;  // valid values are 0..num_classes-1
};

struct CifarLayout {
  const char* format;  // "CIFAR-10" or "CIFAR-100"
  std::vector<CifarLabelField> fields;
  size_t returned_field;  // index into fields of the label the Dataset gets

  int64_t record_bytes() const { return static_cast<int64_t>(fields.size()) + kCifarImageBytes; }
  int64_t label_bytes() const { return static_cast<int64_t>(fields.size()); }
};

CifarLayout cifar_layout(CifarLabel kind) {
  const CifarLabelField coarse{"coarse label", 0, 20};
  const CifarLabelField fine{"fine label", 1, 100};
  switch (kind) {
    case CifarLabel::kCifar10:
      return {"CIFAR-10", {{"label", 0, 10}}, 0};
    case CifarLabel::kCifar100Coarse:
      return {"CIFAR-100", {coarse, fine}, 0};
    case CifarLabel::kCifar100Fine:
      return {"CIFAR-100", {coarse, fine}, 1};
  }
  throw std::logic_error("cifar: unknown CifarLabel value " + std::to_string(static_cast<int>(kind)));
}

// Returns the number of records in path after checking that the file exists and holds whole records.
int64_t cifar_count_records(const std::string& path, const CifarLayout& layout) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    const int err = errno;
    TRIACCEL_CHECK_INPUT(err != ENOENT && err != ENOTDIR, "cifar: ", path, ": file not found");
    throw UserError(str_cat("cifar: ", path, ": cannot access the file: ", std::strerror(err)));
  }
  TRIACCEL_CHECK_INPUT(S_ISREG(info.st_mode), "cifar: ", path, ": not a regular file");
  const auto size = static_cast<uintmax_t>(info.st_size);
  const auto record = static_cast<uintmax_t>(layout.record_bytes());
  TRIACCEL_CHECK_INPUT(size > 0, "cifar: ", path, ": file is empty, expected records of ", record, " bytes (",
                       layout.format, " binary)");
  TRIACCEL_CHECK_INPUT(size % record == 0, "cifar: ", path, ": size ", size, " is not a multiple of the record size ",
                       record, " (truncated or not ", layout.format, " binary)");
  return static_cast<int64_t>(size / record);
}

// Reads the records of one file into images[first..first+records) and labels[first..first+records).
void cifar_read_file(const std::string& path, const CifarLayout& layout, int64_t records, uint8_t* images,
                     int64_t* labels) {
  std::unique_ptr<FILE, int (*)(FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  TRIACCEL_CHECK_INPUT(file != nullptr, "cifar: ", path, ": cannot open: ", std::strerror(errno));
  const int64_t record = layout.record_bytes();
  const CifarLabelField& returned = layout.fields[layout.returned_field];
  std::vector<uint8_t> buffer(static_cast<size_t>(std::min(records, kCifarRecordsPerRead) * record));
  for (int64_t first = 0; first < records; first += kCifarRecordsPerRead) {
    const int64_t count = std::min(kCifarRecordsPerRead, records - first);
    const auto want = static_cast<size_t>(count * record);
    const size_t got = std::fread(buffer.data(), 1, want, file.get());
    TRIACCEL_CHECK_INPUT(got == want, "cifar: ", path, ": read ", got, " of ", want, " bytes at offset ",
                         first * record, " (the file shrank while it was read, or a read error)");
    for (int64_t i = 0; i < count; ++i) {
      const uint8_t* rec = buffer.data() + i * record;
      const int64_t index = first + i;
      for (const CifarLabelField& field : layout.fields) {
        const int value = rec[field.offset];
        TRIACCEL_CHECK_INPUT(value < field.num_classes, "cifar: ", path, ": record ", index, " (offset ",
                             index * record + field.offset, ") has ", field.name, " ", value, ", expected 0..",
                             field.num_classes - 1);
      }
      labels[index] = rec[returned.offset];
      std::memcpy(images + index * kCifarImageBytes, rec + layout.label_bytes(), kCifarImageBytes);
    }
  }
}

}  // namespace

CifarScan cifar_scan(const std::vector<std::string>& files, CifarLabel label_kind) {
  const CifarLayout layout = cifar_layout(label_kind);
  TRIACCEL_CHECK_INPUT(!files.empty(), "cifar: no ", layout.format, " files given");
  CifarScan scan;
  for (const std::string& path : files) {
    scan.records.push_back(cifar_count_records(path, layout));
    scan.total += scan.records.back();
  }
  scan.num_classes = layout.fields[layout.returned_field].num_classes;
  return scan;
}

void cifar_read_into(const std::vector<std::string>& files, CifarLabel label_kind, const CifarScan& scan,
                     uint8_t* images, int64_t* labels) {
  const CifarLayout layout = cifar_layout(label_kind);
  int64_t first = 0;
  for (size_t f = 0; f < files.size(); ++f) {
    cifar_read_file(files[f], layout, scan.records[f], images + first * kCifarImageBytes, labels + first);
    first += scan.records[f];
  }
}

}  // namespace triaccel
