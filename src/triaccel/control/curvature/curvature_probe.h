// The curvature probe (Tri-Accel §3.2): top-k Hessian eigenvalues of every unit's parameter block on one small
// batch, for learning-rate scaling and precision promotion.
//
// Invariants:
// - One forward pass in train mode (BatchNorm uses batch statistics) with the training step's autocast off; the
//   products' arithmetic is options.precision (fp32: the parameters' precision, the reference).
// - Every unit's block is probed from that same loss: each unit computes its first-order gradients once
//   (create_graph) and then takes up to max_iters products per eigenvalue; the forward graph is kept across units.
// - The probe leaves the model as it found it: parameters, their .grad, every buffer (BatchNorm running
//   statistics, num_batches_tracked), the train/eval mode, the autocast state and the default CPU/CUDA
//   generators are the same after the call.
// - Deterministic for options.seed on a given device (unit i starts from seed + i).
#pragma once

#include "triaccel/core/clock.h"
#include "triaccel/core/enum_names.h"
#include "triaccel/models/model.h"
#include "triaccel/train/step_graph.h"

#include <ATen/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace triaccel {

// The arithmetic of the probe's forward and Hessian-vector products. The power iteration's vectors and Rayleigh
// quotients stay fp32 in both modes; the parameters are the fp32 master weights. Runs use fp32: the bf16 products
// were no faster (bound by host work on small models, slower on some larger ones) and their λ_1 was off by a few to
// tens of % (measured: docs/results/tri-accel.md); bench_curvature compares the two.
//   fp32: fp32 tensors (cuDNN convolutions as PyTorch allows them by default, with TF32 tensor cores): the reference.
//   bf16: the forward under bf16 autocast, so the products' convolutions and matmuls run in bf16 with fp32
//         accumulation (the loss and what autocast keeps in fp32 stay fp32).
enum class ProbePrecision { kFP32, kBF16 };
template <>
struct EnumNames<ProbePrecision> {
  static constexpr EnumName<ProbePrecision> kNames[] = {{ProbePrecision::kFP32, "fp32"},
                                                        {ProbePrecision::kBF16, "bf16"}};
};

// What a unit's curvature is the top eigenvalue of (docs/tri-accel.md "Curvature"):
//   hessian: the unit's block of the Hessian of the probe batch's mean loss, in train mode (BatchNorm on the batch's
//            statistics), by Hessian-vector products (double backward): the paper's definition, the reference.
//   fisher:  the unit's block of the Monte-Carlo Fisher F = (1/n) Σ_i g_i g_iᵀ, g_i the gradient of sample i's loss
//            at a label drawn from the model's own prediction, in eval mode (BatchNorm on its running statistics, so
//            the samples are independent). For softmax cross-entropy its expectation over the drawn labels is the
//            generalized Gauss-Newton matrix, the positive part of the Hessian that sets its top eigenvalues; it
//            costs n one-sample forward/backward passes per power-iteration step and no double backward.
enum class CurvatureEstimator { kHessian, kFisher };
template <>
struct EnumNames<CurvatureEstimator> {
  static constexpr EnumName<CurvatureEstimator> kNames[] = {{CurvatureEstimator::kHessian, "hessian"},
                                                            {CurvatureEstimator::kFisher, "fisher"}};
};

// The rounds' samples per forward/backward by default: the Hessian's memory (a chunk's double-backward graph, its
// pool growing with the chunk; measured: docs/results/memory-planner.md), the Fisher's rank (n/m terms) and cost
// (n/m one-chunk passes per power step).
constexpr int64_t kHessianChunk = 16;
constexpr int64_t kFisherChunk = 4;

// curv_cudnn auto: whether a probe's convolutions go through cuDNN. Off for the Fisher's rounds on a model with grouped
// (depthwise) convolutions, on otherwise: there cuDNN spends most of a cold round building plans for the probe's
// shapes, far longer than PyTorch's own kernels take, and its replayed passes are slower too; elsewhere its set-up is
// cheap and its passes several times faster (bench_curvature; measured: docs/results/tri-accel.md). The Hessian's
// double backward keeps cuDNN.
bool probe_cudnn_auto(const Model& model, CurvatureEstimator estimator);

// The defaults here are the run's (Config's curv_* options read them): a probe built in C++ runs what the CLI runs.
struct CurvatureOptions {
  // curv_top_k: eigenvalues per unit. λ_max is what the lr scale and the precision promotion use; the paper's k is 5.
  int top_k = 1;
  int max_iters = 20;          // curv_max_iters: power-iteration steps per eigenvalue
  double tol = 0.01;           // curv_tol: stop when the Rayleigh quotient changes by less than tol, relative
  int64_t batch = 32;          // curv_batch: samples the probe uses (paper: b_curv = 32)
  int64_t every_steps = 200;   // curv_every: training steps between probes (paper: T_curv = 200)
  uint64_t seed = 0;           // start vectors of the power iteration (the run's seed)
  ProbePrecision precision = ProbePrecision::kFP32;
  bool cuda_graphs = true;     // cuda_graphs: each unit's products replay a CUDA graph after the first (hvp.h)
  // curv_cudnn: the probe's convolutions may use cuDNN. Off, they run PyTorch's own kernels: no cuDNN plans to build
  // for the probe's shapes (probe_cudnn_auto).
  bool cudnn = true;
  // curv_chunk: CurvatureRound's samples per forward/backward (0: the whole batch; -1: the estimator's own,
  // kHessianChunk or kFisherChunk).
  int64_t chunk = -1;
  int warm_passes = 0;         // CurvatureRound: a warm round's most passes (0: max_iters)
  // curv_estimator: CurvatureRound's (the Fisher needs top_k 1); curvature_probe is the Hessian's whatever this says.
  CurvatureEstimator estimator = CurvatureEstimator::kFisher;
  const Clock* clock = nullptr;  // what times the probe and each unit (nullptr: the steady clock)

  // Throws UserError naming the flag and the bad value.
  void validate() const;
  // A warm round's most passes: warm_passes, or max_iters when it is 0.
  int warm_round_passes() const { return warm_passes > 0 ? warm_passes : max_iters; }
};

struct UnitCurvature {
  std::string unit;                  // the unit's name ("block1", "layer2.0", "fc")
  std::vector<double> eigenvalues;   // top-k of the unit's Hessian block, by decreasing |λ|, signed
  double lambda_max = 0.0;           // max_i λ_i (the largest signed value); 0 for a unit without parameters
  int iterations = 0;                // Hessian-vector products taken for this unit
  bool converged = false;            // every eigenvalue met options.tol within options.max_iters
  double seconds = 0.0;              // time of this unit's power iteration (its share of the probe)
  bool graphed = false;              // its products after the first replayed a CUDA graph
  bool probed = true;                // false: not in `only_units` this call (the other fields are empty)
};

// Probes every unit of model on the first min(options.batch, N) samples.
// images: (N, C, H, W) on the model's device, normalized as for training; labels: (N), int64 class indices.
// Returns one entry per unit, in unit order. If wall_seconds is given, it receives the whole call's time on
// options.clock (forward, every unit, restoring the state; the device is synchronized before the clock stops), so
// the trainer can report the probe's share of training time.
// warm_start (optional, per unit): the previous probe's eigenvectors in, this probe's out; power iteration starts
// from them, so a probe on a slowly moving model converges in a few products instead of max_iters.
// only_units (optional): probe just these unit indices (first-order gradients too); the others come back with
// probed = false. Tri-Accel's time-budgeted schedule probes a few units per round.
std::vector<UnitCurvature> curvature_probe(Model& model, const at::Tensor& images, const at::Tensor& labels,
                                           const CurvatureOptions& options, double* wall_seconds = nullptr,
                                           std::vector<std::vector<at::Tensor>>* warm_start = nullptr,
                                           const std::vector<size_t>* only_units = nullptr);

// Every unit's top eigenvalue (k = 1) in lockstep, by an object that lives across Tri-Accel's probe rounds on a GPU.
// A power iteration is one pass of: the forward on the probe batch, the first-order gradients with their graph, and
// one Hessian-vector product per unit; every unit advances one product per pass, with one host synchronization per
// pass. On CUDA (options.cuda_graphs, a non-default current stream) the pass is captured in a CUDA graph at the
// first round's first pass (after an eager pass where that capture fails) and replayed for every pass of every round:
// the probe batch is fixed and the optimizer updates the parameters in place, so a replay reads the current weights,
// and the products cost their GPU work without autograd's host work. A parameter that moved to new storage drops the
// graph (captured again). Each round starts from the last round's vectors (warm start; the first from seed + i for
// unit i). The estimate is curvature_probe's with top_k = 1 (CurvatureRoundTest compares them), and the model is
// left as found, as there. The graph's private pool (graph_bytes) is held until the object goes; between passes
// and rounds the object keeps one vector of the probed parameters' size (the units' current vectors): the products
// and the per-sample gradients are the pass's own tensors (in the pool when captured).
// options.chunk splits the batch into chunks run one after the other within a pass: H·v is the sum over chunks of
// each chunk's mean-loss H·v weighted by its share of the batch — the whole batch's H·v for a model without
// BatchNorm, with BatchNorm statistics per chunk otherwise — and the memory is one chunk's autograd graphs.
// The first round (from random vectors) stops after kColdRoundPasses passes; the next rounds continue from there.
// The pass's GPU work is the floor of a round's cost (its figures: docs/results/tri-accel.md).
// options.estimator kFisher: the same rounds on the Monte-Carlo Fisher blocks (CurvatureEstimator). A pass is one
// eval-mode forward and backward per chunk of samples, its loss at labels drawn from that forward's softmax (one
// uniform draw per sample, fixed for the run, seeded with options.seed: the weights do not move within a round, so
// its passes draw the same labels), each unit's w += s_u (s_u·v_u) for the chunk's gradient s, divided by n at the
// end. The model is in eval mode during the round (restored after), so dropout is off and BatchNorm reads its
// running statistics.
class CurvatureRound {
 public:
  // images/labels as for curvature_probe; the first min(options.batch, N) samples are copied in once.
  CurvatureRound(Model& model, const at::Tensor& images, const at::Tensor& labels, CurvatureOptions options);
  ~CurvatureRound();
  CurvatureRound(const CurvatureRound&) = delete;
  CurvatureRound& operator=(const CurvatureRound&) = delete;

  // One round: one entry per unit, all probed; `seconds` of a unit is its share of the round (the round's time split
  // by its products). wall_seconds as curvature_probe's.
  std::vector<UnitCurvature> run(double* wall_seconds = nullptr);

  static constexpr int kColdRoundPasses = 8;

  // Under a --vram-budget, whose memory plan leaves no room for a pool of the pass's own: the pass is captured as a
  // side graph in the training step's graph pool (StepGraph::side_capture; captured again after the step's graph
  // was). A pass that cannot be captured there throws c10::OutOfMemoryError (eagerly, beside the step's pool, it would
  // not fit either). nullptr: a pool of the pass's own (graph_bytes). Set before the first run; `step_graph` outlives
  // this object.
  void share_pool(StepGraph* step_graph);

  bool graphed() const;
  int64_t graph_bytes() const;  // reserved by the graph's pool at its capture (0: no graph)
  int64_t chunk() const;        // samples per forward/backward in a pass (options.chunk resolved)
  // The labels the passes read, (n) int64: kFisher's last round's draws (the batch's own before the first round).
  const at::Tensor& labels() const;
  // Where the last round's time went: its passes, the eager ones and the capture (at the first round), and one
  // replayed pass (< 0: none replayed) — what a warm round costs per pass.
  struct Timing {
    int passes = 0;
    double eager_s = 0;
    double capture_s = 0;
    double replay_s = -1;
    double fastest_replay_s = -1;  // the quickest replayed pass (the first replays of a graph pay for its upload)
    double passes_s = 0;           // all passes, each with its statistics read
  };
  const Timing& timing() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace triaccel
