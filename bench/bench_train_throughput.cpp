// Training-step throughput and peak VRAM of triaccel's step (TrainStep: autocast, fused SGD, loss scaler, CUDA
// graph) on synthetic GPU-resident input, for each batch size × precision. The PyTorch eager reference
// (bench/pytorch_reference.py) measures the same protocol; bench/run_foundation.sh runs both in one job.
// Protocol (docs/measuring.md): warm up, synchronize, time `steps` steps with CUDA events, repeat, report the median
// images/s; peak VRAM = the allocator's peak allocated bytes from model creation to the end of the timed steps.
#include "triaccel/core/device.h"
#include "triaccel/core/errors.h"
#include "triaccel/train/grad_stats.h"
#include "triaccel/core/io.h"
#include "triaccel/core/json.h"
#include "triaccel/kernels/batch_norm.h"
#include "triaccel/models/batch_norm.h"
#include "triaccel/models/registry.h"
#include "triaccel/train/loss_scaler.h"
#include "triaccel/train/precision.h"
#include "triaccel/optim/sgd.h"
#include "triaccel/train/step.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include "bench_util.h"

#include <CLI/CLI.hpp>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <unordered_map>

namespace {

using triaccel::Json;

using bench::split;

struct Config {
  std::string model;
  int64_t batch;
  triaccel::PrecisionMode precision;
  bool channels_last;
  bool cuda_graphs;
  int64_t image_size;
  bool grad_stats;  // Tri-Accel's per-unit gradient statistics accumulated inside the step
};

Json bench_one(const Config& cfg, int warmup, int steps, int repeats, const c10::Device& device) {
  c10::cuda::CUDACachingAllocator::emptyCache();
  triaccel::memory_stats_reset_peak(device);
  torch::manual_seed(0);
  triaccel::ModelOptions mo;
  mo.name = cfg.model;
  mo.image_size = cfg.image_size;
  auto model = triaccel::model_create(mo);
  model->to(device);
  const auto mf = cfg.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  {
    const torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) {
      if (p.dim() == 4) p.set_data(p.contiguous(mf));
    }
  }
  model->train();
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& it : model->named_parameters()) named.emplace_back(it.key(), it.value());
  triaccel::Sgd sgd(named, triaccel::SgdOptions{0.9, true, 5e-4});
  triaccel::LossScalerOptions lso;
  lso.enabled = cfg.precision == triaccel::PrecisionMode::kAmpFP16;
  triaccel::LossScaler scaler(lso, device);
  triaccel::StepOptions so;
  so.precision = cfg.precision;
  so.cuda_graphs = cfg.cuda_graphs;
  so.graph_batch_size = cfg.batch;
  triaccel::TrainStep step(*model, sgd, scaler, so, device);
  if (cfg.grad_stats) {
    std::unordered_map<const c10::TensorImpl*, int64_t> owner;
    const auto& units = model->units();
    for (size_t u = 0; u < units.size(); ++u) {
      for (const auto& p : units[u].parameters()) owner[p.unsafeGetTensorImpl()] = static_cast<int64_t>(u);
    }
    std::vector<int64_t> unit_of;
    for (const auto& p : sgd.params()) unit_of.push_back(owner.at(p.unsafeGetTensorImpl()));
    step.grad_stats_enable(triaccel::GradStatsLayout(sgd.params(), unit_of, static_cast<int64_t>(units.size())));
  }

  const auto opts = at::TensorOptions().device(device);
  const at::Tensor images = torch::randn({cfg.batch, 3, cfg.image_size, cfg.image_size}, opts).contiguous(mf);
  const at::Tensor labels = torch::randint(0, 10, {cfg.batch}, opts.dtype(at::kLong));
  for (int i = 0; i < warmup; ++i) step.run(images, labels, 0.01);
  triaccel::device_synchronize(device);

  std::vector<double> rates;
  for (int r = 0; r < repeats; ++r) {
    at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
    start.record();
    for (int i = 0; i < steps; ++i) step.run(images, labels, 0.01);
    stop.record();
    stop.synchronize();
    const double ms = start.elapsed_time(stop);
    rates.push_back(static_cast<double>(cfg.batch * steps) / (ms / 1000.0));
  }
  std::sort(rates.begin(), rates.end());
  const auto mem = triaccel::memory_stats(device);
  const double loss = step.last_loss().item<double>();
  return Json{{"model", cfg.model},
              {"batch", cfg.batch},
              {"precision", triaccel::enum_name(cfg.precision)},
              {"channels_last", cfg.channels_last},
              {"cuda_graphs", cfg.cuda_graphs},
              {"image_size", cfg.image_size},
              {"images_per_s", rates[rates.size() / 2]},
              {"images_per_s_min", rates.front()},
              {"images_per_s_max", rates.back()},
              {"peak_allocated_gb", static_cast<double>(mem.peak_allocated_bytes) / 1e9},
              {"graph_captured", step.graph().captured()},
              {"grad_stats", cfg.grad_stats},
              {"bn_kernel", triaccel::batch_norm_kernel_enabled()},
              {"bn_tail", triaccel::batch_norm_add_relu_fused()},
              {"cudnn_autotune", at::globalContext().benchmarkCuDNN()},
              {"final_loss_finite", std::isfinite(loss)}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_train_throughput: triaccel training-step throughput and peak VRAM (synthetic input)"};
  std::string model = "resnet18", batches = "96,512", precisions = "fp32,amp-bf16,amp-fp16", out, grad_stats = "off";
  int warmup = 15, steps = 50, repeats = 5;
  int64_t image_size = 32;
  bool channels_last = true, cuda_graphs = true;
  app.add_option("--model", model, "model")->capture_default_str();
  app.add_option("--batch-sizes", batches, "comma-separated batch sizes")->capture_default_str();
  app.add_option("--precisions", precisions, "comma-separated precision modes")->capture_default_str();
  app.add_option("--image-size", image_size, "input height and width")->capture_default_str();
  app.add_option("--warmup", warmup, "warm-up steps (graph capture included)")->capture_default_str();
  app.add_option("--steps", steps, "timed steps per repeat")->capture_default_str();
  app.add_option("--repeats", repeats, "repeats (the median is reported)")->capture_default_str();
  app.add_option("--channels-last", channels_last, "channels_last layout")->capture_default_str();
  app.add_option("--cuda-graphs", cuda_graphs, "capture the step in a CUDA graph")->capture_default_str();
  app.add_option("--out", out, "write the rows as JSON here");
  std::string bn_kernel = "on";
  app.add_option("--bn-kernel", bn_kernel, "on|off: our fused bf16 BatchNorm(+ReLU) kernel (models/batch_norm.h); off "
                 "runs LibTorch's BatchNorm, for A/B runs")->capture_default_str()->check(CLI::IsMember({"on", "off"}));
  std::string bn_tail = "on";
  app.add_option("--bn-tail", bn_tail, "on|off: a residual block's end (BatchNorm + add + ReLU) as one pass of the "
                 "kernel; off: three (A/B runs)")->capture_default_str()->check(CLI::IsMember({"on", "off"}));
  std::string bn_launch = "0:0";
  app.add_option("--bn-launch", bn_launch, "ROWS:BLOCKS, the BatchNorm kernels' launch (kernels/batch_norm.h, "
                 "BatchNormLaunch: backward rows in flight, blocks per SM; 0: the rule; 4:4 the launch before the "
                 "rules, for A/B runs)")->capture_default_str();
  app.add_option("--grad-stats", grad_stats, "off|on|both: Tri-Accel's fused per-unit gradient statistics in the step "
                 "(both: each configuration without, then with)")->capture_default_str();
  bool cudnn_autotune = true;
  app.add_option("--cudnn-autotune", cudnn_autotune, "cuDNN autotuning (false: heuristics, as the trainer uses under "
                 "a --vram-budget by default)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    TRIACCEL_CHECK_INPUT(torch::cuda::is_available(), "bench_train_throughput needs a CUDA GPU");
    const c10::Device device(c10::kCUDA, 0);
    const c10::cuda::CUDAStreamGuard stream_guard(c10::cuda::getStreamFromPool(false, 0));
    at::globalContext().setBenchmarkCuDNN(cudnn_autotune);
    triaccel::batch_norm_kernel_set_enabled(bn_kernel == "on");
    triaccel::batch_norm_add_relu_set_fused(bn_tail == "on");
    const auto [rows_in_flight, blocks_per_sm] = bench::int_pair_parse(bn_launch, "--bn-launch");
    triaccel::batch_norm_launch_set({rows_in_flight, blocks_per_sm});
    Json rows = Json::array();
    for (const auto& b : split(batches)) {
      for (const auto& p : split(precisions)) {
        std::vector<bool> stats_modes;
        if (grad_stats != "on") stats_modes.push_back(false);
        if (grad_stats != "off") stats_modes.push_back(true);
        for (const bool gs : stats_modes) {
          const Config cfg{model, std::stoll(b), triaccel::enum_parse<triaccel::PrecisionMode>(p, "precision"), channels_last, cuda_graphs,
                           image_size, gs};
          Json row = bench_one(cfg, warmup, steps, repeats, device);
          row["bn_launch"] = bn_launch;
          std::printf("triaccel %-16s batch %4lld %-9s %s%9.0f img/s  peak %.3f GB\n", model.c_str(),
                      static_cast<long long>(cfg.batch), p.c_str(), gs ? "grad-stats " : "", row["images_per_s"].get<double>(),
                      row["peak_allocated_gb"].get<double>());
          std::fflush(stdout);
          rows.push_back(row);
        }
      }
    }
    const Json result{{"system", "triaccel"}, {"gpu", triaccel::device_long_name(device)}, {"rows", rows}};
    if (!out.empty()) triaccel::file_write_atomic(out, result.dump(2) + "\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_train_throughput: error: %s\n", triaccel::error_one_line(e).c_str());
    return 2;
  }
}
