"""Partition balance on a skewed graph: METIS balancing edges alone, nodes alone, or both (issue #36).

    .venv/bin/python benchmarks/bench_balance.py --out results/bench/balance.json
    .venv/bin/python benchmarks/bench_balance.py --smoke --out /tmp/b.json   # 2^10 nodes, P = 2

An R-MAT graph (numpy, here: ``(a, b, c, d) = (0.57, 0.19, 0.19, 0.05)``, ``2^scale`` nodes,
``edge_factor · 2^scale`` edges before symmetrising, self loops and duplicates dropped): hubs
of degree in the thousands and a quarter of the nodes isolated, the shape of the issue's held-out
graph (131,072 nodes, max degree 17,340, 26 % isolated). For every P in ``--parts`` and every
balance (``partitioning.balance_nodes`` / ``balance_edges``), ``gnnpipe.partition.partition_graph``
with METIS, timed (wall clock, the whole call: the symmetrised adjacency and METIS; the
machine's load is in the JSON), and its node balance, edge balance (max part / mean; in-edges)
and edge cut (``partition_stats``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from gnnpipe.graph import Graph, csr_from_edges
from gnnpipe.io import write_json
from gnnpipe.partition import balance_name, partition_graph, partition_stats
from machine import machine_record
from smoke import parse_args

#: (balance_nodes, balance_edges) of each setting
SETTINGS = ((True, True), (False, True), (True, False))


def rmat(scale: int, edge_factor: int, seed: int = 0) -> Graph:
    """An R-MAT graph of ``2^scale`` nodes, symmetrised, without self loops (module docstring)."""
    rng = np.random.default_rng(seed)
    m = edge_factor << scale
    quadrant_bits = np.array([[0, 0], [0, 1], [1, 0], [1, 1]], dtype=np.int64)  # a, b, c, d: (src, dst) bit
    src, dst = np.zeros(m, dtype=np.int64), np.zeros(m, dtype=np.int64)
    for level in range(scale):
        q = quadrant_bits[rng.choice(4, size=m, p=[0.57, 0.19, 0.19, 0.05])]
        src += q[:, 0] << level
        dst += q[:, 1] << level
    loop = src == dst
    n = 1 << scale
    indptr, indices = csr_from_edges(src[~loop], dst[~loop], n, symmetrize=True)
    none = np.zeros(n, dtype=bool)
    return Graph(indptr, indices, np.zeros((n, 1), dtype=np.float32), np.zeros(n, dtype=np.int64), none, none, none,
                 1, name=f"rmat-{scale}", symmetric=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=int, default=17, help="2^scale nodes (17: 131,072, the issue's graph)")
    ap.add_argument("--edge-factor", type=int, default=16, help="edges drawn per node before symmetrising")
    ap.add_argument("--parts", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--seed", type=int, default=0, help="METIS's seed")
    ap.add_argument("--out", required=True)
    a = parse_args(ap, argv, scale=10, parts=[2])
    load0, t0 = os.getloadavg(), time.perf_counter()
    g = rmat(a.scale, a.edge_factor)
    deg = g.in_degrees()
    graph = {"kind": "rmat", "scale": a.scale, "edge_factor": a.edge_factor, "num_nodes": g.num_nodes,
             "num_edges": g.num_edges, "max_degree": int(deg.max()), "isolated": float(np.mean(deg == 0)),
             "generate_s": time.perf_counter() - t0}
    print(f"[balance] {graph['num_nodes']:,} nodes, {graph['num_edges']:,} edges, max degree {graph['max_degree']:,}, "
          f"{100 * graph['isolated']:.0f} % isolated", flush=True)
    partition_graph(g, "metis", 2, seed=a.seed, balance_nodes=False, balance_edges=False)  # warm the import
    rows = []
    for parts in a.parts:
        for nodes, edges in SETTINGS:
            t = time.perf_counter()
            assignment = partition_graph(g, "metis", parts, seed=a.seed, balance_nodes=nodes, balance_edges=edges)
            seconds = time.perf_counter() - t
            st = partition_stats(g, assignment, parts)
            rows.append({"parts": parts, "balance": balance_name("metis", nodes, edges), "partition_s": seconds,
                         **{k: st[k] for k in ("node_balance", "edge_balance", "edge_cut_fraction",
                                               "nodes_per_part", "edges_per_part")}})
            r = rows[-1]
            print(f"[balance] P = {parts} {r['balance']:>11}: nodes {r['node_balance']:.3f}, edges "
                  f"{r['edge_balance']:.3f} (max / mean), cut {r['edge_cut_fraction']:.3f}, {seconds:.2f} s",
                  flush=True)
    write_json(a.out, {"benchmark": "balance", "graph": graph, "metis_seed": a.seed, "rows": rows,
                       "machine": machine_record(load0), "wall_s": time.perf_counter() - t0})
    return 0


if __name__ == "__main__":
    sys.exit(main())
