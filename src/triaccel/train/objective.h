// What a training step minimizes and what evaluation counts, for every model: by default cross-entropy over the
// last dimension of the output against integer targets (with label smoothing in training) and the share of argmax
// predictions equal to the target; a program (the Python module's loss= and metric=) may give its own.
// Shapes: output (B, ...) as the model returns it, target (B, ...) as the dataset holds it.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <functional>

namespace triaccel {

struct Objective {
  // The batch's mean loss: a scalar tensor (float32 or castable), differentiable in `output`.
  std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)> loss;
  // The batch's mean of the metric (accuracy: a share in [0, 1]) as a scalar tensor; empty: no metric.
  std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)> metric;
};

// One batch's terms: the mean loss, and the metric as a sum with the count it sums over (predictions of a classifier
// or a language model's tokens; samples for a program's metric). `label_smoothing` applies to the default loss only.
struct ObjectiveTerms {
  at::Tensor loss;     // scalar, float32
  at::Tensor metric;   // scalar, float32: the metric summed over `counted`
  int64_t counted = 0;
};
ObjectiveTerms objective_terms(const Objective* objective, const at::Tensor& output, const at::Tensor& target,
                               double label_smoothing);

}  // namespace triaccel
