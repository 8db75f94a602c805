#!/usr/bin/env python3
"""Checks that triaccel's binaries and its Python module use the shared libstdc++ that LibTorch uses.

Torch's libraries load /lib/.../libstdc++.so.6. A binary that links pieces of libstdc++.a instead (what `-lstdc++`
does where the compiler has no libstdc++.so link) carries a second copy of the locale machinery: the Python module
built so on the GPU machine crashed at the first integer it streamed (issue 54). Each file given must name
libstdc++.so.6 in its dynamic section and define none of libstdc++'s own internals.

    check_linkage.py FILE...        exit 1 naming each file that fails
    check_linkage.py --self-test    builds a shared object with -static-libstdc++ and shows that it is refused
"""
import os
import subprocess
import sys
import tempfile

# Symbols only libstdc++ itself defines: the locale's category ids and the facet base's vtable.
OWN_INTERNALS = ("_ZNSt6locale5_Impl", "_ZTVNSt6locale5facetE", "_ZNSt8ios_base4InitC")


def problems(path):
    out = []
    dynamic = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    if "[libstdc++.so.6]" not in dynamic:
        out.append("does not load the shared libstdc++.so.6")
    symbols = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    own = sorted({line.split()[-1] for line in symbols.splitlines() if line.split()[-1].startswith(OWN_INTERNALS)})
    if own:
        out.append(f"defines libstdc++'s own {own[0]} (and {len(own) - 1} more): a static copy of libstdc++")
    return out


def check(paths):
    failed = 0
    for path in paths:
        for p in problems(path):
            print(f"{path}: {p}; link the shared libstdc++ (CMakeLists.txt, TRIACCEL_LIBSTDCXX)")
            failed += 1
    return failed


def self_test():
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "m.cpp")
        with open(src, "w") as f:
            f.write('#include <sstream>\nextern "C" int f(long x) { std::ostringstream s; s << x; return (int)s.str().size(); }\n')
        good, bad = os.path.join(d, "good.so"), os.path.join(d, "bad.so")
        subprocess.run(["g++", "-shared", "-fPIC", "-O1", src, "-o", good], check=True)
        subprocess.run(["g++", "-shared", "-fPIC", "-O1", "-static-libstdc++", src, "-o", bad], check=True)
        if problems(good):
            print("self-test: a shared object linked as usual was refused:", problems(good))
            return 1
        if len(problems(bad)) != 2:
            print("self-test: a shared object with a static libstdc++ was not refused twice:", problems(bad))
            return 1
    print("self-test: the shared link passes, -static-libstdc++ is refused")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    n = check(sys.argv[1:])
    print(f"linkage: {len(sys.argv) - 1} files checked, {n} problems")
    sys.exit(1 if n else 0)
