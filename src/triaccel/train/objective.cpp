#include "triaccel/train/objective.h"

#include "triaccel/core/errors.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

namespace triaccel {

ObjectiveTerms objective_terms(const Objective* objective, const at::Tensor& output, const at::Tensor& target,
                               double label_smoothing) {
  ObjectiveTerms out;
  if (objective == nullptr || !objective->loss) {
    // (B, classes), or (B, T, V) for a language model: one prediction per target element.
    const at::Tensor logits = output.flatten(0, -2);
    const at::Tensor targets = target.flatten();
    out.loss = at::cross_entropy_loss(logits.to(at::kFloat), targets, {}, at::Reduction::Mean, -100, label_smoothing);
    const torch::NoGradGuard no_grad;
    out.metric = logits.detach().argmax(1).eq(targets).sum().to(at::kFloat);
    out.counted = targets.numel();
    return out;
  }
  const at::Tensor loss = objective->loss(output, target);
  TRIACCEL_CHECK_INPUT(loss.defined() && loss.numel() == 1, "loss= must return one number (the batch's mean loss), "
                       "got a tensor of shape ", loss.defined() ? loss.sizes() : at::IntArrayRef{});
  out.loss = loss.reshape({}).to(at::kFloat);
  const int64_t b = output.size(0);
  out.counted = b;
  const torch::NoGradGuard no_grad;
  if (objective->metric) {
    const at::Tensor m = objective->metric(output.detach(), target);
    TRIACCEL_CHECK_INPUT(m.defined() && m.numel() == 1, "metric= must return one number (the batch's mean), got a "
                         "tensor of shape ", m.defined() ? m.sizes() : at::IntArrayRef{});
    out.metric = m.reshape({}).to(at::kFloat) * static_cast<double>(b);
  } else {
    out.metric = at::zeros({}, output.options().dtype(at::kFloat));
  }
  return out;
}

}  // namespace triaccel
