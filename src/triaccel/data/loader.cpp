#include "triaccel/data/loader.h"

#include "triaccel/core/errors.h"
#ifdef TRIACCEL_WITH_CUDA
#include "triaccel/kernels/augment.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#endif

#include <ATen/ATen.h>
#include <torch/utils.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/autograd.h>

#include <algorithm>

namespace triaccel {

struct Loader::Staging {
#ifdef TRIACCEL_WITH_CUDA
  at::Tensor host[2][2];    // [group][slot]: pinned host buffers
  at::Tensor device[2][2];  // their device copies
  at::cuda::CUDAEvent copied[2][2];
  bool pending[2][2] = {{false, false}, {false, false}};
  int next[2] = {0, 0};
#endif
};

void LoaderOptions::validate() const {
  TRIACCEL_CHECK_INPUT(batch_size > 0, option_ref("batch_size") + " must be > 0, got ", batch_size);
  TRIACCEL_CHECK_INPUT(pad >= 0, "augmentation pad must be >= 0, got ", pad);
  TRIACCEL_CHECK_INPUT(cutout >= 0, option_ref("cutout") + " must be >= 0 (0: off), got ", cutout);
  TRIACCEL_CHECK_INPUT(image_size >= 0 && image_size <= 1024, option_ref("image_size") + " must be in [0, 1024], got ", image_size);
}

uint64_t seed_mix(uint64_t seed, uint64_t stream) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (stream + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

Loader::Loader(const Dataset& data, std::vector<float> mean, std::vector<float> std, LoaderOptions options,
               const c10::Device& device)
    : options_(options), kind_(data.kind), device_(device), mean_(std::move(mean)), std_(std::move(std)) {
  options_.validate();
  // A served dataset (data.source) is fetched on the host batch by batch: it has no home to place.
  host_ = !data.source && options_.placement == DataPlacement::kHost && device_.is_cuda();
  if (host_) staging_ = std::make_shared<Staging>();
  // The dataset's home: the device, or pinned host memory (kHost).
  const auto home = [this](const at::Tensor& t) { return host_ ? t.contiguous().pin_memory() : t.contiguous().to(device_); };
  size_ = data.size();
  if (kind_ != DatasetKind::kImage) {  // tokens or a program's tensors: batched as they are
    TORCH_CHECK(kind_ != DatasetKind::kTokens ||
                    (data.images.defined() && data.images.dim() == 2 && data.images.scalar_type() == at::kLong &&
                     data.labels.sizes() == data.images.sizes()),
                "Loader: token datasets must hold (N, T) int64 inputs and targets");
    const char* what = kind_ == DatasetKind::kTokens ? " is text" : " holds tensors passed as they are";
    TRIACCEL_CHECK_INPUT(!options_.augment, option_ref("augment") + " on applies to images only; dataset ", data.name,
                         what, ": use " + option_ref("augment") + " off (or auto)");
    TRIACCEL_CHECK_INPUT(options_.cutout == 0, option_ref("cutout") + " applies to images only; dataset ", data.name,
                         what, ": drop the flag");
    TRIACCEL_CHECK_INPUT(data.size() > 0, "dataset ", data.name, " is empty");
    if (data.source) {
      source_ = data.source;
      images_ = data.images;  // the example sample, on the CPU
      labels_ = data.labels;
    } else {
      images_ = home(data.images);
      labels_ = home(data.labels);
    }
    epoch_begin(0);
    return;
  }
  TORCH_CHECK(data.images.defined() && data.images.dim() == 4 && data.images.scalar_type() == at::kByte,
              "Loader: dataset images must be (N, C, H, W) uint8");
  TORCH_CHECK(static_cast<int64_t>(mean_.size()) == data.channels() &&
                  static_cast<int64_t>(std_.size()) == data.channels(),
              "Loader: need one mean and std per channel");
  TRIACCEL_CHECK_INPUT(data.size() > 0, "dataset ", data.name, " is empty");
  TRIACCEL_CHECK_INPUT(options_.cutout <= std::min(data.images.size(2), data.images.size(3)), option_ref("cutout") + " ",
                       options_.cutout, " is larger than the ", data.images.size(2), "×", data.images.size(3),
                       " images of dataset ", data.name, "; use at most ",
                       std::min(data.images.size(2), data.images.size(3)));
  images_ = home(data.images);
  labels_ = data.labels.to(at::kLong).to(device_);  // small: on the device either way
  epoch_begin(0);
}

int64_t Loader::image_height() const {
  if (kind_ != DatasetKind::kImage) return 0;
  return options_.image_size > 0 ? options_.image_size : images_.size(2);
}
int64_t Loader::image_width() const {
  if (kind_ != DatasetKind::kImage) return 0;
  return options_.image_size > 0 ? options_.image_size : images_.size(3);
}

namespace {

// The generator of epoch `epoch`'s draws: its order first, then the augmentation's.
at::Generator epoch_generator(uint64_t seed, int64_t epoch) {
  return at::make_generator<at::CPUGeneratorImpl>(seed_mix(seed, static_cast<uint64_t>(epoch)));
}

// An order (int64 on the CPU) as a served source takes it.
std::vector<int64_t> order_values(const at::Tensor& order) {
  return std::vector<int64_t>(order.data_ptr<int64_t>(), order.data_ptr<int64_t>() + order.numel());
}

}  // namespace

at::Tensor Loader::order_of(at::Generator& gen) const {
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  return options_.shuffle ? at::randperm(size(), gen, i64) : at::arange(size(), i64);
}

void Loader::epoch_begin(int64_t epoch) {
  const int64_t n = size();
  auto gen = epoch_generator(options_.seed, epoch);
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  const at::Tensor order = order_of(gen);
  epoch_ = epoch;
  order_ = source_ ? order : order.to(device_);
  if (host_ || source_) order_cpu_ = order;
  if (source_) source_->epoch_begin(order_values(order));
  if (options_.augment) {
    shift_ = at::randint(0, 2 * options_.pad + 1, {n, 2}, gen, i64).to(device_);
    flip_ = at::randint(0, 2, {n}, gen, i64).to(at::kByte).to(device_);
  } else {
    shift_ = at::Tensor();
    flip_ = at::Tensor();
  }
  // Drawn after the crops and flips, so that --cutout 0 leaves every earlier draw as it was.
  if (options_.cutout > 0 && kind_ == DatasetKind::kImage) {
    const at::Tensor cy = at::randint(0, images_.size(2), {n}, gen, i64);
    const at::Tensor cx = at::randint(0, images_.size(3), {n}, gen, i64);
    cutout_ = at::stack({cy, cx}, 1).to(device_);
  } else {
    cutout_ = at::Tensor();
  }
}

at::Tensor Loader::batch_labels_empty(int64_t count) const {
  const auto i64 = at::TensorOptions().dtype(at::kLong).device(device_);
  if (kind_ == DatasetKind::kImage) return at::empty({count}, i64);
  std::vector<int64_t> shape = labels_.sizes().vec();
  shape[0] = count;
  return at::empty(shape, labels_.options().device(device_));
}

at::Tensor Loader::batch_images_empty(int64_t count) const {
  if (kind_ != DatasetKind::kImage) {
    std::vector<int64_t> shape = images_.sizes().vec();
    shape[0] = count;
    return at::empty(shape, images_.options().device(device_));
  }
  auto opts = at::TensorOptions().dtype(at::kFloat).device(device_);
  if (options_.channels_last) opts = opts.memory_format(at::MemoryFormat::ChannelsLast);
  return at::empty({count, channels(), image_height(), image_width()}, opts);
}

void Loader::batch_into(int64_t offset, int64_t count, at::Tensor& images, at::Tensor& labels) const {
  TORCH_CHECK(offset >= 0 && count > 0 && offset + count <= size(), "Loader::batch_into: samples [", offset, ", ",
              offset + count, ") out of range [0, ", size(), ")");
  const torch::NoGradGuard no_grad;
  if (source_) {  // the program's samples, fetched on the host and copied (pinned: without a host sync)
    auto [x, y] = source_->fetch(offset, sample_indices(offset, count));
    TRIACCEL_CHECK_INPUT(x.sizes() == images.sizes() && y.sizes() == labels.sizes(), "the data gave inputs of shape ",
                         x.sizes(), " and targets of shape ", y.sizes(), " for ", count, " samples; expected ",
                         images.sizes(), " and ", labels.sizes(), " (every sample of one shape, as the first)");
    images.copy_(x, /*non_blocking=*/x.is_pinned());
    labels.copy_(y, /*non_blocking=*/y.is_pinned());
    if (offset + count == size()) {  // the epoch's last samples: the source may start on the next epoch's
      auto gen = epoch_generator(options_.seed, epoch_ + 1);
      source_->epoch_ahead(order_values(order_of(gen)));
    }
    return;
  }
  const at::Tensor index = order_.narrow(0, offset, count);
  const at::Tensor index_cpu = host_ ? order_cpu_.narrow(0, offset, count) : at::Tensor();
  if (kind_ != DatasetKind::kImage) {  // (count, ...) inputs and targets, as stored
    images.copy_(host_ ? stage(images_, index_cpu, 0) : images_.index_select(0, index));
    labels.copy_(host_ ? stage(labels_, index_cpu, 1) : labels_.index_select(0, index));
    return;
  }
  const at::Tensor shift = shift_.defined() ? shift_.narrow(0, offset, count) : at::Tensor();
  const at::Tensor flip = flip_.defined() ? flip_.narrow(0, offset, count) : at::Tensor();
  const at::Tensor cutout = cutout_.defined() ? cutout_.narrow(0, offset, count) : at::Tensor();
  const bool resize = options_.image_size > 0 &&
                      (options_.image_size != images_.size(2) || options_.image_size != images_.size(3));
  at::Tensor native = resize ? at::empty({count, images_.size(1), images_.size(2), images_.size(3)},
                                         at::TensorOptions().dtype(at::kFloat).device(device_))
                             : images;
  TORCH_CHECK(native.defined() && native.size(0) == count, "Loader::batch_into: output buffer has the wrong size");
  // kHost: the batch's samples, gathered and copied, are the source; they sit in epoch order.
  const at::Tensor source = host_ ? stage(images_, index_cpu, 0) : images_;
  const at::Tensor source_index =
      host_ ? at::arange(count, at::TensorOptions().dtype(at::kLong).device(device_)) : index;
#ifdef TRIACCEL_WITH_CUDA
  if (device_.is_cuda()) {
    augment_cuda(source, source_index, shift, flip, options_.pad, cutout, options_.cutout, mean_, std_, native);
  } else
#endif
  {
    augment_reference(source, source_index, shift, flip, options_.pad, cutout, options_.cutout, mean_, std_, native);
  }
  if (resize) {
    images.copy_(at::upsample_bilinear2d(native, {options_.image_size, options_.image_size}, false));
  }
  labels.copy_(labels_.index_select(0, index));
}

at::Tensor Loader::stage(const at::Tensor& source, const at::Tensor& index_cpu, int group) const {
#ifdef TRIACCEL_WITH_CUDA
  Staging& st = *staging_;
  const int slot = st.next[group];
  st.next[group] ^= 1;
  if (st.pending[group][slot]) st.copied[group][slot].synchronize();  // its previous copy has left the buffer
  const int64_t count = index_cpu.numel();
  at::Tensor& host = st.host[group][slot];
  if (!host.defined() || host.size(0) < count || !st.device[group][slot].defined()) {
    std::vector<int64_t> shape = source.sizes().vec();
    shape[0] = count;
    // Both made before either is kept: an out-of-memory error on the device buffer (under a budget) leaves the
    // slot as it was, so the retry does not find a grown host buffer beside a device buffer that never grew.
    at::Tensor device_buffer = at::empty(shape, source.options().pinned_memory(false).device(device_));
    at::Tensor host_buffer = at::empty(shape, source.options().pinned_memory(true));
    st.device[group][slot] = std::move(device_buffer);
    host = std::move(host_buffer);
  }
  at::Tensor h = host.narrow(0, 0, count);
  at::index_select_out(h, source, 0, index_cpu);
  at::Tensor d = st.device[group][slot].narrow(0, 0, count);
  d.copy_(h, /*non_blocking=*/true);
  st.copied[group][slot].record(at::cuda::getCurrentCUDAStream(device_.index()));
  st.pending[group][slot] = true;
  return d;
#else
  TORCH_CHECK(false, "Loader: host placement needs a CUDA build");
  return {};
#endif
}

std::pair<at::Tensor, at::Tensor> Loader::batch(int64_t offset, int64_t count) const {
  at::Tensor images = batch_images_empty(count);
  at::Tensor labels = batch_labels_empty(count);
  batch_into(offset, count, images, labels);
  return {images, labels};
}

std::vector<int64_t> Loader::sample_indices(int64_t offset, int64_t count) const {
  TORCH_CHECK(order_.defined(), "Loader::sample_indices before epoch_begin");
  const at::Tensor ids = order_.narrow(0, offset, count).to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
}

int64_t Loader::resident_bytes() const {
  if (source_) return 0;
  const auto bytes = [](const at::Tensor& t) { return t.is_cuda() ? t.numel() * t.element_size() : int64_t{0}; };
  return device_.is_cuda() ? bytes(images_) + bytes(labels_)
                           : images_.numel() * images_.element_size() + labels_.numel() * labels_.element_size();
}

int64_t Loader::batch_staging_bytes() const {
  const auto per_sample = [](const at::Tensor& t) { return t.numel() / std::max<int64_t>(1, t.size(0)) * t.element_size(); };
  if (source_) return device_.is_cuda() ? per_sample(images_) + per_sample(labels_) : 0;  // the copies' targets
  if (!host_) return 0;
  // Two slots; labels are staged only for tokens (image labels stay on the device).
  return 2 * (per_sample(images_) + (kind_ != DatasetKind::kImage ? per_sample(labels_) : 0));
}

void augment_reference(const at::Tensor& images, const at::Tensor& index, const at::Tensor& shift,
                       const at::Tensor& flip, int64_t pad, const at::Tensor& cutout, int64_t cutout_size,
                       const std::vector<float>& mean, const std::vector<float>& std, at::Tensor& out) {
  const int64_t B = index.numel();
  const int64_t C = images.size(1), H = images.size(2), W = images.size(3);
  const at::Tensor m = at::tensor(mean, at::kFloat).view({1, C, 1, 1}).to(images.device());
  const at::Tensor s = at::tensor(std, at::kFloat).view({1, C, 1, 1}).to(images.device());
  if (!shift.defined() && !flip.defined()) {  // no crop or flip: gather and normalize
    out.copy_((images.index_select(0, index).to(at::kFloat) / 255.0 - m) / s);
  } else {
    // (B, C, H + 2·pad, W + 2·pad) float, zero borders.
    const at::Tensor padded =
        at::constant_pad_nd(images.index_select(0, index).to(at::kFloat), {pad, pad, pad, pad}, 0);
    const at::Tensor shift_cpu = shift.defined() ? shift.cpu() : at::Tensor();
    const at::Tensor flip_cpu = flip.defined() ? flip.cpu() : at::Tensor();
    std::vector<at::Tensor> crops;
    crops.reserve(B);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t dy = shift_cpu.defined() ? shift_cpu[b][0].item<int64_t>() : pad;
      const int64_t dx = shift_cpu.defined() ? shift_cpu[b][1].item<int64_t>() : pad;
      at::Tensor crop = padded[b].narrow(1, dy, H).narrow(2, dx, W);
      if (flip_cpu.defined() && flip_cpu[b].item<uint8_t>() != 0) crop = crop.flip({2});
      crops.push_back(crop);
    }
    out.copy_((at::stack(crops) / 255.0 - m) / s);
  }
  if (!cutout.defined() || cutout_size == 0) return;
  // Cutout, in output coordinates (after crop and flip): the clipped square is set to 0 (normalized).
  const at::Tensor centres = cutout.cpu();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t y0 = centres[b][0].item<int64_t>() - cutout_size / 2;
    const int64_t x0 = centres[b][1].item<int64_t>() - cutout_size / 2;
    const int64_t y_lo = std::max<int64_t>(y0, 0), y_hi = std::min<int64_t>(y0 + cutout_size, H);
    const int64_t x_lo = std::max<int64_t>(x0, 0), x_hi = std::min<int64_t>(x0 + cutout_size, W);
    if (y_hi > y_lo && x_hi > x_lo) out[b].narrow(1, y_lo, y_hi - y_lo).narrow(2, x_lo, x_hi - x_lo).zero_();
  }
}

}  // namespace triaccel
