"""The atomic trainer's habits (gnnpipe.habits): the schedule's values, clipping, the weights'
moving average in evaluation and the finished model, the divergence guard (unit and end to end)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from gnnpipe.habits import Diverged, Guard, lr_at
from test_faults import _isolated_mlflow, mlflow_runs, one_error_line, setup_atomic_run  # noqa: F401 (a fixture)


def test_schedule_warms_up_then_decays_by_a_cosine_to_its_floor():
    # 21 steps, 4 of warmup, lr 1, floor 0.1: the decay runs over steps 4 .. 20
    lr = [lr_at(t, 21, 1.0, 4, "cosine", 0.1) for t in range(21)]
    assert lr[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert lr[12] == pytest.approx(0.55)  # half-way: the mean of lr and its floor
    assert lr[20] == pytest.approx(0.1) and all(a > b for a, b in zip(lr[4:], lr[5:]))
    assert [lr_at(t, 21, 1.0, 4, "none", 0.1) for t in (3, 4, 20)] == pytest.approx([0.8, 1.0, 1.0])
    assert lr_at(0, 5, 0.3, 0, "cosine", 0.5) == pytest.approx(0.3)  # no warmup


def _engine(tmp_path, **spec):
    from gnnpipe.atomic.atomic_engine import AtomicEngine
    cfg = setup_atomic_run(tmp_path, "single", 1, epochs=3, spec=spec, dtype="float64")
    return AtomicEngine(cfg, None, None, torch.device("cpu"))


def _grad_norm(engine) -> float:
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in engine.model.parameters()])))


def test_the_engine_steps_with_the_schedules_lr_and_clips_the_gradients_norm(tmp_path):
    """Each optimizer step runs at lr_at(its global step); the gradients it applies have the clip's norm
    (without the clip they are larger: the clip acts)."""
    eng = _engine(tmp_path, clip_grad_norm=1e-3)
    seen = []
    eng.opt.register_step_pre_hook(lambda opt, *a: seen.append((opt.param_groups[0]["lr"], _grad_norm(eng))))
    for epoch in range(3):
        eng.train_epoch(epoch)
    per, total = eng.steps_per_epoch, 3 * eng.steps_per_epoch
    assert per == 4 and eng.habits.warmup_steps == 6 and len(seen) == total  # 8 training systems, 2 a step; 1.5 epochs
    assert [lr for lr, _ in seen] == [lr_at(t, total, 1e-3, 6, "cosine", 0.1) for t in range(total)]
    assert seen[-1][0] == pytest.approx(1e-4)
    assert all(norm == pytest.approx(1e-3, rel=1e-4) for _, norm in seen)  # torch divides by norm + 1e-6
    free = _engine(tmp_path / "free", clip_grad_norm=None)
    norms = []
    free.opt.register_step_pre_hook(lambda opt, *a: norms.append(_grad_norm(free)))
    free.train_epoch(0)
    assert min(norms) > 1e-2


def test_evaluation_and_the_finished_model_use_the_weights_moving_average(tmp_path):
    """The average is d·avg + (1 - d)·w after each step with d = min(decay, (1 + n)/(10 + n)); evaluate()
    computes with it (an engine loaded with the finished model gives the same metrics), the live weights
    give others, and training goes on from the live weights."""
    from gnnpipe.atomic.atomic_engine import AtomicEngine

    eng = _engine(tmp_path, ema_decay=0.9)
    avg = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    n = [0]

    def follow(opt, *a):
        d = min(0.9, (1 + n[0]) / (10 + n[0]))
        for name, p in eng.model.named_parameters():
            avg[name] = d * avg[name] + (1 - d) * p.detach()
        n[0] += 1
    eng.opt.register_step_post_hook(follow)
    for epoch in range(2):
        eng.train_epoch(epoch)
    live = {k: v.clone() for k, v in eng.model.state_dict().items()}
    final = eng.full_state_dict()
    for name in avg:
        torch.testing.assert_close(final[name], avg[name], rtol=0, atol=1e-14)
    assert any(not torch.equal(final[k], live[k]) for k in avg)
    with_avg = eng.evaluate()
    assert all(torch.equal(v, eng.model.state_dict()[k]) for k, v in live.items())  # put back after evaluation
    loaded = AtomicEngine(eng.cfg, None, None, torch.device("cpu"))
    loaded.model.load_state_dict(final)
    assert loaded.evaluate() == with_avg  # evaluate.py's path: a loaded model, no average yet
    eng.habits.ema = None
    assert eng.evaluate()["train_force_mae"] != with_avg["train_force_mae"]


def test_guard_stops_on_a_loss_that_stays_high_a_non_finite_one_or_a_low_force_cosine():
    where = "epoch 3, rank 0"
    g = Guard(3.0, 2, 0.0, after_epoch=2, hint="lower the lr")
    for epoch, loss in enumerate([2.0, 1.0, 3.5, 2.5, 3.5]):  # above 3x the best once, then not: no stop
        g.check(epoch, {"loss": loss}, where)
    with pytest.raises(Diverged, match=r"^epoch 3, rank 0: training diverged: loss 3.6 above 3x its best 1 "
                                       r"\(epoch 1\) for 2 epochs; lower the lr$"):
        g.check(5, {"loss": 3.6}, where)
    with pytest.raises(Diverged, match="training diverged: non-finite loss \\(nan\\)"):
        Guard(3.0, 2, 0.0, 0, "h").check(0, {"loss": math.nan}, where)
    g = Guard(3.0, 2, 0.0, after_epoch=2, hint="h")
    g.check(1, {"loss": 1.0, "val_force_cos": -0.5}, where)  # in the warmup: not judged
    g.check(2, {"loss": 1.0, "val_force_cos": None, "train_force_cos": 0.2}, where)  # no val split: train's
    with pytest.raises(Diverged, match=r"val force cosine -0.100 below the floor 0 after the warmup, and the loss "
                                       r"1 no longer falls \(best 1 at epoch 1\); h$"):
        g.check(3, {"loss": 1.0, "val_force_cos": -0.1}, where)
    off = Guard(None, 1, None, after_epoch=0, hint="h")
    for epoch, loss in enumerate([1.0, 100.0, 1000.0]):
        off.check(epoch, {"loss": loss, "val_force_cos": -1.0}, where)
    g = Guard(3.0, 2, 0.0, 0, "h")
    g.check(0, {"loss": 1.0}, where)
    g.check(1, {"loss": 4.0}, where)
    resumed = Guard(3.0, 2, 0.0, 0, "h")
    resumed.load_state_dict(g.state_dict())  # the count of epochs above survives a resume
    with pytest.raises(Diverged, match="for 2 epochs"):
        resumed.check(2, {"loss": 4.0}, where)


def test_the_force_cosine_floor_does_not_stop_a_run_whose_loss_still_falls():
    """#37 item 10: GemNet-T at lr 1e-3, loss 756 -> 448 -> 51 -> 15 -> 9.5 (a new best every epoch) with
    val force cosine -0.356 under the floor -0.2 after the warmup: a healthy run, not stopped. Once the loss
    stops falling (no new best) the same cosine stops it."""
    g = Guard(3.0, 3, -0.2, after_epoch=2, hint="h")
    for epoch, loss in enumerate([756.0, 448.0, 51.0, 15.0, 9.5]):
        g.check(epoch, {"loss": loss, "val_force_cos": -0.356}, "w")
    g.check(5, {"loss": 9.6, "val_force_cos": -0.1}, "w")  # not falling, but the cosine is above the floor
    with pytest.raises(Diverged, match=r"^w: training diverged: val force cosine -0.356 below the floor -0.2 after "
                                       r"the warmup, and the loss 9.7 no longer falls \(best 9.5 at epoch 4\); h$"):
        g.check(6, {"loss": 9.7, "val_force_cos": -0.356}, "w")


def test_a_run_the_guard_stops_ends_with_one_line_failed_in_mlflow_and_no_model(tmp_path, capsys):
    """The trainer's failure path: exit 2, one line, the MLflow run FAILED with it, neither model.pt nor
    metrics.json (a force-cosine floor no model reaches after its warmup, at an lr so small that the loss
    stops falling: 42.10, 42.16, 42.29: the guard's plumbing)."""
    from gnnpipe import cli

    cfg = setup_atomic_run(tmp_path, "single", 1, epochs=4, eval_every=1,
                           spec={"lr": 1e-6, "guard": {"min_force_cos": 0.999}})
    assert cli.main(["train", "--run-config", str(Path(cfg.out_dir) / "run.yaml")]) == 2
    line = one_error_line(capsys)
    assert line.startswith("gnnpipe: error: epoch 2, rank 0: training diverged: val force cosine ") and \
        "below the floor 0.999 after the warmup, and the loss 42.29 no longer falls (best 42.1 at epoch 0); " \
        "lower models.<name>.dimenetpp.lr (now 1e-06)" in line, line
    assert not (Path(cfg.out_dir) / "metrics.json").exists() and not (Path(cfg.out_dir) / "model.pt").exists()
    run, = mlflow_runs(cfg)
    assert run.info.status == "FAILED" and "training diverged" in run.data.tags["gnnpipe.error"]


def test_baselines_are_the_test_systems_per_element_energy_and_zero_force_errors(tmp_path):
    """baseline_force_mae is the MAE of predicting F = 0 on the test systems' free atoms (computed here from
    the arrays), beside the per-element energy baseline's; the record's extra carries both."""
    import numpy as np

    eng = _engine(tmp_path)
    s, test = eng.systems, eng.ids["test"]
    comps = [s["forces"][a][~s["fixed"][a]] for a in (slice(s["atom_ptr"][i], s["atom_ptr"][i + 1]) for i in test)]
    base = eng.baselines()
    assert base["baseline_force_mae"] == pytest.approx(np.abs(np.concatenate(comps)).mean(), rel=1e-12)
    assert base["baseline_energy_mae"] > 0 and eng.extra_info()["baseline_force_mae"] == base["baseline_force_mae"]
    assert eng.baselines("val")["baseline_force_mae"] != base["baseline_force_mae"]


@pytest.mark.parametrize("energy,force,want", [(0.5, 0.1, "beats both"), (2.0, 0.1, "forces only"),
                                               (0.5, 0.9, "energy only"), (2.0, 0.9, "**beats neither**")])
def test_the_reports_atomic_row_shows_both_baselines_and_marks_a_model_that_beats_neither(energy, force, want):
    from gnnpipe.report.atomic import HEADER, run_row, verdict
    from gnnpipe.report.records import Run

    record = {"run_id": "r", "mode": "single", "ways": 1, "epoch_time_s": 1.0, "comm_bytes_per_epoch": 0,
              "comm_bytes_predicted": 0, "peak_mem_bytes": 0, "energy_mae": 9.0, "force_mae": 9.0,
              "extra": {"atomic": True, "parameters": 10, "baseline_energy_mae": 9.0, "baseline_force_mae": 9.0}}
    evaluation = {"energy_mae": energy, "force_mae": force, "force_cos": 0.5, "efwt": 0.0,
                  "baseline_energy_mae": 1.0, "baseline_force_mae": 0.4}
    row = dict(zip(HEADER, run_row(Run(record, evaluation, Path(".")))))
    assert (row["baseline"], row["zero-force baseline"], row["vs baselines"]) == ("1.0000", "0.4000", want)
    assert verdict(0.5, None, 0.1, 0.4) == "—"  # a run without a test split: no verdict


def test_a_resume_state_from_before_the_habits_loads_with_a_fresh_guard_and_average(tmp_path):
    """A resume state of a gnnpipe before the habits (model and optimizer only; its config matches at the
    new keys' defaults) resumes: the average starts at the loaded weights, the guard afresh."""
    eng = _engine(tmp_path)
    eng.train_epoch(0)
    old = {k: v for k, v in eng.state_dict().items() if k in ("model", "optimizer")}
    other = _engine(tmp_path / "other")
    other.load_state_dict(old)
    assert other.habits.ema.updates == 0 and other.habits.guard.best == math.inf
    final = other.full_state_dict()
    assert all(torch.equal(final[k], v) for k, v in eng.model.state_dict().items())
