#include "triaccel/train/faults.h"

#include "triaccel/core/errors.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

namespace triaccel {
namespace {

constexpr FaultKind kFaultKinds[] = {FaultKind::kOom, FaultKind::kNanGrad, FaultKind::kInfGrad, FaultKind::kNanLoss};

FaultKind fault_kind_parse(const std::string& name, const std::string& item) {
  for (const FaultKind k : kFaultKinds) {
    if (name == fault_kind_name(k)) return k;
  }
  throw UserError(option_ref("inject_faults") + ": unknown fault '" + name + "' in '" + item +
                  "'; use oom, nan-grad, inf-grad or nan-loss");
}

int64_t int_parse(const std::string& text, const std::string& item, int64_t min) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  TRIACCEL_CHECK_INPUT(!text.empty() && end == text.c_str() + text.size() && errno == 0 && v >= min,
                       option_ref("inject_faults") + ": '", item, "' needs an integer >= ", min, ", got '", text, "'");
  return v;
}

double probability_parse(const std::string& text, const std::string& item) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  TRIACCEL_CHECK_INPUT(!text.empty() && end == text.c_str() + text.size() && std::isfinite(v) && v >= 0 && v <= 1,
                       option_ref("inject_faults") + ": '", item, "' needs a probability in [0, 1], got '", text, "'");
  return v;
}

// splitmix64: a well-mixed 64-bit hash; its top 53 bits as a uniform number in [0, 1).
double unit_hash(uint64_t seed, uint64_t step, uint64_t kind) {
  uint64_t z = seed ^ (step * 0x9e3779b97f4a7c15ULL) ^ (kind * 0xd1b54a32d192ed03ULL);
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) out.push_back(item);
  if (!s.empty() && s.back() == sep) out.emplace_back();
  return out;
}

}  // namespace

const char* fault_kind_name(FaultKind kind) {
  switch (kind) {
    case FaultKind::kNone: return "none";
    case FaultKind::kOom: return "oom";
    case FaultKind::kNanGrad: return "nan-grad";
    case FaultKind::kInfGrad: return "inf-grad";
    case FaultKind::kNanLoss: return "nan-loss";
  }
  return "?";
}

FaultPlan::FaultPlan(const std::string& spec) {
  if (spec.empty()) return;
  const std::string kRandom = "random:";
  bool seeded = false;
  for (std::string item : split(spec, ',')) {
    if (item.rfind(kRandom, 0) == 0) {
      random_ = true;
      item = item.substr(kRandom.size());
    }
    if (item.find('@') == std::string::npos) {  // KEY=VALUE of the random plan
      const auto eq = item.find('=');
      TRIACCEL_CHECK_INPUT(random_ && eq != std::string::npos, option_ref("inject_faults") + ": '", item,
                           "' is not KIND@STEP[xN] (e.g. oom@5, nan-loss@20x3) or, after random:, KEY=VALUE "
                           "(random:seed=S,oom=P,nan-grad=P,inf-grad=P,nan-loss=P,burst=N)");
      const std::string key = item.substr(0, eq);
      const std::string value = item.substr(eq + 1);
      if (key == "seed") {
        seed_ = static_cast<uint64_t>(int_parse(value, item, 0));
        seeded = true;
      } else if (key == "burst") {
        burst_ = int_parse(value, item, 1);
      } else {
        p_[static_cast<int>(fault_kind_parse(key, item))] = probability_parse(value, item);
      }
      continue;
    }
    const auto at = item.find('@');
    TRIACCEL_CHECK_INPUT(at > 0, option_ref("inject_faults") + ": '", item, "' is not KIND@STEP[xN] (e.g. oom@5, nan-loss@20x3)");
    FaultEvent e;
    e.kind = fault_kind_parse(item.substr(0, at), item);
    std::string rest = item.substr(at + 1);
    const auto x = rest.find('x');
    if (x != std::string::npos) {
      e.count = int_parse(rest.substr(x + 1), item, 1);
      rest = rest.substr(0, x);
    }
    e.step = int_parse(rest, item, 0);
    for (const FaultEvent& other : explicit_) {
      TRIACCEL_CHECK_INPUT(other.step != e.step, option_ref("inject_faults") + ": two faults at step ", e.step,
                           "; use xN for a burst at one step");
    }
    explicit_.push_back(e);
  }
  TRIACCEL_CHECK_INPUT(!random_ || seeded, option_ref("inject_faults") + ": random mode needs seed=S, got '", spec, "'");
}

FaultKind FaultPlan::fault_at(int64_t step, int64_t attempt) const {
  for (const FaultEvent& e : explicit_) {  // an explicit fault owns its step, in a mixed plan too
    if (e.step == step) return attempt < e.count ? e.kind : FaultKind::kNone;
  }
  if (!random_) return FaultKind::kNone;
  for (const FaultKind k : kFaultKinds) {
    const double p = p_[static_cast<int>(k)];
    if (p <= 0 || unit_hash(seed_, static_cast<uint64_t>(step), static_cast<uint64_t>(k)) >= p) continue;
    const int64_t span = k == FaultKind::kNanLoss ? burst_ : 1;
    return attempt < span ? k : FaultKind::kNone;
  }
  return FaultKind::kNone;
}

}  // namespace triaccel
