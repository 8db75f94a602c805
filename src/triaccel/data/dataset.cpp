// Named datasets: finds the standard files of cifar10, cifar100, mnist and fashion-mnist in a folder (or hands an image
// folder to folder_read), reads both splits with the format readers and computes the per-channel normalisation
// statistics of the training split.
// Invariants: every file is located before any is read, so a missing file is reported by name and folder with the
// command that fixes it; train and test splits of one dataset have the same (C, H, W) and class count.
#include "triaccel/data/dataset.h"

#include "triaccel/core/errors.h"
#include "triaccel/data/folder.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>

namespace triaccel {

namespace {

constexpr const char* kFashionMnistDefaultDir = "/usr/share/datasets/fashion-mnist";

bool dataset_is_file(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

bool dataset_is_dir(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

std::string dataset_join(const std::string& dir, const std::string& name) {
  return !dir.empty() && dir.back() == '/' ? dir + name : dir + "/" + name;
}

std::string dataset_join_names(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

void dataset_check_dir(const std::string& name, const std::string& dir, const std::string& fix_hint) {
  TRIACCEL_CHECK_INPUT(dataset_is_dir(dir), name, ": data folder ", dir, " does not exist or is not a folder; ",
                       fix_hint);
}

// Finds the folder (dir itself, or dir/subfolder) that holds all of files, and returns each file's full path.
// Throws naming the first missing file, the folder it was expected in, and fix_hint.
std::vector<std::string> dataset_find_files(const std::string& name, const std::string& dir,
                                            const std::string& subfolder, const std::vector<std::string>& files,
                                            const std::string& fix_hint) {
  dataset_check_dir(name, dir, fix_hint);
  const std::vector<std::string> candidates = {dir, dataset_join(dir, subfolder)};
  // The candidate holding the most of the files: all of them when the data is complete, else the best guess
  // of where the user meant them to be.
  std::string best = candidates.front();
  int64_t best_found = -1;
  for (const std::string& folder : candidates) {
    const auto found = std::count_if(files.begin(), files.end(),
                                     [&](const std::string& f) { return dataset_is_file(dataset_join(folder, f)); });
    if (found > best_found) {
      best = folder;
      best_found = found;
    }
  }
  std::vector<std::string> paths;
  for (const std::string& file : files) {
    const std::string path = dataset_join(best, file);
    TRIACCEL_CHECK_INPUT(dataset_is_file(path), name, ": ", file, " not found in ", best, " (looked in ", candidates[0],
                         " and ", candidates[1], "); ", fix_hint);
    paths.push_back(path);
  }
  return paths;
}

// One IDX file by its base name: the plain file when present, else the .gz one.
std::string dataset_find_idx(const std::string& name, const std::string& dir, const std::string& base,
                             const std::string& fix_hint) {
  const std::string plain = dataset_join(dir, base);
  if (dataset_is_file(plain)) return plain;
  const std::string gz = plain + ".gz";
  if (dataset_is_file(gz)) return gz;
  throw UserError(c10::str(name, ": neither ", base, " nor ", base, ".gz found in ", dir, "; ", fix_hint));
}

DatasetSplits dataset_load_cifar10(const std::string& dir) {
  const std::string hint = str_cat("unpack CIFAR-10's binary version (cifar-10-binary.tar.gz), or build its files from an "
                                   "image copy with build_cifar10_bin.py (README, Data), into ",
                                   dir.empty() ? "DIR" : dir, ", then pass ", option_ref("data_dir"), " with that folder");
  TRIACCEL_CHECK_INPUT(!dir.empty(), "cifar10: no data folder given; ", hint);
  std::vector<std::string> names;
  for (int k = 1; k <= 5; ++k) names.push_back(c10::str("data_batch_", k, ".bin"));
  names.push_back("test_batch.bin");
  std::vector<std::string> paths = dataset_find_files("cifar10", dir, "cifar-10-batches-bin", names, hint);
  const std::string test_path = paths.back();
  paths.pop_back();
  DatasetSplits out;
  out.train = cifar_read(paths, CifarLabel::kCifar10);
  out.test = cifar_read({test_path}, CifarLabel::kCifar10);
  return out;
}

DatasetSplits dataset_load_cifar100(const std::string& dir) {
  const std::string hint =
      "pass " + option_ref("data_dir") + " with the folder of the CIFAR-100 binary version (train.bin, test.bin, from cifar-100-binary.tar.gz)";
  TRIACCEL_CHECK_INPUT(!dir.empty(), "cifar100: no data folder given; ", hint);
  const std::vector<std::string> paths =
      dataset_find_files("cifar100", dir, "cifar-100-binary", {"train.bin", "test.bin"}, hint);
  DatasetSplits out;
  out.train = cifar_read({paths[0]}, CifarLabel::kCifar100Fine);
  out.test = cifar_read({paths[1]}, CifarLabel::kCifar100Fine);
  return out;
}

DatasetSplits dataset_load_idx(const std::string& name, const std::string& dir_arg) {
  const std::string files_text = "{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]";
  std::string dir = dir_arg;
  std::string hint = c10::str("pass " + option_ref("data_dir") + " with the folder that holds ", files_text);
  if (dir.empty()) {
    TRIACCEL_CHECK_INPUT(name == "fashion-mnist", name, ": no data folder given and ", name,
                         " has no default location; ", hint);
    dir = kFashionMnistDefaultDir;
    hint = c10::str("install the Debian package dataset-fashion-mnist (it fills ", dir, "), or ", hint);
  }
  dataset_check_dir(name, dir, hint);
  const std::string train_images = dataset_find_idx(name, dir, "train-images-idx3-ubyte", hint);
  const std::string train_labels = dataset_find_idx(name, dir, "train-labels-idx1-ubyte", hint);
  const std::string test_images = dataset_find_idx(name, dir, "t10k-images-idx3-ubyte", hint);
  const std::string test_labels = dataset_find_idx(name, dir, "t10k-labels-idx1-ubyte", hint);
  DatasetSplits out;
  out.train = idx_read(train_images, train_labels, 10);
  out.test = idx_read(test_images, test_labels, 10);
  TRIACCEL_CHECK_INPUT(out.train.images.sizes().slice(1) == out.test.images.sizes().slice(1), name, ": test images ",
                       test_images, " are ", out.test.height(), "x", out.test.width(), " but train images ",
                       train_images, " are ", out.train.height(), "x", out.train.width(), ", expected the same size");
  return out;
}

DatasetSplits dataset_load_text(const std::string& name, const std::string& dir_arg, int64_t block_size) {
  TRIACCEL_CHECK_INPUT(!dir_arg.empty(), name, " has no standard location: pass ", option_ref("data_dir"),
                       " with the folder that holds input.txt (the plain-text corpus)");
  const std::string& dir = dir_arg;
  const std::string path = dataset_join(dir, "input.txt");
  TRIACCEL_CHECK_INPUT(dataset_is_file(path), name, ": input.txt not found in ", dir,
                       "; pass " + option_ref("data_dir") + " with the folder that holds input.txt (the plain-text corpus)");
  return text_read(path, name, block_size);
}

DatasetSplits dataset_load_folder(const std::string& dir) {
  TRIACCEL_CHECK_INPUT(!dir.empty(), "folder: no data folder given; pass ", option_ref("data_dir"),
                       " with a folder holding train/<class>/<image> and test/<class>/<image> (or val/), images "
                       ".jpg, .jpeg or .png");
  return folder_read(dir);
}

}  // namespace

const std::vector<std::string>& dataset_names() {
  static const std::vector<std::string> names = {"cifar10",         "cifar100", "mnist", "fashion-mnist",
                                                 "tinyshakespeare", "folder",   "tensors"};
  return names;
}

DatasetKind dataset_kind(const std::string& name) {
  return name == "tinyshakespeare" ? DatasetKind::kTokens : DatasetKind::kImage;
}

DatasetSplits dataset_load(const std::string& name, const std::string& dir, int64_t block_size) {
  const auto& names = dataset_names();
  TRIACCEL_CHECK_INPUT(std::find(names.begin(), names.end(), name) != names.end(), "unknown dataset '", name,
                       "'; known datasets: ", dataset_join_names(names));
  TRIACCEL_CHECK_INPUT(name != "tensors", option_ref("dataset"),
                       " tensors holds images a program passes (Python: triaccel.train(model, train=(images, labels), "
                       "test=(images, labels))); from the command line give a dataset read from files");
  if (dataset_kind(name) == DatasetKind::kTokens) return dataset_load_text(name, dir, block_size);
  DatasetSplits out;
  if (name == "cifar10") {
    out = dataset_load_cifar10(dir);
  } else if (name == "cifar100") {
    out = dataset_load_cifar100(dir);
  } else if (name == "folder") {
    out = dataset_load_folder(dir);
  } else {
    out = dataset_load_idx(name, dir);
  }
  out.train.name = name;
  out.test.name = name;
  dataset_channel_stats(out.train.images, out.mean, out.std);
  return out;
}

namespace {

// One split of dataset_from_tensors as the Dataset invariants want it: (N, C, H, W) uint8 and (N) int64 on the CPU.
Dataset dataset_split_from_tensors(const std::string& split, const at::Tensor& images_in, const at::Tensor& labels_in) {
  TRIACCEL_CHECK_INPUT(images_in.defined() && labels_in.defined(), split, " needs (images, labels), both tensors");
  at::Tensor images = images_in.detach().cpu();
  at::Tensor labels = labels_in.detach().cpu();
  TRIACCEL_CHECK_INPUT(images.dim() == 3 || images.dim() == 4, split, " images must be (N, C, H, W) or (N, H, W), got ",
                       images.dim(), " dimensions of shape ", images.sizes());
  if (images.dim() == 3) images = images.unsqueeze(1);
  TRIACCEL_CHECK_INPUT(images.size(0) > 0 && images.numel() > 0, split, " holds no images (shape ", images.sizes(), ")");
  if (images.is_floating_point()) {
    const double lo = images.min().item<double>();
    const double hi = images.max().item<double>();
    TRIACCEL_CHECK_INPUT(lo >= 0.0 && hi <= 1.0, split, " images are floating point with values in [", lo, ", ", hi,
                         "]; pass pixels in [0, 1] or uint8 in [0, 255], unnormalized (triaccel normalizes each "
                         "channel with the training split's mean and std)");
    images = images.mul(255.0).round_().to(at::kByte);  // the loader keeps every dataset as uint8 pixels
  } else {
    TRIACCEL_CHECK_INPUT(images.scalar_type() == at::kByte, split, " images must be uint8 or floating point in [0, 1], "
                         "got ", images.scalar_type());
  }
  TRIACCEL_CHECK_INPUT(labels.dim() == 1 && !labels.is_floating_point() && !labels.is_complex() &&
                           labels.scalar_type() != at::kBool,
                       split, " labels must be one integer class index per image, shape (N), got ", labels.scalar_type(),
                       " of shape ", labels.sizes());
  TRIACCEL_CHECK_INPUT(labels.size(0) == images.size(0), split, " has ", images.size(0), " images but ", labels.size(0),
                       " labels");
  labels = labels.to(at::kLong).contiguous();
  const int64_t low = labels.min().item<int64_t>();
  TRIACCEL_CHECK_INPUT(low >= 0, split, " labels must be class indices >= 0, found ", low);
  Dataset out;
  out.name = "tensors";
  out.images = images.contiguous();
  out.labels = labels;
  return out;
}

}  // namespace

DatasetSplits dataset_from_tensors(const at::Tensor& train_images, const at::Tensor& train_labels,
                                   const at::Tensor& test_images, const at::Tensor& test_labels) {
  DatasetSplits out;
  out.train = dataset_split_from_tensors("train", train_images, train_labels);
  out.test = dataset_split_from_tensors("test", test_images, test_labels);
  TRIACCEL_CHECK_INPUT(out.train.images.sizes().slice(1) == out.test.images.sizes().slice(1),
                       "train images are ", out.train.images.sizes().slice(1), " (C, H, W) but test images are ",
                       out.test.images.sizes().slice(1), "; resize them to one size");
  const int64_t train_classes = out.train.labels.max().item<int64_t>() + 1;
  const int64_t test_classes = out.test.labels.max().item<int64_t>() + 1;
  TRIACCEL_CHECK_INPUT(test_classes <= train_classes, "test has class ", test_classes - 1,
                       " but the training labels go up to ", train_classes - 1,
                       " only; the model cannot learn a class it never sees");
  out.train.num_classes = train_classes;
  out.test.num_classes = train_classes;
  dataset_channel_stats(out.train.images, out.mean, out.std);
  return out;
}

Dataset dataset_raw(const std::string& split, const at::Tensor& inputs, const at::Tensor& targets) {
  TRIACCEL_CHECK_INPUT(inputs.defined() && targets.defined(), split, " needs (inputs, targets), both tensors");
  TRIACCEL_CHECK_INPUT(inputs.dim() >= 1 && inputs.size(0) > 0, split, " holds no samples (inputs of shape ",
                       inputs.sizes(), ")");
  TRIACCEL_CHECK_INPUT(targets.dim() >= 1 && targets.size(0) == inputs.size(0), split, " has ", inputs.size(0),
                       " inputs but targets of shape ", targets.sizes(),
                       "; give one target per input along the first dimension");
  Dataset out;
  out.name = "tensors";
  out.kind = DatasetKind::kTensors;
  out.images = inputs.detach().cpu().contiguous();
  out.labels = targets.detach().cpu().contiguous();
  return out;
}

Dataset dataset_from_source(std::shared_ptr<SampleSource> source, const std::string& split) {
  TRIACCEL_CHECK_INPUT(source && source->size() > 0, split, " holds no samples");
  auto [x, y] = source->fetch(0, {0});
  Dataset out = dataset_raw(split, x, y);
  TRIACCEL_CHECK_INPUT(out.images.size(0) == 1, split, ": fetching one sample gave ", out.images.size(0));
  out.source = std::move(source);
  return out;
}

namespace {

int64_t classes_of(const at::Tensor& targets) {
  if (targets.is_floating_point() || targets.is_complex() || targets.scalar_type() == at::kBool) return 1;
  return std::max<int64_t>(1, targets.max().item<int64_t>() + 1);
}

}  // namespace

DatasetSplits dataset_splits_raw(Dataset train, Dataset test) {
  TRIACCEL_CHECK_INPUT(train.images.sizes().slice(1) == test.images.sizes().slice(1) &&
                           train.images.scalar_type() == test.images.scalar_type(),
                       "train inputs are ", train.images.scalar_type(), " ", train.images.sizes().slice(1),
                       " per sample but test inputs are ", test.images.scalar_type(), " ",
                       test.images.sizes().slice(1), "; give both splits one shape and dtype");
  DatasetSplits out;
  out.train = std::move(train);
  out.test = std::move(test);
  out.train.num_classes = std::max(classes_of(out.train.labels), classes_of(out.test.labels));
  out.test.num_classes = out.train.num_classes;
  return out;
}

void dataset_channel_stats(const at::Tensor& images_in, std::vector<float>& mean_out, std::vector<float>& std_out) {
  TORCH_CHECK(images_in.defined() && images_in.dim() == 4 && images_in.scalar_type() == at::kByte &&
                  images_in.device().is_cpu(),
              "dataset_channel_stats: expected a (N, C, H, W) uint8 CPU tensor, got ",
              images_in.defined() ? images_in.toString() : "an undefined tensor", " of shape ",
              images_in.defined() ? images_in.sizes() : at::IntArrayRef{});
  TORCH_CHECK(images_in.numel() > 0, "dataset_channel_stats: no pixels in a tensor of shape ", images_in.sizes());
  const at::Tensor images = images_in.contiguous();  // (N, C, H, W), uint8
  const int64_t n = images.size(0);
  const int64_t channels = images.size(1);
  const int64_t plane = images.size(2) * images.size(3);
  const uint8_t* data = images.data_ptr<uint8_t>();
  // Exact integer sums. Within a block of at most kStatsBlock pixels the sums fit 32 bits (65536 * 255^2 < 2^32),
  // which lets the compiler vectorise the inner loop; the totals are 64-bit.
  constexpr int64_t kStatsBlock = 65536;
  std::vector<uint64_t> sum(static_cast<size_t>(channels), 0);
  std::vector<uint64_t> sum_sq(static_cast<size_t>(channels), 0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < channels; ++c) {
      const uint8_t* p = data + (i * channels + c) * plane;
      for (int64_t start = 0; start < plane; start += kStatsBlock) {
        const int64_t end = std::min(plane, start + kStatsBlock);
        uint32_t s = 0;
        uint32_t s2 = 0;
        for (int64_t k = start; k < end; ++k) {
          const uint32_t v = p[k];
          s += v;
          s2 += v * v;
        }
        sum[c] += s;
        sum_sq[c] += s2;
      }
    }
  }
  const double count = static_cast<double>(n * plane);
  mean_out.assign(static_cast<size_t>(channels), 0.0f);
  std_out.assign(static_cast<size_t>(channels), 0.0f);
  for (int64_t c = 0; c < channels; ++c) {
    const double m = static_cast<double>(sum[c]) / count / 255.0;
    const double m2 = static_cast<double>(sum_sq[c]) / count / (255.0 * 255.0);
    mean_out[c] = static_cast<float>(m);
    std_out[c] = static_cast<float>(std::sqrt(std::max(0.0, m2 - m * m)));  // population std over all pixels
  }
}

}  // namespace triaccel
