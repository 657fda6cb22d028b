"""Peak memory of a worker for one training step on one large structure: the domains layout at P = 2, 4
(each rank builds its own regions and reads of graphs.h5 each system's counts alone) against one
process and the atoms layout (every worker reads the whole graphs.h5 and groups the batch's graph).

    python benchmarks/bench_domains_train.py --out results/bench/domains_train.json [--repeat 10]
                                             [--configs 1:single,2:atoms,2:domains,4:domains] [--smoke]

The dataset: one rattled fcc Cu cell of ``--repeat``³ conventional cells (4 atoms each; 10: 4,000
atoms), EMT energy and forces, the training split; its graphs.h5 at ``--cutoff`` with a neighbour cap
that does not bind (the domains layout builds every neighbour within the cutoff). The run: DimeNet++
``small`` (``--kind``), ``--dtype`` float32, batch size 1, every training habit on, one epoch = one
optimisation step with forces (the double backward). Each configuration in a fresh process, its P
workers spawned (gloo, one thread each; P = 4 time-shares the 2 cores): each worker's ``VmRSS``
before the engine (torch imported, no data), after it is built (data read, model built), and its
peak (``VmHWM``) after the step. ``--smoke``: 2³ cells (32 atoms), the figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) / 1024


def _worker(rank: int, world: int, run_yaml: str) -> dict:
    """One rank: the engine of ``run_yaml`` and its first epoch (one step); its RSS at each stage."""
    import torch

    from gnnpipe.atomic.atomic_engine import AtomicEngine
    from gnnpipe.config import load_run_config

    cfg = load_run_config(run_yaml)
    before = _status_mb("VmRSS")
    if cfg.mode == "single":
        engine = AtomicEngine(cfg, None, None, torch.device("cpu"))
    else:
        from gnnpipe.layout import ParallelDims
        from gnnpipe.parallel.comm import Communicator
        from gnnpipe.parallel.groups import build_groups

        groups = build_groups(ParallelDims("graph", world, ways=cfg.ways, data=cfg.data_parallel), rank)
        engine = AtomicEngine(cfg, groups, Communicator(groups, torch.device("cpu")), torch.device("cpu"))
    built = _status_mb("VmRSS")
    graph_arrays = sorted(k for k, v in engine.graphs.items() if hasattr(v, "nbytes"))
    t0 = time.perf_counter()
    stats = engine.train_epoch(0)
    return {"rank": rank, "rss_mb_before_engine": before, "rss_mb_engine_built": built,
            "peak_rss_mb": _status_mb("VmHWM"), "s_per_step": time.perf_counter() - t0, "loss": stats.loss,
            "graphs_h5_arrays_read": graph_arrays}


def one(args) -> dict:
    """One configuration (``--one P:layout``) in this (fresh) process: its workers spawned."""
    from gnnpipe.parallel.testing import spawn_multi_process

    workers, layout = args.one.split(":")
    run_yaml = os.path.join(args.root, f"{workers}-{layout}.yaml")
    res = spawn_multi_process(_worker, int(workers), run_yaml, timeout=args.timeout)
    peaks = [r["peak_rss_mb"] for r in res]
    return {"workers": int(workers), "layout": layout, "peak_rss_mb_per_worker": peaks, "peak_rss_mb_max": max(peaks),
            "rss_mb_before_engine": [r["rss_mb_before_engine"] for r in res],
            "rss_mb_engine_built": [r["rss_mb_engine_built"] for r in res],
            "peak_above_before_mb_max": max(r["peak_rss_mb"] - r["rss_mb_before_engine"] for r in res),
            "s_per_step": max(r["s_per_step"] for r in res), "loss": res[0]["loss"],
            "graphs_h5_arrays_read": res[0]["graphs_h5_arrays_read"]}


def prepare(args, root: str) -> dict:
    """The dataset (systems.h5, graphs.h5) and a run.yaml per layout under ``root``."""
    from pathlib import Path

    import numpy as np
    from ase.build import bulk
    from ase.calculators.emt import EMT

    from gnnpipe.atomic import data
    from gnnpipe.config import dump_run_config, load_workflow_config, resolve_runs
    from gnnpipe.io import write_text

    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((args.repeat,) * 3)
    atoms.rattle(0.05, seed=1)
    atoms.calc = EMT()
    energy, forces = atoms.get_potential_energy(), atoms.get_forces()
    n = len(atoms)
    systems = data._pack([(atoms.numbers, atoms.positions, np.zeros(n, bool), forces, atoms.cell.array, atoms.pbc,
                           energy)], np.zeros(1, np.int8), "bench_domains_train", 0.5, np.zeros(1, np.int64))
    confs = [c.split(":") for c in args.configs.split(",")]
    runs = [{"mode": "graph", "dataset": "cell", "model": "m", "workers": int(p), "atom_layout": lay}
            if int(p) > 1 else {"mode": "single", "dataset": "cell", "model": "m", "workers": 1} for p, lay in confs]
    wf = load_workflow_config({"results": str(Path(root) / "results"), "datasets": {"cell": {"kind": "atoms"}},
                               "models": {"m": {"kind": args.kind, args.kind: {"preset": "small", "batch_size": 1}}},
                               "training": {"epochs": 1, "dtype": args.dtype}, "runs": runs})
    cfgs = list(resolve_runs(wf).values())
    assert len(cfgs) == len(confs), "one run per configuration"
    Path(cfgs[0].graph_path).parent.mkdir(parents=True, exist_ok=True)
    digest = data.write_systems(cfgs[0].systems_path, systems)
    data.write_graphs(cfgs[0].graph_path, data.build_graphs(systems, args.cutoff, 64, progress=False), args.cutoff,
                      64, digest)
    for (p, lay), cfg in zip(confs, cfgs):
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
        write_text(Path(root) / f"{p}-{lay}.yaml", dump_run_config(cfg))
    return {"atoms": n, "cells": args.repeat}


def main(argv=None) -> None:
    import tempfile

    from gnnpipe.io import write_json
    from machine import machine_record
    from smoke import parse_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/bench/domains_train.json")
    ap.add_argument("--repeat", type=int, default=10, help="conventional fcc cells per axis (4 atoms each)")
    ap.add_argument("--cutoff", type=float, default=3.0)
    ap.add_argument("--kind", default="dimenetpp")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--configs", default="1:single,2:atoms,2:domains,4:domains",
                    help="P:layout of each configuration (the first: the ratios' base)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a configuration may take")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # one configuration (internal)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = parse_args(ap, argv, repeat=2, configs="1:single,2:domains")
    if args.one:
        print(json.dumps(one(args)))
        return
    load0 = os.getloadavg()
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory(prefix="bench_domains_train") as root:
        size = prepare(args, root)
        runs = []
        for conf in args.configs.split(","):
            cmd = [sys.executable, os.path.join(here, "bench_domains_train.py"), "--one", conf, "--root", root,
                   "--timeout", str(args.timeout)]
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=here)
            if done.returncode:
                raise SystemExit(f"bench_domains_train: {' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
            runs.append({**json.loads(done.stdout.strip().splitlines()[-1]), "loadavg_after": os.getloadavg()})
            r = runs[-1]
            print(f"{size['atoms']} atoms, P={r['workers']} {r['layout']}: peak RSS per worker "
                  f"{[round(m) for m in r['peak_rss_mb_per_worker']]} MB (before the engine "
                  f"{[round(m) for m in r['rss_mb_before_engine']]}), {r['s_per_step']:.1f} s a step, "
                  f"graphs.h5 read: {r['graphs_h5_arrays_read']}", file=sys.stderr, flush=True)
    base, grown = runs[0]["peak_rss_mb_max"], runs[0]["peak_above_before_mb_max"]
    out = {"kind": args.kind, "dtype": args.dtype, "cutoff": args.cutoff, **size, "runs": runs,
           "peak_ratio": {f"{r['workers']}:{r['layout']}": r["peak_rss_mb_max"] / base for r in runs},
           "peak_above_before_ratio": {f"{r['workers']}:{r['layout']}": r["peak_above_before_mb_max"] / grown
                                       for r in runs},
           "machine": machine_record(load0)}
    write_json(args.out, out)


if __name__ == "__main__":
    main()
