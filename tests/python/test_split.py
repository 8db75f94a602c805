#!/usr/bin/env python3
"""triaccel._split.auto_units (docs/python-auto-split.md): the units it finds for small models written here and for
torchvision's ResNet-18/50, MobileNetV3-Small, ConvNeXt-Tiny and ViT-B/16; that the units composed compute the model's
forward exactly; that every state tensor is owned once (tied weights by their first user, under their first name);
that the units hold the model's own modules and parameters; and the errors for models it cannot split.

Loads python/triaccel/_split.py by its path, so it runs without the engine's C++ module:
    python3 tests/python/test_split.py
"""
import importlib.util
import os
import unittest

import torch
import torch.nn.functional as F
from torch import nn

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "triaccel", "_split.py")
_spec = importlib.util.spec_from_file_location("triaccel_split", _PATH)
split = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(split)


def compose(units, x):
    for _, unit, _ in units:
        x = unit(x)
    return x


def names(units):
    return [name for name, _, _ in units]


def randomize_norms(model, seed=0):
    """Running statistics and affine parameters away from 0/1, so that eval-mode BatchNorm is not the identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.running_mean is not None:
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
    return model


class Checks(unittest.TestCase):
    def assertOwnedOnce(self, model, units):
        state = model.state_dict(keep_vars=True)
        first = {}
        for name, t in state.items():
            first.setdefault(id(t), name)
        owned = [n for _, _, o in units for n in o]
        self.assertEqual(len(owned), len(set(owned)), "a name is owned twice")
        self.assertEqual(sorted(owned), sorted(first.values()), "not every tensor owned once, under its first name")
        for _, _, o in units:  # in state_dict order
            order = [n for n in state if n in o]
            self.assertEqual(o, order)

    def assertOwnTensors(self, model, units):
        """Units reference the model's own submodules and parameters (no copies)."""
        for _, unit, _ in units:
            self.assertIsInstance(unit, torch.fx.GraphModule)
            for node in unit.graph.nodes:
                if node.op == "call_module":
                    self.assertIs(unit.get_submodule(node.target), model.get_submodule(node.target))
            for name, p in unit.named_parameters():
                self.assertIs(p, model.get_parameter(name))

    def assertComposes(self, model, units, x, atol=0.0):
        with torch.no_grad():
            got, want = compose(units, x), model(x)
        self.assertEqual(got.shape, want.shape)
        if atol == 0.0:
            self.assertTrue(torch.equal(got, want), f"max difference {(got - want).abs().max().item()}")
        else:
            torch.testing.assert_close(got, want, atol=atol, rtol=1e-5)


# 1. A small residual CNN ---------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class ResCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.block1 = Block(8)
        self.block2 = Block(8)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        x = self.stem(x)
        x = self.block1(x)
        x = self.block2(x)
        return self.head(torch.flatten(self.pool(x), 1))


# 2. Glue: cat inside a block, flatten/transpose/reshape between units; an int live across modules -----------------
class TwoBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(8, 4, 1)
        self.b = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        return torch.cat([self.a(x), torch.relu(self.b(x))], dim=1)


class Glued(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.mix = TwoBranch()
        self.proj = nn.Linear(8, 6)
        self.head = nn.Linear(6 * 16, 5)

    def forward(self, x):
        x = self.mix(self.stem(x))                  # (B, 8, 4, 4)
        x = x.flatten(2).transpose(1, 2)            # (B, 16, 8)
        x = self.proj(x)                            # (B, 16, 6)
        return self.head(x.reshape(x.shape[0], -1))


class LiveSize(nn.Module):
    """n = x.size(0) is live from the start to the reshape: no cut between a and b."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        n = x.size(0)
        x = self.b(torch.relu(self.a(x)))
        return self.head(x.reshape(n, -1))


# 3. Untraceable ------------------------------------------------------------------------------------------------------
class Branching(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.l(x)
        return x


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x, y):
        return self.l(x) + y


class TupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        return self.l(x), x


# 4. Tied weights -----------------------------------------------------------------------------------------------------
class GPTBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.out(y)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=50, d=16, t=8, layers=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, t, d) * 0.02)
        self.blocks = nn.Sequential(*[GPTBlock(d, 2) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos
        return self.head(self.ln_f(self.blocks(x)))


# Other rules ---------------------------------------------------------------------------------------------------------
class FunctionalBlock(nn.Module):
    """Its parameter is reached through get_attr only, yet it is a module's own call: a unit of its own."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.unused = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return torch.relu(x @ self.w)


class RootDropout(nn.Module):
    """F.dropout(..., self.training) at the root: the unit reads its own training flag at run time (the train- and
    eval-mode traces differ by that bool only, their constants being equal)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        shift = torch.linspace(0.0, 1.0, 8)  # a constant: fx stores it on the model, under a new name per trace
        return self.b(F.dropout(self.a(x) + shift, 0.5, self.training))


class SmallModels(Checks):
    def test_residual_cnn(self):
        torch.manual_seed(0)
        model = randomize_norms(ResCNN()).eval()
        units = split.auto_units(model)
        self.assertEqual(names(units), ["stem", "block1", "block2", "head"])
        owned = {name: o for name, _, o in units}
        self.assertEqual(owned["stem"], ["stem.0.weight", "stem.1.weight", "stem.1.bias", "stem.1.running_mean",
                                         "stem.1.running_var", "stem.1.num_batches_tracked"])
        self.assertEqual(owned["head"], ["head.weight", "head.bias"])
        self.assertTrue(all(n.startswith("block1.") for n in owned["block1"]) and len(owned["block1"]) == 12)
        self.assertOwnedOnce(model, units)
        self.assertOwnTensors(model, units)
        x = torch.randn(2, 3, 8, 8)
        self.assertComposes(model, units, x)
        # Each block is whole: its input is live across its inside (the x in x + f(x)).
        block1 = units[1][1]
        self.assertEqual(sum(1 for n in block1.graph.nodes if n.op == "placeholder"), 1)
        self.assertIn("block1.conv1", [n.target for n in block1.graph.nodes if n.op == "call_module"])
        self.assertIn("block1.bn2", [n.target for n in block1.graph.nodes if n.op == "call_module"])

    def test_glue_folds_into_neighbours(self):
        torch.manual_seed(0)
        model = Glued().eval()
        units = split.auto_units(model)
        self.assertEqual(names(units), ["stem", "mix", "proj", "head"])
        self.assertOwnedOnce(model, units)
        self.assertTrue(all(o for _, _, o in units), "a unit without parameters")
        mix = units[1][1]
        methods = [n.target for n in mix.graph.nodes if n.op == "call_method"]
        self.assertIn(torch.cat, [n.target for n in mix.graph.nodes if n.op == "call_function"])
        self.assertIn("flatten", methods)      # the glue after mix joined mix's unit
        self.assertIn("transpose", methods)
        self.assertIn("reshape", [n.target for n in units[2][1].graph.nodes if n.op == "call_method"])
        x = torch.randn(3, 3, 4, 4)
        self.assertComposes(model, units, x)
        self.assertEqual(units[1][1](units[0][1](x)).shape, (3, 16, 8))     # mix's unit ends transposed
        self.assertEqual(units[2][1](units[1][1](units[0][1](x))).shape, (3, 96))  # proj's unit ends reshaped

    def test_live_int_prevents_a_cut(self):
        torch.manual_seed(0)
        model = LiveSize().eval()
        units = split.auto_units(model)
        self.assertEqual(names(units), ["a", "head"])
        self.assertEqual(units[0][2], ["a.weight", "a.bias", "b.weight", "b.bias"])
        self.assertComposes(model, units, torch.randn(5, 4))

    def test_untraceable(self):
        with self.assertRaises(split.UntraceableModel) as caught:
            split.auto_units(Branching())
        message = str(caught.exception)
        self.assertIn("units()", message)
        self.assertIn("control flow", message)
        self.assertNotIn("\n", message)
        self.assertIsInstance(caught.exception, TypeError)
        with self.assertRaisesRegex(split.UntraceableModel, r"2 inputs \(x, y\).*units\(\)"):
            split.auto_units(TwoInputs())
        with self.assertRaisesRegex(split.UntraceableModel, r"returns a tuple.*units\(\)"):
            split.auto_units(TupleOut())

    def test_tied_weights(self):
        torch.manual_seed(0)
        model = TinyGPT()
        units = split.auto_units(model)
        by_name = {name: o for name, _, o in units}
        self.assertEqual(names(units)[0], "tok")
        self.assertEqual(names(units)[-1], "head")
        self.assertIn("tok.weight", by_name["tok"])
        self.assertIn("pos", by_name["tok"])   # a bare parameter joins its neighbour's unit
        self.assertEqual(by_name["head"], [])  # the tied weight is tok's; head owns no copy
        self.assertNotIn("head.weight", [n for _, _, o in units for n in o])
        self.assertOwnedOnce(model, units)
        self.assertOwnTensors(model, units)
        self.assertIs(units[-1][1].get_parameter("head.weight"), model.tok.weight)
        idx = torch.randint(0, 25, (2, 8))     # tokens 25..49 never appear: their rows get grads only via head
        self.assertComposes(model, units, idx)

        model.zero_grad()
        F.cross_entropy(compose(units, idx).flatten(0, 1), idx.flatten()).backward()
        via_units = model.tok.weight.grad.clone()
        model.zero_grad()
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        torch.testing.assert_close(via_units, model.tok.weight.grad, rtol=1e-6, atol=1e-8)
        self.assertGreater(via_units[25:].abs().sum().item(), 0.0)

    def test_get_attr_module_is_a_unit_and_unused_parameter_stays_with_its_module(self):
        torch.manual_seed(0)
        model = nn.Sequential(FunctionalBlock(6), FunctionalBlock(6), FunctionalBlock(6))
        units = split.auto_units(model)
        self.assertEqual(names(units), ["0", "1", "2"])
        self.assertEqual([o for _, _, o in units], [["0.w", "0.unused"], ["1.w", "1.unused"], ["2.w", "2.unused"]])
        self.assertComposes(model, units, torch.randn(3, 6))

    def test_max_units(self):
        torch.manual_seed(0)
        model = randomize_norms(ResCNN()).eval()
        x = torch.randn(2, 3, 8, 8)
        # Fewer cuts than there are boundaries: those that split the compute nodes most evenly.
        for k, expected in [(1, ["stem"]), (2, ["stem", "block2"]), (3, ["stem", "block2", "head"]),
                            (4, ["stem", "block1", "block2", "head"]), (9, ["stem", "block1", "block2", "head"])]:
            units = split.auto_units(model, max_units=k)
            self.assertEqual(names(units), expected)
            self.assertOwnedOnce(model, units)
            self.assertComposes(model, units, x)

    def test_training_flag_read_at_run_time(self):
        torch.manual_seed(0)
        model = RootDropout().train()
        units = split.auto_units(model)
        self.assertEqual(len(units), 2)
        self.assertEqual([k for k in vars(model) if k.startswith("_tensor_constant")], [])  # left as it was
        x = torch.randn(4, 8)
        for _, unit, _ in units:
            unit.eval()
        self.assertTrue(torch.equal(compose(units, x), model.eval()(x)))
        for _, unit, _ in units:
            unit.train()
        torch.manual_seed(3)
        got = compose(units, x)
        torch.manual_seed(3)
        self.assertTrue(torch.equal(got, model.train()(x)))
        self.assertFalse(torch.equal(got, model.eval()(x)))


class Torchvision(Checks):
    @classmethod
    def setUpClass(cls):
        import torchvision
        cls.tv = torchvision.models
        cls.x = torch.randn(2, 3, 32, 32)

    def check(self, model, x=None, traced_in_train=False):
        model.train(traced_in_train)
        units = split.auto_units(model)
        model.eval()
        self.assertGreater(len(units), 1)
        self.assertOwnedOnce(model, units)
        self.assertOwnTensors(model, units)
        self.assertComposes(model, units, self.x if x is None else x, atol=1e-5)
        return units

    def test_resnet18_cifar(self):
        torch.manual_seed(0)
        model = self.tv.resnet18(num_classes=10)
        model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
        units = self.check(randomize_norms(model))
        self.assertEqual(names(units), ["conv1"] + [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)] + ["fc"])
        self.assertEqual(units[0][2][:2], ["conv1.weight", "bn1.weight"])

    def test_resnet50(self):
        torch.manual_seed(0)
        units = self.check(randomize_norms(self.tv.resnet50()))
        blocks = [f"layer{i}.{j}" for i, n in zip(range(1, 5), (3, 4, 6, 3)) for j in range(n)]
        self.assertEqual(names(units), ["conv1"] + blocks + ["fc"])

    def test_mobilenet_v3_small(self):
        torch.manual_seed(0)
        units = self.check(randomize_norms(self.tv.mobilenet_v3_small()))
        self.assertEqual(names(units)[0], "features.0")
        self.assertEqual(names(units)[-1], "classifier.3")

    def test_convnext_tiny_traced_in_train_mode(self):
        torch.manual_seed(0)
        # Traced in train mode: stochastic depth must follow the modules' flag at run time, or eval would differ.
        units = self.check(self.tv.convnext_tiny(stochastic_depth_prob=0.5), traced_in_train=True)
        self.assertEqual(names(units)[:2], ["features.0", "features.1.0"])
        self.assertEqual(names(units)[-1], "classifier.2")

    def test_vit_b_16(self):
        torch.manual_seed(0)
        units = self.check(self.tv.vit_b_16(image_size=32))
        self.assertEqual(names(units)[0], "conv_proj")
        self.assertIn("class_token", units[0][2])
        self.assertIn("encoder.pos_embedding", units[0][2])
        self.assertEqual(names(units)[-1], "heads")


if __name__ == "__main__":
    unittest.main()
