#include "triaccel/control/optimizer_state/format_plan.h"

#include "triaccel/core/bytes.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

namespace triaccel {
namespace {

int64_t unit_bytes(StateFormat f, const FormatPlanUnit& u) {
  int64_t b = 0;
  for (const auto& s : u.shapes) b += state_format_bytes(f, s);
  return b;
}

int64_t unit_params(const FormatPlanUnit& u) {
  int64_t n = 0;
  for (const auto& s : u.shapes) {
    int64_t k = 1;
    for (int64_t d : s) k *= d;
    n += k;
  }
  return n;
}

}  // namespace

StepTimeModel::StepTimeModel() {
  for (StateFormat f : state_formats_all()) seconds_per_element.push_back(state_format_bytes_moved(f) / kModelBandwidth);
}

double StepTimeModel::seconds(StateFormat f, int64_t elements) const {
  return seconds_per_element[static_cast<size_t>(f)] * static_cast<double>(elements);
}

StepTimeModel step_time_model_from_bench(const std::string& path) {
  TRIACCEL_CHECK_INPUT(file_exists(path), option_ref("optim_time_table") + " ", path, ": no such file (write it with bench_optim_step --out)");
  Json j;
  try {
    j = Json::parse(file_read_all(path));
  } catch (const Json::exception&) {
    throw UserError(option_ref("optim_time_table") + " " + path + " is not JSON (a bench_optim_step result)");
  }
  TRIACCEL_CHECK_INPUT(j.value("bench", "") == "optim_step" && j.contains("params") && j.contains("rows"),
                       option_ref("optim_time_table") + " ", path, " is not a bench_optim_step result");
  const double params = j["params"].get<double>();
  TRIACCEL_CHECK_INPUT(params > 0, option_ref("optim_time_table") + " ", path, " has no parameter count");
  StepTimeModel model;
  model.source = path;
  for (StateFormat f : state_formats_all()) {
    bool found = false;
    for (const auto& row : j["rows"]) {
      if (row.value("format", "") == state_format_name(f) && row.contains("graph")) {
        model.seconds_per_element[static_cast<size_t>(f)] = row["graph"].at("median_ms").get<double>() * 1e-3 / params;
        found = true;
      }
    }
    TRIACCEL_CHECK_INPUT(found, option_ref("optim_time_table") + " ", path, " has no time for format ", state_format_name(f));
  }
  return model;
}

int64_t optim_memory_budget_parse(const std::string& text, int64_t adamw_fp32_bytes) {
  TRIACCEL_CHECK_INPUT(!text.empty(), option_ref("optim_memory_budget") + " needs a value like 15% or 200MB");
  if (text.back() == '%') {
    char* end = nullptr;
    const std::string number = text.substr(0, text.size() - 1);
    const double pct = std::strtod(number.c_str(), &end);
    TRIACCEL_CHECK_INPUT(!number.empty() && end == number.c_str() + number.size() && pct >= 0 && pct <= 100,
                         option_ref("optim_memory_budget") + " must be a percentage in [0, 100] like 15% or a size like 200MB, got '",
                         text, "'");
    return static_cast<int64_t>(std::floor(pct / 100.0 * static_cast<double>(adamw_fp32_bytes)));
  }
  return bytes_parse(text, "optim_memory_budget");
}

double optim_time_budget_parse(const std::string& text, double adamw_fp32_seconds) {
  if (text.empty() || text == "none") return -1;
  char* end = nullptr;
  const std::string number = text.back() == 'x' ? text.substr(0, text.size() - 1) : std::string();
  const double factor = std::strtod(number.c_str(), &end);
  TRIACCEL_CHECK_INPUT(!number.empty() && end == number.c_str() + number.size() && factor > 0 && std::isfinite(factor),
                       option_ref("optim_time_budget") + " must be none or a multiple of fp32 AdamW's step time like 1.1x, got '",
                       text, "'");
  return factor * adamw_fp32_seconds;
}

std::vector<StateFormat> format_plan_unit_menu(const FormatPlanUnit& unit, const std::vector<StateFormat>& menu) {
  if (!unit.lookup) return menu;
  std::vector<StateFormat> kept;
  for (StateFormat f : menu) {
    if (state_format_per_element_adamw(f)) kept.push_back(f);
  }
  return kept.empty() ? menu : kept;
}

FormatPlan format_plan_solve(const std::vector<FormatPlanUnit>& units, const std::vector<UnitSignals>& signals,
                const FormatPlanOptions& o) {
  TORCH_CHECK(signals.size() == units.size(), "format_plan_solve: ", signals.size(), " signals for ", units.size(),
              " units");
  TRIACCEL_CHECK_INPUT(!o.formats.empty(), option_ref("optim_formats") + " must name at least one format");
  FormatPlan plan;
  int64_t total_params = 0;
  for (const auto& u : units) {
    plan.adamw_fp32_bytes += unit_bytes(StateFormat::kAdamW32, u);
    plan.adamw_fp32_time_s += o.time_model.seconds(StateFormat::kAdamW32, unit_params(u));
    total_params += unit_params(u);
  }
  plan.budget_bytes = optim_memory_budget_parse(o.memory_budget, plan.adamw_fp32_bytes);
  plan.budget_time_s = optim_time_budget_parse(o.time_budget, plan.adamw_fp32_time_s);
  AllocationProblem problem;
  problem.memory_budget = plan.budget_bytes;
  problem.time_budget = plan.budget_time_s;
  std::vector<std::vector<StateFormat>> menus;
  for (size_t u = 0; u < units.size(); ++u) {
    menus.push_back(format_plan_unit_menu(units[u], o.formats));
    std::vector<AllocationOption> options;
    for (StateFormat f : menus.back()) {
      UnitSignals s = signals[u];
      s.params = unit_params(units[u]);
      options.push_back({risk_weighted(f, s, total_params, static_cast<int64_t>(units.size()), o.risk),
                         unit_bytes(f, units[u]),
                         o.time_model.seconds(f, s.params)});
    }
    problem.units.push_back(std::move(options));
  }
  const AllocationResult r = allocation_solve(problem);
  const double pct = 100.0 / static_cast<double>(std::max<int64_t>(plan.adamw_fp32_bytes, 1));
  TRIACCEL_CHECK_INPUT(r.min_bytes <= plan.budget_bytes, option_ref("optim_memory_budget") + " ", o.memory_budget, " (",
                       plan.budget_bytes, " bytes) is below the cheapest plan with these formats: raise it to at least ",
                       r.min_bytes, " bytes (", r.min_bytes * pct, "% of fp32 AdamW's ", plan.adamw_fp32_bytes,
                       " bytes) or allow cheaper " + option_ref("optim_formats"));
  TRIACCEL_CHECK_INPUT(plan.budget_time_s < 0 || r.min_time <= plan.budget_time_s, option_ref("optim_time_budget") + " ",
                       o.time_budget, " is below the fastest plan (", r.min_time / plan.adamw_fp32_time_s,
                       "x of fp32 AdamW's step time): raise it or use none");
  TRIACCEL_CHECK_INPUT(r.feasible, "no plan fits " + option_ref("optim_memory_budget") + " ", o.memory_budget, " and " + option_ref("optim_time_budget") + " ",
                       o.time_budget, " together: raise one of them");
  for (size_t u = 0; u < units.size(); ++u) {
    const StateFormat f = menus[u][static_cast<size_t>(r.choice[u])];
    const AllocationOption& opt = problem.units[u][static_cast<size_t>(r.choice[u])];
    UnitFormatPlan up;
    up.name = units[u].name;
    up.lookup = units[u].lookup;
    up.format = f;
    up.params = unit_params(units[u]);
    up.bytes = opt.bytes;
    up.risk = opt.risk;
    up.time_s = opt.time;
    up.signals = signals[u];
    up.signals.params = up.params;
    plan.units.push_back(up);
  }
  plan.time_source = o.time_model.source;
  plan.bytes = r.bytes;
  plan.risk = r.risk;
  plan.time_s = r.time;
  return plan;
}

Json format_plan_to_json(const FormatPlan& plan) {
  Json units = Json::array();
  for (const auto& u : plan.units) {
    const UnitSignals& s = u.signals;
    units.push_back(Json{{"unit", u.name},
                         {"format", state_format_name(u.format)},
                         {"lookup", u.lookup},
                         {"params", u.params},
                         {"bytes", u.bytes},
                         {"risk", u.risk},
                         {"signals", Json{{"cos_successive", s.cos_successive},
                                          {"cos_momentum", s.cos_momentum},
                                          {"snr", s.snr},
                                          {"log_v_spread", s.log_v_spread},
                                          {"precond_error", s.precond_error},
                                          {"factor_error", s.factor_error},
                                          {"quant_error_bf16", s.quant_error_bf16},
                                          {"quant_error_8bit", s.quant_error_8bit}}}});
  }
  const double fp32 = static_cast<double>(std::max<int64_t>(plan.adamw_fp32_bytes, 1));
  return Json{{"units", units},
              {"total_bytes", plan.bytes},
              {"total_risk", plan.risk},
              {"budget_bytes", plan.budget_bytes},
              {"adamw_fp32_bytes", plan.adamw_fp32_bytes},
              {"fraction_of_adamw_fp32", static_cast<double>(plan.bytes) / fp32},
              {"model_time_s", plan.time_s},
              {"time_model", plan.time_source},
              {"adamw_fp32_model_time_s", plan.adamw_fp32_time_s},
              {"budget_time_s", plan.budget_time_s < 0 ? Json(nullptr) : Json(plan.budget_time_s)}};
}

}  // namespace triaccel
