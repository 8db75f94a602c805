// One thread per output element: out[b, c, y, x] = (src[idx[b], c, y + dy − pad, x' + dx − pad] / 255 − mean[c]) / std[c]
// with x' = W − 1 − x when flipped, and 0 for source pixels outside the image (the zero padding, normalized).
// Cutout: out = 0 (after normalization) where cy − s/2 ≤ y < cy − s/2 + s and cx − s/2 ≤ x < cx − s/2 + s.
// Output strides are passed in, so NCHW and channels_last outputs are both written directly. Bytes: B·C·H·W
// reads of uint8 (gathered, cached in L1/L2) and 4-byte writes: a few microseconds per batch on a modern GPU.
#include "triaccel/kernels/augment.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

namespace triaccel {
namespace {

constexpr int kMaxChannels = 4;
constexpr int kThreads = 256;

struct AugmentArgs {
  int64_t batch, channels, height, width, pad;
  int64_t cutout_size;    // side of the cutout square (used when the cutout pointer is non-null)
  int64_t out_stride[4];  // b, c, y, x
  float scale[kMaxChannels];  // 1 / (255 · std)
  float bias[kMaxChannels];   // −mean / std
};

__global__ void augment_kernel(const uint8_t* __restrict__ images, const int64_t* __restrict__ index,
                               const int64_t* __restrict__ shift, const uint8_t* __restrict__ flip,
                               const int64_t* __restrict__ cutout, float* __restrict__ out, const AugmentArgs a) {
  const int64_t total = a.batch * a.channels * a.height * a.width;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  // Decompose i in (b, y, x, c) order so that consecutive threads write neighbouring channels_last addresses.
  const int64_t c = i % a.channels;
  const int64_t x = (i / a.channels) % a.width;
  const int64_t y = (i / (a.channels * a.width)) % a.height;
  const int64_t b = i / (a.channels * a.width * a.height);
  const int64_t dy = shift ? shift[2 * b] : a.pad;
  const int64_t dx = shift ? shift[2 * b + 1] : a.pad;
  const int64_t xf = (flip && flip[b]) ? (a.width - 1 - x) : x;
  const int64_t sy = y + dy - a.pad;
  const int64_t sx = xf + dx - a.pad;
  float v = 0.f;
  if (sy >= 0 && sy < a.height && sx >= 0 && sx < a.width) {
    const int64_t n = index[b];
    v = static_cast<float>(images[((n * a.channels + c) * a.height + sy) * a.width + sx]);
  }
  float normalized = v * a.scale[c] + a.bias[c];
  if (cutout) {
    const int64_t y0 = cutout[2 * b] - a.cutout_size / 2;
    const int64_t x0 = cutout[2 * b + 1] - a.cutout_size / 2;
    if (y >= y0 && y < y0 + a.cutout_size && x >= x0 && x < x0 + a.cutout_size) normalized = 0.f;
  }
  out[b * a.out_stride[0] + c * a.out_stride[1] + y * a.out_stride[2] + x * a.out_stride[3]] = normalized;
}

void augment_launch(const uint8_t* images, const int64_t* index, const int64_t* shift, const uint8_t* flip,
                    const int64_t* cutout, float* out, const AugmentArgs& args, cudaStream_t stream) {
  const int64_t total = args.batch * args.channels * args.height * args.width;
  if (total == 0) return;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  augment_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(images, index, shift, flip, cutout, out,
                                                                            args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void augment_cuda(const at::Tensor& images, const at::Tensor& index, const at::Tensor& shift,
                  const at::Tensor& flip, int64_t pad, const at::Tensor& cutout, int64_t cutout_size,
                  const std::vector<float>& mean, const std::vector<float>& std, at::Tensor& out) {
  TORCH_CHECK(images.is_cuda() && images.scalar_type() == at::kByte && images.dim() == 4 && images.is_contiguous(),
              "augment_cuda: images must be a contiguous (N, C, H, W) uint8 CUDA tensor");
  const int64_t B = index.numel();
  const int64_t C = images.size(1), H = images.size(2), W = images.size(3);
  TORCH_CHECK(C <= kMaxChannels && static_cast<int64_t>(mean.size()) == C && static_cast<int64_t>(std.size()) == C,
              "augment_cuda: need one mean and std per channel (at most ", kMaxChannels, " channels)");
  TORCH_CHECK(index.is_cuda() && index.scalar_type() == at::kLong && index.is_contiguous(),
              "augment_cuda: index must be contiguous int64 on the GPU");
  TORCH_CHECK(!shift.defined() || (shift.is_cuda() && shift.scalar_type() == at::kLong && shift.is_contiguous() &&
                                   shift.numel() == 2 * B),
              "augment_cuda: shift must be contiguous (B, 2) int64 on the GPU");
  TORCH_CHECK(!flip.defined() || (flip.is_cuda() && flip.scalar_type() == at::kByte && flip.numel() == B),
              "augment_cuda: flip must be (B) uint8 on the GPU");
  TORCH_CHECK(!cutout.defined() || (cutout.is_cuda() && cutout.scalar_type() == at::kLong && cutout.is_contiguous() &&
                                    cutout.numel() == 2 * B),
              "augment_cuda: cutout must be contiguous (B, 2) int64 on the GPU");
  TORCH_CHECK(cutout_size >= 0 && cutout_size <= std::min(H, W), "augment_cuda: cutout size out of range: ",
              cutout_size);
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kFloat && out.dim() == 4 && out.size(0) == B &&
                  out.size(1) == C && out.size(2) == H && out.size(3) == W && out.is_non_overlapping_and_dense(),
              "augment_cuda: out must be a dense (B, C, H, W) float32 CUDA tensor");
  TORCH_CHECK(pad >= 0 && pad <= std::min(H, W), "augment_cuda: pad out of range: ", pad);

  AugmentArgs args{};
  args.batch = B;
  args.channels = C;
  args.height = H;
  args.width = W;
  args.pad = pad;
  args.cutout_size = cutout_size;
  for (int d = 0; d < 4; ++d) args.out_stride[d] = out.stride(d);
  for (int64_t c = 0; c < C; ++c) {
    args.scale[c] = 1.f / (255.f * std[c]);
    args.bias[c] = -mean[c] / std[c];
  }
  const c10::cuda::CUDAGuard guard(images.device());
  augment_launch(images.data_ptr<uint8_t>(), index.data_ptr<int64_t>(),
                 shift.defined() ? shift.data_ptr<int64_t>() : nullptr,
                 flip.defined() ? flip.data_ptr<uint8_t>() : nullptr,
                 cutout.defined() && cutout_size > 0 ? cutout.data_ptr<int64_t>() : nullptr, out.data_ptr<float>(), args,
                 at::cuda::getCurrentCUDAStream());
}

}  // namespace triaccel
