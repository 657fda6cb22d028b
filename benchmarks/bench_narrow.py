"""Bytes per mirror per layer of graph parallelism, ours beside the SAR scheme's closed form (issue #27).

    .venv/bin/python benchmarks/bench_narrow.py --out results/bench/narrow.json
    .venv/bin/python benchmarks/bench_narrow.py --out /tmp/narrow.json --nodes 2000 --degree 20   # quick
    .venv/bin/python benchmarks/bench_narrow.py --out /tmp/narrow.json --smoke   # 400 nodes, one epoch

A degree-corrected SBM graph (``--nodes``, ``--degree``; 64 features, 16 classes: the issue's
10^5-node, 4.9·10^6-edge shape at a size this machine trains in seconds), METIS into ``--parts``
(default 2), a 3-layer GraphSAGE 64 -> 128 -> 128 -> 16 trained for ``--epochs`` epochs in
float32 on ``--parts`` real processes (gloo; ``gnnpipe.parallel.testing.spawn_multi_process``),
the engine's own graph layout (``LayoutEngine``). Per epoch the communicator's ledger gives the
halo bytes all ranks sent; divided by Σ mirrors · 4 B that is the floats one mirror costs per
epoch (both directions), which must equal the closed form ``GNN.halo_dims()`` gives
(docs/DESIGN.md §4 "Narrow side"): conv 0 nothing (its input halo cached at set-up), conv l > 0
``2 · min(in, out)`` for GCN / SAGE. Beside it, per layer:

* ``sar``: Intel SAR's scheme (through DGL's SAGEConv): the raw input halo re-sent every epoch
  (forward only: no gradient), every later layer's rows forward and their gradients back at
  the narrow side (DGL projects before aggregating when the output is narrower);
* ``input_width``: ours before #27 (every conv exchanged its input width).

The JSON has the graph, the mirror counts, per layer the three closed forms, the measured
floats per mirror per epoch (every epoch), the ratio to SAR (the issue's target: <= 0.85) and the
halo row width of every all-to-all of one epoch, in order (what crossed the wire). The same is
printed. The machine's load averages are recorded (bytes do not depend on them).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

from gnnpipe.config import (GraphParallelConfig, ModelConfig, PartitionConfig, PipelineConfig, RunConfig,
                            SyntheticConfig, TrainingConfig)
from gnnpipe.data.synthetic import generate
from gnnpipe.graph import write_graph
from gnnpipe.io import write_json
from gnnpipe.partition import partition_graph
from gnnpipe.store import materialize
from machine import machine_record
from smoke import parse_args

FEATURES, HIDDEN, CLASSES, LAYERS = 64, 128, 16, 3


def sar_per_layer(dims: list[tuple[int, int]]) -> list[int]:
    """Floats per mirror per epoch of each layer under SAR: the input halo every epoch (forward
    only if the layer aggregates raw features, else its projection both ways), later layers both
    ways at the narrow side."""
    out = []
    for l, (d_in, d_out) in enumerate(dims):
        if l == 0:
            out.append(d_in if d_in <= d_out else 2 * d_out)
        else:
            out.append(2 * min(d_in, d_out))
    return out


def _train(rank: int, world: int, cfg: RunConfig, epochs: int) -> dict:
    from gnnpipe.layout import ParallelDims
    from gnnpipe.parallel.comm import Communicator
    from gnnpipe.parallel.layout_engine import LayoutEngine
    from gnnpipe.parallel.groups import build_groups

    groups = build_groups(ParallelDims("graph", world, 1, world), rank)
    comm = Communicator(groups, "cpu")
    widths, send = [], comm.all_to_all_rows

    def recording(rows, *args, **kw):
        if kw.get("op") == "halo":
            widths.append(int(rows.shape[1]))
        return send(rows, *args, **kw)
    comm.all_to_all_rows = recording
    engine = LayoutEngine(cfg, groups, comm, "cpu")
    halo = []
    for e in range(epochs):
        comm.set_epoch(e)
        widths.clear()
        engine.train_epoch(e)
        halo.append(comm.ledger_dict()[e].get("halo", {}).get("sent", 0))
    return {"halo": halo, "widths": list(widths), "mirrors": engine.mirrors,
            "predicted": engine.predicted_bytes_by_kind(), "halo_dims": engine.halo_dims}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench/narrow.json")
    ap.add_argument("--nodes", type=int, default=20_000, help="graph nodes (the issue's graph: 10^5)")
    ap.add_argument("--degree", type=float, default=49.0, help="average degree (the issue's graph: 49)")
    ap.add_argument("--parts", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    a = parse_args(ap, argv, nodes=400, degree=8.0, epochs=1)
    from gnnpipe.parallel.testing import spawn_multi_process

    load0, t0 = os.getloadavg(), time.perf_counter()
    syn = SyntheticConfig(num_nodes=a.nodes, avg_degree=a.degree, num_features=FEATURES, num_classes=CLASSES,
                          seed=0)
    g = generate(syn, name="dcsbm")
    print(f"[bench_narrow] graph: {g.num_nodes} nodes, {g.num_edges} edges ({time.perf_counter() - t0:.1f} s)",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        graph_path, store = Path(tmp) / "graph.h5", Path(tmp) / f"metis-{a.parts}.h5"
        write_graph(graph_path, g)
        parts = partition_graph(g, "metis", a.parts, seed=1)
        materialize(g, parts, store, method="metis")
        cfg = RunConfig(
            run_id="bench-narrow", mode="graph", dataset_name="dcsbm", graph_path=str(graph_path),
            store_path=str(store), out_dir=tmp,
            model=ModelConfig(kind="sage", layers=LAYERS, hidden=HIDDEN, dropout=0.5, norm="none"),
            training=TrainingConfig(epochs=a.epochs, lr=0.01, seed=0, dtype="float32"),
            partitioning=PartitionConfig(), pipeline=PipelineConfig(), graph_parallel=GraphParallelConfig(),
            workers=a.parts, stages=1, ways=a.parts, chunks=a.parts)
        res = spawn_multi_process(_train, a.parts, cfg, a.epochs, timeout=1800)
    mirrors = res[0]["mirrors"]
    M, b = sum(mirrors), 4
    dims = [(FEATURES, HIDDEN)] + [(HIDDEN, HIDDEN)] * (LAYERS - 2) + [(HIDDEN, CLASSES)]
    hd = res[0]["halo_dims"]
    ours = [0] + [2 * d for d in hd[1:]]  # conv 0: cached at set-up
    sar = sar_per_layer(dims)
    before = [0] + [2 * d_in for d_in, _ in dims[1:]]
    measured = [sum(r["halo"][e] for r in res) / (M * b) for e in range(a.epochs)]
    out = {
        "graph": {"num_nodes": g.num_nodes, "num_edges": g.num_edges, "num_features": FEATURES,
                  "num_classes": CLASSES, "synthetic": dataclasses.asdict(syn)},
        "model": {"kind": "sage", "dims": dims}, "parts": a.parts, "mirrors": mirrors, "bytes_per_value": b,
        "per_layer_floats_per_mirror": [{"layer": l, "in": i, "out": o, "ours": ours[l], "sar": sar[l],
                                         "input_width": before[l]} for l, (i, o) in enumerate(dims)],
        "ours": sum(ours), "sar": sum(sar), "input_width": sum(before),
        "ratio_to_sar": sum(ours) / sum(sar), "target_ratio": 0.85,
        "measured_floats_per_mirror": measured, "ledger_equals_closed_form": all(m == sum(ours) for m in measured),
        "predicted_halo_bytes": res[0]["predicted"]["halo"],
        "halo_row_widths_one_epoch": res[0]["widths"],
        "machine": machine_record(load0),
        "wall_s": time.perf_counter() - t0,
    }
    print(f"[bench_narrow] Σ mirrors {M} ({mirrors}); floats per mirror per epoch, layer by layer:")
    print(f"  {'layer':>5} {'in->out':>9} {'ours':>6} {'SAR':>6} {'before':>6}")
    for row in out["per_layer_floats_per_mirror"]:
        print(f"  {row['layer']:>5} {row['in']:>4}->{row['out']:<4} {row['ours']:>6} {row['sar']:>6} "
              f"{row['input_width']:>6}")
    print(f"  {'total':>5} {'':>9} {out['ours']:>6} {out['sar']:>6} {out['input_width']:>6}   "
          f"ours / SAR = {out['ratio_to_sar']:.3f} (target <= 0.85); measured {measured}")
    write_json(a.out, out)
    return 0 if out["ledger_equals_closed_form"] else 1


if __name__ == "__main__":
    sys.exit(main())
