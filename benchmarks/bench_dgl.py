"""Our single-process epoch against DGL 2.1, interleaved A/B on the issue #27 graph.

    .venv/bin/python benchmarks/bench_dgl.py --out results/bench/dgl.json
    .venv/bin/python benchmarks/bench_dgl.py --nodes 20000 --epochs 3 --out /tmp/dgl.json   # quick

A degree-corrected SBM graph (``--nodes``, ``--degree``; 64 features, 16 classes: by default the
issue's 10^5-node, 4.9·10^6-edge shape), then for each model (GraphSAGE-mean, GCN; ``--layers``
layers, hidden ``--hidden``, ReLU between, no dropout, no norm) ``--epochs`` pairs of epochs
(forward + backward + Adam, ``--threads`` threads, after one warm-up each): ours in this process
and DGL's in a server process (``benchmarks/dgl_epoch.py --serve`` in the DGL environment,
``make dgl-env``), one epoch each, alternating which goes first. The machine may be shared:
interleaving epoch by epoch lets the load hit both alike, and the 1-minute load average is
recorded beside every pair. The JSON has, per model, every pair, each side's median epoch and
``speedup_vs_dgl`` = DGL's median / ours (issue #27's target for SAGE 3x128: >= 2), and beside
it the median of the pairs' own ratios and the ratio of each side's fastest epoch (on a loaded
machine the least disturbed one: the closest to a quiet machine's time). The same is printed.

Both frameworks run the same maths on the same graph file. Two differences are ours: the first
GCN/SAGE layer memoises the aggregation of the static input features (``static_input``, exact),
which DGL recomputes every epoch; and our process is set up as ``gnnpipe.train.run`` sets up a
training process, which keeps freed memory for reuse (``gnnpipe.engine.retain_freed_memory``),
while DGL's runs with glibc's defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_foundation import DEFAULT_DGL, dgl_command, our_step
from gnnpipe.config import SyntheticConfig
from gnnpipe.data.synthetic import generate
from gnnpipe.graph import write_graph
from gnnpipe.io import write_json

FEATURES, CLASSES = 64, 16


def interleaved(a, graph_path: Path, kind: str) -> dict:
    """``a.epochs`` pairs of epochs, ours and DGL's (a server process) alternately first."""
    cmd, env = dgl_command(a.dgl_python, graph_path, kind, a.hidden, a.threads, a.layers, ("--serve",))
    dgl = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def dgl_epoch() -> float:
        dgl.stdin.write("epoch\n")
        dgl.stdin.flush()
        line = dgl.stdout.readline()
        if not line:
            raise SystemExit(f"bench_dgl: the DGL process ended (exit {dgl.wait()}); run {' '.join(cmd)}")
        return json.loads(line)["epoch_time_s"]
    try:
        header = dgl.stdout.readline()
        if not header:
            raise SystemExit(f"bench_dgl: the DGL process ended (exit {dgl.wait()}); run {' '.join(cmd)}")
        info = json.loads(header)
        ours_epoch = our_step(graph_path, kind, a.hidden, a.threads, a.layers)
        ours_epoch(), dgl_epoch()  # warm-up
        pairs = []
        for i in range(a.epochs):
            load = os.getloadavg()[0]
            if i % 2:
                d, o = dgl_epoch(), ours_epoch()
            else:
                o, d = ours_epoch(), dgl_epoch()
            pairs.append({"ours_s": o, "dgl_s": d, "first": "dgl" if i % 2 else "ours", "loadavg_1min": load})
    finally:
        dgl.stdin.close()
        dgl.wait()
    ours_s = statistics.median(p["ours_s"] for p in pairs)
    dgl_s = statistics.median(p["dgl_s"] for p in pairs)
    ours_min, dgl_min = min(p["ours_s"] for p in pairs), min(p["dgl_s"] for p in pairs)
    return {"ours_s": ours_s, "dgl_s": dgl_s, "speedup_vs_dgl": dgl_s / ours_s,
            "pair_ratio_median": statistics.median(p["dgl_s"] / p["ours_s"] for p in pairs),
            "ours_min_s": ours_min, "dgl_min_s": dgl_min, "speedup_vs_dgl_min": dgl_min / ours_min,
            "loadavg_1min_median": statistics.median(p["loadavg_1min"] for p in pairs),
            "dgl_version": info["dgl_version"], "dgl_torch": info["torch_version"], "pairs": pairs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench/dgl.json")
    ap.add_argument("--nodes", type=int, default=100_000, help="graph nodes (the issue's graph: 10^5)")
    ap.add_argument("--degree", type=float, default=49.0, help="average degree (the issue's graph: 49)")
    ap.add_argument("--models", nargs="+", default=["sage", "gcn"], choices=["sage", "gcn"])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=15, help="timed epoch pairs per model (after one warm-up each)")
    ap.add_argument("--dgl-python", type=Path, default=DEFAULT_DGL,
                    help="python of the DGL environment (make dgl-env)")
    a = ap.parse_args(argv)
    if not a.dgl_python.exists():
        raise SystemExit(f"bench_dgl: no DGL environment at {a.dgl_python} (make dgl-env, or --dgl-python)")

    t0, load0 = time.perf_counter(), os.getloadavg()
    syn = SyntheticConfig(num_nodes=a.nodes, avg_degree=a.degree, num_features=FEATURES, num_classes=CLASSES,
                          seed=0)
    g = generate(syn, name="dcsbm")
    graph_info = {"num_nodes": g.num_nodes, "num_edges": g.num_edges, "num_features": FEATURES,
                  "num_classes": CLASSES, "synthetic": {"kind": "dcsbm", "avg_degree": a.degree, "seed": 0}}
    print(f"[bench_dgl] graph: {g.num_nodes} nodes, {g.num_edges} edges", flush=True)
    models: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        graph_path = Path(tmp) / "graph.h5"
        write_graph(graph_path, g)
        del g
        for kind in a.models:
            models[kind] = m = interleaved(a, graph_path, kind)
            print(f"[bench_dgl] {kind} {a.layers}x{a.hidden}: ours {m['ours_s']:.3f} s, DGL {m['dgl_s']:.3f} s: "
                  f"DGL / ours = {m['speedup_vs_dgl']:.2f} (medians of {a.epochs} interleaved epochs; "
                  f"median pair ratio {m['pair_ratio_median']:.2f}; fastest epochs {m['ours_min_s']:.3f} s vs "
                  f"{m['dgl_min_s']:.3f} s: {m['speedup_vs_dgl_min']:.2f}; load {m['loadavg_1min_median']:.2f})",
                  flush=True)
    loads = [p["loadavg_1min"] for m in models.values() for p in m["pairs"]]
    write_json(a.out, {
        "benchmark": "dgl", "graph": graph_info,
        "model": {"layers": a.layers, "hidden": a.hidden, "dropout": 0.0, "norm": "none"},
        "threads": a.threads, "epochs": a.epochs, "target_speedup_sage": 2.0,
        "models": models, "loadavg_1min_median": statistics.median(loads),
        "ours_process": "as gnnpipe.train.run sets one up: --threads threads, retain_freed_memory()",
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count(),
                    "torch": torch.__version__, "loadavg_before": list(load0), "loadavg_after": list(os.getloadavg())},
        "wall_s": time.perf_counter() - t0})
    return 0


if __name__ == "__main__":
    sys.exit(main())
