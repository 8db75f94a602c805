#include "triaccel/train/grad_buckets.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/utils.h>

#include <limits>

namespace triaccel {

int64_t grad_buckets_bytes(int64_t params, const GradBucketsOptions& options) {
  return (options.wire == at::kBFloat16 ? 6 : 4) * params;
}

struct GradBuckets::State {
  struct Bucket {
    std::vector<size_t> params;    // indices into State::params
    std::vector<int64_t> offsets;  // each one's first element in `flat`
    at::Tensor flat;               // (elements), the gradients' dtype and device
    at::Tensor wire;               // (elements) in the wire dtype; undefined: `flat` is sent
    int64_t pending = 0;           // gradients still to come in this pass
    DistWork work;
  };

  std::vector<at::Tensor> params;
  std::vector<size_t> bucket_of, slot_of;  // per parameter: its bucket, its place in the bucket
  std::vector<char> filled;                // per parameter: copied in this pass
  std::vector<Bucket> buckets;
  std::vector<std::vector<size_t>> layout;  // buckets' parameter lists (buckets())
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  // kept alive, so their hooks stay
  std::vector<uintptr_t> hook_keys;  // accumulators[i]'s hook
  GradBucketStart start;
  bool armed = false;
  bool poisoned = false;  // finish_poisoned(): the buckets still to start carry NaN
  size_t next = 0;  // the next bucket to start: those before it have started
  int64_t started_during_backward = 0;

  // Every bucket waits for all of its gradients again, none started.
  void pass_reset() {
    for (Bucket& b : buckets) {
      b.pending = static_cast<int64_t>(b.params.size());
      b.work = DistWork();
    }
    std::fill(filled.begin(), filled.end(), 0);
    next = 0;
  }

  // Parameter i's place in its bucket, laid out as the parameter (its strides: a channels_last weight's too), so that
  // after the reduction it stands as the parameter's gradient without a copy.
  at::Tensor slot(size_t i) const {
    const Bucket& b = buckets[bucket_of[i]];
    const at::Tensor& p = params[i];
    return b.flat.as_strided(p.sizes(), p.strides(), b.flat.storage_offset() + b.offsets[slot_of[i]]);
  }

  // The bucket's sum over the ranks, started. Its gradients go into their slots in one multi-tensor copy (a kernel
  // per ~100 tensors instead of one per parameter: ResNet-18's 62 copies would cost a few percent of a step); a slot
  // whose parameter has no gradient (not reached by this pass nor by earlier micro-batches) takes zeros.
  void bucket_start(Bucket& b) {
    const torch::NoGradGuard no_grad;
    std::vector<at::Tensor> slots, grads;
    slots.reserve(b.params.size());
    grads.reserve(b.params.size());
    for (const size_t i : b.params) {
      const at::Tensor& g = params[i].grad();
      if (g.defined()) {
        slots.push_back(slot(i));
        grads.push_back(g);
      } else {
        slot(i).zero_();
      }
    }
    if (!slots.empty()) at::_foreach_copy_(slots, grads);
    if (poisoned) b.flat.fill_(std::numeric_limits<double>::quiet_NaN());
    if (b.wire.defined()) b.wire.copy_(b.flat);
    b.work = start(b.wire.defined() ? b.wire : b.flat);
  }

  // Calls back after parameter `index`'s gradient accumulator ran (its .grad holds this pass's total).
  class AccumulatedHook final : public torch::autograd::FunctionPostHook {
   public:
    AccumulatedHook(std::weak_ptr<State> state, size_t index) : state_(std::move(state)), index_(index) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list& /*inputs*/) override {
      if (const auto state = state_.lock()) state->gradient_ready(index_);
      return outputs;
    }

   private:
    std::weak_ptr<State> state_;
    size_t index_;
  };

  // From a hook: parameter i's gradient is accumulated for this pass (its .grad holds the total so far; the bucket
  // reads it when it starts, once all of its parameters came in).
  void gradient_ready(size_t i) {
    if (!armed) return;
    const size_t j = bucket_of[i];
    TORCH_CHECK(j >= next, "GradBuckets: a gradient came in after its bucket's reduction started");
    if (filled[i]) return;  // accumulated twice in one pass: the bucket reads the newer total
    filled[i] = 1;
    if (--buckets[j].pending > 0) return;
    while (next < buckets.size() && buckets[next].pending == 0) {
      bucket_start(buckets[next++]);
      ++started_during_backward;
    }
  }
};

GradBuckets::GradBuckets(std::vector<at::Tensor> params, GradBucketsOptions options, GradBucketStart start)
    : state_(std::make_shared<State>()) {
  State& s = *state_;
  s.params = std::move(params);
  s.start = std::move(start);
  const size_t n = s.params.size();
  s.bucket_of.assign(n, 0);
  s.slot_of.assign(n, 0);
  s.filled.assign(n, 0);
  // Last parameter first; a new bucket past the byte cap, where the tail begins, or at a change of dtype or device.
  const auto bytes_of = [&](size_t k) {
    return s.params[k].numel() * static_cast<int64_t>(s.params[k].element_size());
  };
  std::vector<int64_t> front(n + 1, 0);  // front[k]: the bytes of parameters 0 .. k-1
  for (size_t k = 0; k < n; ++k) front[k + 1] = front[k] + bytes_of(k);
  const bool tail = options.bucket_bytes > 0 && options.tail_bytes > 0;
  std::vector<int64_t> elements;
  int64_t bytes = 0;
  for (size_t k = n; k-- > 0;) {
    const at::Tensor& p = s.params[k];
    TORCH_CHECK(p.is_non_overlapping_and_dense(), "GradBuckets: parameter ", k, " is not dense");
    const int64_t pb = bytes_of(k);
    // Parameter k begins the tail: parameters 0 .. k fit in tail_bytes, 0 .. k+1 do not.
    const bool tail_begins =
        tail && k + 1 < n && front[k + 1] <= options.tail_bytes && front[k + 2] > options.tail_bytes;
    const bool fresh = s.buckets.empty() || (bytes > 0 && tail_begins) ||
                       (options.bucket_bytes > 0 && bytes > 0 && bytes + pb > options.bucket_bytes) ||
                       p.scalar_type() != s.params[s.buckets.back().params[0]].scalar_type() ||
                       p.device() != s.params[s.buckets.back().params[0]].device();
    if (fresh) {
      s.buckets.emplace_back();
      elements.push_back(0);
      bytes = 0;
    }
    State::Bucket& b = s.buckets.back();
    s.bucket_of[k] = s.buckets.size() - 1;
    s.slot_of[k] = b.params.size();
    b.params.push_back(k);
    b.offsets.push_back(elements.back());
    elements.back() += p.numel();
    bytes += pb;
  }
  for (size_t j = 0; j < s.buckets.size(); ++j) {
    State::Bucket& b = s.buckets[j];
    const at::Tensor& first = s.params[b.params[0]];
    b.flat = at::zeros({elements[j]}, first.options());
    if (options.wire != at::ScalarType::Undefined && options.wire != first.scalar_type()) {
      b.wire = at::zeros({elements[j]}, first.options().dtype(options.wire));
    }
    b.pending = static_cast<int64_t>(b.params.size());
    s.layout.push_back(b.params);
  }
  if (options.bucket_bytes <= 0) return;  // one bucket, started after backward: no hooks
  const std::weak_ptr<State> weak = state_;
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(s.params[i].requires_grad(), "GradBuckets: parameter ", i, " does not require a gradient");
    std::shared_ptr<torch::autograd::Node> acc = torch::autograd::impl::grad_accumulator(s.params[i]);
    TORCH_CHECK(acc, "GradBuckets: parameter ", i, " has no gradient accumulator (not a leaf)");
    s.hook_keys.push_back(acc->add_post_hook(std::make_unique<State::AccumulatedHook>(weak, i)));
    s.accumulators.push_back(std::move(acc));
  }
}

GradBuckets::~GradBuckets() {
  State& s = *state_;
  for (size_t i = 0; i < s.accumulators.size(); ++i) s.accumulators[i]->del_post_hook(s.hook_keys[i]);
}

void GradBuckets::arm() {
  State& s = *state_;
  // A pass abandoned before finish() (a capture that failed midway: the step then runs eagerly) leaves nothing: its
  // started buckets are started again.
  s.pass_reset();
  s.armed = true;
  s.started_during_backward = 0;
}

void GradBuckets::finish() {
  State& s = *state_;
  s.armed = false;
  while (s.next < s.buckets.size()) s.bucket_start(s.buckets[s.next++]);
  const torch::NoGradGuard no_grad;
  for (State::Bucket& b : s.buckets) {
    b.work.wait();
    if (b.wire.defined()) b.flat.copy_(b.wire);
  }
  // Each gradient becomes its slot, a view of the bucket (no copy kernel per parameter); the next step releases it.
  for (size_t i = 0; i < s.params.size(); ++i) s.params[i].mutable_grad() = s.slot(i);
  s.pass_reset();
  s.poisoned = false;
}

bool GradBuckets::finish_poisoned() {
  State& s = *state_;
  if (!s.armed) arm();
  const bool carried = s.next < s.buckets.size();
  s.poisoned = true;
  finish();
  return carried;
}

const std::vector<std::vector<size_t>>& GradBuckets::buckets() const { return state_->layout; }

int64_t GradBuckets::started_during_backward() const { return state_->started_during_backward; }

int64_t GradBuckets::bytes() const {
  int64_t total = 0;
  for (const State::Bucket& b : state_->buckets) {
    total += b.flat.nbytes() + (b.wire.defined() ? static_cast<int64_t>(b.wire.nbytes()) : 0);
  }
  return total;
}

}  // namespace triaccel
