// In-memory image classification datasets and the readers for their file formats.
// Invariants: images are (N, C, H, W) uint8 on the CPU, contiguous; labels are (N) int64 in [0, num_classes).
// Readers validate every size, magic number and label before trusting it and name the file, the offset and the
// expected value in the UserError they throw.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace triaccel {

struct Dataset {
  std::string name;        // "cifar10", "cifar100", "mnist", "fashion-mnist"
  at::Tensor images;       // (N, C, H, W) uint8, CPU, contiguous
  at::Tensor labels;       // (N) int64, CPU
  int64_t num_classes = 0;

  int64_t size() const { return images.defined() ? images.size(0) : 0; }
  int64_t channels() const { return images.size(1); }
  int64_t height() const { return images.size(2); }
  int64_t width() const { return images.size(3); }
};

struct DatasetSplits {
  Dataset train;
  Dataset test;
  std::vector<float> mean;  // per channel, in [0, 1], from the training split
  std::vector<float> std;   // per channel, from the training split
};

enum class CifarLabel { kCifar10, kCifar100Fine, kCifar100Coarse };

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
// An empty dir means the default location: fashion-mnist → /usr/share/datasets/fashion-mnist.
// Unknown names or missing files throw UserError naming what was expected and where.
DatasetSplits dataset_load(const std::string& name, const std::string& dir);

// Per-channel mean and std of a uint8 image tensor, scaled to [0, 1].
void dataset_channel_stats(const at::Tensor& images, std::vector<float>& mean, std::vector<float>& std);

// The dataset names dataset_load accepts, for --help and error messages.
const std::vector<std::string>& dataset_names();

}  // namespace triaccel
