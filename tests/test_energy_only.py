"""Energy-only training of atomic models (issue #37 items 13, 14, 16): data without forces, or
``force_weight: 0``, trains on the energy alone with no force pass (no forces by autograd, no double
backward, no direct head), in every mode exactly as in one process, and reports no force metric;
each atomic kind's own default learning rate."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gnnpipe.parallel.testing import spawn_multi_process
from test_faults import setup_atomic_run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True, scope="module")
def _slabs_once():
    """``setup_atomic_run``'s 10 EMT slabs relaxed once for the module, not once per run."""
    from gnnpipe.atomic import data

    made = {}

    def generate(*args, **kwargs):
        key = repr((args, sorted(kwargs.items())))
        if key not in made:
            made[key] = real(*args, **kwargs)
        return {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in made[key].items()}

    real = data.generate
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(data, "generate", generate)
        yield


def _run(root: Path, mode: str = "single", workers: int = 1, *, forces: bool = False, **kw):
    """``setup_atomic_run`` (float64, one epoch); ``forces=False``: its slabs as a file of energies alone
    gives them (``data.read_structures``: NaN forces), systems.h5 and graphs.h5 rewritten to match."""
    from gnnpipe.atomic import data

    cfg = setup_atomic_run(root, mode, workers, epochs=1, dtype="float64", **kw)
    if not forces:
        systems, graphs = data.read_systems(cfg.systems_path), data.read_graphs(cfg.graph_path)
        systems["forces"][:] = np.nan
        digest = data.write_systems(cfg.systems_path, systems)
        data.write_graphs(cfg.graph_path, graphs, graphs["cutoff"], graphs["max_neighbors"], digest)
    return cfg


def _no_force_pass(*args, **kwargs):
    raise AssertionError("a force pass ran (torch.autograd.grad)")


@pytest.mark.parametrize("kind,head,forces,spec,why", [
    ("dimenetpp", "gradient", False, {}, "its data has no forces"),
    ("gemnet_t", "gradient", True, {"force_weight": 0}, "force_weight is 0"),
    ("gemnet_t", "direct", False, {}, "its data has no forces")])
def test_energy_only_training_runs_no_force_pass_and_has_no_force_metric(tmp_path, monkeypatch, kind, head,
                                                                          forces, spec, why):
    """The engine decides energy-only once (``engine.energy_only``) and then never computes forces: an epoch
    and an evaluation run with ``torch.autograd.grad`` (every gradient force's) made to fail, the direct head
    gets no gradient; the force metrics, EFwT and the zero-force baseline are None, the record says why."""
    from gnnpipe.atomic.atomic_engine import AtomicEngine, StepCounts, step_loss

    cfg = _run(tmp_path, kind=kind, forces=forces, spec={"force_head": head, **spec})
    eng = AtomicEngine(cfg, None, None, torch.device("cpu"))
    assert eng.energy_only == why and eng.force_weight == 0.0
    monkeypatch.setattr(torch.autograd, "grad", _no_force_pass)
    if head == "gradient":  # the patch does catch a force pass
        b, g = eng.layout.view(eng._batch(eng.ids["train"][:1]), None, eng.dtype, eng.device)
        with pytest.raises(AssertionError, match="a force pass ran"):
            step_loss(eng.model, g, b, eng.norm, StepCounts(1, 1), 1.0)
    stats = eng.train_epoch(0)
    assert len(stats.step_losses) == 4 and np.isfinite(stats.loss)
    if head == "direct":
        heads = {n: p.grad for n, p in eng.model.named_parameters() if "forces" in n}
        assert heads and all(not g.any() for g in heads.values())
    ev = eng.evaluate()
    for split in ("train", "val", "test"):
        assert ev[f"{split}_energy_mae"] > 0
        assert ev[f"{split}_force_mae"] is ev[f"{split}_force_cos"] is ev[f"{split}_efwt"] is None
    assert ev["force_mae"] is ev["force_cos"] is ev["efwt"] is None
    extra = eng.extra_info()
    assert extra["energy_only"] == why and extra["baseline_force_mae"] is None and extra["baseline_energy_mae"] > 0


def test_the_energy_only_step_is_the_force_steps_energy_term_exactly(tmp_path):
    """Without the force pass the loss and every parameter gradient are those of the full step with force
    weight 0 (float64, to rounding): dropping the force pass changes the cost, not the training."""
    from gnnpipe.atomic.atomic_engine import AtomicEngine, StepCounts, step_loss

    eng = AtomicEngine(_run(tmp_path, forces=True), None, None, torch.device("cpu"))
    b, g = eng.layout.view(eng._batch(eng.ids["train"][:3]), None, eng.dtype, eng.device)
    with torch.no_grad():  # the zero-initialised output layers would make most gradients 0
        for p in eng.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = []
    for forces in (True, False):
        eng.model.zero_grad(set_to_none=False)
        loss, energy, f, report = step_loss(eng.model, g, b, eng.norm, StepCounts(3, 9), 0.0, forces=forces)
        loss.backward()
        out.append((loss.detach(), energy, [p.grad.clone() for p in eng.model.parameters()], f))
    (l1, e1, g1, f1), (l0, e0, g0, f0) = out
    assert f1 is not None and f0 is None
    torch.testing.assert_close(l0, l1, rtol=1e-12, atol=0)
    torch.testing.assert_close(e0, e1, rtol=1e-12, atol=0)
    assert max(float((a - c).abs().max()) for a, c in zip(g0, g1)) < 1e-12 and any(a.any() for a in g0)


def _epochs(rank: int, world: int, cfgs: list) -> list[dict]:
    """One epoch and an evaluation of ``AtomicEngine`` on rank ``rank`` for each run of ``cfgs``, as
    ``gnnpipe train`` builds it: step losses, finished weights, bytes sent and predicted, metrics."""
    from gnnpipe.atomic.atomic_engine import AtomicEngine
    from gnnpipe.layout import ParallelDims
    from gnnpipe.parallel.comm import Communicator
    from gnnpipe.parallel.groups import build_groups

    out = []
    for cfg in cfgs:
        groups = build_groups(ParallelDims("graph", world, ways=cfg.ways, data=cfg.data_parallel), rank)
        comm = Communicator(groups, torch.device("cpu"))
        engine = AtomicEngine(cfg, groups, comm, torch.device("cpu"))
        comm.set_epoch(0)
        stats = engine.train_epoch(0)
        out.append({"steps": stats.step_losses, "weights": engine.full_state_dict(), "sent": comm.epoch_bytes(0),
                    "predicted": engine.predicted_bytes(), "eval": engine.evaluate(),
                    "energy_only": engine.energy_only})
    return out


@pytest.mark.slow
def test_energy_only_graph_parallel_training_equals_single(tmp_path):
    """Energy-only at P = 2, DimeNet++ in the edges layout and GemNet-T in the atoms layout (halo exchanges),
    trains as one process does: every step's loss and the finished weights to 1e-10 (float64), the same
    energy MAE, no force metric; the bytes sent are the closed form of two passes without forces
    (``collective_passes(..., forces=False)``)."""
    from gnnpipe.atomic.atomic_engine import AtomicEngine

    cases = [("dimenetpp", "edges"), ("gemnet_t", "atoms")]
    graphs = [_run(tmp_path / f"graph-{kind}", "graph", 2, kind=kind, run={"atom_layout": layout})
              for kind, layout in cases]
    res = spawn_multi_process(_epochs, 2, graphs, timeout=240)
    for i, (kind, _) in enumerate(cases):
        ref = AtomicEngine(_run(tmp_path / f"single-{kind}", kind=kind), None, None, torch.device("cpu"))
        ref_steps, ref_eval = ref.train_epoch(0).step_losses, ref.evaluate()
        for rank in res:
            r = rank[i]
            assert r["energy_only"] == "its data has no forces"
            assert r["steps"] == pytest.approx(ref_steps, rel=1e-10, abs=0)
            for k, v in ref.full_state_dict().items():
                torch.testing.assert_close(r["weights"][k], v, rtol=0, atol=1e-10)
            assert r["eval"]["energy_mae"] == pytest.approx(ref_eval["energy_mae"], rel=1e-9)
            assert r["eval"]["force_mae"] is None and r["eval"]["efwt"] is None
        assert sum(rank[i]["sent"] for rank in res) == res[0][i]["predicted"] == res[1][i]["predicted"] > 0


def test_the_report_says_a_run_is_energy_only_and_judges_it_on_the_energy(tmp_path):
    from gnnpipe.report.atomic import HEADER, run_row, section
    from gnnpipe.report.records import Run

    record = {"run_id": "mol-e", "mode": "single", "dataset": "mol", "model": "dimenetpp", "ways": 1,
              "epoch_time_s": 1.0, "comm_bytes_per_epoch": 0, "comm_bytes_predicted": 0, "peak_mem_bytes": 0,
              "energy_mae": 0.5, "force_mae": None, "history": [{"epoch": 0, "loss": 1.0, "val_energy_mae": 0.6}],
              "extra": {"atomic": True, "parameters": 10, "baseline_energy_mae": 1.0, "baseline_force_mae": None,
                        "energy_only": "its data has no forces"}}
    row = dict(zip(HEADER, run_row(Run(record, None, Path(".")))))
    assert row["vs baselines"] == "energy-only run: beats the energy baseline"
    assert row["force MAE (eV/Å)"] == row["zero-force baseline"] == row["force cos"] == "—"
    worse = dict(zip(HEADER, run_row(Run({**record, "energy_mae": 2.0}, None, Path(".")))))
    assert worse["vs baselines"] == "energy-only run: **does not beat the energy baseline**"
    text = section([Run(record, None, Path("."))], tmp_path, str)
    assert "Energy-only training: `mol-e` (its data has no forces): the loss is the energy term alone, " \
           "no force pass ran" in text


@pytest.mark.parametrize("kind", ["dimenetpp", "gemnet_t"])
def test_an_atomic_model_without_lr_trains_at_its_kinds_default_not_training_lr(kind):
    """``training.lr`` (0.01, the node models') is not an atomic model's: a section without ``lr`` gets its
    kind's published default, 1e-3 (DimeNet++ and GemNet alike; the README's example), in run.yaml too."""
    import yaml

    from gnnpipe.config import dump_run_config, load_workflow_config, resolve_runs

    wf = load_workflow_config({"datasets": {"s": {"kind": "atoms"}}, "models": {"m": {"kind": kind}},
                               "training": {"lr": 0.05}, "runs": [{"mode": "single", "dataset": "s", "model": "m"}]})
    cfg = next(iter(resolve_runs(wf).values()))
    assert cfg.model.spec.lr == 1e-3 and cfg.training.lr == 0.05
    assert yaml.safe_load(dump_run_config(cfg))["model"][kind]["lr"] == 1e-3
