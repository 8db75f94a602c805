#include "triaccel/train/optimizer.h"

#include "triaccel/train/checkpoint.h"

namespace triaccel {

void Optimizer::state_load(const NamedTensors& stored, const std::string& path) {
  named_tensors_load(state_tensors(), stored, "optimizer", path);
}

std::vector<at::Tensor> Optimizer::grads() const {
  std::vector<at::Tensor> out;
  out.reserve(params().size());
  for (const auto& p : params()) out.push_back(p.grad());
  return out;
}

}  // namespace triaccel
