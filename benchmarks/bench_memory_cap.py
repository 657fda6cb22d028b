"""The paper's claim in shape: a model too large for one worker, trained across P (issue #22, part 4).

    sudo .venv/bin/python benchmarks/bench_memory_cap.py --out results/bench/memory_cap.json [--cap-mib 1300]
    .venv/bin/python benchmarks/bench_memory_cap.py --out /tmp/memory_cap.json --smoke   # no root, no cap

Each worker gets a memory of its own, as each GPU has: a cgroup (v1) per rank with
``memory.limit_in_bytes`` = the cap (``gnnpipe.launch.cap_workers``; the workers join theirs first
thing, ``GNNPIPE_MEMCAP_CGROUP``). Per model kind — a GemNet-T (edge width 512, 3 blocks,
gradient forces) and a DimeNet++ (hidden 128, 4 blocks, triplet width 64), sized so that
``gnnpipe plan-atomic`` says they need P >= 4 under the cap on batches of 2 EMT slabs of 38 atoms
(cutoff 6 Å, 30 neighbours: ~2,500 edges and ~80,000 triplets a batch) — every run goes through
``gnnpipe launch``, as the workflow's train rule starts it:

1. ``p1``: P = 1 without a cap (``--mem-mb-per-worker`` far above the need): the reference losses
   and the per-worker peak at P = 1;
2. ``p1``, capped: refused before launch with the plan's one line (exit 2);
3. ``p1-forced``: the same with ``--force``: killed by the cap (exit 137, the launcher's line);
4. ``p2``: P = 2 without a cap: the per-worker peak at P = 2 (the plan refuses P = 2 under the cap);
5. ``p4``: P = 4 under the cap: trains; its step losses against ``p1``'s (float32: |Δ| / loss below
   1e-4 is summation order, the same bound tests/test_atomic_workflow.py applies to P = 2).

Workers run with ``MALLOC_MMAP_THRESHOLD_=131072``: a device's memory keeps no freed heap, and
glibc's would (gnnpipe.launch's docstring). Per-worker peak = ``memory.max_usage_in_bytes`` of the rank's cgroup (what the cap judges: pages the
worker touched after joining) and the run record's ``peak_mem_bytes`` (the largest resident set).
Needs root and the cgroup v1 memory controller (this machine's); elsewhere it stops with one line
(``RLIMIT_AS`` is no substitute: it fails allocations with an exception at a virtual size far above
the resident one, not with the kill a memory cap gives). Takes ~15 minutes on 2 busy cores.

``--smoke`` needs no root: DimeNet++ ``small`` on 6 slabs of 2x2x2, one epoch, no cgroup (the peaks
are empty), only the steps no cap enforces: ``p1``, and ``p1``'s refusal under the cap (no
second run, so no loss comparison: seconds, not a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

MODELS = {  # models.<name>.<kind> sections: large for a worker of --cap-mib, small for the machine
    "gemnet_t": {"preset": "default", "force_head": "gradient", "num_blocks": 3, "emb_size_atom": 128,
                 "emb_size_edge": 512, "emb_size_trip": 64, "emb_size_bil_trip": 64, "num_radial": 32},
    "dimenetpp": {"preset": "default", "hidden_channels": 512, "num_blocks": 4, "int_emb_size": 64,
                  "out_emb_channels": 256},
}
SMOKE_MODELS = {"gemnet_t": {"preset": "small", "force_head": "gradient"}, "dimenetpp": {"preset": "small"}}
BATCH = {"gemnet_t": 2, "dimenetpp": 4}  # systems per step: DimeNet++'s triplet blocks keep far less per system
# 12 structures: the starts of 12 generated relaxations (one frame each: not relaxed), 8 for training
DATASET = {"kind": "atoms", "atoms": {"num_trajectories": 12, "frames_per_trajectory": 1, "slab_size": [3, 3, 4],
                                      "cutoff": 6.0, "max_neighbors": 30, "train_fraction": 0.67, "val_fraction": 0.17,
                                      "seed": 1}}
SMOKE_DATASET = {"kind": "atoms", "atoms": {**DATASET["atoms"], "num_trajectories": 6, "slab_size": [2, 2, 2],
                                            "cutoff": 4.0, "max_neighbors": 12}}
LOSS_RTOL = 1e-4
MMAP_THRESHOLD = 128 << 10  # glibc returns freed tensors from 128 KiB: the resident set is what a worker holds


def workflow(root: Path, kind: str, epochs: int, smoke: bool) -> dict:
    spec = {**(SMOKE_MODELS if smoke else MODELS)[kind], "batch_size": BATCH[kind], "lr": 1e-4}
    runs = [{"mode": "single", "dataset": "slabs", "model": "m", "name": f"{kind}-p1"},
            {"mode": "single", "dataset": "slabs", "model": "m", "name": f"{kind}-p1-forced"},
            {"mode": "graph", "dataset": "slabs", "model": "m", "workers": 2, "name": f"{kind}-p2"},
            {"mode": "graph", "dataset": "slabs", "model": "m", "workers": 4, "name": f"{kind}-p4"}]
    return {"results": str(root / "results"), "datasets": {"slabs": SMOKE_DATASET if smoke else DATASET},
            "models": {"m": {"kind": kind, kind: spec}},
            "training": {"epochs": epochs, "eval_every": 1000, "checkpoint_every": 0, "weight_decay": 0.0},
            "runs": runs}


def build_data(cfg, dataset: dict) -> None:
    from gnnpipe.atomic import data
    from gnnpipe.config import AtomsConfig, from_dict

    if Path(cfg.graph_path).exists():
        return
    atoms = from_dict(AtomsConfig, dataset["atoms"])
    systems = data.systems_from_config(atoms, progress=False)
    digest = data.write_systems(cfg.systems_path, systems)
    graphs = data.build_graphs(systems, atoms.cutoff, atoms.max_neighbors, progress=False)
    data.write_graphs(cfg.graph_path, graphs, atoms.cutoff, atoms.max_neighbors, digest)


def launch(cfg, root: Path, mem_mib: int, capped: bool, cap_bytes: int, force: bool = False,
           cgroups: bool = True) -> dict:
    """``gnnpipe launch`` of one run with every rank in a cgroup of its own (limited or not; none
    without ``cgroups``: the ``--smoke`` run, no root)."""
    from gnnpipe.launch import MEMCAP_ENV, MMAP_ENV, cap_workers, uncap_workers

    top = cap_workers(cap_bytes if capped else None, cfg.workers) if cgroups else None
    run_yaml = Path(cfg.out_dir) / "run.yaml"
    cmd = [sys.executable, "-m", "gnnpipe.cli", "launch", "--run-config", str(run_yaml),
           "--mem-mb-per-worker", str(mem_mib), *(["--force"] if force else [])]
    env = {**os.environ, **({MEMCAP_ENV: str(top)} if top else {}), "OMP_NUM_THREADS": "1",
           MMAP_ENV: str(MMAP_THRESHOLD), "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"}
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        peaks = [int((d / "memory.max_usage_in_bytes").read_text()) for d in sorted(top.glob("rank-*"))] if top else []
    finally:
        if top:
            uncap_workers(top)
    lines = [line for line in done.stderr.splitlines() if line.startswith("gnnpipe:")]
    out = {"run_id": cfg.run_id, "workers": cfg.workers, "capped": capped, "forced": force, "mem_mib": mem_mib,
           "command": " ".join(cmd[1:]), "exit": done.returncode, "lines": lines, "wall_s": time.monotonic() - t0,
           "cgroup_peak_bytes": peaks}
    metrics = Path(cfg.out_dir) / "metrics.json"
    if done.returncode == 0 and metrics.exists():
        rec = json.loads(metrics.read_text())
        out.update(peak_rss_bytes=rec["peak_mem_bytes"], epoch_time_s=rec["epoch_time_s"],
                   step_losses=[x for h in rec["history"] for x in h["step_losses"]])
    elif done.returncode not in (2, 137):
        out["stderr_tail"] = done.stderr[-3000:]
    return out


def summarise(out: dict) -> dict:
    """One model's figures: exits, per-worker peaks (GiB, the largest rank's cgroup peak), the loss check."""
    runs, gib = out["runs"], 2**30
    trained = [r for n, r in runs.items() if n in ("p1", "p2", "p4")]
    last = "p4" if "p4" in runs else "p2"  # the run checked against p1 (p2: --smoke)
    return {"exit": {name: r["exit"] for name, r in runs.items()},
            "peak_gib": {f"P={r['workers']}": max(r["cgroup_peak_bytes"], default=0) / gib for r in trained},
            "peak_rss_gib": {f"P={r['workers']}": r.get("peak_rss_bytes", 0) / gib for r in trained},
            "refusal": next(iter(runs["p1-capped"]["lines"]), None),
            "oom": next(iter(runs.get("p1-forced", {}).get("lines", [])), None),
            f"{last}_vs_p1_max_rel_diff": (out.get(f"{last}_vs_p1") or {}).get("max_rel_diff")}


def bench_kind(kind: str, root: Path, cap_mib: int, epochs: int, smoke: bool = False) -> dict:
    from gnnpipe.atomic.atomic_engine import plan_run
    from gnnpipe.config import dump_run_config, load_workflow_config, resolve_runs

    runs = resolve_runs(load_workflow_config(workflow(root, kind, epochs, smoke)))
    for cfg in runs.values():
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out_dir) / "run.yaml").write_text(dump_run_config(cfg))
    build_data(next(iter(runs.values())), SMOKE_DATASET if smoke else DATASET)
    p1, forced, p2, p4 = runs.values()
    cap = cap_mib * 2**20
    plan = plan_run(p1, cap)
    out = {"kind": kind, "model": (SMOKE_MODELS if smoke else MODELS)[kind],
           "parameters": plan.kind.count_parameters(plan.model_cfg),
           "largest_batch": dict(zip(("atoms", "edges", "triplets"), plan.batch)), "cap_mib": cap_mib,
           "plan_gib_without_process": {p: plan.need(p) / 2**30 for p in (1, 2, 4)}, "runs": {}}
    print(f"{kind}: {out['parameters']:,} parameters; plan (model only) "
          f"{', '.join(f'P={p}: {v:.2f}' for p, v in out['plan_gib_without_process'].items())} GiB", file=sys.stderr)
    free = 10**6  # MiB: no cap, the same launcher path (and allocator settings)
    steps = [("p1", p1, free, False, False), ("p1-capped", p1, cap_mib, True, False),
             ("p1-forced", forced, cap_mib, True, True), ("p2", p2, free, False, False),
             ("p4", p4, cap_mib, True, False)]
    if smoke:  # what no cap enforces, in seconds: P = 1 through the launcher, and the plan's refusal
        steps = [s for s in steps if s[0] in ("p1", "p1-capped")]
    for name, cfg, mem, capped, force in steps:
        res = out["runs"][name] = launch(cfg, root, mem, capped, cap, force, cgroups=not smoke)
        peak = max(res["cgroup_peak_bytes"], default=0) / 2**30
        print(f"  {name}: exit {res['exit']} in {res['wall_s']:.0f} s, per-worker peak {peak:.2f} GiB"
              + "".join(f"\n    {line}" for line in res["lines"]), file=sys.stderr)
    last = "p2" if smoke else "p4"
    ref, got = out["runs"]["p1"].get("step_losses"), out["runs"].get(last, {}).get("step_losses")
    if ref and got:
        rel = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
        out[f"{last}_vs_p1"] = {"steps": len(ref), "max_rel_diff": rel, "rtol": LOSS_RTOL, "equal": rel < LOSS_RTOL}
        print(f"  {last} vs P=1 uncapped, {len(ref)} steps: max |Δloss|/loss = {rel:.1e} "
              f"({'within' if rel < LOSS_RTOL else 'ABOVE'} {LOSS_RTOL:g})", file=sys.stderr)
    out["summary"] = summarise(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench/memory_cap.json")
    ap.add_argument("--work", default="results/bench/memory_cap", help="runs and data go here")
    ap.add_argument("--cap-mib", type=int, default=1300, help="memory cap per worker, MiB")
    ap.add_argument("--epochs", type=int, default=2, help="2 steps an epoch (4 training systems, batches of 2)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src"), str(Path(__file__).resolve().parent)]
    from gnnpipe.io import write_json
    from gnnpipe.launch import own_cgroup
    from smoke import parse_args

    a = parse_args(ap, argv, cap_mib=100, epochs=1, models=["dimenetpp"])  # 100 MiB: below a worker's imports
    if not a.smoke and (os.geteuid() != 0 or own_cgroup() is None):
        print("bench_memory_cap: needs root and the cgroup v1 memory controller (/sys/fs/cgroup/memory) to give "
              "each worker a memory cap", file=sys.stderr)
        return 2
    root = Path(a.work).resolve()
    out = {"cap_mib": a.cap_mib, "epochs": a.epochs, "dataset": SMOKE_DATASET if a.smoke else DATASET, "models": {}}
    for kind in a.models:
        out["models"][kind] = bench_kind(kind, root / kind, a.cap_mib, a.epochs, a.smoke)
    write_json(a.out, out)
    print(yaml.safe_dump({k: {n: {"exit": r["exit"], "peak_gib": round(max(r["cgroup_peak_bytes"], default=0) / 2**30, 2)}
                              for n, r in m["runs"].items()} for k, m in out["models"].items()}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
