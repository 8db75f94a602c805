// The triaccel command line: parsing and printing only; the work is the library's (api/api.h). Subcommands:
//   train   train a model (every option of run/config.h as --flag VALUE; `triaccel train --help` lists them)
//   plan    the plan a run would follow, without writing a file (BAOC's optimizer-state plan by default; the memory
//           plan with --vram-budget)
//   report  RUN_DIR... -o report.html: one self-contained HTML page of charts and a side-by-side table of the runs,
//           and that table as CSV beside it (docs/report.md)
// Every error ends the program with one line "triaccel: error: <what and how to fix it>": exit 2 for bad input, 1 for
// internal errors. Options in library messages are spelled as this CLI's flags. A training stopped by SIGINT or
// SIGTERM writes a checkpoint and exits 3; a second signal aborts at once (docs/reliability.md). `train --nproc N`
// starts N data-parallel ranks of this program (api/launch.h); a rank other than 0 marks its error lines with it.
#include "triaccel/api/api.h"
#include "triaccel/api/launch.h"
#include "triaccel/api/stop_signals.h"
#include "triaccel/core/errors.h"

#include <CLI/CLI.hpp>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

namespace {

using triaccel::Config;
using triaccel::Json;

// Every configuration option as a flag taking a value, declared from the configuration's own table.
class ConfigFlags {
 public:
  explicit ConfigFlags(Config defaults) : defaults_(std::move(defaults)) {}

  void declare(CLI::App& app) {
    for (const auto& doc : defaults_.options()) {
      CLI::Option* opt =
          app.add_option(doc.flag, values_[doc.key], doc.help)->group(doc.section)->type_name(doc.type);
      if (!doc.default_text.empty()) opt->default_str(doc.default_text);
      options_[doc.key] = opt;
    }
  }

  // The defaults with every flag given on the command line set (by its key, so the library parses and checks it).
  Config config() const {
    Config c = defaults_;
    for (const auto& [key, opt] : options_) {
      if (opt->count() > 0) c.set(key, values_.at(key));
    }
    return c;
  }

 private:
  Config defaults_;
  std::map<std::string, std::string> values_;
  std::map<std::string, CLI::Option*> options_;
};

// "" in a single process or rank 0; " (rank R)" in another data-parallel rank.
std::string rank_tag() {
  const char* rank = std::getenv("RANK");
  return rank == nullptr || *rank == '\0' || std::string(rank) == "0" ? "" : " (rank " + std::string(rank) + ")";
}

std::string flag_spelling(const std::string& key) {
  const auto& keys = Config::keys();
  return std::find(keys.begin(), keys.end(), key) != keys.end() ? Config::flag_of(key) : key;
}

void plan_print(const Json& plan, bool json) {
  if (json) {
    std::printf("%s\n", plan.dump().c_str());
    return;
  }
  std::printf("%s on %s: %lld parameters in %zu units, %s, batch %lld\n", plan["model"].get<std::string>().c_str(),
              plan["dataset"].get<std::string>().c_str(), static_cast<long long>(plan["params"].get<int64_t>()),
              plan["units"].size(), plan["device"].get<std::string>().c_str(),
              static_cast<long long>(plan["batch_size"].get<int64_t>()));
  if (plan.contains("memory_plan") && !plan["memory_plan"].is_null()) {
    const Json& m = plan["memory_plan"];
    const auto names = [&m](const char* key) {
      std::string out;
      if (m.contains(key)) {
        for (const auto& u : m[key]) out += (out.empty() ? "" : ", ") + u.get<std::string>();
      }
      return out.empty() ? std::string("none") : out;
    };
    const std::string recompute = names("recompute"), fp8 = names("fp8_saved");
    if (!m["feasible"].get<bool>()) {
      std::printf("memory: no plan fits; the floor is %lld bytes\n",
                  static_cast<long long>(m["floor_bytes"].get<int64_t>()));
    } else {
      // Without a budget (levers given by hand) there is no limit to name.
      const bool budgeted = m.contains("budget_bytes") && m["budget_bytes"].is_number();
      const std::string limit =
          budgeted ? c10::str(" of ", m["plan_limit_bytes"].get<int64_t>(), " planned (budget ",
                              m["budget_bytes"].get<int64_t>(), ", floor ", m["floor_bytes"].get<int64_t>(), ")")
                   : c10::str(" (no budget; floor ", m["floor_bytes"].get<int64_t>(), ")");
      const bool in_backward = m.value("update_in_backward", false);
      std::printf("memory: micro-batch %lld x %lld%s, data on the %s, recompute: %s, in FP8: %s; predicted peak %lld "
                  "bytes%s\n",
                  static_cast<long long>(m["micro_batch"].get<int64_t>()),
                  static_cast<long long>(m["accumulation"].get<int64_t>()),
                  in_backward ? ", updated in backward" : "", m["data_placement"].get<std::string>().c_str(),
                  recompute.c_str(), fp8.c_str(),
                  static_cast<long long>(m["predicted_peak_bytes"].get<int64_t>()), limit.c_str());
    }
  }
  if (!plan.contains("optim_plan")) return;
  const Json& p = plan["optim_plan"];
  std::printf("%-24s %-14s %12s %10s\n", "unit", "format", "bytes", "risk");
  for (const auto& u : p["units"]) {
    std::printf("%-24s %-14s %12lld %10.4g\n", u["unit"].get<std::string>().c_str(),
                u["format"].get<std::string>().c_str(), static_cast<long long>(u["bytes"].get<int64_t>()),
                u["risk"].get<double>());
  }
  std::printf("total %lld bytes (%.1f%% of fp32 AdamW's %lld), budget %lld, risk %.4g\n",
              static_cast<long long>(p["total_bytes"].get<int64_t>()), 100.0 * p["fraction_of_adamw_fp32"].get<double>(),
              static_cast<long long>(p["adamw_fp32_bytes"].get<int64_t>()),
              static_cast<long long>(p["budget_bytes"].get<int64_t>()), p["total_risk"].get<double>());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"triaccel: fast neural-network training inside a GPU-memory budget (LibTorch + CUDA)"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "help for every subcommand");

  ConfigFlags train_flags{Config{}};
  CLI::App* train = app.add_subcommand("train", "train a model; writes OUT/events.jsonl, checkpoint.pt, model.pt");
  train->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // a repeated flag: last wins
  train_flags.declare(*train);

  Config plan_defaults;
  plan_defaults.output.out = "runs/plan";
  ConfigFlags plan_flags{plan_defaults};
  bool plan_json = false;
  CLI::App* plan = app.add_subcommand(
      "plan", "the plan a run of these options would follow, without writing a file: with --vram-budget the memory "
              "plan (micro-batch, accumulation, recomputed units, data placement, predicted peak); otherwise BAOC's "
              "optimizer-state plan (a format per unit with its bytes and risk, the totals, fp32 AdamW's total) after "
              "a warm-up of --plan-warmup steps in memory");
  plan->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
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
    std::fprintf(stderr, "triaccel: error: %s (see `triaccel %s--help`)\n", e.what(),
                 train->parsed() ? "train " : (plan->parsed() ? "plan " : (report->parsed() ? "report " : "")));
    return triaccel::kExitUserError;
  }

  try {
    if (train->parsed() && triaccel::api::launch_needed(train_flags.config())) {
      const Config config = train_flags.config();
      const triaccel::api::LaunchResult r = triaccel::api::launch(config, std::vector<std::string>(argv, argv + argc));
      if (r.failed_rank >= 0 && r.exit_code != triaccel::kExitUserError) {  // a bad input was named by the rank
        const std::string how = r.by_signal ? "was killed by signal " + std::to_string(r.exit_code - 128)
                                            : "exited with code " + std::to_string(r.exit_code);
        std::fprintf(stderr,
                     "triaccel: error: rank %d of %lld %s; the other ranks were stopped; continue from the last "
                     "checkpoint with --resume %s\n",
                     r.failed_rank, static_cast<long long>(config.execution.nproc), how.c_str(),
                     config.output.resume.empty() ? config.output.out.c_str() : config.output.resume.c_str());
      }
      return r.exit_code;
    }
    if (train->parsed()) {
      triaccel::RunHooks hooks;
      hooks.spell_option = flag_spelling;
      hooks.stop_requested = &triaccel::api::StopSignals::requested;
      const triaccel::api::StopSignals signals;
      const Json result = triaccel::api::run(train_flags.config(), hooks);
      const std::string reason = result.value("reason", std::string());
      if (reason == "sigint" || reason == "sigterm") return triaccel::kExitStopped;
    }
    if (plan->parsed()) {
      Config c = plan_flags.config();
      if (plan_json && !c.was_given("progress")) c.output.progress = triaccel::ProgressMode::kOff;
      plan_print(triaccel::api::plan(c), plan_json);
    }
    if (report->parsed()) {
      const triaccel::ReportResult r = triaccel::api::report(report_options);
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
    std::fprintf(stderr, "triaccel: error%s: %s\n", rank_tag().c_str(), e.message(flag_spelling).c_str());
    return triaccel::kExitUserError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "triaccel: internal error%s: %s\n", rank_tag().c_str(), triaccel::error_one_line(e).c_str());
    return triaccel::kExitInternalError;
  }
}
