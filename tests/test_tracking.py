"""MLflow logging: many jobs logging at once into one fresh SQLite store must all land."""

import json
import multiprocessing as mp

import pytest

from gnnpipe.config import load_workflow_config, resolve_runs


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
    return log_training(cfg, _record(cfg), out)


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
