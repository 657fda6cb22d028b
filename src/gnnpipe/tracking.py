"""MLflow logging for train and evaluate jobs, safe when many jobs run at once.

The default tracking store is a SQLite file, ``<results>/mlflow.db`` (absolute path),
with artifacts under ``<results>/mlartifacts``; ``MLFLOW_TRACKING_URI`` overrides it.
SQLite allows one writer at a time and MLflow's first use of a new database runs its
schema migrations, so parallel Snakemake jobs that log at once fail with "database is
locked". We therefore (1) log in short bursts: the run's start, its per-epoch metrics at
most every ``GNNPIPE_MLFLOW_EVERY_S`` seconds while it trains (``EpochLog``, rank 0; a burst
that finds the store busy does not wait, its rows go with the next), the rest at the end of
the job, and (2) hold an exclusive ``fcntl`` lock next to the database for each burst, so
writers queue instead of colliding. Other stores (a tracking server) need no lock and get none.

A tracking outage never throws a run away: waits are bounded (a server gets
``HTTP_DEFAULTS`` unless the environment sets MLflow's own variables; the SQLite lock is
given up after ``GNNPIPE_MLFLOW_LOCK_TIMEOUT`` seconds), and any failure is a warning on
stderr and an ``mlflow_error`` in ``metrics.json`` (with ``mlflow_run_id: null``), never
an error exit that would make Snakemake delete the finished outputs. A run whose logging
fails half-way is ended ``FAILED`` with the error as its ``gnnpipe.error`` tag.

A training job's run is opened at its start (``start_training``, one burst): a job that
fails is ended ``FAILED`` by whichever rank survives (``mark_failed``, with the epochs' metrics
not yet logged), and a resumed job continues the same run id (kept in its checkpoint) instead
of creating another. An epoch is logged once per run: a burst skips the steps the run has
(a resumed attempt retrains the epochs after its checkpoint, to the same numbers).

Open the UI with ``mlflow ui --backend-store-uri sqlite:///$PWD/results/mlflow.db``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from pathlib import Path
from typing import Iterator

from .config import RunConfig, flatten, to_dict
from .io import write_json

EXPERIMENT = os.environ.get("GNNPIPE_EXPERIMENT", "gnnpipe")
# MLflow's own defaults retry an unreachable server for ~4 minutes (7 retries, backoff 2,
# 120 s per request): far too long to hold a finished job. These apply unless set.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
LOCK_TIMEOUT_S = 600.0  # GNNPIPE_MLFLOW_LOCK_TIMEOUT: the longest wait for the SQLite store's lock
EVERY_S = 10.0  # GNNPIPE_MLFLOW_EVERY_S: the shortest time between two bursts of per-epoch metrics


def results_root(cfg: RunConfig) -> Path:
    """``results/`` of a run: its out_dir is ``<results>/runs/<run_id>``."""
    return Path(cfg.out_dir).resolve().parent.parent


def tracking_uri(cfg: RunConfig) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{results_root(cfg) / 'mlflow.db'}"


@contextlib.contextmanager
def _store_lock(uri: str, wait: float | None = None) -> Iterator[None]:
    """Exclusive lock for a SQLite (or file) store; a no-op for servers. ``wait``: the longest
    wait for it (default ``GNNPIPE_MLFLOW_LOCK_TIMEOUT``)."""
    if uri.startswith("sqlite:///"):
        lock = Path(uri[len("sqlite:///"):]).with_suffix(".lock")
    elif "://" not in uri or uri.startswith("file:"):
        lock = Path(uri.removeprefix("file:")) / ".gnnpipe.lock"
    else:
        yield
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    wait = float(os.environ.get("GNNPIPE_MLFLOW_LOCK_TIMEOUT", LOCK_TIMEOUT_S)) if wait is None else wait
    with open(lock, "a") as fh:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{lock}: held by another job for over {wait:g} s") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _client(cfg: RunConfig, lock_wait: float | None = None):
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(cfg)
    if uri.startswith(("http://", "https://")):
        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
    with _store_lock(uri, lock_wait):
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


def _row_metrics(client, rid: str, rows: list[dict], names) -> list:
    """The metrics ``names`` of the ``rows`` whose epoch the run does not have yet (``loss`` says which it
    has; step: the epoch). ``names``: what the trainer's rows log, its own and its task's (``train.py``)."""
    from mlflow.entities import Metric

    have = {m.step for m in client.get_metric_history(rid, "loss")} if rows else set()
    now = int(time.time() * 1000)
    return [Metric(key, float(row[key]), now, row["epoch"]) for row in rows if row["epoch"] not in have
            for key in names if row.get(key) is not None]


def _log_metrics_batched(client, rid: str, metrics: list) -> None:
    for i in range(0, len(metrics), 1000):
        client.log_batch(rid, metrics=metrics[i:i + 1000])


class EpochLog:
    """Rank 0: the epochs' metrics into the open MLflow run while it trains, in bursts at most
    every ``GNNPIPE_MLFLOW_EVERY_S`` seconds (and with ``mark_failed``: a failed run shows its
    loss curve). A busy store is not waited for (the rows go with the next burst); a failure is
    one warning and the end of the bursts (the end of the job logs every epoch), never an error."""

    def __init__(self, cfg: RunConfig, run_id: str, metrics, every_s: float | None = None):
        self.cfg, self.run_id, self.metrics, self.pending, self.on = cfg, run_id, tuple(metrics), [], True
        self.every_s = float(os.environ.get("GNNPIPE_MLFLOW_EVERY_S", EVERY_S)) if every_s is None else every_s
        self.last = time.monotonic()

    def add(self, row: dict) -> None:
        self.pending.append(row)
        if self.on and time.monotonic() - self.last >= self.every_s:
            self.flush()

    def flush(self) -> None:
        self.last = time.monotonic()
        try:
            with _client(self.cfg, lock_wait=0.0) as (client, _):
                _log_metrics_batched(client, self.run_id, _row_metrics(client, self.run_id, self.pending,
                                                                                 self.metrics))
            self.pending = []
        except TimeoutError:  # another job's burst holds the store: next time
            pass
        except Exception as e:
            self.on = False
            print(f"gnnpipe: warning: MLflow per-epoch logging stopped (the end of the run logs every epoch): "
                  f"{_one_line(e)[:300]}", file=sys.stderr)


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:2000]


def _warn(what: str, e: BaseException, where: Path) -> None:
    print(f"gnnpipe: warning: MLflow {what} failed, the run's outputs are kept ({where} says "
          f"mlflow_error): {_one_line(e)}", file=sys.stderr)


def _tags(cfg: RunConfig) -> dict:
    return {"mode": cfg.mode, "dataset": cfg.dataset_name, "model": cfg.model.kind, "gnnpipe.run_id": cfg.run_id}


#: what a resumed run records when its previous attempt never ended it (and left no reason)
UNCLOSED = ("the previous attempt ended without closing this run (all its workers killed, or the "
            "tracking store not writable then)")


def start_training(cfg: RunConfig, prior: str | None, *, resumed_at: int, superseded: str | None = None,
                   unrecorded: str | None = None) -> str | None:
    """At the start of a training attempt (rank 0, one short burst): the MLflow run it logs to.

    ``prior``: the run an earlier attempt of the same run logged to (kept in the checkpoint);
    it is set RUNNING again (its error tag kept as ``gnnpipe.previous_error``), so a resumed
    run is one MLflow run, not a duplicate. A prior run still RUNNING was never ended (its
    attempt was killed, or could not reach the store to mark it FAILED, e.g. on a full disk):
    its ``previous_error`` is ``unrecorded`` (the reason that attempt could not record) or
    ``UNCLOSED``. Else a new RUNNING run. ``superseded``: a run that ``--restart`` abandons,
    ended FAILED if it was left RUNNING. An outage is a warning and None (the final burst then
    creates the run, as without a checkpoint).
    """
    try:
        with _client(cfg) as (client, exp_id):
            if superseded:
                with contextlib.suppress(Exception):
                    if client.get_run(superseded).info.status == "RUNNING":
                        client.set_tag(superseded, "gnnpipe.error", "abandoned: training restarted (--restart)")
                        client.set_terminated(superseded, status="FAILED")
            if prior:
                try:
                    run = client.get_run(prior)
                except Exception:  # the store was replaced: a new run
                    run = None
                if run is not None and run.info.lifecycle_stage == "active":
                    client.update_run(prior, status="RUNNING")
                    error = run.data.tags.get("gnnpipe.error")
                    if error:
                        client.delete_tag(prior, "gnnpipe.error")
                    elif run.info.status == "RUNNING":
                        error = unrecorded or UNCLOSED
                    if error:
                        client.set_tag(prior, "gnnpipe.previous_error", error[:5000])
                    client.set_tag(prior, "gnnpipe.resumed_at_epoch", str(resumed_at))
                    return prior
            return client.create_run(exp_id, run_name=cfg.run_id, tags=_tags(cfg)).info.run_id
    except Exception as e:
        print(f"gnnpipe: warning: MLflow could not open the run at the start of training, it is "
              f"logged at the end instead: {_one_line(e)}", file=sys.stderr)
        return None


#: the longest wait for the store's lock on the failure path: torchrun gives a stopped worker 30 s
FAIL_LOCK_WAIT_S = 10.0


def mark_failed(cfg: RunConfig, run_id: str, error: str, rows: list[dict] = (), metrics=(),
                consequence: bool = False) -> bool:
    """End ``run_id`` FAILED with ``error`` as its ``gnnpipe.error`` tag (any rank, on the way
    out of a failed attempt), after the epochs' ``rows`` not yet logged (``EpochLog.pending``, its
    ``metrics``). ``consequence``: ``error`` is this rank's view of another's failure (the worker
    group broke): it does not replace the error a rank already ended the run with, which is the
    cause (every rank marks the run, in whatever order their exits reach the store; under the
    store's lock, so the check and the write are one step);
    never raises, waits at most ``FAIL_LOCK_WAIT_S`` for the lock.
    False: it could not (a warning is printed; the next attempt records the outcome)."""
    try:
        with _client(cfg, lock_wait=FAIL_LOCK_WAIT_S) as (client, _):
            with contextlib.suppress(Exception):  # the curve is a bonus; the outcome is not
                _log_metrics_batched(client, run_id, _row_metrics(client, run_id, list(rows), metrics))
            run = client.get_run(run_id)
            ended = run.info.status == "FAILED" and run.data.tags.get("gnnpipe.error")
            if not (ended and (consequence or run.data.tags.get("gnnpipe.error_is_consequence") != "true")):
                client.set_tag(run_id, "gnnpipe.error", error[:5000])
                client.set_tag(run_id, "gnnpipe.error_is_consequence", str(consequence).lower())
            client.set_terminated(run_id, status="FAILED")
        return True
    except Exception as e:
        print(f"gnnpipe: warning: MLflow run {run_id} could not be marked FAILED (the next attempt records "
              f"it): {_one_line(e)[:300]}", file=sys.stderr)
        return False


def log_training(cfg: RunConfig, record: dict, out_dir: Path, run_id: str | None = None, *,
                 metrics, evaluation: tuple[dict, Path] | None = None) -> str | None:
    """Log one finished training run (params, per-epoch ``metrics`` of its history, artifacts); return its id.

    ``run_id``: the run ``start_training`` opened (else one is created now). ``evaluation``: the
    train job's own evaluation of the finished model (its result and ``eval.json``), logged in the
    same burst as ``log_evaluation`` logs one (``eval/<key>``, the file as an artifact).
    Writes ``out_dir/metrics.json`` (with ``mlflow_run_id`` set) before logging it. On any
    failure: a warning, ``metrics.json`` (and ``eval.json``) with ``mlflow_run_id: null`` and
    ``mlflow_error``, and None; never an exception (the training is done and must not be thrown away).
    """
    try:
        return _log_training(cfg, record, out_dir, run_id, metrics, evaluation)
    except Exception as e:
        record["mlflow_run_id"], record["mlflow_error"] = None, _one_line(e)
        write_json(out_dir / "metrics.json", record)
        if evaluation is not None:
            write_json(evaluation[1], {**evaluation[0], "mlflow_error": _one_line(e)})
        _warn("logging of the training run", e, out_dir / "metrics.json")
        return None


@contextlib.contextmanager
def _failing_run(client, rid: str):
    """End run ``rid`` FAILED, with the error as its ``gnnpipe.error`` tag, if the body raises."""
    try:
        yield
    except BaseException as e:  # KeyboardInterrupt too: no run is left RUNNING
        with contextlib.suppress(Exception):
            client.set_tag(rid, "gnnpipe.error", _one_line(e)[:5000])
        with contextlib.suppress(Exception):
            client.set_terminated(rid, status="FAILED")
        if not isinstance(e, Exception):
            raise
        raise RuntimeError(f"MLflow run {rid} ended FAILED: {_one_line(e)}") from e


def _log_training(cfg: RunConfig, record: dict, out_dir: Path, run_id: str | None, metrics, evaluation) -> str:
    with _client(cfg) as (client, exp_id):
        rid = run_id or client.create_run(exp_id, run_name=cfg.run_id, tags=_tags(cfg)).info.run_id
        with _failing_run(client, rid):
            _log_run(client, rid, cfg, record, out_dir, metrics, evaluation)
    return rid


def _log_run(client, rid: str, cfg: RunConfig, record: dict, out_dir: Path, names, evaluation=None) -> None:
    from mlflow.entities import Metric, Param, RunTag
    import time as _time

    params = [Param(k, str(v)[:6000]) for k, v in flatten(to_dict(cfg)).items()]
    now = int(_time.time() * 1000)
    metrics = _row_metrics(client, rid, record["history"], names)  # the epochs no burst has logged
    for key in ("epoch_time_s", "comm_bytes_per_epoch", "comm_bytes_predicted", "peak_mem_bytes",
                "train_acc", "val_acc", "test_acc", "final_loss", "energy_mae", "force_mae", "force_cos", "efwt"):
        if record.get(key) is not None:
            metrics.append(Metric(f"final/{key}", float(record[key]), now, 0))
    for key in ("baseline_energy_mae", "baseline_force_mae"):  # atomic runs: what the model must beat
        if (record.get("extra") or {}).get(key) is not None:
            metrics.append(Metric(f"final/{key}", float(record["extra"][key]), now, 0))
    for k, v in record["epoch_time_breakdown_s"].items():
        metrics.append(Metric(f"final/epoch_{k}_s", float(v), now, 0))
    if evaluation is not None:
        metrics += _result_metrics(evaluation[0], "eval", now)
    for i in range(0, len(params), 100):
        client.log_batch(rid, params=params[i:i + 100])
    _log_metrics_batched(client, rid, metrics)
    client.log_batch(rid, tags=[RunTag("world_size", str(cfg.workers))])
    record["mlflow_run_id"] = rid
    write_json(out_dir / "metrics.json", record)  # the artifact carries its own run id
    for name in ("run.resolved.yaml", "metrics.json"):
        client.log_artifact(rid, str(out_dir / name))
    if evaluation is not None:
        client.log_artifact(rid, str(evaluation[1]))
    client.set_terminated(rid)


def log_evaluation(cfg: RunConfig, mlflow_run_id: str, result: dict, eval_json: Path) -> None:
    """Add the exact-inference metrics of ``evaluate`` to the training run (``eval/<key>``); a
    failure is a warning and an ``mlflow_error`` in ``eval.json``, never an exception."""
    _log_result(cfg, mlflow_run_id, result, eval_json, "eval", "the evaluation")


def log_relaxation(cfg: RunConfig, mlflow_run_id: str, result: dict, relax_json: Path) -> None:
    """Add the IS2RS metrics of ``relax`` (ADwT, FbT, AFbT, relaxed-energy MAE, mean steps) to the
    training run (``relax/<key>``), ``relax.json`` as an artifact; a failure is a warning and an
    ``mlflow_error`` in ``relax.json``, never an exception."""
    _log_result(cfg, mlflow_run_id, result, relax_json, "relax", "the relaxations")


def _log_result(cfg: RunConfig, mlflow_run_id: str, result: dict, path: Path, prefix: str, what: str) -> None:
    try:
        _log_metrics(cfg, mlflow_run_id, result, path, prefix)
    except Exception as e:
        write_json(path, {**result, "mlflow_error": _one_line(e)})
        _warn(f"logging of {what}", e, path)


def _log_metrics(cfg: RunConfig, mlflow_run_id: str, result: dict, path: Path, prefix: str) -> None:
    """One burst under the store's lock: the top-level numbers of ``result`` and the file."""
    import time as _time

    with _client(cfg) as (client, _):
        client.log_batch(mlflow_run_id, metrics=_result_metrics(result, prefix, int(_time.time() * 1000)))
        client.log_artifact(mlflow_run_id, str(path))


def _result_metrics(result: dict, prefix: str, now: int) -> list:
    """The top-level numbers of an evaluation's (or relaxation's) ``result`` as ``<prefix>/<key>`` metrics."""
    from mlflow.entities import Metric

    return [Metric(f"{prefix}/{k}", float(v), now, 0) for k, v in result.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("checkpoint_epoch", "seed")]
