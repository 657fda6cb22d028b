"""Measured epoch times of the modes on an emulated cluster network, beside the cost model's.

    sudo .venv/bin/python benchmarks/bench_netem.py --out results/bench/netem.json
    sudo .venv/bin/python benchmarks/bench_netem.py --out n.json --links netem-1g --workers 2
    .venv/bin/python benchmarks/bench_netem.py --out n.json --smoke   # --modes single: no namespaces, no root

Root (network namespaces; not for ``--modes single``, which trains outside them). For each link
in ``--links`` (hardware profiles ``config/hardware/netem-*.yaml``; the rate to emulate is their
``measured.emulated_link``)
``gnnpipe.netem`` brings up max(``--workers``) namespaces with that rate, measures what
the links carry (``netem.check``: all_to_all Gb/s per worker, gloo ping-pong latency),
and trains graph / pipeline / hybrid runs at each P in ``--workers`` on the
``reddit-like`` and ``physics-like`` synthetic shapes (32-layer GCN): every run is the
real ``gnnpipe train`` under one torchrun agent per namespace (rendezvous and gloo over
the emulated links), its numbers read from the run's ``metrics.json``. ``single`` (one
thread) runs once per dataset, outside the namespaces (it sends nothing).

Each run is predicted by the report's ``Predictor`` with four inputs (``VARIANTS``):
``profile``, the link's profile as shipped (the target's); ``single_anchored``, its
compute rates scaled by one factor to the dataset's measured single epoch; ``calibrated``,
the compute rates fitted here by ``gnnpipe calibrate`` (what the workflow's report would
use); ``measured_link``, calibrated and with the link rate ``netem.check`` measured at that P.
``--predict-only`` predicts the runs of an earlier JSON again (after a cost-model change)
without training.

The JSON has per run: the link, mode, P, layout, measured epoch time (median of the
timed epochs, the slowest rank's), its split, bytes per epoch (ledger and closed form),
the predictions (epoch, compute, comm, bubble, bytes, relative error) per variant; per dataset,
link and P ``graph_over_pipeline`` (bytes and epoch time); and ``targets``: whether
graph ÷ pipeline ≥ 2 on reddit-like and < 1 on physics-like at the slowest link, and
whether every prediction is within 25 %. The machine's load average is recorded before
and after: other jobs on the same cores distort every timing here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_modes import prepare  # noqa: E402

from gnnpipe import netem  # noqa: E402
from gnnpipe.config import (GraphParallelConfig, ModelConfig, PartitionConfig, PipelineConfig,  # noqa: E402
                            RunConfig, TrainingConfig, dump_run_config)
from gnnpipe.costmodel.hardware import Hardware, load_hardware  # noqa: E402
from gnnpipe.io import GnnPipeError, write_json, write_text  # noqa: E402
from gnnpipe.layout import resolve_layout  # noqa: E402
from gnnpipe.planning.calibrate import calibrate_run  # noqa: E402
from gnnpipe.report.predictions import Predictor, rel_error  # noqa: E402
from gnnpipe.report.records import load_run  # noqa: E402
from smoke import parse_args  # noqa: E402

# shape -> (nodes, avg degree): as large as a few minutes per link allow on 2 cores
SIZES = {"reddit-like": (8000, 150.0), "physics-like": (4000, None)}
TOLERANCE = 0.25


#: the compute side of a profile, what ``gnnpipe calibrate`` fits on this machine
COMPUTE_FIELDS = ("dense_gflops", "sparse_gvalues", "elementwise_gvalues", "random_gvalues",
                  "layer_overhead_us", "single_worker_speedup")
#: the cost model's inputs each run is predicted with; the first is the target's
VARIANTS = ("profile", "single_anchored", "calibrated", "measured_link")


def anchored(link: Hardware, single_measured_s: float, single_predicted_s: float) -> Hardware:
    """``link`` with every compute rate scaled by one factor, so that the dataset's single-
    process epoch (measured once: the accuracy reference every study trains anyway) is
    predicted exactly; the links are untouched."""
    k = single_measured_s / single_predicted_s
    return dataclasses.replace(
        link, name=f"{link.name}+single", dense_gflops=link.dense_gflops / k,
        sparse_gvalues=link.sparse_gvalues / k, elementwise_gvalues=link.elementwise_gvalues / k,
        random_gvalues=(link.random_gvalues or link.elementwise_gvalues) / k,
        layer_overhead_us=link.layer_overhead_us * k)


def variants(link: Hardware, calibration: dict, check: Optional[dict],
             single: Optional[tuple[float, float]] = None) -> dict[str, Hardware]:
    """The profiles a run is predicted with. ``profile``: the link's profile as shipped
    (cpu-2core's compute rates, the configured rate). ``single_anchored``: the profile with
    its compute rates scaled to the dataset's measured single epoch (``single``: measured and
    ``profile``-predicted seconds; absent without a single run). ``calibrated``: the compute
    rates ``gnnpipe calibrate`` fits to the dataset and model here (what the workflow's report
    uses). ``measured_link``: ``calibrated`` with the link ``netem.check`` measured at this P
    (all_to_all Gb/s per worker; ``check`` None: a single run, no link)."""
    fitted = {**calibration["rates"], "single_worker_speedup": calibration["single_worker_speedup"]}
    cal = dataclasses.replace(link, **{k: fitted[k] for k in COMPUTE_FIELDS}, name=f"{link.name}+calibrated")
    out = {"profile": link}
    if single is not None:
        out["single_anchored"] = anchored(link, *single)
    out["calibrated"] = cal
    if check is not None:
        out["measured_link"] = dataclasses.replace(cal, name=f"{link.name}+measured",
                                                   intra_bandwidth_gbs=check["gbit_per_worker"] / 8)
    return out


def single_anchor(runs: list[dict], dataset: str, link: str) -> Optional[tuple[float, float]]:
    """(measured, profile-predicted) single epoch of ``dataset`` under ``link``'s row, or None."""
    for r in runs:
        if (r["mode"], r["dataset"], r["link"]) == ("single", dataset, link) and r.get("prediction"):
            return r["epoch_time_s"], r["predictions"]["profile"]["epoch_s"]
    return None


def layout(mode: str, p: int, layers: int) -> dict:
    _, s, g, c = resolve_layout(mode, p, stages=2 if mode == "hybrid" else None, layers=layers)
    return {"stages": s, "ways": g, "chunks": c}


def plan_runs(modes: list[str], workers: list[int]) -> list[tuple[str, int]]:
    return [(m, p) for m in modes if m != "single" for p in workers
            if not (m == "hybrid" and p < 4)]  # a hybrid needs 2 stages x 2 ways


def train(cfg: RunConfig, run_dir: Path, cluster, timeout: float, env: dict) -> dict:
    """Write run.yaml, train (torchrun in the namespaces, or one process), return the record
    fields the benchmark keeps (or an error)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text(run_dir / "run.yaml", dump_run_config(cfg))
    args = ["-m", "gnnpipe.cli", "train", "--run-config", str(run_dir / "run.yaml")]
    t0 = time.perf_counter()
    with open(run_dir / "train.log", "w") as log:
        if cluster is None:
            rc = subprocess.run([sys.executable, *args], env={**os.environ, **env}, stdout=log,
                                stderr=subprocess.STDOUT, timeout=timeout).returncode
        else:
            rc = cluster.launch(args, timeout=timeout, env=env, log=log, rdzv_id=cfg.run_id)
    wall = time.perf_counter() - t0
    if rc:
        tail = (run_dir / "train.log").read_text()[-2000:]
        return {"error": f"exit {rc}: {tail}", "wall_s": wall}
    return {"wall_s": wall}


def measured(run) -> dict:
    r = run.record
    return {"epoch_time_s": r["epoch_time_s"], "breakdown_s": r["epoch_time_breakdown_s"],
            "epoch_times_s": [h["epoch_time_s"] for h in r["history"]],
            "comm_bytes_per_epoch": r["comm_bytes_per_epoch"], "comm_bytes_predicted": r["comm_bytes_predicted"],
            "peak_mem_bytes": r["peak_mem_bytes"]}


def predict(row: dict, run, profiles: dict[str, Hardware]) -> None:
    """Set ``row["predictions"]`` (each variant's epoch, split, bytes and error) and, from the
    first variant, ``prediction``, ``epoch_error`` and ``within_tolerance``."""
    row["predictions"] = {}
    for name, hw in profiles.items():
        p = Predictor(hw)(run)
        if not p.available:
            row["predictions"][name] = {"unavailable": p.reason}
            continue
        row["predictions"][name] = {"epoch_s": p.epoch_s, "compute_s": p.compute_s, "comm_s": p.comm_s,
                                    "bubble_s": p.bubble_s, "bytes": p.bytes,
                                    "epoch_error": rel_error(p.epoch_s, row["epoch_time_s"])}
    first = row["predictions"][VARIANTS[0]]
    row["prediction"] = None if "unavailable" in first else {k: v for k, v in first.items() if k != "epoch_error"}
    err = first.get("epoch_error")
    row["epoch_error"] = err
    row["within_tolerance"] = err is not None and abs(err) <= TOLERANCE


def ratios(runs: list[dict]) -> list[dict]:
    ok = {(r["dataset"], r["link"], r["mode"], r["workers"]): r for r in runs if "epoch_time_s" in r}
    rows = []
    for (d, link, mode, p), g in ok.items():
        q = ok.get((d, link, "pipeline", p))
        if mode == "graph" and q is not None:
            rows.append({"dataset": d, "link": link, "workers": p,
                         "bytes": g["comm_bytes_per_epoch"] / max(q["comm_bytes_per_epoch"], 1),
                         "epoch_time": g["epoch_time_s"] / q["epoch_time_s"],
                         "epoch_time_predicted": (g["prediction"]["epoch_s"] / q["prediction"]["epoch_s"]
                                                  if g.get("prediction") and q.get("prediction") else None)})
    return rows


def targets(rows: list[dict], runs: list[dict], slowest: str) -> dict:
    slow = [r for r in rows if r["link"] == slowest]
    red = [r["epoch_time"] for r in slow if r["dataset"] == "reddit-like"]
    phy = [r["epoch_time"] for r in slow if r["dataset"] == "physics-like"]
    graph_wins = sorted({r["link"] for r in rows if r["dataset"] == "physics-like" and r["epoch_time"] < 1})
    errs = [r for r in runs if r.get("epoch_error") is not None]
    per_variant = {}
    for v in VARIANTS:
        e = [r["predictions"][v]["epoch_error"] for r in runs  # the parallel runs (single anchors one)
             if r["mode"] != "single" and r.get("predictions", {}).get(v, {}).get("epoch_error") is not None]
        per_variant[v] = {"within": sum(abs(x) <= TOLERANCE for x in e), "of": len(e),
                          "worst": max(e, key=abs, default=None)}
    return {"slowest_link": slowest,
            "reddit_graph_over_pipeline_ge_2": bool(red) and all(x >= 2 for x in red),
            "physics_graph_wins": bool(phy) and all(x < 1 for x in phy),
            "physics_graph_wins_on_links": graph_wins,
            "cost_model_within_25pct": bool(errs) and all(r["within_tolerance"] for r in errs),
            "worst_epoch_error": max((abs(r["epoch_error"]) for r in errs), default=None),
            "within_25pct_by_variant": per_variant}


def summarise(out: dict, links: dict[str, Hardware]) -> None:
    """The graph ÷ pipeline ratios and the targets, into ``out`` and onto stderr."""
    out["graph_over_pipeline"] = ratios(out["runs"])
    slowest = min(links, key=lambda n: links[n].measured["emulated_link"]["rate_gbit"])
    out["targets"] = targets(out["graph_over_pipeline"], out["runs"], slowest)
    for row in out["graph_over_pipeline"]:
        print(f"[netem] {row['link']} {row['dataset']} P={row['workers']}: graph / pipeline bytes "
              f"x{row['bytes']:.1f}, epoch x{row['epoch_time']:.2f} (model x{row['epoch_time_predicted'] or 0:.2f})",
              file=sys.stderr, flush=True)
    print(f"[netem] targets: {out['targets']}", file=sys.stderr, flush=True)


def repredict(path: str, work: Path) -> dict:
    """``--predict-only``: the cost model again on the runs of an earlier JSON (their run
    directories under ``work``), with the profiles as they are now; nothing is trained."""
    if not Path(path).is_file():
        raise GnnPipeError(f"--predict-only: {path}: no such benchmark JSON (run bench_netem.py without it first)")
    out = json.loads(Path(path).read_text())
    links = {name: load_hardware(name) for name in out["links"]}
    for row in out["runs"]:
        if "epoch_time_s" not in row:
            continue
        run_dir = (work / "runs" / f"{row['dataset']}-single" if row["mode"] == "single" else
                   work / "runs" / row["link"] / f"{row['dataset']}-{row['mode']}-p{row['workers']}")
        check = None if row["mode"] == "single" else out["links"][row["link"]]["check"][str(row["workers"])]
        for stale in ("prediction_profile", "prediction_profile_epoch_error"):
            row.pop(stale, None)
        anchor = None if row["mode"] == "single" else single_anchor(out["runs"], row["dataset"], row["link"])
        predict(row, load_run(run_dir),
                variants(links[row["link"]], out["datasets"][row["dataset"]]["calibration"], check, anchor))
    out["repredicted"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    summarise(out, links)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--links", nargs="+", default=["netem-1g", "netem-10g"],
                    help="hardware profiles with measured.emulated_link (slowest first is not required)")
    ap.add_argument("--workers", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--modes", nargs="+", default=["single", "graph", "pipeline", "hybrid"],
                    choices=["single", "graph", "pipeline", "hybrid"])
    ap.add_argument("--datasets", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--nodes", type=int, default=None)
    ap.add_argument("--degree", type=float, default=None)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs (the median is reported)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed epochs first (here the first two are 2-5x slower than the rest)")
    ap.add_argument("--work-dir", default="results/bench/work/netem")
    ap.add_argument("--prefix", default=netem.PREFIX)
    ap.add_argument("--timeout", type=float, default=900, help="per run, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-pin", action="store_true",
                    help="leave the workers' CPUs to the kernel (default: netem.cpu_slices, neighbouring "
                         "ranks sharing a CPU where there are more workers than CPUs)")
    ap.add_argument("--predict-only", action="store_true",
                    help="train nothing: predict the runs of --out again (their run directories under "
                         "--work-dir) with the profiles as they are now, and rewrite --out")
    a = parse_args(ap, argv, links=["netem-1g"], modes=["single"], datasets=["physics-like"], nodes=300, degree=8.0,
                   layers=2, hidden=16, epochs=1, warmup=1)
    if a.predict_only:
        write_json(a.out, repredict(a.out, Path(a.work_dir).resolve()))
        return 0
    runs_plan = plan_runs(a.modes, a.workers)
    why = netem.available() if runs_plan else None  # single trains outside the namespaces
    if why:
        raise SystemExit(f"bench_netem: {why}")
    work = Path(a.work_dir).resolve()
    links = {name: load_hardware(name) for name in a.links}
    for name, hw in links.items():
        if "emulated_link" not in hw.measured:
            raise SystemExit(f"bench_netem: profile {name} has no measured.emulated_link (rate_gbit, delay_us)")
    model = ModelConfig(kind="gcn", layers=a.layers, hidden=a.hidden, dropout=0.5)
    training = TrainingConfig(epochs=a.epochs + a.warmup, seed=a.seed, dtype="float32", warmup_epochs=a.warmup,
                              eval_every=a.epochs + a.warmup, threads_per_worker=1)
    env = {"OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}"}
    out = {"benchmark": "netem", "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                       "loadavg_before": os.getloadavg(), "pinned_cpus": not a.no_pin,
                       "netem_delay_supported": netem.netem_supported()},
           "model": dataclasses.asdict(model), "epochs_timed": a.epochs, "warmup": a.warmup,
           "tolerance": TOLERANCE, "datasets": {}, "links": {}, "runs": []}
    cfgs = []  # (dataset, mode, p, RunConfig without out_dir)
    for shape in a.datasets:
        nodes, degree = a.nodes or SIZES[shape][0], a.degree or SIZES[shape][1]
        parts = {layout(m, p, a.layers)[k] for m, p in runs_plan for k in ("ways", "chunks")} - {1}
        print(f"[netem] {shape}: {nodes} nodes, partitions {sorted(parts)}", file=sys.stderr, flush=True)
        info, stores = prepare(shape, nodes, degree, work / "data", parts, a.seed)
        out["datasets"][shape] = info
        for mode, p in ([("single", 1)] if "single" in a.modes else []) + runs_plan:
            lay = layout(mode, p, a.layers) if mode != "single" else {"stages": 1, "ways": 1, "chunks": 1}
            cfgs.append((shape, mode, p, dict(
                mode=mode, dataset_name=shape, graph_path=info["graph_path"], workers=p, model=model,
                training=training, partitioning=PartitionConfig(), pipeline=PipelineConfig(),
                graph_parallel=GraphParallelConfig(),
                store_path=stores[lay["chunks"]] if mode != "single" else None, **lay)))

    def record(shape, mode, p, lay, link, run_dir, res, check):
        row = {"dataset": shape, "link": link, "mode": mode, "workers": p, **lay, **res}
        if "error" not in res:
            run = load_run(run_dir)
            row.update(measured(run))
            predict(row, run, variants(links[link], out["datasets"][shape]["calibration"], check,
                                       single_anchor(out["runs"], shape, link)))
        out["runs"].append(row)
        write_json(a.out, out)  # after every run: a run cut short keeps what it measured
        errs = ", ".join(f"{v} {x['epoch_error']:+.0%}" for v, x in row.get("predictions", {}).items()
                         if x.get("epoch_error") is not None)
        msg = (f"epoch {row['epoch_time_s']:.2f}s (comm {row['breakdown_s']['comm']:.2f}), "
               f"{row['comm_bytes_per_epoch']:,} B; model {errs}" if "epoch_time_s" in row
               else row.get("error", "")[:300])
        print(f"[netem] {link} {shape} {mode} P={p}: {msg}", file=sys.stderr, flush=True)

    # the compute rates, fitted to each dataset and the model here (what the workflow's
    # calibrate rule does; the thread's CPU clock, outside the namespaces, before any run)
    fitted = {}
    for shape, mode, p, kw in cfgs:
        if shape not in fitted:
            cal = RunConfig(**{**kw, "mode": "single", "workers": 1, "stages": 1, "ways": 1, "chunks": 1,
                               "store_path": None}, run_id=f"netem-{shape}-calibrate",
                            out_dir=str(work / "runs" / f"{shape}-calibrate"))
            t0 = time.perf_counter()
            fitted[shape] = calibrate_run(cal, links[next(iter(links))], clock="cpu")
            out["datasets"][shape]["calibration"] = fitted[shape].measured["calibration"]
            print(f"[netem] {shape}: compute rates fitted in {time.perf_counter() - t0:.0f} s "
                  f"(dense {fitted[shape].dense_gflops:.1f} GFLOP/s, sparse {fitted[shape].sparse_gvalues:.2f} "
                  f"Gvalues/s)", file=sys.stderr, flush=True)
    for shape, mode, p, kw in cfgs:  # single: once, outside the namespaces, predicted per link
        if mode != "single":
            continue
        run_dir = work / "runs" / f"{shape}-single"
        cfg = RunConfig(run_id=f"netem-{shape}-single", out_dir=str(run_dir), **kw)
        res = train(cfg, run_dir, None, a.timeout, env)
        for link in links:
            record(shape, mode, p, {"stages": 1, "ways": 1, "chunks": 1}, link, run_dir, dict(res), None)
    for link, hw in links.items() if runs_plan else ():
        el = hw.measured["emulated_link"]
        cluster = netem.Cluster(max(a.workers), float(el["rate_gbit"]), float(el.get("delay_us", 0)), a.prefix)
        cluster.down()
        cluster.up()
        try:
            out["links"][link] = {"configured": el, "check": {}}
            for p in sorted(set(a.workers)):
                sub = netem.Cluster(p, cluster.rate_gbit, cluster.delay_us, a.prefix, pin_cpus=not a.no_pin)
                out["links"][link]["check"][str(p)] = chk = netem.check(sub, mib=32)
                print(f"[netem] {link} P={p}: all_to_all {chk['gbit_per_worker']:.2f} Gb/s per worker, "
                      f"latency {chk['latency_us']:.0f} us", file=sys.stderr, flush=True)
            for shape, mode, p, kw in cfgs:
                if mode == "single":
                    continue
                run_dir = work / "runs" / link / f"{shape}-{mode}-p{p}"
                cfg = RunConfig(run_id=f"netem-{link}-{shape}-{mode}-p{p}", out_dir=str(run_dir), **kw)
                sub = netem.Cluster(p, cluster.rate_gbit, cluster.delay_us, a.prefix, pin_cpus=not a.no_pin)
                res = train(cfg, run_dir, sub, a.timeout, env)
                lay = {k: kw[k] for k in ("stages", "ways", "chunks")}
                record(shape, mode, p, lay, link, run_dir, res, out["links"][link]["check"][str(p)])
        finally:
            cluster.down()
    out["machine"]["loadavg_after"] = os.getloadavg()
    summarise(out, links)
    write_json(a.out, out)
    return 0


if __name__ == "__main__":
    # SIGTERM (timeout, a scheduler) as an exception: the namespaces are torn down on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        sys.exit(main())
    except GnnPipeError as e:
        raise SystemExit(f"bench_netem: error: {e}")
