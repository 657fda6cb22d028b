"""How much a second torch thread helps (or hurts) small dense ops on this machine.

    .venv/bin/python benchmarks/bench_threads.py --out results/bench/threads.json

Times ReLU, dropout and a matmul on an 8000 x 100 tensor (the per-layer size of
bench_modes' reddit-like graph) with 1 and 2 torch threads. On the 2-core VMs this
project is developed on, 2 threads made these ops several times slower, which is why
bench_modes reports ratios to both the 1- and the 2-thread single-process reference.
"""

import argparse
import json
import time

import torch

from gnnpipe.io import write_json
from smoke import parse_args


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench/threads.json")
    ap.add_argument("--rows", type=int, default=8000)
    ap.add_argument("--width", type=int, default=100)
    ap.add_argument("--reps", type=int, default=200)
    a = parse_args(ap, argv, rows=200, reps=2)
    x, w = torch.randn(a.rows, a.width), torch.randn(a.width, a.width)
    ops = {"relu": lambda: torch.relu(x), "dropout": lambda: torch.nn.functional.dropout(x, 0.5),
           "matmul": lambda: x @ w}
    res = {"rows": a.rows, "width": a.width, "us_per_call": {}}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, fn in ops.items():
            fn()
            t0 = time.perf_counter()
            for _ in range(a.reps):
                fn()
            res["us_per_call"][f"{name}@{threads}"] = (time.perf_counter() - t0) / a.reps * 1e6
    write_json(a.out, res)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
