"""MLflow logging for train and evaluate jobs, safe when many jobs run at once.

The default tracking store is a SQLite file, ``<results>/mlflow.db`` (absolute path),
with artifacts under ``<results>/mlartifacts``; ``MLFLOW_TRACKING_URI`` overrides it.
SQLite allows one writer at a time and MLflow's first use of a new database runs its
schema migrations, so parallel Snakemake jobs that log at once fail with "database is
locked". We therefore (1) log each run in one short burst at the end of the job
(metrics are batched, not written epoch by epoch while training) and (2) hold an
exclusive ``fcntl`` lock next to the database for that burst, so writers queue
instead of colliding. Other stores (a tracking server) need no lock and get none.

Open the UI with ``mlflow ui --backend-store-uri sqlite:///$PWD/results/mlflow.db``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

from .config import RunConfig, flatten, to_dict
from .io import write_json

EXPERIMENT = os.environ.get("GNNPIPE_EXPERIMENT", "gnnpipe")


def results_root(cfg: RunConfig) -> Path:
    """``results/`` of a run: its out_dir is ``<results>/runs/<run_id>``."""
    return Path(cfg.out_dir).resolve().parent.parent


def tracking_uri(cfg: RunConfig) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{results_root(cfg) / 'mlflow.db'}"


@contextlib.contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """Exclusive lock for a SQLite (or file) store; a no-op for servers."""
    if uri.startswith("sqlite:///"):
        lock = Path(uri[len("sqlite:///"):]).with_suffix(".lock")
    elif "://" not in uri or uri.startswith("file:"):
        lock = Path(uri.removeprefix("file:")) / ".gnnpipe.lock"
    else:
        yield
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _client(cfg: RunConfig):
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(cfg)
    with _store_lock(uri):
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(EXPERIMENT)
        if exp is None:
            artifacts = None
            if uri.startswith("sqlite:///"):
                artifacts = (results_root(cfg) / "mlartifacts").as_uri()
            try:
                exp_id = client.create_experiment(EXPERIMENT, artifact_location=artifacts)
            except mlflow.exceptions.MlflowException:  # created by another job meanwhile
                exp_id = client.get_experiment_by_name(EXPERIMENT).experiment_id
        else:
            exp_id = exp.experiment_id
        yield client, exp_id


#: per-epoch metrics of atomic runs (OC20 S2EF, per split)
ATOMIC_ROW_METRICS = tuple(f"{s}_{m}" for s in ("train", "val", "test")
                           for m in ("energy_mae", "force_mae", "force_cos", "efwt"))


def log_training(cfg: RunConfig, record: dict, out_dir: Path) -> str:
    """Log one finished training run (params, per-epoch metrics, artifacts); return its id.

    Writes ``out_dir/metrics.json`` (with ``mlflow_run_id`` set) before logging it.
    """
    from mlflow.entities import Metric, Param, RunTag
    import time as _time

    with _client(cfg) as (client, exp_id):
        run = client.create_run(exp_id, run_name=cfg.run_id, tags={
            "mode": cfg.mode, "dataset": cfg.dataset_name, "model": cfg.model.kind, "gnnpipe.run_id": cfg.run_id})
        rid = run.info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in flatten(to_dict(cfg)).items()]
        now = int(_time.time() * 1000)
        metrics = []
        for row in record["history"]:
            for key in ("loss", "epoch_time_s", "compute_s", "comm_s", "bubble_s", "comm_bytes",
                        "train_acc", "val_acc", "test_acc", *ATOMIC_ROW_METRICS):
                if row.get(key) is not None:
                    metrics.append(Metric(key, float(row[key]), now, row["epoch"]))
        for key in ("epoch_time_s", "comm_bytes_per_epoch", "comm_bytes_predicted", "peak_mem_bytes",
                    "train_acc", "val_acc", "test_acc", "final_loss", "energy_mae", "force_mae", "force_cos",
                    "efwt"):
            if record.get(key) is not None:
                metrics.append(Metric(f"final/{key}", float(record[key]), now, 0))
        for k, v in record["epoch_time_breakdown_s"].items():
            metrics.append(Metric(f"final/epoch_{k}_s", float(v), now, 0))
        for i in range(0, len(params), 100):
            client.log_batch(rid, params=params[i:i + 100])
        for i in range(0, len(metrics), 1000):
            client.log_batch(rid, metrics=metrics[i:i + 1000])
        client.log_batch(rid, tags=[RunTag("world_size", str(cfg.workers))])
        record["mlflow_run_id"] = rid
        write_json(out_dir / "metrics.json", record)  # the artifact carries its own run id
        for name in ("run.resolved.yaml", "metrics.json"):
            client.log_artifact(rid, str(out_dir / name))
        client.set_terminated(rid)
    return rid


def log_evaluation(cfg: RunConfig, mlflow_run_id: str, result: dict, eval_json: Path) -> None:
    """Add the exact-inference metrics of ``evaluate`` to the training run."""
    from mlflow.entities import Metric
    import time as _time

    with _client(cfg) as (client, _):
        now = int(_time.time() * 1000)
        client.log_batch(mlflow_run_id, metrics=[
            Metric(f"eval/{k}", float(v), now, 0) for k, v in result.items()
            if isinstance(v, (int, float)) and k != "checkpoint_epoch"])
        client.log_artifact(mlflow_run_id, str(eval_json))
