// FP8 storage of saved activations; see fp8_saved.h.
#include "triaccel/train/fp8_saved.h"

#include "triaccel/core/flat_view.h"
#include "triaccel/train/fp8.h"
#include "triaccel/kernels/fp8_block.h"  // declarations only: the kernels exist in CUDA builds

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>
#include <torch/utils.h>

#include <algorithm>
#include <unordered_map>
#include <vector>

namespace triaccel {
namespace {

constexpr uint8_t kFp8SavedNanByte = 0x7f;  // the spec's NaN byte (train/fp8.h)

int64_t block_count(int64_t n) { return (n + kFp8BlockElements - 1) / kFp8BlockElements; }

void dense_floating_check(const at::Tensor& t, const char* who) {
  TORCH_CHECK(t.defined() && fp8_quantizable(t.scalar_type()), who, ": float32, bfloat16 or float16 only");
  TORCH_CHECK(t.is_non_overlapping_and_dense(), who, ": a dense tensor only");
}

// Each element's block scale, for the first n elements.
at::Tensor per_element(const at::Tensor& scales, int64_t n) {
  return scales.repeat_interleave(kFp8BlockElements).narrow(0, 0, n);
}

}  // namespace

Fp8Blocks fp8_block_quantize_reference(const at::Tensor& x) {
  dense_floating_check(x, "fp8_block_quantize");
  const torch::NoGradGuard no_grad;
  const int64_t n = x.numel(), blocks = block_count(n);
  const at::Tensor flat = memory_flat(x, "fp8_block_quantize").to(at::kFloat);
  const at::Tensor rows = at::constant_pad_nd(flat, {0, blocks * kFp8BlockElements - n}).view({blocks, kFp8BlockElements});
  const at::Tensor amax = std::get<0>(at::max(at::where(at::isnan(rows), 0.0, at::abs(rows)), 1)).cpu();
  // Each block's scale by the delayed scale's own rule (fp8_scale_for_amax: no margin, 1 for an amax of 0 or inf).
  at::Tensor scales = at::empty({blocks}, amax.options());
  const float* a = amax.data_ptr<float>();
  float* s = scales.data_ptr<float>();
  for (int64_t b = 0; b < blocks; ++b) s[b] = fp8_scale_for_amax(a[b], Fp8Format::kE4M3, 0.0, 1.f);
  scales = scales.to(x.device());
  const double fmax = fp8_max(Fp8Format::kE4M3);
  at::Tensor data = at::clamp(flat.mul(per_element(scales, n)), -fmax, fmax)
                        .to(at::kFloat8_e4m3fn)
                        .view(at::kByte)
                        .contiguous();
  data.masked_fill_(at::isnan(flat), kFp8SavedNanByte);
  return {data, scales};
}

void fp8_block_dequantize_reference_into(const Fp8Blocks& q, const at::Tensor& out) {
  dense_floating_check(out, "fp8_block_dequantize");
  const torch::NoGradGuard no_grad;
  const int64_t n = out.numel();
  TORCH_CHECK(q.data.numel() == n && q.scales.numel() == block_count(n), "fp8_block_dequantize: ", q.data.numel(),
              " bytes and ", q.scales.numel(), " scales for ", n, " elements");
  const at::Tensor values = q.data.view(at::kFloat8_e4m3fn).to(at::kFloat).div(per_element(q.scales, n));
  memory_flat(out, "fp8_block_dequantize").copy_(values);
}

Fp8Blocks fp8_block_quantize(const at::Tensor& x) {
#ifdef TRIACCEL_WITH_CUDA
  if (x.is_cuda()) {
    dense_floating_check(x, "fp8_block_quantize");
    const at::Tensor flat = memory_flat(x, "fp8_block_quantize");
    Fp8Blocks q{at::empty({x.numel()}, x.options().dtype(at::kByte)),
                at::empty({block_count(x.numel())}, x.options().dtype(at::kFloat))};
    fp8_block_quantize_cuda(flat, q.data, q.scales);
    return q;
  }
#endif
  return fp8_block_quantize_reference(x);
}

void fp8_block_dequantize_into(const Fp8Blocks& q, const at::Tensor& out) {
#ifdef TRIACCEL_WITH_CUDA
  if (out.is_cuda()) {
    dense_floating_check(out, "fp8_block_dequantize");
    fp8_block_dequantize_cuda(q.data, q.scales, memory_flat(out, "fp8_block_dequantize"));
    return;
  }
#endif
  fp8_block_dequantize_reference_into(q, out);
}

namespace {

// One tensor as stored: its blocks and what it was.
struct Fp8SavedTensor {
  Fp8Blocks blocks;
  std::vector<int64_t> sizes, strides;
  at::TensorOptions options;
};

struct SeenTensor {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> impl;
  int64_t version;
  std::weak_ptr<Fp8SavedTensor> stored;
};

}  // namespace

struct Fp8SavedStore::State {
  std::unordered_map<const c10::TensorImpl*, SeenTensor> seen;
  int64_t stored_tensors = 0, stored_bytes = 0, original_bytes = 0, largest_original_bytes = 0, passed_tensors = 0;
};

namespace {

thread_local std::shared_ptr<Fp8SavedStore::State> tls_fp8_saved_store;

// A tensor made from parameters alone (a weight's cast, view or transpose): every edge of its node goes to a leaf's
// gradient accumulator. An edge to nowhere is an input that needs no gradient (the data), so a first layer's output
// is not one of them.
bool made_from_leaves(const at::Tensor& t) {
  const auto& fn = t.grad_fn();
  if (!fn) return true;
  for (const auto& edge : fn->next_edges()) {
    if (!edge.function || dynamic_cast<torch::autograd::AccumulateGrad*>(edge.function.get()) == nullptr) return false;
  }
  return true;
}

bool worth_storing(const at::Tensor& t) {
  return t.defined() && fp8_quantizable(t.scalar_type()) && t.numel() >= kFp8SavedMinElements &&
         t.is_non_overlapping_and_dense() && !t.is_leaf() && !made_from_leaves(t);
}

class Fp8SavedHooks final : public torch::autograd::SavedVariableHooks {
 public:
  explicit Fp8SavedHooks(std::shared_ptr<Fp8SavedStore::State> store) : store_(std::move(store)) {}

  void call_pack_hook(const at::Tensor& t) override {
    std::shared_ptr<Fp8SavedStore::State> store = std::move(store_);
    if (!worth_storing(t)) {
      ++store->passed_tensors;
      plain_ = t;
      return;
    }
    // The same tensor, still alive and unchanged, already stored by this store: shared. (A freed tensor's address
    // may come back as another: the weak reference tells them apart.)
    const auto seen = store->seen.find(t.unsafeGetTensorImpl());
    if (seen != store->seen.end() && seen->second.impl.lock().get() == t.unsafeGetTensorImpl() &&
        seen->second.version == t._version()) {
      stored_ = seen->second.stored.lock();
      if (stored_) return;
    }
    stored_ = std::make_shared<Fp8SavedTensor>(
        Fp8SavedTensor{fp8_block_quantize(t), t.sizes().vec(), t.strides().vec(), t.options()});
    store->seen.insert_or_assign(
        t.unsafeGetTensorImpl(),
        SeenTensor{c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(t.getIntrusivePtr()),
                   t._version(), stored_});
    ++store->stored_tensors;
    store->stored_bytes += stored_->blocks.data.numel() + 4 * stored_->blocks.scales.numel();
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    store->original_bytes += bytes;
    store->largest_original_bytes = std::max(store->largest_original_bytes, bytes);
  }

  at::Tensor call_unpack_hook() override {
    if (!stored_) return plain_;
    at::Tensor out = at::empty_strided(stored_->sizes, stored_->strides, stored_->options);
    fp8_block_dequantize_into(stored_->blocks, out);
    return out;
  }

 private:
  std::shared_ptr<Fp8SavedStore::State> store_;
  std::shared_ptr<Fp8SavedTensor> stored_;
  at::Tensor plain_;
};

// LibTorch's engine with one change: the hooks of a tensor saved while a scope is open on the saving thread.
class Fp8SavedEngine final : public torch::autograd::Engine {
 public:
  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (!tls_fp8_saved_store) return nullptr;
    return std::make_unique<Fp8SavedHooks>(tls_fp8_saved_store);
  }
};

torch::autograd::Engine& fp8_saved_engine() {
  static Fp8SavedEngine* engine = new Fp8SavedEngine();  // never destroyed: its threads may outlive static destruction
  return *engine;
}

}  // namespace

Fp8SavedStore::Fp8SavedStore() : state_(std::make_shared<State>()) {}
Fp8SavedStore::~Fp8SavedStore() = default;
int64_t Fp8SavedStore::stored_tensors() const { return state_->stored_tensors; }
int64_t Fp8SavedStore::stored_bytes() const { return state_->stored_bytes; }
int64_t Fp8SavedStore::original_bytes() const { return state_->original_bytes; }
int64_t Fp8SavedStore::largest_original_bytes() const { return state_->largest_original_bytes; }
int64_t Fp8SavedStore::passed_tensors() const { return state_->passed_tensors; }

Fp8SavedScope::Fp8SavedScope(Fp8SavedStore& store) : previous_(tls_fp8_saved_store) {
  TORCH_CHECK(fp8_saved_available(), "Fp8SavedScope: FP8 storage of saved activations is not available here");
  tls_fp8_saved_store = store.state_;
}

Fp8SavedScope::~Fp8SavedScope() { tls_fp8_saved_store = previous_; }

bool fp8_saved_available() {
  static const bool installed = [] {
    if (&torch::autograd::Engine::get_default_engine() != &torch::autograd::Engine::get_base_engine()) return false;
    torch::autograd::set_default_engine_stub(&fp8_saved_engine);
    return true;
  }();
  return installed;
}

}  // namespace triaccel
