"""Aggregation kernels and layers, forward + backward, on one CPU graph.

    .venv/bin/python benchmarks/bench_layers.py --out results/bench/layers.json
    .venv/bin/python benchmarks/bench_layers.py --quick --out /tmp/layers.json
    .venv/bin/python benchmarks/bench_layers.py --smoke --out /tmp/layers.json   # 2,000 nodes, one repetition

Part 1, **kernels**: ``out = A @ X`` and ``grad_X = A^T @ G`` for the GCN-normalised
adjacency (self loops included) of a synthetic graph (the project's DC-SBM, power-law
degrees), at each ``--widths`` and ``--threads``, for every candidate:

* ``ours_embedding_bag``: ours (``gnnpipe.models.ops.apply_op``): a custom Function whose
  forward is ``embedding_bag(sum, per_sample_weights)`` over the CSR (FBGEMM) and whose
  backward is the same on a transposed CSR cached on the block; int32 indices
  (``..._int64``: int64);
* ``ours_mkl_csr``: the same Function on ``torch.sparse_csr_tensor @ X`` (MKL; CUDA's path);
* ``torch_csr_autograd``: ``torch.sparse_csr_tensor @ X`` with torch's own backward;
* ``torch_spmm_reduce_sum``: ``torch.sparse.mm(A, X, "sum")`` (torch's spmm_reduce kernel);
* ``coo_sparse_mm``: ``torch.sparse.mm`` on a coalesced COO matrix (autograd);
* ``embedding_bag_autograd``: ``F.embedding_bag`` with torch's own backward;
* ``gather_index_add``: ``out.index_add_(0, dst, X[src] * w)`` (autograd);
* ``gather_segment_reduce``: ``segment_reduce(X[src] * w, "sum", lengths)`` (autograd).

Every candidate's result is checked against ours (``max_abs_diff``). Part 2, **layers**:
each conv (``H -> H``) forward + backward on the whole graph, and GCN on one chunk of
``1/--chunks`` of the nodes against the whole graph (GNNPipe's block). Part 3, when the DGL
environment exists (``make dgl-env``): DGL 2.1's ``GraphConv`` aggregation
(``dgl_graphconv_aggregate``: norm "both", no weight, self loops added) and its
``GraphConv``/``SAGEConv``/``GATConv`` layers on the same graph, in that environment. Times are medians
over ``--reps`` interleaved runs after one warm-up; the JSON also holds the minimum and
the median CPU time of the process (all threads), the fairer figure on a machine shared
with other jobs.
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

import numpy as np
import torch

from gnnpipe.config import SyntheticConfig
from gnnpipe.data.synthetic import generate
from gnnpipe.io import write_json
from gnnpipe.models import GATConv, GCNConv, GCNIIConv, ResGCNLayer, SAGEConv, ops
from gnnpipe.models.block import Block
from smoke import parse_args

DEFAULT_DGL = Path.home() / ".cache" / "gnnpipe" / "dgl-venv" / "bin" / "python"


def timeit_interleaved(fns: dict, reps: int) -> dict[str, dict]:
    """Median and minimum time of every function, run in turn ``reps`` times after one
    warm-up each (caches: transposed CSR, weights); interleaving spreads any load from
    other processes over all candidates alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return {name: {"median_s": statistics.median(t), "min_s": min(t),
                   "cpu_median_s": statistics.median(cpu[name])} for name, t in times.items()}


def kernel_candidates(block: Block):
    """name -> run(X, G) -> (A @ X, A^T @ G computed by backward)."""
    csr = ops.self_loop_csr(block)
    op = ops.gcn_op(block, torch.float32)
    w = op.values
    n_dst, n_src = csr.n_rows, csr.n_cols
    dst, src = csr.row.long(), csr.indices.long()
    indptr64 = csr.indptr.long()
    lengths = indptr64[1:] - indptr64[:-1]
    op64 = ops.FixedOp(ops.CSR(indptr64, src, dst, csr.t_indptr.long(), csr.t_indices.long(),
                               csr.perm.long(), n_dst, n_src), w, op.values_t)
    a_csr = torch.sparse_csr_tensor(csr.indptr, csr.indices, w, (n_dst, n_src))
    a_csr64 = torch.sparse_csr_tensor(indptr64, src, w, (n_dst, n_src))
    a_coo = torch.sparse_coo_tensor(torch.stack([dst, src]), w, (n_dst, n_src)).coalesce()

    def autograd_run(f, kernel="embedding_bag"):
        def run(x, g):
            old, ops.CPU_KERNEL = ops.CPU_KERNEL, kernel
            try:
                x = x.detach().requires_grad_()
                out = f(x)
                (gx,) = torch.autograd.grad(out, x, g)
            finally:
                ops.CPU_KERNEL = old
            return out, gx
        return run

    return {
        "ours_embedding_bag": autograd_run(lambda x: ops.apply_op(x, op)),
        "ours_embedding_bag_int64": autograd_run(lambda x: ops.apply_op(x, op64)),
        "ours_mkl_csr": autograd_run(lambda x: ops.apply_op(x, op), kernel="sparse"),
        "torch_csr_autograd": autograd_run(lambda x: a_csr @ x),
        "torch_spmm_reduce_sum": autograd_run(lambda x: torch.sparse.mm(a_csr64, x, "sum")),
        "coo_sparse_mm": autograd_run(lambda x: torch.sparse.mm(a_coo, x)),
        "embedding_bag_autograd": autograd_run(lambda x: torch.nn.functional.embedding_bag(
            csr.indices, x, csr.indptr, mode="sum", per_sample_weights=w, include_last_offset=True)),
        "gather_index_add": autograd_run(
            lambda x: x.new_zeros(n_dst, x.shape[1]).index_add_(0, dst, x[src] * w[:, None])),
        "gather_segment_reduce": autograd_run(
            lambda x: torch.segment_reduce(x[src] * w[:, None], "sum", lengths=lengths)),
    }


def bench_kernels(block: Block, widths, threads, reps: int, skip: set[str]) -> list[dict]:
    rows = []
    cands = kernel_candidates(block)
    gen = torch.Generator().manual_seed(0)
    for d in widths:
        x = torch.randn(block.n_src, d, generator=gen)
        g = torch.randn(block.n_dst, d, generator=gen)
        ref_out, ref_gx = cands["ours_embedding_bag"](x, g)
        for t in threads:
            torch.set_num_threads(t)
            fns = {name: (lambda run=run: run(x, g)) for name, run in cands.items() if name not in skip}
            timed = timeit_interleaved(fns, reps)
            for name in fns:
                out, gx = cands[name](x, g)
                diff = max(float((out - ref_out).abs().max().detach()), float((gx - ref_gx).abs().max()))
                row = {"kernel": name, "width": d, "threads": t, "max_abs_diff": diff, **timed[name]}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def bench_layers(block: Block, chunk: Block, hidden: int, threads, reps: int) -> list[dict]:
    rows = []
    torch.manual_seed(0)
    convs = {
        "GCNConv": GCNConv(hidden, hidden),
        "SAGEConv": SAGEConv(hidden, hidden),
        "GATConv(heads=4)": GATConv(hidden, hidden // 4, heads=4),
        "GCNIIConv": GCNIIConv(hidden, layer=1),
        "ResGCNLayer": ResGCNLayer(hidden),
    }
    x = torch.randn(block.n_src, hidden)
    x0 = torch.randn(block.n_dst, hidden)
    cases = [(name, conv, block) for name, conv in convs.items()]
    cases.append(("GCNConv chunk", convs["GCNConv"], chunk))
    def run(conv, blk):
        h = x.detach().requires_grad_()
        out = conv(h, blk, blk.dst_rows(x0) if blk is block else x0[:blk.n_dst])
        out.backward(torch.ones_like(out))

    for t in threads:
        torch.set_num_threads(t)
        timed = timeit_interleaved({name: (lambda c=conv, b=blk: run(c, b)) for name, conv, blk in cases},
                                   reps)
        for name, conv, blk in cases:
            row = {"layer": name, "width": hidden, "threads": t, "n_dst": blk.n_dst, "n_src": blk.n_src,
                   "nnz": blk.nnz, **timed[name]}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


DGL_SCRIPT = r"""
import json, statistics, sys, time
import numpy as np, torch, dgl, dgl.nn as dglnn
path, widths, threads, reps, hidden = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
d = np.load(path)
n = len(d["indptr"]) - 1
dst = np.repeat(np.arange(n), np.diff(d["indptr"]))
src = d["indices"].astype(np.int64)  # graph.h5 v2 holds int32 ids; DGL wants src and dst of one dtype
g = dgl.add_self_loop(dgl.graph((torch.from_numpy(src), torch.from_numpy(dst)), num_nodes=n))
g.create_formats_()
g_plain = dgl.graph((torch.from_numpy(src), torch.from_numpy(dst)), num_nodes=n)
g_plain.create_formats_()
def fb(conv, graph, x):
    def run():
        h = x.detach().requires_grad_()
        out = conv(graph, h)
        out.backward(torch.ones_like(out))
    return run
def timed(fns):
    for f in fns.values():
        f()
    t = {k: [] for k in fns}; c = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0, c0 = time.perf_counter(), time.process_time(); f()
            t[k].append(time.perf_counter() - t0); c[k].append(time.process_time() - c0)
    return {k: {"median_s": statistics.median(v), "min_s": min(v), "cpu_median_s": statistics.median(c[k])} for k, v in t.items()}
rows = []
torch.manual_seed(0)
for th in threads:
    torch.set_num_threads(th)
    for w in widths:
        x = torch.randn(n, w)
        agg = dglnn.GraphConv(w, w, norm="both", weight=False, bias=False)
        for k, v in timed({"dgl_graphconv_aggregate": fb(agg, g, x)}).items():
            rows.append({"kernel": k, "width": w, "threads": th, **v})
    x = torch.randn(n, hidden)
    layers = {"dgl GraphConv": (dglnn.GraphConv(hidden, hidden, norm="both"), g),
              "dgl SAGEConv": (dglnn.SAGEConv(hidden, hidden, "mean"), g_plain),
              "dgl GATConv(heads=4)": (dglnn.GATConv(hidden, hidden // 4, num_heads=4), g)}
    for k, v in timed({k: fb(c, gr, x) for k, (c, gr) in layers.items()}).items():
        rows.append({"layer": k, "width": hidden, "threads": th, **v})
print(json.dumps({"dgl_version": dgl.__version__, "torch_version": torch.__version__, "rows": rows}))
"""


def bench_dgl(python: Path, indptr, indices, widths, threads, reps: int, hidden: int) -> dict:
    """The DGL 2.1 counterparts, run in the DGL environment on the same graph."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "graph.npz"
        np.savez(path, indptr=indptr, indices=indices)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        out = subprocess.run([str(python), "-c", DGL_SCRIPT, str(path), json.dumps(widths),
                              json.dumps(threads), str(reps), str(hidden)],
                             capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def chunk_block(indptr: np.ndarray, indices: np.ndarray, chunks: int) -> Block:
    n = len(indptr) - 1
    e = n // chunks
    deg_in, deg_out = np.diff(indptr), np.bincount(indices, minlength=n)
    return Block.from_numpy(indptr[:e + 1], indices[:indptr[e]], n, 0, deg_in[:e], deg_out)


def summary(rows: list[dict]) -> dict:
    """Per (width, threads): the fastest kernel, every kernel's wall and CPU time over ours."""
    out = {}
    for key in sorted({(r["width"], r["threads"]) for r in rows}):
        sel = {r["kernel"]: r for r in rows if (r["width"], r["threads"]) == key}
        wall = {k: r["median_s"] / sel["ours_embedding_bag"]["median_s"] for k, r in sel.items()}
        cpu = {k: r["cpu_median_s"] / sel["ours_embedding_bag"]["cpu_median_s"] for k, r in sel.items()}
        out[f"width={key[0]},threads={key[1]}"] = {
            "fastest": min(wall, key=wall.get), "wall_over_ours": wall, "cpu_over_ours": cpu}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench/layers.json")
    ap.add_argument("--nodes", type=int, default=200_000)
    ap.add_argument("--avg-degree", type=float, default=20.0, help="stored CSR entries per node")
    ap.add_argument("--widths", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--hidden", type=int, default=64, help="width of the layer benchmark")
    ap.add_argument("--chunks", type=int, default=8, help="the chunk block holds 1/chunks of the nodes")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip", nargs="*", default=[], help="kernel candidates to leave out")
    ap.add_argument("--dgl-python", type=Path, default=DEFAULT_DGL,
                    help="python of the DGL environment (make dgl-env); skipped when absent")
    ap.add_argument("--quick", action="store_true", help="100k nodes, width 64, 2 repetitions")
    a = parse_args(ap, argv, nodes=2000, avg_degree=8.0, widths=[16], threads=[1], hidden=16, reps=1)
    if a.quick:
        a.nodes, a.widths, a.reps = 100_000, [64], 2

    graph = generate(SyntheticConfig(shape="default", num_nodes=a.nodes, avg_degree=a.avg_degree,
                                     num_features=8))
    block = Block.full(graph.indptr, graph.indices)
    chunk = chunk_block(graph.indptr, graph.indices, a.chunks)
    dgl = (bench_dgl(a.dgl_python, graph.indptr, graph.indices, a.widths, a.threads, a.reps, a.hidden)
           if a.dgl_python.exists() else {"error": f"skipped: no DGL environment at {a.dgl_python}"})
    res = {
        "benchmark": "layers",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": sys.version.split()[0], "torch": torch.__version__,
                    "mkl": torch.backends.mkl.is_available()},
        "graph": {"generator": "synthetic default shape", "num_nodes": graph.num_nodes,
                  "num_edges": graph.num_edges, "nnz_with_self_loops": graph.num_edges + graph.num_nodes},
        "dtype": "float32",
        "op": "forward A@X + backward A^T@G, A = GCN-normalised adjacency with self loops",
    }
    del graph
    res["kernels"] = bench_kernels(block, a.widths, a.threads, a.reps, set(a.skip))
    res["layers"] = bench_layers(block, chunk, a.hidden, a.threads, a.reps)
    res["dgl"] = {k: v for k, v in dgl.items() if k != "rows"}
    for row in dgl.get("rows", []):
        res["kernels" if "kernel" in row else "layers"].append(row)
    res["kernel_summary"] = summary(res["kernels"])
    write_json(a.out, res)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
