#!/usr/bin/env python3
"""bench/roofline.py (issue 59, item 1): the counts a wrong implementation would miss, each checked by hand.

ResNet-18/CIFAR forward MACs per image, conv by conv (h_out^2 * cin * cout * k^2):
  stem 3*64*9*1024 = 1,769,472; layer1 4 * 64*64*9*1024 = 150,994,944; layer2..4 each
  18,874,368 (strided conv1) + 3 * 37,748,736 + 2,097,152 (1x1 downsample) = 134,217,728;
  convs 555,417,600 + fc 512*10 = 555,422,720 MACs = 1.1108 GFLOP (2 per MAC), fwd+bwd ~3.33 GFLOP (the issue's 3.34).
BN activations per image: 5 * 64*32*32 + 5 * 128*16*16 + 5 * 256*8*8 + 5 * 512*4*4 = 614,400 (= 9.375 * 65,536;
314.6 M at b512, the figure in batch_norm.cu's header). No GPU, no torch."""
import importlib.util
import os
import unittest

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "roofline.py")
_spec = importlib.util.spec_from_file_location("roofline", _PATH)
r = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(r)


class Counts(unittest.TestCase):
    def test_forward_macs_and_flops_per_image(self):
        self.assertEqual(r.forward_macs_per_image(), 555_422_720)
        self.assertAlmostEqual(2 * r.forward_macs_per_image() / 1e9, 1.1108, places=4)
        # the 3.34 GFLOP per image fwd+bwd is 3 x the forward
        self.assertAlmostEqual(6 * r.forward_macs_per_image() / 1e9, 3.34, delta=0.01)

    def test_conv_shapes(self):
        convs = {c["name"]: c for c in r.network(1)[0]}
        self.assertEqual(len(convs), 20)  # stem + 16 block convs + 3 downsamples
        self.assertEqual(convs["conv1"]["macs"], 1_769_472)
        self.assertEqual(convs["layer2.0.conv1"]["macs"], 18_874_368)
        self.assertEqual(convs["layer4.0.downsample.0"]["macs"], 2_097_152)
        self.assertEqual(convs["layer4.1.conv2"]["out_elems"], 512 * 4 * 4)
        self.assertEqual(sum(c["params"] for c in convs.values()), 11_159_232)

    def test_activation_elements_per_image(self):
        self.assertEqual(r.bn_activation_elems_per_image(), 614_400)
        self.assertEqual(r.bn_activation_elems_per_image() * 512, 314_572_800)
        # conv outputs (= the BN inputs) 614,400 + BN outputs 614,400 + per block the add's and the ReLU's outputs
        # 2 * (2 * 65,536 + 2 * 32,768 + 2 * 16,384 + 2 * 8,192) = 491,520 + pooled 512 + logits 10
        self.assertEqual(r.activation_elems_per_image(), 1_720_842)

    def test_one_bn_transform_pass_is_a_read_and_a_write_at_two_bytes(self):
        ks = [k for k in r.step_kernels(512) if k["cls"] == "bn_transform"]
        self.assertEqual(len(ks), 20)
        layer1 = next(k for k in ks if k["name"] == "layer1.0.bn1")
        self.assertEqual(layer1["bytes"], 512 * 64 * 32 * 32 * 2 * 2)  # 134,217,728
        layer4 = next(k for k in ks if k["name"] == "layer4.1.bn2")
        self.assertEqual(layer4["bytes"], 512 * 512 * 4 * 4 * 2 * 2)

    def test_bn_bytes_per_step_match_the_kernels(self):
        by = {}
        for k in r.step_kernels(512):
            by[k["cls"]] = by.get(k["cls"], 0) + k["bytes"]
        one_pass = 314_572_800 * 2
        self.assertEqual(by["bn_stats"], 1 * one_pass)            # reads x
        self.assertEqual(by["bn_transform"], 2 * one_pass)        # reads x, writes y
        self.assertEqual(by["bn_backward_reduce"], 2 * one_pass)  # reads dy, x
        self.assertEqual(by["bn_backward_elemt"], 3 * one_pass)   # reads dy, x, writes dx
        # residual: forward add (3 passes of each block output) + backward accumulation (3 of each block input)
        outs, ins = 245_760, 303_104
        self.assertEqual(by["residual_add"], 3 * (outs + ins) * 2 * 512)
        self.assertEqual(by["relu_backward"], 3 * outs * 2 * 512)

    def test_conv_flops_per_step_are_three_forwards_less_the_stem_dgrad(self):
        ks = [k for k in r.step_kernels(512) if k["cls"] == "conv"]
        self.assertEqual(len(ks), 20 + 19 + 20)
        self.assertEqual(sum(k["flops"] for k in ks), (3 * 555_417_600 - 1_769_472) * 2 * 512)


class Roofline(unittest.TestCase):
    def test_roofline_is_the_max_of_the_two_terms(self):
        self.assertAlmostEqual(r.roofline_s(1e12, 1e9), 1e12 / 989e12)  # FLOP-bound
        self.assertAlmostEqual(r.roofline_s(1e9, 1e12), 1e12 / 4.8e12)  # bandwidth-bound
        self.assertAlmostEqual(r.roofline_s(989e9, 4.8e9), 1e-3)  # the ridge: both terms 1 ms

    def test_efficiencies_against_the_measurements(self):
        rows = {row["class"]: row for row in r.class_table(512)}
        # bn_transform: 1.258 GB / 4.8 TB/s = 0.262 ms against 0.30 measured
        self.assertAlmostEqual(rows["bn_transform"]["roofline_ms"], 0.2621, places=3)
        self.assertAlmostEqual(rows["bn_transform"]["efficiency"], 0.874, places=2)
        self.assertAlmostEqual(rows["bn_backward_reduce"]["efficiency"], 0.504, places=2)
        # convolutions are FLOP-bound: 1704 GFLOP / 989 TFLOP/s
        self.assertGreater(rows["conv"]["roofline_ms"], 1704e9 / 989e12 * 1e3 - 1e-6)
        self.assertLess(rows["conv"]["efficiency"], 0.6)
        for row in rows.values():  # the calibrated model reproduces every measured class
            if row["measured_ms"] is not None:
                self.assertAlmostEqual(row["modelled_ms"], row["measured_ms"], places=3)

    def test_fusions_remove_bytes_and_time(self):
        preds, _ = r.predict(512)
        self.assertEqual(preds[0]["step_ms"], 6.49)
        self.assertAlmostEqual(preds[1]["saved_ms"], 0.24, places=6)  # F1: the bn_stats kernels are gone
        steps = [p["step_ms"] for p in preds]
        self.assertEqual(steps, sorted(steps, reverse=True))
        before = sum(k["bytes"] for k in r.step_kernels(512) if k["cls"] != "conv")
        after = sum(k["bytes"] for k in r.step_kernels(512, ["F1"]) if k["cls"] != "conv")
        self.assertAlmostEqual(before - after, 314_572_800 * 2, delta=1)  # one read of every BN input
        for p in r.predict(96)[0]:
            self.assertGreater(p["img_s"], 0)


if __name__ == "__main__":
    unittest.main()
