// A batch loader. The uint8 dataset is copied to the device once (placement kDevice), or kept in pinned host memory
// (kHost: the memory planner's lever when the dataset does not fit the budget), from which each batch's samples are
// gathered on the host and copied to the device; either way each batch is augmented and normalized on the device
// (kernels/augment.cu on CUDA, augment_reference on the CPU), with the same result bit for bit.
// Determinism: the order and the augmentation of epoch e are a pure function of (seed, e), drawn on the CPU,
// so a resumed run, a CPU run and a GPU run all see the same samples in the same order with the same crops (and
// cutout squares). The draws come from one generator in a fixed order: order, crop shifts, flips, cutout centres;
// cutout's draws come last, so --cutout 0 leaves the order, crops and flips of earlier runs unchanged.
// Any batch is addressed by its offset in the epoch's order, so batch sizes may change mid-epoch without
// skipping or repeating a sample. Token datasets (DatasetKind::kTokens) pass through unchanged: inputs (count, T)
// and targets (count, T) int64, same seeded order, no normalization or augmentation (augment must be off).
#pragma once

#include "triaccel/core/enum_names.h"
#include "triaccel/data/dataset.h"

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace triaccel {

// Where a loader keeps its dataset on a CUDA device (on the CPU both are the same).
enum class DataPlacement { kDevice, kHost };
template <>
struct EnumNames<DataPlacement> {
  static constexpr EnumName<DataPlacement> kNames[] = {{DataPlacement::kDevice, "device"},
                                                       {DataPlacement::kHost, "host"}};
};

struct LoaderOptions {
  int64_t batch_size = 128;
  bool shuffle = true;
  bool augment = false;      // random crop with `pad` zero pixels on each side + horizontal flip
  int64_t pad = 4;
  // Cutout (DeVries & Taylor 2017): after crop and flip, one cutout × cutout square per image at a uniformly random
  // centre (cy, cx) ∈ [0, H) × [0, W) (output coordinates), covering rows [cy − cutout/2, cy − cutout/2 + cutout)
  // and columns [cx − cutout/2, cx − cutout/2 + cutout) (integer division) clipped at the borders, is set to 0 in
  // normalized space, i.e. to the channel's dataset mean (not to black, as the crop padding is). 0: off.
  // Independent of `augment`; in native pixels (before an image_size resize); at most min(H, W) (Loader checks).
  int64_t cutout = 0;
  int64_t image_size = 0;    // 0: native size; else bilinear resize to image_size × image_size
  bool channels_last = false;
  uint64_t seed = 0;
  DataPlacement placement = DataPlacement::kDevice;

  void validate() const;
};

class Loader {
 public:
  Loader(const Dataset& data, std::vector<float> mean, std::vector<float> std, LoaderOptions options,
         const c10::Device& device);

  // Draws the order (and augmentation) of epoch `epoch`. Must be called before batch(). A served dataset's source
  // is told the next epoch's order (SampleSource::epoch_ahead) when the epoch's last sample is fetched.
  void epoch_begin(int64_t epoch);

  int64_t size() const { return size_; }
  int64_t steps_per_epoch() const { return (size() + options_.batch_size - 1) / options_.batch_size; }
  int64_t image_height() const;  // 0 for tokens
  int64_t image_width() const;   // 0 for tokens
  int64_t channels() const { return images_.size(1); }
  DatasetKind kind() const { return kind_; }
  const LoaderOptions& options() const { return options_; }

  // Samples [offset, offset + count) of the epoch's order: images (count, C, H', W') float32 (channels_last if
  // asked) and labels (count) int64, on the device.
  void batch_into(int64_t offset, int64_t count, at::Tensor& images, at::Tensor& labels) const;
  std::pair<at::Tensor, at::Tensor> batch(int64_t offset, int64_t count) const;
  // The dataset indices of samples [offset, offset + count) of the epoch's order: (count) int64 on the CPU.
  std::vector<int64_t> sample_indices(int64_t offset, int64_t count) const;
  at::Tensor batch_images_empty(int64_t count) const;  // an output buffer of the right shape and format
  at::Tensor batch_labels_empty(int64_t count) const;  // (count) int64, or (count, T) int64 for tokens

  // Bytes the dataset holds on the device: the whole copy (kDevice) or the per-epoch order and draws (kHost; the
  // staging buffers come on top, batch_staging_bytes per sample).
  int64_t resident_bytes() const;
  // Device bytes per sample of a batch's staging buffer when streaming from the host (0 for kDevice).
  int64_t batch_staging_bytes() const;
  DataPlacement placement() const { return host_ ? DataPlacement::kHost : DataPlacement::kDevice; }

 private:
  // kHost: gathers the samples of `index_cpu` into a pinned buffer and copies them to the device (double-buffered:
  // a buffer is rewritten only after its previous copy finished). Returns (count, ...) on the device.
  at::Tensor stage(const at::Tensor& source, const at::Tensor& index_cpu, int slot_group) const;

  // An epoch's order: the first draw of `gen`, that epoch's generator (seeded by (seed, epoch)).
  at::Tensor order_of(at::Generator& gen) const;

  bool host_ = false;  // placement kHost on a CUDA device
  int64_t epoch_ = 0;  // the epoch of the order
  // kTensors a program serves (Dataset::source): images_ and labels_ hold its one-sample example; the order stays
  // on the CPU, and each batch is fetched and copied to the device.
  std::shared_ptr<SampleSource> source_;
  int64_t size_ = 0;
  LoaderOptions options_;
  DatasetKind kind_;
  c10::Device device_;
  std::vector<float> mean_, std_;
  at::Tensor images_;   // (N, C, H, W) uint8 on device (pinned host memory for kHost); tokens: (N, T) int64
  at::Tensor labels_;   // (N) int64 on device; tokens: (N, T) int64 (pinned host memory for kHost)
  at::Tensor order_;    // (N) int64 on device: this epoch's sample order
  at::Tensor shift_;    // (N, 2) int64 on device, or undefined
  at::Tensor flip_;     // (N) uint8 on device, or undefined
  at::Tensor cutout_;   // (N, 2) int64 on device: cutout centres (cy, cx), or undefined
  at::Tensor order_cpu_;  // kHost: the order on the host
  // kHost staging, grown on demand: per slot group (0: images, 1: labels) two pinned buffers, their device
  // buffers, and the event after each one's last copy.
  struct Staging;
  std::shared_ptr<Staging> staging_;
};

// The CPU reference of kernels/augment.cu (same arguments; tensors on the CPU).
void augment_reference(const at::Tensor& images, const at::Tensor& index, const at::Tensor& shift,
                       const at::Tensor& flip, int64_t pad, const at::Tensor& cutout, int64_t cutout_size,
                       const std::vector<float>& mean, const std::vector<float>& std, at::Tensor& out);

// Mixes a seed with an epoch (or any stream id) into an independent 64-bit seed (splitmix64).
uint64_t seed_mix(uint64_t seed, uint64_t stream);

}  // namespace triaccel
