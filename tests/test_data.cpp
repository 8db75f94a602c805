// Tests of the dataset readers (CIFAR binary, IDX plain and gzip) and of dataset_load, on tiny files written here
// with known pixels and labels, and of every kind of bad input: each must throw a one-line UserError that names
// the file and what was expected. The real Fashion-MNIST is loaded when its Debian package is installed.
// Pixel values are integers, so images compare exactly; channel statistics are floats compared to 1e-6.
#include "triaccel/data/dataset.h"

#include "test_util.h"
#include "triaccel/core/errors.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <zlib.h>

#include <fstream>
#include <iterator>

namespace triaccel {
namespace {

using test::TempDir;

constexpr int64_t kSide = 32;
constexpr int64_t kImageBytes = 3 * kSide * kSide;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_gzip(const std::string& path, const std::string& bytes) {
  gzFile gz = gzopen(path.c_str(), "wb");
  ASSERT_NE(gz, nullptr) << "cannot write " << path;
  if (!bytes.empty()) {
    ASSERT_EQ(gzwrite(gz, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
  }
  ASSERT_EQ(gzclose(gz), Z_OK);
}

// The message of the UserError that f throws, or a marker that fails every check on the message.
template <class F>
std::string user_error_of(F&& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<not a UserError> ") + e.what();
  }
  return "<no exception>";
}

::testing::AssertionResult message_has(const std::string& message, const std::vector<std::string>& parts) {
  if (message.find('\n') != std::string::npos) return ::testing::AssertionFailure() << "multi-line: " << message;
  for (const std::string& part : parts) {
    if (message.find(part) == std::string::npos) {
      return ::testing::AssertionFailure() << "'" << part << "' missing from: " << message;
    }
  }
  return ::testing::AssertionSuccess();
}

// CIFAR pixel of image n (numbered across files) at planar position (c, y, x).
uint8_t cifar_pixel(int64_t n, int64_t c, int64_t y, int64_t x) {
  return static_cast<uint8_t>((n * 97 + c * 31 + y * 7 + x * 3) % 256);
}

// CIFAR records: record r holds the label bytes label_bytes[r] then the pixels of image first_image + r.
std::string cifar_records(const std::vector<std::vector<uint8_t>>& label_bytes, int64_t first_image = 0) {
  std::string out;
  for (size_t r = 0; r < label_bytes.size(); ++r) {
    for (uint8_t label : label_bytes[r]) out.push_back(static_cast<char>(label));
    for (int64_t c = 0; c < 3; ++c) {
      for (int64_t y = 0; y < kSide; ++y) {
        for (int64_t x = 0; x < kSide; ++x) {
          out.push_back(static_cast<char>(cifar_pixel(first_image + static_cast<int64_t>(r), c, y, x)));
        }
      }
    }
  }
  return out;
}

at::Tensor cifar_expected_images(int64_t first_image, int64_t count) {
  at::Tensor out = at::empty({count, 3, kSide, kSide}, at::kByte);
  auto a = out.accessor<uint8_t, 4>();
  for (int64_t n = 0; n < count; ++n) {
    for (int64_t c = 0; c < 3; ++c) {
      for (int64_t y = 0; y < kSide; ++y) {
        for (int64_t x = 0; x < kSide; ++x) a[n][c][y][x] = cifar_pixel(first_image + n, c, y, x);
      }
    }
  }
  return out;
}

std::vector<int64_t> labels_of(const at::Tensor& labels) {
  const at::Tensor l = labels.contiguous();
  return std::vector<int64_t>(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
}

std::vector<int64_t> labels_of(const Dataset& d) { return labels_of(d.labels); }

std::string be32(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8), static_cast<char>(v)};
}

uint8_t idx_pixel(int64_t n, int64_t y, int64_t x) { return static_cast<uint8_t>((n * 50 + y * 5 + x + 1) % 256); }

std::string idx_images(uint32_t n, uint32_t h, uint32_t w) {
  std::string out = be32(0x803) + be32(n) + be32(h) + be32(w);
  for (uint32_t i = 0; i < n; ++i) {
    for (uint32_t y = 0; y < h; ++y) {
      for (uint32_t x = 0; x < w; ++x) out.push_back(static_cast<char>(idx_pixel(i, y, x)));
    }
  }
  return out;
}

std::string idx_labels(const std::vector<uint8_t>& labels) {
  std::string out = be32(0x801) + be32(static_cast<uint32_t>(labels.size()));
  for (uint8_t label : labels) out.push_back(static_cast<char>(label));
  return out;
}

void expect_idx_tiny(const Dataset& d) {
  ASSERT_EQ(d.images.sizes(), (at::IntArrayRef{3, 1, 4, 5}));
  EXPECT_EQ(d.images.scalar_type(), at::kByte);
  EXPECT_TRUE(d.images.is_contiguous());
  EXPECT_EQ(d.labels.scalar_type(), at::kLong);
  EXPECT_EQ(labels_of(d), (std::vector<int64_t>{0, 9, 4}));
  EXPECT_EQ(d.num_classes, 10);
  auto a = d.images.accessor<uint8_t, 4>();
  EXPECT_EQ(a[0][0][0][0], 1);
  EXPECT_EQ(a[1][0][2][3], 50 + 10 + 3 + 1);
  EXPECT_EQ(a[2][0][3][4], 100 + 15 + 4 + 1);
  for (int64_t n = 0; n < 3; ++n) {
    for (int64_t y = 0; y < 4; ++y) {
      for (int64_t x = 0; x < 5; ++x) ASSERT_EQ(a[n][0][y][x], idx_pixel(n, y, x)) << n << "," << y << "," << x;
    }
  }
}

// ---- CIFAR ----

TEST(CifarRead, Cifar10ThreeRecords) {
  TempDir dir("cifar10_three");
  const std::string path = dir.file("data_batch_1.bin");
  write_bytes(path, cifar_records({{3}, {0}, {9}}));
  const Dataset d = cifar_read({path}, CifarLabel::kCifar10);
  EXPECT_EQ(d.name, "cifar10");
  EXPECT_EQ(d.num_classes, 10);
  ASSERT_EQ(d.images.sizes(), (at::IntArrayRef{3, 3, 32, 32}));
  EXPECT_EQ(d.images.scalar_type(), at::kByte);
  EXPECT_TRUE(d.images.is_contiguous());
  EXPECT_TRUE(d.images.device().is_cpu());
  EXPECT_EQ(d.labels.scalar_type(), at::kLong);
  EXPECT_EQ(labels_of(d), (std::vector<int64_t>{3, 0, 9}));
  auto a = d.images.accessor<uint8_t, 4>();
  EXPECT_EQ(a[0][0][0][0], 0);
  EXPECT_EQ(a[0][1][0][0], 31);                             // G plane starts at byte 1 + 1024
  EXPECT_EQ(a[1][2][31][0], (97 + 62 + 217) % 256);         // last row of the B plane
  EXPECT_EQ(a[2][1][5][17], (194 + 31 + 35 + 51) % 256);    // row 5, column 17
  EXPECT_EQ(a[2][2][31][31], (194 + 62 + 217 + 93) % 256);  // the last byte of the file
  EXPECT_TRUE(d.images.equal(cifar_expected_images(0, 3)));
}

TEST(CifarRead, ConcatenatesFilesInTheOrderGiven) {
  TempDir dir("cifar10_concat");
  write_bytes(dir.file("a.bin"), cifar_records({{1}, {2}}, 0));
  write_bytes(dir.file("b.bin"), cifar_records({{7}}, 2));
  const Dataset ab = cifar_read({dir.file("a.bin"), dir.file("b.bin")}, CifarLabel::kCifar10);
  EXPECT_EQ(labels_of(ab), (std::vector<int64_t>{1, 2, 7}));
  EXPECT_TRUE(ab.images.equal(cifar_expected_images(0, 3)));
  const Dataset ba = cifar_read({dir.file("b.bin"), dir.file("a.bin")}, CifarLabel::kCifar10);
  EXPECT_EQ(labels_of(ba), (std::vector<int64_t>{7, 1, 2}));
  EXPECT_TRUE(ba.images[0].equal(cifar_expected_images(2, 1)[0]));
  EXPECT_TRUE(ba.images.slice(0, 1).equal(cifar_expected_images(0, 2)));
}

TEST(CifarRead, Cifar100FineAndCoarseLabels) {
  TempDir dir("cifar100_labels");
  const std::string path = dir.file("train.bin");
  write_bytes(path, cifar_records({{19, 99}, {0, 42}, {7, 3}}));
  const Dataset fine = cifar_read({path}, CifarLabel::kCifar100Fine);
  EXPECT_EQ(fine.name, "cifar100");
  EXPECT_EQ(fine.num_classes, 100);
  EXPECT_EQ(labels_of(fine), (std::vector<int64_t>{99, 42, 3}));
  ASSERT_EQ(fine.images.sizes(), (at::IntArrayRef{3, 3, 32, 32}));
  EXPECT_TRUE(fine.images.equal(cifar_expected_images(0, 3)));  // pixels start after two label bytes
  const Dataset coarse = cifar_read({path}, CifarLabel::kCifar100Coarse);
  EXPECT_EQ(coarse.num_classes, 20);
  EXPECT_EQ(labels_of(coarse), (std::vector<int64_t>{19, 0, 7}));
  EXPECT_TRUE(coarse.images.equal(fine.images));
}

TEST(CifarRead, MissingFile) {
  TempDir dir("cifar_missing");
  const std::string path = dir.file("data_batch_1.bin");
  EXPECT_TRUE(message_has(user_error_of([&] { cifar_read({path}, CifarLabel::kCifar10); }),
                          {"cifar: ", path, "file not found"}));
}

TEST(CifarRead, EmptyFile) {
  TempDir dir("cifar_empty");
  const std::string path = dir.file("test_batch.bin");
  write_bytes(path, "");
  EXPECT_TRUE(
      message_has(user_error_of([&] { cifar_read({path}, CifarLabel::kCifar10); }), {path, "file is empty", "3073"}));
}

TEST(CifarRead, SizeNotAMultipleOfTheRecord) {
  TempDir dir("cifar_size");
  const std::string path = dir.file("data_batch_1.bin");
  write_bytes(path, std::string(30000, '\0'));
  EXPECT_EQ(
      user_error_of([&] { cifar_read({path}, CifarLabel::kCifar10); }),
      "cifar: " + path + ": size 30000 is not a multiple of the record size 3073 (truncated or not CIFAR-10 binary)");
}

TEST(CifarRead, TruncatedLastRecord) {
  TempDir dir("cifar_truncated");
  const std::string good = dir.file("good.bin");
  const std::string cut = dir.file("cut.bin");
  write_bytes(good, cifar_records({{1}}));
  std::string bytes = cifar_records({{1}, {2}});
  bytes.pop_back();
  write_bytes(cut, bytes);
  // The good file comes first: the error must still name the truncated one, before anything is read.
  const std::string message = user_error_of([&] { cifar_read({good, cut}, CifarLabel::kCifar10); });
  EXPECT_TRUE(message_has(message, {cut, "size 6145 is not a multiple of the record size 3073"}));
}

TEST(CifarRead, Cifar100FileReadAsCifar10) {
  TempDir dir("cifar_wrong_kind");
  const std::string path = dir.file("train.bin");
  write_bytes(path, cifar_records({{1, 2}, {3, 4}}));
  EXPECT_TRUE(message_has(user_error_of([&] { cifar_read({path}, CifarLabel::kCifar10); }),
                          {path, "size 6148 is not a multiple of the record size 3073"}));
}

TEST(CifarRead, LabelOutOfRange) {
  TempDir dir("cifar_label");
  const std::string path = dir.file("test_batch.bin");
  std::vector<std::vector<uint8_t>> labels(20, std::vector<uint8_t>{5});
  labels[17] = {12};
  write_bytes(path, cifar_records(labels));
  EXPECT_EQ(user_error_of([&] { cifar_read({path}, CifarLabel::kCifar10); }),
            "cifar: " + path + ": record 17 (offset 52241) has label 12, expected 0..9");
}

TEST(CifarRead, Cifar100LabelsOutOfRange) {
  TempDir dir("cifar100_label");
  const std::string bad_fine = dir.file("fine.bin");
  write_bytes(bad_fine, cifar_records({{1, 2}, {3, 100}}));
  EXPECT_EQ(user_error_of([&] { cifar_read({bad_fine}, CifarLabel::kCifar100Fine); }),
            "cifar: " + bad_fine + ": record 1 (offset 3075) has fine label 100, expected 0..99");
  // A corrupt coarse label is an error even when the fine labels are the ones asked for.
  const std::string bad_coarse = dir.file("coarse.bin");
  write_bytes(bad_coarse, cifar_records({{1, 2}, {3, 4}, {20, 5}}));
  EXPECT_EQ(user_error_of([&] { cifar_read({bad_coarse}, CifarLabel::kCifar100Fine); }),
            "cifar: " + bad_coarse + ": record 2 (offset 6148) has coarse label 20, expected 0..19");
}

TEST(CifarRead, NoFiles) {
  EXPECT_TRUE(message_has(user_error_of([] { cifar_read({}, CifarLabel::kCifar10); }), {"no CIFAR-10 files"}));
}

// ---- IDX ----

TEST(IdxRead, PlainImagesAndLabels) {
  TempDir dir("idx_plain");
  write_bytes(dir.file("images"), idx_images(3, 4, 5));
  write_bytes(dir.file("labels"), idx_labels({0, 9, 4}));
  const Dataset d = idx_read(dir.file("images"), dir.file("labels"));
  expect_idx_tiny(d);
}

TEST(IdxRead, GzipImagesAndLabels) {
  TempDir dir("idx_gzip");
  write_gzip(dir.file("images.gz"), idx_images(3, 4, 5));
  write_gzip(dir.file("labels.gz"), idx_labels({0, 9, 4}));
  ASSERT_EQ(read_bytes(dir.file("images.gz")).substr(0, 2), "\x1f\x8b");
  expect_idx_tiny(idx_read(dir.file("images.gz"), dir.file("labels.gz")));
  write_bytes(dir.file("labels"), idx_labels({0, 9, 4}));
  expect_idx_tiny(idx_read(dir.file("images.gz"), dir.file("labels")));
}

TEST(IdxRead, GzipDetectedByMagicNotByName) {
  TempDir dir("idx_magic");
  write_gzip(dir.file("images.bin"), idx_images(3, 4, 5));    // gzip without .gz
  write_bytes(dir.file("labels.gz"), idx_labels({0, 9, 4}));  // plain with .gz
  expect_idx_tiny(idx_read(dir.file("images.bin"), dir.file("labels.gz")));
}

TEST(IdxRead, LargeGzipSpansManyReadChunks) {
  TempDir dir("idx_large");
  write_gzip(dir.file("images.gz"), idx_images(3000, 28, 28));  // 2.35 MB decompressed
  write_bytes(dir.file("labels"), idx_labels(std::vector<uint8_t>(3000, 5)));
  const Dataset d = idx_read(dir.file("images.gz"), dir.file("labels"));
  ASSERT_EQ(d.images.sizes(), (at::IntArrayRef{3000, 1, 28, 28}));
  EXPECT_EQ(d.images[2999][0][27][27].item<uint8_t>(), idx_pixel(2999, 27, 27));
  EXPECT_EQ(d.images[1337][0][13][2].item<uint8_t>(), idx_pixel(1337, 13, 2));
}

TEST(IdxRead, MissingAndEmptyFiles) {
  TempDir dir("idx_missing");
  write_bytes(dir.file("labels"), idx_labels({0, 9, 4}));
  const std::string missing = dir.file("train-images-idx3-ubyte");
  EXPECT_TRUE(
      message_has(user_error_of([&] { idx_read(missing, dir.file("labels")); }), {"idx: ", missing, "file not found"}));
  write_bytes(dir.file("empty"), "");
  EXPECT_TRUE(message_has(user_error_of([&] { idx_read(dir.file("empty"), dir.file("labels")); }),
                          {dir.file("empty"), "file is empty"}));
}

TEST(IdxRead, WrongMagic) {
  TempDir dir("idx_wrong_magic");
  write_gzip(dir.file("train-images-idx3-ubyte.gz"), idx_images(3, 4, 5));
  write_gzip(dir.file("train-labels-idx1-ubyte.gz"), idx_labels({0, 9, 4}));
  const std::string images = dir.file("train-images-idx3-ubyte.gz");
  const std::string labels = dir.file("train-labels-idx1-ubyte.gz");
  EXPECT_EQ(user_error_of([&] { idx_read(images, images); }),
            "idx: " + images + ": magic 0x00000803, expected 0x00000801 (labels file)");
  EXPECT_EQ(user_error_of([&] { idx_read(labels, labels); }),
            "idx: " + labels + ": magic 0x00000801, expected 0x00000803 (images file)");
  write_bytes(dir.file("text"), "hello world, not an IDX file");
  EXPECT_TRUE(message_has(user_error_of([&] { idx_read(dir.file("text"), labels); }),
                          {dir.file("text"), "magic 0x68656c6c, expected 0x00000803"}));
}

TEST(IdxRead, ShortHeaders) {
  TempDir dir("idx_short");
  write_bytes(dir.file("labels"), idx_labels({0, 9, 4}));
  write_bytes(dir.file("tiny"), std::string(2, '\0'));
  EXPECT_TRUE(message_has(user_error_of([&] { idx_read(dir.file("tiny"), dir.file("labels")); }),
                          {dir.file("tiny"), "size 2 is shorter than the 4-byte magic"}));
  write_bytes(dir.file("images"), idx_images(3, 4, 5).substr(0, 10));
  EXPECT_TRUE(message_has(user_error_of([&] { idx_read(dir.file("images"), dir.file("labels")); }),
                          {dir.file("images"), "size 10 is shorter than the 16-byte images header"}));
  write_bytes(dir.file("images"), idx_images(3, 4, 5));
  write_bytes(dir.file("labels"), idx_labels({0, 9, 4}).substr(0, 6));
  EXPECT_TRUE(message_has(user_error_of([&] { idx_read(dir.file("images"), dir.file("labels")); }),
                          {dir.file("labels"), "size 6 is shorter than the 8-byte labels header"}));
}

TEST(IdxRead, DimsInconsistentWithFileSize) {
  TempDir dir("idx_dims");
  write_bytes(dir.file("labels"), idx_labels({0, 9, 4}));
  const std::string images = dir.file("images");
  std::string bytes = idx_images(3, 4, 5);
  write_bytes(images, bytes.substr(0, bytes.size() - 1));
  EXPECT_EQ(user_error_of([&] { idx_read(images, dir.file("labels")); }),
            "idx: " + images +
                ": dims 3x4x5 need 60 pixel bytes after the 16-byte header, found 59 (truncated or wrong dims)");
  write_bytes(images, bytes + "x");
  EXPECT_TRUE(message_has(user_error_of([&] { idx_read(images, dir.file("labels")); }), {images, "found 61"}));
  write_bytes(images, be32(0x803) + be32(3) + be32(0) + be32(5));
  EXPECT_TRUE(message_has(user_error_of([&] { idx_read(images, dir.file("labels")); }),
                          {images, "image size 0x5", "expected both > 0"}));
}

TEST(IdxRead, HugeHeaderCountsAreRejectedBeforeAllocating) {
  TempDir dir("idx_huge");
  write_bytes(dir.file("labels"), idx_labels({0, 9, 4}));
  const std::string images = dir.file("images");
  std::string bytes = idx_images(10, 28, 28);
  bytes.replace(4, 4, be32(0x80000000u));
  write_bytes(images, bytes);
  EXPECT_TRUE(message_has(user_error_of([&] { idx_read(images, dir.file("labels")); }),
                          {images, "dims 2147483648x28x28 need 1683627180032 pixel bytes", "found 7840"}));
  write_bytes(images, be32(0x803) + be32(0xffffffffu) + be32(0xffffffffu) + be32(0xffffffffu) + "abc");
  EXPECT_TRUE(message_has(user_error_of([&] { idx_read(images, dir.file("labels")); }),
                          {images, "need more than 2^64 pixel bytes", "found 3"}));
  write_bytes(images, idx_images(3, 4, 5));
  std::string labels = idx_labels({0, 9, 4});
  labels.replace(4, 4, be32(0x80000000u));
  write_gzip(dir.file("labels.gz"), labels);
  EXPECT_TRUE(message_has(user_error_of([&] { idx_read(images, dir.file("labels.gz")); }),
                          {dir.file("labels.gz"), "header says 2147483648 labels, found 3 label bytes"}));
}

TEST(IdxRead, ImageAndLabelCountMismatch) {
  TempDir dir("idx_count");
  write_bytes(dir.file("images"), idx_images(3, 4, 5));
  write_bytes(dir.file("labels"), idx_labels({0, 9}));
  EXPECT_EQ(user_error_of([&] { idx_read(dir.file("images"), dir.file("labels")); }),
            "idx: " + dir.file("images") + " has 3 images but " + dir.file("labels") +
                " has 2 labels, expected the same count");
}

TEST(IdxRead, LabelOutOfRange) {
  TempDir dir("idx_label");
  write_bytes(dir.file("images"), idx_images(3, 4, 5));
  write_bytes(dir.file("labels"), idx_labels({0, 9, 10}));
  EXPECT_EQ(user_error_of([&] { idx_read(dir.file("images"), dir.file("labels")); }),
            "idx: " + dir.file("labels") + ": item 2 (offset 10) has label 10, expected 0..9");
  write_bytes(dir.file("labels"), idx_labels({0, 9, 4}));
  EXPECT_TRUE(message_has(user_error_of([&] { idx_read(dir.file("images"), dir.file("labels"), 5); }),
                          {dir.file("labels"), "item 1 (offset 9) has label 9, expected 0..4"}));
  EXPECT_TRUE(message_has(user_error_of([&] { idx_read(dir.file("images"), dir.file("labels"), 0); }),
                          {"num_classes must be in 1..256, got 0"}));
}

TEST(IdxRead, CorruptGzip) {
  TempDir dir("idx_corrupt_gz");
  write_bytes(dir.file("labels"), idx_labels({0, 9, 4}));
  write_gzip(dir.file("good.gz"), idx_images(3, 4, 5));
  const std::string gz = read_bytes(dir.file("good.gz"));
  ASSERT_GT(gz.size(), 30u);
  const std::string images = dir.file("images.gz");
  // Cut in the middle of the deflate stream.
  write_bytes(images, gz.substr(0, gz.size() / 2));
  EXPECT_TRUE(message_has(user_error_of([&] { idx_read(images, dir.file("labels")); }),
                          {"idx: ", images, "corrupt or truncated gzip data", "unexpected end of file"}));
  // All the data but no CRC/size trailer: every pixel decompresses, and it is still an error.
  write_bytes(images, gz.substr(0, gz.size() - 8));
  EXPECT_TRUE(message_has(user_error_of([&] { idx_read(images, dir.file("labels")); }),
                          {images, "corrupt or truncated gzip data"}));
  // Only the gzip magic.
  write_bytes(images, gz.substr(0, 2));
  EXPECT_TRUE(message_has(user_error_of([&] { idx_read(images, dir.file("labels")); }),
                          {images, "corrupt or truncated gzip data after 0 decompressed bytes"}));
  // A flipped bit in the CRC.
  std::string bad_crc = gz;
  bad_crc[bad_crc.size() - 8] = static_cast<char>(bad_crc[bad_crc.size() - 8] ^ 1);
  write_bytes(images, bad_crc);
  EXPECT_TRUE(message_has(user_error_of([&] { idx_read(images, dir.file("labels")); }),
                          {images, "corrupt or truncated gzip data", "incorrect data check"}));
  // A gzip stream of nothing.
  write_gzip(images, "");
  EXPECT_TRUE(message_has(user_error_of([&] { idx_read(images, dir.file("labels")); }),
                          {images, "decompressed size 0 is shorter than the 4-byte magic"}));
}

// ---- dataset_load ----

TEST(DataLoad, UnknownNameListsTheKnownNames) {
  EXPECT_EQ(user_error_of([] { dataset_load("imagenet", "/tmp"); }),
            "unknown dataset 'imagenet'; known datasets: cifar10, cifar100, mnist, fashion-mnist, tinyshakespeare, folder, tensors");
}

TEST(DataLoad, DatasetNames) {
  EXPECT_EQ(dataset_names(), (std::vector<std::string>{"cifar10", "cifar100", "mnist", "fashion-mnist", "tinyshakespeare", "folder",
                                                   "tensors"}));
}

TEST(DataLoad, TensorsAreNotReadFromFiles) {
  EXPECT_TRUE(message_has(user_error_of([] { dataset_load("tensors", "/tmp"); }),
                          {"dataset", "tensors holds images a program passes", "triaccel.train"}));
}

TEST(DataLoad, MnistWithoutFolderAsksForData) {
  EXPECT_TRUE(
      message_has(user_error_of([] { dataset_load("mnist", ""); }),
                  {"mnist: no data folder given", "data_dir", "{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]"}));
}

TEST(DataLoad, Cifar10WithoutFolderNamesTheBuildScript) {
  EXPECT_TRUE(message_has(user_error_of([] { dataset_load("cifar10", ""); }),
                          {"cifar10: no data folder given", "build_cifar10_bin.py", "data_dir"}));
}

TEST(DataLoad, MissingFolder) {
  TempDir dir("load_missing_dir");
  const std::string missing = dir.file("nope");
  EXPECT_TRUE(message_has(user_error_of([&] { dataset_load("cifar10", missing); }),
                          {"cifar10: data folder " + missing + " does not exist", "build_cifar10_bin.py"}));
  EXPECT_TRUE(message_has(user_error_of([&] { dataset_load("mnist", missing); }),
                          {"mnist: data folder " + missing + " does not exist", "data_dir"}));
}

TEST(DataLoad, Cifar10MissingFileNamesFileFolderAndScript) {
  TempDir dir("load_cifar10_missing");
  EXPECT_TRUE(message_has(user_error_of([&] { dataset_load("cifar10", dir.path()); }),
                          {"cifar10: data_batch_1.bin not found in " + dir.path() + " (",
                           "build_cifar10_bin.py"}));
  const std::string sub = dir.file("cifar-10-batches-bin");
  ASSERT_EQ(::mkdir(sub.c_str(), 0755), 0) << sub;
  for (const char* name : {"data_batch_1.bin", "data_batch_2.bin", "data_batch_3.bin", "test_batch.bin"}) {
    write_bytes(sub + "/" + name, cifar_records({{1}}));
  }
  EXPECT_TRUE(message_has(user_error_of([&] { dataset_load("cifar10", dir.path()); }),
                          {"cifar10: data_batch_4.bin not found in " + sub, "build_cifar10_bin.py"}));
}

TEST(DataLoad, Cifar10FromSubfolder) {
  TempDir dir("load_cifar10");
  const std::string sub = dir.file("cifar-10-batches-bin");
  ASSERT_EQ(::mkdir(sub.c_str(), 0755), 0) << sub;
  for (int k = 1; k <= 5; ++k) {
    const auto a = static_cast<uint8_t>(k);
    const auto b = static_cast<uint8_t>((k + 5) % 10);
    write_bytes(sub + "/data_batch_" + std::to_string(k) + ".bin", cifar_records({{a}, {b}}, 2 * (k - 1)));
  }
  write_bytes(sub + "/test_batch.bin", cifar_records({{9}, {8}, {0}}, 100));
  const DatasetSplits s = dataset_load("cifar10", dir.path());
  EXPECT_EQ(s.train.name, "cifar10");
  EXPECT_EQ(s.test.name, "cifar10");
  EXPECT_EQ(s.train.num_classes, 10);
  EXPECT_EQ(s.train.size(), 10);
  EXPECT_EQ(s.test.size(), 3);
  EXPECT_EQ(labels_of(s.train), (std::vector<int64_t>{1, 6, 2, 7, 3, 8, 4, 9, 5, 0}));
  EXPECT_EQ(labels_of(s.test), (std::vector<int64_t>{9, 8, 0}));
  EXPECT_TRUE(s.train.images.equal(cifar_expected_images(0, 10)));
  EXPECT_TRUE(s.test.images.equal(cifar_expected_images(100, 3)));
  // Statistics of the training split, against an ATen reference in double precision.
  const at::Tensor x = s.train.images.to(at::kDouble) / 255.0;
  const at::Tensor mean = x.mean({0, 2, 3});
  const at::Tensor stddev = x.std({0, 2, 3}, /*unbiased=*/false);
  ASSERT_EQ(s.mean.size(), 3u);
  ASSERT_EQ(s.std.size(), 3u);
  for (int64_t c = 0; c < 3; ++c) {
    EXPECT_NEAR(s.mean[c], mean[c].item<double>(), 1e-6) << c;
    EXPECT_NEAR(s.std[c], stddev[c].item<double>(), 1e-6) << c;
  }
}

TEST(DataLoad, Cifar100UsesFineLabels) {
  TempDir dir("load_cifar100");
  write_bytes(dir.file("train.bin"), cifar_records({{1, 55}, {19, 99}}));
  write_bytes(dir.file("test.bin"), cifar_records({{4, 40}}, 2));
  const DatasetSplits s = dataset_load("cifar100", dir.path());
  EXPECT_EQ(s.train.name, "cifar100");
  EXPECT_EQ(s.train.num_classes, 100);
  EXPECT_EQ(labels_of(s.train), (std::vector<int64_t>{55, 99}));
  EXPECT_EQ(labels_of(s.test), (std::vector<int64_t>{40}));
  EXPECT_TRUE(s.test.images.equal(cifar_expected_images(2, 1)));
  TempDir empty("load_cifar100_missing");
  EXPECT_TRUE(message_has(user_error_of([&] { dataset_load("cifar100", empty.path()); }),
                          {"cifar100: train.bin not found in " + empty.path(), "cifar-100-binary"}));
}

TEST(DataLoad, MnistFromFolderPlainAndGzip) {
  TempDir dir("load_mnist");
  write_gzip(dir.file("train-images-idx3-ubyte.gz"), idx_images(3, 4, 5));
  write_gzip(dir.file("train-labels-idx1-ubyte.gz"), idx_labels({0, 9, 4}));
  write_bytes(dir.file("t10k-images-idx3-ubyte"), idx_images(2, 4, 5));
  write_bytes(dir.file("t10k-labels-idx1-ubyte"), idx_labels({3, 3}));
  const DatasetSplits s = dataset_load("mnist", dir.path());
  EXPECT_EQ(s.train.name, "mnist");
  expect_idx_tiny(s.train);
  EXPECT_EQ(s.test.size(), 2);
  EXPECT_EQ(labels_of(s.test), (std::vector<int64_t>{3, 3}));
  ASSERT_EQ(s.mean.size(), 1u);
  const at::Tensor x = s.train.images.to(at::kDouble) / 255.0;
  EXPECT_NEAR(s.mean[0], x.mean().item<double>(), 1e-6);
  EXPECT_NEAR(s.std[0], x.std(/*unbiased=*/false).item<double>(), 1e-6);
}

TEST(DataLoad, MnistMissingFileAndMismatchedSplits) {
  TempDir dir("load_mnist_missing");
  write_bytes(dir.file("train-images-idx3-ubyte"), idx_images(3, 4, 5));
  write_bytes(dir.file("train-labels-idx1-ubyte"), idx_labels({0, 9, 4}));
  write_bytes(dir.file("t10k-images-idx3-ubyte"), idx_images(2, 3, 3));
  EXPECT_EQ(user_error_of([&] { dataset_load("fashion-mnist", dir.path()); }),
            "fashion-mnist: neither t10k-labels-idx1-ubyte nor t10k-labels-idx1-ubyte.gz found in " + dir.path() +
                "; pass data_dir with the folder that holds {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]");
  write_gzip(dir.file("t10k-labels-idx1-ubyte.gz"), idx_labels({1, 2}));
  EXPECT_TRUE(message_has(user_error_of([&] { dataset_load("mnist", dir.path()); }),
                          {"test images " + dir.file("t10k-images-idx3-ubyte") + " are 3x3",
                           "train images " + dir.file("train-images-idx3-ubyte") + " are 4x5"}));
}

TEST(DataLoad, RealFashionMnist) {
  struct stat info {};
  if (::stat("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz", &info) != 0) {
    GTEST_SKIP() << "Fashion-MNIST not installed (Debian package dataset-fashion-mnist)";
  }
  const DatasetSplits s = dataset_load("fashion-mnist", "");
  EXPECT_EQ(s.train.name, "fashion-mnist");
  EXPECT_EQ(s.train.num_classes, 10);
  ASSERT_EQ(s.train.images.sizes(), (at::IntArrayRef{60000, 1, 28, 28}));
  ASSERT_EQ(s.test.images.sizes(), (at::IntArrayRef{10000, 1, 28, 28}));
  const at::Tensor train_counts = at::bincount(s.train.labels, {}, 10);
  const at::Tensor test_counts = at::bincount(s.test.labels, {}, 10);
  EXPECT_TRUE(train_counts.equal(at::full({10}, 6000, at::kLong))) << train_counts;
  EXPECT_TRUE(test_counts.equal(at::full({10}, 1000, at::kLong))) << test_counts;
  // First labels and statistics as numpy computes them from the same files.
  EXPECT_EQ(labels_of(s.train.labels.slice(0, 0, 5)), (std::vector<int64_t>{9, 0, 0, 3, 0}));
  EXPECT_EQ(labels_of(s.test.labels.slice(0, 0, 5)), (std::vector<int64_t>{9, 2, 1, 1, 6}));
  ASSERT_EQ(s.mean.size(), 1u);
  EXPECT_NEAR(s.mean[0], 0.2860406, 1e-6);
  EXPECT_NEAR(s.std[0], 0.3530242, 1e-6);
}

// ---- dataset_channel_stats ----

TEST(DataChannelStats, KnownTensor) {
  // (2, 2, 1, 2): channel 0 holds 0 and 255 in each image (mean 0.5, std 0.5); channel 1 holds 51, 51 in
  // image 0 and 102, 102 in image 1 (0.2, 0.2, 0.4, 0.4: mean 0.3, std 0.1).
  const at::Tensor images =
      at::tensor(std::vector<uint8_t>{0, 255, 51, 51, 255, 0, 102, 102}, at::kByte).reshape({2, 2, 1, 2});
  std::vector<float> mean;
  std::vector<float> stddev;
  dataset_channel_stats(images, mean, stddev);
  ASSERT_EQ(mean.size(), 2u);
  ASSERT_EQ(stddev.size(), 2u);
  EXPECT_NEAR(mean[0], 0.5, 1e-6);
  EXPECT_NEAR(stddev[0], 0.5, 1e-6);
  EXPECT_NEAR(mean[1], 0.3, 1e-6);
  EXPECT_NEAR(stddev[1], 0.1, 1e-6);
  // A non-contiguous view gives the statistics of the values it shows (channel 1 only).
  dataset_channel_stats(images.slice(1, 1, 2), mean, stddev);
  ASSERT_EQ(mean.size(), 1u);
  EXPECT_NEAR(mean[0], 0.3, 1e-6);
  EXPECT_NEAR(stddev[0], 0.1, 1e-6);
}

TEST(DataChannelStats, RejectsWrongInput) {
  std::vector<float> mean;
  std::vector<float> stddev;
  EXPECT_THROW(dataset_channel_stats(at::zeros({2, 1, 2, 2}, at::kFloat), mean, stddev), c10::Error);
  EXPECT_THROW(dataset_channel_stats(at::zeros({2, 2, 2}, at::kByte), mean, stddev), c10::Error);
  EXPECT_THROW(dataset_channel_stats(at::zeros({0, 1, 2, 2}, at::kByte), mean, stddev), c10::Error);
}

}  // namespace
}  // namespace triaccel
