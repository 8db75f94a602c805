// The Python module's C++ half, `triaccel._triaccel` (docs/python.md): a user's torch.nn.Module as a triaccel Model
// whose units call the module's children, tensors as the dataset "tensors", and api::run / plan / report with
// UserError raised as ValueError. A front end like the CLI: it reaches the library through the public header only.
//
// The Model holds the Python module's own tensors (the same TensorImpls, under the same dotted names), so the
// engine's updates are the module's weights, model.pt has the module's state_dict names, and moving the Model moves
// the module. The GIL is released while the engine runs; a unit's forward takes it to call Python, so a CUDA-graph
// replay calls no Python at all.
#include <triaccel/triaccel.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>  // THPVariable_Check
#include <torch/csrc/utils/pybind.h>                // at::Tensor <-> torch.Tensor
#include <torch/library.h>

#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// The line a user reads for a Python exception's text: its first line; for an error a DataLoader worker caught
// ("Caught ValueError in DataLoader worker process 0." and then the worker's traceback) also the traceback's last
// line, the error itself.
std::string python_error_line(const std::string& text) {
  const std::string first = text.substr(0, text.find('\n'));
  const size_t end = text.find_last_not_of(" \t\r\n");
  if (text.find("Original Traceback") == std::string::npos || end == std::string::npos) return first;
  const size_t newline = text.rfind('\n', end);
  const size_t start = newline == std::string::npos ? 0 : newline + 1;
  return first + " " + text.substr(start, end - start + 1);
}

// Runs f (which calls Python) from any of the engine's threads: under the GIL, a Python exception as a UserError
// "<what>: <type>: <python_error_line>" (its input is the user's), except an out-of-memory error, which stays one so
// the engine's recovery sees it.
template <typename F>
auto python_call(const std::string& what, F&& f) {
  py::gil_scoped_acquire gil;
  try {
    return f();
  } catch (py::error_already_set& e) {
    const std::string type = py::str(e.type().attr("__name__"));
    const std::string text = py::str(e.value());
    // torch.OutOfMemoryError, or the RuntimeError a C++ extension's allocation failure becomes: the engine's recovery
    // (a smaller plan or batch) handles it, not the user.
    if (type == "OutOfMemoryError" || (type == "RuntimeError" && text.rfind("CUDA out of memory", 0) == 0)) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, text);
    }
    throw triaccel::UserError(triaccel::str_cat(what, ": ", type, ": ", python_error_line(text)));
  }
}

// Python callables the engine holds: the children of one unit (one module, or a parametered child with the
// parameterless ones after it), or a program's loss and metric. Its references are dropped under the GIL, so copies
// of the functions that hold it may live on threads that do not hold the GIL.
struct PyCalls {
  std::vector<py::object> modules;
  ~PyCalls() {
    py::gil_scoped_acquire gil;
    modules.clear();
  }
};

// A module of the tree of names: holds the Python module's tensors at one dotted path ("0", "layer1.0.conv1").
class Holder : public torch::nn::Module {
 public:
  Holder() : torch::nn::Module("python") {}
  std::map<std::string, std::shared_ptr<Holder>> kids;
};

class PythonModel final : public triaccel::Model {
 public:
  PythonModel() : Model("python") {}

  // Registers one state_dict entry under its dotted name, creating the path's holders in first-seen order (which
  // keeps Python's state_dict order: a module's own tensors, then its children's). A tensor tied to another (one
  // tensor under two names) is passed once, under its first name.
  void tensor_add(const std::string& name, const at::Tensor& tensor, bool parameter) {
    const auto dot = name.rfind('.');
    torch::nn::Module& owner = dot == std::string::npos ? static_cast<torch::nn::Module&>(*this)
                                                        : *holder(name.substr(0, dot));
    const std::string leaf = dot == std::string::npos ? name : name.substr(dot + 1);
    if (parameter) {
      owner.register_parameter(leaf, tensor, tensor.requires_grad());
    } else {
      owner.register_buffer(leaf, tensor);
    }
    tensors_[name] = {tensor, parameter};
  }

  // One unit: its name, the Python callables it runs in order, and the state names (registered by tensor_add
  // before) of the tensors it owns. The unit's owner module holds exactly those tensors (the same TensorImpls as the
  // tree's), so a unit can own a bare parameter of a module (ViT's class token) and a tied weight is owned once
  // even when two units use it.
  void unit_add_python(const std::string& name, std::vector<py::object> modules, const std::vector<std::string>& owned) {
    auto owner = std::make_shared<torch::nn::Module>("unit");
    for (size_t i = 0; i < owned.size(); ++i) {
      const auto it = tensors_.find(owned[i]);
      TRIACCEL_CHECK_INPUT(it != tensors_.end(), "unit '", name, "' owns '", owned[i], "', which is not in the state");
      const std::string key = "t" + std::to_string(i);
      if (it->second.second) {
        owner->register_parameter(key, it->second.first, it->second.first.requires_grad());
      } else {
        owner->register_buffer(key, it->second.first);
      }
    }
    auto calls = std::make_shared<PyCalls>();
    calls->modules = std::move(modules);
    const torch::nn::Module* model = this;
    unit_add(name, {owner}, [calls, model, name](const at::Tensor& x) { return unit_call(*calls, *model, name, x); });
  }

 private:
  std::shared_ptr<Holder> holder(const std::string& path) {
    std::map<std::string, std::shared_ptr<Holder>>* kids = &roots_;
    torch::nn::Module* parent = this;
    std::shared_ptr<Holder> node;
    size_t start = 0;
    while (start <= path.size()) {
      const size_t end = std::min(path.find('.', start), path.size());
      const std::string part = path.substr(start, end - start);
      auto it = kids->find(part);
      if (it == kids->end()) {
        auto made = std::make_shared<Holder>();
        parent->register_module(part, made);
        it = kids->emplace(part, made).first;
      }
      node = it->second;
      parent = node.get();
      kids = &node->kids;
      start = end + 1;
    }
    return node;
  }

  // The unit's forward: its modules in order, in the Model's training mode. A Python exception becomes a UserError
  // naming the unit (its model is the user's input), except an out-of-memory error, which stays one so the engine's
  // recovery sees it.
  static at::Tensor unit_call(const PyCalls& calls, const torch::nn::Module& model, const std::string& name,
                              const at::Tensor& x) {
    const std::string what = triaccel::str_cat("unit '", name, "' of the model failed on an input of shape ", x.sizes());
    return python_call(what, [&] {
      const bool training = model.is_training();
      py::object h = py::cast(x);
      for (const auto& m : calls.modules) {
        if (m.attr("training").cast<bool>() != training) m.attr("train")(training);
        h = m(h);
      }
      TRIACCEL_CHECK_INPUT(THPVariable_Check(h.ptr()), "unit '", name, "' returned a ",
                           py::str(py::type::of(h).attr("__name__")).cast<std::string>(),
                           ", not a tensor; every unit maps one tensor to the next");
      return h.cast<at::Tensor>();
    });
  }

  std::map<std::string, std::shared_ptr<Holder>> roots_;
  std::map<std::string, std::pair<at::Tensor, bool>> tensors_;  // state name -> (tensor, is a parameter)
};

triaccel::Config config_from(const std::string& options_json) {
  triaccel::Config config;
  const triaccel::Json options = triaccel::Json::parse(options_json);
  for (const auto& [key, value] : options.items()) config.set_json(key, value);
  return config;
}

// What the Python side passes for a model: units as (name, [modules], [owned state names]) and the state_dict's
// entries as (name, tensor, is_parameter), each tensor once.
using UnitSpec = std::tuple<std::string, std::vector<py::object>, std::vector<std::string>>;
using StateSpec = std::tuple<std::string, at::Tensor, bool>;

std::shared_ptr<PythonModel> model_from(std::vector<UnitSpec> units, const std::vector<StateSpec>& state) {
  auto model = std::make_shared<PythonModel>();
  for (const auto& [name, tensor, parameter] : state) model->tensor_add(name, tensor, parameter);
  for (auto& [name, modules, owned] : units) model->unit_add_python(name, std::move(modules), owned);
  return model;
}

// A torch Dataset or DataLoader as the engine's SampleSource (python/triaccel/_data.py serves the batches).
class PySource final : public triaccel::SampleSource {
 public:
  PySource(py::object served, std::string split) : served_(std::move(served)), split_(std::move(split)) {
    size_ = served_.attr("size")().cast<int64_t>();
  }
  // Stops the source's fetching ahead (a run stopped mid-epoch leaves its thread and workers waiting otherwise).
  ~PySource() override {
    py::gil_scoped_acquire gil;
    try {
      if (py::hasattr(served_, "close")) served_.attr("close")();
    } catch (const py::error_already_set& e) {
      std::fprintf(stderr, "triaccel: stopping the %s data's loader failed: %s\n", split_.c_str(), e.what());
    }
    served_ = py::object();
  }
  int64_t size() const override { return size_; }
  void epoch_begin(const std::vector<int64_t>& order) override {
    python_call("the " + split_ + " data failed", [&] { served_.attr("epoch_begin")(order); });
  }
  void epoch_ahead(const std::vector<int64_t>& order) override {
    python_call("the " + split_ + " data failed", [&] { served_.attr("epoch_ahead")(order); });
  }
  std::pair<at::Tensor, at::Tensor> fetch(int64_t offset, const std::vector<int64_t>& ids) override {
    return python_call("the " + split_ + " data failed", [&] {
      const py::tuple batch = served_.attr("fetch")(offset, ids);
      return std::make_pair(batch[0].cast<at::Tensor>(), batch[1].cast<at::Tensor>());
    });
  }

 private:
  py::object served_;
  std::string split_;
  int64_t size_ = 0;
};

// One split passed as it is: (inputs, targets) tensors, or a served source.
triaccel::Dataset raw_split(const py::object& given, const std::string& split) {
  if (py::isinstance<py::tuple>(given)) {
    const auto [x, y] = given.cast<std::pair<at::Tensor, at::Tensor>>();
    return triaccel::dataset_raw(split, x, y);
  }
  return triaccel::dataset_from_source(std::make_shared<PySource>(given, split), split);
}

// The hooks that give the engine the program's model, data and objective (each may be absent). `data`: None, or
// (kind, train, test) with kind "images" (pixels the engine normalizes and augments) or "raw" (batched as they are),
// each split (inputs, targets) or a served source (raw only). `objective`: None or (loss, metric or None).
triaccel::RunHooks inputs_hooks(const std::shared_ptr<PythonModel>& model, const py::object& data,
                                const py::object& objective) {
  triaccel::RunHooks hooks;
  if (model) hooks.model = [model](const triaccel::ModelOptions&) { return model; };
  if (!data.is_none()) {
    const auto spec = data.cast<py::tuple>();
    if (spec[0].cast<std::string>() == "images") {
      const auto [x_train, y_train] = spec[1].cast<std::pair<at::Tensor, at::Tensor>>();
      const auto [x_test, y_test] = spec[2].cast<std::pair<at::Tensor, at::Tensor>>();
      hooks.data = std::make_shared<const triaccel::DatasetSplits>(
          triaccel::dataset_from_tensors(x_train, y_train, x_test, y_test));
    } else {
      hooks.data = std::make_shared<const triaccel::DatasetSplits>(
          triaccel::dataset_splits_raw(raw_split(spec[1], "train"), raw_split(spec[2], "test")));
    }
  }
  if (!objective.is_none()) {
    const auto pair = objective.cast<py::tuple>();
    auto o = std::make_shared<triaccel::Objective>();
    auto fns = std::make_shared<PyCalls>();  // (loss, metric or None)
    fns->modules = {pair[0], pair[1]};
    o->loss = [fns](const at::Tensor& out, const at::Tensor& target) {
      return python_call("loss= failed", [&] { return fns->modules[0](out, target).cast<at::Tensor>(); });
    };
    if (!pair[1].is_none()) {
      o->metric = [fns](const at::Tensor& out, const at::Tensor& target) {
        return python_call("metric= failed", [&] { return fns->modules[1](out, target).cast<at::Tensor>(); });
      };
    }
    hooks.objective = std::move(o);
  }
  hooks.spell_option = [](const std::string& key) { return key; };
  return hooks;
}

std::string train(const std::string& options_json, std::vector<UnitSpec> units, const std::vector<StateSpec>& state,
                  const py::object& data, const py::object& objective) {
  const triaccel::Config config = config_from(options_json);
  const std::shared_ptr<PythonModel> model = units.empty() ? nullptr : model_from(std::move(units), state);
  triaccel::RunHooks hooks = inputs_hooks(model, data, objective);
  hooks.stop_requested = &triaccel::api::StopSignals::requested;
  triaccel::Json result;
  {
    const py::gil_scoped_release nogil;
    const triaccel::api::StopSignals signals;  // Python's handlers come back when the run returns
    result = triaccel::api::run(config, hooks);
  }
  return result.dump();
}

std::string plan(const std::string& options_json, std::vector<UnitSpec> units, const std::vector<StateSpec>& state,
                 const py::object& data, const py::object& objective) {
  const triaccel::Config config = config_from(options_json);
  const std::shared_ptr<PythonModel> model = units.empty() ? nullptr : model_from(std::move(units), state);
  const triaccel::RunHooks hooks = inputs_hooks(model, data, objective);
  triaccel::Json result;
  {
    const py::gil_scoped_release nogil;
    result = triaccel::api::plan(config, hooks);
  }
  return result.dump();
}

py::dict report(const std::vector<std::string>& runs, const std::string& output, const std::string& csv,
                const std::string& title) {
  triaccel::ReportOptions options;
  options.runs = runs;
  options.html = output;
  options.csv = csv;
  options.title = title;
  triaccel::ReportResult r;
  {
    const py::gil_scoped_release nogil;
    r = triaccel::api::report(options);
  }
  py::dict out;
  out["html"] = r.html_path;
  out["csv"] = r.csv_path;
  out["runs"] = r.runs.size();
  return out;
}

// Every option: (key, default as JSON text, help); the Python side checks names against it.
std::vector<std::tuple<std::string, std::string, std::string>> options() {
  std::vector<std::tuple<std::string, std::string, std::string>> out;
  for (const auto& o : triaccel::Config().options()) out.emplace_back(o.key, o.default_text, o.help);
  return out;
}

// triaccel.optim's engine: units as (name, [(parameter name, tensor)]).
std::unique_ptr<triaccel::api::LoopOptimizer> loop_optimizer_make(
    const std::vector<triaccel::api::LoopUnit>& units, const std::string& format, double beta1, double beta2,
    double eps, double weight_decay, const std::string& memory_budget, const std::string& time_budget,
    const std::string& formats, int64_t plan_warmup, int64_t replan_every) {
  triaccel::api::LoopOptimizerOptions o;
  o.format = format;
  o.adam.beta1 = beta1;
  o.adam.beta2 = beta2;
  o.adam.eps = eps;
  o.adam.weight_decay = weight_decay;
  o.baoc.memory_budget = memory_budget;
  o.baoc.time_budget = time_budget;
  o.baoc.formats = formats;
  o.baoc.plan_warmup = plan_warmup;
  o.baoc.replan_every = replan_every;
  return std::make_unique<triaccel::api::LoopOptimizer>(units, o);
}

// The torch op triaccel::loop_optimizer_step: one step of the LoopOptimizer named by `handle`, so that torch.compile
// traces triaccel.optim's step into its graph (an opaque op that mutates the parameters it is given) and a CUDA graph
// captures it. A user's mistake is raised as Python's ValueError, as the module's other errors are.
void loop_optimizer_step_op(int64_t handle, at::TensorList params, const c10::List<std::optional<at::Tensor>>& grads,
                            const at::Tensor& lr) {
  triaccel::api::LoopOptimizer* opt = triaccel::api::LoopOptimizer::find(handle);
  TORCH_CHECK_VALUE(opt != nullptr, "triaccel::loop_optimizer_step: no live optimizer has handle ", handle);
  std::vector<at::Tensor> gs;
  gs.reserve(grads.size());
  for (const std::optional<at::Tensor>& g : grads) gs.push_back(g.has_value() ? *g : at::Tensor());
  try {
    opt->step(params.vec(), gs, lr);
  } catch (const triaccel::UserError& e) {
    TORCH_CHECK_VALUE(false, e.message([](const std::string& key) { return key; }));
  }
}

std::shared_ptr<triaccel::Model> python_model_unbuilt(const triaccel::ModelOptions&) {
  throw triaccel::UserError("the model 'python' is a torch.nn.Module passed to triaccel.train(model, ...); "
                            "the command line trains the built-in models");
}

}  // namespace

TORCH_LIBRARY(triaccel, m) {
  m.def("loop_optimizer_step(int handle, Tensor(a!)[] params, Tensor?[] grads, Tensor lr) -> ()");
}

TORCH_LIBRARY_IMPL(triaccel, CompositeExplicitAutograd, m) {
  m.impl("loop_optimizer_step", &loop_optimizer_step_op);
}

PYBIND11_MODULE(_triaccel, m) {
  m.doc() = "triaccel's C++ engine (use the triaccel package, not this module)";
  triaccel::model_register({"python", "a torch.nn.Module passed to triaccel.train (Python)",
                            triaccel::ModelInput::kAny, /*double_backward=*/true, /*local_learning=*/false,
                            &python_model_unbuilt});
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const triaccel::UserError& e) {
      PyErr_SetString(PyExc_ValueError, e.message([](const std::string& key) { return key; }).c_str());
    }
  });
  m.def("train", &train, py::arg("options"), py::arg("units"), py::arg("state"), py::arg("data"),
        py::arg("objective"));
  m.def("plan", &plan, py::arg("options"), py::arg("units"), py::arg("state"), py::arg("data"), py::arg("objective"));
  m.def("report", &report, py::arg("runs"), py::arg("output"), py::arg("csv"), py::arg("title"));
  m.def("options", &options);
  // Whether a run at this `precision` value may compute linear layers in FP8 (the engine's names and aliases; false
  // for a name it does not know, which train() then refuses with its own message).
  m.def("precision_takes_fp8", [](const std::string& precision) {
    triaccel::PrecisionMode mode{};
    return triaccel::enum_try_parse(precision, &mode) && triaccel::fp8_linears(mode);
  });
  // A unit's nn.Linear as the run computes it (python/triaccel/_fp8.py): under amp-fp8 the step's FP8 linears
  // (train/fp8_linear.h), y; None where no override is installed on this thread or it does not take the layer.
  m.def("linear", [](const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias) -> std::optional<at::Tensor> {
    at::Tensor y = triaccel::linear_override_forward(x, weight, bias.value_or(at::Tensor()));
    if (!y.defined()) return std::nullopt;
    return y;
  });
  // The fused BatchNorm(+ReLU) kernel for a unit's BatchNorm2d (python/triaccel/_fused.py): y, or None where it does
  // not apply (models/batch_norm.h).
  m.def("batch_norm_kernel", [](const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                const at::Tensor& running_mean, const at::Tensor& running_var, double momentum,
                                double eps, bool relu) -> std::optional<at::Tensor> {
    try {
      at::Tensor y = triaccel::batch_norm_kernel_try(x, weight, bias, running_mean, running_var, momentum, eps, relu);
      if (!y.defined()) return std::nullopt;
      return y;
    } catch (const c10::OutOfMemoryError& e) {  // torch.OutOfMemoryError, as PyTorch's own ops raise it
      PyErr_SetString(py::module_::import("torch").attr("OutOfMemoryError").ptr(), e.what_without_backtrace());
      throw py::error_already_set();
    }
  });
  using triaccel::api::LoopOptimizer;
  py::class_<LoopOptimizer>(m, "LoopOptimizer")
      .def(py::init(&loop_optimizer_make), py::arg("units"), py::arg("format"), py::arg("beta1"), py::arg("beta2"),
           py::arg("eps"), py::arg("weight_decay"), py::arg("memory_budget"), py::arg("time_budget"),
           py::arg("formats"), py::arg("plan_warmup"), py::arg("replan_every"))
      .def("steps", &LoopOptimizer::steps)
      .def("handle", &LoopOptimizer::handle)
      .def("state_bytes", &LoopOptimizer::state_bytes)
      .def("adamw_fp32_bytes", &LoopOptimizer::adamw_fp32_bytes)
      .def("formats", &LoopOptimizer::formats)
      .def("names", &LoopOptimizer::names)
      .def("last_plan", [](const LoopOptimizer& o) { return o.last_plan().dump(); })
      .def("state_tensors", &LoopOptimizer::state_tensors)
      .def("state_record", [](const LoopOptimizer& o) { return o.state_record().dump(); })
      .def("load", [](LoopOptimizer& o, const triaccel::NamedTensors& tensors, const std::string& record) {
        o.load(tensors, triaccel::Json::parse(record));
      });
}
