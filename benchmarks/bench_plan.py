"""What ``gnnpipe plan`` recommends for the paper's two regimes, on the shipped GPU profiles.

    .venv/bin/python benchmarks/bench_plan.py --out results/bench/plan.json
    .venv/bin/python benchmarks/bench_plan.py --out /tmp/plan.json --hardware 8xgpu-nvlink
    .venv/bin/python benchmarks/bench_plan.py --out /tmp/plan.json --smoke   # 4 layers, both graphs at 600 nodes of degree 8

The Reddit-shaped and the Coauthor-Physics-shaped synthetic graphs (``reddit-like``,
``physics-like``), a 32-layer GCN of hidden width 100 (docs/DESIGN.md's deep model), 8
workers, on each ``--hardware`` profile (default: 8 GPUs over PCIe, NCCL-class and
staged through host memory over gloo as the GNNPipe and PipeGCN codes run). Physics is
generated at its real size (34,493 nodes); Reddit's 1.1·10^8 edges are too many for
METIS on a small machine, so it is generated at ``--reddit-sample`` nodes (default
2·10^4, its real degree 492) and its statistics extrapolated to 232,965 nodes with the
mirrors pinned to Reddit's published METIS cut at 8 parts (``--mirror-ratio 8:2.1``; the
sample's own cut is recorded beside it).

Per (graph, profile) the JSON has every layout's predicted bytes, epoch time and its
split, bubble and peak memory, the recommendation, graph ÷ pipeline for bytes and time,
and the plan's printed reason; the same is printed. Each is the command line

    gnnpipe plan --graph G.h5 [--at-nodes N --mirror-ratio 8:2.1] --kind gcn --layers 32 \\
        --hidden 100 --hardware PROFILE --workers 8

run in process (``gnnpipe.planning.plan.run_plan``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from gnnpipe.config import SyntheticConfig
from gnnpipe.data.synthetic import generate
from gnnpipe.graph import write_graph
from gnnpipe.io import write_json
from gnnpipe.planning.plan import run_plan
from smoke import parse_args

MODEL = {"kind": "gcn", "layers": 32, "hidden": 100, "dropout": 0.5}
REDDIT_NODES = 232_965
REDDIT_MIRRORS_AT_8 = 2.1  # METIS, 8 parts, Σ mirrors / N (the GNNPipe / PipeGCN papers' Reddit cut)


def make_graphs(work: Path, reddit_sample: int, smoke: bool = False) -> dict:
    """shape -> (graph file, plan arguments); ``smoke``: both shapes at ``reddit_sample`` nodes of degree 8."""
    out = {}
    for shape, nodes in (("reddit-like", reddit_sample), ("physics-like", reddit_sample if smoke else None)):
        path = work / f"{shape}.h5"
        t0 = time.perf_counter()
        cfg = SyntheticConfig(shape=shape, seed=0, **({"num_nodes": nodes} if nodes else {}),
                              **({"avg_degree": 8.0} if smoke else {}))
        g = generate(cfg, name=shape)
        write_graph(path, g)
        print(f"[bench_plan] {shape}: {g.num_nodes} nodes, {g.num_edges} edges, {g.num_features} features "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
        extra = ({"at_nodes": REDDIT_NODES, "mirror_ratio": (8, REDDIT_MIRRORS_AT_8)}
                 if shape == "reddit-like" else {})
        out[shape] = (path, extra, {"num_nodes": g.num_nodes, "num_edges": g.num_edges,
                                    "num_features": g.num_features})
    return out


def summarize(p) -> dict:
    rows = [r.as_dict() for r in p.rows]
    by = {r.mode: r for r in p.rows}
    g, pp = by.get("graph"), by.get("pipeline")
    return {"rows": rows, "best": p.best.as_dict() if p.best else None, "reason": p.reason,
            "graph_over_pipeline": ({"bytes": g.bytes["total"] / pp.bytes["total"], "epoch_time": g.epoch_s / pp.epoch_s}
                                    if g and pp else None)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench/plan.json")
    ap.add_argument("--hardware", nargs="+", default=["8xgpu-pcie", "8xgpu-pcie-gloo"])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--reddit-sample", type=int, default=20_000, help="nodes of the reddit-like sample")
    ap.add_argument("--layers", type=int, default=MODEL["layers"], help="the GCN's depth")
    a = parse_args(ap, argv, reddit_sample=600, hardware=["8xgpu-pcie"], layers=4)
    model = {**MODEL, "layers": a.layers}
    res = {"model": model, "workers": a.workers, "load_avg_1min": os.getloadavg()[0], "graphs": {}, "plans": {}}
    with tempfile.TemporaryDirectory(prefix="bench_plan-") as tmp:
        graphs = make_graphs(Path(tmp), a.reddit_sample, a.smoke)
        for shape, (path, extra, info) in graphs.items():
            res["graphs"][shape] = {**info, **{k: list(v) if isinstance(v, tuple) else v for k, v in extra.items()}}
            for hw in a.hardware:
                print(f"\n=== {shape}, {hw}: gnnpipe plan --graph {path.name} --kind gcn --layers {a.layers} --hidden 100 "
                      f"--hardware {hw} --workers {a.workers}"
                      + (f" --at-nodes {extra['at_nodes']} --mirror-ratio 8:{REDDIT_MIRRORS_AT_8}" if extra else ""),
                      flush=True)
                p = run_plan(str(path), model, hw, a.workers, progress=False, **extra)
                res["plans"][f"{shape} on {hw}"] = s = summarize(p)
                if s["graph_over_pipeline"]:
                    r = s["graph_over_pipeline"]
                    print(f"graph ÷ pipeline: bytes {r['bytes']:.2f}x, epoch time {r['epoch_time']:.2f}x", flush=True)
    write_json(a.out, res)
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
