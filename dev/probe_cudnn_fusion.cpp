// Issue 59, item 2: what cuDNN's graph API (through the header-only cudnn-frontend of PyPI's nvidia-cudnn-frontend)
// offers on this GPU for ResNet-18's CIFAR 3x3 convolutions in bf16 and fp16 channels-last: for each layer shape, a
// convolution alone, the convolution with BatchNorm's statistics in its epilogue (genstats: per-channel sum and sum
// of squares, fp32), and the same with the previous BatchNorm's scale, bias and ReLU in its prologue (the pattern
// NVIDIA's MLPerf ResNet fuses). Prints, per variant, whether an engine supports it (or cuDNN's message), its
// workspace and the median of timed runs; writes one JSON object per row to the file given (or stdout).
// Build and run: bash dev/probe_cudnn_fusion.sh (device machine; docs/roofline.md).
#include <cudnn_frontend.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace fe = cudnn_frontend;

namespace {

#define CUDA_OK(call)                                                                        \
  do {                                                                                       \
    const cudaError_t e = (call);                                                            \
    if (e != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e));        \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

struct Shape {
  int64_t n, c, k, h;  // batch, input channels, output channels, height = width; 3x3, stride 1, padding 1
};

enum class Variant { kConv, kConvStats, kPrologueConvStats };
const char* variant_name(Variant v) {
  switch (v) {
    case Variant::kConv: return "conv";
    case Variant::kConvStats: return "conv+stats";
    case Variant::kPrologueConvStats: return "bn_relu+conv+stats";
  }
  return "?";
}

struct Row {
  bool supported = false;
  std::string message;
  int64_t workspace = 0;
  double median_us = 0;
};

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

// NHWC strides of an NCHW-ordered dim (n, c, h, w).
std::vector<int64_t> nhwc(int64_t c, int64_t h, int64_t w) { return {c * h * w, 1, w * c, c}; }

// Device buffers freed when the row is done, on every path out of it.
struct DeviceBuffers {
  std::vector<void*> owned;
  void* alloc(size_t bytes) {
    void* p = nullptr;
    CUDA_OK(cudaMalloc(&p, std::max<size_t>(bytes, 256)));
    CUDA_OK(cudaMemset(p, 0, std::max<size_t>(bytes, 256)));
    owned.push_back(p);
    return p;
  }
  ~DeviceBuffers() {
    for (void* p : owned) cudaFree(p);
  }
};

// One variant at one shape in the 16-bit type io (bf16 or fp16): the images, weights, the prologue's scale and bias
// and the intermediates in it; the statistics and the arithmetic in fp32 (the pattern cuDNN's own genstats test builds
// in fp16; on the H200, fp32 scale and bias or fp32 intermediates found no engine: "inputDataTypeX == FLOAT",
// "!is_input_compute_type_match").
Row run(cudnnHandle_t handle, const Shape& s, Variant v, fe::DataType_t io, int reps) {
  Row row;
  fe::graph::Graph g;
  g.set_io_data_type(io).set_intermediate_data_type(io).set_compute_data_type(fe::DataType_t::FLOAT);
  const TensorPtr x = g.tensor(fe::graph::Tensor_attributes()
                                   .set_name("x")
                                   .set_dim({s.n, s.c, s.h, s.h})
                                   .set_stride(nhwc(s.c, s.h, s.h))
                                   .set_data_type(io));
  const TensorPtr w = g.tensor(fe::graph::Tensor_attributes()
                                   .set_name("w")
                                   .set_dim({s.k, s.c, 3, 3})
                                   .set_stride(nhwc(s.c, 3, 3))
                                   .set_data_type(io));
  TensorPtr in = x, scale, bias;
  if (v == Variant::kPrologueConvStats) {
    const auto channel = [&](const char* name) {
      return g.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_dim({1, s.c, 1, 1})
                          .set_stride({s.c, 1, s.c, s.c})
                          .set_data_type(io));
    };
    scale = channel("scale");
    bias = channel("bias");
    const TensorPtr scaled =
        g.pointwise(x, scale, fe::graph::Pointwise_attributes().set_mode(fe::PointwiseMode_t::MUL));
    const TensorPtr shifted =
        g.pointwise(scaled, bias, fe::graph::Pointwise_attributes().set_mode(fe::PointwiseMode_t::ADD));
    in = g.pointwise(shifted, fe::graph::Pointwise_attributes().set_mode(fe::PointwiseMode_t::RELU_FWD));
  }
  const TensorPtr y = g.conv_fprop(
      in, w, fe::graph::Conv_fprop_attributes().set_padding({1, 1}).set_stride({1, 1}).set_dilation({1, 1}));
  y->set_output(true).set_data_type(io);
  TensorPtr sum, sq_sum;
  if (v != Variant::kConv) {
    auto stats = g.genstats(y, fe::graph::Genstats_attributes());
    sum = stats[0];
    sq_sum = stats[1];
    sum->set_output(true).set_data_type(fe::DataType_t::FLOAT);
    sq_sum->set_output(true).set_data_type(fe::DataType_t::FLOAT);
  }
  const auto failed = [&](fe::error_t e) {
    if (e.is_good()) return false;
    row.message = e.get_message();
    return true;
  };
  if (failed(g.validate()) || failed(g.build_operation_graph(handle)) ||
      failed(g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK})) ||
      failed(g.check_support(handle)) || failed(g.build_plans(handle))) {
    return row;
  }
  row.supported = true;
  if (failed(g.get_workspace_size(row.workspace))) return row;

  DeviceBuffers buffers;
  std::unordered_map<TensorPtr, void*> pack;
  pack[x] = buffers.alloc(static_cast<size_t>(s.n * s.c * s.h * s.h) * 2);
  pack[w] = buffers.alloc(static_cast<size_t>(s.k * s.c * 9) * 2);
  pack[y] = buffers.alloc(static_cast<size_t>(s.n * s.k * s.h * s.h) * 2);
  if (sum) {
    pack[sum] = buffers.alloc(static_cast<size_t>(s.k) * 4);
    pack[sq_sum] = buffers.alloc(static_cast<size_t>(s.k) * 4);
  }
  if (scale) {
    pack[scale] = buffers.alloc(static_cast<size_t>(s.c) * 2);
    pack[bias] = buffers.alloc(static_cast<size_t>(s.c) * 2);
  }
  void* workspace = buffers.alloc(static_cast<size_t>(row.workspace));
  for (int i = 0; i < 5; ++i) {  // warm-up
    if (failed(g.execute(handle, pack, workspace))) return row;
  }
  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  std::vector<double> us;
  for (int i = 0; i < reps; ++i) {
    CUDA_OK(cudaEventRecord(start));
    if (failed(g.execute(handle, pack, workspace))) break;
    CUDA_OK(cudaEventRecord(stop));
    CUDA_OK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
    us.push_back(1000.0 * ms);
  }
  if (!us.empty()) {
    std::sort(us.begin(), us.end());
    row.median_us = us[us.size() / 2];
  }
  CUDA_OK(cudaEventDestroy(start));
  CUDA_OK(cudaEventDestroy(stop));
  return row;
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (const char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\';
    if (ch == '\n') {
      out += "\\n";
      continue;
    }
    out += ch;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t batch = argc > 2 ? std::atoll(argv[2]) : 512;
  FILE* json = argc > 1 ? std::fopen(argv[1], "w") : stdout;
  if (json == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", argv[1]);
    return 1;
  }
  cudnnHandle_t handle;
  if (cudnnCreate(&handle) != CUDNN_STATUS_SUCCESS) {
    std::fprintf(stderr, "cudnnCreate failed\n");
    return 1;
  }
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, cuDNN %zu, cudnn-frontend %d, batch %lld\n", prop.name, cudnnGetVersion(), CUDNN_FRONTEND_VERSION,
              static_cast<long long>(batch));
  const std::vector<Shape> shapes{
      {batch, 64, 64, 32}, {batch, 128, 128, 16}, {batch, 256, 256, 8}, {batch, 512, 512, 4}};
  std::printf("%-22s %-5s %-20s %9s %12s %10s  %s\n", "layer", "type", "variant", "supported", "workspace", "median us",
              "note");
  for (const Shape& s : shapes) {
    char layer[64];
    std::snprintf(layer, sizeof layer, "%lldx%lld %lld->%lld", static_cast<long long>(s.h), static_cast<long long>(s.h),
                  static_cast<long long>(s.c), static_cast<long long>(s.k));
    for (const fe::DataType_t io : {fe::DataType_t::BFLOAT16, fe::DataType_t::HALF}) {
      const char* type = io == fe::DataType_t::HALF ? "fp16" : "bf16";
      for (const Variant v : {Variant::kConv, Variant::kConvStats, Variant::kPrologueConvStats}) {
        const Row r = run(handle, s, v, io, 50);
        // The note: cuDNN's message up to its first line break (the JSON keeps all of it).
        const std::string note = r.message.substr(0, r.message.find('\n'));
        std::printf("%-22s %-5s %-20s %9s %12lld %10.1f  %.100s\n", layer, type, variant_name(v),
                    r.supported ? "yes" : "no", static_cast<long long>(r.workspace), r.median_us, note.c_str());
        std::fprintf(json,
                     "{\"batch\": %lld, \"c\": %lld, \"k\": %lld, \"hw\": %lld, \"type\": \"%s\", "
                     "\"variant\": \"%s\", \"supported\": %s, \"workspace_bytes\": %lld, \"median_us\": %.3f, "
                     "\"message\": \"%s\"}\n",
                     static_cast<long long>(s.n), static_cast<long long>(s.c), static_cast<long long>(s.k),
                     static_cast<long long>(s.h), type, variant_name(v), r.supported ? "true" : "false",
                     static_cast<long long>(r.workspace), r.median_us, json_escape(r.message).c_str());
      }
    }
  }
  if (json != stdout) std::fclose(json);
  cudnnDestroy(handle);
  return 0;
}
