"""Synthetic generator benchmark: generation time at 10^6 nodes / 2*10^7 stored edges, and
the METIS mirror totals of every named shape at several sizes (is the target N-stable?).

    .venv/bin/python benchmarks/bench_synthetic.py --out results/bench/synthetic.json
    .venv/bin/python benchmarks/bench_synthetic.py --quick --out /tmp/synthetic.json
    .venv/bin/python benchmarks/bench_synthetic.py --smoke --out /tmp/synthetic.json   # 2,000 / 600 nodes, degree 8

Mirrors of part p: distinct nodes outside p that are sources of an edge into p;
``mirrors_over_n`` is their sum over the ``--parts`` METIS parts (vertex weights
degree + 1) divided by N. Targets at 8 parts: reddit-like ~2 N (Reddit 2.1 N),
physics-like ~0.3 N (Coauthor-Physics). Features are generated with F = 4 for the
mirror runs (the structure does not depend on the features); the timing run uses the
default shape's F. Times are wall clock and CPU (this process), since the machine may
be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from gnnpipe.config import SyntheticConfig
from gnnpipe.data.synthetic import GENERATOR_VERSION, generate
from gnnpipe.io import write_json
from gnnpipe.partition import partition_graph, partition_stats
from smoke import parse_args

SIZES = {"default": [10_000, 100_000], "physics-like": [20_000, 34_493, 100_000],
         "reddit-like": [40_000, 100_000, 232_965]}
QUICK_SIZES = {"default": [10_000], "physics-like": [34_493], "reddit-like": [40_000]}
SMOKE_SIZES = {shape: [600] for shape in SIZES}  # at degree 8: each shape's own is too many edges for 600 nodes


def timed(fn, *args, **kw):
    w, c = time.perf_counter(), time.process_time()
    out = fn(*args, **kw)
    return out, time.perf_counter() - w, time.process_time() - c


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="smaller sizes and a 2*10^5-node timing run")
    ap.add_argument("--parts", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=1, help="seeds per (shape, size) mirror run")
    ap.add_argument("--nodes", type=int, help="the timing run's nodes (default 10^6, --quick 2*10^5)")
    a = parse_args(ap, argv, nodes=2000)

    res: dict = {"benchmark": "synthetic", "generator_version": GENERATOR_VERSION,
                 "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                             "python": sys.version.split()[0], "numpy": np.__version__}}
    n = a.nodes or (200_000 if a.quick else 1_000_000)
    g, wall, cpu = timed(generate, SyntheticConfig(num_nodes=n, avg_degree=20.0))
    res["generate"] = {"num_nodes": g.num_nodes, "num_edges": g.num_edges, "num_features": g.num_features,
                       "wall_s": wall, "cpu_s": cpu}
    print("generate", json.dumps(res["generate"]), file=sys.stderr, flush=True)
    del g

    res["mirrors"] = []
    for shape, sizes in (SMOKE_SIZES if a.smoke else QUICK_SIZES if a.quick else SIZES).items():
        for num_nodes in sizes:
            for seed in range(a.seeds):
                g, gen_wall, gen_cpu = timed(generate, SyntheticConfig(
                    shape=shape, num_nodes=num_nodes, num_features=4, seed=seed,
                    **({"avg_degree": 8.0} if a.smoke else {})))
                assignment, metis_wall, _ = timed(partition_graph, g, "metis", a.parts)
                st = partition_stats(g, assignment, a.parts)
                row = {"shape": shape, "num_nodes": num_nodes, "seed": seed, "num_edges": g.num_edges,
                       "parts": a.parts, "mirrors_total": st["mirrors_total"],
                       "mirrors_over_n": st["mirrors_over_n"], "edge_cut_fraction": st["edge_cut_fraction"],
                       "edge_balance": st["edge_balance"], "generate_wall_s": gen_wall,
                       "generate_cpu_s": gen_cpu, "metis_wall_s": metis_wall}
                res["mirrors"].append(row)
                print("mirrors", json.dumps(row), file=sys.stderr, flush=True)
                del g, assignment
    write_json(a.out, res)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
