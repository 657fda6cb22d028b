"""Predictions: a user's structures to an extxyz as ASE writes results (1 or N workers), errors that
name the row, and the per-system predictions file of evaluate."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
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
    done = predict(model_path, tmp_path / "in.extxyz", tmp_path / "out.extxyz", progress=False)
    out = read(tmp_path / "out.extxyz", ":")
    assert done.count == len(out) == 4 and done.layouts == {"one process": 4} and done.rebuilds == 0
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


def _impossible(case):
    """A structure ``gnnpipe data`` refuses (issue #37 item 5), as a user's file holds it."""
    cu = bulk("Cu", "fcc", a=3.61, cubic=True)
    if case == "nan_position":
        cu.positions[2, 1] = np.nan
    elif case == "zero_cell":
        cu.cell[:] = 0.0  # pbc stays True
    elif case == "tiny_cell":
        cu = bulk("Cu", "sc", a=0.1)
    elif case in ("close", "coincident"):
        cu.positions[1] = cu.positions[0] + [1e-6 if case == "close" else 0.0, 0.0, 0.0]
    return cu


IMPOSSIBLE = {"nan_position": r"atom 2 \(Cu\) has a non-finite position",
              "zero_cell": r"periodic along axis 0 but the cell's height along it is 0 Å",
              "tiny_cell": r"periodic along axis 0 but the cell's height along it is 0.1 Å",
              "close": r"atom 0 \(Cu\) and atom 1 \(Cu\) are 1e-06 Å apart",
              "coincident": r"atom 0 \(Cu\) and atom 1 \(Cu\) are 0 Å apart"}


@pytest.mark.parametrize("case", IMPOSSIBLE)
def test_impossible_structures_are_refused_in_one_line_by_predict_and_the_calculator(model_path, tmp_path, case,
                                                                                       capsys):
    """What `gnnpipe data` refuses is refused at inference too: predict names the file and frame before any
    is computed (before: a traceback from the neighbour list, or an energy without a word); the calculator
    raises ASE's InputError with the same line."""
    from ase.calculators.calculator import InputError

    from gnnpipe import cli
    from gnnpipe.ase import StructureRefused

    write(tmp_path / "in.extxyz", [bulk("Cu", "fcc", a=3.61), _impossible(case)])
    assert cli.main(["predict", "--run", str(model_path), "--structures", str(tmp_path / "in.extxyz"),
                     "--out", str(tmp_path / "out.extxyz")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("gnnpipe: error: "), err
    assert "in.extxyz: frame 1: " in err and re.search(IMPOSSIBLE[case], err), err
    assert not (tmp_path / "out.extxyz").exists()
    atoms = _impossible(case)
    atoms.calc = GNNPipeCalculator(model_path)
    with pytest.raises(StructureRefused, match=IMPOSSIBLE[case]) as e:
        atoms.get_potential_energy()
    assert isinstance(e.value, InputError) and isinstance(e.value, GnnPipeError)
    assert "\n" not in str(e.value) and str(e.value).startswith("Cu")


def test_threads_per_worker_are_chosen_recorded_and_used(model_path, monkeypatch):
    """workers=1 computes on the threads chosen as training's workers take them (OMP_NUM_THREADS, else the
    cores shared out), for the call only, and says how many (issue #37 item 7: torch's default before)."""
    from gnnpipe.atomic import inference

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(inference, "cpu_cores", lambda: 8)
    torch.set_num_threads(8)  # the one_thread fixture restores the process's own
    assert inference.threads_per_worker(1) == 8 and inference.threads_per_worker(3) == 2
    torch.set_num_threads(1)  # a caller's choice holds
    assert inference.threads_per_worker(1) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert inference.threads_per_worker(1) == 3 and inference.threads_per_worker(1, 2) == 2
    calc = GNNPipeCalculator(model_path, threads=2)
    seen, forward = [], calc.predictor.model.forward
    monkeypatch.setattr(calc.predictor.model, "forward", lambda g: seen.append(torch.get_num_threads()) or forward(g))
    before = torch.get_num_threads()
    atoms = bulk("Cu", "fcc", a=3.61)
    atoms.calc = calc
    atoms.get_potential_energy()
    assert seen == [2] and torch.get_num_threads() == before and calc.threads == 2
    assert "threads=2" in repr(calc)
    with pytest.raises(GnnPipeError, match="threads must be an integer >= 1"):
        GNNPipeCalculator(model_path, threads=0)


def test_more_workers_than_cores_are_refused_before_any_starts(model_path, tmp_path, capsys):
    """`--workers 100000` spawned workers until the memory cap killed them (issue #37 item 4)."""
    from gnnpipe import cli
    from gnnpipe.atomic.inference import cpu_cores

    write(tmp_path / "in.extxyz", bulk("Cu", "fcc", a=3.61))
    assert cli.main(["predict", "--run", str(model_path), "--structures", str(tmp_path / "in.extxyz"),
                     "--out", str(tmp_path / "out.extxyz"), "--workers", "100000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"gnnpipe: error: workers 100000: more than the {cpu_cores()} CPU cores this process may use; "
                   f"use at most {cpu_cores()} (each worker is a process), or oversubscribe=True (Predictor, "
                   f"GNNPipeCalculator) to time-share them, up to 4 per core")
    with pytest.raises(GnnPipeError, match="more than the"):
        GNNPipeCalculator(model_path, workers=cpu_cores() + 1)


@pytest.mark.slow
def test_a_script_without_the_main_guard_is_told_so_in_one_line(model_path, tmp_path):
    """Workers re-import the main script; one without `if __name__ == "__main__":` starts workers again
    there (issue #37 item 8: multiprocessing's RuntimeError and BrokenPipeError tracebacks before)."""
    script = tmp_path / "noguard.py"
    script.write_text("from ase.build import bulk\nfrom gnnpipe.ase import GNNPipeCalculator\n"
                      "atoms = bulk('Cu', 'fcc', a=3.61, cubic=True)\n"
                      f"atoms.calc = GNNPipeCalculator({str(model_path)!r}, workers=2)\n"
                      "print(atoms.get_potential_energy())\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last == (f"gnnpipe.io.GnnPipeError: inference workers cannot start: {script} starts them when it is "
                    "imported, and each worker imports it again; put the script's code under "
                    "'if __name__ == \"__main__\":' (Python's multiprocessing needs it); the other workers were "
                    "stopped"), out.stderr
    assert "RuntimeError" not in out.stderr and "BrokenPipeError" not in out.stderr
    assert out.stderr.count("Traceback") == 1, out.stderr  # the script's own, ending in that line


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


def test_predict_layout_choices_are_the_predictors():
    """``gnnpipe predict --layout``'s help lists, without importing torch, what the Predictor takes."""
    from gnnpipe import cli
    from gnnpipe.atomic.atom_layouts import PREDICT_LAYOUTS
    from gnnpipe.atomic.inference import DEFAULT_SKIN

    assert cli.PREDICT_LAYOUT_CHOICES.split(", ") == ["auto", *PREDICT_LAYOUTS.names()]
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["predict"].format_help()
    assert f"(default {DEFAULT_SKIN})" in " ".join(help_text.split())


def test_predict_in_the_domains_layout_records_its_layout_and_rebuilds(slabs, model_path, tmp_path, capsys):
    """A trajectory of one cell through `gnnpipe predict --workers 2 --layout domains`: the same numbers as one
    worker, each frame's layout and the skin rule's rebuilds so far in its info, their sums in --stats."""
    import json

    from gnnpipe import cli

    uncapped = save_model_file(tmp_path / "uncapped.pt", tiny_atomic_model(slabs, "dimenetpp", max_neighbors=None)
                               .payload())
    cell = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((2, 2, 2))
    cell.rattle(0.05, seed=3)
    frames = []
    for shift in (0.0, 0.1, 0.2, 0.6):  # the skin of 1 Å: rebuilt once an atom moved 0.5 Å, at the last frame
        f = cell.copy()
        f.positions[0] += shift
        frames.append(f)
    write(tmp_path / "traj.extxyz", frames)
    args = ["predict", "--run", str(uncapped), "--structures", str(tmp_path / "traj.extxyz"), "--skin", "1.0"]
    assert cli.main(args + ["--out", str(tmp_path / "one.extxyz")]) in (None, 0)
    assert cli.main(args + ["--out", str(tmp_path / "two.extxyz"), "--workers", "2", "--layout", "domains",
                            "--stats", str(tmp_path / "stats.json")]) in (None, 0)
    assert "layout: domains 4; rebuilds: 2" in capsys.readouterr().err
    one, two = read(tmp_path / "one.extxyz", ":"), read(tmp_path / "two.extxyz", ":")
    assert [f.info["layout"] for f in one] == ["one process"] * 4 and [f.info["rebuilds"] for f in one] == [0] * 4
    assert [f.info["layout"] for f in two] == ["domains"] * 4 and [f.info["rebuilds"] for f in two] == [1, 1, 1, 2]
    for a, b in zip(one, two):
        assert a.get_potential_energy() == pytest.approx(b.get_potential_energy(), abs=1e-10)
        np.testing.assert_allclose(a.get_forces(), b.get_forces(), atol=2e-8)  # extxyz: 8 decimals
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert (stats["layouts"], stats["rebuilds"], stats["workers"], stats["layout_asked"]) == ({"domains": 4}, 2, 2,
                                                                                              "domains")
    # the calls' ledger, by op: the two rebuilds' Domains held, every call's positions, build, halo and replies
    from gnnpipe.atomic.atom_layouts import DOMAINS
    parts = DOMAINS.ledger_parts(stats["bytes"])
    assert all(parts[k] > 0 for k in DOMAINS.CALL_PARTS), parts
    assert parts["replies"] == 4 * (2 * (8 + 72) + 24 * len(cell))  # energy, stress part and own forces, 4 calls
    assert cli.main(args + ["--out", str(tmp_path / "bad.extxyz"), "--workers", "2", "--layout", "metis"]) == 2
    assert capsys.readouterr().err.strip() == "gnnpipe: error: layout 'metis': one of auto, edges, atoms, domains"
