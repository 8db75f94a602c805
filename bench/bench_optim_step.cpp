// Optimizer step time and state bytes per BAOC state format on ResNet-18's parameters (CIFAR stem, channels_last
// like the trainer), against LibTorch's torch::optim::AdamW on the same parameters and gradients, in one process.
// Protocol (DESIGN.md): warm up, synchronize, time `steps` steps with CUDA events, repeat, report the median ms per
// step (min and max too). Ours runs eagerly (one launch per format group) and replayed from a CUDA graph (how the
// trainer runs it); LibTorch runs eagerly (its C++ AdamW has no foreach/fused path). State bytes: the exact count
// (state_format_bytes) and the allocator's growth when the state is created.
#include "triaccel/core/device.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"
#include "triaccel/core/json.h"
#include "triaccel/models/registry.h"
#include "triaccel/optim/baoc_optimizer.h"
#include "triaccel/optim/sgd.h"

#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <CLI/CLI.hpp>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>

namespace {

using triaccel::Json;

struct Timing {
  double median_ms = 0, min_ms = 0, max_ms = 0;
  Json to_json() const { return Json{{"median_ms", median_ms}, {"min_ms", min_ms}, {"max_ms", max_ms}}; }
};

template <typename F>
Timing time_steps(F&& step, int warmup, int steps, int repeats) {
  for (int i = 0; i < warmup; ++i) step();
  std::vector<double> ms;
  for (int r = 0; r < repeats; ++r) {
    at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
    start.record();
    for (int i = 0; i < steps; ++i) step();
    stop.record();
    stop.synchronize();
    ms.push_back(start.elapsed_time(stop) / steps);
  }
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front(), ms.back()};
}

std::vector<std::pair<std::string, at::Tensor>> resnet_params(const c10::Device& device) {
  torch::manual_seed(0);
  triaccel::ModelOptions mo;
  mo.name = "resnet18";
  auto model = triaccel::model_create(mo);
  model->to(device);
  std::vector<std::pair<std::string, at::Tensor>> out;
  const torch::NoGradGuard no_grad;
  for (const auto& item : model->named_parameters()) {
    at::Tensor p = item.value().detach().clone();
    if (p.dim() == 4) p = p.contiguous(at::MemoryFormat::ChannelsLast);
    p.set_requires_grad(true);
    p.mutable_grad() = torch::randn_like(p) * 1e-2;
    out.emplace_back(item.key(), p);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"optimizer step time per BAOC state format vs LibTorch's AdamW (ResNet-18 parameters)"};
  std::string out, commit = "unknown";
  int warmup = 10, steps = 50, repeats = 5;
  app.add_option("--out", out, "write the JSON result here");
  app.add_option("--commit", commit, "the commit measured (stored in the JSON)");
  app.add_option("--warmup", warmup, "untimed steps first")->capture_default_str();
  app.add_option("--steps", steps, "timed steps per repeat")->capture_default_str();
  app.add_option("--repeats", repeats, "repeats (the median is reported)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    const c10::Device device = triaccel::device_resolve(triaccel::DeviceKind::kCuda);
    const c10::cuda::CUDAStreamGuard stream_guard(c10::cuda::getStreamFromPool(false, device.index()));
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
    const at::Tensor lr = at::full({1}, 1e-3, f32), no_inf = at::zeros({1}, f32);
    Json rows = Json::array();
    int64_t n_params = 0;

    // LibTorch AdamW on the same parameters (weight decay on weights only, as ours).
    double libtorch_ms = 0;
    {
      auto named = resnet_params(device);
      std::vector<at::Tensor> decay, no_decay;
      for (auto& [name, p] : named) {
        (p.dim() <= 1 ? no_decay : decay).push_back(p);
        n_params += p.numel();
      }
      std::vector<torch::optim::OptimizerParamGroup> groups;
      groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(1e-3).weight_decay(0.05)));
      groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(1e-3).weight_decay(0)));
      torch::optim::AdamW adamw(groups, torch::optim::AdamWOptions(1e-3));
      const Timing t = time_steps([&]() { adamw.step(); }, warmup, steps, repeats);
      libtorch_ms = t.median_ms;
      rows.push_back(Json{{"system", "libtorch"}, {"optimizer", "torch::optim::AdamW"}, {"mode", "eager"},
                          {"time", t.to_json()}, {"state_bytes", 8 * n_params}});
      std::printf("%-16s %-6s %8.3f ms\n", "libtorch-adamw", "eager", t.median_ms);
    }

    for (triaccel::StateFormat f : triaccel::state_formats_all()) {
      auto named = resnet_params(device);
      triaccel::BaocOptions bo;
      bo.weight_decay = 0.05;
      c10::cuda::device_synchronize();
      const int64_t before = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index())
                                 .allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
                                 .current;
      triaccel::BaocOptimizer opt(named, bo, f);
      opt.state_init();
      c10::cuda::device_synchronize();
      const int64_t after = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index())
                                .allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
                                .current;
      const Timing eager = time_steps([&]() { opt.step(lr, no_inf); }, warmup, steps, repeats);
      at::cuda::CUDAGraph graph;
      graph.capture_begin();
      opt.step(lr, no_inf);
      graph.capture_end();
      const Timing graphed = time_steps([&]() { graph.replay(); }, warmup, steps, repeats);
      const std::string name = triaccel::state_format_name(f);
      rows.push_back(Json{{"system", "triaccel"},
                          {"format", name},
                          {"eager", eager.to_json()},
                          {"graph", graphed.to_json()},
                          {"libtorch_adamw_ms", libtorch_ms},
                          {"eager_vs_libtorch", eager.median_ms / libtorch_ms},
                          {"graph_vs_libtorch", graphed.median_ms / libtorch_ms},
                          {"state_bytes", opt.state_bytes()},
                          {"state_bytes_per_param", static_cast<double>(opt.state_bytes()) / n_params},
                          {"fraction_of_adamw_fp32", static_cast<double>(opt.state_bytes()) / (8.0 * n_params)},
                          {"allocator_growth_bytes", after - before}});
      std::printf("%-16s eager %8.3f ms  graph %8.3f ms  (%.2fx / %.2fx LibTorch)  %.3f B/param\n", name.c_str(),
                  eager.median_ms, graphed.median_ms, eager.median_ms / libtorch_ms, graphed.median_ms / libtorch_ms,
                  static_cast<double>(opt.state_bytes()) / n_params);
    }
    // Our fused SGD (the default optimizer) for scale.
    {
      auto named = resnet_params(device);
      triaccel::Sgd sgd(named, triaccel::SgdOptions{});
      const Timing t = time_steps([&]() { sgd.step(lr, no_inf); }, warmup, steps, repeats);
      rows.push_back(Json{{"system", "triaccel"}, {"format", "sgd-nesterov (Sgd)"}, {"eager", t.to_json()},
                          {"state_bytes", 4 * n_params}});
    }
    const Json result{{"bench", "optim_step"},
                      {"gpu", triaccel::device_long_name(device)},
                      {"command", "build/bench_optim_step --warmup " + std::to_string(warmup) + " --steps " +
                                      std::to_string(steps) + " --repeats " + std::to_string(repeats)},
                      {"commit", commit},
                      {"params", n_params},
                      {"rows", rows}};
    if (!out.empty()) triaccel::file_write_atomic(out, result.dump(2) + "\n");
    return 0;
  } catch (const triaccel::UserError& e) {
    std::fprintf(stderr, "bench_optim_step: error: %s\n", e.what());
    return triaccel::kExitUserError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_optim_step: internal error: %s\n", triaccel::error_one_line(e).c_str());
    return triaccel::kExitInternalError;
  }
}
