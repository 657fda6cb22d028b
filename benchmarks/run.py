"""Run every benchmark, one JSON each under results/bench/ (``make bench``).

    .venv/bin/python benchmarks/run.py                 # all, full size
    .venv/bin/python benchmarks/run.py --quick         # smaller graphs, minutes not tens of minutes
    .venv/bin/python benchmarks/run.py --smoke         # each one's tiny run: does it still run (seconds)
    .venv/bin/python benchmarks/run.py foundation modes  # some

Each benchmark is a script ``benchmarks/bench_<name>.py`` that takes ``--out``; ``QUICK`` says
what ``--quick`` passes to each (its own ``--quick``, smaller sizes, or nothing: a benchmark
that has no smaller size runs as it is, and says so). This runner only sequences them, so that
the machine runs one at a time and the timings do not disturb each other.
"""

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: ``--quick``'s arguments of every benchmark (tests/test_benchmarks_smoke.py checks that each is
#: listed and that each argument is one its script defines); ``[]``: no smaller size, run as it is.
QUICK = {
    "atom_layout": ["--atoms-per-worker", "250", "--neighbor-atoms", "10000", "--workers", "1", "2"],
    "atomic": ["--quick"],
    "atomic_training": ["--epochs", "10"],
    "balance": ["--scale", "14"],
    "calculator": ["--quick"],
    "calibrate": [],
    "compare": [],
    "convergence": [],
    "dgl": ["--nodes", "20000", "--epochs", "5"],
    "dimenet_pyg": ["--quick"],
    "domains": ["--repeat", "8"],
    "domains_cap": ["--repeat", "10", "--cap-mib", "700"],
    "domains_train": ["--repeat", "6"],
    "foundation": ["--nodes", "100000"],
    "gemnet_fairchem": ["--quick"],
    "layers": ["--quick"],
    "locality": ["--nodes", "20000"],
    "md": ["--atoms", "864", "--steps", "20"],
    "memory_cap": [],
    "memory_modes": ["--nodes", "10000", "--epochs", "1"],
    "modes": ["--quick"],
    "narrow": [],
    "netem": [],
    "plan": ["--reddit-sample", "5000"],
    "scale": ["--edges", "1e7"],
    "synthetic": ["--quick"],
    "threads": [],
}


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
            args += QUICK[name]
            if not QUICK[name]:
                print(f"== {name}: no smaller size, run as it is", file=sys.stderr, flush=True)
        print(f"== {name}: {' '.join(args[1:])}", file=sys.stderr, flush=True)
        if subprocess.run(args).returncode:
            failed.append(name)
    if failed:
        sys.exit(f"benchmarks failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
