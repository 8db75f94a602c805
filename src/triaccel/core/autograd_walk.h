// A walk over the autograd graph behind a tensor: each node once, from the tensor's grad_fn towards the leaves.
// Used to read what a graph keeps for backward (control/memory_profile: its recorded tensors' bytes;
// train/recompute: the inputs its recompute nodes hold).
#pragma once

#include <ATen/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <unordered_set>
#include <vector>

namespace triaccel {

// Calls visit(node) for every node of the graph behind `output` (none when it has no grad_fn), each once.
template <class Visit>
void autograd_graph_visit(const at::Tensor& output, Visit&& visit) {
  if (!output.grad_fn()) return;
  std::vector<torch::autograd::Node*> stack{output.grad_fn().get()};
  std::unordered_set<torch::autograd::Node*> seen{output.grad_fn().get()};
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    visit(*node);
    for (const auto& edge : node->next_edges()) {
      torch::autograd::Node* next = edge.function.get();
      if (next && seen.insert(next).second) stack.push_back(next);
    }
  }
}

}  // namespace triaccel
