"""Automatic units for a torch.nn.Module whose forward traces with torch.fx (docs/python-auto-split.md).

The engine trains a model as an ordered list of units, forward(x) = units[n-1](... units[0](x)), each unit mapping one
tensor to the next and owning its own parameters and buffers. auto_units(model) finds such units for a module that is
neither an nn.Sequential nor has a units() method: it traces the forward, finds the points of the graph where a
single value is live, and cuts there along the module hierarchy (a residual block stays whole: its input is live
across its inside).

Why torch.fx and not torch.export: fx keeps call_module nodes on the user's own submodules and get_attr nodes on the
user's own parameters, so every unit is a GraphModule that holds the model's tensors themselves (no copies; the engine
trains them in place) under the model's own state_dict names. torch.export lifts parameters and buffers into graph
inputs and functionalizes the program (buffer updates become outputs), so its units would neither hold the model's
tensors nor update BatchNorm's running statistics in place.

This file imports only torch and the standard library (not the engine's C++ module), so it can be used and tested on
its own.

Python in the forward that reads self.training outside torch.nn's leaf modules (torchvision's stochastic depth) would
be frozen into the graph in the mode it was traced in: auto_units traces in both modes and, where the two graphs
differ only by such a bool, reads the flag of the module that read it at run time (the unit's own flag at the root).
Where they differ otherwise, the graph is the trace in the model's current mode.

Refused with UntraceableModel: a forward fx cannot trace, one with more than one input (defaulted arguments
included), one that returns anything but one tensor.
"""
import operator

import torch
import torch.fx

__all__ = ["UntraceableModel", "auto_units"]

_HOW_TO_FIX = "give the model a units() method returning its submodules in forward order, or an nn.Sequential"
_COMPUTE_OPS = ("call_module", "call_function", "call_method")
# Nodes whose value is not a tensor (shapes, sizes), so never a unit's output.
_NON_TENSOR_METHODS = {"size", "dim", "numel", "tolist", "item", "stride", "ndimension", "nelement"}
_NON_TENSOR_FUNCTIONS = {getattr, len}
_NORM_TYPES = tuple(t for t in (torch.nn.modules.batchnorm._NormBase, torch.nn.LayerNorm, torch.nn.GroupNorm,
                                getattr(torch.nn, "RMSNorm", None)) if t is not None)


class UntraceableModel(TypeError):
    """The model cannot be split automatically (fx could not trace it, or its forward is not one tensor in, one
    tensor out). The message says why in one line and how to fix it."""


def _untraceable(model, why):
    return UntraceableModel(f"cannot split {type(model).__name__} into units automatically: {why}; {_HOW_TO_FIX}")


class _Piece:
    """A contiguous range of graph nodes, positions (s, e], inside the module `path` (stack depth `depth`:
    the first `depth` entries of each node's nn_module_stack are the module call the piece lies in)."""

    def __init__(self, s, e, depth, path, whole_module):
        self.s, self.e, self.depth, self.path = s, e, depth, path
        self.whole_module = whole_module  # every node comes from one call of the module `path`
        self.final = False


class _Graph:
    """The traced graph with what the split needs per position: the module stack, compute or not, the single live
    value after it (None where zero or several values are live, or the one live value is not a tensor)."""

    def __init__(self, model, graph):
        self.model = model
        self.nodes = list(graph.nodes)
        index = {n: i for i, n in enumerate(self.nodes)}
        self.stack = []
        for n in self.nodes:
            st = n.meta.get("nn_module_stack") or {}
            self.stack.append([(key, value[0]) for key, value in st.items()])
        self.compute = [n.op in _COMPUTE_OPS for n in self.nodes]
        self.span = {}  # a module call's key: (first, last) position of its compute nodes
        for i, st in enumerate(self.stack):
            if self.compute[i]:
                for key, _ in st:
                    first, _ = self.span.get(key, (i, i))
                    self.span[key] = (first, i)
        ends_at = {}
        for i, n in enumerate(self.nodes):
            if n.op == "get_attr" or not n.users:
                continue
            last = max(index[u] for u in n.users)
            ends_at.setdefault(last, []).append(n)
        live, self.single = set(), [None] * len(self.nodes)
        for i, n in enumerate(self.nodes):
            if n.op != "get_attr" and n.users:
                live.add(n)
            for done in ends_at.get(i, ()):
                live.discard(done)
            if len(live) == 1:
                (value,) = live
                if self._may_be_tensor(value):
                    self.single[i] = value

    @staticmethod
    def _may_be_tensor(n):
        if n.op == "call_method" and n.target in _NON_TENSOR_METHODS:
            return False
        if n.op == "call_function" and n.target in _NON_TENSOR_FUNCTIONS:
            return False
        # A module or function returning a tuple (nn.MultiheadAttention, torch.chunk): only indexed by ints.
        return not all(u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
                       for u in n.users)

    def key(self, i, depth):
        """The call of a direct child of the piece's module that node i lies in (None: the module's own node)."""
        st = self.stack[i]
        return st[depth][0] if len(st) > depth else None

    def key_path(self, i, depth):
        return self.stack[i][depth][1]

    def compute_in(self, s, e):
        return [i for i in range(s + 1, e + 1) if self.compute[i]]


def _cuts(g, piece):
    """The cut positions inside piece on boundaries between different direct children of its module (a run of the
    module's own nodes counts as one), descending into a child that covers the whole piece. [] marks it final."""
    while True:
        comp = g.compute_in(piece.s, piece.e)
        if len(comp) <= 1:
            return []
        keys = [g.key(i, piece.depth) for i in comp]
        cuts = [comp[j] for j in range(len(comp) - 1) if keys[j] != keys[j + 1] and g.single[comp[j]] is not None]
        if cuts:
            return cuts
        if keys[0] is None or any(k != keys[0] for k in keys):
            return []
        piece.path = g.key_path(comp[0], piece.depth)
        piece.depth += 1
        piece.whole_module = True


def _pieces_of(g, piece, cuts):
    out = []
    bounds = [piece.s] + cuts + [piece.e]
    for s, e in zip(bounds, bounds[1:]):
        comp = g.compute_in(s, e)
        keys = {g.key(i, piece.depth) for i in comp}
        if len(keys) == 1 and None not in keys:
            out.append(_Piece(s, e, piece.depth + 1, g.key_path(comp[0], piece.depth), True))
        else:
            out.append(_Piece(s, e, piece.depth, piece.path, False))
    return out


def _balanced(g, piece, cuts, n):
    """n of the cuts, splitting the piece's compute nodes as evenly as possible."""
    comp = g.compute_in(piece.s, piece.e)
    rank = {i: r + 1 for r, i in enumerate(comp)}
    chosen = set()
    for j in range(1, n + 1):
        target = j * len(comp) / (n + 1)
        chosen.add(min((c for c in cuts if c not in chosen), key=lambda c: abs(rank[c] - target)))
    return sorted(chosen)


class _Uses:
    """The state tensors (by identity) a range of nodes uses, and what the merge rules need to know of them."""

    def __init__(self, model, state_ids):
        self.model, self.state_ids = model, state_ids

    def tensors(self, nodes):
        """[(tensor, owner module, by_call_module)] for the parameters and buffers the nodes use, in node order."""
        out = []
        for n in nodes:
            if n.meta.get("triaccel_training_flag"):
                continue
            if n.op == "call_module":
                out += self._of_module(n.target, True)
            for a in n.all_input_nodes:
                if a.op == "get_attr" and not a.meta.get("triaccel_training_flag"):
                    out += self._of_attr(a.target)
            if n.op == "get_attr" and not n.users:
                out += self._of_attr(n.target)
        return out

    def _of_module(self, target, by_call):
        module = self.model.get_submodule(target)
        out = []
        for name, t in module.state_dict(keep_vars=True).items():
            owner = module.get_submodule(name.rpartition(".")[0])
            out.append((t, owner, by_call))
        return out

    def _of_attr(self, target):
        prefix, _, field = target.rpartition(".")
        owner = self.model.get_submodule(prefix)
        value = getattr(owner, field)
        if isinstance(value, torch.nn.Module):
            return self._of_module(target, False)
        if isinstance(value, torch.Tensor) and id(value) in self.state_ids:
            return [(value, owner, False)]
        return []

    def absorbable(self, g, piece):
        """True when the piece joins a neighbour: no parameters, only normalization layers' parameters, or only
        parameters reached through get_attr (bare parameters such as ViT's class_token), unless the piece is one
        module's own call using that module's own parameters."""
        params = [(t, owner, by_call) for t, owner, by_call in self.tensors(g.nodes[piece.s + 1:piece.e + 1])
                  if isinstance(t, torch.nn.Parameter)]
        if not params:
            return True
        if all(isinstance(owner, _NORM_TYPES) for _, owner, _ in params):
            return True
        if any(by_call for _, _, by_call in params):
            return False
        if piece.whole_module:
            module = self.model.get_submodule(piece.path)
            own = {id(p) for p in module.parameters()}
            if all(id(t) in own for t, _, _ in params):
                return False
        return True


def _merge(pieces, absorbable):
    """Groups of pieces: an absorbable piece joins the group before it; leading ones join the first group."""
    groups, leading = [], []
    for p, a in zip(pieces, absorbable):
        if a:
            (groups[-1] if groups else leading).append(p)
        else:
            groups.append(leading + [p])
            leading = []
    if leading:
        groups.append(leading)
    return groups


def _unit_graph(g, s, e, value_in, value_out):
    graph = torch.fx.Graph()
    env = {value_in: graph.placeholder("x")}
    attrs = {}

    def lookup(a):
        if a in env:
            return env[a]
        if a.op == "get_attr":
            if a.target not in attrs:
                attrs[a.target] = graph.get_attr(a.target)
                attrs[a.target].meta = dict(a.meta)
            return attrs[a.target]
        raise RuntimeError(f"node {a.name} is used outside the unit that defines it")  # a cut-detection bug

    for n in g.nodes[s + 1:e + 1]:
        if n.op == "get_attr":
            continue
        env[n] = graph.node_copy(n, lookup)
    graph.output(lookup(value_out))
    return graph


def _trace_in(model, training):
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.train(training)
        return torch.fx.Tracer().trace(model)
    finally:
        for m, mode in modes:
            m.training = mode


class _Flag:
    """Where the train-mode trace has a constant True (inverted: False) and the eval-mode trace its opposite."""

    def __init__(self, inverted):
        self.inverted = inverted


def _merge_args(a, b, index_a, index_b):
    """a (train trace) with _Flag where the two traces differ only by a bool; None if they differ otherwise."""
    if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
        ok = isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node) and index_a[a] == index_b[b]
        return a if ok else None
    if isinstance(a, bool) and isinstance(b, bool):
        return a if a == b else _Flag(inverted=not a)
    if type(a) is not type(b):
        return None
    if isinstance(a, (tuple, list)):
        if len(a) != len(b):
            return None
        out = [_merge_args(x, y, index_a, index_b) for x, y in zip(a, b)]
        if any(o is None and x is not None for o, x in zip(out, a)):
            return None
        return type(a)(out)
    if isinstance(a, dict):
        if list(a) != list(b):
            return None
        out = {k: _merge_args(a[k], b[k], index_a, index_b) for k in a}
        if any(out[k] is None and a[k] is not None for k in a):
            return None
        return out
    if isinstance(a, slice):
        parts = _merge_args((a.start, a.stop, a.step), (b.start, b.stop, b.step), index_a, index_b)
        return None if parts is None else slice(*parts)
    try:
        return a if a is b or bool(a == b) else None
    except Exception:
        return None


def _same_target(model, a, b):
    """The same target, or two get_attr of equal constants: each trace stores the tensors the forward makes (a
    torch.tensor(...) in forward) on the model as _tensor_constant<i>, under a new name each time."""
    if a.target == b.target:
        return True
    if a.op != "get_attr":
        return False
    x, y = _attr(model, a.target), _attr(model, b.target)
    if x is y:
        return True
    return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
            and x.shape == y.shape and x.device == y.device and bool(torch.equal(x, y)))


def _attr(model, target):
    value = model
    for field in target.split("."):
        value = getattr(value, field)
    return value


def _trace(model):
    """The forward's fx graph. Where the forward reads self.training outside torch.nn's leaf modules (torchvision's
    stochastic depth: stochastic_depth(x, p, mode, self.training)), the train- and eval-mode traces differ by a bool;
    that bool becomes a read of the training flag of the module whose forward read it, at run time. Where the two
    traces differ otherwise, the graph is the trace in the model's current mode."""
    try:
        train, evaluate = _trace_in(model, True), _trace_in(model, False)
    except Exception:
        train = evaluate = None
    if train is not None:
        nodes_a, nodes_b = list(train.nodes), list(evaluate.nodes)
        same = len(nodes_a) == len(nodes_b)
        index_a = {n: i for i, n in enumerate(nodes_a)}
        index_b = {n: i for i, n in enumerate(nodes_b)}
        merged = []
        for a, b in zip(nodes_a, nodes_b) if same else ():
            args = _merge_args((a.args, a.kwargs), (b.args, b.kwargs), index_a, index_b)
            if a.op != b.op or not _same_target(model, a, b) or args is None:
                same = False
                break
            merged.append(args)
        if same:
            for a, (args, kwargs) in zip(nodes_a, merged):
                flags = []
                torch.fx.node.map_aggregate((args, kwargs), lambda v: flags.append(v) if isinstance(v, _Flag) else v)
                if flags:
                    _read_training(train, a, args, kwargs)
            return train
    try:
        return _trace_in(model, model.training)
    except Exception as e:  # TraceError, control flow on a Proxy, an unsupported op, ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise _untraceable(model, f"torch.fx cannot trace its forward ({type(e).__name__}: {first})") from e


def _read_training(graph, node, args, kwargs):
    """Replaces node's _Flag arguments by a run-time read of `training` of the innermost module on its stack (the
    unit's own flag where that module is the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    meta = {"nn_module_stack": stack.copy(), "triaccel_training_flag": True}
    with graph.inserting_before(node):
        if stack:
            module = graph.get_attr(list(stack.values())[-1][0])
            flag = graph.call_function(getattr, (module, "training"))
            module.meta.update(meta)
        else:
            flag = graph.get_attr("training")
        flag.meta.update(meta)
        inverted = graph.call_function(operator.not_, (flag,))
        inverted.meta.update(meta)

    def put(v):
        return (inverted if v.inverted else flag) if isinstance(v, _Flag) else v
    node.args = torch.fx.node.map_aggregate(args, put)
    node.kwargs = torch.fx.node.map_aggregate(kwargs, put)
    if not inverted.users:
        graph.erase_node(inverted)


def auto_units(model: torch.nn.Module, max_units: int = 32):
    """[(unit_name, unit_module, owned_state_names)] in forward order, for a model whose forward (one tensor in, one
    tensor out) traces with torch.fx. unit_module is a torch.fx.GraphModule over the model's own submodules and
    parameters; owned_state_names are the model.state_dict() names of the tensors the unit owns (each tensor once,
    tied tensors under their first name, by the first unit that uses them), in state_dict order. Raises
    UntraceableModel when the model cannot be traced or is not one tensor in, one tensor out."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"auto_units() takes a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(max_units, int) or max_units < 1:
        raise ValueError(f"max_units must be a positive int, got {max_units!r}")
    before = set(model.__dict__)
    try:
        return _auto_units(model, max_units, _trace(model))
    finally:
        # fx's tracer stores the tensors the forward makes as model._tensor_constant<i>; the units hold their own
        # references (as their buffers), so the model is left as it was.
        for key in [k for k in model.__dict__ if k not in before and k.startswith("_tensor_constant")]:
            del model.__dict__[key]


def _auto_units(model, max_units, graph):
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise _untraceable(model, f"its forward takes {len(inputs)} inputs ({', '.join(n.target for n in inputs)}), "
                                  "a unit takes one tensor")
    (out_node,) = [n for n in graph.nodes if n.op == "output"]
    result = out_node.args[0]
    if not isinstance(result, torch.fx.Node):
        raise _untraceable(model, f"its forward returns a {type(result).__name__}, not one tensor")

    g = _Graph(model, graph)
    state = model.state_dict(keep_vars=True)
    first_name = {}
    for name, t in state.items():
        first_name.setdefault(id(t), name)
    uses = _Uses(model, set(first_name))

    # Split: the piece with the most compute nodes first, while the units after merging stay within max_units.
    last = len(g.nodes) - 2  # the node before the output
    pieces = [_Piece(0, last, 0, "", True)]
    absorb = {}

    def is_absorbable(p):
        if (p.s, p.e, p.path) not in absorb:
            absorb[(p.s, p.e, p.path)] = uses.absorbable(g, p)
        return absorb[(p.s, p.e, p.path)]

    def merged_count(ps):
        return len(_merge(ps, [is_absorbable(p) for p in ps]))

    while True:
        open_pieces = [p for p in pieces if not p.final]
        if not open_pieces:
            break
        piece = max(open_pieces, key=lambda p: len(g.compute_in(p.s, p.e)))
        cuts = _cuts(g, piece)
        at = pieces.index(piece)

        def trial(n):  # the pieces with n of the cuts, and whether they merge into max_units units at most
            chosen = cuts if n == len(cuts) else _balanced(g, piece, cuts, n)
            out = pieces[:at] + _pieces_of(g, piece, chosen) + pieces[at + 1:]
            return out, merged_count(out) <= max_units

        best = None
        if cuts:
            best, fits = trial(len(cuts))
            if not fits:  # the most cuts that still fit (binary search; merged counts grow with the cuts)
                best, lo, hi = None, 1, len(cuts) - 1
                while lo <= hi:
                    mid = (lo + hi) // 2
                    out, fits = trial(mid)
                    if fits:
                        best, lo = out, mid + 1
                    else:
                        hi = mid - 1
        if best is None:
            piece.final = True
        else:
            pieces = best

    # Merge, name, build.
    groups = _merge(pieces, [is_absorbable(p) for p in pieces])
    units, names = [], set()
    value_in = g.nodes[0]
    for k, group in enumerate(groups):
        s, e = group[0].s, group[-1].e
        value_out = result if k == len(groups) - 1 else g.single[e]
        name = _unit_name(g, group, is_absorbable, k)
        unique, n = name, 0
        while unique in names:
            n += 1
            unique = f"{name}.{n}"
        names.add(unique)
        module = torch.fx.GraphModule(model, _unit_graph(g, s, e, value_in, value_out), class_name="Unit")
        # fx's call wrapper prints the generated code's frame to stderr on any exception; the engine retries an
        # out-of-memory error in a unit as part of its plan, so the unit is called as a plain module (its class is
        # this instance's own).
        type(module).__call__ = torch.nn.Module.__call__
        units.append([unique, module])
        value_in = value_out

    # Ownership: the first unit that uses a tensor owns it, under its first state_dict name.
    owner = {}
    for k, (_, module) in enumerate(units):
        for t, _, _ in uses.tensors(module.graph.nodes):
            owner.setdefault(id(t), k)
    # A tensor no node uses (an unused parameter, BatchNorm's num_batches_tracked in a traced-through norm) goes to
    # the unit owning the other tensors of its module, else of its parent module's other tensors, else the last unit.
    for name, t in state.items():
        if id(t) in owner:
            continue
        prefixes = []
        module_path = name.rpartition(".")[0]
        if module_path:
            prefixes.append(module_path + ".")
            parent = module_path.rpartition(".")[0]
            if parent:
                prefixes.append(parent + ".")
        owner[id(t)] = len(units) - 1
        for prefix in prefixes:
            found = [owner[id(u)] for m, u in state.items() if m.startswith(prefix) and id(u) in owner and u is not t]
            if found:
                owner[id(t)] = found[0]
                break
    owned = [[] for _ in units]
    for name, t in state.items():
        if first_name[id(t)] == name:
            owned[owner[id(t)]].append(name)
    return [(name, module, owned[k]) for k, (name, module) in enumerate(units)]


def _unit_name(g, group, is_absorbable, k):
    """The outermost module whose call is exactly the unit's compute nodes (a Sequential stem conv+bn+relu: "stem");
    else the path of the unit's first piece that calls a module with parameters, else of its first piece that is
    not absorbable, else of its first piece. The root's path "" becomes the model's child that holds the unit's first
    module with parameters (else unit<k>)."""
    s, e = group[0].s, group[-1].e
    comp = g.compute_in(s, e)
    if comp:
        common = [key for key, _ in g.stack[comp[0]]]
        for i in comp[1:]:
            keys = [key for key, _ in g.stack[i]]
            n = 0
            while n < min(len(common), len(keys)) and common[n] == keys[n]:
                n += 1
            common = common[:n]
        for d in range(len(common)):
            first, last = g.span[common[d]]
            if s < first and last <= e:
                return g.stack[comp[0]][d][1]

    def param_calls(p):
        return [i for i in range(p.s + 1, p.e + 1) if g.nodes[i].op == "call_module"
                and any(True for _ in g.model.get_submodule(g.nodes[i].target).parameters())]

    anchor = next((p for p in group if param_calls(p)), None) or \
        next((p for p in group if not is_absorbable(p)), group[0])
    if anchor.path:
        return anchor.path
    calls = [i for p in group for i in param_calls(p)]
    return g.stack[calls[0]][0][1] if calls else f"unit{k}"
