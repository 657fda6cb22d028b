"""MLflow logging: many jobs logging at once into one fresh SQLite store must all land."""

import json
import multiprocessing as mp
import time
from pathlib import Path

import pytest

from gnnpipe.config import load_workflow_config, resolve_runs
from gnnpipe.tasks import TASKS
from gnnpipe.train import row_metrics

NODE = row_metrics(TASKS["node_classification"])  # what a node run logs per epoch


def _cfg(tmp_path, seed):
    wf = load_workflow_config({
        "results": str(tmp_path / "results"),
        "datasets": {"d": {}}, "models": {"m": {"kind": "gcn"}},
        "runs": [{"mode": "single", "dataset": "d", "model": "m", "seed": seed}]})
    return next(iter(resolve_runs(wf).values()))


def _record(cfg):
    history = [{"epoch": e, "loss": 1.0 / (e + 1), "epoch_time_s": 0.1, "compute_s": 0.1, "comm_s": 0.0,
                "bubble_s": 0.0, "comm_bytes": 0, "train_acc": 0.5, "val_acc": None, "test_acc": None}
               for e in range(5)]
    return {"run_id": cfg.run_id, "epoch_time_s": 0.1, "epoch_time_breakdown_s": {"compute": 0.1, "comm": 0,
            "bubble": 0}, "comm_bytes_per_epoch": 0, "comm_bytes_predicted": 0, "peak_mem_bytes": 1,
            "train_acc": 0.5, "val_acc": 0.4, "test_acc": 0.3, "final_loss": 0.2, "history": history}


def _log_one(tmp_path, seed):
    from pathlib import Path
    from gnnpipe.tracking import log_training
    cfg = _cfg(Path(tmp_path), seed)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True)
    (out / "run.resolved.yaml").write_text("x: 1\n")
    return log_training(cfg, _record(cfg), out, metrics=NODE)


@pytest.mark.slow
def test_parallel_jobs_share_one_sqlite_store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with mp.get_context("spawn").Pool(4) as pool:
        ids = pool.starmap(_log_one, [(str(tmp_path), s) for s in range(6)])
    assert len(set(ids)) == 6
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["gnnpipe"])
    assert sorted(runs["run_id"]) == sorted(ids)
    assert set(runs["metrics.final/test_acc"]) == {0.3}
    one = _cfg(tmp_path, 0)
    record = json.loads((tmp_path / "results" / "runs" / one.run_id / "metrics.json").read_text())
    assert record["mlflow_run_id"] in ids
    client = mlflow.tracking.MlflowClient()
    hist = client.get_metric_history(record["mlflow_run_id"], "loss")
    assert [m.step for m in sorted(hist, key=lambda m: m.step)] == list(range(5))
    arts = {a.path for a in client.list_artifacts(record["mlflow_run_id"])}
    assert {"metrics.json", "run.resolved.yaml"} <= arts
    assert str(tmp_path / "results") in client.get_experiment_by_name("gnnpipe").artifact_location


def _closed_port() -> int:
    import socket
    with socket.socket() as s:  # bound, then closed: nothing listens there afterwards
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _no_mlflow_http_env(monkeypatch):
    """Drop MLflow's HTTP settings for the test, and whatever gnnpipe sets in their place."""
    from gnnpipe.tracking import HTTP_DEFAULTS
    for key in HTTP_DEFAULTS:
        monkeypatch.setenv(key, "0")
        monkeypatch.delenv(key)


def test_an_unreachable_tracking_server_keeps_the_finished_run(tmp_path, monkeypatch, capsys):
    """An outage is a warning and an mlflow_error in metrics.json, after a bounded wait; the
    train command exits 0 with its outputs (MLflow's defaults would retry for ~4 minutes)."""
    import time

    from gnnpipe.cli import main
    from gnnpipe.config import dump_run_config
    from helpers import run_cfg

    _no_mlflow_http_env(monkeypatch)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_closed_port()}")
    cfg = run_cfg(tmp_path, {"kind": "gcn", "layers": 2, "hidden": 8}, epochs=2)
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(dump_run_config(cfg))
    t0 = time.monotonic()
    assert main(["train", "--run-config", str(run_yaml)]) == 0
    assert time.monotonic() - t0 < 60
    out = tmp_path / "results" / "runs" / cfg.run_id
    record = json.loads((out / "metrics.json").read_text())
    assert record["mlflow_run_id"] is None and "127.0.0.1" in record["mlflow_error"]
    assert len(record["history"]) == 2 and (out / "model.pt").is_file()
    assert "gnnpipe: warning: MLflow logging of the training run failed" in capsys.readouterr().err
    assert main(["evaluate", "--run-config", str(run_yaml)]) == 0  # no MLflow run to add to: fine


def test_evaluation_logging_failure_is_a_warning(tmp_path, monkeypatch, capsys):
    from gnnpipe.tracking import log_evaluation

    _no_mlflow_http_env(monkeypatch)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_closed_port()}")
    cfg = _cfg(tmp_path, 0)
    eval_json = tmp_path / "eval.json"
    log_evaluation(cfg, "0" * 32, {"run_id": cfg.run_id, "test_acc": 0.5}, eval_json)
    ev = json.loads(eval_json.read_text())
    assert ev["test_acc"] == 0.5 and "127.0.0.1" in ev["mlflow_error"]
    assert "MLflow logging of the evaluation failed" in capsys.readouterr().err


def test_an_error_while_logging_ends_the_mlflow_run_failed(tmp_path, monkeypatch):
    import mlflow
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def broken(self, *a, **k):
        raise OSError("artifact store full")

    monkeypatch.setattr(MlflowClient, "log_artifact", broken)
    assert _log_one(tmp_path, 0) is None
    cfg = _cfg(tmp_path, 0)
    record = json.loads((tmp_path / "results" / "runs" / cfg.run_id / "metrics.json").read_text())
    assert record["mlflow_run_id"] is None
    assert "ended FAILED" in record["mlflow_error"] and "artifact store full" in record["mlflow_error"]
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["gnnpipe"])
    assert list(runs["status"]) == ["FAILED"]
    assert "artifact store full" in runs["tags.gnnpipe.error"].iloc[0]


def test_epochs_are_logged_while_the_run_trains_and_once_each(tmp_path, monkeypatch, capsys):
    """#37 item 11: the loss curve is in MLflow while the run trains (and of a failed run); a busy
    store is not waited for; the end of the job (or a resumed attempt) logs no epoch twice."""
    import fcntl

    from mlflow.tracking import MlflowClient

    from gnnpipe import tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = _cfg(tmp_path, 0)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True)
    (out / "run.resolved.yaml").write_text("x: 1\n")
    rid = tracking.start_training(cfg, None, resumed_at=0)
    client = MlflowClient(tracking_uri=tracking.tracking_uri(cfg))
    steps = lambda: sorted(m.step for m in client.get_metric_history(rid, "loss"))  # noqa: E731
    rows = _record(cfg)["history"]

    log = tracking.EpochLog(cfg, rid, NODE, every_s=0.0)
    log.add(rows[0])
    assert steps() == [0] and not log.pending and client.get_run(rid).info.status == "RUNNING"
    with open(tmp_path / "results" / "mlflow.lock", "a") as held:  # another job's burst
        fcntl.flock(held, fcntl.LOCK_EX)
        t0 = time.monotonic()
        log.add(rows[1])
        assert time.monotonic() - t0 < 1.0 and log.pending == [rows[1]]
    log.add(rows[2])
    assert steps() == [0, 1, 2] and not log.pending

    log.every_s = 3600.0  # nothing due: epoch 3 waits, and goes with the failure
    log.add(rows[3])
    assert tracking.mark_failed(cfg, rid, "rank 0: epoch 4: boom", log.pending, log.metrics)
    assert steps() == [0, 1, 2, 3] and client.get_run(rid).info.status == "FAILED"

    assert tracking.start_training(cfg, rid, resumed_at=2) == rid  # resumed after epoch 1: 2, 3 trained again
    record = _record(cfg)
    assert tracking.log_training(cfg, record, out, rid, metrics=NODE) == rid
    assert steps() == [0, 1, 2, 3, 4] and client.get_run(rid).info.status == "FINISHED"
    # the task's epoch metrics beside the trainer's: train_acc every epoch, val_acc (None) never
    assert sorted(m.step for m in client.get_metric_history(rid, "train_acc")) == [0, 1, 2, 3, 4]
    assert not client.get_metric_history(rid, "val_acc")
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("first_cause", [True, False])
def test_the_failed_runs_error_is_the_cause_not_a_peers_broken_group(tmp_path, monkeypatch, first_cause):
    """Every rank of a failed job marks the run, in whatever order their exits reach the store: the
    error kept is the rank's that failed, never another rank's "the worker group broke"."""
    from mlflow.tracking import MlflowClient

    from gnnpipe import tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = _cfg(tmp_path, 0)
    Path(cfg.out_dir).mkdir(parents=True)
    (Path(cfg.out_dir) / "run.resolved.yaml").write_text("x: 1\n")
    rid = tracking.start_training(cfg, None, resumed_at=0)
    cause = "rank 1: epoch 2: NonFiniteError: loss is nan"
    broke = "rank 0: epoch 2: the worker group broke: rank 1 died (Connection closed by peer)"
    marks = [(cause, False), (broke, True)] if first_cause else [(broke, True), (cause, False)]
    for line, consequence in marks:
        assert tracking.mark_failed(cfg, rid, line, consequence=consequence)
    run = MlflowClient(tracking_uri=tracking.tracking_uri(cfg)).get_run(rid)
    assert run.info.status == "FAILED" and run.data.tags["gnnpipe.error"] == cause


def test_a_failing_store_stops_the_epoch_bursts_with_one_warning(tmp_path, monkeypatch, capsys):
    from gnnpipe import tracking

    _no_mlflow_http_env(monkeypatch)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_closed_port()}")
    cfg = _cfg(tmp_path, 0)
    log = tracking.EpochLog(cfg, "0" * 32, NODE, every_s=0.0)
    for row in _record(cfg)["history"]:
        log.add(row)
    err = capsys.readouterr().err
    assert err.count("gnnpipe: warning: MLflow per-epoch logging stopped") == 1, err
    assert len(log.pending) == 5 and not log.on


def test_a_run_logs_the_epoch_metrics_of_its_task():
    """The per-epoch names come from the task (each declares its evaluation's fields), after the trainer's."""
    node, s2ef, energy = (row_metrics(TASKS[k]) for k in ("node_classification", "s2ef", "energy_only"))
    assert node == ("loss", "epoch_time_s", "compute_s", "comm_s", "bubble_s", "comm_bytes",
                    "train_acc", "val_acc", "test_acc")
    assert s2ef == energy == (*node[:6], *(f"{s}_{m}" for s in ("train", "val", "test")
                                           for m in ("energy_mae", "force_mae", "force_cos", "efwt")))
