// The triaccel command line. Subcommands:
//   train   train a model (TrainOptions; every option declared once below with its help text and default)
//   plan    BAOC: a short fp32-AdamW warm-up (--plan-warmup steps) gathering statistics, then the per-unit optimizer
//           state plan under --optim-memory-budget / --optim-time-budget (JSON with --json)
//   report  RUN_DIR... -o report.html: one self-contained HTML page of charts and a side-by-side table of the runs,
//           and that table as CSV beside it (docs/report.md)
// main() catches every error and prints one line: "triaccel: error: <what and how to fix it>", exit 2 for bad
// input, 1 for internal errors.
#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"
#include "triaccel/train/telemetry.h"
#include "triaccel/data/dataset.h"
#include "triaccel/models/model.h"
#include "triaccel/report/report.h"
#include "triaccel/train/options.h"
#include "triaccel/train/trainer.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

namespace {

using triaccel::TrainOptions;

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : "|") + s;
  return out;
}

struct TrainFlags {
  TrainOptions options;
  std::string precision = "fp32";
  std::vector<std::pair<std::string, CLI::Option*>> declared;  // TrainOptions JSON key → option

  void declare(CLI::App& app) {
    auto& o = options;
    auto add = [&](const std::string& key, CLI::Option* opt) { declared.emplace_back(key, opt); };
    add("method", app.add_option("--method", o.method, "training method: " + join(triaccel::method_names()))
                      ->capture_default_str());
    add("model", app.add_option("--model", o.model, "model: " + join(triaccel::model_names()))->capture_default_str());
    add("dataset", app.add_option("--dataset", o.dataset, "dataset: " + join(triaccel::dataset_names()))
                       ->capture_default_str());
    add("data_dir", app.add_option("--data", o.data_dir,
                                   "dataset folder (CIFAR binary files, IDX files, or input.txt for text); default: "
                                   "the dataset's standard location (fashion-mnist: /usr/share/datasets/fashion-mnist, "
                                   "tinyshakespeare: ../shared/data/tinyshakespeare)"));
    add("block_size", app.add_option("--block-size", o.block_size,
                                     "text datasets: characters per sample = the GPT's context length")
                          ->capture_default_str());
    add("epochs", app.add_option("--epochs", o.epochs, "epochs (the schedule spans all of them)")->capture_default_str());
    add("max_steps", app.add_option("--max-steps", o.max_steps,
                                    "stop this run after N optimizer steps with a checkpoint (0: no limit)")
                         ->capture_default_str());
    add("batch_size", app.add_option("--batch-size", o.batch_size, "training batch size")->capture_default_str());
    add("lr", app.add_option("--lr", o.lr, "peak learning rate (after warm-up)")->capture_default_str());
    add("momentum", app.add_option("--momentum", o.momentum, "SGD momentum")->capture_default_str());
    add("nesterov", app.add_option("--nesterov", o.nesterov, "Nesterov momentum (true|false)")->capture_default_str());
    add("weight_decay", app.add_option("--weight-decay", o.weight_decay,
                                       "weight decay (not applied to norms and biases)")
                            ->capture_default_str());
    add("warmup_epochs", app.add_option("--warmup-epochs", o.warmup_epochs,
                                        "linear warm-up in epochs, then the --lr-decay to 0 (-1: auto = min(1, 0.1 × "
                                        "epochs))")
                             ->capture_default_str());
    add("lr_decay", app.add_option("--lr-decay", o.lr_decay,
                                   "cosine|linear: the lr's decay from its peak (after the warm-up) to 0 at the end")
                        ->capture_default_str());
    add("label_smoothing", app.add_option("--label-smoothing", o.label_smoothing, "label smoothing for the loss")
                               ->capture_default_str());
    add("precision", app.add_option("--precision", precision, "fp32|amp-bf16|amp-fp16 (fp16 uses dynamic loss scaling)")
                         ->capture_default_str());
    add("device", app.add_option("--device", o.device, "auto|cpu|cuda")->capture_default_str());
    add("channels_last", app.add_option("--channels-last", o.channels_last, "channels_last layout on CUDA (true|false)")
                             ->capture_default_str());
    add("cuda_graphs", app.add_option("--cuda-graphs", o.cuda_graphs,
                                      "capture the training step in a CUDA graph (true|false)")
                           ->capture_default_str());
    add("augment", app.add_option("--augment", o.augment,
                                  "auto|on|off: random crop (4-pixel padding) + horizontal flip; auto = on for CIFAR")
                       ->capture_default_str());
    add("cutout", app.add_option("--cutout", o.cutout,
                                 "training images: set one random N×N square per image (after crop and flip; "
                                 "clipped at the borders) to the dataset mean, i.e. 0 after normalization; "
                                 "0: off; at most the image side")
                      ->capture_default_str());
    add("image_size", app.add_option("--image-size", o.image_size, "resize inputs to N×N (0: native size)")
                          ->capture_default_str());
    add("eval_batch_size", app.add_option("--eval-batch-size", o.eval_batch_size, "batch size for evaluation")
                               ->capture_default_str());
    add("tta", app.add_option("--tta", o.tta,
                              "off|flip: also report test accuracy with horizontal-flip test-time augmentation")
                   ->capture_default_str());
    add("ctrl_every", app.add_option("--ctrl-every", o.ctrl_every, "tri-accel: steps per control window (T_ctrl)")
                          ->capture_default_str());
    add("curv_every", app.add_option("--curv-every", o.curv_every, "tri-accel: steps between curvature probes (T_curv)")
                          ->capture_default_str());
    add("curv_batch", app.add_option("--curv-batch", o.curv_batch, "tri-accel: samples in the curvature batch (b_curv)")
                          ->capture_default_str());
    add("curv_top_k", app.add_option("--curv-top-k", o.curv_top_k, "tri-accel: Hessian eigenvalues per unit")
                          ->capture_default_str());
    add("curv_max_iters", app.add_option("--curv-max-iters", o.curv_max_iters,
                                         "tri-accel: power-iteration steps per eigenvalue")
                              ->capture_default_str());
    add("curv_budget", app.add_option("--curv-budget", o.curv_budget,
                                      "tri-accel: max share of training time for curvature probes; they are spaced "
                                      "to stay within it (0: every --curv-every steps)")
                           ->capture_default_str());
    add("curv_alpha", app.add_option("--curv-alpha", o.curv_alpha,
                                     "tri-accel: alpha in lr / (1 + alpha * lambda_max); -1: calibrate")
                          ->capture_default_str());
    add("tau_low", app.add_option("--tau-low", o.tau_low, "tri-accel: fp16 below this gradient variance; -1: calibrate")
                       ->capture_default_str());
    add("tau_high", app.add_option("--tau-high", o.tau_high, "tri-accel: fp32 at or above this variance; -1: calibrate")
                        ->capture_default_str());
    add("tau_curv", app.add_option("--tau-curv", o.tau_curv, "tri-accel: promote precision above this lambda_max; -1: calibrate")
                        ->capture_default_str());
    add("ta_precision", app.add_option("--ta-precision", o.ta_precision, "tri-accel: adaptive per-unit precision (true|false)")
                            ->capture_default_str());
    add("ta_curvature", app.add_option("--ta-curvature", o.ta_curvature,
                                       "tri-accel: curvature-scaled per-unit learning rates (true|false)")
                            ->capture_default_str());
    add("ta_batch", app.add_option("--ta-batch", o.ta_batch,
                                   "tri-accel: memory-elastic batch size under --vram-budget (true|false)")
                        ->capture_default_str());
    add("vram_budget", app.add_option("--vram-budget", o.vram_budget,
                                      "GPU memory budget, e.g. 2GB or 1.5GiB: the allocator is capped at it and "
                                      "tri-accel sizes the batch by it (default: none)"));
    add("nf_max_batch", app.add_option("--nf-max-batch", o.nf_max_batch, "neuroflux: cap on a block's batch size")
                            ->capture_default_str());
    add("nf_holdout", app.add_option("--nf-holdout", o.nf_holdout,
                                     "neuroflux: training samples held out to choose the exit (at most 10%)")
                          ->capture_default_str());
    add("nf_exit_tolerance", app.add_option("--nf-exit-tolerance", o.nf_exit_tolerance,
                                            "neuroflux: exported exit = fewest parameters whose held-out accuracy is "
                                            "within this many points of the full network's")
                                 ->capture_default_str());
    add("nf_profile", app.add_option("--nf-profile", o.nf_profile,
                                     "neuroflux: memory profile auto|model|measured (auto: measured on CUDA)")
                          ->capture_default_str());
    add("lr_batch_rule", app.add_option("--lr-batch-rule", o.lr_batch_rule,
                                        "how the lr follows a batch change (elastic batch, out-of-memory retry): "
                                        "none|linear|sqrt")
                             ->capture_default_str());
    add("cudnn_autotune", app.add_option("--cudnn-autotune", o.cudnn_autotune,
                                         "cuDNN algorithms: on (autotune each shape), off (heuristics), auto (on "
                                         "without --vram-budget, off under one: autotuning's workspace tries fill a "
                                         "budget, though the cap still holds; off for tri-accel, whose precision "
                                         "changes would re-tune every new dtype mix)")
                              ->capture_default_str());
    add("optimizer", app.add_option("--optimizer", o.optimizer,
                                    "sgd|adamw|baoc: SGD with momentum; AdamW (fp32 states); BAOC (AdamW warm-up, then "
                                    "per-unit state formats under the budgets). adamw/baoc default to --lr 1e-3 and "
                                    "--weight-decay 0.01 unless given")
                         ->capture_default_str());
    add("adam_beta1", app.add_option("--adam-beta1", o.adam_beta1, "AdamW beta1")->capture_default_str());
    add("adam_beta2", app.add_option("--adam-beta2", o.adam_beta2, "AdamW beta2")->capture_default_str());
    add("adam_eps", app.add_option("--adam-eps", o.adam_eps, "AdamW epsilon")->capture_default_str());
    add("optim_memory_budget", app.add_option("--optim-memory-budget", o.optim_memory_budget,
                                              "baoc: optimizer-state memory budget, a percentage of fp32 AdamW's "
                                              "state (15%) or a size (200MB)")
                                   ->capture_default_str());
    add("optim_time_budget", app.add_option("--optim-time-budget", o.optim_time_budget,
                                            "baoc: optimizer step-time budget as a multiple of fp32 AdamW's (1.1x; "
                                            "default: none)"));
    add("optim_formats", app.add_option("--optim-formats", o.optim_formats,
                                        "baoc: comma-separated formats to choose from (default: all of adamw-fp32, "
                                        "adamw-bf16, adamw-8bit, factored, no-momentum, sgd-momentum, sgd)"));
    add("optim_time_table", app.add_option("--optim-time-table", o.optim_time_table,
                                           "baoc: step times per format measured by bench_optim_step (its --out "
                                           "JSON); default: a bytes-moved model"));
    add("plan_warmup", app.add_option("--plan-warmup", o.plan_warmup,
                                      "baoc: fp32 AdamW steps gathering statistics before the first plan")
                           ->capture_default_str());
    add("replan_every", app.add_option("--replan-every", o.replan_every,
                                       "baoc: steps between re-plans (0: plan once)")
                            ->capture_default_str());
    add("optim_risk_floor", app.add_option("--optim-risk-floor", o.optim_risk_floor,
                                           "baoc: share of a unit's risk weight that is the same for every unit; the "
                                           "rest is by its share of the parameters (docs/baoc.md)")
                                ->capture_default_str());
    add("out", app.add_option("--out", o.out, "output folder (events.jsonl, checkpoint.pt, model.pt)")
                   ->capture_default_str());
    add("seed", app.add_option("--seed", o.seed, "random seed (initialization, data order, augmentation)")
                    ->capture_default_str());
    add("resume", app.add_option("--resume", o.resume, "continue the run in this folder (or checkpoint file)"));
    add("checkpoint_every", app.add_option("--checkpoint-every", o.checkpoint_every,
                                           "checkpoint every N steps (0: at the end of every epoch)")
                                ->capture_default_str());
    add("log_every", app.add_option("--log-every", o.log_every, "steps between progress lines")->capture_default_str());
    add("progress", app.add_option("--progress", o.progress, "auto|bar|lines|off")->capture_default_str());
    add("inject_faults", app.add_option("--inject-faults", o.inject_faults,
                                        "test faults: KIND@STEP[xN],... (KIND: oom, nan-grad, inf-grad, nan-loss) or "
                                        "random:seed=S,oom=P,nan-grad=P,inf-grad=P,nan-loss=P,burst=N "
                                        "(docs/reliability.md)"));
  }

  std::vector<std::string> explicit_keys() const {
    std::vector<std::string> keys;
    for (const auto& [key, opt] : declared) {
      if (opt->count() > 0) keys.push_back(key);
    }
    return keys;
  }

  bool given(const std::string& key) const {
    const auto keys = explicit_keys();
    return std::find(keys.begin(), keys.end(), key) != keys.end();
  }

  TrainOptions resolve() {
    options.precision = triaccel::precision_mode_parse(precision);
    if (!options.resume.empty()) return triaccel::resume_options(options, explicit_keys());
    // AdamW's usual scale: SGD's defaults (lr 0.1, weight decay 5e-4) would diverge or barely regularize.
    if (options.optimizer != "sgd") {
      if (!given("lr")) options.lr = 1e-3;
      if (!given("weight_decay")) options.weight_decay = 1e-2;
    }
    return options;
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"triaccel: fast neural-network training inside a GPU-memory budget (LibTorch + CUDA)"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "help for every subcommand");

  TrainFlags train_flags;
  CLI::App* train = app.add_subcommand("train", "train a model; writes OUT/events.jsonl, checkpoint.pt, model.pt");
  train->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // a repeated flag: last wins
  train_flags.declare(*train);

  TrainFlags plan_flags;
  bool plan_json = false;
  CLI::App* plan = app.add_subcommand(
      "plan", "BAOC: warm up with fp32 AdamW for --plan-warmup steps, gather per-unit statistics and print the plan "
              "(a format per unit with its bytes and risk, the totals, fp32 AdamW's total)");
  plan->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  plan_flags.options.out = "runs/plan";
  plan_flags.declare(*plan);
  plan->add_flag("--json", plan_json, "print the plan as one JSON object on stdout");

  triaccel::ReportOptions report_options;
  CLI::App* report = app.add_subcommand(
      "report", "one self-contained HTML page (no network) with the runs' charts and a side-by-side table (accuracy, "
                "s/epoch, peak GB, efficiency score), and the table as CSV beside it");
  report->add_option("RUN_DIR", report_options.runs,
                     "run folders written by `triaccel train --out` (each holds events.jsonl), or events files; a "
                     "missing or damaged one is named in the page");
  report->add_option("-o,--output", report_options.html, "the HTML file to write")->capture_default_str();
  report->add_option("--csv", report_options.csv, "the table's CSV file (default: the -o path with .csv)");
  report->add_option("--title", report_options.title, "the page's title")->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string msg = e.what();
    std::fprintf(stderr, "triaccel: error: %s (see `triaccel %s--help`)\n", msg.c_str(),
                 train->parsed() ? "train " : (plan->parsed() ? "plan " : (report->parsed() ? "report " : "")));
    return triaccel::kExitUserError;
  }

  try {
    if (train->parsed()) {
      const TrainOptions options = train_flags.resolve();
      triaccel::train_run(options);
    }
    if (plan->parsed()) {
      TRIACCEL_CHECK_INPUT(plan_flags.options.resume.empty(), "plan does not take --resume (it starts a fresh warm-up)");
      TrainOptions options = plan_flags.resolve();
      TRIACCEL_CHECK_INPUT(options.optimizer != "sgd" || !plan_flags.given("optimizer"),
                           "plan uses --optimizer baoc; drop --optimizer");
      options.optimizer = "baoc";
      if (!plan_flags.given("lr")) options.lr = 1e-3;
      if (!plan_flags.given("weight_decay")) options.weight_decay = 1e-2;
      options.max_steps = options.plan_warmup;
      options.replan_every = 0;
      if (plan_json && !plan_flags.given("progress")) options.progress = "off";
      triaccel::train_run(options);
      const std::string events = (std::filesystem::path(options.out) / "events.jsonl").string();
      triaccel::Json found;
      for (const auto& e : triaccel::events_read(events)) {
        if (e.value("event", "") == "plan") found = e;
      }
      TRIACCEL_CHECK_INPUT(!found.is_null(), "the warm-up ended before --plan-warmup ", options.plan_warmup,
                           " steps: raise --epochs or lower --plan-warmup");
      found["model"] = options.model;
      found["dataset"] = options.dataset;
      found["optim_memory_budget"] = options.optim_memory_budget;
      if (plan_json) {
        std::printf("%s\n", found.dump().c_str());
      } else {
        std::printf("%-24s %-14s %12s %10s\n", "unit", "format", "bytes", "risk");
        for (const auto& u : found["units"]) {
          std::printf("%-24s %-14s %12lld %10.4g\n", u["unit"].get<std::string>().c_str(),
                      u["format"].get<std::string>().c_str(), static_cast<long long>(u["bytes"].get<int64_t>()),
                      u["risk"].get<double>());
        }
        std::printf("total %lld bytes (%.1f%% of fp32 AdamW's %lld), budget %lld, risk %.4g\n",
                    static_cast<long long>(found["total_bytes"].get<int64_t>()),
                    100.0 * found["fraction_of_adamw_fp32"].get<double>(),
                    static_cast<long long>(found["adamw_fp32_bytes"].get<int64_t>()),
                    static_cast<long long>(found["budget_bytes"].get<int64_t>()), found["total_risk"].get<double>());
      }
    }
    if (report->parsed()) {
      const triaccel::ReportResult r = triaccel::report_write(report_options);
      size_t with_problems = 0;
      for (const auto& run : r.runs) with_problems += run.problems.empty() ? 0 : 1;
      for (const auto& run : r.runs) {
        for (const auto& p : run.problems) std::fprintf(stderr, "triaccel: warning: %s: %s\n", run.name.c_str(), p.c_str());
      }
      std::printf("wrote %s and %s (%zu run%s, %zu with problems shown in the page)\n", r.html_path.c_str(),
                  r.csv_path.c_str(), r.runs.size(), r.runs.size() == 1 ? "" : "s", with_problems);
    }
    return 0;
  } catch (const triaccel::UserError& e) {
    std::fprintf(stderr, "triaccel: error: %s\n", e.what());
    return triaccel::kExitUserError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "triaccel: internal error: %s\n", triaccel::error_one_line(e).c_str());
    return triaccel::kExitInternalError;
  }
}
