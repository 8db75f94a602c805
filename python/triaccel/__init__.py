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
import json
import os

import torch  # loads LibTorch before the engine, which links it

from . import _triaccel
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
    return out


def units(model):
    """The model's units as [(name, [modules])]: a Sequential's children, or what model.units() returns, with each
    parameterless module joined to the unit before it (the first ones to the first unit with parameters)."""
    if hasattr(model, "units") and callable(model.units):
        names = {id(m): n for n, m in model.named_modules()}
        listed = list(model.units())
        for m in listed:
            if not isinstance(m, torch.nn.Module) or id(m) not in names or names[id(m)] == "":
                raise TypeError("units() must return submodules of the model, in the order its forward runs them")
        pairs = [(names[id(m)], m) for m in listed]
    elif isinstance(model, torch.nn.Sequential):
        pairs = list(model.named_children())
    else:
        raise TypeError(f"model is a {type(model).__name__}: triaccel trains a torch.nn.Sequential whose children are "
                        "the units, or a module with a units() method returning them in order")
    groups, leading = [], []
    for name, module in pairs:
        has_params = any(True for _ in module.parameters())
        if has_params:
            groups.append((name, leading + [module]))
            leading = []
        elif groups:
            groups[-1][1].append(module)
        else:
            leading.append(module)
    if not groups:
        raise ValueError("the model has no parameters: there is nothing to train")
    return groups


def _model_spec(model):
    """(units, state) for the engine: units as (name, [modules], [path]); state_dict entries as (name, tensor,
    is_parameter). Checks that every parameter is in exactly one unit and no tensor appears under two names."""
    groups = units(model)
    owner = {}
    for name, modules in groups:
        for module in modules:
            for p in module.parameters():
                if id(p) in owner and owner[id(p)] != name:
                    raise ValueError(f"a parameter is in units '{owner[id(p)]}' and '{name}'; units must not overlap")
                owner[id(p)] = name
    for pname, p in model.named_parameters():
        if id(p) not in owner:
            raise ValueError(f"parameter '{pname}' is in none of the units; every parameter must belong to one unit "
                             "(a Sequential child, or a module units() returns)")
    params = {id(p) for p in model.parameters()}
    seen, state = {}, []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            raise ValueError(f"'{seen[id(tensor)]}' and '{name}' are one tensor (tied weights); triaccel needs every "
                             "tensor under one name")
        seen[id(tensor)] = name
        state.append((name, tensor, id(tensor) in params))  # keep_vars: the Parameter objects themselves
    return [(name, modules, [name]) for name, modules in groups], state


def _device_of(opts):
    device = opts.get("device", "auto")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _split(fn, which, pair):
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        raise TypeError(f"{fn}() {which}= takes a pair (images, labels)")
    images, labels = (torch.as_tensor(x) for x in pair)
    return images, labels


def _inputs(fn, model, train_data, test_data, dataset, given):
    opts = _options_json(fn, given)
    if train_data is not None:
        if dataset is not None:
            raise TypeError(f"{fn}() takes train=(images, labels) or dataset=NAME, not both")
        if test_data is None:
            raise TypeError(f"{fn}() needs test=(images, labels) with train=(images, labels): it evaluates every epoch")
        data = _split(fn, "train", train_data) + _split(fn, "test", test_data)
        opts["dataset"] = "tensors"
    else:
        if test_data is not None:
            raise TypeError(f"{fn}() got test= without train=")
        data = None
        if dataset is not None:
            opts["dataset"] = os.fspath(dataset)
    if isinstance(model, str):
        opts["model"] = model
        return opts, [], [], data
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{fn}() model must be a torch.nn.Module or a built-in model's name, got "
                        f"{type(model).__name__}")
    opts["model"] = "python"
    model.to(_device_of(opts))
    unit_specs, state = _model_spec(model)
    return opts, unit_specs, state, data


def train(model, train=None, test=None, dataset=None, **options):
    """Trains `model` (a torch.nn.Module, trained in place, or a built-in model's name) on train=(images, labels)
    with test=(images, labels) evaluated every epoch, or on a named dataset (dataset="fashion-mnist", data_dir=...).
    Images are (N, C, H, W) or (N, H, W), uint8 or float in [0, 1]; labels (N) class indices. Returns the run's
    summary (test_acc, steps, peak memory, ...). Options by key: epochs, batch_size, lr, precision, method, optimizer,
    vram_budget, device, out, resume, ... (triaccel.options()). Ctrl-C stops at the step with a checkpoint to resume
    from (resume=OUT). Raises ValueError for a bad value, TypeError for an unknown option."""
    opts, unit_specs, state, data = _inputs("train", model, train, test, dataset, options)
    return json.loads(_triaccel.train(json.dumps(opts), unit_specs, state, data))


def plan(model, train=None, test=None, dataset=None, **options):
    """The plan a run would follow (model units, memory plan under vram_budget, BAOC's optimizer-state plan),
    computed on a copy of the model (BAOC's plan warms up a few steps) without writing any file."""
    if isinstance(model, torch.nn.Module):
        model = copy.deepcopy(model)
    opts, unit_specs, state, data = _inputs("plan", model, train, test, dataset, options)
    return json.loads(_triaccel.plan(json.dumps(opts), unit_specs, state, data))


def report(runs, output="report.html", csv=None, title="triaccel report"):
    """One self-contained HTML page and a CSV table of the runs (folders holding events.jsonl)."""
    if isinstance(runs, (str, os.PathLike)):
        runs = [runs]
    return _triaccel.report([os.fspath(r) for r in runs], os.fspath(output), os.fspath(csv) if csv else "", title)
