"""What numbering the nodes for locality buys each mode, interleaved A/B on the issue #27 graph.

    .venv/bin/python benchmarks/bench_locality.py --out results/bench/locality.json
    .venv/bin/python benchmarks/bench_locality.py --nodes 20000 --rounds 1 --out /tmp/loc.json   # quick
    .venv/bin/python benchmarks/bench_locality.py --smoke --out /tmp/loc.json   # 400 nodes, graph P = 2 only

A degree-corrected SBM graph (``--nodes``, ``--degree``; 64 features, 16 classes: by default the
issue's 10^5-node, 4.9·10^6-edge shape, whose ids are a random permutation), a ``--kind`` model of
3 layers, hidden ``--hidden``, no dropout, trained as the trainer's engines train it
(``bench_modes.run_layout``: one process per rank, the slowest rank's epoch):

* ``single`` (2 threads) with ``training.node_order`` ``given`` and ``locality`` (the default:
  METIS parts of ~1,024 nodes, ``gnnpipe.partition.locality_order``);
* ``graph`` P = 2 and ``pipeline`` S = 2 (4 chunks; 1 thread per rank) on two chunk stores of
  the same METIS partition: rows by id inside each part's inner / boundary groups (the order
  before the locality pieces) and in locality pieces (``materialize``'s default,
  ``gnnpipe.partition.part_locality_key``).

Each layout runs ``--rounds`` times, the two numberings alternating, ``--warmup`` + ``--epochs``
epochs a run. The JSON has every epoch, each side's median and fastest, ``speedup`` (given ÷
locality, medians), the bytes per epoch of both (the same: the numbering moves no halo row) and
the set-up times (materialise of each store; METIS inside the single run). The machine's load is
recorded: it moves every figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from bench_modes import layout, run_layout
from machine import machine_record
from smoke import parse_args
from gnnpipe.config import (GraphParallelConfig, ModelConfig, PartitionConfig, PipelineConfig, RunConfig,
                            SyntheticConfig, TrainingConfig)
from gnnpipe.data.synthetic import generate
from gnnpipe.graph import write_graph
from gnnpipe.io import write_json
from gnnpipe.partition import partition_graph
from gnnpipe.store import materialize

FEATURES, CLASSES = 64, 16
ORDERS = ("given", "locality")


def run(a, mode: str, graph_path: Path, stores: dict) -> dict:
    lay = layout(mode, 1 if mode == "single" else 2, chunks_per_stage=2)
    threads = 2 if mode == "single" else 1
    sides = {o: [] for o in ORDERS}
    info = {}
    for r in range(a.rounds):
        for order in (ORDERS if r % 2 == 0 else ORDERS[::-1]):
            cfg = RunConfig(
                run_id=f"locality-{mode}-{order}", mode=mode, dataset_name="locality", graph_path=str(graph_path),
                store_path=stores.get(order, ""), out_dir=str(Path(a.work) / "runs"),
                model=ModelConfig(kind=a.kind, layers=3, hidden=a.hidden, dropout=0.0),
                training=TrainingConfig(epochs=a.warmup + a.epochs, seed=0, dtype="float32",
                                        warmup_epochs=a.warmup, node_order=order),
                partitioning=PartitionConfig(), pipeline=PipelineConfig(), graph_parallel=GraphParallelConfig(),
                workers=1 if mode == "single" else 2, **lay)
            res = run_layout(cfg, threads, a.epochs, a.warmup, a.timeout)
            sides[order] += res["epoch_times_s"]
            info[order] = {"bytes_per_epoch": res["comm_bytes_per_epoch"], "setup_s": res["setup_s"],
                           "bytes_match_closed_form": res["bytes_match"]}
            print(f"[locality] {mode} {order}: {[round(t, 3) for t in res['epoch_times_s']]} s", file=sys.stderr,
                  flush=True)
    med = {o: statistics.median(sides[o]) for o in ORDERS}
    return {"threads_per_rank": threads, **lay,
            **{f"{o}_s": med[o] for o in ORDERS}, **{f"{o}_min_s": min(sides[o]) for o in ORDERS},
            "speedup": med["given"] / med["locality"], "epochs": sides, "runs": info}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench/locality.json")
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--degree", type=float, default=49.0)
    ap.add_argument("--kind", default="sage", choices=["sage", "gcn", "gat"])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--modes", nargs="+", default=["single", "graph", "pipeline"],
                    choices=["single", "graph", "pipeline"])
    ap.add_argument("--rounds", type=int, default=2, help="runs per numbering and mode, alternating")
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs a run")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--work", default="results/bench/work/locality")
    a = parse_args(ap, argv, nodes=400, degree=8.0, hidden=16, modes=["graph"], rounds=1, epochs=1)

    t0, load0 = time.perf_counter(), os.getloadavg()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    g = generate(SyntheticConfig(num_nodes=a.nodes, avg_degree=a.degree, num_features=FEATURES,
                                 num_classes=CLASSES, seed=0), name="dcsbm")
    graph_path = work / "graph.h5"
    digest = write_graph(graph_path, g)
    setup, stores = {}, {}
    for mode, k in (("graph", 2), ("pipeline", layout("pipeline", 2, chunks_per_stage=2)["chunks"])):
        if mode not in a.modes:
            continue
        assignment = partition_graph(g, "metis", k, seed=0)
        stores[mode] = {}
        for order, pieces in (("given", g.num_nodes + 1), ("locality", None)):
            path = work / f"metis-{k}-{order}.h5"
            t = time.perf_counter()
            materialize(g, assignment, path, graph_hash=digest, method="metis", piece_nodes=pieces)
            setup[f"materialize {mode} {order} s"] = time.perf_counter() - t
            stores[mode][order] = str(path)
    graph_info = {"num_nodes": g.num_nodes, "num_edges": g.num_edges, "num_features": FEATURES,
                  "num_classes": CLASSES, "synthetic": {"kind": "dcsbm", "avg_degree": a.degree, "seed": 0}}
    del g
    modes = {}
    for mode in a.modes:
        modes[mode] = m = run(a, mode, graph_path, stores.get(mode, {}))
        print(f"[locality] {mode} {a.kind} 3x{a.hidden}: given {m['given_s']:.3f} s, locality {m['locality_s']:.3f} s: "
              f"{m['speedup']:.2f}x (medians)", flush=True)
    write_json(a.out, {
        "benchmark": "locality", "graph": graph_info, "model": {"kind": a.kind, "layers": 3, "hidden": a.hidden},
        "modes": modes, "setup_s": setup, "rounds": a.rounds, "epochs": a.epochs,
        "machine": machine_record(load0),
        "wall_s": time.perf_counter() - t0})
    return 0


if __name__ == "__main__":
    sys.exit(main())
