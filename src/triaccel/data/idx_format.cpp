// IDX formats: reading (plain or gzip) and validation, no LibTorch (idx_format.h).
#include "triaccel/data/idx_format.h"

#include "triaccel/core/errors.h"

#include <sys/stat.h>
#include <zlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

namespace triaccel {

namespace {

constexpr uint32_t kIdxImagesMagic = 0x00000803;  // unsigned bytes, 3 dims
constexpr uint32_t kIdxLabelsMagic = 0x00000801;  // unsigned bytes, 1 dim
constexpr size_t kIdxImagesHeader = kIdxImagesHeaderBytes;
constexpr size_t kIdxLabelsHeader = kIdxLabelsHeaderBytes;
constexpr size_t kIdxMaxBytes = size_t{1} << 30;  // sanity cap on a decompressed IDX file (MNIST train: 47 MB)
constexpr size_t kIdxReadChunk = size_t{1} << 20;

struct IdxBytes {
  std::string path;
  std::string bytes;  // the whole file, decompressed
  bool gzip = false;

  const uint8_t* data() const { return reinterpret_cast<const uint8_t*>(bytes.data()); }
  const char* size_name() const { return gzip ? "decompressed size" : "size"; }
};

uint32_t idx_be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

std::string idx_hex32(uint32_t value) {
  char text[16];
  std::snprintf(text, sizeof(text), "0x%08x", value);
  return text;
}

// a*b*c as decimal text, or a note that it exceeds 64 bits.
std::string idx_product_text(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t ab = 0;
  uint64_t abc = 0;
  if (__builtin_mul_overflow(a, b, &ab) || __builtin_mul_overflow(ab, c, &abc)) return "more than 2^64";
  return std::to_string(abc);
}

std::string idx_gunzip(const std::string& path) {
  std::unique_ptr<gzFile_s, int (*)(gzFile)> gz(gzopen(path.c_str(), "rb"), &gzclose);
  TRIACCEL_CHECK_INPUT(gz != nullptr, "idx: ", path, ": cannot open: ", std::strerror(errno));
  gzbuffer(gz.get(), 1 << 17);
  std::string out;
  std::vector<char> chunk(kIdxReadChunk);
  int got = 0;
  while ((got = gzread(gz.get(), chunk.data(), static_cast<unsigned>(chunk.size()))) > 0) {
    TRIACCEL_CHECK_INPUT(out.size() + static_cast<size_t>(got) <= kIdxMaxBytes, "idx: ", path,
                         ": gzip data decompresses to more than ", kIdxMaxBytes,
                         " bytes, the limit for an IDX file (corrupt, or not an IDX file)");
    out.append(chunk.data(), static_cast<size_t>(got));
  }
  int status = Z_OK;
  std::string reason = gzerror(gz.get(), &status);
  if (reason.rfind(path + ": ", 0) == 0) reason.erase(0, path.size() + 2);  // zlib prefixes the path
  TRIACCEL_CHECK_INPUT(got == 0 && status == Z_OK, "idx: ", path, ": corrupt or truncated gzip data after ", out.size(),
                       " decompressed bytes: ", reason, " (download the file again)");
  return out;
}

IdxBytes idx_read_bytes(const std::string& path) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    const int err = errno;
    TRIACCEL_CHECK_INPUT(err != ENOENT && err != ENOTDIR, "idx: ", path, ": file not found");
    throw UserError(str_cat("idx: ", path, ": cannot access the file: ", std::strerror(err)));
  }
  TRIACCEL_CHECK_INPUT(S_ISREG(info.st_mode), "idx: ", path, ": not a regular file");
  const auto size = static_cast<uintmax_t>(info.st_size);
  TRIACCEL_CHECK_INPUT(size > 0, "idx: ", path, ": file is empty, expected an IDX file");
  TRIACCEL_CHECK_INPUT(size <= kIdxMaxBytes, "idx: ", path, ": size ", size, " exceeds ", kIdxMaxBytes,
                       " bytes, the limit for an IDX file");

  IdxBytes out;
  out.path = path;
  std::unique_ptr<FILE, int (*)(FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  TRIACCEL_CHECK_INPUT(file != nullptr, "idx: ", path, ": cannot open: ", std::strerror(errno));
  uint8_t head[2] = {0, 0};
  const size_t head_got = std::fread(head, 1, sizeof(head), file.get());
  out.gzip = head_got == 2 && head[0] == 0x1f && head[1] == 0x8b;
  if (out.gzip) {
    file.reset();
    out.bytes = idx_gunzip(path);
    return out;
  }
  out.bytes.resize(static_cast<size_t>(size));
  std::memcpy(out.bytes.data(), head, head_got);
  const size_t got = head_got + std::fread(out.bytes.data() + head_got, 1, out.bytes.size() - head_got, file.get());
  TRIACCEL_CHECK_INPUT(got == out.bytes.size(), "idx: ", path, ": read ", got, " of ", out.bytes.size(),
                       " bytes (the file shrank while it was read, or a read error)");
  return out;
}

void idx_check_magic(const IdxBytes& file, uint32_t expected, const char* kind) {
  TRIACCEL_CHECK_INPUT(file.bytes.size() >= 4, "idx: ", file.path, ": ", file.size_name(), " ", file.bytes.size(),
                       " is shorter than the 4-byte magic, expected ", idx_hex32(expected), " (", kind, ")");
  const uint32_t magic = idx_be32(file.data());
  TRIACCEL_CHECK_INPUT(magic == expected, "idx: ", file.path, ": magic ", idx_hex32(magic), ", expected ",
                       idx_hex32(expected), " (", kind, ")");
}

IdxImagesHeader idx_parse_images(const IdxBytes& file) {
  idx_check_magic(file, kIdxImagesMagic, "images file");
  const size_t size = file.bytes.size();
  TRIACCEL_CHECK_INPUT(size >= kIdxImagesHeader, "idx: ", file.path, ": ", file.size_name(), " ", size,
                       " is shorter than the ", kIdxImagesHeader, "-byte images header (magic, N, H, W)");
  const IdxImagesHeader h{idx_be32(file.data() + 4), idx_be32(file.data() + 8), idx_be32(file.data() + 12)};
  TRIACCEL_CHECK_INPUT(h.height > 0 && h.width > 0, "idx: ", file.path, ": image size ", h.height, "x", h.width,
                       " (offsets 8 and 12), expected both > 0");
  const uint64_t payload = size - kIdxImagesHeader;
  const uint64_t plane = uint64_t{h.height} * h.width;  // < 2^64: both factors are < 2^32
  TRIACCEL_CHECK_INPUT(payload % plane == 0 && payload / plane == h.count, "idx: ", file.path, ": dims ", h.count, "x",
                       h.height, "x", h.width, " need ", idx_product_text(h.count, h.height, h.width),
                       " pixel bytes after the ", kIdxImagesHeader, "-byte header, found ", payload,
                       " (truncated or wrong dims)");
  return h;
}

uint32_t idx_parse_labels(const IdxBytes& file) {
  idx_check_magic(file, kIdxLabelsMagic, "labels file");
  const size_t size = file.bytes.size();
  TRIACCEL_CHECK_INPUT(size >= kIdxLabelsHeader, "idx: ", file.path, ": ", file.size_name(), " ", size,
                       " is shorter than the ", kIdxLabelsHeader, "-byte labels header (magic, N)");
  const uint32_t count = idx_be32(file.data() + 4);
  const uint64_t payload = size - kIdxLabelsHeader;
  TRIACCEL_CHECK_INPUT(payload == count, "idx: ", file.path, ": header says ", count, " labels, found ", payload,
                       " label bytes after the ", kIdxLabelsHeader, "-byte header (truncated or wrong count)");
  return count;
}

}  // namespace


const uint8_t* IdxSplit::pixels() const {
  return reinterpret_cast<const uint8_t*>(images.data()) + kIdxImagesHeaderBytes;
}
const uint8_t* IdxSplit::label_bytes() const {
  return reinterpret_cast<const uint8_t*>(labels.data()) + kIdxLabelsHeaderBytes;
}

IdxSplit idx_load(const std::string& images_path, const std::string& labels_path, int64_t num_classes) {
  TRIACCEL_CHECK_INPUT(num_classes >= 1 && num_classes <= 256, "idx: num_classes must be in 1..256, got ", num_classes);
  IdxBytes images_file = idx_read_bytes(images_path);
  const IdxImagesHeader header = idx_parse_images(images_file);
  IdxBytes labels_file = idx_read_bytes(labels_path);
  const uint32_t label_count = idx_parse_labels(labels_file);
  TRIACCEL_CHECK_INPUT(label_count == header.count, "idx: ", images_path, " has ", header.count, " images but ",
                       labels_path, " has ", label_count, " labels, expected the same count");
  const uint8_t* label_bytes = labels_file.data() + kIdxLabelsHeader;
  for (uint32_t i = 0; i < header.count; ++i) {
    const int value = label_bytes[i];
    TRIACCEL_CHECK_INPUT(value < num_classes, "idx: ", labels_path, ": item ", i, " (offset ",
                         static_cast<int64_t>(kIdxLabelsHeader) + i, ") has label ", value, ", expected 0..",
                         num_classes - 1);
  }
  IdxSplit out;
  out.header = header;
  out.images = std::move(images_file.bytes);
  out.labels = std::move(labels_file.bytes);
  return out;
}

}  // namespace triaccel
