"""IS2RS: the metrics on hand-made cases with known answers (and against a transcription of
fairchem's evaluator), the rattle, relaxations through ASE, and the whole evaluation."""

from __future__ import annotations

import numpy as np
import pytest
from ase.calculators.emt import EMT
from helpers import tiny_atomic_model

from gnnpipe.atomic import data
from gnnpipe.atomic.is2rs import (ADWT_THRESHOLDS, AFBT_THRESHOLDS, adwt, afbt, fbt, free_mask, mean_distances,
                                  rattle, relax, relax_systems, systems_to_atoms, threshold_curve)
from gnnpipe.io import GnnPipeError

pytestmark = pytest.mark.usefixtures("one_thread")
CELL = np.diag([3.0, 4.0, 20.0])


def _below(value: float, thresholds) -> int:
    """How many thresholds t = 0.01 + 0.001 k the value is strictly below (values chosen off the grid)."""
    return int(sum(value < t for t in thresholds))


def test_threshold_grids_are_ocs():
    assert len(ADWT_THRESHOLDS) == 490 and ADWT_THRESHOLDS[0] == 0.01 and ADWT_THRESHOLDS[-1] == pytest.approx(0.499)
    assert len(AFBT_THRESHOLDS) == 390 and AFBT_THRESHOLDS[-1] == pytest.approx(0.399)


def test_adwt_on_hand_made_systems():
    """Three systems: free-atom mean distances 0.0305 Å, 0.0125 Å (across the periodic boundary;
    a fixed atom far off is ignored), 0.6 Å (beyond every threshold)."""
    ref = [np.zeros((2, 3)), np.array([[0.005, 1.0, 5.0], [1.0, 1.0, 1.0]]), np.zeros((1, 3))]
    pred = [np.array([[0.021, 0.0, 0.0], [0.0, -0.04, 0.0]]),  # 0.021 and 0.04: mean 0.0305
            np.array([[2.9925, 1.0, 5.0], [2.0, 2.0, 2.0]]),  # x: 2.9925 - 0.005 = 3 - 0.0125 -> wraps to 0.0125
            np.array([[0.0, 0.0, 0.6]])]  # z is not periodic: 0.6
    pbc = [(True, True, False)] * 3
    free = [np.array([True, True]), np.array([True, False]), np.array([True])]
    d = mean_distances(pred, ref, [CELL] * 3, pbc, free)
    np.testing.assert_allclose(d, [0.0305, 0.0125, 0.6], atol=1e-12)
    want = (_below(0.0305, ADWT_THRESHOLDS) + _below(0.0125, ADWT_THRESHOLDS)) / (3 * 490)
    assert (_below(0.0305, ADWT_THRESHOLDS), _below(0.0125, ADWT_THRESHOLDS)) == (469, 487)
    assert adwt(pred, ref, [CELL] * 3, pbc, free) == pytest.approx(want, abs=1e-15)
    assert adwt([np.zeros((1, 3))], [np.zeros((1, 3))], [CELL], [(True, True, True)]) == 1.0
    with pytest.raises(GnnPipeError, match="no systems"):
        adwt([], [], [], [])


def _fairchem_adwt(pred: list, target: list, cells: list) -> float:
    """fairchem-core 1.9.0 modules/evaluator.py: average_distance_within_threshold and min_diff,
    transcribed to NumPy (pbc = [True, True, True], as its run_relaxations passes)."""
    mean_distance = []
    for ml_pos, dft_pos, cell in zip(pred, target, cells):
        pos_diff = ml_pos - dft_pos
        fractional = np.linalg.solve(cell.T, pos_diff.T).T
        for i in range(3):
            fractional[:, i] %= 1.0
            fractional[:, i] %= 1.0
        fractional[fractional > 0.5] -= 1
        mean_distance.append(np.mean(np.linalg.norm(np.matmul(fractional, cell), axis=1)))
    success = 0
    intv = np.arange(0.01, 0.5, 0.001)
    for i in intv:
        success += sum(np.array(mean_distance) < i)
    return success / (len(mean_distance) * len(intv))


def test_adwt_equals_fairchems_on_random_skewed_cells():
    rng = np.random.default_rng(0)
    cells = [np.array([[3.0, 0, 0], [1.2, 2.8, 0], [0.3, 0.2, 9.0]]) * rng.uniform(0.9, 1.1) for _ in range(20)]
    ref = [rng.uniform(0, 1, (5, 3)) @ c for c in cells]
    pred = [r + rng.normal(scale=rng.uniform(0.01, 0.4), size=r.shape) + rng.integers(-1, 2, (5, 1)) * c[0]
            for r, c in zip(ref, cells)]
    assert adwt(pred, ref, cells, [(True, True, True)] * 20) == pytest.approx(_fairchem_adwt(pred, ref, cells),
                                                                               abs=1e-15)


def test_fbt_and_afbt_on_hand_made_structures():
    """Largest per-atom force *norm* over free atoms: 0.0305 (a fixed atom's 5 eV/Å ignored), 0.0605,
    and sqrt(3)·0.03 = 0.052 (every component 0.03: below 0.05 by component, not by norm)."""
    forces = [np.array([[0.0305, 0, 0], [0, 0.01, 0], [5.0, 0, 0]]),
              np.array([[0, 0, 0.0605]]),
              np.array([[0.03, 0.03, 0.03], [0.0, 0.0, 0.0]])]
    free = [np.array([True, True, False]), np.array([True]), np.array([True, True])]
    assert fbt(forces, free) == pytest.approx(1 / 3)
    assert fbt(forces, free, threshold=0.07) == pytest.approx(1.0)
    assert fbt(forces) == pytest.approx(0.0)  # the fixed atom counted: 5 eV/Å
    counts = [_below(v, AFBT_THRESHOLDS) for v in (0.0305, 0.0605, np.sqrt(3) * 0.03)]
    assert counts == [369, 339, 348]
    assert afbt(forces, free) == pytest.approx(sum(counts) / (3 * 390), abs=1e-15)
    curve = threshold_curve([0.0305, 0.0605, np.sqrt(3) * 0.03], AFBT_THRESHOLDS)  # what the report plots
    assert curve.shape == (390,) and curve[0] == 0 and curve[-1] == 1 and np.all(np.diff(curve) >= 0)
    assert curve.mean() == pytest.approx(afbt(forces, free), abs=1e-15)


@pytest.fixture(scope="module")
def slabs():
    return data.generate(4, metals=("Cu", "Pt"), adsorbates=("O", "H"), seed=6, progress=False)


def test_rattle_is_seeded_and_moves_free_atoms_only(slabs):
    atoms = systems_to_atoms(slabs, [0])[0]
    free = free_mask(atoms)
    assert 0 < free.sum() < len(atoms) and np.array_equal(~free, slabs["fixed"][:len(atoms)])
    a, b, c = rattle(atoms, [0, 1], 0.05), rattle(atoms, [0, 1], 0.05), rattle(atoms, [0, 2], 0.05)
    assert np.array_equal(a.positions, b.positions) and not np.allclose(a.positions, c.positions)
    assert np.array_equal(a.positions[~free], atoms.positions[~free])
    assert 0.02 < np.std(a.positions[free] - atoms.positions[free]) < 0.08
    assert a.constraints and np.array_equal(atoms.positions, systems_to_atoms(slabs, [0])[0].positions)


@pytest.mark.parametrize("optimizer", ["lbfgs", "fire"])
def test_relax_converges_through_ase_and_writes_its_trajectory(slabs, tmp_path, optimizer):
    from ase.io import read
    atoms = rattle(systems_to_atoms(slabs, [1])[0], 3, 0.05)
    r = relax(atoms, EMT(), optimizer, fmax=0.05, steps=200, trajectory=tmp_path / "t.traj")
    assert r.converged and 0 < r.steps < 200 and r.fmax <= 0.05
    frames = read(tmp_path / "t.traj", ":")
    assert len(frames) == r.steps + 1 and frames[-1].get_potential_energy() == pytest.approx(r.energy)
    assert r.energy < EMT().get_potential_energy(atoms)
    assert np.array_equal(r.atoms.positions[~free_mask(atoms)], atoms.positions[~free_mask(atoms)])
    short = relax(atoms, EMT(), optimizer, fmax=1e-6, steps=3)
    assert not short.converged and short.steps == 3
    with pytest.raises(GnnPipeError, match="unknown optimizer 'bfgs'; known: lbfgs, fire"):
        relax(atoms, EMT(), "bfgs")


def test_relax_systems_with_the_reference_as_the_model_scores_perfectly(slabs, tmp_path):
    """EMT relaxing against EMT: the same path, so ADwT = 1, energy MAE = 0, FbT = 1."""
    out = relax_systems(systems_to_atoms(slabs, [0, 1]), EMT(), EMT, fmax=0.03, steps=100, seed=1,
                        trajectories=tmp_path / "traj", names=["a", "b"])
    assert (out["adwt"], out["energy_mae"], out["fbt"], out["ml_converged"]) == (1.0, 0.0, 1.0, 1.0)
    assert out["afbt"] > 0.9 and out["systems"] == 2 and out["ml_steps_mean"] == out["ref_steps_mean"] > 0
    assert [r["name"] for r in out["per_system"]] == ["a", "b"]
    assert {p.name for p in (tmp_path / "traj").iterdir()} == {"0-ml.traj", "0-ref.traj", "1-ml.traj", "1-ref.traj"}


def test_trajectories_are_checked_first_and_written_atomically(slabs, tmp_path):
    """relax --trajectories onto a file was a traceback; a relaxation that failed half-way left a
    half-written trajectory (issue 37, item 1)."""
    (tmp_path / "file").write_text("")
    with pytest.raises(GnnPipeError, match=rf"^{tmp_path / 'file'}: cannot write there: .* is not a directory"):
        relax_systems(systems_to_atoms(slabs, [0]), EMT(), trajectories=tmp_path / "file")

    class Failing(EMT):  # its fourth computation fails: the relaxation stops after three steps
        calls = 0

        def calculate(self, *args, **kwargs):
            Failing.calls += 1
            if Failing.calls > 3:
                raise RuntimeError("calculator failed")
            super().calculate(*args, **kwargs)

    with pytest.raises(RuntimeError, match="calculator failed"):
        relax_systems(systems_to_atoms(slabs, [0]), Failing(), trajectories=tmp_path / "traj", fmax=1e-6)
    assert Failing.calls == 4 and list((tmp_path / "traj").iterdir()) == []


def test_relax_systems_with_a_model_and_without_a_reference(slabs):
    from gnnpipe.ase import GNNPipeCalculator
    calc = GNNPipeCalculator(tiny_atomic_model(slabs, "dimenetpp"))
    structures = systems_to_atoms(slabs, [2, 3])
    out = relax_systems(structures, calc, EMT, fmax=0.05, steps=5, rattle_stdev=0.03, seed=2)
    assert set(out) >= {"adwt", "fbt", "afbt", "energy_mae", "ml_steps_mean", "ref_steps_mean", "per_system"}
    assert all(0.0 <= out[k] <= 1.0 for k in ("adwt", "fbt", "afbt")) and out["energy_mae"] > 0
    row = out["per_system"][0]
    assert row["ml_steps"] <= 5 and row["formula"] == structures[0].get_chemical_formula()
    assert row["energy_error"] == pytest.approx(row["ml_energy"] - row["ref_energy"])
    ml_only = relax_systems(structures, calc, None, fmax=0.05, steps=2)
    assert "adwt" not in ml_only and ml_only["reference"] is False and len(ml_only["per_system"]) == 2


def test_relaxed_systems_are_a_seeded_sample_across_compositions_and_trajectories():
    """Not "the first N test systems" (issue #37 item 12: all Pd31 on the data it was found on): one system
    of each composition in turn, a trajectory not drawn yet first, seeded."""
    from gnnpipe.atomic.is2rs import sample_systems

    # 10 systems: ids 0-5 Pd3 (trajectories 0, 0, 0, 1, 1, 1), 6-7 Pd2O (trajectory 2), 8-9 Cu3 (trajectory 3)
    z = [[46] * 3] * 6 + [[46, 46, 8]] * 2 + [[29] * 3] * 2
    systems = {"z": np.concatenate(z), "atom_ptr": np.arange(0, 31, 3), "group": np.array([0, 0, 0, 1, 1, 1, 2, 2, 3, 3])}
    ids = np.arange(10)
    for seed in range(5):
        three = sample_systems(ids, systems, 3, seed)
        assert [sum(s in block for s in three) for block in (range(6), range(6, 8), range(8, 10))] == [1, 1, 1]
        six = sample_systems(ids, systems, 6, seed)  # two of each composition
        pd3 = [s for s in six if s < 6]
        assert len(pd3) == 2 and {systems["group"][s] for s in pd3} == {0, 1}  # two trajectories, not one twice
        assert np.array_equal(six, np.sort(six)) and np.array_equal(six, sample_systems(ids, systems, 6, seed))
    assert len({tuple(sample_systems(ids, systems, 3, seed)) for seed in range(8)}) > 1  # the seed draws
    assert np.array_equal(sample_systems(ids, systems, 99, 0), ids) and len(sample_systems(ids[:0], systems, 4, 0)) == 0


def test_the_reference_is_explicit_and_none_by_default_for_a_users_file():
    """`gnnpipe relax` took EMT for any file (issue #37 item 12): by default EMT only for gnnpipe's own
    EMT-generated systems; emt, none or an ASE calculator class module:Class when given."""
    from gnnpipe.atomic.is2rs import reference_calculator

    assert reference_calculator(None, "generated:ase-emt seed=0 frames=3 split=trajectory") == ("EMT", EMT)
    assert reference_calculator(None, "file:dft.extxyz split=random") == (None, None)
    assert reference_calculator("none", "generated:ase-emt seed=0") == (None, None)
    assert reference_calculator("emt", "file:mine.extxyz") == ("EMT", EMT)
    assert reference_calculator("ase.calculators.emt:EMT", "file:x") == ("ase.calculators.emt:EMT", EMT)
    for bad, match in (("dft", "'dft': emt, none or an ASE calculator class as module:Class"),
                       ("no_such_module:Calc", r"'no_such_module:Calc': cannot be imported \(ModuleNotFoundError"),
                       ("ase.calculators.emt:Nope", r"cannot be imported \(AttributeError")):
        with pytest.raises(GnnPipeError, match=match) as e:
            reference_calculator(bad, "file:x")
        assert "\n" not in str(e.value)
