"""Peak memory per rank of every mode, measured beside the cost model's prediction (issue #36 item 3).

    .venv/bin/python benchmarks/bench_memory_modes.py --out results/bench/memory_modes.json
    .venv/bin/python benchmarks/bench_memory_modes.py --out /tmp/mm.json --nodes 40000 --modes graph pipeline
    .venv/bin/python benchmarks/bench_memory_modes.py --out /tmp/mm.json --smoke   # 400 nodes, 4 layers, the pipeline only
    .venv/bin/python benchmarks/bench_memory_modes.py --reprice benchmarks/results/memory_modes.json --out /tmp/mm.json

On the ``default`` (DC-SBM) synthetic shape at ``--nodes`` nodes, a GCNII of ``--layers`` x
``--hidden`` (the issue's deep model: 16 x 128) is set up, trained ``--epochs`` epochs and evaluated
once (one exact pass) in each layout of ``--modes``: ``single``; ``graph`` P = 2; ``pipeline``
S = 2 with ``--chunks`` chunks; ``hybrid`` 2 x 2 with ``--chunks`` chunks; ``pipeline-recompute``,
``hybrid-recompute``: the same with ``pipeline.recompute: true``. Every rank is a real
process (``spawn_multi_process``, gloo, one thread) that keeps freed memory as a training run does
(``engine.retain_freed_memory``), so its resident peak is a training rank's. Per rank the JSON has
the resident set after the imports (the process itself, what the cost model calls
``process_overhead``), the peak (``ru_maxrss``) after set-up (the warm start's exact pass
included), after training and after the evaluation, and the breakdown the engine can count: bytes
of tensors autograd saved for backward in one epoch (``saved_tensors_hooks``: every chunk's, GPipe
keeps them all until the backward) and the history buffers' bytes (several chunks per way). Per
layout: the cost model's ``peak_mem_bytes`` (``planning.predict.predict_layout`` on the graph's
own METIS statistics) and its breakdown, with the ``cpu-2core`` profile's process overhead (what
``gnnpipe plan`` prints: ``predicted``) and with the ranks' own resident set after the imports
(``predicted_own_overhead``), each over the largest rank's peak (``..._over_measured``), the
statistics it priced (``stats``: ``tests/test_costmodel.py`` prices them again), and the heap the
run kept beyond the rest of the estimate over its activations (``retained_heap_fraction``: what
the CPU profiles' field of that name prices); per rank, glibc's ``mallinfo2`` after training.
``--reprice`` runs nothing: it prices an earlier result's measured peaks with this cost model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch

from gnnpipe.config import (GraphParallelConfig, ModelConfig, PartitionConfig, PipelineConfig, RunConfig, SyntheticConfig,
                            TrainingConfig, from_dict, to_dict)
from gnnpipe.data.synthetic import generate
from gnnpipe.graph import write_graph
from gnnpipe.io import write_json
from gnnpipe.partition import partition_graph
from gnnpipe.store import materialize
from smoke import parse_args

#: layout -> (mode, workers, stages, ways, recompute); chunks: 1 per way in graph mode, --chunks in the
#: pipelined ones; ``--recompute`` turns recompute on in every pipelined layout
LAYOUTS = {"single": ("single", 1, 1, 1, False), "graph": ("graph", 2, 1, 2, False),
           "pipeline": ("pipeline", 2, 2, 1, False), "hybrid": ("hybrid", 4, 2, 2, False),
           "pipeline-recompute": ("pipeline", 2, 2, 1, True), "hybrid-recompute": ("hybrid", 4, 2, 2, True)}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _heap() -> dict:
    """glibc's ``mallinfo2`` now: the main arena's size, its bytes in use and free (kept), mmapped bytes."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(k, ctypes.c_size_t) for k in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]

    f = ctypes.CDLL("libc.so.6").mallinfo2
    f.restype = MallInfo2
    m = f()
    return {"arena": m.arena, "in_use": m.uordblks, "free": m.fordblks, "mmapped": m.hblkhd}


def _mmap_threshold(nbytes: int) -> None:
    """glibc's ``M_MMAP_THRESHOLD`` (fixed: no dynamic rise): every block above ``nbytes`` is mapped
    on its own and returned when freed, so the resident set follows the live tensors."""
    import ctypes

    if not ctypes.CDLL("libc.so.6").mallopt(-3, int(nbytes)):  # <malloc.h> M_MMAP_THRESHOLD
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) refused")


def _worker(rank: int, world: int, cfg_dict: dict, epochs: int, mmap_threshold) -> dict:
    from gnnpipe.layout import ParallelDims
    from gnnpipe.parallel.comm import Communicator
    from gnnpipe.parallel.groups import build_groups
    from gnnpipe.tasks import task_for
    from gnnpipe.train import build_engine

    cfg = from_dict(RunConfig, cfg_dict)
    task = task_for(cfg)
    if mmap_threshold is None:
        task.prepare()  # as a training rank: keeps freed memory (engine.retain_freed_memory)
    else:
        _mmap_threshold(mmap_threshold)
    device = torch.device("cpu")
    groups = comm = None
    if cfg.mode != "single":
        groups = build_groups(ParallelDims(cfg.mode, world, cfg.stages, cfg.ways), rank)
        comm = Communicator(groups, device)
    out = {"rank": rank, "imports_rss": _rss()}
    engine = build_engine(task, cfg, groups, comm, device)
    out["setup_peak"] = _maxrss()
    stage = getattr(engine, "stage", None)
    out["history_bytes"] = sum(t.numel() * t.element_size() for st in getattr(stage, "hist", {}).values()
                               for t in (st.cur, st.hist, st.snap, st.grad) if t is not None)
    saved = {"bytes": 0}

    def pack(t):
        saved["bytes"] += t.numel() * t.element_size()
        return t

    out["epoch_s"] = []
    for e in range(epochs):
        if comm is not None:
            comm.set_epoch(e)
        saved["bytes"] = 0
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            engine.train_epoch(e)
        out["epoch_s"].append(time.perf_counter() - t0)
    out["saved_bytes_per_epoch"] = saved["bytes"]  # an upper bound: a tensor saved twice counts twice
    out["train_peak"] = _maxrss()
    out["heap_after_training"] = _heap()
    engine.evaluate()
    out["eval_peak"] = _maxrss()
    out["layers"] = list(getattr(engine, "layers", []))
    return out


def predict(cfg: RunConfig, graph, overhead=None) -> dict:
    """The cost model's peak per worker of ``cfg`` on ``graph`` (its own METIS statistics), with the
    ``cpu-2core`` profile's process overhead (what ``gnnpipe plan`` prints) or ``overhead`` bytes."""
    from gnnpipe.costmodel.hardware import load_hardware
    from gnnpipe.costmodel.bytes import first_input
    from gnnpipe.planning.fit import meta_model
    from gnnpipe.planning.predict import predict_layout
    from gnnpipe.planning.shape import model_shape
    from gnnpipe.planning.stats import graph_stats

    parts = sorted({k for k in (cfg.ways, cfg.chunks) if k > 1})
    stats = graph_stats(graph, parts, seed=cfg.training.seed)
    gnn = meta_model(cfg.model, graph.num_features, graph.num_classes)
    hw = load_hardware("cpu-2core")
    if overhead is not None:
        hw = dataclasses.replace(hw, process_overhead_gib=overhead / 2**30)
    est = predict_layout(stats, gnn, model_shape(gnn), hw, cfg.mode, cfg.stages, cfg.ways, cfg.chunks,
                         balance=cfg.pipeline.balance, first_input=first_input(gnn, cfg.graph_parallel),
                         pipeline_cfg=cfg.pipeline)
    return {"peak_mem_bytes": est.peak_mem_bytes,
            "breakdown": {k: v for k, v in est.memory.items() if k != "fits"},
            "stats": stats}  # what it priced: tests/test_costmodel.py prices the same again


def _config(layout: str, a, graph_path, model, training, stores: dict, work: Path) -> RunConfig:
    mode, workers, stages, ways, recompute = LAYOUTS[layout]
    chunks = a.chunks if stages > 1 else ways
    return RunConfig(run_id=f"mem-{layout}", mode=mode, dataset_name="default", graph_path=str(graph_path),
                     store_path=stores.get(chunks), out_dir=str(work / "runs"), model=model, training=training,
                     partitioning=PartitionConfig(),
                     pipeline=PipelineConfig(recompute=recompute or (a.recompute and stages > 1)),
                     graph_parallel=GraphParallelConfig(), workers=workers, stages=stages, ways=ways, chunks=chunks)


def _price(r: dict, cfg: RunConfig, graph, overhead: int) -> None:
    """``r`` (a run with its measured ``peak_mem_bytes``) gains the cost model's predictions and their ratios."""
    pred, own = predict(cfg, graph), predict(cfg, graph, overhead)
    bd = own["breakdown"]
    r.update(predicted=pred, predicted_over_measured=pred["peak_mem_bytes"] / r["peak_mem_bytes"],
             predicted_own_overhead=own,
             predicted_own_overhead_over_measured=own["peak_mem_bytes"] / r["peak_mem_bytes"],
             # the heap this run kept beyond the rest of the estimate, over its activations: what the
             # profile's retained_heap_fraction prices
             retained_heap_fraction=(r["peak_mem_bytes"] - own["peak_mem_bytes"] + bd["heap"]) / bd["activations"])


def _print(r: dict) -> None:
    peaks = ", ".join(f"{x['eval_peak'] / 2**30:.3f}" for x in r.get("ranks", []))
    msg = (f"peak {r['peak_mem_bytes'] / 2**30:.3f} GiB per rank (max; ranks {peaks}), predicted "
           f"{r['predicted']['peak_mem_bytes'] / 2**30:.3f} (x{r['predicted_over_measured']:.2f}; with this "
           f"process's overhead x{r['predicted_own_overhead_over_measured']:.2f})"
           if "error" not in r else r["error"].splitlines()[0])
    print(f"[memory_modes] {r['layout']} {r['stages']}x{r['ways']} C={r['chunks']}: {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    from gnnpipe.parallel.testing import spawn_multi_process

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--modes", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--nodes", type=int, default=40_000)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--kind", default="gcnii")
    ap.add_argument("--chunks", type=int, default=8, help="chunks of the pipelined modes")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--recompute", action="store_true", help="the pipelined modes recompute activations")
    ap.add_argument("--mmap-threshold", type=int, default=None, metavar="BYTES",
                    help="glibc's mmap threshold in every rank, fixed (mallopt M_MMAP_THRESHOLD: every larger "
                         "block is mapped and returned when freed); default: the training run's policy "
                         "(engine.retain_freed_memory)")
    ap.add_argument("--reprice", metavar="JSON", help="no runs: price the measured peaks of this earlier result "
                    "(same --nodes, --layers, --hidden, --kind, --chunks, --seed) with this cost model, write --out")
    ap.add_argument("--work-dir", default="results/bench/work/memory_modes")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--seed", type=int, default=0)
    a = parse_args(ap, argv, nodes=400, layers=4, hidden=16, chunks=4, epochs=1, modes=["pipeline"])
    work = Path(a.work_dir)
    g = generate(SyntheticConfig(shape="default", num_nodes=a.nodes, seed=a.seed), name="default")
    graph_path = work / "graph.h5"
    digest = None if a.reprice else write_graph(graph_path, g)
    model = ModelConfig(kind=a.kind, layers=a.layers, hidden=a.hidden, dropout=0.5)
    training = TrainingConfig(epochs=a.epochs, seed=a.seed, dtype="float32")
    out = {"benchmark": "memory_modes", "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                       "loadavg_before": os.getloadavg()},
           "graph": {"num_nodes": g.num_nodes, "num_edges": g.num_edges, "num_features": g.num_features},
           "model": dataclasses.asdict(model), "epochs": a.epochs, "runs": []}
    stores: dict[int, str] = {}
    out["malloc"] = ("retain_freed_memory" if a.mmap_threshold is None else
                     {"mmap_threshold": a.mmap_threshold})
    if a.reprice:  # the measured peaks of an earlier run, priced by this cost model
        out = json.loads(Path(a.reprice).read_text())
        for r in out["runs"]:
            if "error" not in r:
                cfg = _config(r["layout"], a, graph_path, model, training, {}, work)
                _price(r, cfg, g, max(x["imports_rss"] for x in r["ranks"]))
                _print(r)
        out["repriced"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        write_json(a.out, out)
        return 0
    for layout in a.modes:
        mode, workers, stages, ways, recompute = LAYOUTS[layout]
        chunks = a.chunks if stages > 1 else ways
        if chunks > 1 and chunks not in stores:
            stores[chunks] = str(work / f"metis-{chunks}.h5")
            materialize(g, partition_graph(g, "metis", chunks, seed=a.seed), stores[chunks], graph_hash=digest,
                        method="metis")
        cfg = _config(layout, a, graph_path, model, training, stores, work)
        t0 = time.perf_counter()
        try:
            ranks = spawn_multi_process(_worker, workers, to_dict(cfg), a.epochs, a.mmap_threshold, timeout=a.timeout,
                                        threads=1, backend="gloo", env={"OMP_NUM_THREADS": "1"})
            r = {"ranks": ranks, "peak_mem_bytes": max(r["eval_peak"] for r in ranks)}
            _price(r, cfg, g, max(r["imports_rss"] for r in ranks))
        except Exception as e:  # one failing mode must not lose the others' numbers
            r = {"error": f"{type(e).__name__}: {e}"[:4000]}
        r.update(layout=layout, mode=mode, recompute=cfg.pipeline.recompute, workers=workers, stages=stages,
                 ways=ways, chunks=chunks, wall_s=time.perf_counter() - t0)
        out["runs"].append(r)
        _print(r)
    out["machine"]["loadavg_after"] = os.getloadavg()
    write_json(a.out, out)
    return 1 if any("error" in r for r in out["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
