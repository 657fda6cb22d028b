"""A run the trainer finished is usable as it is: its model.pt carries the inference payload, evaluate
writes the test split's predictions, the calculator (1 and 2 workers) equals them, `gnnpipe predict`
computes a user's structures, and `gnnpipe relax` scores IS2RS into relax.json and MLflow."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch
from ase.build import bulk
from ase.io import read, write

from gnnpipe import cli
from gnnpipe.ase import GNNPipeCalculator
from gnnpipe.atomic import data
from gnnpipe.atomic.is2rs import NO_REFERENCE, relax_run, sample_systems, systems_to_atoms
from gnnpipe.atomic.modelfile import PAYLOAD_KEY, load_model_file
from gnnpipe.atomic.predict import read_predictions
from gnnpipe.config import load_workflow_config, resolve_runs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A GemNet-T run trained 1 epoch in float64 on 12 generated slabs, then evaluated."""
    from gnnpipe import train
    from gnnpipe.evaluate import evaluate_run

    d = tmp_path_factory.mktemp("trained")
    s = data.generate(12, size=(2, 2, 2), metals=("Cu", "Pt"), adsorbates=("O", "H"), seed=3,
                      train_fraction=0.6, val_fraction=0.1, progress=False)
    digest = data.write_systems(d / "systems.h5", s)
    data.write_graphs(d / "graphs.h5", data.build_graphs(s, 4.0, 8, progress=False), 4.0, 8, digest)
    wf = load_workflow_config({
        "results": str(d / "results"), "datasets": {"slabs": {"kind": "atoms", "atoms": {"cutoff": 4.0}}},
        "models": {"gem": {"kind": "gemnet_t", "gemnet_t": {"preset": "small", "num_blocks": 1, "batch_size": 4}}},
        "training": {"epochs": 1, "eval_every": 1, "checkpoint_every": 0, "dtype": "float64"},
        "runs": [{"mode": "single", "dataset": "slabs", "model": "gem"}]})
    cfg, = resolve_runs(wf).values()
    cfg = dataclasses.replace(cfg, systems_path=str(d / "systems.h5"), graph_path=str(d / "graphs.h5"))
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{d / 'mlflow.db'}")
    train.run(cfg, progress=False)
    evaluate_run(cfg)
    yield cfg, s
    mp.undo()


def test_the_finished_model_carries_its_payload_and_equals_evaluates_predictions(run):
    cfg, systems = run
    state = torch.load(f"{cfg.out_dir}/model.pt", weights_only=True)
    assert state[PAYLOAD_KEY]["run_id"] == cfg.run_id
    assert state[PAYLOAD_KEY]["fingerprint"]["config_hash"] == state["config_hash"]
    for k, w in state["model"].items():  # the weights are stored once: the payload's are the checkpoint's
        assert state[PAYLOAD_KEY]["state_dict"][k].untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    mf = load_model_file(cfg.out_dir)  # the run directory as it is: no upgrade step
    assert mf.kind == "gemnet_t" and mf.dtype == "float64" and mf.cutoff == 4.0 and mf.max_neighbors == 8
    assert set(mf.elements) == {1, 8, 29, 78}
    preds = read_predictions(f"{cfg.out_dir}/predictions.h5")
    test = np.nonzero(systems["split"] == 2)[0]
    assert preds["split"] == "test" and np.array_equal(preds["system"], test) and len(test) >= 1
    np.testing.assert_array_equal(preds["energy_ref"], systems["energy"][test])
    structures = systems_to_atoms(systems, test)
    for workers in (1, 2):
        with GNNPipeCalculator.from_run(cfg.out_dir, workers=workers) as calc:
            for k, atoms in enumerate(structures):
                atoms.calc = calc
                a0, a1 = preds["atom_ptr"][k], preds["atom_ptr"][k + 1]
                assert atoms.get_potential_energy() == pytest.approx(preds["energy"][k], abs=1e-10, rel=0)
                np.testing.assert_allclose(atoms.get_forces(apply_constraint=False), preds["forces"][a0:a1],
                                           atol=1e-10, rtol=0)


def test_predict_cli_on_20_structures_two_workers_equal_one(run, tmp_path, capsys):
    cfg, systems = run
    structures = systems_to_atoms(systems, np.nonzero(systems["split"] == 0)[0])  # elements seen in training
    cu = bulk("Cu", "fcc", a=3.61, cubic=True) * (2, 1, 1)
    for seed in range(20 - len(structures)):  # periodic cells: stress too
        c = cu.copy()
        c.rattle(0.04, seed=seed)
        structures.append(c)
    write(tmp_path / "in.extxyz", structures)
    for w in (1, 2):
        assert cli.main(["predict", "--run", cfg.out_dir, "--structures", str(tmp_path / "in.extxyz"),
                         "--out", str(tmp_path / f"out{w}.extxyz"), "--workers", str(w)]) == 0
    assert "20 structures predicted" in capsys.readouterr().err
    one, two = read(tmp_path / "out1.extxyz", ":"), read(tmp_path / "out2.extxyz", ":")
    assert len(one) == len(two) == 20
    for a, b in zip(one, two):
        assert a.get_potential_energy() == pytest.approx(b.get_potential_energy(), abs=1e-9)
        np.testing.assert_allclose(a.get_forces(apply_constraint=False), b.get_forces(apply_constraint=False),
                                   atol=1e-9)
    np.testing.assert_allclose(one[-1].get_stress(), two[-1].get_stress(), atol=1e-9)


def _one_error_line(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("gnnpipe: error: "), err
    return err


def test_predict_cli_bad_input_is_one_line_each(run, tmp_path, capsys):
    cfg, systems = run
    good = systems_to_atoms(systems, [0])[0]
    gold = bulk("Au", "fcc", a=4.08)  # an element the model never saw, in the second frame
    write(tmp_path / "gold.extxyz", [good, gold])
    (tmp_path / "empty.extxyz").write_text("")
    base = ["predict", "--out", str(tmp_path / "out.extxyz")]
    err = _one_error_line(capsys, base + ["--run", cfg.out_dir, "--structures", str(tmp_path / "gold.extxyz")])
    assert "gold.extxyz: frame 1:" in err and "Au" in err
    err = _one_error_line(capsys, base + ["--run", cfg.out_dir, "--structures", str(tmp_path / "empty.extxyz")])
    assert "empty.extxyz: empty file" in err
    err = _one_error_line(capsys, base + ["--run", str(tmp_path / "no-such-run"),
                                          "--structures", str(tmp_path / "gold.extxyz")])
    assert "no-such-run: no such run directory or model file" in err
    assert not (tmp_path / "out.extxyz").exists()


def test_relax_run_scores_is2rs_into_relax_json_and_mlflow(run, tmp_path):
    cfg, _ = run
    out = relax_run(cfg, systems=2, fmax=0.05, steps=4, seed=1, reference="emt", out=tmp_path / "relax.json",
                    trajectories=tmp_path / "traj", progress=False)
    written = json.loads((tmp_path / "relax.json").read_text())
    assert written["reference"] == "EMT" and written["systems"] == 2 and written["run_id"] == cfg.run_id
    for key in ("adwt", "fbt", "afbt", "energy_mae", "ml_steps_mean", "ref_steps_mean"):
        assert 0 <= written[key] == pytest.approx(out[key]), key
    assert all(1 <= r["ml_steps"] <= 4 for r in written["per_system"])
    assert sorted(p.name for p in (tmp_path / "traj").iterdir()) == ["0-ml.traj", "0-ref.traj", "1-ml.traj",
                                                                     "1-ref.traj"]
    assert len(read(tmp_path / "traj" / "0-ml.traj", ":")) == written["per_system"][0]["ml_steps"] + 1
    import mlflow
    record = json.loads(open(f"{cfg.out_dir}/metrics.json").read())
    from gnnpipe.tracking import tracking_uri
    client = mlflow.tracking.MlflowClient(tracking_uri=tracking_uri(cfg))  # not mlflow's global (other tests set it)
    logged = client.get_run(record["mlflow_run_id"]).data.metrics
    assert logged["relax/adwt"] == pytest.approx(out["adwt"]) and "relax/afbt" in logged
    assert "mlflow_error" not in written


def test_relax_run_without_a_reference_says_so(run, tmp_path):
    cfg, _ = run
    out = relax_run(cfg, systems=1, fmax=0.05, steps=2, reference="none", out=tmp_path / "relax.json",
                    trajectories=tmp_path / "traj", progress=False)
    assert out["reference"] is None and out["note"] == NO_REFERENCE and "adwt" not in out
    assert out["per_system"][0]["ml_steps"] <= 2 and "ref_energy" not in out["per_system"][0]
    assert [p.name for p in (tmp_path / "traj").iterdir()] == ["0-ml.traj"]


@pytest.mark.parametrize("unseen", [(78,), (29, 78)])
def test_relax_run_skips_test_systems_with_unseen_elements_and_says_when_none_is_left(run, tmp_path, monkeypatch,
                                                                                       unseen):
    """A test system with an element no training system had cannot be computed: it is skipped and
    listed; when none is left, relax.json says so (the workflow goes on) and the report shows the row."""
    from gnnpipe.atomic import modelfile
    from gnnpipe.report.records import Run

    cfg, systems = run
    real = modelfile.load_model_file

    def fewer_elements(path, run=None):
        mf = real(path, run)
        return dataclasses.replace(mf, elements=tuple(z for z in mf.elements if z not in unseen))
    monkeypatch.setattr("gnnpipe.atomic.calculator.load_model_file", fewer_elements)
    out = relax_run(cfg, systems=4, fmax=0.05, steps=2, reference="emt", out=tmp_path / "relax.json",
                    trajectories=tmp_path / "traj", progress=False)
    test, ptr = np.nonzero(systems["split"] == 2)[0], systems["atom_ptr"]
    skipped = [int(s) for s in test if set(systems["z"][ptr[s]:ptr[s + 1]].tolist()) & set(unseen)]
    assert out["skipped_unseen_elements"] == skipped and skipped
    left = [s for s in test if s not in skipped]
    assert [r["name"] for r in out["per_system"]] == [str(s) for s in sample_systems(left, systems, 4, 0)]
    if len(skipped) == len(test):  # none left: said, not raised; the report's row and plot cope
        from gnnpipe.report.atomic import is2rs_section
        assert out["systems"] == 0 and "none relaxed" in out["note"] and out["ml_steps_mean"] is None
        record = {"run_id": cfg.run_id, "mode": "single", "dataset": "slabs", "model": "gemnet_t", "ways": 1}
        md = "\n".join(is2rs_section([Run(record, None, tmp_path, out)], tmp_path, str))
        assert "none relaxed" in md and (tmp_path / "is2rs_slabs.png").is_file()


def test_relax_cli_bad_input_is_one_line(run, tmp_path, capsys):
    cfg, _ = run
    run_yaml = tmp_path / "run.yaml"
    from gnnpipe.config import dump_run_config
    run_yaml.write_text(dump_run_config(cfg))
    err = _one_error_line(capsys, ["relax", "--run-config", str(run_yaml), "--systems", "0"])
    assert "relax: systems must be >= 1, got 0" in err
    unfinished = dataclasses.replace(cfg, out_dir=str(tmp_path / "unfinished"))
    (tmp_path / "unfinished").mkdir()
    run_yaml.write_text(dump_run_config(unfinished))
    err = _one_error_line(capsys, ["relax", "--run-config", str(run_yaml)])
    assert "unfinished: no model.pt in this run directory" in err


def test_evaluate_scores_the_training_split_on_a_bounded_seeded_sample_and_says_so(run, tmp_path, capsys):
    """#37 item 20: evaluation scores a seeded sample of at most ``eval_train_systems`` training systems
    (here ``--train-systems 2`` of 7), the same every time, val and test whole; eval.json records how many and
    the command says so; ``--train-systems all`` (or a split no larger than the bound: the default 500 here)
    scores every one."""
    from gnnpipe.atomic.atomic_engine import AtomicEngine

    cfg, _ = run
    with open(f"{cfg.out_dir}/eval.json") as f:
        whole = json.load(f)  # the fixture's evaluation: the default bound, above the 7 training systems
    from gnnpipe.config import dump_run_config
    (tmp_path / "run.yaml").write_text(dump_run_config(cfg))
    base = ["evaluate", "--run-config", str(tmp_path / "run.yaml"), "--predictions", str(tmp_path / "p.h5")]
    assert cli.main([*base, "--out", str(tmp_path / "two.json"), "--train-systems", "2"]) == 0
    assert "train_* scored on a seeded sample of 2 of the 7 training systems" in capsys.readouterr().err
    two = json.loads((tmp_path / "two.json").read_text())
    assert (two["train_systems_scored"], two["train_systems"]) == (2, 7) == (2, whole["train_systems"])
    assert whole["train_systems_scored"] == 7 and two["train_energy_mae"] != whole["train_energy_mae"]
    assert all(two[f"{s}_{k}"] == whole[f"{s}_{k}"] for s in ("val", "test") for k in ("energy_mae", "force_mae"))
    assert cli.main([*base, "--out", str(tmp_path / "all.json"), "--train-systems", "all"]) == 0
    assert json.loads((tmp_path / "all.json").read_text())["train_energy_mae"] == whole["train_energy_mae"]
    # the sample is what is scored: the same metrics as an engine whose training split is that sample
    eng = AtomicEngine(cfg, None, None, torch.device("cpu"))
    eng.model.load_state_dict(torch.load(f"{cfg.out_dir}/model.pt", weights_only=True)["model"])
    eng.eval_train_systems = 2
    sample = eng.eval_ids("train")
    assert len(sample) == 2 and set(sample) <= set(eng.ids["train"]) and list(eng.eval_ids("train")) == list(sample)
    eng.ids["train"], eng.eval_train_systems = sample, None
    assert eng.evaluate()["train_energy_mae"] == pytest.approx(two["train_energy_mae"], rel=1e-12)


def test_a_model_pt_of_another_run_is_refused_by_every_consumer_naming_both(run, tmp_path, capsys):
    """Run A's model.pt copied into run B's folder (issue #37 item 2): relax, predict --run, the calculator's
    from_run and evaluate refuse it in one line naming both runs; before, relax and predict used A's model
    under B's name and evaluate blamed the epochs ("checkpoint after 1 of 30 epochs")."""
    import shutil

    from gnnpipe.config import dump_run_config
    from gnnpipe.evaluate import evaluate_run
    from gnnpipe.io import GnnPipeError

    cfg, systems = run
    other = tmp_path / "other-run"
    other.mkdir()
    b = dataclasses.replace(cfg, run_id="other-run", out_dir=str(other),
                            training=dataclasses.replace(cfg.training, epochs=30))
    (other / "run.yaml").write_text(dump_run_config(b))
    shutil.copy(f"{cfg.out_dir}/model.pt", other / "model.pt")
    write(tmp_path / "in.extxyz", systems_to_atoms(systems, [0]))
    both = rf"the model of run {cfg.run_id} \(gemnet_t\), not of run other-run \(gemnet_t\) that it was asked for"
    for argv in (["relax", "--run-config", str(other / "run.yaml"), "--systems", "1", "--steps", "1"],
                 ["predict", "--run", str(other), "--structures", str(tmp_path / "in.extxyz"),
                  "--out", str(tmp_path / "out.extxyz")]):
        assert re.search(both, _one_error_line(capsys, argv))
    with pytest.raises(GnnPipeError, match=both):
        GNNPipeCalculator.from_run(other)
    with pytest.raises(GnnPipeError, match=both) as e:
        evaluate_run(b)
    assert "\n" not in str(e.value) and "epochs" not in str(e.value)
    assert not (other / "relax.json").exists() and not (tmp_path / "out.extxyz").exists()
    # the same run id trained from another config: the keys that differ are named
    (other / "run.yaml").write_text(dump_run_config(dataclasses.replace(
        cfg, out_dir=str(other), training=dataclasses.replace(cfg.training, lr=0.5))))
    with pytest.raises(GnnPipeError, match=r"trained from another config: training.lr 0.01 -> 0.5 \(run "):
        GNNPipeCalculator.from_run(other)
    # the run's own model.pt beside its run.yaml loads
    (other / "run.yaml").write_text(dump_run_config(dataclasses.replace(cfg, out_dir=str(other))))
    assert GNNPipeCalculator.from_run(other).model_file.run_id == cfg.run_id
