// Image-folder datasets (folder.h): lists DIR/train and DIR/test (or DIR/val), decodes JPEG with libjpeg(-turbo)
// and PNG with libpng's simplified API, resizes images of another size than the first training image, and keeps the
// decoded tensors in a cache file inside DIR.
// Invariants: the listing is complete and checked (classes, empty folders, no images) before any image is decoded;
// a file's format is taken from its first bytes, not its extension; images are decoded in parallel but the error
// reported is that of the first failing file in listing order, so messages do not depend on the thread count; a
// cache file is trusted only after its header, length and checksum match (folder.h), and is written atomically
// (temporary file + rename) or not at all.
//
// Cache file layout (host byte order; the cache is a local file of the machine that wrote it):
//   FolderCacheHeader (72 bytes) | train images (n_train, 3, H, W) uint8 | test images (n_test, 3, H, W) uint8
// Labels are not stored: they follow from the listing, which the key covers.
#include "triaccel/data/folder.h"

#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <vector>

// After <cstdio>: jpeglib.h uses FILE and size_t without including their headers.
#include <jerror.h>
#include <jpeglib.h>
#include <png.h>

namespace triaccel {

namespace {

constexpr uint32_t kFolderCacheVersion = 1;  // bump when the layout or the decoding changes
constexpr char kFolderCacheMagic[8] = {'T', 'R', 'I', 'F', 'O', 'L', 'D', 'R'};
constexpr const char* kFolderCachePrefix = ".triaccel-cache-";
constexpr const char* kFolderCacheSuffix = ".bin";
constexpr int64_t kMaxImageSide = 32768;
constexpr uint64_t kFnvOffset = 14695981039346656037ull;
constexpr uint64_t kFnvPrime = 1099511628211ull;
constexpr int64_t kChannels = 3;

struct ImageFile {
  std::string path;      // full path
  std::string relative;  // e.g. "train/cat/001.jpg"
  int64_t label = 0;
  int64_t bytes = 0;
  int64_t mtime_ns = 0;
};

struct FolderListing {
  std::vector<std::string> classes;  // sorted
  std::vector<ImageFile> train;      // class by class, files sorted by name
  std::vector<ImageFile> test;
};

struct DecodedImage {
  std::vector<uint8_t> rgb;  // (height, width, 3) uint8, interleaved
  int64_t height = 0;
  int64_t width = 0;
};

struct FolderCacheHeader {
  char magic[8];
  uint32_t version;
  uint32_t num_classes;
  uint64_t key;
  uint64_t n_train;
  uint64_t n_test;
  uint64_t channels;
  uint64_t height;
  uint64_t width;
  uint64_t checksum;  // folder_checksum over the train images, then the test images
};
static_assert(sizeof(FolderCacheHeader) == 72, "the cache header has no padding");

// --- listing ---

std::string folder_join(const std::string& dir, const std::string& name) {
  return !dir.empty() && dir.back() == '/' ? dir + name : dir + "/" + name;
}

bool folder_is_dir(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

// The names in dir, sorted by byte order, without "." and ".." and hidden names (starting with '.', such as
// macOS's "._x.jpg" resource files or a cache file).
std::vector<std::string> folder_entries(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  TRIACCEL_CHECK_INPUT(d != nullptr, "folder: cannot list ", dir, ": ", std::strerror(errno),
                       "; check the folder's permissions");
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') names.emplace_back(e->d_name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<std::string> folder_subdirs(const std::string& dir) {
  std::vector<std::string> out;
  for (const std::string& name : folder_entries(dir)) {
    if (folder_is_dir(folder_join(dir, name))) out.push_back(name);
  }
  return out;
}

bool image_name_accepted(const std::string& name) {
  const size_t dot = name.rfind('.');
  if (dot == std::string::npos) return false;
  std::string ext = name.substr(dot + 1);
  for (char& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return ext == "jpg" || ext == "jpeg" || ext == "png";
}

// The images of one class folder, sorted by name, appended to out.
void folder_list_class(const std::string& root, const std::string& split, const std::string& cls, int64_t label,
                       std::vector<ImageFile>& out) {
  const std::string dir = folder_join(folder_join(root, split), cls);
  for (const std::string& name : folder_entries(dir)) {
    if (!image_name_accepted(name)) continue;
    ImageFile f;
    f.path = folder_join(dir, name);
    struct stat info {};
    if (::stat(f.path.c_str(), &info) != 0 || !S_ISREG(info.st_mode)) continue;
    f.relative = split + "/" + cls + "/" + name;
    f.label = label;
    f.bytes = static_cast<int64_t>(info.st_size);
    f.mtime_ns = static_cast<int64_t>(info.st_mtim.tv_sec) * 1000000000 + info.st_mtim.tv_nsec;
    out.push_back(std::move(f));
  }
}

FolderListing folder_list(const std::string& dir) {
  const std::string layout = "expected " + folder_join(dir, "train/<class>/<image>") + " and " +
                             folder_join(dir, "test/<class>/<image>") + " (or val/), images .jpg, .jpeg or .png";
  TRIACCEL_CHECK_INPUT(folder_is_dir(dir), "folder: data folder ", dir, " does not exist or is not a folder; pass ",
                       option_ref("data_dir"), " with a folder of images: ", layout);
  const std::string train_dir = folder_join(dir, "train");
  TRIACCEL_CHECK_INPUT(folder_is_dir(train_dir), "folder: no train folder ", train_dir, "; ", layout);
  const std::string test_split = folder_is_dir(folder_join(dir, "test")) ? "test" : "val";
  const std::string test_dir = folder_join(dir, test_split);
  TRIACCEL_CHECK_INPUT(folder_is_dir(test_dir), "folder: neither ", folder_join(dir, "test"), " nor ", test_dir,
                       " exists; the run evaluates on it: ", layout);

  FolderListing listing;
  listing.classes = folder_subdirs(train_dir);
  TRIACCEL_CHECK_INPUT(!listing.classes.empty(), "folder: ", train_dir, " has no class folders; ", layout);
  for (size_t k = 0; k < listing.classes.size(); ++k) {
    const size_t before = listing.train.size();
    folder_list_class(dir, "train", listing.classes[k], static_cast<int64_t>(k), listing.train);
    TRIACCEL_CHECK_INPUT(listing.train.size() > before, "folder: class folder ",
                         folder_join(train_dir, listing.classes[k]),
                         " has no .jpg, .jpeg or .png images; a class with no training images cannot be learned: "
                         "add images or remove the folder");
  }
  for (const std::string& cls : folder_subdirs(test_dir)) {
    const auto it = std::lower_bound(listing.classes.begin(), listing.classes.end(), cls);
    TRIACCEL_CHECK_INPUT(it != listing.classes.end() && *it == cls, "folder: class folder ",
                         folder_join(test_dir, cls), " is not a class of ", train_dir,
                         "; every evaluated class must be trained: add ", folder_join(train_dir, cls),
                         " with images, or remove the folder");
    folder_list_class(dir, test_split, cls, it - listing.classes.begin(), listing.test);
  }
  TRIACCEL_CHECK_INPUT(!listing.test.empty(), "folder: ", test_dir, " has no .jpg, .jpeg or .png images in class ",
                       "folders; ", layout);
  return listing;
}

// --- hashing ---

uint64_t fnv1a(uint64_t h, const void* data, size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) h = (h ^ p[i]) * kFnvPrime;
  return h;
}

// FNV-1a over 64-bit words (then the tail bytes): a corruption check of the cache's pixels, 8x faster than bytes.
uint64_t folder_checksum(uint64_t h, const uint8_t* data, size_t size) {
  const size_t words = size / 8;
  for (size_t i = 0; i < words; ++i) {
    uint64_t w;
    std::memcpy(&w, data + i * 8, 8);
    h = (h ^ w) * kFnvPrime;
  }
  return fnv1a(h, data + words * 8, size - words * 8);
}

// The cache key: the format version, then (relative path, size, modification time) of every image in order.
uint64_t folder_key(const FolderListing& listing) {
  uint64_t h = fnv1a(kFnvOffset, &kFolderCacheVersion, sizeof(kFolderCacheVersion));
  for (const auto* split : {&listing.train, &listing.test}) {
    for (const ImageFile& f : *split) {
      h = fnv1a(h, f.relative.data(), f.relative.size() + 1);  // with its '\0', so names cannot run together
      h = fnv1a(h, &f.bytes, sizeof(f.bytes));
      h = fnv1a(h, &f.mtime_ns, sizeof(f.mtime_ns));
    }
  }
  return h;
}

std::string folder_cache_name(uint64_t key) {
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(key));
  return std::string(kFolderCachePrefix) + hex + kFolderCacheSuffix;
}

// --- decoding ---

struct JpegErrorManager {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
  bool truncated;
};

void jpeg_error_exit(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<JpegErrorManager*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

// Warnings are not printed; premature end of data (a truncated file, decoded as grey) counts as an error.
void jpeg_emit_message(j_common_ptr cinfo, int level) {
  auto* err = reinterpret_cast<JpegErrorManager*>(cinfo->err);
  if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF && !err->truncated) {
    err->truncated = true;
    (*cinfo->err->format_message)(cinfo, err->message);
  }
}

// Decodes a JPEG held in memory into out; on a libjpeg error returns false with err->message set. The error handler
// longjmps back here: no object with a destructor lives in this frame, and out lives in the caller's.
bool jpeg_decode(const unsigned char* data, size_t size, DecodedImage* out, JpegErrorManager* err) {
  jpeg_decompress_struct cinfo;
  std::memset(&cinfo, 0, sizeof(cinfo));
  cinfo.err = jpeg_std_error(&err->pub);
  err->pub.error_exit = jpeg_error_exit;
  err->pub.emit_message = jpeg_emit_message;
  err->truncated = false;
  err->message[0] = '\0';
  if (setjmp(err->jump)) {
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);
  cinfo.out_color_space = JCS_RGB;  // grey is replicated; CMYK fails with libjpeg's message
  jpeg_start_decompress(&cinfo);
  if (cinfo.output_components != kChannels || cinfo.output_width > kMaxImageSide ||
      cinfo.output_height > kMaxImageSide) {
    std::snprintf(err->message, sizeof(err->message), "unsupported image: %u x %u with %d components (at most %lld "
                  "per side, RGB or grey)", cinfo.output_width, cinfo.output_height, cinfo.output_components,
                  static_cast<long long>(kMaxImageSide));
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  out->height = cinfo.output_height;
  out->width = cinfo.output_width;
  out->rgb.resize(static_cast<size_t>(out->height * out->width * kChannels));
  while (cinfo.output_scanline < cinfo.output_height) {
    JSAMPROW row = out->rgb.data() + static_cast<size_t>(cinfo.output_scanline) * out->width * kChannels;
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  return !err->truncated;
}

// Decodes a PNG held in memory into out (alpha dropped, grey replicated); on an error returns false with message.
bool png_decode(const unsigned char* data, size_t size, DecodedImage* out, std::string* message) {
  png_image image;
  std::memset(&image, 0, sizeof(image));
  image.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&image, data, size)) {
    *message = image.message;
    png_image_free(&image);
    return false;
  }
  if (image.width > kMaxImageSide || image.height > kMaxImageSide) {
    *message = str_cat("unsupported image: ", image.width, " x ", image.height, " (at most ", kMaxImageSide,
                       " per side)");
    png_image_free(&image);
    return false;
  }
  image.format = PNG_FORMAT_RGBA;
  std::vector<uint8_t> rgba(PNG_IMAGE_SIZE(image));
  if (!png_image_finish_read(&image, nullptr, rgba.data(), 0, nullptr)) {
    *message = image.message;
    png_image_free(&image);
    return false;
  }
  out->height = image.height;
  out->width = image.width;
  const size_t pixels = static_cast<size_t>(out->height * out->width);
  out->rgb.resize(pixels * kChannels);
  for (size_t i = 0; i < pixels; ++i) {
    for (int64_t c = 0; c < kChannels; ++c) out->rgb[i * kChannels + c] = rgba[i * 4 + c];
  }
  png_image_free(&image);
  return true;
}

std::string file_bytes_read(const ImageFile& f) {
  std::ifstream in(f.path, std::ios::binary);
  TRIACCEL_CHECK_INPUT(in.good(), "folder: cannot open ", f.path, ": ", std::strerror(errno),
                       "; check the file's permissions");
  std::string bytes(static_cast<size_t>(f.bytes), '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  TRIACCEL_CHECK_INPUT(in.gcount() == static_cast<std::streamsize>(bytes.size()), "folder: read ", in.gcount(),
                       " of ", bytes.size(), " bytes of ", f.path, "; was the file changed while reading?");
  return bytes;
}

// Reads and decodes one image; throws UserError naming the file. The format comes from the first bytes.
DecodedImage image_decode(const ImageFile& f) {
  const std::string bytes = file_bytes_read(f);
  const auto* data = reinterpret_cast<const unsigned char*>(bytes.data());
  const std::string fix = "; replace or remove the file";
  TRIACCEL_CHECK_INPUT(!bytes.empty(), "folder: ", f.path, " is empty", fix);
  DecodedImage out;
  if (bytes.size() >= 3 && data[0] == 0xFF && data[1] == 0xD8 && data[2] == 0xFF) {
    JpegErrorManager err;
    TRIACCEL_CHECK_INPUT(jpeg_decode(data, bytes.size(), &out, &err), "folder: cannot decode ", f.path,
                         " (corrupt or truncated JPEG): ", err.message, fix);
  } else if (bytes.size() >= 8 && png_sig_cmp(data, 0, 8) == 0) {
    std::string message;
    TRIACCEL_CHECK_INPUT(png_decode(data, bytes.size(), &out, &message), "folder: cannot decode ", f.path,
                         " (corrupt or truncated PNG): ", message, fix);
  } else {
    char head[16];
    std::snprintf(head, sizeof(head), "%02x %02x %02x %02x", data[0], bytes.size() > 1 ? data[1] : 0,
                  bytes.size() > 2 ? data[2] : 0, bytes.size() > 3 ? data[3] : 0);
    throw UserError(str_cat("folder: ", f.path, " is neither a JPEG nor a PNG file (it starts with bytes ", head,
                            ")", fix));
  }
  return out;
}

// Writes an interleaved image into its (3, h, w) slot, resizing it first when its size differs. Returns whether it
// was resized.
bool image_store(const DecodedImage& img, int64_t h, int64_t w, uint8_t* chw) {
  const bool resize = img.height != h || img.width != w;
  std::vector<uint8_t> resized;
  const uint8_t* hwc = img.rgb.data();
  if (resize) {
    resized.resize(static_cast<size_t>(h * w * kChannels));
    image_resize_bilinear(img.rgb.data(), img.height, img.width, resized.data(), h, w);
    hwc = resized.data();
  }
  const int64_t plane = h * w;
  for (int64_t i = 0; i < plane; ++i) {
    for (int64_t c = 0; c < kChannels; ++c) chw[c * plane + i] = hwc[i * kChannels + c];
  }
  return resize;
}

// Decodes files in parallel into one split (name, labels, images (N, 3, h, w)); adds the count of resized images to
// *resized. Throws the error of the first failing file in order.
Dataset folder_decode(const std::vector<ImageFile>& files, int64_t num_classes, int64_t h, int64_t w,
                      int64_t* resized) {
  const int64_t n = static_cast<int64_t>(files.size());
  Dataset d;
  d.name = "folder";
  d.kind = DatasetKind::kImage;
  d.num_classes = num_classes;
  d.images = at::empty({n, kChannels, h, w}, at::kByte);  // (N, 3, H, W), uint8
  d.labels = at::empty({n}, at::kLong);                   // (N), int64
  uint8_t* images = d.images.data_ptr<uint8_t>();
  int64_t* labels = d.labels.data_ptr<int64_t>();
  std::vector<std::string> errors(files.size());
  std::vector<uint8_t> was_resized(files.size(), 0);
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      labels[i] = files[i].label;
      try {
        was_resized[i] = image_store(image_decode(files[i]), h, w, images + i * kChannels * h * w);
      } catch (const UserError& e) {
        errors[i] = e.what();
      }
    }
  });
  for (const std::string& e : errors) {
    if (!e.empty()) throw UserError(e);
  }
  *resized += std::count(was_resized.begin(), was_resized.end(), 1);
  return d;
}

// --- cache ---

// Reads the cache at path into out when it is valid for this listing and key; false (and out untouched) otherwise.
bool folder_cache_read(const std::string& path, const FolderListing& listing, uint64_t key, DatasetSplits& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) return false;
  FolderCacheHeader hd{};
  if (!in.read(reinterpret_cast<char*>(&hd), sizeof(hd))) return false;
  const uint64_t n_train = listing.train.size();
  const uint64_t n_test = listing.test.size();
  if (std::memcmp(hd.magic, kFolderCacheMagic, sizeof(hd.magic)) != 0 || hd.version != kFolderCacheVersion ||
      hd.key != key || hd.num_classes != listing.classes.size() || hd.n_train != n_train || hd.n_test != n_test ||
      hd.channels != kChannels || hd.height < 1 || hd.height > kMaxImageSide || hd.width < 1 ||
      hd.width > kMaxImageSide) {
    return false;
  }
  const uint64_t image_bytes = kChannels * hd.height * hd.width;  // < 2^32, so the products below fit 64 bits
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0 ||
      static_cast<uint64_t>(info.st_size) != sizeof(hd) + (n_train + n_test) * image_bytes) {
    return false;
  }
  DatasetSplits splits;
  uint64_t checksum = kFnvOffset;
  for (auto [d, files] : {std::pair{&splits.train, &listing.train}, std::pair{&splits.test, &listing.test}}) {
    const int64_t n = static_cast<int64_t>(files->size());
    d->name = "folder";
    d->kind = DatasetKind::kImage;
    d->num_classes = static_cast<int64_t>(listing.classes.size());
    d->images = at::empty({n, kChannels, static_cast<int64_t>(hd.height), static_cast<int64_t>(hd.width)},
                          at::kByte);  // (N, 3, H, W), uint8
    d->labels = at::empty({n}, at::kLong);
    int64_t* labels = d->labels.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) labels[i] = (*files)[i].label;
    const size_t bytes = static_cast<size_t>(d->images.numel());
    if (!in.read(reinterpret_cast<char*>(d->images.data_ptr<uint8_t>()), static_cast<std::streamsize>(bytes))) {
      return false;
    }
    checksum = folder_checksum(checksum, d->images.data_ptr<uint8_t>(), bytes);
  }
  if (checksum != hd.checksum) return false;
  out.train = std::move(splits.train);
  out.test = std::move(splits.test);
  return true;
}

// Writes the cache atomically; returns false (leaving no file behind) when the folder is not writable or the disk
// is full. Then removes the caches of other keys (the images changed since they were written).
bool folder_cache_write(const std::string& dir, const std::string& name, uint64_t key, const DatasetSplits& data) {
  FolderCacheHeader hd{};
  std::memcpy(hd.magic, kFolderCacheMagic, sizeof(hd.magic));
  hd.version = kFolderCacheVersion;
  hd.num_classes = static_cast<uint32_t>(data.train.num_classes);
  hd.key = key;
  hd.n_train = static_cast<uint64_t>(data.train.size());
  hd.n_test = static_cast<uint64_t>(data.test.size());
  hd.channels = kChannels;
  hd.height = static_cast<uint64_t>(data.train.height());
  hd.width = static_cast<uint64_t>(data.train.width());
  const size_t train_bytes = static_cast<size_t>(data.train.images.numel());
  const size_t test_bytes = static_cast<size_t>(data.test.images.numel());
  const auto* train = data.train.images.data_ptr<uint8_t>();
  const auto* test = data.test.images.data_ptr<uint8_t>();
  hd.checksum = folder_checksum(folder_checksum(kFnvOffset, train, train_bytes), test, test_bytes);
  std::string bytes;
  bytes.reserve(sizeof(hd) + train_bytes + test_bytes);
  bytes.append(reinterpret_cast<const char*>(&hd), sizeof(hd));
  bytes.append(reinterpret_cast<const char*>(train), train_bytes);
  bytes.append(reinterpret_cast<const char*>(test), test_bytes);
  const std::string path = folder_join(dir, name);
  try {
    file_remove_stale_temps(path);
    file_write_atomic(path, bytes);
  } catch (const UserError&) {
    return false;  // a read-only or full folder: run without a cache
  }
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return true;
  while (const dirent* e = ::readdir(d)) {
    const std::string other = e->d_name;
    if (other != name && other.rfind(kFolderCachePrefix, 0) == 0 && other.size() > std::strlen(kFolderCacheSuffix) &&
        other.compare(other.size() - std::strlen(kFolderCacheSuffix), std::string::npos, kFolderCacheSuffix) == 0) {
      ::unlink(folder_join(dir, other).c_str());
    }
  }
  ::closedir(d);
  return true;
}

}  // namespace

void image_resize_bilinear(const uint8_t* in, int64_t in_h, int64_t in_w, uint8_t* out, int64_t out_h,
                           int64_t out_w) {
  TORCH_CHECK(in_h > 0 && in_w > 0 && out_h > 0 && out_w > 0, "image_resize_bilinear: sizes must be positive, got ",
              in_h, "x", in_w, " -> ", out_h, "x", out_w);
  // Per output coordinate: the two source indices and the weight of the second (half-pixel centres, clamped at 0).
  struct Tap {
    int64_t i0, i1;
    double t;
  };
  auto taps = [](int64_t in_size, int64_t out_size) {
    std::vector<Tap> out(static_cast<size_t>(out_size));
    const double scale = static_cast<double>(in_size) / static_cast<double>(out_size);
    for (int64_t o = 0; o < out_size; ++o) {
      const double src = std::max(0.0, (static_cast<double>(o) + 0.5) * scale - 0.5);
      const int64_t i0 = std::min(static_cast<int64_t>(src), in_size - 1);
      out[o] = Tap{i0, std::min(i0 + 1, in_size - 1), src - static_cast<double>(i0)};
    }
    return out;
  };
  const std::vector<Tap> ys = taps(in_h, out_h);
  const std::vector<Tap> xs = taps(in_w, out_w);
  for (int64_t y = 0; y < out_h; ++y) {
    const Tap& ty = ys[y];
    const uint8_t* row0 = in + ty.i0 * in_w * kChannels;
    const uint8_t* row1 = in + ty.i1 * in_w * kChannels;
    for (int64_t x = 0; x < out_w; ++x) {
      const Tap& tx = xs[x];
      for (int64_t c = 0; c < kChannels; ++c) {
        const double top = row0[tx.i0 * kChannels + c] * (1.0 - tx.t) + row0[tx.i1 * kChannels + c] * tx.t;
        const double bottom = row1[tx.i0 * kChannels + c] * (1.0 - tx.t) + row1[tx.i1 * kChannels + c] * tx.t;
        const double v = top * (1.0 - ty.t) + bottom * ty.t;
        out[(y * out_w + x) * kChannels + c] = static_cast<uint8_t>(std::clamp(std::floor(v + 0.5), 0.0, 255.0));
      }
    }
  }
}

DatasetSplits folder_read(const std::string& dir, FolderReadInfo* info) {
  const FolderListing listing = folder_list(dir);
  const uint64_t key = folder_key(listing);
  const std::string cache_name = folder_cache_name(key);
  const std::string cache_path = folder_join(dir, cache_name);
  FolderReadInfo local;
  FolderReadInfo& result = info != nullptr ? *info : local;
  result = FolderReadInfo{};
  DatasetSplits out;
  if (folder_cache_read(cache_path, listing, key, out)) {
    result.source = FolderSource::kCache;
    result.cache_path = cache_path;
    return out;
  }
  // The size every image ends up: the first training image's.
  const DecodedImage first = image_decode(listing.train.front());
  const auto num_classes = static_cast<int64_t>(listing.classes.size());
  out.train = folder_decode(listing.train, num_classes, first.height, first.width, &result.resized);
  out.test = folder_decode(listing.test, num_classes, first.height, first.width, &result.resized);
  if (folder_cache_write(dir, cache_name, key, out)) result.cache_path = cache_path;
  return out;
}

}  // namespace triaccel
