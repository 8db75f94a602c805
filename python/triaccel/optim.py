"""triaccel's optimizers for your own PyTorch training loop (docs/python.md, "Optimizers").

    opt = triaccel.optim.BAOC(model.named_parameters(), memory_budget="25%", lr=1e-3)
    opt = triaccel.optim.AdamW8bit(model.named_parameters(), lr=1e-3)
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

They are torch.optim.Optimizer subclasses (one parameter group; LR schedulers work) running triaccel's C++ optimizer:
its fused CUDA kernels on a GPU, their reference on the CPU. BAOC trains in fp32 AdamW for `plan_warmup` steps while
it measures each unit's gradient statistics, then gives every unit (the module that owns a parameter) the optimizer-
state format that fits `memory_budget` at the least risk (docs/baoc.md). Weight decay is decoupled and skips tensors
of dimension <= 1 (norms, biases). state_dict() / load_state_dict() continue a run exactly.

step() is one torch op, torch.ops.triaccel.loop_optimizer_step, so torch.compile traces it into its graph (no graph
break) and a CUDA graph can capture it. Give lr as a tensor on the parameters' device (lr=torch.tensor(1e-3,
device="cuda")) for a captured step to read the current learning rate when it is replayed (a float is copied in when
the step is captured), and capture BAOC only after its plan (plan_warmup steps, replan_every=0).
"""
import json

import torch

from . import _triaccel

__all__ = ["AdamW", "AdamW8bit", "BAOC"]


def _named(params):
    params = list(params)
    if params and isinstance(params[0], dict):
        raise TypeError("triaccel.optim takes one group of parameters: model.named_parameters() or a list of tensors")
    if params and isinstance(params[0], (tuple, list)):
        return [(str(n), p) for n, p in params]
    return [(f"param{i}", p) for i, p in enumerate(params)]


def _units(named):
    """Parameters grouped by the module that owns them ("layer1.0.conv1.weight" -> unit "layer1.0.conv1")."""
    units, index = [], {}
    for name, p in named:
        unit = name.rsplit(".", 1)[0] if "." in name else name
        if unit not in index:
            index[unit] = len(units)
            units.append((unit, []))
        units[index[unit]][1].append((name, p))
    return units


class _LoopOptimizer(torch.optim.Optimizer):
    def __init__(self, params, lr, betas, eps, weight_decay, state_format, memory_budget="25%", time_budget="",
                 formats="", plan_warmup=50, replan_every=0):
        named = [(n, p) for n, p in _named(params) if p.requires_grad]
        if not named:
            raise ValueError("the optimizer got no parameters that require gradients")
        super().__init__([p for _, p in named], dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._lr = torch.zeros((), dtype=torch.float32, device=named[0][1].device)
        self._engine = _triaccel.LoopOptimizer(_units(named), state_format, float(betas[0]), float(betas[1]),
                                               float(eps), float(weight_decay), str(memory_budget),
                                               str(time_budget or ""), str(formats or ""), int(plan_warmup),
                                               int(replan_every))
        self._handle = self._engine.handle()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        lr = group["lr"]
        if not isinstance(lr, torch.Tensor):
            self._lr.fill_(lr)
            lr = self._lr
        params = group["params"]
        torch.ops.triaccel.loop_optimizer_step(self._handle, params, [p.grad for p in params], lr)
        return loss

    @property
    def state_bytes(self):
        """Bytes of optimizer state now (fp32 AdamW's would be adamw_fp32_bytes)."""
        return self._engine.state_bytes()

    @property
    def adamw_fp32_bytes(self):
        return self._engine.adamw_fp32_bytes()

    @property
    def formats(self):
        """{parameter name: its state format}."""
        return dict(zip(self._engine.names(), self._engine.formats()))

    @property
    def plan(self):
        """BAOC's latest plan (per unit: format, bytes, risk, signals), None before the first."""
        return json.loads(self._engine.last_plan())

    def state_dict(self):
        return {"triaccel": json.loads(self._engine.state_record()),
                "tensors": {n: t.clone() for n, t in self._engine.state_tensors()},
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]}

    def load_state_dict(self, state_dict):
        if not isinstance(state_dict, dict) or "triaccel" not in state_dict or "tensors" not in state_dict:
            raise ValueError("not a triaccel.optim state_dict (it has no 'triaccel' and 'tensors' entries)")
        self._engine.load(list(state_dict["tensors"].items()), json.dumps(state_dict["triaccel"]))
        for group, saved in zip(self.param_groups, state_dict.get("param_groups", [])):
            group.update(saved)


@torch.library.register_fake("triaccel::loop_optimizer_step")
def _loop_optimizer_step_fake(handle, params, grads, lr):
    return None  # the op updates `params` in place and returns nothing


class AdamW(_LoopOptimizer):
    """AdamW with its state in one format for every tensor: state_format "adamw-fp32" (the default; torch.optim.AdamW's
    trajectory with no decay on norms and biases), "adamw-bf16", "adamw-8bit", "factored", "no-momentum", ..."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, state_format="adamw-fp32"):
        super().__init__(params, lr, betas, eps, weight_decay, state_format)


class AdamW8bit(_LoopOptimizer):
    """AdamW with both moments in 8 bits (blocks of 256 with a float32 scale): about a quarter of fp32 AdamW's state."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, lr, betas, eps, weight_decay, "adamw-8bit")


class BAOC(_LoopOptimizer):
    """Per-unit optimizer-state formats chosen under `memory_budget` ("25%" of fp32 AdamW's state, or a size such as
    "200MB") and an optional `time_budget` ("1.1x" fp32 AdamW's step time), from `plan_warmup` steps of gradient
    statistics; `replan_every` > 0 re-plans that often. `formats`: the menu, e.g. "adamw-8bit,factored" (default:
    all)."""

    def __init__(self, params, memory_budget="25%", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 time_budget="", formats="", plan_warmup=50, replan_every=0):
        super().__init__(params, lr, betas, eps, weight_decay, "baoc", memory_budget, time_budget, formats,
                         plan_warmup, replan_every)
