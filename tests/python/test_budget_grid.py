#!/usr/bin/env python3
"""bench/budget_grid.py (issue 56's randomized grid): the same seed draws the same combinations on every machine,
every value of every axis is drawn, the arguments say what the combination says, and each way a run can end is
classified as the issue counts it (an internal error is never "refused"). No engine needed."""
import os
import sys
import unittest
import unittest.mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import budget_grid as g  # noqa: E402


class Grid(unittest.TestCase):
    def test_a_seed_draws_the_same_grid_and_another_seed_another(self):
        self.assertEqual(g.combos(0, 150), g.combos(0, 150))
        self.assertNotEqual(g.combos(0, 150), g.combos(1, 150))
        self.assertEqual([c["index"] for c in g.combos(3, 20)], list(range(20)))

    def test_shards_split_the_grid_or_the_rows_asked_for_once_each(self):
        grid = g.combos(0, 150)
        shards = [g.shard_of(grid, f"{i}/8") for i in range(8)]
        self.assertEqual(sorted(c["index"] for s in shards for c in s), list(range(150)))
        self.assertEqual([c["index"] for c in shards[3]][:3], [3, 11, 19])
        asked = [2, 5, 6, 8, 10, 17, 30, 146]
        shards = [g.shard_of(grid, f"{i}/3", only=",".join(map(str, asked))) for i in range(3)]
        self.assertEqual(sorted(c["index"] for s in shards for c in s), asked)
        self.assertEqual([len(s) for s in shards], [3, 3, 2])  # dealt in turn, not by index modulo 3
        self.assertEqual(shards[0][0], grid[2])

    def test_every_value_of_every_axis_is_drawn(self):
        grid = g.combos(0, 150, gpus=2)
        axes = {"model": sorted(g.MODELS), "method": g.METHODS, "optimizer": g.OPTIMIZERS,
                "precision": g.PRECISIONS, "controllers": g.CONTROLLERS, "budget_share": g.BUDGET_SHARES,
                "placement": g.PLACEMENTS, "cuda_graphs": g.GRAPHS, "nproc": [1, 2]}
        for axis, values in axes.items():
            self.assertEqual({repr(c[axis]) for c in grid}, {repr(v) for v in values}, axis)
        self.assertEqual({c["nproc"] for c in g.combos(0, 150, gpus=1)}, {1})

    def test_amp_fp8_is_drawn_only_when_asked_and_the_default_grid_stays(self):
        self.assertEqual(g.combos(0, 150), g.combos(0, 150, precisions=list(g.PRECISIONS)))
        self.assertNotIn("amp-fp8", {c["precision"] for c in g.combos(0, 150)})
        with_fp8 = g.combos(0, 150, precisions=g.PRECISIONS + ["amp-fp8"])
        self.assertIn("amp-fp8", {c["precision"] for c in with_fp8})
        self.assertEqual(with_fp8[0]["model"], g.combos(0, 150)[0]["model"])  # the axes before it draw as before

    def test_arguments_follow_the_combination(self):
        c = {"index": 7, "model": "gpt-char", "method": "tri-accel", "optimizer": "adamw", "precision": "amp-fp16",
             "controllers": "ta_batch", "budget_share": 0.5, "vram_budget": "0.895GB", "placement": "host",
             "cuda_graphs": "false", "nproc": 2}
        a = g.args_of(c, "/cifar", "/text", 30, "/out")
        pairs = dict(zip(a[1::2], a[2::2]))
        self.assertEqual(pairs["--data"], "/text")
        self.assertEqual(pairs["--batch-size"], "64")
        self.assertEqual(pairs["--ta-batch"], "false")
        self.assertEqual(pairs["--vram-budget"], "0.895GB")
        self.assertEqual(pairs["--nproc"], "2")
        self.assertEqual(pairs["--max-steps"], "30")
        self.assertEqual(pairs["--data-placement"], "host")
        unbudgeted = dict(c, budget_share=None, vram_budget=None, nproc=1, method="backprop")
        b = g.args_of(unbudgeted, "/cifar", "/text", 30, "/out")
        self.assertNotIn("--vram-budget", b)
        self.assertNotIn("--nproc", b)
        self.assertNotIn("--ta-batch", b)

    def test_how_a_run_ended(self):
        ok = {"peak_vram_gb": 0.29}
        self.assertEqual(g.classify(0, "done\n", ok, 0.3e9)[0], "ok")
        self.assertEqual(g.classify(0, "done\n", {"peak_vram_gb": 0.31}, 0.3e9)[0], "over_budget")
        self.assertEqual(g.classify(0, "", {"peak_vram_gb": 5.0}, 0)[0], "ok")  # no budget: any peak
        refused = g.classify(2, "triaccel: --vram-budget 0.1GB is below this run's floor ...\n", None, 1e8)
        self.assertEqual(refused, ("refused", "triaccel: --vram-budget 0.1GB is below this run's floor ..."))
        internal = "oom ...\ntriaccel: internal error: CUDA out of memory. Tried to allocate 20.00 MiB\n"
        self.assertEqual(g.classify(1, internal, None, 3e8)[0], "internal_error")
        self.assertEqual(g.classify(2, internal, None, 3e8)[0], "internal_error")  # never counted as refused
        self.assertEqual(g.classify(-11, "", None, 0)[0], "crash")
        self.assertEqual(g.classify(1, "Traceback\n", None, 0)[0], "crash")
        self.assertEqual(g.classify(0, "", None, 0, timed_out=True)[0], "timeout")
        self.assertEqual(g.bytes_of("0.25GB"), 0.25e9)
        self.assertEqual(g.bytes_of("800MB"), 8e8)
        self.assertEqual(g.bytes_of(None), 0)

    def test_the_predicted_peak_is_judged_on_budgeted_runs_that_trained(self):
        def row(budget, outcome, predicted, plan_peak, run_peak):
            return dict(vram_budget=budget, outcome=outcome, predicted_peak_gb=predicted,
                        plan_measured_peak_gb=plan_peak, peak_vram_gb=run_peak)
        rows = [row("0.3GB", "ok", 0.29, 0.30, 0.30),  # 3.3 %
                row("0.3GB", "over_budget", 0.25, 0.32, 0.32),  # 22 %
                row("0.5GB", "ok", 0.40, 0.41, 0.48),  # 2.4 % of its steps; 17 % of the run (an earlier plan's)
                row(None, "ok", None, None, 0.6),  # unbudgeted
                row("0.1GB", "refused", 0.09, None, None)]
        p = g.peak_prediction(rows)
        self.assertEqual((p["runs"], p["within_5pct"]), (3, 2))
        self.assertAlmostEqual(p["median_abs_error"], 0.01 / 0.30)
        run = g.peak_prediction(rows, "peak_vram_gb")
        self.assertEqual((run["runs"], run["within_5pct"]), (3, 1))
        self.assertEqual(g.peak_prediction([])["median_abs_error"], None)

    def test_a_refusal_for_a_floor_the_budget_is_above_is_a_bug(self):
        below = "triaccel: error: --vram-budget 0.1GB is below this run's floor: batch 96 of resnet18 needs at least " \
                "192191328 bytes (0.192191 GB) with micro-batches of 1\n"
        self.assertEqual(g.classify(2, below, None, 0.1e9)[0], "refused")
        self.assertEqual(g.classify(2, below, None, 0.2e9)[0], "wrong_floor")
        other = "triaccel: error: --vram-budget 0.158GB is below backprop's floor of 110939547 bytes for x; raise it\n"
        self.assertEqual(g.floor_named(other), 110939547)
        self.assertEqual(g.classify(2, other, None, 0.158e9)[0], "wrong_floor")
        self.assertEqual(g.classify(2, "triaccel: error: --optimizer baoc needs --method backprop\n", None, 9e9)[0],
                         "refused")

    def test_a_sample_a_step_did_not_train_is_a_bug(self):
        self.assertEqual(g.classify(0, "", {"peak_vram_gb": 0.2, "dropped_samples": 0}, 0.3e9)[0], "ok")
        self.assertEqual(g.classify(0, "", {"peak_vram_gb": 0.2, "dropped_samples": 16}, 0.3e9)[0],
                         "samples_dropped")

    def test_the_models_defined_in_python_run_through_the_python_runner(self):
        import grid_python_model as runner
        c = dict(g.combos(0, 1)[0], model="tv-resnet18", method="backprop", vram_budget="0.3GB", nproc=1)
        args = g.args_of(c, "/cifar", "/text", 30, "/out")
        name, dataset, opts = runner.options_of(args)
        self.assertEqual((name, dataset), ("tv-resnet18", "cifar10"))
        self.assertEqual(opts["data_dir"], "/cifar")
        self.assertEqual(opts["batch_size"], 96)
        self.assertEqual(opts["vram_budget"], "0.3GB")
        self.assertIs(opts["cuda_graphs"], c["cuda_graphs"] == "true")
        self.assertNotIn("model", opts)
        self.assertEqual(runner.options_of(["train", "--ta-batch", "false", "--model", "m", "--dataset", "d"])[2],
                         {"ta_batch": False})
        python_models = {m for m in g.MODELS if g.MODELS[m].get("python")}
        self.assertEqual(python_models, {"tv-resnet18", "py-gpt-tied"})
        self.assertTrue(python_models <= {c["model"] for c in g.combos(0, 150)})

    def test_shards_merge_into_one_table_whose_bugs_fail_it(self):
        import contextlib
        import io
        import json
        import tempfile
        ok = dict(vram_budget="0.3GB", outcome="ok", predicted_peak_gb=0.29, plan_measured_peak_gb=0.30,
                  peak_vram_gb=0.30)
        shards = [{"shard": "0/2", "not_run": [], "rows": [ok, dict(ok, outcome="refused")]},
                  {"shard": "1/2", "not_run": [5, 7], "rows": [dict(ok, outcome="internal_error")]}]
        with tempfile.TemporaryDirectory() as d:
            files = []
            for i, s in enumerate(shards):
                files.append(os.path.join(d, f"grid_{i}.json"))
                json.dump(s, open(files[-1], "w"))
            out = io.StringIO()
            with contextlib.redirect_stdout(out), unittest.mock.patch.object(sys, "argv", ["g", "--merge"] + files):
                code = g.main()
            self.assertEqual(code, 1)  # the internal error of the second shard
            text = out.getvalue()
            self.assertIn("2 shards (0/2, 1/2): 3 runs", text)
            self.assertIn("not run (deadline): 2 combinations", text)
            self.assertIn("| ok | 1 |", text)
            self.assertIn("| internal_error | 1 |", text)
            with contextlib.redirect_stdout(io.StringIO()), \
                    unittest.mock.patch.object(sys, "argv", ["g", "--merge", files[0]]):
                self.assertEqual(g.main(), 0)


if __name__ == "__main__":
    unittest.main()
