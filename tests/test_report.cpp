// Reports (src/triaccel/report): the table figures computed from synthetic events, the messages for missing, empty
// and damaged files, the chart series, the exact CSV and the page's escaping. All on the CPU, no browser (the page's
// drawing is tested in Chromium by tests/report/run_report_browser_test.sh).
#include "test_util.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"
#include "triaccel/report/report.h"
#include "triaccel/report/run_events.h"
#include "triaccel/report/run_model.h"
#include "triaccel/report/table.h"

#include <gtest/gtest.h>

#include <filesystem>

namespace triaccel {
namespace {

using test::TempDir;

std::string line(const Json& j) { return j.dump() + "\n"; }

Json event(const std::string& kind, int64_t step, double time_s, const Json& fields = Json::object()) {
  Json e{{"event", kind}, {"step", step}, {"time_s", time_s}};
  for (const auto& [k, v] : fields.items()) e[k] = v;
  return e;
}

Json config(const std::string& method) {
  return event("config", 0, 0.5, Json{{"options", {{"method", method}, {"model", "resnet18"}, {"dataset", "cifar10"},
                                                    {"precision", "fp32"}, {"epochs", 7}}}});
}

Json epoch(int64_t n, double epoch_s, double acc, double peak_gb) {
  return event("epoch", 100 * n, 10.0 * static_cast<double>(n),
               Json{{"epoch", n}, {"train_loss", 2.0 / static_cast<double>(n)}, {"train_acc", acc - 1},
                    {"test_loss", 2.5 / static_cast<double>(n)}, {"test_acc", acc}, {"epoch_s", epoch_s},
                    {"batch", 96}, {"peak_vram_gb", peak_gb}});
}

std::string run_write(const TempDir& dir, const std::string& name, const std::string& text) {
  const std::string run = dir.file(name);
  std::filesystem::create_directories(run);
  file_write_atomic(run + "/events.jsonl", text);
  return run;
}

TEST(Report, TableRowFromSummaryIsExact) {
  TempDir dir("report_summary");
  std::string text = line(config("tri-accel"));
  for (int n = 1; n <= 3; ++n) text += line(epoch(n, 9.0, 50.0 + n, 2.0));
  text += line(event("summary", 300, 31.0,
                     Json{{"test_acc", 90.0}, {"epoch_s", 2.5}, {"peak_vram_gb", 1.5}, {"eff_score", 24.0},
                          {"method", "tri-accel"}, {"model", "resnet18"}, {"dataset", "cifar10"},
                          {"precision", "adaptive"}, {"epochs", 3}}));
  const RunModel m = run_model_build(run_events_read(run_write(dir, "tri", text)));
  EXPECT_TRUE(m.problems.empty()) << m.problems.front();
  EXPECT_EQ(m.row.run, "tri");
  EXPECT_EQ(m.row.source, TableSource::kSummary);
  EXPECT_EQ(m.row.method, "tri-accel");
  EXPECT_EQ(m.row.precision, "adaptive");  // the summary's, not the config's fp32
  EXPECT_EQ(m.row.epochs.value(), 3);
  EXPECT_DOUBLE_EQ(m.row.test_acc.value(), 90.0);  // the summary's, not the last epoch's 53
  EXPECT_DOUBLE_EQ(m.row.epoch_s.value(), 2.5);
  EXPECT_DOUBLE_EQ(m.row.peak_gb.value(), 1.5);
  EXPECT_DOUBLE_EQ(m.row.eff_score.value(), 24.0);  // 90 / (2.5 × 1.5)
}

TEST(Report, TableRowWithoutSummaryUsesLastFiveEpochs) {
  TempDir dir("report_nosummary");
  std::string text = line(config("backprop"));
  const double peaks[] = {1.0, 3.0, 2.0, 2.5, 2.0, 1.0, 2.0};
  for (int n = 1; n <= 7; ++n) text += line(epoch(n, static_cast<double>(n), 60.0 + n, peaks[n - 1]));
  const RunModel m = run_model_build(run_events_read(run_write(dir, "part", text)));
  EXPECT_EQ(m.row.source, TableSource::kEpochEvents);
  EXPECT_EQ(m.row.method, "backprop");  // from the config
  EXPECT_EQ(m.row.epochs.value(), 7);
  EXPECT_DOUBLE_EQ(m.row.test_acc.value(), 67.0);
  EXPECT_DOUBLE_EQ(m.row.epoch_s.value(), 5.0);  // (3 + 4 + 5 + 6 + 7) / 5
  EXPECT_DOUBLE_EQ(m.row.peak_gb.value(), 3.0);  // the largest epoch peak
  EXPECT_DOUBLE_EQ(m.row.eff_score.value(), 67.0 / 15.0);
  ASSERT_EQ(m.problems.size(), 1u);
  EXPECT_EQ(m.problems[0], m.file + ": no summary event: the run did not finish (it was stopped, crashed or is still "
                                    "running); its table row comes from its 7 epoch events");
}

// A data-parallel run: its ranks from world_size, and the largest rank's peak (rank 0's is the summary's).
TEST(Report, DataParallelRowHasItsRanksAndTheLargestRankPeak) {
  TempDir dir("report_dp");
  Json e1 = epoch(1, 2.0, 50.0, 0.5);
  e1["world_size"] = 2;
  e1["rank_peak_vram_gb"] = Json::array({0.5, 0.7});
  const std::string text = line(config("backprop")) + line(e1) +
                           line(event("summary", 100, 10.0, Json{{"test_acc", 50.0}, {"epoch_s", 2.0},
                                                                 {"peak_vram_gb", 0.5}, {"world_size", 2}}));
  const RunModel m = run_model_build(run_events_read(run_write(dir, "dp", text)));
  EXPECT_EQ(m.row.ranks, 2);
  ASSERT_TRUE(m.row.peak_gb.has_value());
  EXPECT_DOUBLE_EQ(*m.row.peak_gb, 0.7);
  EXPECT_EQ(run_model_json(m)["row"]["ranks"], 2);
}

TEST(Report, StoppedRunSaysHowToContinue) {
  TempDir dir("report_stop");
  const std::string text = line(config("backprop")) + line(epoch(1, 2.0, 50.0, 1.0)) +
                           line(event("stop", 150, 21.0, Json{{"reason", "max_steps"}, {"epoch", 1}}));
  const RunModel m = run_model_build(run_events_read(run_write(dir, "stopped", text)));
  ASSERT_EQ(m.problems.size(), 1u);
  EXPECT_NE(m.problems[0].find("the run stopped at step 150 (max_steps); continue it with `triaccel train --resume"),
            std::string::npos)
      << m.problems[0];
}

TEST(Report, NoFiguresWithoutSummaryOrEpochs) {
  TempDir dir("report_nofigures");
  const RunModel m = run_model_build(run_events_read(run_write(dir, "early", line(config("backprop")))));
  EXPECT_EQ(m.row.source, TableSource::kNone);
  EXPECT_FALSE(m.row.test_acc || m.row.epoch_s || m.row.peak_gb || m.row.eff_score);
  ASSERT_EQ(m.problems.size(), 1u);
  EXPECT_NE(m.problems[0].find("no summary or epoch event"), std::string::npos) << m.problems[0];
  EXPECT_TRUE(m.charts.empty());
}

TEST(Report, EffScoreNeedsPositiveTimeAndPeak) {
  TempDir dir("report_cpu");
  const std::string text = line(event("summary", 10, 3.0, Json{{"test_acc", 80.0}, {"epoch_s", 2.0},
                                                               {"peak_vram_gb", 0.0}}));  // a CPU run: no VRAM
  const RunModel m = run_model_build(run_events_read(run_write(dir, "cpu", text)));
  EXPECT_DOUBLE_EQ(m.row.peak_gb.value(), 0.0);
  EXPECT_FALSE(m.row.eff_score.has_value());
}

TEST(Report, DamagedLinesAreSkippedAndNamed) {
  TempDir dir("report_damaged");
  const std::string text = line(config("backprop")) + "{not json\n" + line(epoch(1, 2.0, 50.0, 1.0)) +
                           "[1, 2]\n" + "{\"step\": 3}\n" + "\n" + line(epoch(2, 2.0, 55.0, 1.0)) +
                           "{\"event\":\"epoch\",\"step\":3";  // cut off: no newline, not JSON
  const RunEvents r = run_events_read(run_write(dir, "damaged", text));
  EXPECT_EQ(r.events.size(), 3u);
  ASSERT_EQ(r.problems.size(), 3u);
  EXPECT_EQ(r.problems[0], r.file + ": line 2 is not valid JSON; skipped (was the file edited or written by two runs "
                                    "at once?)");
  EXPECT_EQ(r.problems[1], r.file + ": lines 4, 5 are not an event (a JSON object with a string \"event\"); skipped");
  EXPECT_EQ(r.problems[2], r.file + ": the last line (8) is cut off; ignored (the run was stopped while writing, or "
                                    "is still running)");
  // The rest of the run still counts: two epochs, no summary.
  const RunModel m = run_model_build(r);
  EXPECT_EQ(m.problems.size(), 4u);
  EXPECT_DOUBLE_EQ(m.row.test_acc.value(), 55.0);
  EXPECT_EQ(m.charts["epochs"]["epoch"], Json::array({1, 2}));
}

TEST(Report, ManyBadLinesAreCounted) {
  TempDir dir("report_manybad");
  std::string text;
  for (int i = 0; i < 8; ++i) text += "garbage\n";
  const RunEvents r = run_events_read(run_write(dir, "bad", text));
  ASSERT_EQ(r.problems.size(), 1u);
  EXPECT_NE(r.problems[0].find("lines 1, 2, 3, 4, 5 and 3 more are not valid JSON"), std::string::npos)
      << r.problems[0];
}

TEST(Report, MissingEmptyAndFolderWithoutEvents) {
  TempDir dir("report_missing");
  const RunEvents missing = run_events_read(dir.file("nope"));
  ASSERT_EQ(missing.problems.size(), 1u);
  EXPECT_EQ(missing.problems[0], dir.file("nope") + ": not found; give a run folder written by `triaccel train --out "
                                                    "DIR` (it holds events.jsonl) or an events.jsonl file");
  EXPECT_EQ(missing.name, "nope");

  const RunEvents empty = run_events_read(run_write(dir, "empty", "\n"));
  ASSERT_EQ(empty.problems.size(), 1u);
  EXPECT_EQ(empty.problems[0], empty.file + ": empty; the run wrote no events (did it start, or is it still loading "
                                            "data?)");

  std::filesystem::create_directories(dir.file("bare"));
  const RunEvents bare = run_events_read(dir.file("bare"));
  ASSERT_EQ(bare.problems.size(), 1u);
  EXPECT_NE(bare.problems[0].find("bare/events.jsonl: not found; is "), std::string::npos) << bare.problems[0];

  // A broken run still gets its (empty) row and no charts.
  const RunModel m = run_model_build(empty);
  EXPECT_EQ(m.problems.size(), 1u);
  EXPECT_EQ(m.row.source, TableSource::kNone);
}

TEST(Report, RunNames) {
  TempDir dir("report_names");
  const std::string a = run_write(dir, "alpha", line(config("backprop")));
  file_write_atomic(dir.file("beta.events.jsonl"), line(config("backprop")));
  std::vector<RunEvents> runs{run_events_read(a), run_events_read(a + "/"), run_events_read(a + "/events.jsonl"),
                              run_events_read(dir.file("beta.events.jsonl"))};
  run_names_make_unique(runs);
  EXPECT_EQ(runs[0].name, "alpha");
  EXPECT_EQ(runs[1].name, "alpha (2)");
  EXPECT_EQ(runs[2].name, "alpha (3)");
  EXPECT_EQ(runs[3].name, "beta");
}

TEST(Report, ChartSeries) {
  TempDir dir("report_series");
  const Json units = Json::array({"stem", "fc"});
  std::string text = line(config("tri-accel"));
  text += line(event("precision", 50, 1.0, Json{{"units", units}, {"precision", {"bf16", "bf16"}},
                                                 {"applied", {"fp32", "bf16"}}}));
  text += line(event("precision", 100, 2.0, Json{{"units", units}, {"applied", {"fp16", "bf16"}}}));
  text += line(event("curvature", 50, 1.0, Json{{"units", units}, {"probed", {"fc"}}, {"lambda_max", {nullptr, 40.0}}}));
  text += line(event("curvature", 250, 3.0, Json{{"units", units}, {"probed", {"stem"}}, {"lambda_max", {7.0, 30.0}}}));
  text += line(event("curvature", 450, 4.0, Json{{"units", units}, {"probed", {"fc"}}, {"lambda_max", {nullptr, 20.0}}}));
  text += line(event("batch", 50, 1.0, Json{{"batch", 128}, {"peak_gb", 0.5}, {"budget_gb", 1.0}}));
  text += line(event("batch", 100, 2.0, Json{{"batch", 96}, {"peak_gb", 0.9}, {"budget_gb", 1.0}}));
  text += line(event("batch", 150, 3.0, Json{{"batch", 112}, {"peak_gb", 0.7}, {"budget_gb", 1.0}}));
  // A plan under the event's current name, then one under the name runs wrote before it (both are read).
  text += line(event("optim_plan", 200, 3.5, Json{{"units", {{{"unit", "stem"}, {"format", "adamw-fp32"}, {"bytes", 800},
                                                              {"risk", 0.0}}}}}));
  text += line(event("plan", 400, 3.8, Json{{"units", {{{"unit", "stem"}, {"format", "adamw-8bit"}, {"bytes", 200},
                                                        {"risk", 0.01}}}},
                                            {"total_bytes", 200}, {"budget_bytes", 300}}));
  // Memory plans: one from before per-unit figures (not drawn), then two with them (the last is drawn).
  text += line(event("memory_plan", 0, 0.5, Json{{"reason", "start"}, {"micro_batch", 96}}));
  const auto mplan = [&](const char* reason, int64_t micro, bool stem_recomputed) {
    return event("memory_plan", 5, 0.7, Json{{"reason", reason}, {"micro_batch", micro}, {"accumulation", 96 / micro},
                                            {"data_placement", "host"}, {"predicted_peak_bytes", 400},
                                            {"units", {{{"unit", "stem"}, {"recompute", stem_recomputed},
                                                        {"activation_bytes", 30}},
                                                       {{"unit", "fc"}, {"recompute", false}, {"activation_bytes", 2}}}},
                                            {"consumers", {{"weights", 100}, {"data", "not a number"}}}});
  };
  text += line(mplan("start", 96, false));
  text += line(mplan("measured", 48, true));
  const RunModel m = run_model_build(run_events_read(run_write(dir, "series", text)));
  const Json& c = m.charts;
  EXPECT_EQ(c["memory_plan"]["plans"], 2);
  EXPECT_EQ(c["memory_plan"]["reason"], "measured");
  EXPECT_EQ(c["memory_plan"]["micro_batch"], 48);
  EXPECT_EQ(c["memory_plan"]["accumulation"], 2);
  EXPECT_EQ(c["memory_plan"]["units"][0]["recompute"], true);
  EXPECT_EQ(c["memory_plan"]["units"][1]["activation_bytes"], 2);
  EXPECT_EQ(c["memory_plan"]["consumers"], Json({{"weights", 100}}));  // non-numbers dropped
  EXPECT_TRUE(c["memory_plan"]["measured_peak_bytes"].is_null());
  EXPECT_EQ(c["precision"]["units"], units);
  EXPECT_EQ(c["precision"]["levels"], Json::parse(R"([["fp32","fp16"],["bf16","bf16"]])"));  // applied wins
  EXPECT_EQ(c["precision"]["time_s"], Json::array({1.0, 2.0}));
  EXPECT_EQ(c["curvature"]["lambda_max"], Json::array({7.0, 20.0}));  // each unit's last probe
  EXPECT_EQ(c["curvature"]["probes"], Json::array({1, 2}));
  EXPECT_EQ(c["memory"]["source"], "batch events");
  EXPECT_EQ(c["memory"]["batch"], Json::array({128, 96, 112}));
  EXPECT_EQ(c["memory"]["current_gb"], Json::array({0.5, 0.9, 0.7}));
  EXPECT_EQ(c["memory"]["peak_gb"], Json::array({0.5, 0.9, 0.9}));  // running maximum
  EXPECT_EQ(c["memory"]["budget_gb"], Json::array({1.0, 1.0, 1.0}));
  EXPECT_FALSE(c["memory"].contains("predicted_gb"));  // batch events predict nothing
  EXPECT_EQ(c["plan"]["plans"], 2);
  EXPECT_EQ(c["plan"]["units"][0]["format"], "adamw-8bit");  // the last plan
  EXPECT_EQ(c["plan"]["budget_bytes"], 300);
  EXPECT_FALSE(c.contains("epochs"));
  EXPECT_FALSE(c.contains("blocks"));
}

// Events that lack the fields a chart reads (a hand-edited or foreign file) give no chart and no crash: a missing key
// is read as null (nlohmann's const operator[] on it is undefined behaviour, an assertion in make test's build).
TEST(Report, EventsWithoutTheirFieldsDrawNothing) {
  TempDir dir("report_bare");
  std::string text = line(config("tri-accel"));
  for (const char* kind : {"precision", "curvature", "optim_plan", "memory_plan", "block", "exit", "stop"}) {
    text += line(event(kind, 10, 1.0, Json::object()));
  }
  const RunModel m = run_model_build(run_events_read(run_write(dir, "bare", text)));
  for (const char* chart : {"precision", "curvature", "plan", "memory_plan", "blocks", "exits"}) {
    EXPECT_FALSE(m.charts.contains(chart)) << chart;
  }
}

TEST(Report, NeuroFluxSeries) {
  TempDir dir("report_nf");
  std::string text = line(config("neuroflux"));
  // NeuroFlux's own plan (blocks, no per-unit formats) is not a BAOC plan, under its current name or the older one.
  text += line(event("block_plan", 0, 0.6, Json{{"method", "neuroflux"}, {"budget_gb", 0.008},
                                          {"units", {{{"unit", "conv1"}, {"params", 10}}}}}));
  text += line(event("block", 10, 2.0,
                     Json{{"block", 0}, {"final_batch", 64}, {"peak_vram_gb", 0.004}, {"predicted_gb", 0.0041},
                          {"local", {{{"unit", "conv1"}, {"train_acc", 60.0}, {"holdout_acc", 58.0}, {"test_acc", 57.0}},
                                     {{"unit", "conv2"}, {"train_acc", 70.0}, {"holdout_acc", 68.0}, {"test_acc", 66.0}}}}}));
  text += line(event("block", 20, 4.0,
                     Json{{"block", 1}, {"final_batch", 32}, {"peak_vram_gb", 0.006},
                          {"local", {{{"unit", "fc"}, {"train_acc", 80.0}, {"holdout_acc", 75.0}, {"test_acc", 74.0}}}}}));
  text += line(event("exit", 20, 5.0,
                     Json{{"exits", {{{"unit", "conv1"}, {"params", 100}, {"holdout_acc", 58.0}, {"test_acc", 57.0}},
                                     {{"unit", "conv2"}, {"params", 1000}, {"holdout_acc", 68.0}, {"test_acc", 66.0}},
                                     {{"unit", "fc"}, {"params", 5000}, {"holdout_acc", 75.0}, {"test_acc", 74.0}}}},
                          {"chosen", {{"unit", "conv2"}, {"index", 1}}}, {"tolerance", 10.0}, {"full_params", 5000}}));
  const RunModel m = run_model_build(run_events_read(run_write(dir, "nf", text)));
  const Json& c = m.charts;
  EXPECT_FALSE(c.contains("plan"));
  EXPECT_EQ(c["blocks"]["unit"], Json::array({"conv1", "conv2", "fc"}));
  EXPECT_EQ(c["blocks"]["block"], Json::array({0, 0, 1}));
  EXPECT_EQ(c["blocks"]["test_acc"], Json::array({57.0, 66.0, 74.0}));
  EXPECT_EQ(c["exits"]["params"], Json::array({100, 1000, 5000}));
  EXPECT_EQ(c["exits"]["chosen"], 1);
  EXPECT_EQ(c["memory"]["source"], "NeuroFlux block events");
  EXPECT_EQ(c["memory"]["batch"], Json::array({64, 32}));
  EXPECT_EQ(c["memory"]["budget_gb"], Json::array({0.008, 0.008}));  // from NeuroFlux's plan
  EXPECT_EQ(c["memory"]["predicted_gb"], Json::array({0.0041, nullptr}));  // each block's prediction (a run before it: none)
}

TEST(Report, CsvIsExact) {
  RunModel a;
  a.row = TableRow{"r18, seed 0", "tri-accel", "resnet18", "cifar10", "adaptive", 15, 88.88, 1.2759283217999993,
                   0.826020352, 84.33095538651754, TableSource::kSummary};
  RunModel b;
  b.row.run = "say \"hi\"";
  RunModel c;
  c.row = TableRow{"part", "backprop", "small-cnn", "fashion-mnist", "fp32", std::nullopt, 91.5, 12.0, 0.0,
                   std::nullopt, TableSource::kEpochEvents, 2};
  EXPECT_EQ(table_csv({a, b, c}),
            "run,method,model,dataset,precision,epochs,test_acc_pct,epoch_s,peak_vram_gb,eff_score,source,ranks\n"
            "\"r18, seed 0\",tri-accel,resnet18,cifar10,adaptive,15,88.88,1.27593,0.82602,84.331,summary,1\n"
            "\"say \"\"hi\"\"\",,,,,,,,,,none,1\n"
            "part,backprop,small-cnn,fashion-mnist,fp32,,91.5,12,0,,epoch events,2\n");
}

TEST(Report, WriteMakesPageAndCsvBesideIt) {
  TempDir dir("report_write");
  const std::string run = run_write(dir, "r<b>1", line(config("backprop")) + line(epoch(1, 2.0, 50.0, 1.0)) +
                                                            line(event("summary", 100, 10.0,
                                                                       Json{{"test_acc", 50.0}, {"epoch_s", 2.0},
                                                                            {"peak_vram_gb", 1.0}})));
  ReportOptions o;
  o.runs = {run, dir.file("missing")};
  o.html = dir.file("out.html");
  o.title = "A & B </script><runs>";
  const ReportResult r = report_write(o);
  EXPECT_EQ(r.csv_path, dir.file("out.csv"));
  EXPECT_EQ(file_read_all(r.csv_path), std::string(kTableCsvHeader) + "\nr<b>1,backprop,resnet18,cifar10,fp32,7,"
                                                                      "50,2,1,25,summary,1\nmissing,,,,,,,,,,none,1\n");
  const std::string page = file_read_all(r.html_path);
  EXPECT_NE(page.find("<title>A &amp; B &lt;/script&gt;&lt;runs&gt;</title>"), std::string::npos);
  // The title and the run name must not end the data <script> early: '<' is written as \u003c inside the JSON.
  EXPECT_EQ(page.find("</script><runs>"), std::string::npos);
  EXPECT_EQ(page.find("r<b>1"), std::string::npos);
  EXPECT_NE(page.find("\\u003c/script>\\u003cruns>"), std::string::npos);
  EXPECT_NE(page.find("r\\u003cb>1"), std::string::npos);
  EXPECT_NE(page.find("not found; give a run folder"), std::string::npos);
  EXPECT_NE(page.find("id=\"page-errors\""), std::string::npos);
  for (const char* external : {"src=\"http", "href=\"http", "@import", "url("}) {
    EXPECT_EQ(page.find(external), std::string::npos) << external;  // self-contained: nothing to fetch
  }
}

TEST(Report, BadOutputOrNoRunsIsAUserError) {
  TempDir dir("report_bad");
  ReportOptions o;
  o.html = dir.file("out.html");
  try {
    report_write(o);
    FAIL() << "no runs must be an error";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("report needs at least one RUN_DIR"), std::string::npos) << e.what();
  }
  o.runs = {dir.file("missing")};
  o.html = dir.file("no/such/folder/out.html");
  try {
    report_write(o);
    FAIL() << "an output in a missing folder must be an error";
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()), "cannot write " + dir.file("no/such/folder/out.csv") + ": folder " +
                                         dir.file("no/such/folder") + " does not exist; create it or choose another -o");
  }
  o.html = dir.file("same.html");
  o.csv = dir.file("same.html");
  EXPECT_THROW(report_write(o), UserError);
}

}  // namespace
}  // namespace triaccel
