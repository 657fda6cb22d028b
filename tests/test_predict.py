"""Predictions: a user's structures to an extxyz as ASE writes results (1 or N workers), errors that
name the row, and the per-system predictions file of evaluate."""

from __future__ import annotations

import numpy as np
import pytest
from ase.build import bulk
from ase.io import read, write
from helpers import tiny_atomic_model

from gnnpipe.ase import GNNPipeCalculator
from gnnpipe.atomic import data
from gnnpipe.atomic.inference import Predictor
from gnnpipe.atomic.is2rs import systems_to_atoms
from gnnpipe.atomic.modelfile import save_model_file
from gnnpipe.atomic.predict import predict, read_predictions, split_predictions, write_predictions
from gnnpipe.io import GnnPipeError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def slabs():
    return data.generate(6, metals=("Cu",), adsorbates=("O", "H"), seed=8, progress=False)


@pytest.fixture(scope="module")
def model_path(slabs, tmp_path_factory):
    return save_model_file(tmp_path_factory.mktemp("model") / "m.pt", tiny_atomic_model(slabs, "dimenetpp").payload())


def _structures(slabs, n):
    cu = bulk("Cu", "fcc", a=3.61, cubic=True)
    cu.rattle(0.03, seed=1)
    return [cu] + systems_to_atoms(slabs, range(min(n - 1, len(slabs["energy"]))))


def test_predict_writes_what_the_calculator_computes(slabs, model_path, tmp_path):
    write(tmp_path / "in.extxyz", _structures(slabs, 4))
    frames = read(tmp_path / "in.extxyz", ":")  # as written (positions to ASE's digits)
    n = predict(model_path, tmp_path / "in.extxyz", tmp_path / "out.extxyz", progress=False)
    out = read(tmp_path / "out.extxyz", ":")
    assert n == len(out) == 4
    calc = GNNPipeCalculator(model_path)
    for got, atoms in zip(out, frames):
        atoms.calc = calc
        assert got.get_potential_energy() == pytest.approx(atoms.get_potential_energy(), abs=1e-6)
        np.testing.assert_allclose(got.get_forces(apply_constraint=False), atoms.get_forces(apply_constraint=False),
                                   atol=1e-6)
        assert np.allclose(got.positions, atoms.positions) and len(got.constraints) == len(atoms.constraints)
    np.testing.assert_allclose(out[0].get_stress(), frames[0].get_stress(), atol=1e-6)  # periodic: stress
    assert "stress" not in out[1].calc.results  # a slab: none


def test_an_ase_database_names_its_rows(slabs, model_path, tmp_path):
    import ase.db
    with ase.db.connect(str(tmp_path / "in.db")) as db:
        for a in _structures(slabs, 3):
            db.write(a)
        bad = bulk("Fe", "bcc", a=2.87, cubic=True)
        db.write(bad)
    with pytest.raises(GnnPipeError, match=r"in.db: row id 4: element\(s\) Fe \(Z=26\) never seen in training; "
                                           r"the model knows H, O, Cu") as e:
        predict(model_path, tmp_path / "in.db", tmp_path / "out.extxyz", progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "out.extxyz").exists()


@pytest.mark.parametrize("case,match", [
    ("empty", "in.extxyz: empty file, holds no structures"),
    ("no_file", r"in.extxyz: no such structure file \(an ASE .db or .extxyz/.xyz\)"),
    ("no_run", "no such run directory or model file"),
    ("garbage", r"in.extxyz: cannot be read as an ASE database or extxyz"),
])
def test_bad_input_is_one_line(model_path, tmp_path, case, match):
    src = tmp_path / "in.extxyz"
    if case == "empty":
        src.write_text("")
    elif case == "garbage":
        src.write_text("3\nnot a comment line = = =\nX 0 0\n")
    elif case == "no_run":
        write(src, bulk("Cu", "fcc", a=3.61))
        model_path = tmp_path / "results" / "runs" / "nope"
    with pytest.raises(GnnPipeError, match=match) as e:
        predict(model_path, src, tmp_path / "out.extxyz", progress=False)
    assert "\n" not in str(e.value)


def test_the_predictions_file_round_trips(slabs, tmp_path):
    mf = tiny_atomic_model(slabs, "dimenetpp")
    graphs = data.build_graphs(slabs, 4.5, 12, progress=False)
    test = np.nonzero(slabs["split"] == 2)[0]
    test = test if len(test) else np.array([0])
    preds = split_predictions(Predictor(mf), slabs, graphs, test)
    write_predictions(tmp_path / "predictions.h5", preds, split="test", run_id="r")
    got = read_predictions(tmp_path / "predictions.h5")
    assert got["split"] == "test" and all(np.array_equal(got[k], preds[k]) for k in preds)
    assert np.array_equal(got["atom_ptr"][-1:], [len(got["z"])]) and got["forces"].shape == (len(got["z"]), 3)


@pytest.mark.slow
def test_predict_with_two_workers_equals_one(slabs, model_path, tmp_path):
    frames = [f for f in _structures(slabs, 6) for _ in range(2)]
    for i, f in enumerate(frames):
        f.positions += np.random.default_rng(i).normal(scale=0.01, size=f.positions.shape)
    write(tmp_path / "in.extxyz", frames)
    for w in (1, 2):
        predict(model_path, tmp_path / "in.extxyz", tmp_path / f"out{w}.extxyz", workers=w, progress=False)
    one, two = read(tmp_path / "out1.extxyz", ":"), read(tmp_path / "out2.extxyz", ":")
    for a, b in zip(one, two):
        assert a.get_potential_energy() == pytest.approx(b.get_potential_energy(), abs=1e-10)
        np.testing.assert_allclose(a.get_forces(), b.get_forces(), atol=2e-8)  # extxyz: 8 decimals


@pytest.mark.slow
def test_the_calculator_on_two_workers_reproduces_the_predictions_file(slabs, model_path, tmp_path):
    """What a consumer does with predictions.h5: rebuild each system from it and compare."""
    from gnnpipe.atomic.modelfile import load_model_file
    mf = load_model_file(model_path)
    preds = split_predictions(Predictor(mf), slabs, data.build_graphs(slabs, 4.5, 12, progress=False),
                              np.arange(len(slabs["energy"])))
    write_predictions(tmp_path / "predictions.h5", preds)
    got = read_predictions(tmp_path / "predictions.h5")
    with GNNPipeCalculator.from_run(model_path, workers=2) as calc:
        for s, atoms in enumerate(systems_to_atoms(got, range(len(got["system"])))):
            atoms.calc = calc
            lo, hi = got["atom_ptr"][s], got["atom_ptr"][s + 1]
            assert atoms.get_potential_energy() == pytest.approx(got["energy"][s], abs=1e-10)
            np.testing.assert_allclose(atoms.get_forces(apply_constraint=False), got["forces"][lo:hi], atol=1e-10)
