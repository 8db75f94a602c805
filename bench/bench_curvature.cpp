// The curvature probe's cost per unit (issue 19): for each probe precision, each unit is probed alone (its
// first-order gradients and its power iteration, as the time-budgeted schedule does), once to set up cuDNN and the
// CUDA graph, then timed from a cold start (seeded random vectors) and from a warm one (the previous probe's
// eigenvectors, as in training). Reports per unit: ms per Hessian-vector product, products, the whole call's ms, and
// λ_1..k with their relative difference to the first precision's (the reference). Synthetic input, random weights
// after a few SGD steps (so the Hessian is not the initialization's), batch b_curv.
// Usage: bench_curvature [--model resnet18] [--image-size 32] [--precisions fp32,bf16] [--top-k 1] [--iters 20]
//                        [--batch 32] [--units all|name,name] [--estimators hessian,fisher] [--rounds 4]
//                        [--chunk -1] [--cudnn-rounds true] [--out FILE]
// --estimators: also whole rounds of every unit (CurvatureRound) per estimator; --precisions "" skips the per-unit
// probes.
#include "triaccel/control/curvature/curvature_probe.h"
#include "triaccel/core/device.h"
#include "triaccel/core/enum_names.h"
#include "triaccel/core/io.h"
#include "triaccel/core/json.h"
#include "triaccel/models/registry.h"

#include "bench_util.h"

#include <CLI/CLI.hpp>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <sstream>

namespace {

using triaccel::Json;

using bench::split;

triaccel::ProbePrecision precision_named(const std::string& name) {
  for (const auto& n : triaccel::EnumNames<triaccel::ProbePrecision>::kNames) {
    if (name == n.name) return n.value;
  }
  throw std::runtime_error("unknown probe precision " + name + " (fp32 or bf16)");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_curvature: the curvature probe's cost and eigenvalues per unit, per probe precision"};
  std::string model_name = "resnet18", precisions = "fp32,bf16", units_arg = "all", out;
  int64_t image_size = 32, batch = 32, train_steps = 20;
  std::string estimators_arg;
  int top_k = 1, iters = 20, rounds = 4;
  int64_t chunk = -1;
  double tol = 1e-3;
  bool graphs = true;
  app.add_option("--model", model_name)->capture_default_str();
  app.add_option("--image-size", image_size)->capture_default_str();
  app.add_option("--precisions", precisions, "probe precisions; the first is the reference")->capture_default_str();
  app.add_option("--top-k", top_k)->capture_default_str();
  app.add_option("--iters", iters, "power-iteration steps per eigenvalue")->capture_default_str();
  app.add_option("--tol", tol)->capture_default_str();
  app.add_option("--batch", batch, "b_curv")->capture_default_str();
  app.add_option("--train-steps", train_steps, "SGD steps on random data before probing")->capture_default_str();
  app.add_option("--units", units_arg, "all, or unit names")->capture_default_str();
  app.add_option("--cuda-graphs", graphs)->capture_default_str();
  app.add_option("--estimators", estimators_arg, "whole rounds per estimator (hessian,fisher); empty: none")
      ->capture_default_str();
  app.add_option("--rounds", rounds, "rounds per estimator, the first cold")->capture_default_str();
  app.add_option("--chunk", chunk, "the rounds' samples per forward/backward (-1: the estimator's)")->capture_default_str();
  app.add_option("--out", out, "JSON file");
  bool cudnn_rounds = true;
  app.add_option("--cudnn-rounds", cudnn_rounds, "the whole rounds' convolutions through cuDNN (--curv-cudnn)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines reach a pipe as they are printed

  const c10::Device device = torch::cuda::is_available() ? c10::Device(at::kCUDA, 0) : c10::Device(at::kCPU);
  std::optional<c10::cuda::CUDAStreamGuard> stream;  // the trainer's setting: a non-default stream (graphs need it)
  if (device.is_cuda()) stream.emplace(c10::cuda::getStreamFromPool(false, 0));
  torch::manual_seed(0);
  triaccel::ModelOptions mo;
  mo.name = model_name;
  mo.image_size = image_size;
  auto model = triaccel::model_create(mo);
  model->to(device);
  {
    const torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) {
      if (p.dim() == 4) p.set_data(p.contiguous(at::MemoryFormat::ChannelsLast));
    }
  }
  model->train();
  const auto opts = at::TensorOptions().device(device);
  const at::Tensor images =
      torch::randn({batch, 3, image_size, image_size}, opts).contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor labels = torch::randint(0, 10, {batch}, opts.dtype(at::kLong));
  {  // a few plain SGD steps, so that the probe sees a trained-a-little model
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    for (int64_t i = 0; i < train_steps; ++i) {
      sgd.zero_grad();
      at::Tensor h = images;
      for (const auto& u : model->units()) h = u.forward(h);
      at::cross_entropy_loss(h.to(at::kFloat), labels).backward();
      sgd.step();
    }
  }
  const auto& units = model->units();
  std::vector<size_t> chosen;
  for (size_t u = 0; u < units.size(); ++u) {
    if (units_arg == "all") {
      chosen.push_back(u);
      continue;
    }
    for (const auto& name : split(units_arg)) {
      if (name == units[u].name) chosen.push_back(u);
    }
  }

  Json rows = Json::array();
  std::vector<std::vector<double>> reference(units.size());
  const auto names = split(precisions);
  std::printf("%-10s %-6s %10s %8s %10s %10s %12s %10s\n", "unit", "prec", "ms/product", "products", "cold_ms",
              "warm_ms", "lambda_1", "rel_diff");
  for (size_t p = 0; p < names.size(); ++p) {
    triaccel::CurvatureOptions co;
    co.top_k = top_k;
    co.max_iters = iters;
    co.tol = tol;
    co.batch = batch;
    co.cuda_graphs = graphs;
    co.precision = precision_named(names[p]);
    for (size_t u : chosen) {
      const std::vector<size_t> only{u};
      std::vector<std::vector<at::Tensor>> warm;
      double cold_s = 0, warm_s = 0;
      triaccel::curvature_probe(*model, images, labels, co, nullptr, nullptr, &only);  // set-up (handles, cuDNN)
      const auto cold = triaccel::curvature_probe(*model, images, labels, co, &cold_s, &warm, &only);
      const auto warm_run = triaccel::curvature_probe(*model, images, labels, co, &warm_s, &warm, &only);
      const auto& c = cold[u];
      const double ms_per_product = c.iterations > 0 ? 1e3 * c.seconds / c.iterations : 0;
      double rel = 0;
      if (p == 0) reference[u] = c.eigenvalues;
      if (!reference[u].empty() && !c.eigenvalues.empty() && reference[u][0] != 0) {
        rel = std::abs(c.eigenvalues[0] - reference[u][0]) / std::abs(reference[u][0]);
      }
      const double lambda1 = c.eigenvalues.empty() ? 0.0 : c.eigenvalues[0];
      std::printf("%-10s %-6s %10.3f %8d %10.1f %10.1f %12.4g %10.4f\n", c.unit.c_str(), names[p].c_str(),
                  ms_per_product, c.iterations, 1e3 * cold_s, 1e3 * warm_s, lambda1, rel);
      rows.push_back(Json{{"unit", c.unit},
                          {"precision", names[p]},
                          {"ms_per_product", ms_per_product},
                          {"products_cold", c.iterations},
                          {"products_warm", warm_run[u].iterations},
                          {"cold_ms", 1e3 * cold_s},
                          {"warm_ms", 1e3 * warm_s},
                          {"unit_ms", 1e3 * c.seconds},
                          {"eigenvalues", c.eigenvalues},
                          {"rel_diff_lambda1", rel},
                          {"graphed", c.graphed},
                          {"converged", c.converged}});
    }
  }
  // Whole rounds per estimator (every unit, k = 1, as --curv-estimator and --curv-lockstep run them): the first
  // (cold, with the capture) and `rounds - 1` warm ones, each round's time and passes, and the last round's λ per
  // unit beside the first estimator's.
  Json round_rows = Json::array();
  std::vector<std::vector<triaccel::UnitCurvature>> last_rounds;
  const auto estimators = split(estimators_arg);
  for (const auto& name : estimators) {
    triaccel::CurvatureOptions co;
    co.top_k = 1;
    co.max_iters = iters;
    co.tol = tol;
    co.batch = batch;
    co.chunk = chunk;
    co.cuda_graphs = graphs;
    co.estimator = triaccel::enum_parse<triaccel::CurvatureEstimator>(name, "curv_estimator");
    co.cudnn = cudnn_rounds;
    triaccel::CurvatureRound round(*model, images, labels, co);
    Json times = Json::array(), passes = Json::array();
    std::vector<triaccel::UnitCurvature> last;
    for (int r = 0; r < rounds; ++r) {
      double s = 0;
      last = round.run(&s);
      times.push_back(s);
      passes.push_back(round.timing().passes);
      const auto& t = round.timing();
      std::printf("round %-8s %d: %8.1f ms, %d passes, replayed pass %.2f ms, graph %.1f MB; capture %.1f ms, eager "
                  "%.1f ms, outside the passes %.1f ms\n",
                  name.c_str(), r, 1e3 * s, t.passes, 1e3 * t.replay_s, round.graph_bytes() / 1e6, 1e3 * t.capture_s,
                  1e3 * t.eager_s, 1e3 * (s - t.passes_s));
    }
    Json lambda = Json::array();
    for (const auto& c : last) lambda.push_back(c.lambda_max);
    round_rows.push_back(Json{{"estimator", name}, {"round_s", times}, {"passes", passes},
                              {"replay_s", round.timing().replay_s}, {"graph_bytes", round.graph_bytes()},
                              {"lambda_max", lambda}});
    last_rounds.push_back(std::move(last));
  }
  for (size_t u = 0; !last_rounds.empty() && u < last_rounds[0].size(); ++u) {
    std::printf("%-10s", last_rounds[0][u].unit.c_str());
    for (size_t e = 0; e < last_rounds.size(); ++e) {
      std::printf(" %s λ %10.4g", estimators[e].c_str(), last_rounds[e][u].lambda_max);
    }
    std::printf("\n");
  }
  const Json result{{"model", model_name}, {"image_size", image_size}, {"batch", batch}, {"top_k", top_k},
                    {"iters", iters},      {"tol", tol},               {"cuda_graphs", graphs},
                    {"device", device.str()}, {"rows", rows},          {"rounds", round_rows}};
  if (!out.empty()) triaccel::file_write_atomic(out, result.dump(1));
  return 0;
}
