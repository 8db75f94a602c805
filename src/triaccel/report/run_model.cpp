#include "triaccel/report/run_model.h"

#include "triaccel/core/events.h"

#include <algorithm>
#include <map>

namespace triaccel {
namespace {

constexpr size_t kEpochsInMean = 5;  // docs/measuring.md: epoch_s is the mean of the last 5 epochs (or of all if fewer)

std::optional<double> number(const Json& j, const char* key) {
  if (!j.is_object() || !j.contains(key) || !j[key].is_number()) return std::nullopt;
  return j[key].get<double>();
}

std::string text(const Json& j, const char* key) {
  if (!j.is_object() || !j.contains(key) || !j[key].is_string()) return "";
  return j[key].get<std::string>();
}

// j[key] for reading: null when j is not an object or has no such key (nlohmann's const operator[] on a missing key
// is undefined behaviour, an assertion in make test's build; an events file is the user's and may lack anything).
const Json& field(const Json& j, const char* key) {
  static const Json kNull;
  return j.is_object() && j.contains(key) ? j[key] : kNull;
}

Json value_or_null(const Json& j, const char* key) {
  const Json& v = field(j, key);
  return v.is_number() || v.is_string() ? v : Json(nullptr);
}

Json optional_json(const std::optional<double>& v) { return v ? Json(*v) : Json(nullptr); }

std::vector<const Json*> of_kind(const std::vector<Json>& events, const char* kind,
                                 const char* legacy_kind = nullptr) {
  std::vector<const Json*> out;
  for (const auto& e : events) {
    if (field(e, "event") == kind || (legacy_kind != nullptr && field(e, "event") == legacy_kind)) out.push_back(&e);
  }
  return out;
}

std::vector<std::string> strings(const Json& j) {
  std::vector<std::string> out;
  if (!j.is_array()) return out;
  for (const auto& v : j) out.push_back(v.is_string() ? v.get<std::string>() : v.dump());
  return out;
}

void table_row_fill(const RunModel& model, const std::vector<Json>& events, TableRow& row,
                    std::vector<std::string>& problems) {
  row.run = model.name;
  for (const auto* c : of_kind(events, event::kConfig)) {
    const Json& o = c->contains("options") ? (*c)["options"] : *c;
    row.method = text(o, "method");
    row.model = text(o, "model");
    row.dataset = text(o, "dataset");
    row.precision = text(o, "precision");
    if (row.method == "tri-accel") row.precision = "adaptive";  // as its summary says (methods/backprop_trainer.cpp)
    if (auto e = number(o, "epochs")) row.epochs = static_cast<int64_t>(*e);
  }
  const auto summaries = of_kind(events, event::kSummary);
  const auto epochs = of_kind(events, event::kEpoch);
  if (!summaries.empty()) {
    const Json& s = *summaries.back();
    row.source = TableSource::kSummary;
    if (!text(s, "method").empty()) row.method = text(s, "method");
    if (!text(s, "model").empty()) row.model = text(s, "model");
    if (!text(s, "dataset").empty()) row.dataset = text(s, "dataset");
    if (!text(s, "precision").empty()) row.precision = text(s, "precision");
    if (auto e = number(s, "epochs")) row.epochs = static_cast<int64_t>(*e);
    row.test_acc = number(s, "test_acc");
    row.epoch_s = number(s, "epoch_s");
    row.peak_gb = number(s, "peak_vram_gb");
  } else if (!epochs.empty()) {
    row.source = TableSource::kEpochEvents;
    row.test_acc = number(*epochs.back(), "test_acc");
    double sum = 0;
    size_t n = 0;
    for (size_t i = epochs.size() - std::min(epochs.size(), kEpochsInMean); i < epochs.size(); ++i) {
      if (auto s = number(*epochs[i], "epoch_s")) {
        sum += *s;
        ++n;
      }
    }
    if (n > 0) row.epoch_s = sum / static_cast<double>(n);
    for (const auto* e : epochs) {
      if (auto p = number(*e, "peak_vram_gb")) row.peak_gb = std::max(row.peak_gb.value_or(*p), *p);
    }
  }
  // Data parallel: the ranks, and the largest rank's peak.
  for (const auto* kinds : {&summaries, &epochs}) {
    if (!kinds->empty()) {
      if (auto w = number(*kinds->back(), "world_size")) {
        row.ranks = std::max<int64_t>(row.ranks, static_cast<int64_t>(*w));
      }
    }
  }
  for (const auto* e : epochs) {
    const Json peaks = field(*e, "rank_peak_vram_gb");
    if (!peaks.is_array()) continue;
    for (const auto& p : peaks) {
      if (p.is_number()) row.peak_gb = std::max(row.peak_gb.value_or(p.get<double>()), p.get<double>());
    }
  }
  if (row.test_acc && row.epoch_s && row.peak_gb && *row.epoch_s > 0 && *row.peak_gb > 0) {
    row.eff_score = *row.test_acc / (*row.epoch_s * *row.peak_gb);
  }
  if (events.empty()) return;  // the reader already said why
  const auto stops = of_kind(events, event::kStop);
  const std::string why = !stops.empty()
                              ? "the run stopped at step " + field(*stops.back(), "step").dump() + " (" +
                                    text(*stops.back(), "reason") + "); continue it with `triaccel train --resume RUN_DIR`"
                              : "the run did not finish (it was stopped, crashed or is still running)";
  if (row.source == TableSource::kEpochEvents) {
    problems.push_back(model.file + ": no summary event: " + why + "; its table row comes from its " +
                       std::to_string(epochs.size()) + " epoch event" + (epochs.size() == 1 ? "" : "s"));
  } else if (row.source == TableSource::kNone) {
    problems.push_back(model.file + ": no summary or epoch event: " + why + "; it has no figures for the table");
  }
}

void epochs_fill(const std::vector<Json>& events, Json& charts) {
  const auto epochs = of_kind(events, event::kEpoch);
  if (epochs.empty()) return;
  Json c = Json::object();
  for (const char* key : {"epoch", "time_s", "train_loss", "test_loss", "train_acc", "test_acc"}) {
    Json a = Json::array();
    for (const auto* e : epochs) a.push_back(value_or_null(*e, key));
    c[key] = a;
  }
  charts["epochs"] = c;
}

void memory_fill(const std::vector<Json>& events, Json& charts) {
  struct Source {
    const char* kind;
    const char* label;
    const char* batch_key;
    const char* current_key;
    const char* predicted_key;  // the peak the run predicted for the interval (nullptr: none)
  };
  const Source sources[] = {{event::kBatch, "batch events", "batch", "peak_gb", nullptr},
                            {event::kEpoch, "epoch events", "batch", "peak_vram_gb", nullptr},
                            {event::kBlock, "NeuroFlux block events", "final_batch", "peak_vram_gb", "predicted_gb"}};
  std::optional<double> plan_budget;
  for (const auto* p : of_kind(events, event::kBlockPlan, event::kLegacyPlan)) {
    if (auto b = number(*p, "budget_gb")) plan_budget = b;
  }
  for (const auto& src : sources) {
    const auto list = of_kind(events, src.kind);
    if (list.empty()) continue;
    Json time_s = Json::array(), batch = Json::array(), current = Json::array(), peak = Json::array(),
         budget = Json::array(), predicted = Json::array();
    bool any_predicted = false;
    std::optional<double> running;
    for (const auto* e : list) {
      time_s.push_back(value_or_null(*e, "time_s"));
      batch.push_back(value_or_null(*e, src.batch_key));
      const auto cur = number(*e, src.current_key);
      current.push_back(optional_json(cur));
      if (cur) running = std::max(running.value_or(*cur), *cur);
      peak.push_back(optional_json(running));
      auto b = number(*e, "budget_gb");
      budget.push_back(optional_json(b ? b : plan_budget));
      const auto p = src.predicted_key ? number(*e, src.predicted_key) : std::nullopt;
      any_predicted = any_predicted || p.has_value();
      predicted.push_back(optional_json(p));
    }
    charts["memory"] = Json{{"source", src.label}, {"time_s", time_s}, {"batch", batch}, {"current_gb", current},
                            {"peak_gb", peak}, {"budget_gb", budget}};
    if (any_predicted) charts["memory"]["predicted_gb"] = predicted;
    return;
  }
}

// Units in first-seen order over all events of a kind, so that a unit list that changes mid-run still lines up.
std::vector<std::string> units_union(const std::vector<const Json*>& list) {
  std::vector<std::string> units;
  for (const auto* e : list) {
    for (const auto& u : strings(field(*e, "units"))) {
      if (std::find(units.begin(), units.end(), u) == units.end()) units.push_back(u);
    }
  }
  return units;
}

size_t index_of(const std::vector<std::string>& v, const std::string& s) {
  return static_cast<size_t>(std::find(v.begin(), v.end(), s) - v.begin());
}

void precision_fill(const std::vector<Json>& events, Json& charts) {
  const auto list = of_kind(events, event::kPrecision);
  const auto units = units_union(list);
  if (list.empty() || units.empty()) return;
  Json time_s = Json::array(), step = Json::array();
  std::vector<Json> levels(units.size(), Json::array());
  for (const auto* e : list) {
    time_s.push_back(value_or_null(*e, "time_s"));
    step.push_back(value_or_null(*e, "step"));
    const auto names = strings(field(*e, "units"));
    const Json& p = e->contains("applied") ? field(*e, "applied") : field(*e, "precision");
    for (auto& l : levels) l.push_back(nullptr);
    for (size_t i = 0; i < names.size(); ++i) {
      if (p.is_array() && i < p.size() && p[i].is_string()) levels[index_of(units, names[i])].back() = p[i];
    }
  }
  Json lv = Json::array();
  for (auto& l : levels) lv.push_back(std::move(l));
  charts["precision"] = Json{{"units", units}, {"time_s", time_s}, {"step", step}, {"levels", lv}};
}

void curvature_fill(const std::vector<Json>& events, Json& charts) {
  const auto list = of_kind(events, event::kCurvature);
  const auto units = units_union(list);
  if (list.empty() || units.empty()) return;
  std::vector<std::optional<double>> last(units.size());
  std::vector<int64_t> probes(units.size(), 0);
  for (const auto* e : list) {
    const auto names = strings(field(*e, "units"));
    const Json& lm = field(*e, "lambda_max");
    for (const auto& p : strings(field(*e, "probed"))) {
      const size_t u = index_of(units, p);
      if (u < units.size()) ++probes[u];
    }
    for (size_t i = 0; i < names.size() && lm.is_array() && i < lm.size(); ++i) {
      if (lm[i].is_number()) last[index_of(units, names[i])] = lm[i].get<double>();
    }
  }
  if (std::none_of(last.begin(), last.end(), [](const auto& v) { return v.has_value(); })) return;
  Json lambda = Json::array();
  for (const auto& v : last) lambda.push_back(optional_json(v));
  charts["curvature"] = Json{{"units", units}, {"lambda_max", lambda}, {"probes", probes}};
}

void plan_fill(const std::vector<Json>& events, Json& charts) {
  const Json* last = nullptr;
  int64_t plans = 0;
  for (const auto* p : of_kind(events, event::kOptimPlan, event::kLegacyPlan)) {
    const Json& u = field(*p, "units");
    if (!u.is_array() || u.empty() || !u[0].is_object() || !u[0].contains("format")) continue;  // not a BAOC plan
    last = p;
    ++plans;
  }
  if (last == nullptr) return;
  Json units = Json::array();
  for (const auto& u : field(*last, "units")) {
    units.push_back(Json{{"unit", value_or_null(u, "unit")}, {"format", value_or_null(u, "format")},
                         {"params", value_or_null(u, "params")}, {"bytes", value_or_null(u, "bytes")},
                         {"risk", value_or_null(u, "risk")}});
  }
  charts["plan"] = Json{{"step", value_or_null(*last, "step")}, {"plans", plans}, {"units", units},
                        {"total_bytes", value_or_null(*last, "total_bytes")},
                        {"budget_bytes", value_or_null(*last, "budget_bytes")},
                        {"adamw_fp32_bytes", value_or_null(*last, "adamw_fp32_bytes")},
                        {"total_risk", value_or_null(*last, "total_risk")}};
}

// The memory planner's last plan with per-unit figures (runs before them logged none): each unit's activations at
// the micro-batch and whether it is recomputed, the other consumers, the levers, predicted and measured peaks.
void memory_plan_fill(const std::vector<Json>& events, Json& charts) {
  const Json* last = nullptr;
  int64_t plans = 0;
  for (const auto* p : of_kind(events, event::kMemoryPlan)) {
    const Json& units = field(*p, "units");
    if (!units.is_array() || units.empty()) continue;  // runs from before per-unit figures
    last = p;
    ++plans;
  }
  if (last == nullptr) return;
  const Json& e = *last;
  Json units = Json::array();
  for (const auto& u : field(e, "units")) {
    const Json& recompute = field(u, "recompute");
    units.push_back(Json{{"unit", value_or_null(u, "unit")},
                         {"recompute", recompute.is_boolean() && recompute.get<bool>()},
                         {"activation_bytes", value_or_null(u, "activation_bytes")}});
  }
  Json consumers = Json::object();
  for (const auto& [k, v] : field(e, "consumers").items()) {
    if (v.is_number()) consumers[k] = v;
  }
  Json c{{"plans", plans}, {"units", units}, {"consumers", consumers}};
  for (const char* key : {"step", "reason", "micro_batch", "accumulation", "data_placement", "predicted_peak_bytes",
                          "measured_peak_bytes", "budget_bytes", "plan_limit_bytes"}) {
    c[key] = value_or_null(e, key);
  }
  charts["memory_plan"] = c;
}

void neuroflux_fill(const std::vector<Json>& events, Json& charts) {
  Json unit = Json::array(), block = Json::array(), train = Json::array(), hold = Json::array(), test = Json::array();
  for (const auto* b : of_kind(events, event::kBlock)) {
    if (!field(*b, "local").is_array()) continue;
    for (const auto& u : field(*b, "local")) {
      unit.push_back(value_or_null(u, "unit"));
      block.push_back(value_or_null(*b, "block"));
      train.push_back(value_or_null(u, "train_acc"));
      hold.push_back(value_or_null(u, "holdout_acc"));
      test.push_back(value_or_null(u, "test_acc"));
    }
  }
  if (!unit.empty()) {
    charts["blocks"] = Json{{"unit", unit}, {"block", block}, {"train_acc", train}, {"holdout_acc", hold},
                            {"test_acc", test}};
  }
  const auto exits = of_kind(events, event::kExit);
  if (exits.empty() || !field(*exits.back(), "exits").is_array() || field(*exits.back(), "exits").empty()) return;
  const Json& e = *exits.back();
  Json c{{"unit", Json::array()}, {"params", Json::array()}, {"holdout_acc", Json::array()}, {"test_acc", Json::array()}};
  for (const auto& x : field(e, "exits")) {
    for (const char* key : {"unit", "params", "holdout_acc", "test_acc"}) c[key].push_back(value_or_null(x, key));
  }
  c["chosen"] = value_or_null(field(e, "chosen"), "index");
  c["tolerance"] = value_or_null(e, "tolerance");
  c["full_params"] = value_or_null(e, "full_params");
  charts["exits"] = c;
}

}  // namespace

const char* table_source_name(TableSource s) {
  switch (s) {
    case TableSource::kSummary: return "summary";
    case TableSource::kEpochEvents: return "epoch events";
    case TableSource::kNone: return "none";
  }
  return "none";
}

RunModel run_model_build(const RunEvents& run) {
  RunModel m;
  m.name = run.name;
  m.file = run.file;
  m.problems = run.problems;
  table_row_fill(m, run.events, m.row, m.problems);
  epochs_fill(run.events, m.charts);
  memory_fill(run.events, m.charts);
  precision_fill(run.events, m.charts);
  curvature_fill(run.events, m.charts);
  plan_fill(run.events, m.charts);
  memory_plan_fill(run.events, m.charts);
  neuroflux_fill(run.events, m.charts);
  return m;
}

Json run_model_json(const RunModel& m) {
  const TableRow& r = m.row;
  Json row{{"run", r.run},
           {"method", r.method},
           {"model", r.model},
           {"dataset", r.dataset},
           {"precision", r.precision},
           {"epochs", r.epochs ? Json(*r.epochs) : Json(nullptr)},
           {"test_acc", optional_json(r.test_acc)},
           {"epoch_s", optional_json(r.epoch_s)},
           {"peak_gb", optional_json(r.peak_gb)},
           {"eff_score", optional_json(r.eff_score)},
           {"source", table_source_name(r.source)},
           {"ranks", r.ranks}};
  return Json{{"name", m.name}, {"file", m.file}, {"problems", m.problems}, {"row", row}, {"charts", m.charts}};
}

}  // namespace triaccel
