// Image-folder datasets (--dataset folder --data DIR): the user's own JPEG and PNG images, one subfolder per class,
//   DIR/train/<class>/<image>   and   DIR/test/<class>/<image>   (DIR/val/<class>/<image> when there is no test/).
// Invariants:
// - Classes are the sorted (byte order) names of train/'s subfolders; a label is the class's index in that order.
//   Every class folder of test/ (or val/) is one of train/'s; every class of train/ has at least one image.
// - Images are the files ending in .jpg, .jpeg or .png (any case) of a class folder, sorted by name; other files,
//   and names starting with '.', are ignored. Each is decoded to RGB (gray replicated, alpha dropped).
// - All images of both splits end up the size of the first training image (first class, first file): an image of
//   another size is resized to it with bilinear interpolation (half-pixel centres, as PyTorch's
//   align_corners=False, no antialiasing).
// - The decoded dataset is cached in DIR/.triaccel-cache-<key>.bin, where key hashes every image's relative path,
//   size and modification time and the cache format's version, so any change of the images gives a new key. A
//   cache is used only when its header (magic, version, key, counts, sizes), its length, its checksum and its
//   labels are all valid; otherwise the images are decoded again and the cache rewritten. A folder that cannot be
//   written is read without a cache.
// Errors are UserErrors naming the folder or the file and the fix.
#pragma once

#include "triaccel/data/dataset.h"

#include <cstdint>
#include <string>

namespace triaccel {

enum class FolderSource { kDecoded, kCache };

// What folder_read did, for tests and tools.
struct FolderReadInfo {
  FolderSource source = FolderSource::kDecoded;
  std::string cache_path;  // the cache file read or written; empty when the folder was not writable
  int64_t resized = 0;     // images resized to the first training image's size (0 when read from the cache)
};

// Reads both splits of an image folder (layout above). train and test have name "folder", images
// (N, 3, H, W) uint8, labels (N) int64 in [0, num_classes), and the same num_classes (the classes of train/).
DatasetSplits folder_read(const std::string& dir, FolderReadInfo* info = nullptr);

// Bilinear resize of an interleaved RGB image (in_h, in_w, 3) uint8 into out (out_h, out_w, 3) uint8, half-pixel
// centres (PyTorch's upsample_bilinear2d with align_corners=False), rounded to the nearest integer.
void image_resize_bilinear(const uint8_t* in, int64_t in_h, int64_t in_w, uint8_t* out, int64_t out_h,
                           int64_t out_w);

}  // namespace triaccel
