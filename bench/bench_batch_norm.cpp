// The BatchNorm kernels alone on ResNet-18/CIFAR's 20 BatchNorm layers (issue 59, docs/roofline.md): per layer the
// forward (statistics, combine, normalize + ReLU or + residual + ReLU) and the backward (reduce, combine,
// elementwise) of kernels/batch_norm.h under each launch choice (BatchNormLaunch: the rules, the grid of 4 blocks
// per SM and 4 rows in flight they replaced, ...), against ATen's unfused sequence in the same process (PyTorch
// eager's: native_batch_norm then relu or add + relu; threshold_backward then native_batch_norm_backward).
// Protocol (DESIGN.md): every call of a layer captured CALLS times in one CUDA graph (as the trainer's step replays
// them: no host launch gaps), a warm-up replay, then REPEATS timed replays; the median µs per call. Bytes are the
// kernels' boundary traffic (forward x twice, y, the residual; backward dy and x twice, dx, and under the block end y
// and g), the same count for ATen's row, so GB/s compare speeds.
// Usage: bench_batch_norm [--batch-sizes 96,512] [--configs rule:0:0,old:4:4] [--calls 20] [--repeats 7] --out F
#include "bench_util.h"
#include "triaccel/core/device.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"
#include "triaccel/core/json.h"
#include "triaccel/kernels/batch_norm.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <CLI/CLI.hpp>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using triaccel::Json;

enum class Kind { kNone, kRelu, kAddRelu };

struct Layer {
  std::string name;
  int64_t channels;
  int64_t size;  // H = W
  Kind kind;
};

// ResNet-18 with the CIFAR stem (models/resnet.cpp): the stem, then per block bn1 (+ReLU), bn2 (+residual +ReLU)
// and the first block of layers 2-4 its downsample's BatchNorm.
std::vector<Layer> resnet18_cifar_layers() {
  std::vector<Layer> out{{"stem", 64, 32, Kind::kRelu}};
  const int64_t widths[] = {64, 128, 256, 512};
  for (int l = 0; l < 4; ++l) {
    const int64_t c = widths[l], s = 32 >> l;
    for (int b = 0; b < 2; ++b) {
      const std::string p = "layer" + std::to_string(l + 1) + "." + std::to_string(b) + ".";
      out.push_back({p + "bn1", c, s, Kind::kRelu});
      out.push_back({p + "bn2", c, s, Kind::kAddRelu});
      if (l > 0 && b == 0) out.push_back({p + "downsample.1", c, s, Kind::kNone});
    }
  }
  return out;
}

// µs per call: `calls` calls captured in one graph, one warm-up replay, the median of `repeats` timed replays.
double time_call(const std::function<void()>& call, int calls, int repeats) {
  call();  // eager first: lazy state (the kernels' occupancy, ATen's workspaces) outside the capture
  at::cuda::CUDAGraph graph;
  graph.capture_begin();
  for (int i = 0; i < calls; ++i) call();
  graph.capture_end();
  graph.replay();
  std::vector<double> us;
  for (int r = 0; r < repeats; ++r) {
    at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
    start.record();
    graph.replay();
    stop.record();
    stop.synchronize();
    us.push_back(1e3 * start.elapsed_time(stop) / calls);
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

struct Config {
  std::string name;
  bool aten = false;
  triaccel::BatchNormLaunch launch;
};

// "name:rows:blocks" (a BatchNormLaunch) or "aten".
Config config_parse(const std::string& s) {
  if (s == "aten") return {"aten", true, {}};
  const auto colon = s.find(':');
  if (colon == std::string::npos) {
    throw triaccel::UserError("--configs: '" + s + "' is not name:rows:blocks or aten (e.g. rule:0:0,old:4:4)");
  }
  Config c;
  c.name = s.substr(0, colon);
  std::tie(c.launch.rows_in_flight, c.launch.blocks_per_sm) =
      bench::int_pair_parse(s.substr(colon + 1), "--configs " + c.name);
  return c;
}

struct Tensors {
  at::Tensor x, r, dy, weight, bias, running_mean, running_var;
};

Tensors tensors_make(const Layer& l, int64_t batch, const c10::Device& device) {
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(device);
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const auto cl = at::MemoryFormat::ChannelsLast;
  Tensors t;
  t.x = (at::randn({batch, l.channels, l.size, l.size}, f32) * 2 + 0.5).to(at::kBFloat16).contiguous(cl);
  t.r = at::randn({batch, l.channels, l.size, l.size}, bf16).contiguous(cl);
  t.dy = at::randn({batch, l.channels, l.size, l.size}, bf16).contiguous(cl);
  t.weight = at::rand({l.channels}, f32) + 0.5;
  t.bias = at::randn({l.channels}, f32) * 0.1;
  t.running_mean = at::zeros({l.channels}, f32);
  t.running_var = at::ones({l.channels}, f32);
  return t;
}

// {forward µs, backward µs} of one layer under one configuration.
std::pair<double, double> layer_time(const Layer& l, const Config& c, Tensors& t, int calls, int repeats) {
  constexpr double kMomentum = 0.1, kEps = 1e-5;
  if (c.aten) {
    const auto forward = [&]() {
      auto out = std::get<0>(at::native_batch_norm(t.x, t.weight, t.bias, t.running_mean, t.running_var, true,
                                                   kMomentum, kEps));
      if (l.kind == Kind::kRelu) return at::relu(out);
      if (l.kind == Kind::kAddRelu) return at::relu(out + t.r);
      return out;
    };
    const at::Tensor y = forward();
    const auto saved = at::native_batch_norm(t.x, t.weight, t.bias, t.running_mean, t.running_var, true, kMomentum,
                                             kEps);
    const double fwd = time_call([&]() { forward(); }, calls, repeats);
    const double bwd = time_call(
        [&]() {
          const at::Tensor g = l.kind == Kind::kNone ? t.dy : at::threshold_backward(t.dy, y, 0);
          at::native_batch_norm_backward(g, t.x, t.weight, t.running_mean, t.running_var, std::get<1>(saved),
                                         std::get<2>(saved), true, kEps, {true, true, true});
        },
        calls, repeats);
    return {fwd, bwd};
  }
  triaccel::batch_norm_launch_set(c.launch);
  if (l.kind == Kind::kAddRelu) {
    const auto forward = [&]() {
      return triaccel::batch_norm_add_relu_forward_cuda(t.x, t.r, t.weight, t.bias, t.running_mean, t.running_var,
                                                        kMomentum, kEps);
    };
    const auto [y, stats] = forward();
    const double fwd = time_call([&]() { forward(); }, calls, repeats);
    const double bwd = time_call(
        [&]() { triaccel::batch_norm_add_relu_backward_cuda(t.dy, t.x, y, t.weight, stats); }, calls, repeats);
    return {fwd, bwd};
  }
  const bool relu = l.kind == Kind::kRelu;
  const auto forward = [&]() {
    return triaccel::batch_norm_forward_cuda(t.x, t.weight, t.bias, t.running_mean, t.running_var, kMomentum, kEps,
                                             relu);
  };
  const auto [y, stats] = forward();
  const double fwd = time_call([&]() { forward(); }, calls, repeats);
  const double bwd =
      time_call([&]() { triaccel::batch_norm_backward_cuda(t.dy, t.x, t.weight, stats, relu); }, calls, repeats);
  return {fwd, bwd};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"the BatchNorm kernels on ResNet-18/CIFAR's layers under each launch choice, against ATen's"};
  std::string out, commit = "unknown", batches = "96,512", configs = "rule:0:0,old:4:4,rows4:4:0,rows2:2:0,aten";
  int calls = 20, repeats = 7;
  app.add_option("--out", out, "write the JSON result here")->required();
  app.add_option("--commit", commit, "the commit measured (stored in the JSON)");
  app.add_option("--batch-sizes", batches, "comma-separated batch sizes")->capture_default_str();
  app.add_option("--configs", configs, "comma-separated name:rows_in_flight:blocks_per_sm (0: the rule) or aten")
      ->capture_default_str();
  app.add_option("--calls", calls, "calls per captured graph")->capture_default_str();
  app.add_option("--repeats", repeats, "timed replays (the median is reported)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    const c10::Device device = triaccel::device_resolve(triaccel::DeviceKind::kCuda);
    const c10::cuda::CUDAStreamGuard stream_guard(c10::cuda::getStreamFromPool(false, device.index()));
    std::vector<Config> cs;
    for (const auto& s : bench::split(configs)) cs.push_back(config_parse(s));
    Json rows = Json::array();
    std::printf("%-6s %-8s %10s %10s %10s %9s\n", "batch", "config", "fwd us", "bwd us", "total us", "bwd GB/s");
    for (const auto& b : bench::split(batches)) {
      const int64_t batch = std::stoll(b);
      for (const Config& c : cs) {
        double fwd_sum = 0, bwd_sum = 0, bwd_bytes_sum = 0;
        for (const Layer& l : resnet18_cifar_layers()) {
          at::manual_seed(0);
          Tensors t = tensors_make(l, batch, device);
          const auto [fwd, bwd] = layer_time(l, c, t, calls, repeats);
          const double pass = 2.0 * batch * l.channels * l.size * l.size;  // bytes of one bf16 activation
          const bool add = l.kind == Kind::kAddRelu;
          const double fwd_bytes = pass * (add ? 4 : 3), bwd_bytes = pass * (add ? 7 : 5);
          fwd_sum += fwd;
          bwd_sum += bwd;
          bwd_bytes_sum += bwd_bytes;
          rows.push_back(Json{{"batch", batch},
                              {"config", c.name},
                              {"rows_in_flight", c.launch.rows_in_flight},
                              {"blocks_per_sm", c.launch.blocks_per_sm},
                              {"layer", l.name},
                              {"channels", l.channels},
                              {"size", l.size},
                              {"forward_us", fwd},
                              {"backward_us", bwd},
                              {"forward_gb_per_s", fwd_bytes / fwd / 1e3},
                              {"backward_gb_per_s", bwd_bytes / bwd / 1e3}});
        }
        std::printf("%-6lld %-8s %10.1f %10.1f %10.1f %9.0f\n", static_cast<long long>(batch), c.name.c_str(),
                    fwd_sum, bwd_sum, fwd_sum + bwd_sum, bwd_bytes_sum / bwd_sum / 1e3);
        std::fflush(stdout);
      }
    }
    triaccel::batch_norm_launch_set({});
    const Json result{{"bench", "batch_norm"},
                      {"commit", commit},
                      {"gpu", triaccel::device_long_name(device)},
                      {"command", std::string("bench_batch_norm --batch-sizes ") + batches + " --configs " + configs +
                                      " --calls " + std::to_string(calls) + " --repeats " + std::to_string(repeats)},
                      {"rows", rows}};
    triaccel::file_write_atomic(out, result.dump(2) + "\n");
  } catch (const triaccel::UserError& e) {
    std::fprintf(stderr, "bench_batch_norm: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {  // a number that does not parse (std::stoi), a CUDA error
    std::fprintf(stderr, "bench_batch_norm: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
