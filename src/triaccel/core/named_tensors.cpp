#include "triaccel/core/named_tensors.h"

#include "triaccel/core/errors.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <map>

namespace triaccel {

void named_tensors_load(const NamedTensors& live, const NamedTensors& stored, const std::string& what,
                        const std::string& path) {
  std::map<std::string, at::Tensor> by_name(stored.begin(), stored.end());
  TRIACCEL_CHECK_INPUT(by_name.size() == live.size(), "checkpoint ", path, " holds ", by_name.size(), " ", what,
                       " tensors, this run has ", live.size(), " (a checkpoint of another model or configuration)");
  const c10::NoGradGuard no_grad;
  for (const auto& [name, t] : live) {
    const auto it = by_name.find(name);
    TRIACCEL_CHECK_INPUT(it != by_name.end(), "checkpoint ", path, " lacks ", what, " tensor '", name,
                         "' (a checkpoint of another model?)");
    TRIACCEL_CHECK_INPUT(it->second.sizes() == t.sizes() && it->second.scalar_type() == t.scalar_type(),
                         "checkpoint ", path, ": ", what, " tensor '", name, "' has shape ", it->second.sizes(),
                         " ", it->second.scalar_type(), ", this run expects ", t.sizes(), " ", t.scalar_type());
    t.copy_(it->second);
  }
}

}  // namespace triaccel
