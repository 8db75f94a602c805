// Tests of the image-folder reader (--dataset folder, data/folder.h) on tiny JPEG and PNG files written here with
// libjpeg and libpng: class order and labels, pixels, grey and alpha conversion, resizing of mixed sizes, the cache
// (used, rebuilt when truncated or corrupt, replaced when the images change) and each refused layout or file.
// Tolerances: PNG is lossless, so its pixels compare exactly. JPEG is written at quality 100 without chroma
// subsampling, whose round trip through libjpeg's integer DCT moves a pixel of these smooth images by at most 4
// (a wrong channel order or a missed colour conversion moves them by tens). The bilinear resize is compared with
// ATen's upsample_bilinear2d (align_corners=false) in float, within 1 for the rounding to uint8.
#include "triaccel/data/folder.h"

#include "test_util.h"
#include "triaccel/core/errors.h"
#include "triaccel/data/dataset.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include <jpeglib.h>
#include <png.h>

namespace triaccel {
namespace {

namespace fs = std::filesystem;
using test::error_of;
using test::TempDir;

// An (h, w, 3) uint8 image whose pixel (y, x, c) is base + 10 y + 3 x + 50 c (mod 256): every pixel and channel
// differs from its neighbours, so a transposed or reordered image does not compare equal.
at::Tensor pattern_hwc(int64_t h, int64_t w, int64_t base) {
  at::Tensor img = at::empty({h, w, 3}, at::kByte);
  auto a = img.accessor<uint8_t, 3>();
  for (int64_t y = 0; y < h; ++y) {
    for (int64_t x = 0; x < w; ++x) {
      for (int64_t c = 0; c < 3; ++c) a[y][x][c] = static_cast<uint8_t>((base + 10 * y + 3 * x + 50 * c) % 256);
    }
  }
  return img;
}

// (h, w, 3) → (3, h, w), the layout of Dataset::images.
at::Tensor chw(const at::Tensor& hwc) { return hwc.permute({2, 0, 1}).contiguous(); }

// Writes an image with libpng's simplified API; pixels are (h, w, channels) uint8, channels 1 (grey), 3 or 4.
void png_write(const std::string& path, const at::Tensor& pixels) {
  fs::create_directories(fs::path(path).parent_path());
  const at::Tensor p = pixels.contiguous();
  png_image image;
  std::memset(&image, 0, sizeof(image));
  image.version = PNG_IMAGE_VERSION;
  image.height = static_cast<png_uint_32>(p.size(0));
  image.width = static_cast<png_uint_32>(p.size(1));
  const int64_t channels = p.size(2);
  image.format = channels == 1 ? PNG_FORMAT_GRAY : channels == 3 ? PNG_FORMAT_RGB : PNG_FORMAT_RGBA;
  ASSERT_TRUE(png_image_write_to_file(&image, path.c_str(), 0, p.data_ptr<uint8_t>(), 0, nullptr))
      << path << ": " << image.message;
}

// Writes a JPEG at quality 100 with no chroma subsampling; pixels (h, w, 3) RGB or (h, w, 1) grey uint8.
void jpeg_write(const std::string& path, const at::Tensor& pixels) {
  fs::create_directories(fs::path(path).parent_path());
  const at::Tensor p = pixels.contiguous();
  FILE* file = std::fopen(path.c_str(), "wb");
  ASSERT_NE(file, nullptr) << path;
  jpeg_compress_struct cinfo;
  jpeg_error_mgr err;
  cinfo.err = jpeg_std_error(&err);
  jpeg_create_compress(&cinfo);
  jpeg_stdio_dest(&cinfo, file);
  cinfo.image_height = static_cast<JDIMENSION>(p.size(0));
  cinfo.image_width = static_cast<JDIMENSION>(p.size(1));
  cinfo.input_components = static_cast<int>(p.size(2));
  cinfo.in_color_space = p.size(2) == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, 100, TRUE);
  cinfo.comp_info[0].h_samp_factor = 1;  // 4:4:4
  cinfo.comp_info[0].v_samp_factor = 1;
  jpeg_start_compress(&cinfo, TRUE);
  const int64_t stride = p.size(1) * p.size(2);
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = p.data_ptr<uint8_t>() + cinfo.next_scanline * stride;
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  std::fclose(file);
}

void bytes_write(const std::string& path, const std::string& bytes) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string bytes_read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Two classes of three 8×8 PNGs each, created out of order ("zebra" before "ant", c before a) so that a reader that
// does not sort is caught, plus one test image per class, a text file and a hidden file that must be ignored.
// Train order: ant/a, ant/b, ant/c, zebra/a, zebra/b, zebra/c with patterns of base 0, 1, 2, 100, 101, 102.
void two_class_png_write(const std::string& root) {
  for (const auto& [cls, base] : {std::pair{"zebra", 100}, std::pair{"ant", 0}}) {
    for (const auto& [name, k] : {std::pair{"c.png", 2}, std::pair{"a.png", 0}, std::pair{"b.PNG", 1}}) {
      png_write(root + "/train/" + cls + "/" + name, pattern_hwc(8, 8, base + k));
    }
    png_write(root + "/test/" + cls + "/t.png", pattern_hwc(8, 8, base + 50));
  }
  bytes_write(root + "/train/ant/notes.txt", "not an image");
  bytes_write(root + "/train/ant/.hidden.png", "not an image either");
}

std::vector<std::string> cache_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().filename().string().rfind(".triaccel-cache-", 0) == 0) out.push_back(e.path().string());
  }
  return out;
}

TEST(FolderRead, ClassesSortedLabelsByClassPngPixelsExact) {
  TempDir dir("folder_png");
  two_class_png_write(dir.path());
  const DatasetSplits d = folder_read(dir.path());
  EXPECT_EQ(d.train.name, "folder");
  EXPECT_EQ(d.train.num_classes, 2);
  EXPECT_EQ(d.test.num_classes, 2);
  ASSERT_EQ(d.train.images.sizes(), (std::vector<int64_t>{6, 3, 8, 8}));
  EXPECT_EQ(d.train.images.scalar_type(), at::kByte);
  EXPECT_TRUE(d.train.images.is_contiguous());
  EXPECT_EQ(d.train.labels.scalar_type(), at::kLong);
  EXPECT_TRUE(d.train.labels.equal(at::tensor({0, 0, 0, 1, 1, 1}, at::kLong)));  // ant = 0, zebra = 1
  EXPECT_TRUE(d.test.labels.equal(at::tensor({0, 1}, at::kLong)));
  const int bases[] = {0, 1, 2, 100, 101, 102};
  for (int64_t i = 0; i < 6; ++i) {
    EXPECT_TRUE(d.train.images[i].equal(chw(pattern_hwc(8, 8, bases[i])))) << "train image " << i;
  }
  EXPECT_TRUE(d.test.images[0].equal(chw(pattern_hwc(8, 8, 50))));
  EXPECT_TRUE(d.test.images[1].equal(chw(pattern_hwc(8, 8, 150))));
}

TEST(FolderRead, JpegWithinToleranceAndGreyJpegHasThreeEqualChannels) {
  TempDir dir("folder_jpeg");
  // A smooth colour image (JPEG's round trip error is small there) and a grey one.
  at::Tensor smooth = at::empty({16, 16, 3}, at::kByte);
  auto a = smooth.accessor<uint8_t, 3>();
  for (int64_t y = 0; y < 16; ++y) {
    for (int64_t x = 0; x < 16; ++x) {
      a[y][x][0] = static_cast<uint8_t>(40 + 8 * x);
      a[y][x][1] = static_cast<uint8_t>(200 - 6 * y);
      a[y][x][2] = static_cast<uint8_t>(90 + 2 * (x + y));
    }
  }
  const at::Tensor grey = smooth.select(2, 1).unsqueeze(2).contiguous();  // (16, 16, 1)
  jpeg_write(dir.file("train/a/1.jpg"), smooth);
  jpeg_write(dir.file("train/a/2.JPEG"), grey);
  jpeg_write(dir.file("val/a/1.jpeg"), smooth);  // no test/: val/ is the evaluation split
  const DatasetSplits d = folder_read(dir.path());
  ASSERT_EQ(d.train.size(), 2);
  ASSERT_EQ(d.test.size(), 1);
  const at::Tensor diff = (d.train.images[0].to(at::kInt) - chw(smooth).to(at::kInt)).abs();
  EXPECT_LE(diff.max().item<int>(), 4);
  const at::Tensor g = d.train.images[1];  // (3, 16, 16)
  EXPECT_TRUE(g[0].equal(g[1]) && g[1].equal(g[2])) << "grey JPEG must be replicated into R, G and B";
  EXPECT_LE((g[0].to(at::kInt) - grey.squeeze(2).to(at::kInt)).abs().max().item<int>(), 4);
}

TEST(FolderRead, GreyPngReplicatedAndAlphaDropped) {
  TempDir dir("folder_grey");
  const at::Tensor rgb = pattern_hwc(6, 5, 7);
  const at::Tensor grey = rgb.select(2, 0).unsqueeze(2).contiguous();                             // (6, 5, 1)
  const at::Tensor rgba = at::cat({rgb, at::full({6, 5, 1}, 255, at::kByte)}, 2).contiguous();  // opaque
  png_write(dir.file("train/c/1.png"), grey);
  png_write(dir.file("train/c/2.png"), rgba);
  png_write(dir.file("test/c/1.png"), rgb);
  const DatasetSplits d = folder_read(dir.path());
  ASSERT_EQ(d.train.images.sizes(), (std::vector<int64_t>{2, 3, 6, 5}));
  for (int64_t c = 0; c < 3; ++c) EXPECT_TRUE(d.train.images[0][c].equal(grey.squeeze(2))) << "channel " << c;
  EXPECT_TRUE(d.train.images[1].equal(chw(rgb)));
}

TEST(FolderRead, MixedSizesResizedToTheFirstTrainingImage) {
  TempDir dir("folder_sizes");
  png_write(dir.file("train/a/1.png"), pattern_hwc(8, 8, 0));                                  // sets 8×8
  const at::Tensor constant = at::tensor({10, 20, 30}, at::kByte).view({1, 1, 3}).expand({4, 4, 3});
  png_write(dir.file("train/a/2.png"), constant);                                               // 4×4 → 8×8
  const at::Tensor big = pattern_hwc(16, 12, 5);
  png_write(dir.file("test/a/1.png"), big);                                                     // 16×12 → 8×8
  FolderReadInfo info;
  const DatasetSplits d = folder_read(dir.path(), &info);
  EXPECT_EQ(info.resized, 2);
  ASSERT_EQ(d.train.images.sizes(), (std::vector<int64_t>{2, 3, 8, 8}));
  ASSERT_EQ(d.test.images.sizes(), (std::vector<int64_t>{1, 3, 8, 8}));
  EXPECT_TRUE(d.train.images[0].equal(chw(pattern_hwc(8, 8, 0))));  // the size-setting image is untouched
  const at::Tensor constant_8x8 = at::tensor({10, 20, 30}, at::kByte).view({3, 1, 1}).expand({3, 8, 8});
  EXPECT_TRUE(d.train.images[1].equal(constant_8x8));  // a constant colour stays constant
  const at::Tensor ref = at::upsample_bilinear2d(chw(big).unsqueeze(0).to(at::kFloat), {8, 8}, false)[0];
  EXPECT_LE((d.test.images[0].to(at::kFloat) - ref).abs().max().item<float>(), 1.0f);
}

TEST(FolderResize, MatchesATenBilinearUpAndDown) {
  const at::Tensor in = pattern_hwc(7, 5, 3);
  for (const auto& [h, w] : {std::pair{13, 11}, std::pair{3, 2}, std::pair{7, 5}, std::pair{1, 9}}) {
    at::Tensor out = at::empty({h, w, 3}, at::kByte);
    image_resize_bilinear(in.data_ptr<uint8_t>(), 7, 5, out.data_ptr<uint8_t>(), h, w);
    const at::Tensor ref = at::upsample_bilinear2d(chw(in).unsqueeze(0).to(at::kFloat), {h, w}, false)[0];
    EXPECT_LE((chw(out).to(at::kFloat) - ref).abs().max().item<float>(), 0.5001f) << h << "x" << w;
  }
}

TEST(FolderCache, SecondLoadReadsTheCacheAndBadCachesAreRebuilt) {
  TempDir dir("folder_cache");
  two_class_png_write(dir.path());
  FolderReadInfo info;
  const DatasetSplits first = folder_read(dir.path(), &info);
  EXPECT_EQ(info.source, FolderSource::kDecoded);
  ASSERT_FALSE(info.cache_path.empty());
  ASSERT_EQ(cache_files(dir.path()), std::vector<std::string>{info.cache_path});
  const std::string cache = info.cache_path;
  auto same = [&](const DatasetSplits& d) {
    return d.train.images.equal(first.train.images) && d.test.images.equal(first.test.images) &&
           d.train.labels.equal(first.train.labels) && d.test.labels.equal(first.test.labels) &&
           d.train.num_classes == 2 && d.test.num_classes == 2 && d.train.name == "folder";
  };

  EXPECT_TRUE(same(folder_read(dir.path(), &info)));
  EXPECT_EQ(info.source, FolderSource::kCache);

  const std::string good = bytes_read(cache);
  bytes_write(cache, good.substr(0, good.size() - 100));  // truncated: decoded again, and rewritten
  EXPECT_TRUE(same(folder_read(dir.path(), &info)));
  EXPECT_EQ(info.source, FolderSource::kDecoded);
  EXPECT_EQ(bytes_read(cache), good);

  std::string flipped = good;
  flipped[flipped.size() - 7] ^= 0x5a;  // a pixel of the last test image: only the checksum sees it
  bytes_write(cache, flipped);
  EXPECT_TRUE(same(folder_read(dir.path(), &info)));
  EXPECT_EQ(info.source, FolderSource::kDecoded);

  std::string bad_header = good;
  bad_header[0] = 'X';  // magic
  bytes_write(cache, bad_header);
  EXPECT_TRUE(same(folder_read(dir.path(), &info)));
  EXPECT_EQ(info.source, FolderSource::kDecoded);
  EXPECT_EQ(folder_read(dir.path(), &info).train.size(), 6);
  EXPECT_EQ(info.source, FolderSource::kCache);

  // A new image changes the key: decoded, the new image is in, and the old cache is replaced.
  png_write(dir.file("test/ant/u.png"), pattern_hwc(8, 8, 77));
  const DatasetSplits more = folder_read(dir.path(), &info);
  EXPECT_EQ(info.source, FolderSource::kDecoded);
  EXPECT_EQ(more.test.size(), 3);
  EXPECT_TRUE(more.test.images[1].equal(chw(pattern_hwc(8, 8, 77))));
  EXPECT_NE(info.cache_path, cache);
  EXPECT_EQ(cache_files(dir.path()), std::vector<std::string>{info.cache_path});
}

TEST(FolderErrors, EachNamesTheOffendingFileOrFolder) {
  TempDir dir("folder_errors");
  const std::string root = dir.path();
  auto fresh = [&](const std::string& name) {
    const std::string d = root + "/" + name;
    two_class_png_write(d);
    return d;
  };

  const std::string corrupt = fresh("corrupt");
  bytes_write(corrupt + "/train/zebra/bad.jpg", std::string("\xFF\xD8\xFF\xE0") + std::string(200, 'x'));
  std::string msg = error_of([&] { folder_read(corrupt); });
  EXPECT_NE(msg.find(corrupt + "/train/zebra/bad.jpg"), std::string::npos) << msg;
  EXPECT_NE(msg.find("corrupt or truncated JPEG"), std::string::npos) << msg;

  const std::string truncated = fresh("truncated");
  jpeg_write(truncated + "/test/ant/half.jpg", pattern_hwc(32, 32, 9));
  const std::string whole = bytes_read(truncated + "/test/ant/half.jpg");
  bytes_write(truncated + "/test/ant/half.jpg", whole.substr(0, whole.size() / 2));
  msg = error_of([&] { folder_read(truncated); });
  EXPECT_NE(msg.find(truncated + "/test/ant/half.jpg"), std::string::npos) << msg;

  const std::string bad_png = fresh("bad_png");
  const std::string png = bytes_read(bad_png + "/train/ant/a.png");
  bytes_write(bad_png + "/train/ant/a.png", png.substr(0, png.size() - 30));
  msg = error_of([&] { folder_read(bad_png); });
  EXPECT_NE(msg.find(bad_png + "/train/ant/a.png"), std::string::npos) << msg;

  const std::string not_image = fresh("not_image");
  bytes_write(not_image + "/train/ant/page.jpg", "<html>");
  msg = error_of([&] { folder_read(not_image); });
  EXPECT_NE(msg.find(not_image + "/train/ant/page.jpg is neither a JPEG nor a PNG"), std::string::npos) << msg;

  const std::string extra_class = fresh("extra_class");
  png_write(extra_class + "/test/yak/1.png", pattern_hwc(8, 8, 0));
  msg = error_of([&] { folder_read(extra_class); });
  EXPECT_NE(msg.find(extra_class + "/test/yak is not a class of"), std::string::npos) << msg;

  const std::string empty_class = fresh("empty_class");
  fs::create_directories(empty_class + "/train/moth");
  bytes_write(empty_class + "/train/moth/readme.txt", "no images here");
  msg = error_of([&] { folder_read(empty_class); });
  EXPECT_NE(msg.find(empty_class + "/train/moth has no .jpg, .jpeg or .png images"), std::string::npos) << msg;

  const std::string no_train = root + "/no_train";
  png_write(no_train + "/test/a/1.png", pattern_hwc(8, 8, 0));
  msg = error_of([&] { folder_read(no_train); });
  EXPECT_NE(msg.find("no train folder " + no_train + "/train"), std::string::npos) << msg;

  const std::string no_test = root + "/no_test";
  png_write(no_test + "/train/a/1.png", pattern_hwc(8, 8, 0));
  msg = error_of([&] { folder_read(no_test); });
  EXPECT_NE(msg.find("neither " + no_test + "/test nor " + no_test + "/val exists"), std::string::npos) << msg;

  const std::string no_test_images = root + "/no_test_images";
  png_write(no_test_images + "/train/a/1.png", pattern_hwc(8, 8, 0));
  fs::create_directories(no_test_images + "/test/a");
  msg = error_of([&] { folder_read(no_test_images); });
  EXPECT_NE(msg.find(no_test_images + "/test has no .jpg, .jpeg or .png images"), std::string::npos) << msg;

  msg = error_of([&] { folder_read(root + "/missing"); });
  EXPECT_NE(msg.find(root + "/missing does not exist"), std::string::npos) << msg;

  // None of the refused folders got a cache file.
  for (const char* name : {"corrupt", "truncated", "bad_png", "not_image", "extra_class", "empty_class"}) {
    EXPECT_TRUE(cache_files(root + "/" + name).empty()) << name;
  }
}

TEST(FolderRead, DatasetLoadRegistersFolder) {
  TempDir dir("folder_load");
  two_class_png_write(dir.path());
  const auto& names = dataset_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "folder"), names.end());
  EXPECT_EQ(dataset_kind("folder"), DatasetKind::kImage);
  const DatasetSplits d = dataset_load("folder", dir.path());
  EXPECT_EQ(d.train.name, "folder");
  EXPECT_EQ(d.test.name, "folder");
  ASSERT_EQ(d.mean.size(), 3u);
  ASSERT_EQ(d.std.size(), 3u);
  // Channel 0 of the training images: mean over the 6 patterns of their pixel values.
  const double mean0 = d.train.images.select(1, 0).to(at::kDouble).mean().item<double>() / 255.0;
  EXPECT_NEAR(d.mean[0], mean0, 1e-6);
  EXPECT_NE(error_of([&] { dataset_load("folder", ""); }).find("folder: no data folder given"), std::string::npos);
}

}  // namespace
}  // namespace triaccel
