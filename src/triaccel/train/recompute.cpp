#include "triaccel/train/recompute.h"

#include "triaccel/core/autograd_walk.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <ATen/core/ivalue.h>
#include <torch/utils.h>

namespace triaccel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What backward needs besides the saved input: the unit's forward, its parameters and buffers.
struct RecomputeClosure : torch::CustomClassHolder {
  UnitForward forward;
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> buffers;
  bool input_requires_grad = false;
};

class RecomputeFunction : public torch::autograd::Function<RecomputeFunction> {
 public:
  // Arguments: the closure (not a tensor), the input, the parameters (so that their gradients are this node's
  // outputs). Runs with autograd off (as every custom function's forward).
  static at::Tensor forward(AutogradContext* ctx, const c10::intrusive_ptr<RecomputeClosure>& closure,
                            const at::Tensor& x, at::TensorList params) {
    closure->input_requires_grad = x.requires_grad();
    ctx->save_for_backward({x});
    ctx->saved_data["closure"] = c10::IValue::make_capsule(closure);
    return closure->forward(x);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto closure =
        c10::static_intrusive_pointer_cast<RecomputeClosure>(ctx->saved_data["closure"].toCapsule());
    const at::Tensor x = ctx->get_saved_variables()[0];
    // The buffers as the first forward left them: the second forward updates them again.
    std::vector<at::Tensor> buffers_after_first;
    {
      const torch::NoGradGuard no_grad;
      for (const auto& b : closure->buffers) buffers_after_first.push_back(b.clone());
    }
    const at::Tensor input = x.detach().requires_grad_(closure->input_requires_grad);
    at::Tensor out;
    {
      const torch::AutoGradMode grad_on(true);
      out = closure->forward(input);
    }
    std::vector<at::Tensor> inputs;
    if (closure->input_requires_grad) inputs.push_back(input);
    for (const auto& p : closure->params) inputs.push_back(p);
    // Through the recomputed graph only: input and parameters are its leaves here.
    const variable_list grads = torch::autograd::grad({out}, inputs, {grad_out[0]}, /*retain_graph=*/false,
                                                      /*create_graph=*/false, /*allow_unused=*/true);
    {  // after the gradients: the recomputed graph saved the buffers (BatchNorm's running statistics) it read
      const torch::NoGradGuard no_grad;
      for (size_t i = 0; i < closure->buffers.size(); ++i) closure->buffers[i].copy_(buffers_after_first[i]);
    }
    variable_list result;
    result.emplace_back();  // the closure
    size_t g = 0;
    result.push_back(closure->input_requires_grad ? grads[g++] : at::Tensor());
    for (size_t i = 0; i < closure->params.size(); ++i) result.push_back(grads[g++]);
    return result;
  }
};

}  // namespace

at::Tensor recompute_forward(const UnitForward& forward, const at::Tensor& x, const std::vector<at::Tensor>& params,
                             const std::vector<at::Tensor>& buffers) {
  auto closure = c10::make_intrusive<RecomputeClosure>();
  closure->forward = forward;
  closure->params = params;
  closure->buffers = buffers;
  return RecomputeFunction::apply(closure, x, at::TensorList(params));
}

std::vector<at::Tensor> recompute_kept_inputs(const at::Tensor& output) {
  std::vector<at::Tensor> kept;
  autograd_graph_visit(output, [&](torch::autograd::Node& node) {
    if (auto* recompute = dynamic_cast<torch::autograd::CppNode<RecomputeFunction>*>(&node)) {
      kept.push_back(recompute->ctx_.get_saved_variables()[0]);
    }
  });
  return kept;
}

}  // namespace triaccel
