// In-memory datasets and the readers for their file formats: image classification, and character-level text.
// Invariants (images): images are (N, C, H, W) uint8 on the CPU, contiguous; labels are (N) int64 in
// [0, num_classes). Invariants (tokens): images holds the inputs (N, T) int64 and labels the targets (N, T) int64,
// both in [0, num_classes) where num_classes is the vocabulary size; labels[i][t] = images[i][t + 1] in the text.
// Readers validate every size, magic number and label before trusting it and name the file, the offset and the
// expected value in the UserError they throw.
#pragma once

#include "triaccel/data/cifar_format.h"
#include "triaccel/data/text_format.h"

#include <ATen/Tensor.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <string>
#include <vector>

namespace triaccel {

// kImage: uint8 pixels, normalized and augmented by the loader; kTokens: a character corpus's ids; kTensors: inputs
// and targets a program passes as they are (any shape and dtype), which the loader only batches.
enum class DatasetKind { kImage, kTokens, kTensors };

// Samples a program serves itself (the Python module's torch Dataset and DataLoader, kTensors): the loader asks for
// the samples of its epoch's order by offset, and the source returns them collated on the CPU (pinned where it can).
class SampleSource {
 public:
  virtual ~SampleSource() = default;
  virtual int64_t size() const = 0;
  // The epoch's order of dataset indices (a source may start fetching ahead in it).
  virtual void epoch_begin(const std::vector<int64_t>& order) = 0;
  // Samples [offset, offset + ids.size()) of the order; `ids` are their dataset indices. (inputs, targets), each
  // (count, ...), with the shapes and dtypes of the dataset's example.
  virtual std::pair<at::Tensor, at::Tensor> fetch(int64_t offset, const std::vector<int64_t>& ids) = 0;
  // The next epoch's order, given once this epoch's last sample was fetched (while its last step and the
  // evaluation run): a source may start fetching it. epoch_begin follows with the same order when that epoch comes.
  virtual void epoch_ahead(const std::vector<int64_t>& /*order*/) {}
};

struct Dataset {
  std::string name;        // "cifar10", "cifar100", "mnist", "fashion-mnist", "tinyshakespeare", "folder"
  DatasetKind kind = DatasetKind::kImage;
  at::Tensor images;       // (N, C, H, W) uint8, CPU, contiguous; tokens: (N, T) int64 inputs
  at::Tensor labels;       // (N) int64, CPU; tokens: (N, T) int64 next-token targets
  int64_t num_classes = 0; // tokens: the vocabulary size
  std::string vocab;       // tokens: the characters (bytes) of ids 0 .. num_classes - 1, sorted

  // kTensors served by the program: images and labels then hold one example sample (1, ...) for shapes and dtypes.
  std::shared_ptr<SampleSource> source;
  int64_t size() const { return source ? source->size() : images.defined() ? images.size(0) : 0; }
  int64_t channels() const { return images.size(1); }
  int64_t height() const { return images.size(2); }
  int64_t width() const { return images.size(3); }
};

struct DatasetSplits {
  Dataset train;
  Dataset test;
  std::vector<float> mean;  // per channel, in [0, 1], from the training split (empty for tokens)
  std::vector<float> std;   // per channel, from the training split (empty for tokens)
};

constexpr int64_t kTextBlockSize = 256;  // tokens per sample of a text dataset unless told otherwise

// A character-level text corpus (text.cpp). The vocabulary is the sorted set of distinct bytes of the whole file;
// the first 90 % of the characters are the training split, the last 10 % the validation split (reported as
// "test"); each split is cut into windows of block_size + 1 characters at stride block_size (input = the first
// block_size, target = the last block_size), so every input character is in exactly one sample and leftover
// characters at a split's end are dropped. Throws UserError for an empty or binary file, or a file too short for
// one window per split.
DatasetSplits text_read(const std::string& path, const std::string& name, int64_t block_size);
at::Tensor text_encode(const std::string& text, const std::string& vocab);  // (len) int64; throws on unknown bytes
std::string text_decode(const at::Tensor& ids, const std::string& vocab);

// What a named dataset holds (images or tokens), for checking it against the model.
DatasetKind dataset_kind(const std::string& name);

// CIFAR binary layout. CIFAR-10 records: 1 label byte + 3072 planar RGB bytes; CIFAR-100 records: coarse label
// byte, fine label byte, 3072 bytes. Files are concatenated in the order given.
Dataset cifar_read(const std::vector<std::string>& files, CifarLabel label_kind);

// IDX files (MNIST / Fashion-MNIST), plain or gzip-compressed (detected by the gzip magic, not the name).
// images: magic 0x00000803, dims N, H, W; labels: magic 0x00000801, dim N; N must match.
Dataset idx_read(const std::string& images_path, const std::string& labels_path, int64_t num_classes = 10);

// Loads a named dataset from dir, finding the standard file names:
//   cifar10:  data_batch_1..5.bin, test_batch.bin (also inside a cifar-10-batches-bin/ subfolder)
//   cifar100: train.bin, test.bin (also inside cifar-100-binary/)
//   mnist, fashion-mnist: {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]
//   tinyshakespeare: input.txt (text_read, windows of block_size + 1 characters)
//   folder:   train/<class>/<image> and test/<class>/<image> (or val/), JPEG and PNG (folder.h: folder_read, cached)
//   tensors:  refused: a program passes them (dataset_from_tensors, RunHooks::data)
// An empty dir means the standard location where a dataset has one: fashion-mnist → /usr/share/datasets/fashion-mnist
// (Debian's dataset-fashion-mnist); the others need a folder.
// Unknown names or missing files throw UserError naming what was expected and where.
DatasetSplits dataset_load(const std::string& name, const std::string& dir, int64_t block_size = kTextBlockSize);

// The dataset "tensors": images and labels a program passes (the Python module's train=(images, labels)). Images
// (N, C, H, W) or (N, H, W), uint8 or floating point in [0, 1] (stored as uint8 pixels, rounded); labels (N) of any
// integer type, class indices >= 0; both splits of one image shape. num_classes is the largest training label + 1;
// a test label above it is refused. Copied to the CPU. UserError naming the split and what is wrong.
DatasetSplits dataset_from_tensors(const at::Tensor& train_images, const at::Tensor& train_labels,
                                   const at::Tensor& test_images, const at::Tensor& test_labels);
// The dataset "tensors" of kind kTensors: inputs (N, ...) and targets (N, ...) of any dtype, batched as they are (no
// normalization, no augmentation). One split from tensors (copied to the CPU), or from a SampleSource (its first
// sample is the example that gives the shapes); dataset_splits_raw checks that both splits hold samples of one shape
// and dtype and sets num_classes: the largest integer target + 1 (1 for other targets). UserError naming the split.
Dataset dataset_raw(const std::string& split, const at::Tensor& inputs, const at::Tensor& targets);
Dataset dataset_from_source(std::shared_ptr<SampleSource> source, const std::string& split);
DatasetSplits dataset_splits_raw(Dataset train, Dataset test);

// Per-channel mean and std of a uint8 image tensor, scaled to [0, 1].
void dataset_channel_stats(const at::Tensor& images, std::vector<float>& mean, std::vector<float>& std);

// The dataset names dataset_load accepts, for --help and error messages.
const std::vector<std::string>& dataset_names();

}  // namespace triaccel
