"""The comparison workflow, timed, and its runs summarised: epoch time, bytes, accuracy, time to accuracy.

    .venv/bin/python benchmarks/bench_compare.py --out results/bench/compare.json
    .venv/bin/python benchmarks/bench_compare.py --no-run --out c.json   # summarise results/compare only
    .venv/bin/python benchmarks/bench_compare.py --smoke --out /tmp/c.json   # .test/bench.yaml in /tmp/smoke-workflow

Runs ``snakemake --cores <cores> --configfile config/experiments/compare.yaml
--replace-workflow-config`` (every run a real job: data, METIS, chunk store, torchrun training,
exact evaluation, MLflow, the report at ``results/compare/report.md``), times the whole
workflow, then reads every run's record as the report does (``gnnpipe.report``): per run its
layout, convergence techniques, median epoch time, bytes per epoch (measured and closed form),
test accuracy (exact inference, eval.json), and its time to accuracy (the single-process
reference's best validation accuracy less 1 point: epochs and summed epoch wall time, or not
reached; ``gnnpipe.report.timing``) with the runs its training job overlapped, and the cost
model's bytes and epoch time with their errors, as in the report; per layout the same pooled
over seeds; the calibrated profiles' ``single_worker_speedup``. The machine's load average before and after is recorded: other jobs
on the same cores distort every timing here. ``--no-run`` summarises an earlier run (its
``workflow_s``, cores and machine are those of the ``--out`` JSON it rewrites, else null).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import yaml

from gnnpipe.config import load_workflow_config, resolve_runs
from gnnpipe.io import write_json
from gnnpipe.report import timing
from gnnpipe.report.predictions import Predictor, rel_error
from gnnpipe.report.records import aggregate, load_runs, mean_std
from smoke import parse_args, snakemake, venv_env, workflow

ROOT = Path(__file__).resolve().parent.parent


def summarise(config: Path) -> dict:
    """Every run of ``config`` that has a record, and its layouts pooled over seeds."""
    wf = load_workflow_config(config)
    dirs = [Path(c.out_dir) for c in resolve_runs(wf).values() if (Path(c.out_dir) / "metrics.json").exists()]
    runs = load_runs(dirs)
    predict = Predictor(wf.cost_model.hardware, Path(wf.results) / "cost_model")  # as the report's
    overlap = timing.overlaps(runs)
    singles = defaultdict(list)
    for r in runs:
        if r["mode"] == "single":
            singles[r.group].append(r)
    rows, by_id = [], {}
    for r in runs:
        target, reached, ref_s = timing.to_target(r, singles[r.group])
        pred = predict(r)
        row = {"run_id": r.run_id, "dataset": r["dataset"], "model": f"{r['model']}{r['layers']}",
               "mode": r["mode"], "workers": r["world_size"], "stages": r["stages"], "ways": r["ways"],
               "chunks": r["chunks"], "seed": r.seed, "techniques": timing.techniques_short(r) or None,
               "epoch_time_s": r["epoch_time_s"], "comm_bytes_per_epoch": r["comm_bytes_per_epoch"],
               "comm_bytes_predicted": r["comm_bytes_predicted"],
               "cost_model": {"bytes": pred.bytes, "epoch_s": pred.epoch_s, "reason": pred.reason,
                              "bytes_error": rel_error(pred.bytes, r["comm_bytes_per_epoch"]),
                              "epoch_error": rel_error(pred.epoch_s, r["epoch_time_s"])},
               "test_acc": r.acc("test"),
               "best_val_acc": timing.best_val(r), "target_val_acc": target,
               "epochs_to_target": reached.epochs, "seconds_to_target": reached.seconds,
               "reference_seconds_to_target": ref_s, "job_s": timing.job_seconds(r),
               "overlapped_with": overlap[r.run_id]}
        rows.append(row)
        by_id[r.run_id] = row
    layouts = []
    for a in aggregate(runs, {}):
        mine = [by_id[r.run_id] for r in a.runs]
        done = [m for m in mine if m["epochs_to_target"] is not None]
        layouts.append({
            "dataset": a["dataset"], "model": mine[0]["model"], "mode": a["mode"], "label": a.label(),
            "techniques": mine[0]["techniques"], "seeds": [m["seed"] for m in mine],
            "epoch_time_s": mean_std(m["epoch_time_s"] for m in mine)[0],
            "comm_bytes_per_epoch": mean_std(m["comm_bytes_per_epoch"] for m in mine)[0],
            "test_acc_mean": mean_std(m["test_acc"] for m in mine)[0],
            "test_acc_std": mean_std(m["test_acc"] for m in mine)[1],
            "reached": len(done),
            "epochs_to_target_mean": mean_std(m["epochs_to_target"] for m in done)[0],
            "seconds_to_target_mean": mean_std(m["seconds_to_target"] for m in done)[0],
            "reference_seconds_to_target_mean": mean_std(m["reference_seconds_to_target"] for m in done)[0]})
    def spread(key):  # the cost model's errors over the runs it predicted
        errs = [row["cost_model"][key] for row in rows if row["cost_model"][key] is not None]
        return {"min": min(errs), "max": max(errs), "runs": len(errs)} if errs else None

    return {"runs": rows, "layouts": layouts,
            "overlapping_runs": sorted(rid for rid, o in overlap.items() if o),
            "cost_model_epoch_error": spread("epoch_error"), "cost_model_bytes_error": spread("bytes_error"),
            "calibrated": {p.parent.name + "/" + p.stem: yaml.safe_load(p.read_text()).get("single_worker_speedup")
                           for p in sorted((Path(wf.results) / "cost_model").glob("*/*.yaml"))}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "config/experiments/compare.yaml")
    ap.add_argument("--out", default="results/bench/compare.json")
    ap.add_argument("--cores", default="all")
    ap.add_argument("--no-run", action="store_true",
                    help="only summarise existing results (the workflow's time, cores and machine kept from --out)")
    a = parse_args(ap, argv)
    directory = ROOT  # Snakemake's: where .snakemake/ and a relative results: land
    if a.smoke:
        a.config, directory = workflow(a.out)
    import torch

    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
               "torch": torch.__version__, "loadavg_before": os.getloadavg()}
    elapsed = None
    if a.no_run and Path(a.out).exists():  # the run that made these results
        earlier = json.loads(Path(a.out).read_text())
        elapsed, machine = earlier.get("workflow_s"), earlier.get("machine", machine)
        a.cores = earlier.get("cores", a.cores)
    if not a.no_run:
        t0 = time.perf_counter()
        subprocess.run(snakemake(directory, a.config, a.cores), cwd=ROOT, check=True, env=venv_env())
        elapsed = time.perf_counter() - t0
        machine["loadavg_after"] = os.getloadavg()
    res = {"benchmark": a.config.stem, "config": os.path.relpath(a.config, ROOT), "cores": a.cores,
           "workflow_s": elapsed, "machine": machine, **summarise(a.config)}
    write_json(a.out, res)
    print(json.dumps({k: v for k, v in res.items() if k not in ("runs",)}, indent=2))


if __name__ == "__main__":
    main()
