"""Calibration: the cost model's compute rates fitted to this machine, on samples of the real
graph and the real model (:func:`calibrate`), for one run (:func:`calibrate_run`, the
workflow's ``calibrate`` rule), and found again for a report (:func:`find_calibration`)."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np
import yaml

from ..config import ModelConfig, RunConfig, load_run_config, to_dict
from ..costmodel.hardware import Hardware, load_hardware
from ..costmodel.work import Work, layer_cost, rowwise_work
from ..graph import read_graph, read_graph_attrs
from ..io import GnnPipeError, write_text
from .shape import DTYPE_BYTES, build_model, model_shape

FLUSH_BYTES = 128 * 2**20
#: The bare dropout kernel's rows at most (:func:`calibrate`).
DROPOUT_ROWS = 16384
#: Clocks for timing: wall time, or this thread's CPU time (blind to time spent
#: descheduled on a shared machine; the same as wall time for one compute thread on an
#: idle core).
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def median_time(fn, reps: int, flush=None, clock: str = "wall") -> float:
    """Median time of ``fn()`` over ``reps`` calls on ``clock``, after one warm-up call;
    ``flush()`` (untimed) runs before each timed call."""
    now = CLOCKS[clock]
    fn()
    ts = []
    for _ in range(reps):
        if flush is not None:
            flush()
        t0 = now()
        fn()
        ts.append(now() - t0)
    return float(statistics.median(ts))


def sample_blocks(graph, rows: int, dtype):
    """Two blocks of the real graph's first ``rows`` destination rows (node ids are the
    dataset's; a synthetic graph's are a random permutation): a *chunk* against the whole
    graph (the pipeline's shape) and a *part* against its own rows plus halo (graph
    parallelism's shape)."""
    from ..models.block import Block

    n = min(int(rows), graph.num_nodes)
    indptr = graph.indptr[:n + 1]
    idx = graph.indices[:int(indptr[-1])]
    deg_in, deg_out = graph.in_degrees(), graph.out_degrees()
    chunk = Block.from_numpy(indptr, idx, graph.num_nodes, 0, deg_in[:n], deg_out, dtype)
    halo = np.unique(idx[idx >= n])
    src = np.concatenate([np.arange(n, dtype=np.int64), halo])
    remap = np.full(graph.num_nodes, -1, dtype=np.int64)
    remap[src] = np.arange(src.shape[0])
    part = Block.from_numpy(indptr, remap[idx], src.shape[0], 0, deg_in[:n], deg_out[src], dtype)
    return chunk, part


def calibrate(graph, model_cfg: ModelConfig, hardware: Optional[Hardware] = None, *,
              rows: Sequence[int] = (2048, 8192), reps: int = 5, threads: int = 1,
              dtype: str = "float32", clock: str = "wall", evict: bool = True,
              block_rows: Optional[Mapping[str, Sequence[int]]] = None) -> Hardware:
    """Fit the compute rates of ``hardware`` to this machine, on the real graph and model.

    Times (median of ``reps``), with ``threads`` compute threads: each distinct conv of
    the model forward and backward on a chunk block and a part block of ``rows``
    destination rows (:func:`sample_blocks`), the encoder/decoder, and the bare kernels
    (a matmul, the CSR SpMM, an elementwise op, dropout on at most :data:`DROPOUT_ROWS` rows).
    The cost model's work counts of every measurement are fitted to its time by
    non-negative least squares on relative errors,
    giving seconds per dense FLOP, per sparse value, per elementwise value and per call.
    The result is ``hardware`` (or a one-node CPU profile) with those rates and the fit
    in ``measured["calibration"]``. ``clock``: ``"wall"``, or ``"cpu"`` (this thread's CPU
    time; only meaningful with ``threads=1``) to fit the rates of the work itself on a
    machine that other jobs share. ``evict=False``: time with warm caches (what a
    single process sees; :func:`calibrate_run`). ``block_rows``: ``{"chunk": rows, "part":
    rows}``, the row counts (of ``rows``) at which each block is timed (None, or a block not
    named: every one). A chunk's sources are the whole graph at any row count, so on a large
    graph it costs far more than its rows say, and one row count measures its shape.
    """
    if clock not in CLOCKS:
        raise GnnPipeError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    if clock == "cpu" and threads != 1:
        raise GnnPipeError("calibrate: clock='cpu' times this thread only; use threads=1")
    import torch

    from ..models.ops import gcn_aggregate

    tdtype = {"float32": torch.float32, "float64": torch.float64}[dtype]
    # An epoch's tensors far exceed the caches, a sample's do not: evict them before each
    # timed call (a write over twice a large L3), or the rates come out several times too fast.
    flush = torch.zeros(FLUSH_BYTES // 4) if evict else None
    cold = (lambda: flush.add_(1.0)) if evict else None  # noqa: E731

    old_threads = torch.get_num_threads()
    torch.set_num_threads(int(threads))
    try:
        gnn = build_model(model_cfg, graph.num_features, graph.num_classes).to(tdtype)
        gnn.train()
        shape = model_shape(gnn)
        gen = torch.Generator().manual_seed(0)
        X, y, names = [], [], []
        held = {}

        def randn(n, d):
            """A (n, d) normal sample, made once per shape: the chunk blocks' sources are the
            whole graph at every row count, and drawing them again is most of the set-up."""
            if (n, d) not in held:
                held[n, d] = torch.randn(n, d, dtype=tdtype, generator=gen)
            return held[n, d]

        def add(name, work: Work, seconds: float):
            X.append([work.dense, work.sparse, work.elem, work.rng, work.calls])
            y.append(seconds)
            names.append(name)

        timed = {"chunk": rows, "part": rows, **(block_rows or {})}
        seen = set()
        with torch.random.fork_rng():
            for r in rows:
                for bname, block in zip(("chunk", "part"), sample_blocks(graph, r, tdtype)):
                    if r not in timed[bname]:
                        continue
                    for l, (conv, spec) in enumerate(zip(gnn.convs, shape.layers)):
                        key = (spec, r, bname)
                        if key in seen:
                            continue
                        seen.add(key)
                        h = randn(block.n_src, spec.d_in).detach().requires_grad_(spec.input_grad)
                        x0 = randn(block.n_dst, spec.d_in) if gnn.needs_x0 else None
                        lc = layer_cost(spec, block.n_dst, block.n_src, block.nnz)
                        out = {}

                        def fwd():
                            out["y"] = conv(h, block, x0)

                        def bwd():
                            conv.zero_grad(set_to_none=True)
                            out["y"] = conv(h, block, x0)
                            out["y"].sum().backward()

                        tf = median_time(fwd, reps, cold, clock)
                        tfb = median_time(bwd, reps, cold, clock)
                        add(f"conv{l} {spec.kind} {spec.d_in}->{spec.d_out} {bname} {r} fwd", lc.fwd, tf)
                        add(f"conv{l} {spec.kind} {spec.d_in}->{spec.d_out} {bname} {r} fwd+bwd",
                            lc.training(), tfb)
                    # bare kernels on this block: SpMM and a matmul at the hidden width
                    d = shape.layers[-1].d_in
                    xs = randn(block.n_src, d)
                    add(f"spmm {bname} {r} width {d}", Work(sparse=(block.nnz + block.n_dst) * d),
                        median_time(lambda: gcn_aggregate(xs, block), reps, cold, clock))
                    m = block.n_src  # a chunk's sources are the whole graph at every row count
                    if ("kernels", m) in seen:
                        continue
                    seen.add(("kernels", m))
                    xk, w = xs, randn(d, d)
                    add(f"matmul {m}x{d}x{d}", Work(dense=2.0 * m * d * d),
                        median_time(lambda: xk @ w, reps, cold, clock))
                    add(f"relu+add {m}x{d}", Work(elem=2.0 * m * d),
                        median_time(lambda: torch.relu(xk).add_(1.0), reps, cold, clock))
                    # random numbers cost the same per value at any size (compute-bound): a
                    # whole-graph mask was ~0.2 s a call on 10^5 nodes, for one rate
                    md = min(m, DROPOUT_ROWS)
                    xd = xk[:md]
                    add(f"dropout {md}x{d}", Work(rng=md * d, elem=md * d),
                        median_time(lambda: torch.nn.functional.dropout(xd, 0.5), reps, cold, clock))
                n = min(r, graph.num_nodes)
                if shape.encoder:
                    x = torch.randn(n, graph.num_features, dtype=tdtype, generator=gen)
                    add(f"encoder {n} rows", rowwise_work(shape.encoder, n, False, shape.encoder_dropout),
                        median_time(lambda: gnn.encode(x).sum().backward(), reps, cold, clock))
                if shape.decoder:
                    hd = torch.randn(n, shape.decoder[0][0], dtype=tdtype, generator=gen).requires_grad_()
                    add(f"decoder {n} rows", rowwise_work(shape.decoder, n, True),
                        median_time(lambda: gnn.decode(hd).sum().backward(), reps, cold, clock))
    finally:
        torch.set_num_threads(old_threads)

    A = np.asarray(X, dtype=float)
    t = np.asarray(y, dtype=float)
    coef = fit_rates(A, t)
    pred = A @ coef
    base = hardware or Hardware(name="calibrated-cpu", workers_per_node=max(1, os.cpu_count() or 1),
                                   memory_gib=8.0, dense_gflops=1.0, sparse_gvalues=1.0,
                                   elementwise_gvalues=1.0, intra_bandwidth_gbs=1.0,
                                   intra_latency_us=50.0, nodes=1)
    rates = coef_rates(coef)
    rel = (pred - t) / t
    fit = {"threads": int(threads), "dtype": dtype, "clock": clock, "graph": graph.name, "model": to_dict(model_cfg),
           "rows": list(rows), "reps": reps,
           "block_rows": {k: list(v) for k, v in timed.items()},
           "rates": rates, "median_abs_rel_error": float(np.median(np.abs(rel))),
           "max_abs_rel_error": float(np.max(np.abs(rel))),
           "measurements": [{"what": nm, "seconds": float(s), "predicted": float(pr)}
                            for nm, s, pr in zip(names, t, pred)]}
    return replace(base, **rates, measured={**base.measured, "calibration": fit})


def nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||A x - b|| over x >= 0, exactly, for a handful of columns: the least-squares fit on
    every subset of the columns, the best whose coefficients are all non-negative (the cost model
    has 5 kinds of work: 31 small solves, no scipy import, which costs a fit from records more
    than the fit)."""
    n = A.shape[1]
    best, best_r = np.zeros(n), float(np.dot(b, b))
    for mask in range(1, 2 ** n):
        cols = [j for j in range(n) if mask >> j & 1]
        x, *_ = np.linalg.lstsq(A[:, cols], b, rcond=None)
        if np.all(x >= 0):
            r = float(np.sum((A[:, cols] @ x - b) ** 2))
            if r < best_r - 1e-12 * max(best_r, 1e-300):
                best, best_r = np.zeros(n), r
                best[cols] = x
    return best


def fit_rates(A: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Seconds per unit of each kind of work (the columns of ``A``: dense, sparse, elementwise,
    random, calls) fitted to the times ``t`` by non-negative least squares on relative errors."""
    scale = A.max(axis=0)
    scale[scale == 0] = 1.0
    return nnls((A / scale) / t[:, None], np.ones_like(t)) / scale


def coef_rates(coef: np.ndarray) -> dict:
    """A profile's rate fields from seconds per unit of each kind of work (a kind fitted to 0
    keeps the profile's own rate)."""
    rates = {}
    for key, c in (("dense_gflops", coef[0]), ("sparse_gvalues", coef[1]),
                   ("elementwise_gvalues", coef[2]), ("random_gvalues", coef[3])):
        if c > 0:
            rates[key] = float(1.0 / c / 1e9)
    rates["layer_overhead_us"] = float(coef[4] * 1e6)
    return rates


#: What :func:`calibrate_run` times: 3 repeats (the median of 3 is as steady as of 5 on the
#: chunk and part shapes, whose operands are the whole graph), the cold pass at two block sizes,
#: the warm pass (which only sets the ratio of two predicted single epochs) at the larger.
RUN_REPS = 3
RUN_ROWS = (2048, 8192)


def run_block_rows() -> dict:
    """Where :func:`calibrate_run`'s cold pass times each block: the chunk, whose sources are the
    whole graph at every row count (its backward fills a whole-graph gradient: most of the time
    on a 10^5-node graph), only at the largest of :data:`RUN_ROWS`; the part at every one (the
    sizes separate the per-call cost from the rates)."""
    return {"chunk": RUN_ROWS[-1:], "part": RUN_ROWS}


def calibration_key(hw: Hardware, graph_hash: str, cfg: RunConfig, clock: str) -> str:
    """The content key of a run's calibration: what its rates depend on — the base profile, this
    machine (host, CPUs, torch), the graph's content, the model config (its shape), dtype,
    threads, clock and node order, and what is timed (:data:`RUN_REPS`, :data:`RUN_ROWS`,
    :func:`run_block_rows`, :data:`DROPOUT_ROWS`).
    The run's name and dataset name are not in it: another config on the same graph reuses it."""
    import platform
    from importlib.metadata import version

    what = {"hardware": hw.as_dict(), "host": platform.node(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "torch": version("torch"), "graph_hash": graph_hash,
            "model": to_dict(cfg.model), "dtype": cfg.training.dtype,
            "threads": cfg.training.threads_per_worker, "clock": clock,
            "node_order": [cfg.training.node_order, cfg.partitioning.seed],
            "reps": RUN_REPS, "rows": list(RUN_ROWS), "block_rows": run_block_rows(),
            "dropout_rows": DROPOUT_ROWS}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]


def record_rows(cfg: RunConfig, records: Sequence[str | os.PathLike]) -> dict:
    """The layer rows the train jobs of ``cfg``'s dataset and model recorded (run records,
    ``metrics.json``, with ``layer_times``: ``gnnpipe.layertimes``): ``{"warm": [...], "cold":
    [...], "runs": {mode: [run ids]}}``, ``warm`` from one-process runs on the whole graph, ``cold``
    from parallel runs' workers. Only records timed on one compute thread's CPU clock count (a
    record without rows, of an older train job, or of several threads adds nothing); a record of
    another dataset, model or dtype is refused."""
    out: dict = {"warm": [], "cold": [], "runs": {}}
    for path in records:
        try:
            rec = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise GnnPipeError(f"calibrate --records: cannot read {path}: {e}") from None
        ours = (cfg.dataset_name, cfg.model.kind, cfg.model.layers, cfg.model.hidden, DTYPE_BYTES[cfg.training.dtype])
        theirs = tuple(rec.get(k) for k in ("dataset", "model", "layers", "hidden", "dtype_bytes"))
        if theirs != ours:
            raise GnnPipeError(f"calibrate --records: {path} is a run of {theirs[0]} {theirs[1]} {theirs[2]}x{theirs[3]} "
                               f"({theirs[4]}-byte values), not of the run config's {ours[0]} {ours[1]} "
                               f"{ours[2]}x{ours[3]} ({ours[4]}-byte); pass the records of that dataset and model")
        lt = rec.get("layer_times") or {}
        if not lt.get("rows") or lt.get("clock") != "cpu" or lt.get("threads", 1) != 1:
            continue
        kind = "warm" if lt.get("whole_graph") else "cold"
        out[kind] += [{**r, "run": rec.get("run_id")} for r in lt["rows"] if r["seconds"] > 0]
        out["runs"].setdefault(str(rec.get("mode")), []).append(rec.get("run_id"))
    return out


#: The speed-ups :func:`joint_fit` searches: from 1 (cold no slower than warm) to this.
MAX_SPEEDUP = 8.0


def joint_fit(A: np.ndarray, t: np.ndarray, Ac: np.ndarray, tc: np.ndarray) -> tuple[float, np.ndarray]:
    """(s, seconds per unit of work) that fit warm rows ``t = A c`` and cold rows ``tc = s Ac c``
    together, by least relative error: for each ``s`` the rates are linear (:func:`fit_rates`), so
    ``s`` is searched in [1, :data:`MAX_SPEEDUP`] (a grid, then golden sections around its best)."""
    y = np.concatenate([t, tc])

    def err(s):
        rows = np.vstack([A, Ac * s])
        c = fit_rates(rows, y)
        return float(np.sum(((rows @ c - y) / y) ** 2)), c

    grid = np.geomspace(1.0, MAX_SPEEDUP, 25)
    errs = [err(g)[0] for g in grid]
    i = int(np.argmin(errs))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    g = (np.sqrt(5.0) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = err(a)[0], err(b)[0]
    for _ in range(40):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = err(a)[0]
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = err(b)[0]
    best = min((grid[i], errs[i]), ((a + b) / 2, err((a + b) / 2)[0]), key=lambda p: p[1])[0]
    return float(best), err(best)[1]


def calibrate_records(rows: dict, hw: Hardware, cold: Optional[Hardware] = None) -> Optional[Hardware]:
    """The compute rates fitted to the rows train jobs recorded (:func:`record_rows`), None
    without warm rows. Warm rows (a one-process run's pieces, forward and backward, on the whole
    graph) are ``t = A c``, cold rows (the parallel runs' conv forwards on parts and chunks)
    ``t = s A c``: the warm rates ``c`` and ``single_worker_speedup`` ``s`` are fitted together by
    least relative error (:func:`joint_fit`; non-negative rates as :func:`calibrate` fits its
    samples). The warm rows are all whole-graph calls of a few shapes, so only the cold rows' other
    sizes tell a per-call cost from a per-value one. The profile's rates are the cold ones,
    ``c s``. Without cold rows the warm rows alone are fitted, and ``s`` is the ratio of what
    ``cold`` (a cold pass timed here; None: 1) and the warm rates predict for the warm rows' work
    (the ratio of two predicted single epochs, as :func:`calibrate_run` takes it)."""
    warm = rows["warm"]
    if not warm:
        return None
    A = np.asarray([r["work"] for r in warm], dtype=float)
    t = np.asarray([r["seconds"] for r in warm], dtype=float)
    measured = [(f"{r['run']}: {r['what']}", float(r["seconds"]), r["work"]) for r in warm + rows["cold"]]
    if rows["cold"]:
        Ac = np.asarray([r["work"] for r in rows["cold"]], dtype=float)
        tc = np.asarray([r["seconds"] for r in rows["cold"]], dtype=float)
        speedup, coef = joint_fit(A, t, Ac, tc)
        source = "the parallel runs' conv forwards, fitted with the rates"
    else:
        coef = fit_rates(A, t)
    warm_epoch = float((A @ coef).sum())
    if not rows["cold"] and cold is not None:
        cold_epoch = float(sum(Work(*r["work"][:3], calls=r["work"][4], rng=r["work"][3]).seconds(cold)
                               for r in warm))
        speedup, source = max(1.0, cold_epoch / max(warm_epoch, 1e-300)), "a cold pass timed by calibrate"
    elif not rows["cold"]:
        speedup, source = 1.0, "none: no parallel run and no cold pass"
    cold_rows = len(warm)  # the rows from here on are cold: their prediction is the cold rates'
    pred = np.asarray([np.dot(w, coef) * (speedup if i >= cold_rows else 1.0) for i, (_, _, w) in enumerate(measured)])
    secs = np.asarray([m[1] for m in measured])
    rel = (pred - secs) / secs
    warm_rates = coef_rates(coef)
    rates = coef_rates(coef * speedup)
    fit = {"source": "records", "runs": rows["runs"], "clock": "cpu", "threads": 1,
           "rates": rates, "warm_rates": warm_rates, "cold_from": source,
           "single_worker_speedup": speedup,
           "single_epoch_s": {"cold": warm_epoch * speedup, "warm": warm_epoch},
           "median_abs_rel_error": float(np.median(np.abs(rel))), "max_abs_rel_error": float(np.max(np.abs(rel))),
           "measurements": [{"what": nm, "seconds": sec, "predicted": float(p)}
                            for (nm, sec, _), p in zip(measured, pred)]}
    return replace(hw, **rates, single_worker_speedup=speedup, measured={**hw.measured, "calibration": fit})


def records_key(hw: Hardware, graph_hash: str, cfg: RunConfig, rows: dict) -> str:
    """The content key of a fit from records: the base profile, the graph's content, the model
    config, dtype, and the rows themselves (the machine and what was timed are in the rows: a
    retrained run's are new)."""
    what = {"hardware": hw.as_dict(), "graph_hash": graph_hash, "model": to_dict(cfg.model),
            "dtype": cfg.training.dtype, "rows": [rows["warm"], rows["cold"]], "cold_pass": not rows["cold"]}
    return "r" + hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:31]


def calibrate_run(run_config, hardware, *, clock: str = "cpu",
                  cache: str | os.PathLike | None = None,
                  records: Sequence[str | os.PathLike] = ()) -> Hardware:
    """:func:`calibrate` on what one run trains: its graph, model, dtype and threads per
    worker. The result is named ``<profile>+<dataset>`` and keeps the profile's links; its
    ``measured["calibration"]`` records the model config and the graph's content hash, so
    that a report can match it to the runs it stands for (:func:`find_calibration`).

    ``cache``: a directory of fitted profiles keyed by :func:`calibration_key`; a profile
    found there is reused (``measured["calibration"]["cached"]`` says so), one fitted here is
    written there (atomically), so a second run or config on the same graph and model pays
    nothing.

    ``records``: run records (``metrics.json``) of train jobs of this dataset and model. With a
    one-process run's layer rows among them (:func:`record_rows`) the rates are fitted to those
    (:func:`calibrate_records`; nothing is timed here, torch is not imported) and the cache key
    is :func:`records_key`; only where no parallel run recorded its workers' convs is a cold pass
    timed, for the cold-to-warm ratio."""
    cfg = run_config if isinstance(run_config, RunConfig) else load_run_config(run_config)
    hw = hardware if isinstance(hardware, Hardware) else load_hardware(hardware)
    threads = cfg.training.threads_per_worker
    if clock == "cpu" and threads != 1:
        clock = "wall"  # the CPU clock of one thread says nothing about a team of threads
    digest = str(read_graph_attrs(cfg.graph_path)["content_hash"])
    rows = record_rows(cfg, records) if records else None
    if rows and rows["warm"] and threads == 1 and clock == "cpu":
        return _from_records(cfg, hw, digest, rows, cache)
    cached, found = _cached(cache, calibration_key(hw, digest, cfg, clock) if cache is not None else "", hw, cfg)
    if found is not None:
        return found
    # not at import, which every gnnpipe command pays (the parser reads CLOCKS): torch (stage
    # balancing), scipy (the locality order)
    from ..partition import node_order
    from .predict import predict_layout

    graph = read_graph(cfg.graph_path)
    out = calibrate(graph, cfg.model, hw, rows=RUN_ROWS, reps=RUN_REPS, threads=threads,
                    dtype=cfg.training.dtype, clock=clock, block_rows=run_block_rows())
    # A process training alone keeps its tensors in cache from conv to conv; the workers of
    # a parallel run, between exchanges, do not (measured: single-process epochs match the
    # warm rates, parallel workers' compute the cold ones). The ratio of the two predicted
    # single-process epochs is the profile's single_worker_speedup.
    # ... and numbers its nodes for locality (training.node_order): the warm rates are timed on
    # the graph as the single engine holds it
    how = node_order(graph, cfg.training.node_order, seed=cfg.partitioning.seed, path=cfg.locality_path, graph_hash=digest)
    held = graph.renumbered(how.pop("order")) if how["parts"] else graph
    warm = calibrate(held, cfg.model, hw, rows=RUN_ROWS[-1:], reps=RUN_REPS, threads=threads,
                     dtype=cfg.training.dtype, clock=clock, evict=False)
    del held
    gnn = build_model(cfg.model, graph.num_features, graph.num_classes)
    sizes = {"num_nodes": graph.num_nodes, "num_edges": graph.num_edges, "partitions": {}}
    epoch = {name: predict_layout(sizes, gnn, model_shape(gnn), h, "single", 1, 1, 1,
                                  dtype_bytes=DTYPE_BYTES[cfg.training.dtype]).epoch_s
             for name, h in (("cold", out), ("warm", warm))}
    speedup = max(1.0, epoch["cold"] / epoch["warm"])
    fit = {**out.measured["calibration"], "graph_hash": digest,
           "warm_rates": warm.measured["calibration"]["rates"], "warm_node_order": how, "single_epoch_s": epoch,
           "single_worker_speedup": speedup}
    fitted = replace(out, single_worker_speedup=speedup, measured={**out.measured, "calibration": fit})
    if cached is not None:
        write_hardware(fitted, cached)
    return _named(fitted, hw, cfg, fit)


def _cached(cache, key: str, hw: Hardware, cfg: RunConfig):
    """(the cache file of ``key`` or None without a cache, the profile found there, named for
    ``cfg``'s dataset, or None)."""
    if cache is None:
        return None, None
    path = Path(cache) / f"{key}.yaml"
    if not path.is_file():
        return path, None
    found = load_hardware(path)
    return path, _named(found, hw, cfg, {**found.measured["calibration"], "cached": str(path)})


def _from_records(cfg: RunConfig, hw: Hardware, digest: str, rows: dict, cache) -> Hardware:
    """:func:`calibrate_run` from the train jobs' rows (cached under :func:`records_key`)."""
    cached, found = _cached(cache, records_key(hw, digest, cfg, rows) if cache is not None else "", hw, cfg)
    if found is not None:
        return found
    cold = None
    if not rows["cold"]:  # no parallel run measured its workers: time the cold rates here
        graph = read_graph(cfg.graph_path)
        cold = calibrate(graph, cfg.model, hw, rows=RUN_ROWS, reps=RUN_REPS, threads=1,
                         dtype=cfg.training.dtype, clock="cpu", block_rows=run_block_rows())
    fitted = calibrate_records(rows, hw, cold)
    fit = {**fitted.measured["calibration"], "graph": cfg.dataset_name, "graph_hash": digest,
           "model": to_dict(cfg.model), "dtype": cfg.training.dtype}
    fitted = replace(fitted, measured={**fitted.measured, "calibration": fit})
    if cached is not None:
        write_hardware(fitted, cached)
    return _named(fitted, hw, cfg, fit)


def _named(fitted: Hardware, hw: Hardware, cfg: RunConfig, fit: dict) -> Hardware:
    """A fitted profile named for the run's dataset (``<profile>+<dataset>``)."""
    return replace(fitted, name=f"{hw.name}+{cfg.dataset_name}",
                   description=f"{hw.description}; compute rates fitted to {cfg.model.kind} "
                               f"{cfg.model.layers}x{cfg.model.hidden} on {cfg.dataset_name}",
                   measured={**fitted.measured, "calibration": {**fit, "dataset": cfg.dataset_name}})


def write_hardware(hw: Hardware, path: str | os.PathLike) -> None:
    """Write a profile as YAML that :func:`gnnpipe.costmodel.hardware.load_hardware` reads back."""
    write_text(path, yaml.safe_dump(hw.as_dict(), sort_keys=False))


def find_calibration(directory: str | os.PathLike, model_cfg: ModelConfig, graph_hash: str,
                     dtype: str = "float32") -> Optional[Hardware]:
    """The profile in ``directory`` (``*.yaml``, written by :func:`calibrate_run`) fitted to
    this model config, dtype and graph content, or None."""
    want = to_dict(model_cfg)
    for path in sorted(Path(directory).glob("*.yaml")):
        hw = load_hardware(path)
        fit = hw.measured.get("calibration") or {}
        if fit.get("model") == want and fit.get("graph_hash") == graph_hash and fit.get("dtype") == dtype:
            return hw
    return None
