#!/usr/bin/env python3
"""The layering check (docs/architecture.md, "Layers"): every #include "triaccel/<folder>/..." in src/triaccel/ must
point at the file's own folder or at a lower layer, kernels/ holds CUDA and headers only, and the command line
(tools/*.cpp) reaches the library through api/ (and core/'s errors) only, and the Python binding (python/src/)
through the public header <triaccel/triaccel.h> only. Prints one line per violation and exits 1;
prints nothing and exits 0 when the tree is clean.

Usage: check_layers.py [REPO_ROOT]       check the tree
       check_layers.py --self-test       show that the check fails on an upward include (a copy of the tree)
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

# Lower numbers are lower layers; folders of one level may not include each other.
LAYERS = {"core": 0, "kernels": 1, "data": 2, "models": 2, "optim": 2, "report": 2, "train": 3, "control": 4,
          "run": 5, "methods": 6, "api": 7}
INCLUDE = re.compile(r'^\s*#\s*include\s+"triaccel/([a-z_]+)/', re.M)
CLI_MAY_INCLUDE = {"api", "core"}


def violations(root):
    found = []
    src = os.path.join(root, "src", "triaccel")
    for folder in sorted(os.listdir(src)):
        path = os.path.join(src, folder)
        if not os.path.isdir(path):
            continue
        if folder not in LAYERS:
            found.append(f"src/triaccel/{folder}/: a folder in no layer (add it to LAYERS and docs/architecture.md)")
            continue
        # A layer's files, its sub-folders' (control/memory/, ...) included: a sub-folder is part of its layer.
        names = sorted(os.path.relpath(os.path.join(d, n), path) for d, _, ns in os.walk(path) for n in ns)
        for name in names:
            rel = f"src/triaccel/{folder}/{name}"
            if folder == "kernels" and not name.endswith((".cu", ".cuh", ".h")):
                found.append(f"{rel}: kernels/ holds .cu, .cuh and .h files only")
            with open(os.path.join(path, name), errors="replace") as f:
                text = f.read()
            for target in INCLUDE.findall(text):
                if target == folder:
                    continue
                if target not in LAYERS:
                    found.append(f"{rel} includes triaccel/{target}/, a folder in no layer")
                elif LAYERS[target] >= LAYERS[folder]:
                    kind = "up a layer" if LAYERS[target] > LAYERS[folder] else "across its layer"
                    found.append(f"{rel} includes triaccel/{target}/ ({kind}: {folder} is layer "
                                 f"{LAYERS[folder]}, {target} layer {LAYERS[target]})")
    tools = os.path.join(root, "tools")
    for name in sorted(os.listdir(tools)) if os.path.isdir(tools) else []:
        if not name.endswith(".cpp"):
            continue
        with open(os.path.join(tools, name), errors="replace") as f:
            for target in INCLUDE.findall(f.read()):
                if target not in CLI_MAY_INCLUDE:
                    found.append(f"tools/{name} includes triaccel/{target}/ (the CLI calls the library through api/)")
    binding = os.path.join(root, "python", "src")
    for name in sorted(os.listdir(binding)) if os.path.isdir(binding) else []:
        with open(os.path.join(binding, name), errors="replace") as f:
            text = f.read()
        for target in INCLUDE.findall(text):
            found.append(f"python/src/{name} includes triaccel/{target}/ (the binding includes <triaccel/triaccel.h> only)")
    return found


def self_test():
    """Copies src/ and tools/ of this repository, adds one upward include, and expects the check to fail."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        for part in ("src", "tools"):
            shutil.copytree(os.path.join(here, part), os.path.join(tmp, part))
        clean = subprocess.run([sys.executable, __file__, tmp], capture_output=True, text=True)
        if clean.returncode != 0:
            print("self-test: the tree itself does not pass:\n" + clean.stdout)
            return 1
        # One upward include in a layer's top folder, one in a sub-folder (control/memory/ reaching methods/).
        for victim, include in ((("core", "io.cpp"), "train/step.h"),
                                (("control", "memory", "memory_planner.cpp"), "methods/neuroflux.h")):
            with open(os.path.join(tmp, "src", "triaccel", *victim), "a") as f:
                f.write(f'\n#include "triaccel/{include}"\n')
        broken = subprocess.run([sys.executable, __file__, tmp], capture_output=True, text=True)
        for expected in ("core/io.cpp includes triaccel/train/",
                         "control/memory/memory_planner.cpp includes triaccel/methods/"):
            if broken.returncode == 0 or expected not in broken.stdout:
                print(f"self-test: '{expected}' was not refused:\n" + broken.stdout)
                return 1
        print("self-test: the check refuses the upward include: " + broken.stdout.strip())
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    problems = violations(sys.argv[1] if len(sys.argv) > 1 else ".")
    for p in problems:
        print(p)
    sys.exit(1 if problems else 0)
