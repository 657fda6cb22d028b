"""Fault injection (issue 11): killed workers end the job promptly and the rerun resumes to the
same bits; failed runs are FAILED in MLflow; a diverging run stops; damaged checkpoints and
chunk stores are refused.

The worker kills are real: ``GNNPIPE_TEST_KILL=<rank>:<epoch>`` makes that rank SIGKILL
itself inside the epoch's first module forward, under a real torchrun (gloo on CPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gnnpipe.config import dump_run_config, load_workflow_config, resolve_runs
from gnnpipe.graph import write_graph
from gnnpipe.io import GnnPipeError
from gnnpipe.partition import partition_graph
from gnnpipe.store import materialize
from test_partition import random_graph
from test_train import _KilledAt

TIMINGS = {"epoch_time_s", "compute_s", "comm_s", "bubble_s"}


def setup_run(root: Path, mode: str = "single", workers: int = 1, *, epochs: int = 8, checkpoint_every: int = 2,
              model=None, pipeline=None, stages=None, **training):
    """A tiny node-classification run under ``root/results`` (graph, chunk store, run.yaml)."""
    wf = load_workflow_config({
        "results": str(root / "results"), "datasets": {"tiny": {}},
        "models": {"m": model or {"kind": "gcn", "layers": 3, "hidden": 8, "dropout": 0.5}},
        "training": {"epochs": epochs, "eval_every": 2, "checkpoint_every": checkpoint_every, "lr": 0.02,
                     **training},
        **({"pipeline": pipeline} if pipeline else {}),
        "runs": [{"mode": mode, "dataset": "tiny", "model": "m", "workers": workers,
                  **({"stages": stages or workers} if mode in ("pipeline", "hybrid") else {})}]})
    cfg = next(iter(resolve_runs(wf).values()))
    g = random_graph(n=90, avg_degree=5, seed=3)
    write_graph(cfg.graph_path, g)
    if mode != "single":
        Path(cfg.store_path).parent.mkdir(parents=True, exist_ok=True)
        materialize(g, partition_graph(g, "metis", cfg.chunks, seed=0), cfg.store_path)
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.out_dir) / "run.yaml").write_text(dump_run_config(cfg))
    return cfg


#: the training habits all on, each where it acts on the tiny runs below: a warmup of 1.5 epochs into a
#: cosine decay, a clip below the gradients' norms, a moving average, the guard
HABITS = {"schedule": {"warmup_epochs": 1.5, "decay": "cosine", "min_lr_factor": 0.1}, "clip_grad_norm": 0.5,
          "ema_decay": 0.9, "guard": {"loss_factor": 3.0, "patience": 2, "min_force_cos": -1.0}}


def setup_atomic_run(root: Path, mode: str = "graph", workers: int = 2, *, epochs: int = 5, kind: str = "dimenetpp",
                     spec=None, run=None, **training):
    """A tiny atomic run (DimeNet++ or GemNet-T, small, one block, every training habit on) on 10 EMT
    slabs under ``root/results`` (systems.h5, graphs.h5, run.yaml); ``run``: more keys of its runs entry."""
    from gnnpipe.atomic import data

    spec = {"preset": "small", "num_blocks": 1, "batch_size": 2, "lr": 0.001, **HABITS, **(spec or {})}
    wf = load_workflow_config({
        "results": str(root / "results"), "datasets": {"slabs": {"kind": "atoms"}},
        "models": {"dpp": {"kind": kind, kind: spec}},
        "training": {"epochs": epochs, "eval_every": 5, "checkpoint_every": 2, "weight_decay": 0.0, **training},
        "runs": [{"mode": mode, "dataset": "slabs", "model": "dpp", "workers": workers, **(run or {})}]})
    cfg = next(iter(resolve_runs(wf).values()))
    systems = data.generate(10, size=(2, 2, 2), seed=2, progress=False)
    Path(cfg.graph_path).parent.mkdir(parents=True, exist_ok=True)
    digest = data.write_systems(cfg.systems_path, systems)
    data.write_graphs(cfg.graph_path, data.build_graphs(systems, 4.0, 8, progress=False), 4.0, 8, digest)
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.out_dir) / "run.yaml").write_text(dump_run_config(cfg))
    return cfg


def one_error_line(capsys) -> str:
    """The single ``gnnpipe: error:`` line a failed command printed (and no traceback)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("gnnpipe:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def db(cfg) -> str:
    return f"sqlite:///{Path(cfg.out_dir).parents[1] / 'mlflow.db'}"


def torchrun(cfg, *extra, env=None, timeout=240):
    """``gnnpipe train`` under a real torchrun; returns (process, seconds)."""
    e = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": db(cfg), **(env or {})}
    e.pop("GNNPIPE_TEST_KILL", None) if "GNNPIPE_TEST_KILL" not in (env or {}) else None
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(cfg.workers), *extra, "-m", "gnnpipe.cli", "train", "--run-config",
                           str(Path(cfg.out_dir) / "run.yaml")], capture_output=True, text=True, env=e,
                          timeout=timeout)
    return proc, time.monotonic() - t0


def weights(cfg) -> dict:
    return torch.load(Path(cfg.out_dir) / "model.pt", weights_only=True)["model"]


def history(cfg) -> list:
    rec = json.loads((Path(cfg.out_dir) / "metrics.json").read_text())
    return [{k: v for k, v in row.items() if k not in TIMINGS} for row in rec["history"]]


def assert_same_run(a, b) -> None:
    wa, wb = weights(a), weights(b)
    assert list(wa) == list(wb)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert history(a) == history(b)


def mlflow_runs(cfg, uri=None):
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=uri or db(cfg))
    exp = client.get_experiment_by_name("gnnpipe")
    return client.search_runs([exp.experiment_id]) if exp else []


@pytest.fixture(autouse=True)
def _isolated_mlflow(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("GNNPIPE_TEST_KILL", raising=False)
    monkeypatch.delenv("GNNPIPE_RESTART", raising=False)


def interrupted_run(monkeypatch, cfg, at):
    from gnnpipe import train
    build = train.build_engine
    with monkeypatch.context() as m:
        m.setattr(train, "build_engine", lambda *a: _KilledAt(build(*a), at))
        with pytest.raises(KeyboardInterrupt):
            train.run(cfg, progress=False)


# --------------------------------------------------------------------------- one process
def test_single_resume_is_bit_identical_and_one_mlflow_run(tmp_path, monkeypatch):
    from gnnpipe.train import run

    ref = setup_run(tmp_path / "ref")
    run(ref, progress=False)
    cfg = setup_run(tmp_path / "cut")
    interrupted_run(monkeypatch, cfg, at=5)  # checkpoints after epochs 2 and 4: resumes at 4
    out = Path(cfg.out_dir)
    assert not (out / "model.pt").exists() and not (out / "metrics.json").exists()
    manifest = json.loads((out / "resume" / "manifest.json").read_text())
    assert manifest["epochs_done"] == 4 and len(manifest["history"]) == 4
    failed, = mlflow_runs(cfg)
    assert failed.info.status == "FAILED" and "interrupted at epoch 5" in failed.data.tags["gnnpipe.error"]

    rec = run(cfg, progress=False)
    assert_same_run(ref, cfg)  # dropout 0.5: the RNG state was restored too
    done, = mlflow_runs(cfg)
    assert done.info.run_id == failed.info.run_id == rec["mlflow_run_id"] and done.info.status == "FINISHED"
    assert "gnnpipe.error" not in done.data.tags and done.data.tags["gnnpipe.resumed_at_epoch"] == "4"
    assert not (out / "resume").exists()  # finished: a later train starts over


def test_foreign_checkpoint_is_refused_until_restart(tmp_path, monkeypatch):
    from gnnpipe.train import run

    cfg = setup_run(tmp_path)
    interrupted_run(monkeypatch, cfg, at=3)
    first, = mlflow_runs(cfg)
    other = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, lr=0.05))
    with pytest.raises(GnnPipeError, match=r"resume/manifest.json: a checkpoint of another config: training.lr "
                                           r"0.02 -> 0.05; to discard it .*gnnpipe train --restart"):
        run(other, progress=False)
    rec = run(other, progress=False, restart=True)
    assert [r["epoch"] for r in rec["history"]] == list(range(8))  # from epoch 0
    runs = {r.info.run_id: r for r in mlflow_runs(cfg)}
    assert rec["mlflow_run_id"] != first.info.run_id and runs[rec["mlflow_run_id"]].info.status == "FINISHED"
    assert runs[first.info.run_id].info.status == "FAILED"


def test_a_resume_ignores_operational_keys_and_names_the_others(tmp_path, monkeypatch):
    """Issue 21, item 7: changing only checkpoint_every refused the resume as "another config" without
    naming the key. Now checkpoint cadence, timeouts and restarts are left out (the resumed run is the
    uninterrupted one, bit for bit) and a real difference is named."""
    from gnnpipe.train import run

    ref = setup_run(tmp_path / "ref")
    run(ref, progress=False)
    cfg = setup_run(tmp_path / "cut")
    interrupted_run(monkeypatch, cfg, at=5)  # resumes after epoch 3 (the checkpoint of epoch 4)
    for change in ({"lr": 0.05, "seed": 3}, {"epochs": 9}):
        other = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, **change))
        with pytest.raises(GnnPipeError) as err:
            run(other, progress=False)
        keys = "; ".join(f"training.{k} {getattr(cfg.training, k)!r} -> {v!r}" for k, v in sorted(change.items()))
        assert f"manifest.json: a checkpoint of another config: {keys}; to discard it" in str(err.value)
    operational = dataclasses.replace(cfg, training=dataclasses.replace(
        cfg.training, checkpoint_every=3, dist_timeout_s=60, max_restarts=2))
    rec = run(operational, progress=False)
    assert rec["history"][0]["epoch"] == 0 and len(rec["history"]) == 8
    assert_same_run(ref, cfg)
    from gnnpipe.evaluate import evaluate_run  # the finished model.pt is the run's under either cadence
    assert evaluate_run(cfg)["test_acc"] == pytest.approx(rec["test_acc"])


FIXTURE_V1 = Path(__file__).parent / "fixtures" / "fingerprint-v1"


def v1_run(tmp_path: Path, out: str, **training):
    """The fixture's run (written by gnnpipe before fingerprint v2, see its make.py) in ``tmp_path``."""
    import shutil

    from gnnpipe.config import load_run_config

    shutil.copytree(FIXTURE_V1, tmp_path / "v1")
    cfg = load_run_config(FIXTURE_V1 / "run.yaml")
    return dataclasses.replace(cfg, graph_path=str(tmp_path / "v1" / "graph.h5"), out_dir=str(tmp_path / "v1" / out),
                               training=dataclasses.replace(cfg.training, **training))


def test_a_model_of_fingerprint_v1_still_evaluates(tmp_path):
    """A model.pt of gnnpipe before fingerprint v2 carries its config whole: compared key by key,
    it evaluates (and with only the cadence changed too), and another config is named."""
    from gnnpipe.evaluate import evaluate_run

    cfg = v1_run(tmp_path, "finished")
    assert 0 <= evaluate_run(cfg)["test_acc"] <= 1
    assert evaluate_run(dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, checkpoint_every=1)))
    other = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, lr=0.1))
    with pytest.raises(GnnPipeError, match=r"model.pt: trained from another config: training.lr 0.05 -> 0.1 "):
        evaluate_run(other)


def test_a_resume_state_of_fingerprint_v1_resumes_or_says_what_to_do(tmp_path):
    """A manifest of gnnpipe before fingerprint v2 has the hash of its config only: while this
    gnnpipe's config hashes the same, the run resumes to the weights of the run that never stopped
    (the fixture's finished model); else one line says to restart."""
    from gnnpipe import checkpoint
    from gnnpipe.config import to_dict
    from gnnpipe.train import run

    cfg = v1_run(tmp_path, "interrupted")
    manifest = json.loads((FIXTURE_V1 / "interrupted" / "resume" / "manifest.json").read_text())
    if checkpoint._hash(checkpoint._fingerprinted(to_dict(cfg), 1)) != manifest["config_hash"]:
        with pytest.raises(GnnPipeError, match=r"manifest.json: a checkpoint of another config, or one of gnnpipe "
                                               r"before fingerprint v2, .*rerun with `gnnpipe train --restart`"):
            run(cfg, progress=False)
        return
    rec = run(cfg, progress=False)
    assert [r["epoch"] for r in rec["history"]] == [0, 1, 2, 3]
    done = torch.load(Path(cfg.out_dir) / "model.pt", weights_only=True)["model"]
    want = torch.load(FIXTURE_V1 / "finished" / "model.pt", weights_only=True)["model"]
    assert list(done) == list(want) and all(torch.equal(done[k], want[k]) for k in want)


def test_diverging_run_stops_with_one_line(tmp_path, capsys):
    """lr = 1e4 on a 10-layer GCN: the first non-finite loss ends the run (exit 2, one line). (A 3-layer
    GCN's loss stays finite at lr = 1e4 here: 1e13 to 1e35, dead ReLUs; only non-finite values stop.)"""
    from gnnpipe import cli

    cfg = setup_run(tmp_path, epochs=30, lr=1e4, model={"kind": "gcn", "layers": 10, "hidden": 16, "dropout": 0.0})
    assert cli.main(["train", "--run-config", str(Path(cfg.out_dir) / "run.yaml")]) == 2
    assert one_error_line(capsys).startswith("gnnpipe: error: epoch 1, rank 0: non-finite training loss (")
    assert not (Path(cfg.out_dir) / "metrics.json").exists() and not (Path(cfg.out_dir) / "model.pt").exists()
    run, = mlflow_runs(cfg)
    assert run.info.status == "FAILED" and "non-finite" in run.data.tags["gnnpipe.error"]


def _flip_bit(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def _tensor_offset(path: Path) -> int:
    """Where the largest stored tensor's bytes lie in a torch zip checkpoint."""
    import zipfile
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "rb") as f:  # local header: 30 bytes + name + extra
        f.seek(info.header_offset + 26)
        n, m = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    return info.header_offset + 30 + n + m + info.file_size // 2


def test_bit_flipped_checkpoints_are_refused(tmp_path, monkeypatch):
    from gnnpipe.evaluate import evaluate_run
    from gnnpipe.train import run

    cfg = setup_run(tmp_path)
    interrupted_run(monkeypatch, cfg, at=5)
    out = Path(cfg.out_dir)
    shard, = (out / "resume").glob("epoch-*/rank-0.pt")
    _flip_bit(shard, _tensor_offset(shard))
    with pytest.raises(GnnPipeError, match=r"rank-0.pt: its digest does not match its contents.*--restart"):
        run(cfg, progress=False)
    _flip_bit(out / "checkpoint.pt", _tensor_offset(out / "checkpoint.pt"))
    with pytest.raises(GnnPipeError, match=r"checkpoint.pt: its digest does not match its contents"):
        evaluate_run(cfg, checkpoint=out / "checkpoint.pt", allow_partial=True)
    manifest = out / "resume" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"epochs_done": 4', '"epochs_done": 2'))
    with pytest.raises(GnnPipeError, match=r"manifest.json: its digest does not match its contents"):
        run(cfg, progress=False)


def test_bit_flipped_chunk_store_is_refused(tmp_path):
    import h5py

    from gnnpipe.store import open_run_store

    cfg = setup_run(tmp_path, "graph", 2)
    with h5py.File(cfg.store_path, "r") as f:
        offset = f["parts/1/features"].id.get_offset()  # contiguous: the raw bytes in the file
    assert offset is not None
    _flip_bit(Path(cfg.store_path), offset + 5)
    with open_run_store(cfg, 2) as store:
        store.part(0)
        with pytest.raises(GnnPipeError, match=r"content hash of /parts/1/features does not match its data"):
            store.part(1)


@pytest.mark.parametrize("which", ["chunk store", "graphs.h5"])
def test_evaluate_on_a_truncated_file_is_one_line(tmp_path, capsys, which):
    """Issue 21, item 5: a truncated chunk store (graph run) or graphs.h5 (atomic run) was a raw
    OSError from h5py in `gnnpipe evaluate`."""
    from gnnpipe import cli

    cfg = setup_run(tmp_path, "graph", 2) if which == "chunk store" else setup_atomic_run(tmp_path)
    damaged = Path(cfg.store_path if which == "chunk store" else cfg.graph_path)
    damaged.write_bytes(damaged.read_bytes()[:3000])
    torch.save({"model": {}, "config_hash": "x", "epochs_done": cfg.training.epochs},
               Path(cfg.out_dir) / "model.pt")
    assert cli.main(["evaluate", "--run-config", str(Path(cfg.out_dir) / "run.yaml")]) == 2
    line = one_error_line(capsys)
    rule = "materialize" if which == "chunk store" else "atom_graphs"
    assert line.startswith(f"gnnpipe: error: {damaged}: not a readable HDF5 file (") and f"(rule {rule} " in line


# --------------------------------------------------------------------------- a full disk (issue 21, item 4)
def error_lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("gnnpipe: error:")]


@pytest.mark.parametrize("store", ["elsewhere", "on the full disk"])
def test_a_full_disk_in_a_checkpoint_round_is_one_line_and_recorded_in_mlflow(tmp_path, monkeypatch, capsys, store):
    """The disk fills during the second checkpoint round (a patched write says ENOSPC, as a full disk
    does): one line naming the shard and ENOSPC, the first round kept; MLflow FAILED when the store
    is elsewhere, else RUNNING and the outcome recorded by the next attempt, which resumes."""
    import errno

    from gnnpipe import cli, io as gio, tracking
    from helpers import full_disk_open

    client = tracking._client

    def store_on_the_full_disk(cfg, lock_wait=None):  # mark_failed (only it waits FAIL_LOCK_WAIT_S) fails
        if lock_wait == tracking.FAIL_LOCK_WAIT_S:
            raise OSError(errno.ENOSPC, "database or disk is full")
        return client(cfg, lock_wait)

    cfg = setup_run(tmp_path)
    out, run_yaml = Path(cfg.out_dir), str(Path(cfg.out_dir) / "run.yaml")
    with monkeypatch.context() as m:
        m.setattr(gio, "open", full_disk_open("epoch-000004"), raising=False)
        if store != "elsewhere":
            m.setattr(tracking, "_client", store_on_the_full_disk)
        assert cli.main(["train", "--run-config", run_yaml]) == 2
    line, = error_lines(capsys)
    shard = out / "resume" / "epoch-000004" / "rank-0.pt"
    assert line.startswith(f"gnnpipe: error: {shard}: cannot write it: No space left on device (ENOSPC)"), line
    assert json.loads((out / "resume" / "manifest.json").read_text())["epochs_done"] == 2
    assert not (out / "model.pt").exists() and not list(shard.parent.glob("*"))  # no temp file left either
    run, = mlflow_runs(cfg)
    if store == "elsewhere":
        assert run.info.status == "FAILED" and "(ENOSPC)" in run.data.tags["gnnpipe.error"]
    else:
        assert run.info.status == "RUNNING"

    assert cli.main(["train", "--run-config", run_yaml]) == 0
    assert "resuming" in capsys.readouterr().err
    done, = mlflow_runs(cfg)
    assert done.info.run_id == run.info.run_id and done.info.status == "FINISHED"
    assert "rank-0.pt: cannot write it: No space left on device (ENOSPC)" in done.data.tags["gnnpipe.previous_error"]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 3 MiB tmpfs (root only): a disk that really fills."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


class _FillsDiskAt:
    """An engine that fills ``filler``'s file system to the last byte when it reaches epoch ``at``."""

    def __init__(self, engine, at, filler: Path):
        self._engine, self._at, self._filler = engine, at, filler

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def train_epoch(self, epoch):
        if epoch == self._at:
            with open(self._filler, "wb", buffering=0) as f:
                for size in (65536, 4096, 1):
                    with contextlib.suppress(OSError):
                        while True:
                            f.write(b"\0" * size)
        return self._engine.train_epoch(epoch)


def test_a_really_full_disk_is_one_line_naming_the_file(small_tmpfs, tmp_path, monkeypatch, capsys):
    """Issue 21, item 4 on a real tmpfs: the disk fills in epoch 3; the checkpoint after it fails with
    one line (path, ENOSPC) instead of torch's "unexpected pos" and a traceback; the round of epoch 2
    is kept, the MLflow store (elsewhere) has the run FAILED with that line; freed, the rerun resumes."""
    from gnnpipe import cli, train
    from gnnpipe.graph import write_graph

    cfg = setup_run(small_tmpfs, epochs=6, model={"kind": "gcn", "layers": 2, "hidden": 128, "dropout": 0.0})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    filler, run_yaml = small_tmpfs / "filler", str(Path(cfg.out_dir) / "run.yaml")
    build = train.build_engine
    with monkeypatch.context() as m:
        m.setattr(train, "build_engine", lambda *a: _FillsDiskAt(build(*a), 3, filler))
        assert cli.main(["train", "--run-config", run_yaml]) == 2
    line, = error_lines(capsys)
    assert line.startswith(f"gnnpipe: error: {cfg.out_dir}/checkpoint.pt: cannot write it: No space left on "
                           f"device (ENOSPC); nothing was replaced"), line
    assert json.loads((Path(cfg.out_dir) / "resume" / "manifest.json").read_text())["epochs_done"] == 2
    run, = mlflow_runs(cfg, os.environ["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FAILED" and "checkpoint.pt: cannot write it: No space left on device (ENOSPC)" in \
        run.data.tags["gnnpipe.error"]
    with pytest.raises(GnnPipeError, match=r"graph.h5: cannot write it: No space left on device \(ENOSPC\)"):
        write_graph(small_tmpfs / "graph.h5", random_graph(n=300, avg_degree=8))  # h5py's error too

    filler.unlink()
    assert cli.main(["train", "--run-config", run_yaml]) == 0
    assert "after epoch 1" in capsys.readouterr().err


# --------------------------------------------------------------------------- real torchrun, SIGKILL
PARALLEL = {
    # kill rank 1 of graph P = 2; kill rank 0 (stage 0, the one that writes manifests and logs) of S = 2
    "graph-P2": dict(mode="graph", workers=2, kill=1),
    "pipeline-S2": dict(mode="pipeline", workers=2, kill=0,
                        model={"kind": "gcn", "layers": 4, "hidden": 8, "dropout": 0.5},
                        pipeline={"chunks_per_stage": 2, "grad_correction": False, "momentum": 0.5,
                                  "snapshot_every": 0}),
    # kill rank 0 of S = 2 x G = 2 (2 chunks per way: history, carried gradients and the ways' halo
    # exchange all resume); rank 1, its stage's other way, sees the group break
    "hybrid-2x2": dict(mode="hybrid", workers=4, stages=2, kill=0,
                       model={"kind": "gcnii", "layers": 4, "hidden": 8, "dropout": 0.5},
                       pipeline={"chunks_per_stage": 2, "grad_correction": False, "momentum": 0.5,
                                 "snapshot_every": 0}),
}


#: the hybrid case kills and resumes both a stage pipeline and graph ways: it stays in make test
@pytest.mark.parametrize("case", [c if c.startswith("hybrid") else pytest.param(c, marks=pytest.mark.long)
                                  for c in PARALLEL])
def test_killed_worker_ends_the_job_and_the_rerun_resumes_exactly(tmp_path, case):
    spec = dict(PARALLEL[case])
    kill = spec.pop("kill")
    ref = setup_run(tmp_path / "ref", **spec)
    proc, _ = torchrun(ref)
    assert proc.returncode == 0, proc.stderr[-3000:]

    cfg = setup_run(tmp_path / "cut", **spec)
    proc, took = torchrun(cfg, env={"GNNPIPE_TEST_KILL": f"{kill}:5"})
    assert proc.returncode != 0 and took < 60, (took, proc.stderr[-3000:])
    survivor = 1 - kill
    assert f"rank {survivor}: the worker group broke: rank {kill} (pid " in proc.stderr, proc.stderr[-3000:]
    out = Path(cfg.out_dir)
    assert not (out / "model.pt").exists() and not (out / "metrics.json").exists()
    failed, = mlflow_runs(cfg)
    assert failed.info.status == "FAILED"
    assert f"rank {kill} (pid" in failed.data.tags["gnnpipe.error"]

    proc, _ = torchrun(cfg)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming" in proc.stderr and "after epoch 3" in proc.stderr
    assert_same_run(ref, cfg)
    done, = mlflow_runs(cfg)
    assert done.info.run_id == failed.info.run_id and done.info.status == "FINISHED"


@pytest.mark.long
def test_torchrun_max_restarts_resumes_by_itself(tmp_path):
    spec = dict(PARALLEL["graph-P2"])
    spec.pop("kill")
    ref = setup_run(tmp_path / "ref", **spec)
    cfg = setup_run(tmp_path / "cut", **spec)
    proc, _ = torchrun(ref)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, _ = torchrun(cfg, "--max-restarts", "1", env={"GNNPIPE_TEST_KILL": "1:5"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming" in proc.stderr
    assert_same_run(ref, cfg)
    done, = mlflow_runs(cfg)
    assert done.info.status == "FINISHED"


# --------------------------------------------------------------------------- orphans, the run's lock (issue 21, 2)
def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun's workers, for its agent)."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(p.name))
        except (OSError, IndexError):
            pass
    return out


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


def _is_torchrun(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1].endswith(b"torchrun")
    except (OSError, IndexError):
        return False


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.slow
def test_workers_die_with_their_launcher_and_one_live_job_owns_a_run(tmp_path):
    """Killing Snakemake's process group (or the torchrun agent alone) left the workers training in
    sessions of their own: they wrote metrics.json / model.pt after the job had failed, or trained
    beside a rerun in the same out_dir. Now they die with the agent, a second job is refused while
    the first lives, and the dead job's lock does not block the rerun."""
    import signal
    import socket

    from gnnpipe.train import _alive

    cfg = setup_run(tmp_path, "graph", 2, epochs=20000, checkpoint_every=20, eval_every=1000)
    out = Path(cfg.out_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": db(cfg)}
    agents, workers = [], set()

    def launch(name: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "w")
        agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                  "2", "-m", "gnnpipe.cli", "train", "--run-config", str(out / "run.yaml")],
                                 stdout=log, stderr=log, env=env, start_new_session=True)  # a group, as Snakemake's
        agents.append(agent)
        return agent

    def training(agent) -> list[int]:
        _wait(lambda: len(_children(agent.pid)) == 2, 60, "two workers")
        workers.update(_children(agent.pid))
        return _children(agent.pid)

    def epochs_done():
        return json.loads((out / "resume" / "manifest.json").read_text())["epochs_done"]

    try:
        first = launch("first")
        _wait(lambda: (out / "resume" / "manifest.json").exists(), 120, "the first checkpoint")
        first_workers = training(first)
        os.killpg(first.pid, signal.SIGKILL)  # Snakemake's process group, torchrun's agent in it
        _wait(lambda: not any(_alive(p) for p in first_workers), 10, "the workers to die with their agent")
        time.sleep(2)
        assert not (out / "metrics.json").exists() and not (out / "model.pt").exists()

        resumed_at = epochs_done()
        rerun = launch("rerun")  # the lock of the dead job does not block it
        _wait(lambda: epochs_done() > resumed_at, 120, "the rerun to resume and checkpoint")
        assert "resuming" in (tmp_path / "rerun.log").read_text()
        rerun_workers = training(rerun)
        proc, _ = torchrun(cfg)  # a second job on the same run, while the rerun trains
        assert proc.returncode != 0, proc.stderr[-3000:]
        line = next(l for l in proc.stderr.splitlines() if l.startswith("gnnpipe: error:"))
        assert f"{out / '.lock'}: run {cfg.run_id} is being trained by another job (host {socket.gethostname()} " \
               f"pid " in line and "one job at a time writes a run directory" in line, line
        assert int(line.split(" pid ")[1].split()[0]) in rerun_workers  # the live job's rank 0

        os.kill(rerun.pid, signal.SIGKILL)  # the agent alone
        _wait(lambda: not any(_alive(p) for p in rerun_workers), 10, "the workers to die with their agent")
        from gnnpipe.tracking import UNCLOSED
        run, = mlflow_runs(cfg)  # one MLflow run: the rerun continued it and said how the first ended
        assert run.info.status == "RUNNING" and run.data.tags["gnnpipe.previous_error"] == UNCLOSED
    finally:
        for agent in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        for pid in workers:  # orphans, where they survive (the defect)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_second_job_is_refused_while_the_first_holds_the_run_and_a_dead_ones_lock_never_blocks(tmp_path, capsys):
    """One process: a live holder of <out_dir>/.lock (another job) refuses the run with one line naming
    it; once the holder is dead, its lock file (still naming it) does not block."""
    import signal

    from gnnpipe import cli

    cfg = setup_run(tmp_path, epochs=2)
    lock = Path(cfg.out_dir) / ".lock"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({str(lock)!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX); f.write('host elsewhere pid 4242'); f.flush()\n"
        "print('held', flush=True); time.sleep(120)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert cli.main(["train", "--run-config", str(Path(cfg.out_dir) / "run.yaml")]) == 2
        assert one_error_line(capsys) == (
            f"gnnpipe: error: {lock}: run {cfg.run_id} is being trained by another job (host elsewhere pid 4242); "
            f"one job at a time writes a run directory: wait for it to end, or stop it")
        assert not mlflow_runs(cfg)  # refused before anything was opened or written
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert lock.read_text() == "host elsewhere pid 4242"
    assert cli.main(["train", "--run-config", str(Path(cfg.out_dir) / "run.yaml")]) == 0
    assert (Path(cfg.out_dir) / "metrics.json").exists()


# --------------------------------------------------------------------------- through Snakemake
@pytest.mark.slow
@pytest.mark.long
def test_killed_worker_under_snakemake_then_rerun_completes(tmp_path):
    import yaml

    from test_workflow import TINY, snakemake

    conf = yaml.safe_load(TINY.read_text())
    conf["training"].update(checkpoint_every=2)
    conf["runs"] = [{"mode": "graph", "dataset": "tiny", "model": "gcnii4", "workers": 2}]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(conf))
    rid = next(iter(resolve_runs(load_workflow_config(conf))))
    out = tmp_path / "results" / "runs" / rid
    target = f"results/runs/{rid}/eval.json"

    os.environ["GNNPIPE_TEST_KILL"] = "1:3"  # inherited by the train job's workers
    try:
        res = snakemake(tmp_path, tmp_path / "config.yaml", "--cores", "2", target)
    finally:
        del os.environ["GNNPIPE_TEST_KILL"]
    assert res.returncode != 0
    log = (out.parents[1] / "logs" / "train" / f"{rid}.log").read_text()
    assert "rank 0: the worker group broke: rank 1 (pid " in log, log[-3000:]
    assert not (out / "model.pt").exists() and not (out / "metrics.json").exists()
    assert json.loads((out / "resume" / "manifest.json").read_text())["epochs_done"] == 2

    res = snakemake(tmp_path, tmp_path / "config.yaml", "--cores", "2", target)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming" in (out.parents[1] / "logs" / "train" / f"{rid}.log").read_text()
    rec = json.loads((out / "metrics.json").read_text())
    assert [r["epoch"] for r in rec["history"]] == list(range(6)) and (out / "eval.json").exists()
    res = snakemake(tmp_path, tmp_path / "config.yaml", "-n", target)
    assert "Nothing to be done" in res.stdout + res.stderr


@pytest.mark.slow
@pytest.mark.long
def test_snakemake_killed_with_its_workers_then_unlocked_and_resumed(tmp_path):
    """The probe of issue 21 (items 2, 7): `kill -9 -- -PGID` of Snakemake mid-train. The workers die
    too and write nothing; as docs/WORKFLOW.md says, the rerun stops on Snakemake's lock until
    `--unlock`, then resumes to the end in the same MLflow run."""
    import signal

    import yaml

    from gnnpipe.train import _alive
    from helpers import TINY, snakemake, snakemake_command

    conf = yaml.safe_load(TINY.read_text())
    conf["training"].update(checkpoint_every=20, epochs=300, eval_every=100)
    conf["runs"] = [{"mode": "graph", "dataset": "tiny", "model": "gcn2", "workers": 2}]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(conf))
    cfg, = resolve_runs(load_workflow_config({**conf, "results": str(tmp_path / "results")})).values()
    out, target = Path(cfg.out_dir), f"results/runs/{cfg.run_id}/eval.json"
    cmd, env = snakemake_command(tmp_path, tmp_path / "config.yaml", "--cores", "2", target)
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    workers = []
    try:
        _wait(lambda: (out / "resume" / "manifest.json").exists(), 240, "the first checkpoint")
        agent, = [pid for pid in _descendants(first.pid) if _is_torchrun(pid)]  # snakemake > sh > launch > torchrun
        workers = _children(agent)
        assert len(workers) == 2, workers
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        _wait(lambda: not any(_alive(p) for p in workers), 10, "the workers to die with Snakemake's group")
        time.sleep(2)
        assert not (out / "metrics.json").exists() and not (out / "model.pt").exists()
    finally:
        for pid in workers:  # orphans, where they survive (the defect)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    res = snakemake(tmp_path, tmp_path / "config.yaml", "--cores", "2", target)
    assert res.returncode != 0 and "LockException" in res.stderr, res.stderr[-3000:]
    assert snakemake(tmp_path, tmp_path / "config.yaml", "--unlock").returncode == 0
    res = snakemake(tmp_path, tmp_path / "config.yaml", "--cores", "2", target)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming" in (out.parents[1] / "logs" / "train" / f"{cfg.run_id}.log").read_text()
    run, = mlflow_runs(cfg)
    assert run.info.status == "FINISHED" and (out / "eval.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", [pytest.param("dimenetpp", marks=pytest.mark.long), "gemnet_t"])
def test_atomic_graph_mode_killed_and_resumed_is_bit_identical(tmp_path, kind):
    """DimeNet++ and GemNet-T graph P = 2 (several optimizer steps per epoch): a killed worker, a resumed
    rerun, the weights of a run that never stopped (GemNet's scale factors, fitted at the start of the
    first attempt, come back from the checkpoint)."""
    ref, cfg = setup_atomic_run(tmp_path / "ref", kind=kind), setup_atomic_run(tmp_path / "cut", kind=kind)
    proc, _ = torchrun(ref)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, took = torchrun(cfg, env={"GNNPIPE_TEST_KILL": "1:3"})
    assert proc.returncode != 0 and took < 60 and "rank 1 (pid " in proc.stderr, proc.stderr[-3000:]
    proc, _ = torchrun(cfg)
    assert proc.returncode == 0 and "after epoch 1" in proc.stderr, proc.stderr[-3000:]
    assert_same_run(ref, cfg)
    scales = [k for k in weights(cfg) if k.endswith("scale_factor")]
    assert bool(scales) == (kind == "gemnet_t") and all(float(weights(cfg)[k]) != 1.0 for k in scales)


@pytest.mark.slow
def test_atomic_graph_mode_with_every_habit_trains_as_single(tmp_path):
    """DimeNet++ with the schedule, clipping, the moving average and the guard on (float64): graph P = 2
    under torchrun trains the model single does, to 1e-10: every epoch's loss, and the finished model's
    weights (the average) and metrics."""
    from gnnpipe import train

    single = setup_atomic_run(tmp_path / "single", "single", 1, dtype="float64")
    graph = setup_atomic_run(tmp_path / "graph", "graph", 2, dtype="float64")
    proc, _ = torchrun(graph)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = train.run(single, progress=False)
    ws, wg = weights(single), weights(graph)
    assert list(ws) == list(wg)
    for k in ws:
        torch.testing.assert_close(wg[k], ws[k], rtol=0, atol=1e-10)
    rec = json.loads((Path(graph.out_dir) / "metrics.json").read_text())
    assert [h["loss"] for h in rec["history"]] == pytest.approx([h["loss"] for h in ref["history"]], rel=1e-10)
    for k in ("energy_mae", "force_mae", "force_cos"):
        assert rec[k] == pytest.approx(ref[k], rel=1e-9), k
