"""Run every benchmark, one JSON each under results/bench/ (``make bench``).

    .venv/bin/python benchmarks/run.py                 # all, full size
    .venv/bin/python benchmarks/run.py --quick         # smaller graphs, minutes not tens of minutes
    .venv/bin/python benchmarks/run.py --smoke         # each one's tiny run: does it still run (seconds)
    .venv/bin/python benchmarks/run.py foundation modes  # some

Each benchmark is a script ``benchmarks/bench_<name>.py`` that takes ``--out`` (and
``--quick`` where it has a smaller size); this runner only sequences them, so that
the machine runs one at a time and the timings do not disturb each other.
"""

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUICK = {"foundation": ["--nodes", "100000"], "calibrate": [], "convergence": [], "compare": []}  # others take --quick


def main():
    names = sorted(p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py"))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"benchmarks to run (default all: {', '.join(names)})")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="benchmarks/smoke.py: tiny sizes, the figures mean nothing")
    ap.add_argument("--out-dir", default="results/bench")
    a = ap.parse_args()
    failed = []
    for name in a.names or names:
        script = HERE / f"bench_{name}.py"
        args = [sys.executable, str(script), "--out", f"{a.out_dir}/{name}.json"]
        if a.smoke:
            args.append("--smoke")
        elif a.quick:
            args += QUICK.get(name, ["--quick"])
        print(f"== {name}: {' '.join(args[1:])}", file=sys.stderr, flush=True)
        if subprocess.run(args).returncode:
            failed.append(name)
    if failed:
        sys.exit(f"benchmarks failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
