"""triaccel: train your own torch.nn.Module with triaccel's C++ engine (docs/python.md).

    import torch, triaccel
    summary = triaccel.train(model, train=(images, labels), test=(images, labels), epochs=1, batch_size=128)
    summary = triaccel.train(model, dataset="fashion-mnist", epochs=1, device="cpu", out="runs/f")
    plan = triaccel.plan(model, train=(images, labels), test=(images, labels), batch_size=96, vram_budget="0.5GB")
    triaccel.report(["runs/f"], output="report.html")

The model is a torch.nn.Sequential whose children are its units, or any module with a units() method returning
them in order; the engine does the rest (per-unit precision, CUDA graphs, budgets, checkpoints, events.jsonl). The
weights are trained in place, and OUT/model.pt loads into a fresh copy of the module with load_state_dict. Every
option of `triaccel train --help` is a keyword argument under its key (batch_size, vram_budget, ...).
"""
import copy
import gc
import json
import os
import sys

import torch  # loads LibTorch before the engine, which links it

from . import _triaccel
from . import _data
from . import _fp8
from . import _fused
from . import _split
from . import optim

__all__ = ["train", "plan", "report", "options", "units", "optim"]

_OPTIONS = {key: (default, doc) for key, default, doc in _triaccel.options()}
# Given through their own arguments, not as options.
_OWN_ARGUMENTS = {"model", "dataset"}


def options():
    """Every option: {key: (default, help)}, as `triaccel train --help` lists them."""
    return dict(_OPTIONS)


def _options_json(fn, given):
    out = {}
    for key, value in given.items():
        if key not in _OPTIONS or key in _OWN_ARGUMENTS:
            raise TypeError(f"{fn}() got an unknown option '{key}'; triaccel.options() lists them")
        if value is None:
            continue
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, (bool, int, float, str)):
            raise TypeError(f"{fn}() option '{key}' takes a bool, int, float or str, got {type(value).__name__}")
        out[key] = value
    if isinstance(out.get("nproc"), int) and not isinstance(out["nproc"], bool) and out["nproc"] > 1:
        raise ValueError(f"{fn}() nproc={out['nproc']}: from Python the processes are yours to start: run the script "
                         f"with torchrun --nproc-per-node {out['nproc']} (each process calls {fn}() with the same "
                         "model, data and options, and trains its share of every batch) and leave nproc at 1 "
                         "(docs/python.md, 'Several GPUs')")
    return out


def units(model):
    """The model's units as [(name, [modules])]: a Sequential's children, or what model.units() returns, with each
    parameterless module joined to the unit before it (the first ones to the first unit with parameters); any other
    module is split automatically (torch.fx, docs/python.md: each unit one GraphModule on the model's own modules)."""
    return [(name, modules) for name, modules, _ in _split_model(model)[0]]


def _split_model(model):
    """([(name, [callables], owned)], how): the units, each with the state_dict names of the tensors it owns (None:
    owned by identity below), and how they were found ("sequential", "units()", "auto", or "whole model: why")."""
    if hasattr(model, "units") and callable(model.units):
        names = {id(m): n for n, m in model.named_modules()}
        listed = list(model.units())
        for m in listed:
            if not isinstance(m, torch.nn.Module) or id(m) not in names or names[id(m)] == "":
                raise TypeError("units() must return submodules of the model, in the order its forward runs them")
        pairs, how = [(names[id(m)], m) for m in listed], "units()"
    elif isinstance(model, torch.nn.Sequential):
        pairs, how = list(model.named_children()), "sequential"
    else:
        try:
            found = _split.auto_units(model)
        except _split.UntraceableModel as e:
            print(f"triaccel: {e}; training the whole model as one unit", file=sys.stderr)
            return [("model", [model], None)], f"whole model: {e}"
        for _, module, _ in found:
            _fused.fuse_batch_norms(module)  # the engine's BatchNorm(+ReLU) kernel on the GPU
        return [(name, [module], owned) for name, module, owned in found], "auto"
    groups, leading = [], []
    for name, module in pairs:
        has_params = any(True for _ in module.parameters())
        if has_params:
            groups.append((name, leading + [module], None))
            leading = []
        elif groups:
            groups[-1][1].append(module)
        else:
            leading.append(module)
    if not groups:
        raise ValueError("the model has no parameters: there is nothing to train")
    return groups, how


def _model_spec(model):
    """(units, state, aliases, how) for the engine: units as (name, [modules], [owned state names]); state_dict
    entries as (name, tensor, is_parameter), each tensor once under its first name; aliases {later name: first name}
    of tied tensors (one tensor under several names: owned by one unit, trained once). Checks that every parameter
    belongs to a unit."""
    groups, how = _split_model(model)
    params = {id(p) for p in model.parameters()}
    first, state, aliases = {}, [], {}
    for name, tensor in model.state_dict(keep_vars=True).items():  # keep_vars: the Parameter objects themselves
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
            continue
        first[id(tensor)] = name
        state.append((name, tensor, id(tensor) in params))
    owned_by = {}
    specs = []
    for name, modules, owned in groups:
        if owned is None:  # a Sequential's or units()'s modules own their tensors, unless an earlier unit does
            owned = []
            for module in modules:
                for t in list(module.parameters()) + list(module.buffers()):
                    if id(t) in first and first[id(t)] not in owned_by and first[id(t)] not in owned:
                        owned.append(first[id(t)])
        for n in owned:
            if n in owned_by:
                raise ValueError(f"'{n}' is owned by units '{owned_by[n]}' and '{name}'; units must not overlap")
            owned_by[n] = name
        specs.append((name, modules, list(owned)))
    for pname, p in model.named_parameters():
        if first[id(p)] not in owned_by:
            raise ValueError(f"parameter '{pname}' is in none of the units; every parameter must belong to one unit "
                             "(a Sequential child, or a module units() returns)")
    return specs, state, aliases, how


def _state_dict_write(model, path):
    """OUT/model.pt as the module's own state_dict, tied names included (the engine writes each tensor once)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save({k: v.detach().to("cpu") for k, v in model.state_dict().items()}, tmp)
    os.replace(tmp, path)


def _device_of(opts):
    device = opts.get("device", "auto")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _pair_of(fn, which, pair):
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        raise TypeError(f"{fn}() {which}= takes a pair (inputs, targets), a torch Dataset or a DataLoader")
    images, labels = (torch.as_tensor(x) for x in pair)
    return images, labels


def _is_images(x, y):
    """Pixels the engine normalizes and augments: (N, C, H, W) or (N, H, W) uint8 or floats in [0, 1] with one
    integer class per image. Anything else is passed to the model as it is."""
    if x.dim() not in (3, 4) or y.dim() != 1 or y.is_floating_point() or y.dtype == torch.bool:
        return False
    if x.dtype == torch.uint8:
        return True
    return x.is_floating_point() and x.numel() > 0 and float(x.min()) >= 0.0 and float(x.max()) <= 1.0


def _data_spec(fn, train_data, test_data, dataset, opts, loss):
    """(data for the engine, the targets' dtype or None): None for a named dataset, else (kind, train, test)."""
    if train_data is None:
        if test_data is not None:
            raise TypeError(f"{fn}() got test= without train=")
        if dataset is not None:
            opts["dataset"] = os.fspath(dataset)
        return None, None
    if dataset is not None:
        raise TypeError(f"{fn}() takes train=... or dataset=NAME, not both")
    if test_data is None:
        raise TypeError(f"{fn}() needs test= with train=: it evaluates every epoch")
    cuda = _device_of(opts).startswith("cuda")
    splits, target_dtype = [], None
    for which, given in (("train", train_data), ("test", test_data)):
        served, loader_batch = _data.served_from(given, which, cuda, "batch_size" in opts)
        if served is not None:
            if which == "train" and loader_batch is not None:
                opts.setdefault("batch_size", loader_batch)
            if target_dtype is None:
                target_dtype = served.fetch(0, [0])[1].dtype
            splits.append(served)
        else:
            splits.append(_pair_of(fn, which, given))
            target_dtype = target_dtype or splits[-1][1].dtype
    tensors = [s for s in splits if isinstance(s, tuple)]
    images = len(tensors) == 2 and loss is None and all(_is_images(x, y) for x, y in tensors)
    opts["dataset"] = "tensors"
    return ("images" if images else "raw", splits[0], splits[1]), target_dtype


def _accuracy(output, target):
    """The share of predictions (argmax over the last dimension) equal to the integer target."""
    return (output.argmax(-1) == target).float().mean()


def _objective(loss, metric, target_dtype):
    """(loss, metric) for the engine, or None for its cross-entropy and accuracy."""
    if loss is None:
        if metric is not None:
            raise TypeError("metric= needs loss= (the built-in loss reports accuracy)")
        return None
    if not callable(loss) or (metric is not None and not callable(metric)):
        raise TypeError("loss= and metric= take callables (output, target) -> a scalar tensor")
    if metric is None and target_dtype is not None and not target_dtype.is_floating_point:
        metric = _accuracy
    return loss, metric


def _inputs(fn, model, train_data, test_data, dataset, given, loss=None, metric=None):
    opts = _options_json(fn, given)
    data, target_dtype = _data_spec(fn, train_data, test_data, dataset, opts, loss)
    objective = _objective(loss, metric, target_dtype)
    if isinstance(model, str):
        if data is not None and data[0] == "raw" or objective is not None:
            raise TypeError(f"{fn}() trains a built-in model on its images or a named dataset; a Dataset, a "
                            "DataLoader, tensors other than images and loss= need a torch.nn.Module")
        opts["model"] = model
        return opts, ([], {}, "built-in"), [], data, objective
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{fn}() model must be a torch.nn.Module or a built-in model's name, got "
                        f"{type(model).__name__}")
    opts["model"] = "python"
    model.to(_device_of(opts))
    unit_specs, state, aliases, how = _model_spec(model)
    return opts, (unit_specs, aliases, how), state, data, objective


def train(model, train=None, test=None, dataset=None, loss=None, metric=None, **options):
    """Trains `model` (a torch.nn.Module, trained in place, or a built-in model's name) and evaluates it every epoch.

    Data: train=(inputs, targets) with test=(inputs, targets); or a torch Dataset of (input, target) pairs or a
    DataLoader over one (its transforms, collate_fn and workers; the engine draws the order) for either; or a named
    dataset (dataset="fashion-mnist", data_dir=...). Images (N, C, H, W) or (N, H, W), uint8 or float in [0, 1], with
    class indices (N) are normalized and augmented by the engine; any other tensors reach the model as they are.
    loss=fn(output, target) -> the batch's mean loss (default: cross-entropy over the last dimension); metric=fn(output,
    target) -> the batch's mean (default with integer targets: accuracy). Returns the run's summary (test_acc,
    test_loss, steps, peak memory, the units found, ...). Options by key: epochs, batch_size, lr, precision, method, optimizer,
    vram_budget, device, out, resume, ... (triaccel.options()). Ctrl-C stops at the step with a checkpoint to resume
    from (resume=OUT). Raises ValueError for a bad value, TypeError for an unknown option or argument."""
    opts, (unit_specs, aliases, how), state, data, objective = _inputs("train", model, train, test, dataset, options,
                                                                       loss, metric)
    gc.collect()  # tensors of earlier runs held only by reference cycles leave the GPU before this one is planned
    fp8 = _triaccel.precision_takes_fp8(str(opts.get("precision", "")))
    with _data.host_threads_for(data[1:] if data else (), _device_of(opts).startswith("cuda")), \
            _fp8.engine_linears(model if fp8 else None):
        summary = json.loads(_triaccel.train(json.dumps(opts), unit_specs, state, data, objective))
    out = opts.get("out", _OPTIONS["out"][0])
    if aliases and os.path.exists(os.path.join(out, "model.pt")):
        _state_dict_write(model, os.path.join(out, "model.pt"))
    if objective is not None and objective[1] is None:
        for key in ("test_acc", "train_acc"):
            if key in summary:
                summary[key] = None  # no metric: the engine's zeros mean nothing
    if unit_specs:
        summary["units"] = [name for name, _, _ in unit_specs]
        summary["units_found"] = how
        summary["fused_batch_norms"] = sum(isinstance(m, _fused.FusedBatchNorm) for _, modules, _ in unit_specs
                                           for unit in modules for m in unit.modules())
    return summary


def plan(model, train=None, test=None, dataset=None, loss=None, metric=None, **options):
    """The plan a run would follow (model units, memory plan under vram_budget, BAOC's optimizer-state plan),
    computed on a copy of the model (BAOC's plan warms up a few steps) without writing any file."""
    if isinstance(model, torch.nn.Module):
        model = copy.deepcopy(model)
    opts, (unit_specs, _, how), state, data, objective = _inputs("plan", model, train, test, dataset, options, loss,
                                                                 metric)
    result = json.loads(_triaccel.plan(json.dumps(opts), unit_specs, state, data, objective))
    if unit_specs:
        result["units_found"] = how
    return result


def report(runs, output="report.html", csv=None, title="triaccel report"):
    """One self-contained HTML page and a CSV table of the runs (folders holding events.jsonl)."""
    if isinstance(runs, (str, os.PathLike)):
        runs = [runs]
    return _triaccel.report([os.fspath(r) for r in runs], os.fspath(output), os.fspath(csv) if csv else "", title)
