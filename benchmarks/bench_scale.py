"""Scale benchmark: a Reddit-sized graph (``--edges`` stored edges) through the whole DAG on
one machine, stage by stage, with the memory every stage needs.

    .venv/bin/python benchmarks/bench_scale.py --edges 1e8 --out results/bench/scale.json
    .venv/bin/python benchmarks/bench_scale.py --edges 1e7 --avg-degree 100 --out /tmp/scale.json
    .venv/bin/python benchmarks/bench_scale.py --smoke --out /tmp/scale.json   # 4,000 edges, single only

Stages, each a process of its own started by this script (the DAG's own commands):

* ``data``: ``gnnpipe data`` on a synthetic dataset of ``--shape`` (default ``reddit-like``,
  Reddit's degree, features and classes) with ``num_nodes = edges / avg_degree``;
* ``partition-<k>`` / ``materialize-<k>``: ``gnnpipe partition`` (METIS) and
  ``gnnpipe materialize`` for the stores the modes need (k = 2 for graph P = 2, the
  pipeline's chunk count for pipeline S = 2);
* ``train-single``, ``train-graph``, ``train-pipeline``: ``--warmup`` + ``--epochs`` epochs
  of the trainer's own engines (``benchmarks/bench_modes.run_layout``): 2-layer GCN and
  SAGE of hidden ``--hidden`` single and graph-parallel on P = 2, an 8-layer GCNII pipelined
  over S = 2 stages.

Per stage the JSON records wall time, ``peak_rss_bytes``: the largest resident set of the
stage's whole process tree *summed over the processes alive at once* (sampled every
``--sample-s`` seconds with psutil; the ranks of a parallel run share the machine's memory),
``peak_rss_max_bytes``: the sum of every process's own ``ru_maxrss`` (an upper bound of the
sampled sum, exact for a one-process stage), and the sizes of the files it wrote. Training
stages add per model the median epoch time, bytes per epoch (ledger and closed form) and the
per-rank peaks; the whole-graph stages the cost model's price (``predicted_peak_bytes``,
``gnnpipe.costmodel.stages``, recomputed on every invocation). ``summary`` holds the headline
figures in GiB and seconds (what docs/BENCHMARKS.md reads). The JSON is rewritten after every stage; a rerun with the same parameters
skips the stages it holds (``--redo STAGE`` forces one) and a rerun with other parameters is
refused (use another ``--out``). Each stage records the memory available when it started
(the machine may be shared); a stage whose processes together exceed ``--max-gib`` is killed
and the benchmark stops there, naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smoke import parse_args  # noqa: E402

STAGES_DOC = "data, partition-<k>, materialize-<k>, train-single, train-graph, train-pipeline"


class TreeSampler:
    """Peak of the summed resident set of a process and all its descendants (psutil)."""

    def __init__(self, pid: int, every: float, limit: float = float("inf")):
        self.root, self.every, self.peak, self.peak_procs = psutil.Process(pid), every, 0, 0
        self.limit, self.killed = limit, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        if total > self.peak:
            self.peak, self.peak_procs = total, len(procs)
        if total > self.limit and not self.killed:  # the machine is shared: stop before swapping it
            self.killed = True
            for p in reversed(procs):
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_stage(cmd: list[str], log: Path, every: float, limit: float, env: dict | None = None) -> dict:
    """Run ``cmd`` to completion; wall time, sampled summed peak RSS, children's maxrss."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        sampler = TreeSampler(proc.pid, every, limit)
        rc = proc.wait()
        sampler.stop()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if sampler.killed:
        raise SystemExit(f"[scale] stage stopped: its processes held {sampler.peak / 2**30:.1f} GiB, over "
                         f"--max-gib {limit / 2**30:g}: {' '.join(cmd)}")
    if rc:
        tail = log.read_text().strip().splitlines()[-5:]
        raise SystemExit(f"[scale] stage failed (exit {rc}): {' '.join(cmd)}\n" + "\n".join(tail))
    return {"wall_s": wall, "peak_rss_bytes": sampler.peak, "processes_at_peak": sampler.peak_procs,
            # RUSAGE_CHILDREN's maxrss is the largest waited-for descendant's, not a sum
            "largest_process_maxrss_bytes": max(after.ru_maxrss, before.ru_maxrss) * 1024,
            "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "command": " ".join(cmd)}


def train_main(a) -> None:
    """One training stage, in its own process: every model of the mode, results to --result."""
    from bench_modes import layout, run_layout  # the trainer's own engines, one process per rank

    from gnnpipe.config import (GraphParallelConfig, ModelConfig, PartitionConfig, PipelineConfig,
                                RunConfig, TrainingConfig)
    from gnnpipe.io import write_json

    mode, workers = a.train, (1 if a.train == "single" else 2)
    lay = layout(mode, workers, chunks_per_stage=a.chunks_per_stage)
    models = ([("gcnii", 8)] if mode == "pipeline" else [("gcn", 2), ("sage", 2)])
    out = {}
    for kind, layers in models:
        model = ModelConfig(kind=kind, layers=layers, hidden=a.hidden, dropout=0.0)
        training = TrainingConfig(epochs=a.epochs + a.warmup, seed=0, dtype="float32", warmup_epochs=a.warmup,
                                  node_order=a.node_order)
        cfg = RunConfig(run_id=f"scale-{mode}-{kind}", mode=mode, dataset_name="scale", graph_path=a.graph,
                        store_path=a.store, out_dir=str(Path(a.result).parent / "runs"), model=model,
                        training=training, partitioning=PartitionConfig(), pipeline=PipelineConfig(),
                        graph_parallel=GraphParallelConfig(), workers=workers, **lay)
        threads = 2 if mode == "single" else 1
        t0 = time.perf_counter()
        r = run_layout(cfg, threads, a.epochs, a.warmup, a.timeout)
        r.update(layers=layers, hidden=a.hidden, workers=workers, **lay, wall_s=time.perf_counter() - t0,
                 peak_rss_sum_of_ranks_bytes=int(sum(r["peak_mem_bytes_per_rank"])))
        out[kind] = r
        print(f"[scale] {mode} {kind}: epoch {r['epoch_time_s']:.2f}s, bytes {r['comm_bytes_per_epoch']:,}, "
              f"ranks' peaks {[round(x / 2**30, 2) for x in r['peak_mem_bytes_per_rank']]} GiB",
              file=sys.stderr, flush=True)
    write_json(a.result, out)


def sizes(paths: list[Path]) -> dict:
    return {p.name: p.stat().st_size for p in paths if p.exists()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench/scale.json")
    ap.add_argument("--edges", type=float, default=1e8, help="stored (directed) CSR entries, e.g. 1e8")
    ap.add_argument("--shape", default="reddit-like", help="synthetic shape (gnnpipe.data.synthetic.SHAPES)")
    ap.add_argument("--avg-degree", type=float, help="stored entries per node (default: the shape's)")
    ap.add_argument("--features", type=int, help="feature width (default: the shape's)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2, help="timed epochs per model")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--chunks-per-stage", type=int, default=2, help="pipeline chunks per stage")
    ap.add_argument("--modes", nargs="+", default=["single", "graph", "pipeline"],
                    choices=["single", "graph", "pipeline"])
    ap.add_argument("--work-dir", type=Path, help="graph, stores and logs (default: <out>.work/)")
    ap.add_argument("--redo", nargs="*", default=[], help=f"stages to rerun ({STAGES_DOC})")
    ap.add_argument("--sample-s", type=float, default=0.2, help="RSS sampling period, seconds")
    ap.add_argument("--max-gib", type=float, default=20.0,
                    help="kill a stage whose processes hold more than this together (GiB; the machine is shared)")
    ap.add_argument("--malloc-mmap-threshold", type=int, default=131072,
                    help="MALLOC_MMAP_THRESHOLD_ of the training ranks (bytes; 0: glibc's default). glibc's "
                         "sliding threshold keeps freed CSR-building temporaries resident (gnnpipe.launch)")
    ap.add_argument("--timeout", type=float, default=3600, help="per training run, seconds")
    ap.add_argument("--node-order", choices=["locality", "given"], default="locality",
                    help="training.node_order of the single-process runs (recorded per training stage; "
                         "'given' with --redo train-single reproduces the figures from before the locality order)")
    # internal: one training stage in a process of its own
    ap.add_argument("--train", choices=["single", "graph", "pipeline"], help=argparse.SUPPRESS)
    ap.add_argument("--graph", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = parse_args(ap, argv, edges=4000.0, avg_degree=8.0, features=16, hidden=16, epochs=1, modes=["single"])
    if a.train:
        return train_main(a)

    from gnnpipe.costmodel.stages import graph_stage_memory
    from gnnpipe.data.synthetic import SHAPES
    from gnnpipe.io import write_json
    from bench_modes import layout

    shape = SHAPES[a.shape]
    degree = a.avg_degree or shape["avg_degree"]
    nodes = int(round(a.edges / degree))
    params = {"edges": a.edges, "shape": a.shape, "avg_degree": degree, "num_nodes": nodes,
              "num_features": a.features or shape["num_features"], "hidden": a.hidden, "epochs": a.epochs,
              "warmup": a.warmup, "chunks_per_stage": a.chunks_per_stage,
              "malloc_mmap_threshold": a.malloc_mmap_threshold}
    out_path = Path(a.out)
    work = a.work_dir or out_path.with_suffix(".work")
    work.mkdir(parents=True, exist_ok=True)
    res = json.loads(out_path.read_text()) if out_path.exists() else {}
    if res and res.get("params") != params:
        raise SystemExit(f"[scale] {out_path} holds a run with other parameters ({res.get('params')}); "
                         f"use another --out or delete it")
    res.update(benchmark="scale", params=params)
    res.setdefault("machine", {"cpus": os.cpu_count(), "platform": platform.platform(),
                               "python": sys.version.split()[0],
                               "memory_total_bytes": psutil.virtual_memory().total})
    stages = res.setdefault("stages", {})
    gnnpipe = [sys.executable, "-m", "gnnpipe.cli"]
    graph = work / "graph.h5"
    pipe_parts = layout("pipeline", 2, chunks_per_stage=a.chunks_per_stage)["chunks"]
    parts = sorted({2} if a.modes == ["single"] else {2, pipe_parts})

    spec = work / "spec.yaml"
    spec.write_text(json.dumps({"kind": "synthetic", "synthetic": {
        "shape": a.shape, "num_nodes": nodes, "avg_degree": degree,
        **({"num_features": a.features} if a.features else {})}}))
    plan = [("data", [*gnnpipe, "data", "--spec", str(spec), "--name", "scale", "--out", str(graph),
                      "--stats", str(work / "graph.json")], [graph])]
    for k in parts:
        asg, store = work / f"metis-{k}.npy", work / f"metis-{k}.h5"
        plan.append((f"partition-{k}", [*gnnpipe, "partition", "--graph", str(graph), "--method", "metis",
                                        "--parts", str(k), "--out", str(asg), "--stats", str(work / f"metis-{k}.json")],
                     [asg]))
        plan.append((f"materialize-{k}", [*gnnpipe, "materialize", "--graph", str(graph), "--assignment", str(asg),
                                          "--out", str(store)], [store]))
    for mode in a.modes:
        k = {"single": 2, "graph": 2, "pipeline": pipe_parts}[mode]
        result = work / f"train-{mode}.json"
        plan.append((f"train-{mode}", [sys.executable, __file__, "--train", mode, "--graph", str(graph),
                                       "--store", str(work / f"metis-{k}.h5"), "--result", str(result),
                                       "--hidden", str(a.hidden), "--epochs", str(a.epochs), "--warmup",
                                       str(a.warmup), "--chunks-per-stage", str(a.chunks_per_stage),
                                       "--timeout", str(a.timeout), "--node-order", a.node_order], [result]))
    for name, cmd, outputs in plan:
        if name in stages and name not in a.redo and all(p.exists() for p in outputs):
            print(f"[scale] {name}: done before, skipped", file=sys.stderr, flush=True)
            continue
        avail = psutil.virtual_memory().available
        print(f"[scale] {name}: starting ({avail / 2**30:.1f} GiB available)", file=sys.stderr, flush=True)
        env = ({"MALLOC_MMAP_THRESHOLD_": str(a.malloc_mmap_threshold)}
               if name.startswith("train-") and a.malloc_mmap_threshold else None)
        row = run_stage(cmd, work / f"{name}.log", a.sample_s, a.max_gib * 2**30, env)
        row["available_before_bytes"] = avail
        row["files_bytes"] = sizes(outputs)
        if name.startswith("train-"):
            row["models"] = json.loads(outputs[0].read_text())
            row["node_order"] = a.node_order
        if name == "data":
            row["graph"] = {k: v for k, v in json.loads((work / "graph.json").read_text()).items()
                            if k in ("num_nodes", "num_edges", "num_features", "num_classes")}
        if name.startswith("partition-"):
            st = json.loads((work / f"metis-{name.split('-')[1]}.json").read_text())
            row["partition"] = {k: st[k] for k in ("edge_cut_fraction", "mirrors_total", "mirrors_over_n",
                                                   "edge_balance")}
        stages[name] = row
        print(f"[scale] {name}: {row['wall_s']:.1f}s, peak {row['peak_rss_bytes'] / 2**30:.2f} GiB "
              f"({row['processes_at_peak']} processes)", file=sys.stderr, flush=True)
        res["summary"] = summary(stages)
        write_json(out_path, res)
    for name, row in stages.items():  # the cost model's price, from the code as it is now
        kind = name.split("-")[0]
        if kind in ("data", "partition", "materialize") and "graph" in stages.get("data", {}):
            g = stages["data"]["graph"]
            row["predicted_peak_bytes"] = graph_stage_memory(g["num_nodes"], g["num_edges"], g["num_features"])[kind]
    res["summary"] = summary(stages)
    write_json(out_path, res)
    print(json.dumps(res["summary"], indent=2))


def summary(stages: dict) -> dict:
    """The headline figures: GiB and seconds per stage, epoch time and bytes per mode and model."""
    gib = 2.0**30
    out = {"stages": {}, "epochs": {}}
    for name, row in stages.items():
        out["stages"][name] = {"wall_s": round(row["wall_s"], 1), "peak_gib": round(row["peak_rss_bytes"] / gib, 2)}
        if "predicted_peak_bytes" in row:
            out["stages"][name]["predicted_gib"] = round(row["predicted_peak_bytes"] / gib, 2)
        for kind, m in row.get("models", {}).items():
            out["epochs"][f"{name[len('train-'):]} {kind}"] = {
                "epoch_s": round(m["epoch_time_s"], 2), "bytes_per_epoch": m["comm_bytes_per_epoch"],
                "bytes_match_closed_form": m["bytes_match"],
                "peak_gib_sum_of_ranks": round(m["peak_rss_sum_of_ranks_bytes"] / gib, 2)}
    peaks = [r["peak_rss_bytes"] for r in stages.values()]
    out["peak_gib_max"] = round(max(peaks) / gib, 2) if peaks else None
    out["every_stage_under_24_gib"] = bool(peaks) and max(peaks) < 24 * gib
    return out


if __name__ == "__main__":
    main()
