"""Single-process training end to end: run record, checkpoint, exact evaluation, MLflow."""

import json
import os

import numpy as np
import pytest
import torch

from gnnpipe.graph import write_graph
from helpers import run_cfg, two_community_graph

RECORD_FIELDS = {
    "run_id", "mode", "dataset", "num_nodes", "num_edges", "in_features", "model", "layers", "hidden",
    "world_size", "stages", "ways", "chunks", "epochs", "dtype_bytes", "epoch_time_s",
    "epoch_time_breakdown_s", "comm_bytes_per_epoch", "comm_bytes_predicted", "peak_mem_bytes",
    "train_acc", "val_acc", "test_acc", "final_loss", "mlflow_run_id", "history"}


@pytest.fixture(autouse=True)
def _no_global_mlflow(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def test_single_run_writes_record_checkpoint_and_mlflow(tmp_path):
    from gnnpipe.checkpoint import load_checkpoint
    from gnnpipe.evaluate import evaluate_run
    from gnnpipe.train import run

    cfg = run_cfg(tmp_path, {"kind": "gcn", "layers": 2, "hidden": 16, "dropout": 0.0})
    record = run(cfg, progress=False)
    on_disk = json.loads((tmp_path / "results" / "runs" / cfg.run_id / "metrics.json").read_text())
    assert RECORD_FIELDS <= set(on_disk)
    assert on_disk["mlflow_run_id"] == record["mlflow_run_id"] and on_disk["mlflow_run_id"]
    assert (on_disk["world_size"], on_disk["stages"], on_disk["ways"], on_disk["chunks"]) == (1, 1, 1, 1)
    assert on_disk["comm_bytes_per_epoch"] == on_disk["comm_bytes_predicted"] == 0
    assert on_disk["dtype_bytes"] == 4 and on_disk["num_nodes"] == 200
    losses = [h["loss"] for h in on_disk["history"]]
    assert len(losses) == 30 and losses[-1] < 0.7 * losses[0]
    assert on_disk["test_acc"] > 0.8  # the communities are easy to tell apart through the graph

    ckpt = load_checkpoint(tmp_path / "results" / "runs" / cfg.run_id / "model.pt")
    assert ckpt["epoch"] == 29 and ckpt["epochs_done"] == 30 and all(isinstance(v, torch.Tensor) for v in ckpt["model"].values())

    # the train job evaluated its finished model itself (#36): eval.json, its time in the record, MLflow
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["gnnpipe"])
    in_train = json.loads((tmp_path / "results" / "runs" / cfg.run_id / "eval.json").read_text())
    assert runs["metrics.eval/test_acc"].iloc[0] == in_train["test_acc"]
    assert 0 < on_disk["evaluate_s"] < 30 and on_disk["evaluate_cpu_s"] > 0
    ev = evaluate_run(cfg)  # the command on model.pt: the same file, number for number
    assert ev == in_train and ev["checkpoint_epoch"] == 29
    assert ev["test_acc"] == pytest.approx(on_disk["test_acc"])

    runs = mlflow.search_runs(experiment_names=["gnnpipe"])
    assert list(runs["run_id"]) == [record["mlflow_run_id"]]
    assert runs["metrics.eval/test_acc"].iloc[0] == pytest.approx(ev["test_acc"])
    assert runs["params.model.kind"].iloc[0] == "gcn"


def test_evaluate_imports_mlflow_while_the_inference_runs_and_logs_after(tmp_path, monkeypatch):
    """MLflow's imports (longer than a 10^5-node graph's inference) start before the checkpoint
    loads and are waited for only to log; a run without an MLflow run imports nothing."""
    import gnnpipe.evaluate as ev
    import gnnpipe.tracking as tr

    cfg = run_cfg(tmp_path, {"kind": "gcn", "layers": 2, "hidden": 16})
    out_dir = tmp_path / "results" / "runs" / cfg.run_id
    out_dir.mkdir(parents=True)
    order = []

    class Imports:
        def join(self):
            order.append("joined")

    class Task:
        def evaluate(self, *a, **k):
            order.append("inference")
            return {"test_acc": 0.5}

    monkeypatch.setattr(ev, "_import_tracking", lambda: order.append("imports") or Imports())
    monkeypatch.setattr(ev, "load_checkpoint", lambda path: order.append("load") or {"epoch": 3})
    monkeypatch.setattr(ev, "check_checkpoint", lambda *a, **k: None)
    monkeypatch.setattr(ev, "task_for", lambda cfg: Task())
    monkeypatch.setattr(tr, "log_evaluation", lambda cfg, rid, result, out: order.append(("log", rid)))
    (out_dir / "metrics.json").write_text(json.dumps({"mlflow_run_id": "abc"}))
    assert ev.evaluate_run(cfg)["test_acc"] == 0.5
    assert order == ["imports", "load", "inference", "joined", ("log", "abc")]
    assert json.loads((out_dir / "eval.json").read_text())["checkpoint_epoch"] == 3
    order.clear()
    (out_dir / "metrics.json").write_text(json.dumps({"mlflow_run_id": None}))
    ev.evaluate_run(cfg)
    assert order == ["load", "inference"]


@pytest.mark.parametrize("kind", ["sage", "gcn", "gat"])
def test_locality_order_trains_the_model_the_given_ids_train(tmp_path, monkeypatch, kind):
    """training.node_order 'locality' (the default) renumbers the nodes by METIS parts (of 50
    nodes here: four parts) and trains the same model as the dataset's ids, in float64 to
    rounding: losses, accuracies and the saved weights. A renumbering that lost a node's
    neighbours or moved labels without features would change all three."""
    from gnnpipe import partition
    from gnnpipe.checkpoint import load_checkpoint
    from gnnpipe.train import run

    monkeypatch.setattr(partition, "LOCALITY_PART_NODES", 50)
    model = {"kind": kind, "layers": 2, "hidden": 16, "dropout": 0.0}
    recs, weights = {}, {}
    for how in ("given", "locality"):
        cfg = run_cfg(tmp_path / how, model, epochs=12, dtype="float64", node_order=how)
        recs[how] = run(cfg, progress=False)
        weights[how] = load_checkpoint(tmp_path / how / "results" / "runs" / cfg.run_id / "model.pt")["model"]
    order = recs["locality"]["extra"]["node_order"]
    assert (order["node_order"], order["parts"]) == ("locality", 4)
    assert recs["given"]["extra"]["node_order"] == {"node_order": "given", "parts": 0, "seconds": 0.0}
    for a, b in zip(recs["given"]["history"], recs["locality"]["history"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-10, abs=1e-12)
    for key in ("train_acc", "val_acc", "test_acc"):
        assert recs["locality"][key] == recs["given"][key]
    assert weights["given"].keys() == weights["locality"].keys()
    for name, w in weights["given"].items():
        torch.testing.assert_close(weights["locality"][name], w, rtol=1e-9, atol=1e-11)


def test_locality_order_keeps_the_ids_of_a_small_graph_or_without_the_memory(tmp_path, monkeypatch, capsys):
    """Fewer than two parts' worth of nodes: the given ids, quietly. METIS refused for memory:
    the given ids, and one line on stderr that says so (training is not refused for it)."""
    from gnnpipe import partition
    from gnnpipe.io import GnnPipeError

    graph = two_community_graph()  # 200 nodes
    assert partition.node_order(graph, "locality")["node_order"] == "given"  # < 2 * 1,024 nodes
    locality_order = partition.locality_order
    with pytest.raises(GnnPipeError, match="GiB"):
        locality_order(graph, part_nodes=50, memory_bytes=1)
    monkeypatch.setattr(partition, "LOCALITY_PART_NODES", 50)
    monkeypatch.setattr(partition, "locality_order", lambda g, **kw: locality_order(g, memory_bytes=1, **kw))
    assert partition.node_order(graph, "locality") == {"node_order": "given", "parts": 0, "seconds": 0.0}
    assert "node_order 'locality' skipped" in capsys.readouterr().err


def test_gcn_beats_mlp_when_the_graph_carries_the_signal(tmp_path):
    from gnnpipe.train import run

    gcn = run(run_cfg(tmp_path / "a", {"kind": "gcn", "layers": 2, "hidden": 16, "dropout": 0.0}), progress=False)
    mlp = run(run_cfg(tmp_path / "b", {"kind": "mlp", "layers": 2, "hidden": 16, "dropout": 0.0}), progress=False)
    assert gcn["test_acc"] > mlp["test_acc"] + 0.1


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gcnii", "resgcn"])
def test_deep_models_train(tmp_path, kind):
    from gnnpipe.train import run

    rec = run(run_cfg(tmp_path, {"kind": kind, "layers": 32, "hidden": 16, "dropout": 0.0}, epochs=40),
              progress=False)
    losses = [h["loss"] for h in rec["history"]]
    assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0]
    assert rec["test_acc"] > 0.75


def test_parallel_mode_outside_torchrun_is_a_clear_error(tmp_path, monkeypatch):
    from gnnpipe.io import GnnPipeError
    from gnnpipe.train import run

    cfg = run_cfg(tmp_path, {"kind": "gcn"})
    cfg.mode, cfg.workers, cfg.ways, cfg.chunks = "graph", 2, 2, 2
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(GnnPipeError, match="runs under torchrun: torchrun --standalone --nproc-per-node 2"):
        run(cfg, progress=False)


class _KilledAt:
    """An engine that dies (as under SIGINT) when it reaches epoch ``at``."""

    def __init__(self, engine, at):
        self._engine, self._at = engine, at

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def train_epoch(self, epoch):
        if epoch == self._at:
            raise KeyboardInterrupt
        return self._engine.train_epoch(epoch)


def _kill_at(monkeypatch, at):
    from gnnpipe import train
    build = train.build_engine
    monkeypatch.setattr(train, "build_engine", lambda *a: _KilledAt(build(*a), at))


def test_a_killed_run_leaves_no_model_pt_and_evaluate_refuses_its_checkpoint(tmp_path, monkeypatch, capsys):
    """... and (#37 items 19 and 11) without a terminal its log has one line an epoch (loss,
    validation, seconds), and MLflow the loss curve of the run that failed before its end."""
    from mlflow.tracking import MlflowClient

    from gnnpipe.checkpoint import load_checkpoint
    from gnnpipe.evaluate import evaluate_run
    from gnnpipe.io import GnnPipeError
    from gnnpipe.tracking import tracking_uri
    from gnnpipe.train import run

    monkeypatch.delenv("GNNPIPE_PROGRESS", raising=False)
    monkeypatch.setenv("GNNPIPE_MLFLOW_EVERY_S", "0")
    cfg = run_cfg(tmp_path, {"kind": "gcn", "layers": 2, "hidden": 8, "dropout": 0.0}, epochs=15,
                  checkpoint_every=4)
    out = tmp_path / "results" / "runs" / cfg.run_id
    _kill_at(monkeypatch, 9)
    with pytest.raises(KeyboardInterrupt):
        run(cfg)
    assert not (out / "model.pt").exists() and not (out / "metrics.json").exists()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(f"train {cfg.run_id}: ")]
    assert [line.split(":")[1] for line in lines] == [f" epoch {e} of 15" for e in range(9)], lines
    assert "val_acc" in lines[4] and "val_acc" not in lines[3] and lines[4].endswith(" s"), lines
    client = MlflowClient(tracking_uri=tracking_uri(cfg))
    (found,) = client.search_runs(client.get_experiment_by_name("gnnpipe").experiment_id)
    assert found.info.status == "FAILED"
    assert sorted(m.step for m in client.get_metric_history(found.info.run_id, "loss")) == list(range(9))
    assert load_checkpoint(out / "checkpoint.pt")["epochs_done"] == 8  # the intermediate one, elsewhere
    with pytest.raises(GnnPipeError, match="no checkpoint"):
        evaluate_run(cfg)
    with pytest.raises(GnnPipeError, match=r"checkpoint after 8 of 15 epochs, not the finished run"):
        evaluate_run(cfg, checkpoint=out / "checkpoint.pt")
    assert evaluate_run(cfg, checkpoint=out / "checkpoint.pt", allow_partial=True)["checkpoint_epoch"] == 7
    assert not (out / "model.pt").exists()


def test_a_killed_retrain_keeps_the_finished_model_and_its_record(tmp_path, monkeypatch):
    from gnnpipe.evaluate import evaluate_run
    from gnnpipe.train import run

    cfg = run_cfg(tmp_path, {"kind": "gcn", "layers": 2, "hidden": 8, "dropout": 0.0}, epochs=12,
                  checkpoint_every=2)
    out = tmp_path / "results" / "runs" / cfg.run_id
    record = run(cfg, progress=False)
    model = (out / "model.pt").read_bytes()
    _kill_at(monkeypatch, 5)  # a hand retrain of the finished run, killed after 2 checkpoints
    with pytest.raises(KeyboardInterrupt):
        run(cfg, progress=False)
    assert (out / "model.pt").read_bytes() == model
    assert evaluate_run(cfg)["test_acc"] == pytest.approx(record["test_acc"])


def test_evaluate_refuses_a_checkpoint_of_another_config_or_graph(tmp_path):
    import dataclasses

    from gnnpipe.evaluate import evaluate_run
    from gnnpipe.io import GnnPipeError
    from gnnpipe.train import run

    cfg = run_cfg(tmp_path, {"kind": "gcn", "layers": 2, "hidden": 8, "dropout": 0.0}, epochs=3)
    run(cfg, progress=False)
    model = tmp_path / "results" / "runs" / cfg.run_id / "model.pt"
    longer = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, epochs=3, lr=0.5))
    with pytest.raises(GnnPipeError, match=r"model\.pt: trained from another config: training.lr 0.02 -> 0.5 \(run "
                                           r".*re-run 'train'"):
        evaluate_run(longer)
    write_graph(cfg.graph_path, two_community_graph(seed=1))
    with pytest.raises(GnnPipeError, match=r"trained from another graph \(graph_hash \w+, the run's is now \w+\)"):
        evaluate_run(cfg)
    ckpt = torch.load(model, weights_only=True)
    torch.save({"model": ckpt["model"], "epoch": 2}, model)  # as an older gnnpipe wrote it
    with pytest.raises(GnnPipeError, match="does not say which config and data it was trained from"):
        evaluate_run(cfg)


def test_the_epoch_line_names_the_loss_the_metrics_it_has_and_the_seconds():
    from types import SimpleNamespace

    from gnnpipe.train import epoch_line

    cfg = SimpleNamespace(run_id="r", training=SimpleNamespace(epochs=5))
    row = {"epoch": 2, "loss": 1.5, "epoch_time_s": 0.5, "comm_bytes": 10, "train_acc": None,
           "val_energy_mae": np.float32(0.25), "val_force_cos": -0.1, "step_losses": [1.0, 2.0]}
    assert epoch_line(cfg, row) == ("train r: epoch 2 of 5: loss 1.5000, val_energy_mae 0.2500, "
                                    "val_force_cos -0.1000, 0.50 s")


def test_retain_freed_memory_applies_on_glibc(monkeypatch):
    """A node training process keeps freed large blocks for reuse (gnnpipe.train.run calls this): on
    glibc both mallopt settings take, unless the environment tunes glibc's malloc itself;
    elsewhere it does nothing and says so."""
    import platform

    from gnnpipe.engine import retain_freed_memory
    for k in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(k)
    assert retain_freed_memory() is (platform.libc_ver()[0] == "glibc")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert retain_freed_memory() is False


def test_the_record_compares_the_ledger_with_the_same_epochs_predictions(tmp_path):
    """#37 item 9: where each epoch carries its own closed form (atomic runs: every epoch its own batches),
    the record's comm_bytes_predicted is their median over the timed epochs, as comm_bytes_per_epoch is of the
    ledger: exact per epoch gives equal figures (the engine's single figure, the last epoch's, was 7-9 % off)."""
    from types import SimpleNamespace

    from gnnpipe.tasks import task_for
    from gnnpipe.train import _record

    cfg = run_cfg(tmp_path, {"kind": "gcn", "layers": 2, "hidden": 16})
    per_epoch = [7_050_000, 10_640_000, 8_000_000, 7_500_000]
    rows = [{"epoch": e, "loss": 1.0, "epoch_time_s": 1.0, "compute_s": 1.0, "comm_s": 0.0, "bubble_s": 0.0,
             "comm_bytes": b, "comm_bytes_predicted": b} for e, b in enumerate(per_epoch)]
    engine = SimpleNamespace(graph_info=dict, extra_info=dict, predicted_bytes=lambda: per_epoch[-1])
    task = task_for(cfg)
    rec = _record(cfg, task, engine, rows, [1.0] * 3, rows[1:], {}, 0)
    assert rec["comm_bytes_per_epoch"] == rec["comm_bytes_predicted"] == 8_000_000  # the median of the timed 3
    rows[0].pop("comm_bytes_predicted")  # rows without their own (node engines): the engine's figure
    assert _record(cfg, task, engine, rows, [1.0] * 4, rows, {}, 0)["comm_bytes_predicted"] == per_epoch[-1]
