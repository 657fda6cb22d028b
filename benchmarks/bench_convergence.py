"""Convergence of the pipeline against exact training, mean +- std over seeds.

    .venv/bin/python benchmarks/bench_convergence.py --out results/bench/convergence.json
    .venv/bin/python benchmarks/bench_convergence.py --no-run --out c.json   # summarise only
    .venv/bin/python benchmarks/bench_convergence.py --smoke --out /tmp/c.json   # bench_compare's smoke workflow

Runs the workflow on ``config/experiments/convergence.yaml`` (every run a real
Snakemake job: data, METIS, chunk store, torchrun training, exact evaluation, MLflow),
then groups the runs' exact-inference test accuracies (``eval.json``) by dataset, model
and mode, and reports each group's mean and standard deviation and, per dataset x
model, pipeline minus single in accuracy points (target: within 1 point).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from collections import defaultdict
from pathlib import Path

from gnnpipe.config import load_workflow_config, resolve_runs
from gnnpipe.io import write_json
from smoke import parse_args, snakemake, venv_env, workflow

ROOT = Path(__file__).resolve().parent.parent


def summarise(config: Path) -> dict:
    runs = resolve_runs(load_workflow_config(config))
    groups: dict[tuple, list[float]] = defaultdict(list)
    for cfg in runs.values():
        ev = Path(cfg.out_dir) / "eval.json"
        if ev.exists():
            groups[(cfg.dataset_name, cfg.model.kind + str(cfg.model.layers), cfg.mode)].append(
                json.loads(ev.read_text())["test_acc"])
    out = {}
    for (d, m, mode), accs in sorted(groups.items()):
        entry = out.setdefault(f"{d}/{m}", {})
        entry[mode] = {"test_acc_mean": statistics.mean(accs),
                       "test_acc_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                       "seeds": len(accs), "test_acc": accs}
    for entry in out.values():
        if "single" in entry and "pipeline" in entry:
            diff = 100 * (entry["pipeline"]["test_acc_mean"] - entry["single"]["test_acc_mean"])
            entry["pipeline_minus_single_points"] = diff
            entry["within_1_point"] = diff >= -1.0
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "config/experiments/convergence.yaml")
    ap.add_argument("--out", default="results/bench/convergence.json")
    ap.add_argument("--cores", default="all")
    ap.add_argument("--no-run", action="store_true", help="only summarise existing results")
    a = parse_args(ap, argv)
    directory = ROOT
    if a.smoke:
        a.config, directory = workflow(a.out)
    if not a.no_run:
        subprocess.run(snakemake(directory, a.config, a.cores), cwd=ROOT, check=True, env=venv_env())
    res = {"benchmark": "convergence", "config": str(a.config), "groups": summarise(a.config)}
    write_json(a.out, res)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
