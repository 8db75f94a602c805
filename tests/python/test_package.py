#!/usr/bin/env python3
"""The package `pip install .` makes (issue 54: a broken package must not land), checked without a second build:
pyproject.toml builds the module's target and packs the CMake install component `python`; that component, installed
from this build into an empty prefix, is a package `triaccel` holding every python/triaccel/*.py and the module,
which imports from there (not from the source or build tree) and trains. A wheel is that prefix zipped.
Run by ctest `python_package`: test_package.py BUILD_DIR (the sanitizer build's environment passed through).
"""
import glob
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.normpath(os.path.join(HERE, "..", ".."))
BUILD = sys.argv.pop(1) if len(sys.argv) > 1 else os.path.join(SOURCE, "build")

TRAIN = """
import os, sys, torch, triaccel
from torch import nn
assert triaccel.__file__.startswith(sys.argv[1]), triaccel.__file__
torch.manual_seed(0)
x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
s = triaccel.train(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), train=(x, y), test=(x, y),
                   device="cpu", epochs=1, batch_size=16, progress="off", out=os.path.join(sys.argv[1], "run"))
print("steps", s["steps"])
"""


class Package(unittest.TestCase):
    def test_pyproject_packs_the_python_component_of_the_module_target(self):
        try:
            import tomllib
        except ImportError:  # Python < 3.11
            self.skipTest("tomllib")
        with open(os.path.join(SOURCE, "pyproject.toml"), "rb") as f:
            build = tomllib.load(f)["tool"]["scikit-build"]
        self.assertIn("triaccel_python", build["build"]["targets"])
        self.assertEqual(build["install"]["components"], ["python"])
        self.assertEqual(build["wheel"]["packages"], [])  # the package comes from the install, not a source folder

    def test_the_installed_component_is_a_package_that_imports_and_trains(self):
        with tempfile.TemporaryDirectory() as prefix:
            subprocess.run(["cmake", "--install", BUILD, "--component", "python", "--prefix", prefix], check=True,
                           stdout=subprocess.DEVNULL)
            installed = sorted(os.path.basename(p) for p in glob.glob(os.path.join(prefix, "triaccel", "*")))
            sources = sorted(os.path.basename(p) for p in glob.glob(os.path.join(SOURCE, "python", "triaccel", "*.py")))
            self.assertEqual([p for p in installed if p.endswith(".py")], sources)
            self.assertEqual(len([p for p in installed if p.startswith("_triaccel") and p.endswith(".so")]), 1,
                             installed)
            env = dict(os.environ, PYTHONPATH=prefix)
            run = subprocess.run([sys.executable, "-c", TRAIN, prefix], cwd=prefix, env=env, capture_output=True,
                                 text=True, timeout=300)
            self.assertEqual(run.returncode, 0, run.stderr[-2000:])
            self.assertIn("steps 4", run.stdout)


if __name__ == "__main__":
    unittest.main()
