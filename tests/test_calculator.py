"""The ASE calculator (gnnpipe.ase.GNNPipeCalculator) over both atomic kinds: training's graphs,
the batched predictions, forces and stress as energy derivatives, ASE's optimisers / filters / MD
unchanged, and graph-parallel workers (equal to one process; persistent; a dead worker)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk
from ase.calculators.fd import calculate_numerical_stress
from ase.calculators.calculator import PropertyNotImplementedError
from ase.data import atomic_numbers, reference_states
from helpers import tiny_atomic_model

from gnnpipe.ase import GNNPipeCalculator
from gnnpipe.atomic import data
from gnnpipe.atomic import neighbors as nb
from gnnpipe.atomic.inference import Predictor, structure_graph
from gnnpipe.atomic.is2rs import systems_to_atoms
from gnnpipe.atomic.predict import split_predictions
from gnnpipe.io import GnnPipeError

pytestmark = pytest.mark.usefixtures("one_thread")
KINDS = ("dimenetpp", "gemnet_t")


@pytest.fixture(autouse=True)
def _one_blas_thread():
    """ASE's cell filter takes matrix logarithms (scipy, OpenBLAS): on oversubscribed cores a
    3x3 solve on many threads costs milliseconds (FIRE: 4 s instead of 0.4 s)."""
    from threadpoolctl import threadpool_limits
    with threadpool_limits(1):
        yield


@pytest.fixture(scope="module")
def slabs():
    return data.generate(8, seed=2, progress=False)


@pytest.fixture(scope="module")
def models(slabs):
    return {kind: tiny_atomic_model(slabs, kind) for kind in KINDS}


def _bulk(mf, repeat=(1, 1, 1), seed=0):
    """A rattled cubic fcc cell of a metal the model was trained on."""
    metal = next(m for m in data.SLAB_METALS if atomic_numbers[m] in mf.elements)
    a = bulk(metal, "fcc", a=reference_states[atomic_numbers[metal]]["a"], cubic=True) * repeat
    a.rattle(0.05, seed=seed)
    return a


def _symmetric_graphs(systems, cutoff, cap) -> dict:
    """graphs.h5's arrays built with the symmetric neighbour lists (the graphs of symmetric kinds)."""
    ptr, cols, ne, nt = systems["atom_ptr"], {}, [0], [0]
    for s in range(len(ptr) - 1):
        g = nb.system_graph(systems["pos"][ptr[s]:ptr[s + 1]], systems["cell"][s], systems["pbc"][s], cutoff, cap)
        for k in data.GRAPH_ARRAYS[2:]:
            cols.setdefault(k, []).append(g[k])
        ne.append(ne[-1] + len(g["edge_src"]))
        nt.append(nt[-1] + len(g["idx_kj"]))
    return {**{k: np.concatenate(v) for k, v in cols.items()}, "edge_ptr": np.array(ne), "triplet_ptr": np.array(nt)}


# --------------------------------------------------------------------------- one process
def test_the_calculators_graph_is_the_training_graph(slabs, models):
    """graphs.h5's rows of each system (atom_graphs' build path), edge for edge and triplet for
    triplet; the symmetric kinds' graph is neighbors.system_graph."""
    graphs = data.build_graphs(slabs, 4.5, 12, progress=False)
    ap, ep, tp = slabs["atom_ptr"], graphs["edge_ptr"], graphs["triplet_ptr"]
    for s in range(len(ap) - 1):
        args = (slabs["z"][ap[s]:ap[s + 1]], slabs["pos"][ap[s]:ap[s + 1]], slabs["cell"][s], slabs["pbc"][s])
        b = structure_graph(*args, models["dimenetpp"])
        for k, ptr in {"edge_src": ep, "edge_dst": ep, "edge_shift": ep, "idx_kj": tp, "idx_ji": tp}.items():
            assert np.array_equal(b[k], graphs[k][ptr[s]:ptr[s + 1]]), (s, k)
        sym = structure_graph(*args, models["gemnet_t"])
        want = nb.system_graph(*args[1:], 4.5, 12)
        assert all(np.array_equal(sym[k], want[k]) for k in want)


def test_a_fairchem_models_graph_is_fairchems(slabs):
    """A model file of the fairchem convention: GemNet gets fairchem's symmetric graph, a per-target
    model (symmetric_edges false, fairchem's DimeNet++) radius_graph_pbc's edges as they are; where the
    cap binds (Cu bulk, 6 Å / 50) both differ from the project's."""
    import dataclasses

    from ase.build import bulk

    mf = tiny_atomic_model(slabs, "gemnet_t", cutoff=6.0, max_neighbors=50, neighbors="fairchem")
    a = bulk("Cu", "fcc", cubic=True).repeat((2, 2, 2))
    a.rattle(0.05, seed=1)
    args = (a.positions, a.cell.array, a.pbc, 6.0, 50)
    got = structure_graph(a.numbers, *args[:3], mf)
    want = nb.system_graph(*args, "fairchem")
    assert len(got["edge_src"]) == 1588 and all(np.array_equal(got[k], want[k]) for k in want)
    directed = structure_graph(a.numbers, *args[:3], dataclasses.replace(mf, symmetric_edges=False))
    assert "id_swap" not in directed and len(directed["edge_src"]) == 1600
    assert np.array_equal(directed["edge_src"], nb.directed_graph(*args, "fairchem")[0])
    project = structure_graph(a.numbers, *args[:3], dataclasses.replace(mf, neighbors="project"))
    assert len(project["edge_src"]) == 1612


def test_a_fairchem_models_graph_is_built_in_the_calculators_dtype(slabs):
    """fairchem's model builds its graph from positions in its own dtype: the calculator in float64 gets
    fairchem's float64 graph, in float32 its float32 one. Cap 1 on a line of three atoms, the centre
    (2) between atom 0 at +(1 + 1e-9) Å and atom 1 at -1 Å: float32 ties the two (the lower source, 0,
    is nominated and keeps the only edge), float64 nominates the nearer, 1; the atom left out feels no
    force. (The calculator built fairchem's float32 graph in float64 too: 6e-2 off fairchem's float64
    energy on a one-atom Cu cell.)"""
    mf = tiny_atomic_model(slabs, "gemnet_t", cutoff=1.5, max_neighbors=1, neighbors="fairchem")
    z = int(slabs["z"][0])
    atoms = Atoms(numbers=[z] * 3, positions=[[1.0 + 1e-9, 0, 0], [-1.0, 0, 0], [0, 0, 0]], pbc=False)
    for dtype, alone in (("float64", 0), ("float32", 1)):
        a = atoms.copy()
        a.calc = GNNPipeCalculator(mf, dtype=dtype)
        f = a.get_forces()
        assert np.all(f[alone] == 0) and np.abs(f[1 - alone]).max() > 1e-3, dtype


def test_from_file_reads_a_model_file(tmp_path, slabs):
    """``GNNPipeCalculator.from_file``: a model file outside any run directory (import-model's --out)."""
    from gnnpipe.atomic.modelfile import save_model_file

    mf = tiny_atomic_model(slabs, "gemnet_t")
    save_model_file(tmp_path / "model.pt", mf.payload())
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    atoms.rattle(0.05, seed=0)
    atoms.calc = GNNPipeCalculator.from_file(tmp_path / "model.pt")
    want = atoms.copy()
    want.calc = GNNPipeCalculator(mf)
    assert atoms.get_potential_energy() == want.get_potential_energy()


@pytest.mark.parametrize("kind", KINDS)
def test_calculator_equals_the_batched_predictions_of_evaluate(slabs, models, kind):
    """Per system, the calculator (one structure, graph rebuilt from positions) = the batched path
    evaluate takes over graphs.h5 rows (split_predictions, batches of 3)."""
    mf = models[kind]
    graphs = data.build_graphs(slabs, 4.5, 12, progress=False) if kind == "dimenetpp" \
        else _symmetric_graphs(slabs, 4.5, 12)
    ids = np.arange(len(slabs["energy"]))
    preds = split_predictions(Predictor(mf), slabs, graphs, ids, batch_size=3)
    calc = GNNPipeCalculator(mf)
    for s, atoms in zip(ids, systems_to_atoms(slabs, ids)):
        atoms.calc = calc
        lo, hi = preds["atom_ptr"][s], preds["atom_ptr"][s + 1]
        assert atoms.get_potential_energy() == pytest.approx(preds["energy"][s], abs=1e-10)
        np.testing.assert_allclose(atoms.get_forces(apply_constraint=False), preds["forces"][lo:hi], atol=1e-10)
    assert np.array_equal(preds["energy_ref"], slabs["energy"]) and preds["forces"].shape == slabs["forces"].shape


@pytest.mark.parametrize("kind,head", [("dimenetpp", "gradient"), ("dimenetpp", "direct"),
                                       ("gemnet_t", "gradient"), ("gemnet_t", "direct")])
def test_forces_and_stress_are_derivatives_of_the_energy(slabs, kind, head):
    """Stress = (1/V) dE/dε against ASE's finite-difference strain (its definition and sign), both
    force heads; gradient forces against finite differences of the energy."""
    mf = tiny_atomic_model(slabs, kind, force_head=head)
    atoms = _bulk(mf)
    atoms.calc = calc = GNNPipeCalculator(mf)
    stress = atoms.get_stress()
    numeric = calculate_numerical_stress(atoms, eps=1e-5)
    assert np.abs(stress).max() > 1e-3  # not trivially zero
    np.testing.assert_allclose(stress, numeric, atol=1e-8 * max(1.0, np.abs(numeric).max()))
    if head == "gradient":
        forces, e0 = atoms.get_forces(), atoms.get_potential_energy()
        for i, ax in ((0, 0), (2, 1), (3, 2)):
            moved = [atoms.copy() for _ in range(2)]
            for m, sign in zip(moved, (1, -1)):
                m.positions[i, ax] += sign * 1e-5
                m.calc = calc
            numeric_f = -(moved[0].get_potential_energy() - moved[1].get_potential_energy()) / 2e-5
            assert forces[i, ax] == pytest.approx(numeric_f, abs=1e-7), (i, ax, e0)


class _PairLJ(torch.nn.Module):
    """Lennard-Jones on the AtomGraph protocol: E = ½ Σ_edges 4ε((σ/r)¹² - (σ/r)⁶) (a symmetric graph)."""

    cfg = type("Cfg", (), {"force_head": "gradient"})

    def forward(self, g):
        from gnnpipe.atomic.batch import gradient_forces

        def energy(g):
            r = g.edge_vectors().norm(dim=-1)
            pair = 4 * 0.1 * ((2.3 / r) ** 12 - (2.3 / r) ** 6)
            return g.sum_systems(g.edges_to_atoms(0.5 * pair.unsqueeze(-1))).squeeze(-1)
        return gradient_forces(energy, g, self.training)


def test_stress_has_ases_convention_of_an_analytic_calculator():
    """The strain machinery (AtomGraph.strain, gradient_forces, the Voigt order and sign) on a pair
    potential against ASE's analytic LennardJones stress and forces, on a skewed cell."""
    from ase.calculators.lj import LennardJones

    from gnnpipe.atomic.inference import VOIGT, view_outputs
    from gnnpipe.atomic.parallel import single_graph

    atoms = bulk("Ar", "fcc", a=3.6) * (2, 2, 2)
    atoms.set_cell(atoms.cell.array @ np.array([[1.02, 0.03, 0.0], [0.0, 0.97, 0.02], [0.01, 0.0, 1.0]]),
                   scale_atoms=True)
    atoms.rattle(0.05, seed=2)
    atoms.calc = LennardJones(sigma=2.3, epsilon=0.1, rc=4.5, smooth=False)
    mf = type("MF", (), {"symmetric_edges": True, "cutoff": 4.5, "max_neighbors": None, "neighbors": "project"})
    b = structure_graph(atoms.numbers, atoms.positions, atoms.cell.array, atoms.pbc, mf)
    _, forces, dy = view_outputs(_PairLJ(), single_graph(b), stress=True)
    sym = (0.5 * (dy + dy.T) / atoms.get_volume()).numpy()
    np.testing.assert_allclose([sym[i, j] for i, j in VOIGT], atoms.get_stress(), atol=1e-10)
    np.testing.assert_allclose(forces.numpy(), atoms.get_forces(), atol=1e-10)
    assert np.abs(atoms.get_stress()[3:]).max() > 1e-4  # the shear components are really tested


@pytest.mark.parametrize("kind", KINDS)
def test_periodic_images_make_energy_extensive(models, kind):
    """A 2x1x1 supercell has every atom's environment of the cell: twice its energy and stress."""
    mf = models[kind]
    cell = _bulk(mf)
    double = cell * (2, 1, 1)
    calc = GNNPipeCalculator(mf)
    cell.calc = double.calc = calc
    assert double.get_potential_energy() == pytest.approx(2 * cell.get_potential_energy(), abs=1e-9)
    np.testing.assert_allclose(double.get_forces(), np.tile(cell.get_forces(), (2, 1)), atol=1e-10)
    np.testing.assert_allclose(double.get_stress(), cell.get_stress(), atol=1e-10)


def test_ase_optimizers_cell_filters_and_md_run_unchanged(slabs, models):
    from ase import units
    from ase.filters import FrechetCellFilter
    from ase.md.velocitydistribution import thermalize_momenta
    from ase.md.verlet import VelocityVerlet
    from ase.optimize import FIRE, LBFGS

    mf = models["gemnet_t"]
    calc = GNNPipeCalculator(mf)
    cell = _bulk(mf)
    cell.calc = calc
    e0, v0 = cell.get_potential_energy(), cell.get_volume()
    FIRE(FrechetCellFilter(cell), logfile=None).run(fmax=0.01, steps=6)
    assert cell.get_potential_energy() < e0 and cell.get_volume() != pytest.approx(v0, rel=1e-6)
    slab = systems_to_atoms(slabs, [0])[0]
    fixed0 = slab.positions[~np.isin(np.arange(len(slab)), slab.constraints[0].get_indices())].copy()
    slab.calc = calc
    e0 = slab.get_potential_energy()
    LBFGS(slab, maxstep=0.04, memory=50, logfile=None).run(fmax=0.01, steps=8)
    assert slab.get_potential_energy() < e0
    assert not np.allclose(slab.positions[~np.isin(np.arange(len(slab)), slab.constraints[0].get_indices())], fixed0)
    md = _bulk(mf, seed=3)
    md.calc = calc
    thermalize_momenta(md, 100, rng=np.random.default_rng(0))
    etot = [md.get_total_energy()]
    dyn = VelocityVerlet(md, timestep=0.5 * units.fs, logfile=None)
    dyn.attach(lambda: etot.append(md.get_total_energy()), interval=2)
    dyn.run(10)
    assert np.ptp(etot) < 1e-3 * max(1.0, abs(etot[0]))  # energy conserved by gradient forces


def test_stress_needs_a_3d_periodic_cell_and_elements_must_be_known(slabs, models):
    calc = GNNPipeCalculator(models["dimenetpp"])
    slab = systems_to_atoms(slabs, [0])[0]  # pbc (True, True, False)
    slab.calc = calc
    assert "stress" not in (slab.get_forces() is not None and calc.results)
    with pytest.raises(PropertyNotImplementedError, match="3-D periodic"):
        slab.get_stress()
    foreign = slab.copy()
    foreign.numbers[0] = 26
    foreign.calc = calc
    with pytest.raises(GnnPipeError, match=r"element\(s\) Fe \(Z=26\) never seen in training; the model knows") as e:
        foreign.get_potential_energy()
    assert "\n" not in str(e.value)
    assert "GNNPipeCalculator(dimenetpp, cutoff=4.5" in repr(calc)


def test_isolated_atoms_have_their_reference_energy_and_no_forces(models):
    """No pair within the cutoff: an empty graph (in training every system has edges)."""
    for mf in models.values():
        calc = GNNPipeCalculator(mf)
        one, two = Atoms("H", positions=[[0, 0, 0]]), Atoms("H2", positions=[[0, 0, 0], [0, 0, 9]])
        one.calc = two.calc = calc
        assert two.get_potential_energy() == pytest.approx(2 * one.get_potential_energy(), abs=1e-12)
        assert not two.get_forces().any()


# --------------------------------------------------------------------------- N workers
def _moved(atoms, seed):
    out = atoms.copy()
    out.positions += np.random.default_rng(seed).normal(scale=0.02, size=out.positions.shape)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind,dtype", [("dimenetpp", "float64"), ("gemnet_t", "float64"), ("gemnet_t", "float32")])
def test_workers_equal_one_process(slabs, models, kind, dtype, monkeypatch):
    """Energies, forces and stress at N = 1, 2, 4 workers equal to 1e-10 (float64), on a bulk cell
    (stress) and a slab, over several calls of one persistent pool. float32 (summation order):
    energies to 1e-6 relative, forces and stress to 1e-5 of their largest component (measured
    1e-7 and 1e-6)."""
    mf = models[kind] if dtype == "float64" else tiny_atomic_model(slabs, kind, dtype=dtype)
    tol = {"e": 1e-10, "f": 1e-10, "s": 1e-10} if dtype == "float64" else {"e": 1e-6, "f": 1e-5, "s": 1e-5}
    structures = [_bulk(mf, (2, 1, 1)), systems_to_atoms(slabs, [1])[0]]
    structures += [_moved(a, 7) for a in structures]

    def results(calc):
        out = []
        for a in structures:
            a = a.copy()
            a.calc = calc
            out.append((a.get_potential_energy(), a.get_forces(), a.get_stress() if a.pbc.all() else None))
        return out

    want = results(GNNPipeCalculator(mf))
    monkeypatch.setattr("gnnpipe.atomic.inference.cpu_cores", lambda: 4)  # 4 workers oversubscribe on purpose
    for workers in (2, 4):
        with GNNPipeCalculator(mf, workers=workers) as calc:
            pids = list(calc.predictor.pool.pids)
            got = results(calc)
            assert calc.predictor.pool.pids == pids and calc.predictor.calls == len(structures)  # persistent
        for (e1, f1, s1), (e2, f2, s2) in zip(want, got):
            assert e2 == pytest.approx(e1, abs=tol["e"] * max(1.0, abs(e1)))
            np.testing.assert_allclose(f2, f1, atol=tol["f"] * max(1.0, np.abs(f1).max()))
            if s1 is not None:
                np.testing.assert_allclose(s2, s1, atol=tol["s"] * max(1.0, np.abs(s1).max()))
        assert not any(_alive(p) for p in pids)  # the with block stopped them


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_fairchem_model_on_two_workers_equals_one_process_in_both_layouts(slabs, kind):
    """fairchem's graphs (GemNet's symmetric; DimeNet++'s per-target, symmetric_edges false) through
    the worker pool: edges and atoms layouts equal one process (float64, 1e-10) on a rattled bulk cell
    at 4.5 Å / 20 neighbours, where the cap binds and the project's graph gives another energy."""
    import dataclasses

    mf = tiny_atomic_model(slabs, kind, cutoff=4.5, max_neighbors=20, neighbors="fairchem")
    if kind == "dimenetpp":
        mf = dataclasses.replace(mf, symmetric_edges=False)
    cell = _bulk(mf, (2, 2, 2), seed=1)
    cell.calc = GNNPipeCalculator(mf)
    want = cell.get_potential_energy(), cell.get_forces()
    other = cell.copy()
    other.calc = GNNPipeCalculator(dataclasses.replace(mf, neighbors="project", symmetric_edges=True))
    assert abs(other.get_potential_energy() - want[0]) > 1e-6 * abs(want[0])
    for layout in ("edges", "atoms"):
        with GNNPipeCalculator(mf, workers=2, layout=layout) as calc:
            a = cell.copy()
            a.calc = calc
            got = a.get_potential_energy(), a.get_forces()
            assert calc.predictor.last_layout.name == layout
        assert got[0] == pytest.approx(want[0], abs=1e-10 * max(1.0, abs(want[0])))
        np.testing.assert_allclose(got[1], want[1], atol=1e-10 * max(1.0, np.abs(want[1]).max()))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_a_killed_worker_is_one_clear_error_within_seconds(slabs, models, monkeypatch):
    mf = models["dimenetpp"]
    atoms = _bulk(mf, (2, 1, 1))
    calc = GNNPipeCalculator(mf, workers=2)
    atoms.calc = calc
    atoms.get_potential_energy()
    os.kill(calc.predictor.pool.pids[1], signal.SIGKILL)  # between calls
    t0 = time.monotonic()
    with pytest.raises(GnnPipeError, match=r"inference worker 1 of 2 \(pid \d+\) died .*SIGKILL") as e:
        calc.get_potential_energy(_moved(atoms, 1))
    # "within seconds": not the collectives' 600 s timeout; 30 s leaves room for a loaded CI machine
    assert time.monotonic() - t0 < 30 and "\n" not in str(e.value)
    with pytest.raises(GnnPipeError, match="stopped after an error"):
        calc.get_potential_energy(_moved(atoms, 2))
    calc = GNNPipeCalculator(mf, workers=2)  # a structure with fewer edges than workers: refused, the pool lives
    with pytest.raises(GnnPipeError, match="over 2 workers needs at least 2 edges, this structure has 0"):
        calc.get_potential_energy(Atoms("H2", positions=[[0, 0, 0], [0, 0, 9]]))
    assert calc.get_potential_energy(atoms) == pytest.approx(GNNPipeCalculator(mf).get_potential_energy(atoms))
    calc.close()
    # during a call: worker 0 kills itself on its second call while worker 1 waits in a collective
    monkeypatch.setenv("GNNPIPE_TEST_KILL_INFERENCE", "0:1")
    calc = GNNPipeCalculator(mf, workers=2)
    calc.get_potential_energy(atoms)
    pids = list(calc.predictor.pool.pids)
    t0 = time.monotonic()
    with pytest.raises(GnnPipeError, match=r"inference worker 0 of 2 .* died during a call \(killed by SIGKILL\)"):
        calc.get_potential_energy(_moved(atoms, 3))
    assert time.monotonic() - t0 < 30
    assert not any(_alive(p) for p in pids)  # the waiting worker was stopped, not left hanging
    calc.close()
    with pytest.raises(GnnPipeError, match=r"shut down \(close\(\)\)"):
        calc.get_potential_energy(_moved(atoms, 4))


@pytest.mark.slow
def test_velocity_verlet_gives_the_same_trajectory_at_1_and_2_workers(models):
    from ase import units
    from ase.md.velocitydistribution import thermalize_momenta
    from ase.md.verlet import VelocityVerlet

    mf = models["dimenetpp"]
    paths = []
    for workers in (1, 2):
        atoms = _bulk(mf, (2, 1, 1), seed=5)
        thermalize_momenta(atoms, 300, rng=np.random.default_rng(1))
        with GNNPipeCalculator(mf, workers=workers) as calc:
            atoms.calc = calc
            frames = []
            dyn = VelocityVerlet(atoms, timestep=1.0 * units.fs, logfile=None)
            dyn.attach(lambda: frames.append(atoms.positions.copy()), interval=1)
            dyn.run(20)
        paths.append(np.array(frames))
    np.testing.assert_allclose(paths[1], paths[0], atol=1e-10, rtol=0)
    assert torch.get_num_threads() == 1


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_one_large_cell_takes_the_atoms_layout_and_equals_one_process(models, kind):
    """A 108-atom cell on 2 workers: ``auto`` takes the atoms layout (fewer closed-form bytes), and
    energy, forces (back in the structure's atom order) and stress equal one process (float64, 1e-10),
    as the edges layout's do."""
    mf = models[kind]
    cell = _bulk(mf, (3, 3, 3), seed=3)
    cell.calc = GNNPipeCalculator(mf)
    want = cell.get_potential_energy(), cell.get_forces(), cell.get_stress()
    for layout in ("auto", "edges"):
        with GNNPipeCalculator(mf, workers=2, layout=layout) as calc:
            a = cell.copy()
            a.calc = calc
            got = a.get_potential_energy(), a.get_forces(), a.get_stress()
            assert calc.predictor.last_layout.name == ("atoms" if layout == "auto" else "edges")
        assert got[0] == pytest.approx(want[0], abs=1e-10 * max(1.0, abs(want[0])))
        for x, y in zip(got[1:], want[1:]):
            np.testing.assert_allclose(x, y, atol=1e-10 * max(1.0, np.abs(y).max()))
    with pytest.raises(GnnPipeError, match="layout 'halo': one of auto, edges, atoms"):
        GNNPipeCalculator(mf, workers=2, layout="halo")
