// What the BackpropTrainer's files share (methods/backprop_trainer.cpp: set-up; backprop_trainer_step.cpp: the loop,
// the step with its recovery; backprop_trainer_eval.cpp: evaluation, checkpoints, the summary): the progress record a
// checkpoint stores, and the loss scaler's state by name. Internal to methods/backprop*.
#pragma once

#include "triaccel/core/json.h"
#include "triaccel/methods/backprop_trainer.h"
#include "triaccel/train/checkpoint.h"
#include "triaccel/train/loss_scaler.h"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <vector>

namespace triaccel {

struct BackpropTrainer::Progress {
  // The built-in controllers' state keys, each stored at the top of the progress record (as checkpoints always have
  // them); any other controller's state is stored under "controllers", by its key.
  static constexpr const char* kControllerKeys[] = {"tri_accel", "baoc", "memory_plan"};
  int64_t step = 0;          // optimizer steps done
  int64_t epoch = 0;         // current epoch (0-based)
  int64_t epoch_offset = 0;  // samples of the current epoch already trained
  double elapsed_s = 0;      // the run's time when the checkpoint was written
  double epoch_train_s = 0;  // training time spent in the current epoch so far
  std::vector<double> epoch_times;  // finished epochs' training seconds
  double peak_vram_gb = 0;
  int64_t batch = 0;         // the batch size in use (smaller than batch_size after an out-of-memory retry)
  Json last_epoch;           // the last epoch event's fields
  Json controllers;          // state_key → state (Tri-Accel's under "tri_accel", BAOC's under "baoc")
  double peak_vram_warmup_gb = -1;  // adamw/baoc: the peak up to step plan_warmup (then the peak restarts)
  // Faults (docs/reliability.md), over the whole run: out-of-memory retries, skipped (inf/NaN) attempts that were
  // retried, samples dropped after kSkipRetryLimit skips in a row, and faults injected by inject_faults.
  int64_t oom_retries = 0;
  int64_t skip_retries = 0;
  int64_t dropped_samples = 0;
  int64_t injected_faults = 0;

  Json fault_counters() const {
    return Json{{"oom_retries", oom_retries}, {"skip_retries", skip_retries}, {"dropped_samples", dropped_samples},
                {"injected_faults", injected_faults}};
  }
  Json to_json() const {
    Json j{{"step", step}, {"epoch", epoch}, {"epoch_offset", epoch_offset}, {"elapsed_s", elapsed_s},
           {"epoch_train_s", epoch_train_s}, {"epoch_times", epoch_times}, {"peak_vram_gb", peak_vram_gb},
           {"batch", batch}, {"last_epoch", last_epoch}};
    for (const char* key : kControllerKeys) j[key] = controllers.value(key, Json());
    Json others = Json::object();
    for (const auto& [key, state] : controllers.items()) {
      if (std::find(std::begin(kControllerKeys), std::end(kControllerKeys), key) == std::end(kControllerKeys)) {
        others[key] = state;
      }
    }
    if (!others.empty()) j["controllers"] = others;
    j["peak_vram_warmup_gb"] = peak_vram_warmup_gb;
    const Json faults = fault_counters();
    for (const auto& [k, v] : faults.items()) j[k] = v;
    return j;
  }
  static Progress from_json(const Json& j, const std::string& path) {
    Progress p;
    try {
      p.step = j.at("step").get<int64_t>();
      p.epoch = j.at("epoch").get<int64_t>();
      p.epoch_offset = j.at("epoch_offset").get<int64_t>();
      p.elapsed_s = j.at("elapsed_s").get<double>();
      p.epoch_train_s = j.at("epoch_train_s").get<double>();
      p.epoch_times = j.at("epoch_times").get<std::vector<double>>();
      p.peak_vram_gb = j.at("peak_vram_gb").get<double>();
      p.batch = j.value("batch", int64_t{0});
      p.last_epoch = j.at("last_epoch");
      p.controllers = Json::object();
      for (const char* key : kControllerKeys) {
        if (j.contains(key) && !j[key].is_null()) p.controllers[key] = j[key];
      }
      if (j.contains("controllers")) {
        for (const auto& [key, state] : j.at("controllers").items()) p.controllers[key] = state;
      }
      p.peak_vram_warmup_gb = j.value("peak_vram_warmup_gb", -1.0);
      p.oom_retries = j.value("oom_retries", int64_t{0});  // absent in checkpoints before fault counters
      p.skip_retries = j.value("skip_retries", int64_t{0});
      p.dropped_samples = j.value("dropped_samples", int64_t{0});
      p.injected_faults = j.value("injected_faults", int64_t{0});
    } catch (const Json::exception&) {
      throw UserError("checkpoint " + path + " has an unreadable progress record");
    }
    return p;
  }
};

inline NamedTensors scaler_state(const LossScaler& s) {
  return {{"scale", s.scale_tensor()}, {"growth_tracker", s.growth_tracker()}, {"skipped", s.skipped_steps()}};
}

// A checkpoint's scaler group holds the loss scaler's tensors and amp-fp8's delayed scales ("fp8.*", TrainStep's
// fp8_state): those of the one (fp8 true) or of the other.
inline NamedTensors fp8_entries(const NamedTensors& scaler, bool fp8) {
  NamedTensors out;
  for (const auto& entry : scaler) {
    if ((entry.first.rfind("fp8.", 0) == 0) == fp8) out.push_back(entry);
  }
  return out;
}

}  // namespace triaccel
