"""Epoch time, its split and bytes per epoch of the training modes, side by side.

    .venv/bin/python benchmarks/bench_modes.py --out results/bench/modes.json
    .venv/bin/python benchmarks/bench_modes.py --out /tmp/modes.json --quick       # smaller graphs
    .venv/bin/python benchmarks/bench_modes.py --out m.json --modes single graph pipeline
    .venv/bin/python benchmarks/bench_modes.py --out /tmp/modes.json --smoke   # 300 nodes, 2 layers, P = 2

On the ``reddit-like`` and ``physics-like`` synthetic shapes (2*10^4 nodes at the real
graphs' average degrees, see ``SIZES``; ``--nodes`` and ``--degree`` override), a 32-layer GCN of hidden width 100 is
trained for ``--warmup`` + ``--epochs`` epochs in every layout: ``single`` with each of
``--single-threads`` (default 2, the reference of ``ratio_to_single``, and 1), and each
mode on P workers in ``--workers`` with one thread each. Every worker is a real process (gloo on CPU, NCCL
on CUDA) started by ``gnnpipe.parallel.testing.spawn_multi_process``; the engines are
the trainer's own (``gnnpipe.train.build_engine``), timed as the trainer times them: a
barrier, then one ``train_epoch``; the epoch's time is the slowest rank's.

Per layout the JSON has the median epoch time, the median split (compute, comm
blocked, pipeline bubble; mean over ranks; and ``cpu_main``, the CPU seconds of each rank's
main thread, which other jobs on the machine do not inflate), the bytes all ranks sent per epoch (the
communicator's ledger, training traffic only) beside the engine's closed form, peak
memory per rank (``ru_maxrss`` on CPU: the whole process, interpreter and torch
included; ``max_memory_allocated`` on CUDA), the ratios to the single-process epochs, and
``graph_over_pipeline``: graph ÷ pipeline bytes and epoch time per dataset and P.
On an oversubscribed machine a 2-thread process suffers most (OpenMP teams wait for
descheduled threads), which flatters every ratio to it: read ``ratio_to_single_1thread``
and ``cpu_main`` beside it.
A mode is one entry of ``LAYOUTS``: adding one (hybrid, another pipeline depth) is one
line. The machine's load average before and after is recorded: other jobs on the same
cores distort every timing here. A run that fails is recorded with its error and the others
go on; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from gnnpipe.config import (GraphParallelConfig, ModelConfig, PartitionConfig, PipelineConfig, RunConfig,
                            SyntheticConfig, TrainingConfig, from_dict, to_dict)
from gnnpipe.data.synthetic import generate
from gnnpipe.graph import write_graph
from gnnpipe.io import write_json
from gnnpipe.layout import resolve_layout
from gnnpipe.partition import partition_graph, partition_stats
from gnnpipe.store import materialize
from smoke import parse_args

# shape -> (num_nodes, avg_degree). "full": the real graphs' average degrees (Reddit 492,
# Coauthor-Physics 14.4: None keeps the shape's own) at 2*10^4 nodes, the fewest at which
# reddit-like's 41 communities hold 492 edges per node; the mirror share of a METIS cut,
# which sets graph parallelism's bytes, depends on the degree far more than on N (at 2
# parts: 0.72 N at degree 492 against 0.24 N at 8000 nodes and degree 100). A 32-layer
# GCN on it takes ~15 s an epoch on one core. "quick": a smoke run.
SIZES = {"full": {"reddit-like": (20_000, 492.0), "physics-like": (20_000, None)},
         "quick": {"reddit-like": (2000, 40.0), "physics-like": (1000, None)}}


def layout(mode: str, workers: int, chunks_per_stage: int = 4) -> dict:
    """stages, ways and store parts of a mode on ``workers`` workers (``dims.resolve_layout``)."""
    if mode not in ("single", "graph", "pipeline"):
        raise ValueError(f"unknown mode {mode!r}")
    _, s, g, c = resolve_layout(mode, workers, chunks_per_stage=chunks_per_stage)
    return {"stages": s, "ways": g, "chunks": c}


# mode -> worker counts it runs with by default (single is always the reference)
LAYOUTS = {"single": [1], "graph": [1, 2, 4], "pipeline": [2, 4]}


def _worker(rank: int, world: int, cfg_dict: dict, epochs: int, warmup: int) -> dict:
    import torch.distributed as dist

    from gnnpipe.parallel.comm import Communicator
    from gnnpipe.layout import ParallelDims
    from gnnpipe.parallel.groups import build_groups
    from gnnpipe.parallel.layout_engine import peak_memory
    from gnnpipe.tasks import task_for
    from gnnpipe.train import build_engine

    cfg = from_dict(RunConfig, cfg_dict)
    task = task_for(cfg)
    task.prepare()  # as gnnpipe.train.run sets up a rank (node models: retain_freed_memory)
    device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    groups = comm = None
    if cfg.mode != "single":
        groups = build_groups(ParallelDims(cfg.mode, world, cfg.stages, cfg.ways), rank)
        comm = Communicator(groups, device)
    t0 = time.perf_counter()
    engine = build_engine(task, cfg, groups, comm, device)
    setup_s = time.perf_counter() - t0
    rows = []
    for e in range(warmup + epochs):
        if comm is not None:
            comm.set_epoch(e)
        if world > 1:
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0, c0 = time.perf_counter(), time.thread_time()
        s = engine.train_epoch(e)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        rows.append({"wall": wall, "compute": s.compute_s, "comm": s.comm_s, "bubble": s.bubble_s,
                     "cpu_main": time.thread_time() - c0,
                     "loss": s.loss, "sent": comm.epoch_bytes(e) if comm is not None else 0})
    peak, how = peak_memory()
    return {"rows": rows, "setup_s": setup_s, "peak": peak, "peak_how": how,
            "predicted": int(engine.predicted_bytes()) if rank == 0 else None,
            "setup_bytes": comm.epoch_bytes(-1) if comm is not None else 0,
            "threads": torch.get_num_threads()}


def run_layout(cfg: RunConfig, threads: int, epochs: int, warmup: int, timeout: float) -> dict:
    from gnnpipe.parallel.testing import spawn_multi_process

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    res = spawn_multi_process(_worker, cfg.workers, to_dict(cfg), epochs, warmup, timeout=timeout,
                              threads=threads, backend=backend, env={"OMP_NUM_THREADS": str(threads)})
    timed = range(warmup, warmup + epochs)
    wall = [max(r["rows"][e]["wall"] for r in res) for e in timed]
    split = {k: statistics.median(statistics.fmean(r["rows"][e][k] for r in res) for e in timed)
             for k in ("compute", "comm", "bubble", "cpu_main")}
    sent = [sum(r["rows"][e]["sent"] for r in res) for e in timed]
    predicted = res[0]["predicted"]
    return {
        "epoch_time_s": statistics.median(wall), "epoch_times_s": wall,
        "breakdown_s": split, "comm_bytes_per_epoch": int(statistics.median(sent)),
        "comm_bytes_predicted": predicted, "bytes_match": all(s == predicted for s in sent),
        "setup_bytes": sum(r["setup_bytes"] for r in res),
        "setup_s": max(r["setup_s"] for r in res),
        "loss_last": res[0]["rows"][-1]["loss"],
        "peak_mem_bytes_per_rank": [r["peak"] for r in res], "peak_mem_method": res[0]["peak_how"],
        "threads_per_worker": res[0]["threads"],
    }


def prepare(shape: str, nodes: int, degree, work: Path, parts_needed: set[int], seed: int) -> tuple[dict, dict]:
    """Generate the graph, write graph.h5, partition and materialise the stores it needs."""
    g = generate(SyntheticConfig(shape=shape, num_nodes=nodes, avg_degree=degree, seed=seed), name=shape)
    root = work / shape
    graph_path = root / "graph.h5"
    digest = write_graph(graph_path, g)
    stores, mirrors = {}, {}
    for k in sorted(parts_needed):
        a = partition_graph(g, "metis", k, seed=seed)
        st = partition_stats(g, a)
        path = root / f"metis-{k}.h5"
        materialize(g, a, path, graph_hash=digest, method="metis")
        stores[k] = str(path)
        mirrors[k] = {"mirrors_total": st["mirrors_total"], "mirrors_over_n": st["mirrors_over_n"],
                      "edge_balance": st["edge_balance"]}
    info = {"num_nodes": g.num_nodes, "num_edges": g.num_edges, "num_features": g.num_features,
            "num_classes": g.num_classes, "avg_degree": g.num_edges / g.num_nodes, "partitions": mirrors,
            "graph_path": str(graph_path)}
    return info, stores


def graph_over_pipeline(runs: list[dict]) -> list[dict]:
    """Per dataset and worker count run in both modes: graph ÷ pipeline bytes per epoch and
    epoch time (> 1: the pipeline moves fewer bytes / is faster)."""
    ok = {(r["dataset"], r["mode"], r["workers"]): r for r in runs if "epoch_time_s" in r}
    rows = []
    for (shape, mode, p), g in ok.items():
        q = ok.get((shape, "pipeline", p))
        if mode != "graph" or q is None:
            continue
        rows.append({"dataset": shape, "workers": p,
                     "bytes": g["comm_bytes_per_epoch"] / max(q["comm_bytes_per_epoch"], 1),
                     "bytes_predicted": (g["comm_bytes_predicted"] or 0) / max(q["comm_bytes_predicted"] or 0, 1),
                     "epoch_time": g["epoch_time_s"] / q["epoch_time_s"]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--quick", action="store_true", help="smaller graphs and fewer epochs (a smoke run)")
    ap.add_argument("--datasets", nargs="+", default=["reddit-like", "physics-like"], choices=list(SIZES["full"]))
    ap.add_argument("--modes", nargs="+", default=["single", "graph", "pipeline"], choices=list(LAYOUTS))
    ap.add_argument("--workers", nargs="+", type=int, default=None,
                    help="worker counts of the parallel modes (default: each mode's LAYOUTS entry)")
    ap.add_argument("--nodes", type=int, default=None, help="override the number of nodes of every dataset")
    ap.add_argument("--degree", type=float, default=None, help="override the average degree")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=100)
    ap.add_argument("--epochs", type=int, default=None, help="timed epochs (default 3, quick 2)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--single-threads", type=int, nargs="+", default=[2, 1],
                    help="thread counts of the single-process references; ratio_to_single is to the "
                         "first, ratio_to_single_1thread to a 1-thread run when there is one")
    ap.add_argument("--no-overlap", action="store_true", help="graph parallelism without overlap")
    ap.add_argument("--no-cache-input-halo", action="store_true",
                    help="graph parallelism exchanging the input features every epoch")
    ap.add_argument("--work-dir", default="results/bench/work/modes")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--seed", type=int, default=0)
    a = parse_args(ap, argv, quick=True, datasets=["physics-like"], nodes=300, degree=8.0, layers=2, hidden=16,
                   epochs=1, workers=[2], single_threads=[1])
    size = "quick" if a.quick else "full"
    epochs = a.epochs or (2 if a.quick else 3)
    work = Path(a.work_dir)
    model = ModelConfig(kind="gcn", layers=a.layers, hidden=a.hidden, dropout=0.5)
    training = TrainingConfig(epochs=epochs + a.warmup, seed=a.seed, dtype="float32", warmup_epochs=a.warmup)
    gp = GraphParallelConfig(overlap=not a.no_overlap, cache_input_halo=not a.no_cache_input_halo)
    modes = ["single"] + [m for m in a.modes if m != "single"]
    # (mode, workers, threads per worker): single once per thread count, the others 1 thread each
    plan = [(m, p, t) for m in modes
            for p, t in ([(1, t) for t in a.single_threads] if m == "single"
                         else [(p, 1) for p in (a.workers or LAYOUTS[m])])]

    out = {"benchmark": "modes", "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "quick": a.quick,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                       "torch": torch.__version__, "cuda": torch.cuda.is_available(),
                       "loadavg_before": os.getloadavg()},
           "model": dataclasses.asdict(model), "epochs_timed": epochs, "warmup": a.warmup,
           "graph_parallel": dataclasses.asdict(gp), "single_threads": a.single_threads,
           "datasets": {}, "runs": []}
    for shape in a.datasets:
        nodes, degree = SIZES[size][shape]
        nodes, degree = a.nodes or nodes, a.degree or degree
        parts = {layout(m, p)["chunks"] for m, p, _ in plan if m != "single"}
        print(f"[modes] {shape}: generating {nodes} nodes, partitioning into {sorted(parts)}",
              file=sys.stderr, flush=True)
        info, stores = prepare(shape, nodes, degree, work, parts, a.seed)
        out["datasets"][shape] = info
        single_time: dict[int, float] = {}  # threads -> single-process epoch time
        for mode, p, threads in plan:
            lay = layout(mode, p)
            cfg = RunConfig(run_id=f"bench-{shape}-{mode}-p{p}-t{threads}", mode=mode, dataset_name=shape,
                            graph_path=info["graph_path"], store_path=stores.get(lay["chunks"]) if mode != "single" else None,
                            out_dir=str(work / "runs"), model=model, training=training,
                            partitioning=PartitionConfig(), pipeline=PipelineConfig(), graph_parallel=gp,
                            workers=p, **lay)
            t0 = time.perf_counter()
            try:
                r = run_layout(cfg, threads, epochs, a.warmup, a.timeout)
            except Exception as e:  # one failing mode must not lose the others' numbers
                r = {"error": f"{type(e).__name__}: {e}"[:4000]}
            r.update({"dataset": shape, "mode": mode, "workers": p, **lay, "wall_s": time.perf_counter() - t0})
            if mode == "single" and "epoch_time_s" in r:
                single_time[threads] = r["epoch_time_s"]
            ref = single_time.get(a.single_threads[0])
            if ref and "epoch_time_s" in r:
                r["ratio_to_single"] = r["epoch_time_s"] / ref
            if single_time.get(1) and "epoch_time_s" in r:
                r["ratio_to_single_1thread"] = r["epoch_time_s"] / single_time[1]
            out["runs"].append(r)
            msg = (f"epoch {r['epoch_time_s']:.3f}s (compute {r['breakdown_s']['compute']:.3f}, comm "
                   f"{r['breakdown_s']['comm']:.3f}, bubble {r['breakdown_s']['bubble']:.3f}), bytes {r['comm_bytes_per_epoch']:,} "
                   f"(closed form {r['comm_bytes_predicted'] or 0:,}), x{r.get('ratio_to_single', 1):.2f} of single"
                   if "epoch_time_s" in r else r["error"].splitlines()[0])
            print(f"[modes] {shape} {mode} P={p} x{threads} thread(s): {msg}", file=sys.stderr, flush=True)
    out["machine"]["loadavg_after"] = os.getloadavg()
    out["graph_over_pipeline"] = graph_over_pipeline(out["runs"])
    for row in out["graph_over_pipeline"]:
        print(f"[modes] {row['dataset']} P={row['workers']}: graph / pipeline bytes x{row['bytes']:.2f}, "
              f"epoch time x{row['epoch_time']:.2f}", file=sys.stderr, flush=True)
    write_json(a.out, out)
    return 1 if any("error" in r for r in out["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
