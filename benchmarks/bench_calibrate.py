"""Measure this machine for the cost model: kernels, concurrency, gloo links; check predictions.

    python benchmarks/bench_calibrate.py --out results/benchmarks/calibrate.json \\
        --write-profile config/hardware/cpu-2core.yaml
    python benchmarks/bench_calibrate.py --check results/data/synth/graph.h5 --layers 8 \\
        --hidden 64 --epochs 5 --runs-dir results/runs --out results/benchmarks/check.json
    python benchmarks/bench_calibrate.py --smoke --out /tmp/calibrate.json   # every measurement, tiny
    python benchmarks/bench_calibrate.py --fit results/runs/<run>/run.yaml --rounds 3 \
        --out results/benchmarks/fit.json      # what the workflow's calibrate costs, what it predicts
    python benchmarks/bench_calibrate.py --fit results/runs/<run>/run.yaml --rounds 3 \
        --records results/runs/<run>/metrics.json results/runs/<parallel run>/metrics.json  # ... from records

Measurements (medians of ``--reps``, after a warm-up):

* dense: ``torch.mm`` of the shapes a GNN layer runs (``(n, d_in) @ (d_in, d_out)``) with
  1 and 2 threads, and with 2 processes of 1 thread each running at the same time (the
  per-worker rate when both cores compute: ``shared_node_efficiency``);
* sparse: CSR SpMM (``gnnpipe.models.ops.spmm``) of a synthetic graph at several widths,
  counted in stored entries x width per second; likewise 1 / 2 threads / 2 processes;
* elementwise: ReLU then an in-place add, values per second (and dropout apart: its
  random mask makes it several times dearer per value);
* per-call overhead: a GCN conv forward + backward on a 64-node block;
* gloo over loopback between 2 processes: ping-pong ``send``/``recv`` of 4 B .. 64 MiB;
  latency is half the round trip of the smallest message, bandwidth the slope of time
  against size over the large ones;
* overlap: an all-to-all started asynchronously while a worker multiplies matrices,
  against the two apart: the share of the transfer hidden is ``comm_overlap``;
* oversubscription: 2 x cores workers, each a loop of matmul bursts with a tiny blocking
  exchange after each (all-to-all; a ring of send/recv as between pipeline stages),
  against the loop without exchanges; what an exchange costs there more than with
  ``cores`` workers is the profile's ``oversubscribed_wait_us``;
* the resident set of a fresh worker after its imports (``process_overhead_gib``).

``--write-profile`` turns them into a hardware profile (1-thread rates per worker, since
each worker runs one compute thread by default). ``--check`` fits the rates to a real
graph and model (``gnnpipe.planning.calibrate.calibrate``), trains ``single`` for a few epochs and
compares measured with predicted epoch times, and does the same for every run record
under ``--runs-dir`` (any mode) whose graph is the checked one. ``--fit`` times the workflow's
own calibration of a run (``calibrate_run``, no cache) ``--rounds`` times: its thread's CPU
seconds, and the epochs each fit predicts for the run's model on its graph, single, graph
1 x 2 and pipeline 2 x 1 (C = 8).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gnnpipe.costmodel.hardware import load_hardware  # noqa: E402
from gnnpipe.io import write_json, write_text  # noqa: E402
from gnnpipe.planning.calibrate import median_time as _median  # noqa: E402
from smoke import parse_args  # noqa: E402


def _graph_csr(n: int, deg: int, seed: int = 0):
    from gnnpipe.config import SyntheticConfig
    from gnnpipe.data.synthetic import generate
    from gnnpipe.models.block import Block

    g = generate(SyntheticConfig(shape="default", num_nodes=n, avg_degree=float(deg), num_features=8,
                                 seed=seed), name="bench")
    return Block.full(g.indptr, g.indices)


DENSE_SHAPES = [(20000, 128, 128), (20000, 602, 100), (20000, 100, 100)]
WIDTHS = [16, 64, 128]
SMALL = 1000  # --smoke: rows of every dense and sparse measurement (x 100: elementwise values)


def kernel_rates(reps: int, threads: int, n: int = 20000, deg: int = 16, clock: str = "wall",
                 small: bool = False) -> dict:
    """Dense GFLOP/s, SpMM G values/s and elementwise G values/s with ``threads`` threads,
    timed on ``clock`` (``cpu``: this thread's CPU time, one thread only); ``small``: ``SMALL`` rows."""
    n = SMALL if small else n
    from functools import partial

    from gnnpipe.planning.calibrate import median_time

    _median = partial(median_time, clock=clock)  # noqa: N806
    from gnnpipe.models.ops import gcn_aggregate, self_loop_csr

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        dense = {}
        for m, k, d in DENSE_SHAPES:
            m = SMALL if small else m
            a, b = torch.randn(m, k, generator=gen), torch.randn(k, d, generator=gen)
            dense[f"{m}x{k}x{d}"] = 2.0 * m * k * d / _median(lambda: a @ b, reps) / 1e9
        block = _graph_csr(n, deg)
        entries = self_loop_csr(block).nnz
        sparse = {}
        for d in WIDTHS:
            x = torch.randn(n, d, generator=gen)
            sparse[str(d)] = entries * d / _median(lambda: gcn_aggregate(x, block), reps) / 1e9
        x = torch.randn(SMALL * 100 if small else 4_000_000, generator=gen)
        elem = 2.0 * x.numel() / _median(lambda: torch.relu(x).add_(1.0), reps) / 1e9
        drop = x.numel() / _median(lambda: torch.nn.functional.dropout(x, 0.5), reps) / 1e9
        return {"threads": threads, "clock": clock, "dense_gflops": dense, "sparse_gvalues": sparse,
                "elementwise_gvalues": elem, "dropout_gvalues": drop,
                "spmm_graph": {"nodes": n, "entries": entries}}
    finally:
        torch.set_num_threads(old)


def layer_overhead_us(reps: int) -> float:
    """Forward + backward of a GCN conv on a 64-node block: nearly all fixed cost."""
    from gnnpipe.models.gcn import GCNConv

    block = _graph_csr(64, 4)
    conv = GCNConv(16, 16)
    x = torch.randn(64, 16, requires_grad=True)
    return _median(lambda: conv(x, block).sum().backward(), reps * 20, clock="cpu") * 1e6


def _concurrent(rank: int, world: int, reps: int, small: bool) -> dict:
    import torch.distributed as dist

    dist.barrier()
    return kernel_rates(reps, 1, clock="cpu", small=small)


def _pingpong(rank: int, world: int, sizes: list[int], reps: int) -> dict:
    import torch.distributed as dist

    out = {}
    for size in sizes:
        t = torch.zeros(max(1, size // 4), dtype=torch.float32)
        times = []
        for i in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
            if i:
                times.append(time.perf_counter() - t0)
        out[size] = float(statistics.median(times)) / 2  # one way
    return out


def _timed_together(fns: dict, reps: int) -> dict:
    """``{name}_s``: the median wall time of ``fn()`` between two barriers over ``reps``
    runs after a warm-up, every rank running the same ``fn`` at once."""
    import torch.distributed as dist

    out = {}
    for name, fn in fns.items():
        times = []
        for i in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            if i:
                times.append(time.perf_counter() - t0)
        out[f"{name}_s"] = float(statistics.median(times))
    return out


def _overlap(rank: int, world: int, reps: int) -> dict:
    """Does a transfer proceed while this worker computes? Times a matmul burst alone, an
    all-to-all alone (async, waited at once) and the two together (all-to-all started,
    matmul, wait): overlap = (alone + alone - together) / the shorter of the two."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(rank)
    a, b = torch.randn(2000, 512, generator=gen), torch.randn(512, 512, generator=gen)
    send = torch.randn(world * (1 << 20))  # 4 MiB to each peer
    recv = torch.empty_like(send)

    def compute():
        for _ in range(4):
            a @ b

    def comm():
        dist.all_to_all_single(recv, send, async_op=True).wait()

    def both():
        work = dist.all_to_all_single(recv, send, async_op=True)
        compute()
        work.wait()

    out = _timed_together({"compute": compute, "comm": comm, "both": both}, reps)
    hidden = out["compute_s"] + out["comm_s"] - out["both_s"]
    out["overlap"] = float(min(1.0, max(0.0, hidden / min(out["compute_s"], out["comm_s"]))))
    return out


def _oversubscribed(rank: int, world: int, iters: int, reps: int) -> dict:
    """``world`` workers on fewer cores, each a loop of ``iters`` (matmul burst, then a tiny
    blocking exchange): against the same loop without exchanges, what each exchange costs.
    With more workers than cores an exchange waits until every peer has had its turn on
    a core (the scheduler's time slice), far longer than the link's latency."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(rank)
    a, b = torch.randn(1000, 256, generator=gen), torch.randn(256, 256, generator=gen)
    tiny = torch.zeros(world * 16)
    tiny_out = torch.empty_like(tiny)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    ring = torch.zeros(16)

    def burst():
        for _ in range(4):
            a @ b

    def alone():
        for _ in range(iters):
            burst()

    def a2a():
        for _ in range(iters):
            burst()
            dist.all_to_all_single(tiny_out, tiny)

    def p2p():  # the pipeline's pattern: a message to the next stage, one from the previous
        for _ in range(iters):
            burst()
            req = dist.isend(ring, nxt)
            dist.recv(ring, prv)
            req.wait()

    out = _timed_together({"alone": alone, "all_to_all": a2a, "p2p_ring": p2p}, reps)
    for name in ("all_to_all", "p2p_ring"):
        out[f"{name}_per_exchange_us"] = (out[f"{name}_s"] - out["alone_s"]) / iters * 1e6
    return out


def oversubscription(reps: int, cores: int, iters: int = 40) -> dict:
    """``_oversubscribed`` at 2 x cores workers and, for reference, at ``cores`` workers."""
    from gnnpipe.parallel.testing import spawn_multi_process

    out = {}
    for world in sorted({max(2, cores), 2 * max(1, cores)}):
        out[str(world)] = spawn_multi_process(_oversubscribed, world, iters, reps, timeout=600)[0]
    return out


def process_rss_gib() -> float:
    """Resident set of a fresh worker process once it has imported what a worker imports
    (torch, h5py, the engines): what its ru_maxrss holds before the run's first tensor."""
    import subprocess

    code = ("import resource, torch, torch.distributed, h5py, gnnpipe.train, gnnpipe.parallel.layout_engine; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return int(out.stdout.split()[-1]) * 1024 / 2**30


def gloo_link(reps: int, small: bool = False) -> dict:
    from gnnpipe.parallel.testing import spawn_multi_process

    sizes = [4, 1 << 10, 1 << 20, 1 << 21] if small else [4, 1 << 10, 1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26]
    one_way = spawn_multi_process(_pingpong, 2, sizes, reps, timeout=300)[0]
    big = [s for s in sizes if s >= 1 << 20]
    slope, intercept = np.polyfit(big, [one_way[s] for s in big], 1)
    return {"one_way_s": {str(k): v for k, v in one_way.items()}, "latency_us": one_way[4] * 1e6,
            "bandwidth_gbs": 1.0 / slope / 1e9, "large_message_intercept_us": intercept * 1e6}


def measure(reps: int, small: bool = False) -> dict:
    """Every measurement of the module docstring; ``small`` (``--smoke``): tiny sizes, seconds."""
    from gnnpipe.parallel.testing import spawn_multi_process

    load = os.getloadavg()[0]
    solo1 = kernel_rates(reps, 1, clock="cpu", small=small)  # the core's own rate, blind to other jobs
    solo1_wall, solo2 = kernel_rates(reps, 1, small=small), kernel_rates(reps, 2, small=small)
    conc = spawn_multi_process(_concurrent, 2, reps, small, timeout=600)
    cores = os.cpu_count() or 1
    return {"cpu_count": os.cpu_count(), "torch": torch.__version__, "load_avg_1min": load,
            "solo_1_thread": solo1, "solo_1_thread_wall": solo1_wall, "solo_2_threads": solo2,
            "concurrent_2x1": conc, "layer_overhead_us": layer_overhead_us(reps),
            "gloo_loopback": gloo_link(reps, small), "overlap": spawn_multi_process(_overlap, 2, 3 * reps, timeout=300)[0],
            "oversubscribed": oversubscription(reps, cores, 2 if small else 40), "mem_total_gib": _mem_total_gib(),
            "process_rss_gib": process_rss_gib(),
            "load_avg_1min_after": os.getloadavg()[0]}


def _mem_total_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 2**30
    return 0.0


def profile_yaml(m: dict, name: str = "cpu-2core", retained_heap_fraction: float = 0.0) -> str:
    """The hardware profile of this machine from ``measure``'s results; ``retained_heap_fraction``
    is ``bench_memory_modes``'s (kept from the profile this one replaces)."""
    s1, s2 = m["solo_1_thread"], m["solo_2_threads"]
    dense1 = statistics.median(s1["dense_gflops"].values())
    sparse1 = statistics.median(s1["sparse_gvalues"].values())
    # two workers computing at once against one alone, both on the CPU clock: the cost of
    # sharing caches and memory bandwidth, not of waiting for a core
    conc_dense = statistics.mean(statistics.median(c["dense_gflops"].values()) for c in m["concurrent_2x1"])
    conc_sparse = statistics.mean(statistics.median(c["sparse_gvalues"].values()) for c in m["concurrent_2x1"])
    eff = min(1.0, 0.5 * (conc_dense / dense1 + conc_sparse / sparse1))
    link = m["gloo_loopback"]
    workers = int(m["cpu_count"] or 1)
    # what an exchange costs more with 2 workers a core than with one (both patterns, mean)
    over, base = m["oversubscribed"][str(2 * max(1, workers))], m["oversubscribed"][str(max(2, workers))]
    wait_us = max(0.0, statistics.mean(over[f"{k}_per_exchange_us"] - base[f"{k}_per_exchange_us"]
                                       for k in ("all_to_all", "p2p_ring")))
    mem = m["mem_total_gib"] * 0.8 / workers
    compact = {k: v for k, v in m.items() if k != "gloo_loopback"}
    compact["gloo_loopback"] = {k: v for k, v in link.items() if k != "one_way_s"}
    lines = [
        f"# This machine ({workers} cores), measured by benchmarks/bench_calibrate.py",
        f"# (torch {m['torch']}, medians, 1-min load average {m['load_avg_1min']:.1f} while measuring).",
        "# Rates are per worker with one compute thread, timed on the thread's CPU clock (what a",
        "# core does, not what other jobs leave of it); two workers computing at once each get",
        "# shared_node_efficiency of them. Links: gloo over loopback between two processes",
        "# (ping-pong, wall clock: a loaded machine inflates the latency). Re-measure with",
        "#   python benchmarks/bench_calibrate.py --write-profile config/hardware/cpu-2core.yaml",
        "# and fit the compute rates to a given graph and model with `gnnpipe plan --calibrate`.",
        f"name: {name}",
        f"description: this {workers}-core CPU machine, workers are processes over gloo (loopback)",
        "source: measured by benchmarks/bench_calibrate.py",
        f"workers_per_node: {workers}",
        "nodes: 1",
        "oversubscribe: true      # more workers than cores time-share them",
        f"memory_gib: {mem:.1f}         # 80 % of {m['mem_total_gib']:.1f} GiB over {workers} workers",
        f"dense_gflops: {dense1:.2f}       # 1 thread; 2 threads (wall clock): "
        f"{statistics.median(s2['dense_gflops'].values()):.2f}",
        f"sparse_gvalues: {sparse1:.3f}     # CSR SpMM, 1 thread; 2 threads (wall clock): "
        f"{statistics.median(s2['sparse_gvalues'].values()):.3f}",
        f"elementwise_gvalues: {s1['elementwise_gvalues']:.3f}",
        f"random_gvalues: {s1['dropout_gvalues']:.4f}     # dropout masks (CPU bernoulli is slow)",
        f"layer_overhead_us: {m['layer_overhead_us']:.0f}",
        f"shared_node_efficiency: {eff:.3f}",
        f"intra_bandwidth_gbs: {link['bandwidth_gbs']:.3f}",
        f"intra_latency_us: {link['latency_us']:.0f}",
        f"oversubscribed_wait_us: {wait_us:.0f}     # per blocking exchange, {2 * workers} workers on "
        f"{workers} cores against {workers} (all-to-all, stage-to-stage receive: mean)",
        f"comm_overlap: {m['overlap']['overlap']:.2f}     # of an all-to-all, hidden behind a matmul",
        f"process_overhead_gib: {m['process_rss_gib']:.3f}     # a worker's resident set after its imports",
        f"retained_heap_fraction: {retained_heap_fraction:.2f}     # heap kept beyond the live tensors / activations "
        "(bench_memory_modes)",
        "measured:",
    ]
    body = json.dumps(compact, indent=2, sort_keys=True, default=float)
    lines += ["  " + ln for ln in _yaml_block(json.loads(body))]
    return "\n".join(lines) + "\n"


def _yaml_block(obj) -> list[str]:
    import yaml

    return yaml.safe_dump(obj, sort_keys=True, default_flow_style=False).splitlines()


# --------------------------------------------------------------------------- --check
def _single_epochs(graph_path: str, model_cfg, epochs: int, threads: int, clock: str = "wall") -> list[float]:
    from gnnpipe.config import (GraphParallelConfig, PartitionConfig, PipelineConfig, RunConfig,
                                TrainingConfig)
    from gnnpipe.parallel.single import SingleEngine

    torch.set_num_threads(threads)
    cfg = RunConfig(run_id="bench", mode="single", dataset_name="bench", graph_path=graph_path,
                    store_path=None, out_dir="/tmp", model=model_cfg,
                    training=TrainingConfig(epochs=epochs, threads_per_worker=threads),
                    partitioning=PartitionConfig(), pipeline=PipelineConfig(),
                    graph_parallel=GraphParallelConfig())
    from gnnpipe.planning.calibrate import CLOCKS

    now = CLOCKS[clock]
    eng = SingleEngine(cfg, None, None, torch.device("cpu"))
    times = []
    for e in range(epochs + 1):
        t0 = now()
        eng.train_epoch(e)
        if e:
            times.append(now() - t0)
    return times


def check(graph_path: str, model_cfg, hw_name: str, epochs: int, threads: int,
          runs_dir: str | None, rounds: int = 3, clock: str = "wall") -> dict:
    """Calibrate on the graph and predict single-process epochs, against measured ones.

    On a shared machine the speed drifts with other jobs, so calibration and measurement
    alternate in ``rounds``: each round fits the rates, then times ``epochs`` epochs; the
    error of each round compares the two made at nearly the same time.
    """
    from gnnpipe.costmodel import hardware as ch
    from gnnpipe.graph import read_graph
    from gnnpipe.planning.calibrate import calibrate
    from gnnpipe.planning.plan import plan, predict_layout
    from gnnpipe.planning.shape import build_model, model_shape
    from gnnpipe.planning.stats import cached_graph_stats

    graph = read_graph(graph_path)
    hw = ch.load_hardware(hw_name)
    stats = {"num_nodes": graph.num_nodes, "num_edges": graph.num_edges, "partitions": {}}
    per_round = []
    fitted = hw
    for r in range(rounds):
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        fitted = calibrate(graph, model_cfg, hw, threads=threads, clock=clock)
        cal_s = time.perf_counter() - t0
        measured = _single_epochs(graph_path, model_cfg, epochs, threads, clock)
        pred = plan(stats, model_cfg, graph.num_features, graph.num_classes, fitted, 1).rows[0].epoch_s
        per_round.append({"round": r, "load_avg_1min": [load0, os.getloadavg()[0]], "calibration_s": cal_s,
                          "rates": fitted.measured["calibration"]["rates"],
                          "fit_median_abs_rel_error": fitted.measured["calibration"]["median_abs_rel_error"],
                          "measured_epochs_s": measured, "measured_s": statistics.median(measured),
                          "predicted_s": pred})
    for pr in per_round:
        pr["rel_error"] = (pr["predicted_s"] - pr["measured_s"]) / pr["measured_s"]
    rows = [{"mode": "single", "workers": 1,
             "measured_s": statistics.median(pr["measured_s"] for pr in per_round),
             "predicted_s": statistics.median(pr["predicted_s"] for pr in per_round),
             "round_errors": [pr["rel_error"] for pr in per_round],
             "profile_predicted_s": plan(stats, model_cfg, graph.num_features, graph.num_classes, hw,
                                         1).rows[0].epoch_s}]
    for rec in sorted(Path(runs_dir).glob("*/metrics.json")) if runs_dir else []:
        m = json.loads(rec.read_text())
        run_yaml = rec.parent / "run.yaml"
        if m.get("mode") == "single" or not run_yaml.exists():
            continue
        from gnnpipe.config import load_run_config

        cfg = load_run_config(run_yaml)
        if Path(cfg.graph_path).resolve() != Path(graph_path).resolve() or cfg.model != model_cfg:
            continue
        st = cached_graph_stats(graph_path, sorted({k for k in (cfg.ways, cfg.chunks) if k > 1}),
                                method=cfg.partitioning.method, seed=cfg.partitioning.seed,
                                balance_edges=cfg.partitioning.balance_edges,
                                balance_nodes=cfg.partitioning.balance_nodes)
        gnn = build_model(cfg.model, graph.num_features, graph.num_classes)
        est = predict_layout(st, gnn, model_shape(gnn), fitted, cfg.mode, cfg.stages, cfg.ways, cfg.chunks,
                             dtype_bytes=m.get("dtype_bytes", 4), overlap=cfg.graph_parallel.overlap,
                             balance=cfg.pipeline.balance, pipeline_cfg=cfg.pipeline)
        rows.append({"run_id": m["run_id"], "mode": cfg.mode, "workers": cfg.workers,
                     "stages": cfg.stages, "ways": cfg.ways, "chunks": cfg.chunks,
                     "measured_s": m["epoch_time_s"], "predicted_s": est.epoch_s,
                     "measured_breakdown_s": m.get("epoch_time_breakdown_s"),
                     "predicted_breakdown_s": {"compute": est.compute_s, "comm": est.comm_s,
                                               "bubble": est.bubble_s},
                     "measured_bytes": m.get("comm_bytes_per_epoch"),
                     "predicted_bytes": est.bytes["total"]})
    for r in rows:
        r["rel_error"] = (r["predicted_s"] - r["measured_s"]) / r["measured_s"]
    return {"graph": graph_path, "num_nodes": graph.num_nodes, "num_edges": graph.num_edges,
            "model": model_cfg.__dict__, "threads": threads, "clock": clock, "rounds": per_round,
            "calibration": fitted.measured["calibration"], "rows": rows}


def _record_predictions(records, fits: dict) -> list[dict]:
    """Each run record's measured epoch against what each fitted profile in ``fits`` predicts for its
    layout (its run.yaml beside it; METIS statistics cached beside the graph)."""
    from gnnpipe.config import load_run_config
    from gnnpipe.graph import read_graph_attrs
    from gnnpipe.planning.predict import predict_layout
    from gnnpipe.planning.shape import build_model, model_shape
    from gnnpipe.planning.stats import cached_graph_stats

    rows = []
    for rec in records:
        m = json.loads(Path(rec).read_text())
        cfg = load_run_config(Path(rec).parent / "run.yaml")
        attrs = read_graph_attrs(cfg.graph_path)
        st = cached_graph_stats(cfg.graph_path, sorted({k for k in (cfg.ways, cfg.chunks) if k > 1}),
                                method=cfg.partitioning.method, seed=cfg.partitioning.seed,
                                balance_edges=cfg.partitioning.balance_edges,
                                balance_nodes=cfg.partitioning.balance_nodes)
        gnn = build_model(cfg.model, int(attrs["num_features"]), int(attrs["num_classes"]))
        pred = {name: predict_layout(st, gnn, model_shape(gnn), hw, cfg.mode, cfg.stages, cfg.ways, cfg.chunks,
                                     dtype_bytes=m.get("dtype_bytes", 4), overlap=cfg.graph_parallel.overlap,
                                     balance=cfg.pipeline.balance, pipeline_cfg=cfg.pipeline)
                for name, hw in fits.items()}
        if cfg.mode == "single":  # its epoch again on this thread's CPU clock: the fits' clock, blind to the load
            from gnnpipe.parallel.single import SingleEngine

            torch.set_num_threads(cfg.training.threads_per_worker)  # as the run: an idle team's spin counts
            eng = SingleEngine(cfg, None, None, torch.device("cpu"))
            cpu = []
            for e in range(4):
                t0 = time.thread_time()
                eng.train_epoch(e)
                cpu.append(time.thread_time() - t0)
            del eng
        rows.append({"run_id": m["run_id"], "mode": cfg.mode, "measured_s": m["epoch_time_s"],
                     "measured_cpu_s": statistics.median(cpu[1:]) if cfg.mode == "single" else None,
                     # rank 0's thread CPU in the epoch its train job timed its layers in
                     "recorded_epoch_cpu_s": (m.get("layer_times") or {}).get("epoch_cpu_s"),
                     "measured_compute_s": m["epoch_time_breakdown_s"]["compute"],
                     "predicted_s": {k: e.epoch_s for k, e in pred.items()},
                     "predicted_compute_s": {k: e.compute_s for k, e in pred.items()}})
    return rows


def _calibrate_job(run_yaml: str, hw_name: str, records) -> dict:
    """``gnnpipe calibrate --records`` as the workflow's job runs it (a process of its own, no
    cache): its wall and CPU seconds (user + system of the child) and whether it imported torch."""
    import resource
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        code = ("import sys; from gnnpipe.cli import main; rc = main(sys.argv[1:]); "
                "print('torch' in sys.modules); sys.exit(rc)")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-c", code, "calibrate", "--run-config", run_yaml, "--hardware",
                              hw_name, "--records", *records, "--out", f"{tmp}/fit.yaml"],
                             capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")})
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "imported_torch": res.stdout.strip().splitlines()[-1] == "True"}


def fit_cost(run_yaml: str, hw_name: str, rounds: int, records=()) -> dict:
    """``calibrate_run`` of a run, ``rounds`` times: each fit's CPU seconds (this thread, and the
    process's; torch already imported, ~1.3 s that the workflow's calibrate job also pays) and
    wall seconds, and its predicted epochs of single, graph 1 x 2 and pipeline 2 x 1 with 8
    chunks on the run's graph (METIS statistics, cached beside the graph).

    ``records``: run records (metrics.json, run.yaml beside each) of that dataset and model whose
    train jobs timed their layers: each round then also fits them (``calibrate_run(records=...)``),
    in this process and as the workflow's job (``gnnpipe calibrate --records``, a process of its
    own: its CPU seconds, imports included), in turns with the fit that times samples, and each
    record's measured epoch is compared with what the two fits predict for its layout."""
    from gnnpipe.config import load_run_config, to_dict
    from gnnpipe.graph import read_graph_attrs
    from gnnpipe.planning.calibrate import calibrate_run
    from gnnpipe.planning.predict import predict_layout
    from gnnpipe.planning.shape import build_model, model_shape
    from gnnpipe.planning.stats import cached_graph_stats

    cfg = load_run_config(run_yaml)
    attrs = read_graph_attrs(cfg.graph_path)
    stats = cached_graph_stats(cfg.graph_path, [2, 8], method=cfg.partitioning.method, seed=cfg.partitioning.seed)
    gnn = build_model(cfg.model, int(attrs["num_features"]), int(attrs["num_classes"]))
    shape = model_shape(gnn)
    layouts = {"single": ("single", 1, 1, 1), "graph 1x2": ("graph", 1, 2, 2),
               "pipeline 2x1 C=8": ("pipeline", 2, 1, 8)}
    ways = {"samples": ()} if not records else {"samples": (), "records": tuple(records)}
    out = []
    for r in range(rounds):
        for way, recs in ways.items():
            load0 = os.getloadavg()[0]
            t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            hw = calibrate_run(cfg, hw_name, records=recs)
            row = {"round": r, "fit": way, "wall_s": time.perf_counter() - t0,
                   "thread_cpu_s": time.thread_time() - c0,
                   "process_cpu_s": time.process_time() - p0, "load_avg_1min": [load0, os.getloadavg()[0]],
                   "single_worker_speedup": hw.single_worker_speedup,
                   "predicted_epoch_s": {k: predict_layout(stats, gnn, shape, hw, *v).epoch_s
                                         for k, v in layouts.items()}}
            if recs:
                row["job"] = _calibrate_job(run_yaml, hw_name, recs)
                row["records"] = _record_predictions(recs, {"samples": out[-1]["profile"], "records": hw})
            row["profile"] = hw
            print(f"fit {r} from {way}: {row['thread_cpu_s']:.2f} s thread CPU, {row['wall_s']:.1f} s wall (load "
                  f"{load0:.1f}); predicted " + ", ".join(f"{k} {v:.3f} s" for k, v in row["predicted_epoch_s"].items())
                  + (f"; as a job {row['job']['cpu_s']:.2f} s CPU, {row['job']['wall_s']:.2f} s wall, torch "
                     f"imported: {row['job']['imported_torch']}" if recs else ""))
            for p in row.get("records", []):
                cpu = f" (thread CPU now {p['measured_cpu_s']:.4f} s)" if p["measured_cpu_s"] else ""
                if p["recorded_epoch_cpu_s"]:
                    cpu += f" (rank 0's thread CPU then {p['recorded_epoch_cpu_s']:.4f} s)"
                print(f"    {p['run_id']:40s} measured {p['measured_s']:.4f} s{cpu}; predicted "
                      + ", ".join(f"{k} {v:.4f} s ({(v - p['measured_s']) / p['measured_s']:+.0%})"
                                  for k, v in p["predicted_s"].items()))
            out.append(row)
    for row in out:
        row.pop("profile")
    return {"run_config": run_yaml, "graph": cfg.graph_path, "model": to_dict(cfg.model), "records": list(records),
            "rounds": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="results/benchmarks/calibrate.json")
    ap.add_argument("--write-profile", help="write the measured hardware profile (YAML) here")
    ap.add_argument("--check", metavar="GRAPH", help="fit on this graph and compare predicted epochs")
    ap.add_argument("--hardware", default="cpu-2core")
    ap.add_argument("--kind", default="gcn")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="--check: calibrate/measure rounds; --fit: fits")
    ap.add_argument("--fit", metavar="RUN_YAML", help="time the workflow's calibration of this run")
    ap.add_argument("--records", nargs="*", default=[], metavar="METRICS_JSON",
                    help="--fit: also fit these run records' layer rows (in turns with the fit that times "
                         "samples) and compare each record's measured epoch with both fits' predictions")
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                    help="--check: time with wall clock, or thread CPU time (a shared machine)")
    ap.add_argument("--runs-dir", help="also compare these run records (metrics.json + run.yaml)")
    a = parse_args(ap, argv, reps=1)
    if a.fit:
        res = fit_cost(a.fit, a.hardware, a.rounds, a.records)
    elif a.check:
        from gnnpipe.config import ModelConfig

        res = check(a.check, ModelConfig(kind=a.kind, layers=a.layers, hidden=a.hidden), a.hardware,
                    a.epochs, a.threads, a.runs_dir, a.rounds, a.clock)
        for pr in res["rounds"]:
            print(f"round {pr['round']} (load {pr['load_avg_1min'][0]:.1f}): measured {pr['measured_s']:.4f} s  "
                  f"predicted {pr['predicted_s']:.4f} s  ({pr['rel_error']:+.1%})")
        for r in res["rows"]:
            print(f"{r.get('run_id', r['mode']):40s} measured {r['measured_s']:.4f} s  predicted "
                  f"{r['predicted_s']:.4f} s  ({r['rel_error']:+.1%})")
        print(f"calibration fit: median |rel err| {res['calibration']['median_abs_rel_error']:.1%} "
              f"over {len(res['calibration']['measurements'])} measurements")
    else:
        res = measure(a.reps, a.smoke)
        if a.write_profile:
            kept = load_hardware(a.write_profile).retained_heap_fraction if Path(a.write_profile).exists() else 0.0
            write_text(a.write_profile, profile_yaml(res, retained_heap_fraction=kept))
            print(f"wrote {a.write_profile}")
    write_json(a.out, res)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
