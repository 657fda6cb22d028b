"""Atomistic datasets (gnnpipe.atomic.data): EMT structures, readers, radius graphs, triplets, HDF5."""

from __future__ import annotations

import functools
import itertools
import json

import h5py
import numpy as np
import pytest

from gnnpipe.atomic import data
from gnnpipe.atomic import neighbors as nb
from gnnpipe.io import GnnPipeError
from helpers import dense_radius_graph


@pytest.fixture(scope="module")
def systems():
    return data.generate(6, seed=3, progress=False)


def _brute_edges(pos, cell, pbc, cutoff):
    out = set()
    rng = [range(-3, 4) if p else range(1) for p in pbc]
    for n in itertools.product(*rng):
        s = np.array(n) @ cell
        for i, j in itertools.product(range(len(pos)), repeat=2):
            d = np.linalg.norm(pos[i] - pos[j] - s)
            if 1e-8 < d < cutoff:
                out.add((j, i, tuple(np.round(s, 6))))
    return out


def test_generate_is_deterministic_and_labelled(systems):
    again = data.generate(6, seed=3, progress=False)
    for k in data.SYSTEM_ARRAYS:
        assert np.array_equal(systems[k], again[k]), k
    assert not np.array_equal(systems["pos"], data.generate(6, seed=4, progress=False)["pos"])
    assert np.all(np.isfinite(systems["energy"])) and systems["fixed"].any() and (~systems["fixed"]).any()
    assert np.abs(systems["forces"][~systems["fixed"]]).max() < 10  # EMT, adsorbates at sane heights
    assert systems["pbc"][:, :2].all() and set(np.unique(systems["split"])) <= {0, 1, 2}


def test_radius_graph_matches_brute_force_on_a_skewed_periodic_cell():
    rng = np.random.default_rng(0)
    cell = np.array([[2.6, 0, 0], [1.1, 2.4, 0], [0.3, 0.2, 3.1]])
    pos = rng.random((4, 3)) @ cell
    pbc = np.array([True, True, False])
    src, dst, shift = nb.radius_graph(pos, cell, pbc, 3.3)
    got = {(int(j), int(i), tuple(np.round(s, 6))) for j, i, s in zip(src, dst, shift)}
    assert got == _brute_edges(pos, cell, pbc, 3.3)
    assert {(i, j, tuple(np.round(-np.array(s), 6)) if any(s) else s) for j, i, s in got} == got  # symmetric
    d = np.linalg.norm(pos[dst] - pos[src] - shift, axis=1)
    for i in range(4):  # sorted by distance per target; the cap keeps every atom's nearest (and their reverses)
        assert np.all(np.diff(d[dst == i]) >= 0)
    s2, d2, sh2 = nb.radius_graph(pos, cell, pbc, 3.3, 3)
    for i in range(4):
        assert np.allclose(np.linalg.norm(pos[i] - pos[s2[d2 == i]] - sh2[d2 == i], axis=1)[:3], d[dst == i][:3])


def test_triplets_match_brute_force_including_periodic_self_images():
    cell = np.eye(3) * 2.0
    pos = np.array([[0.1, 0.2, 0.3], [1.1, 0.9, 1.2]])
    src, dst, shift = nb.radius_graph(pos, cell, np.array([True] * 3), 2.1, 100)
    kj, ji = data.triplets(src, dst, shift)
    want = {(f, e) for e in range(len(src)) for f in range(len(src))
            if dst[f] == src[e] and not (src[f] == dst[e] and np.allclose(shift[f] + shift[e], 0))}
    assert set(zip(kj.tolist(), ji.tolist())) == want and len(kj) == len(want)
    assert any(src[f] == dst[e] for f, e in want)  # k == i on another image is kept


def test_graphs_are_symmetric_with_their_reverse_edges_and_a_binding_cap_keeps_them_so(systems):
    """build_graphs: vesin's symmetric graph per system; id_swap (local ids, stored) maps every edge to
    its reverse; with a binding cap (4 neighbours) each atom keeps its 4 nearest of the dense search."""
    g = data.build_graphs(systems, 4.0, 4, progress=False)
    ep, ap = g["edge_ptr"], systems["atom_ptr"]
    for s in range(len(ep) - 1):
        src, dst, shift, swap = (g[k][ep[s]:ep[s + 1]] for k in ("edge_src", "edge_dst", "edge_shift", "id_swap"))
        assert np.array_equal(src[swap], dst) and np.array_equal(dst[swap], src)
        assert np.allclose(shift[swap], -shift) and np.array_equal(swap[swap], np.arange(len(swap)))
        pos = systems["pos"][ap[s]:ap[s + 1]]
        kept = {(int(j), int(i), tuple(np.round(v, 6) + 0.0)) for j, i, v in zip(src, dst, shift)}
        nearest = dense_radius_graph(pos, systems["cell"][s], systems["pbc"][s], 4.0, 4)
        assert {(int(j), int(i), tuple(np.round(v, 6) + 0.0)) for j, i, v in zip(*nearest)} <= kept
        assert len(kept) > len(nearest[0])  # the cap binds: the reverses of others' nominations are added


def test_h5_round_trip_and_refusals(tmp_path, systems):
    p = tmp_path / "systems.h5"
    digest = data.write_systems(p, systems)
    back = data.read_systems(p)
    assert back["content_hash"] == digest and np.array_equal(back["pos"], systems["pos"])
    g = data.build_graphs(systems, 4.0, 12, progress=False)
    gp = tmp_path / "graphs.h5"
    data.write_graphs(gp, g, 4.0, 12, digest)
    back = data.read_graphs(gp, digest)
    assert np.array_equal(back["idx_kj"], g["idx_kj"]) and np.array_equal(back["id_swap"], g["id_swap"])
    assert back["symmetric_edges"] is True and back["max_neighbors"] == 12
    with pytest.raises(GnnPipeError, match="rule atom_graphs"):
        data.read_graphs(gp, "another")
    with h5py.File(gp, "r+") as f:  # a graphs.h5 of format 1 (per-target cut, no id_swap): rebuilt, not read
        f.attrs["format_version"] = 1
    with pytest.raises(GnnPipeError, match=r"not a atom_graphs file of format version 2 .*version 1.*rule atom_graphs"):
        data.read_graphs(gp, digest)
    with h5py.File(p, "r+") as f:  # an edited attribute
        f.attrs["num_systems"] = 99
    with pytest.raises(GnnPipeError, match="content hash mismatch.*rule build_systems"):
        data.read_systems(p)
    data.write_systems(p, systems)
    with h5py.File(p, "r+") as f:  # a flipped value
        f["energy"][0] += 1e-9
    with pytest.raises(GnnPipeError, match="content hash"):
        data.read_systems(p)
    with h5py.File(p, "r+") as f:
        f.attrs["format_version"] = 99
    with pytest.raises(GnnPipeError, match="format version"):
        data.read_systems(p)
    p.write_bytes(p.read_bytes()[:2000])
    with pytest.raises(GnnPipeError, match="truncated"):
        data.read_systems(p)


def test_graphs_h5_records_the_neighbour_convention(tmp_path, systems):
    """atom-graphs --neighbors fairchem writes fairchem's graphs (atomic.neighbors) and records it; a
    project file carries no such attribute (the file it was before the option) and reads as project;
    a model's smaller cutoff rebuilds the graphs in the file's convention."""
    from gnnpipe.atomic.atomic_engine import model_graphs
    from gnnpipe.cli import main

    sp, gp = tmp_path / "systems.h5", tmp_path / "graphs.h5"
    digest = data.write_systems(sp, systems)
    assert main(["atom-graphs", "--systems", str(sp), "--cutoff", "4", "--max-neighbors", "4",
                 "--neighbors", "fairchem", "--out", str(gp)]) == 0
    g = data.read_graphs(gp, digest)
    assert g["neighbors"] == "fairchem"
    ep, ap = g["edge_ptr"], systems["atom_ptr"]
    for s in range(len(ep) - 1):
        want = nb.system_graph(systems["pos"][ap[s]:ap[s + 1]], systems["cell"][s], systems["pbc"][s], 4.0, 4,
                               "fairchem")
        assert all(np.array_equal(g[k][ep[s]:ep[s + 1]], want[k]) for k in ("edge_src", "edge_dst", "id_swap"))
    project = data.build_graphs(systems, 4.0, 4, progress=False)
    assert len(project["edge_src"]) != len(g["edge_src"])  # the cap binds: the conventions differ
    smaller = model_graphs(g, systems, 3.5, gp)
    assert smaller["neighbors"] == "fairchem"
    assert np.array_equal(smaller["edge_src"], data.build_graphs(systems, 3.5, 4, False, "fairchem")["edge_src"])
    data.write_graphs(gp, project, 4.0, 4, digest)
    with h5py.File(gp, "r") as f:
        assert "neighbors" not in f.attrs
    assert data.read_graphs(gp, digest)["neighbors"] == "project"


def test_readers_and_bad_rows(tmp_path, systems):
    import ase.db
    import ase.io
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator

    def atoms(z, with_labels=True):
        a = Atoms(numbers=z, positions=np.arange(3 * len(z)).reshape(-1, 3) * 0.7, cell=np.eye(3) * 5, pbc=True)
        if with_labels:
            a.calc = SinglePointCalculator(a, energy=-1.5, forces=np.ones((len(z), 3)))
        return a
    xyz = tmp_path / "s.extxyz"
    ase.io.write(xyz, [atoms([1, 8]), atoms([29, 29, 8])])
    got = data.read_structures(xyz, split="random")
    assert list(got["atom_ptr"]) == [0, 2, 5] and np.allclose(got["energy"], -1.5)
    db = tmp_path / "s.db"
    with ase.db.connect(str(db)) as c:
        c.write(atoms([1, 8]))
        c.write(atoms([6, 8], with_labels=False))
    with pytest.raises(GnnPipeError, match="row id 2 has no energy; every structure needs its energy"):
        data.read_structures(db, split="random")
    ase.io.write(xyz, [atoms([1, 118])])
    with pytest.raises(GnnPipeError, match=r"frame 0: element\(s\) \[118\]"):
        data.read_structures(xyz, split="random")


def test_a_file_of_energies_alone_is_read_with_unknown_forces_and_mixed_or_energyless_files_are_one_line(tmp_path):
    """Energies without forces (molecular datasets): read, the forces NaN (``has_forces`` False), which
    trains energy-only; a file where some structures have forces and some not, or one with forces but
    no energy, is one line naming the structure and what it lacks."""
    import ase.io
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator

    def atoms(z, energy=-1.5, forces=None):
        a = Atoms(numbers=z, positions=np.arange(3 * len(z)).reshape(-1, 3) * 0.7, cell=np.eye(3) * 5, pbc=True)
        a.calc = SinglePointCalculator(a, energy=energy, forces=forces)
        return a
    xyz = tmp_path / "e.extxyz"
    ase.io.write(xyz, [atoms([1, 8]), atoms([6, 8], energy=-2.5)])
    got = data.read_structures(xyz, split="random")
    assert np.isnan(got["forces"]).all() and got["forces"].shape == (4, 3) and not data.has_forces(got)
    assert list(got["energy"]) == [-1.5, -2.5] and data.systems_summary(got)["forces"] is False
    both = atoms([6, 8], forces=np.ones((2, 3)))
    for frames, lacks, has in (([both, atoms([1, 8])], 1, 0), ([atoms([1, 8]), both], 0, 1)):
        ase.io.write(xyz, frames)
        with pytest.raises(GnnPipeError, match=f"frame {lacks} has an energy but no forces while frame {has} has "
                                               f"both; give every structure forces, or none"):
            data.read_structures(xyz, split="random")
    ase.io.write(xyz, [atoms([1, 8], energy=None, forces=np.ones((2, 3)))])
    with pytest.raises(GnnPipeError, match="frame 0 has forces but no energy; every structure needs its energy"):
        data.read_structures(xyz, split="random")


def test_bad_graph_settings(systems):
    with pytest.raises(GnnPipeError, match="cutoff must be > 0"):
        data.build_graphs(systems, 0.0, 12, progress=False)
    with pytest.raises(GnnPipeError, match="max_neighbors"):
        data.build_graphs(systems, 4.0, 0, progress=False)
    with pytest.raises(GnnPipeError, match="system 0 .* no pair of atoms within the cutoff 0.5"):
        data.build_graphs(systems, 0.5, 12, progress=False)


def test_batch_arrays_offsets(systems):
    g = data.build_graphs(systems, 4.0, 12, progress=False)
    b = data.batch_arrays(systems, g, [2, 0])
    n2 = systems["atom_ptr"][3] - systems["atom_ptr"][2]
    e2 = g["edge_ptr"][3] - g["edge_ptr"][2]
    assert b["num_systems"] == 2 and b["system"].max() == 1
    assert b["edge_src"][e2:].min() >= n2 and b["idx_kj"][b["idx_ji"] >= e2].min() >= e2
    assert np.all(b["edge_dst"][b["idx_ji"]] != -1) and np.array_equal(b["edge_dst"][b["idx_kj"]], b["edge_src"][b["idx_ji"]])
    assert np.array_equal(b["edge_src"][b["id_swap"]], b["edge_dst"])  # reverse edges in batch ids
    assert np.array_equal(b["id_swap"], nb.reverse_edges(b["edge_src"], b["edge_dst"], b["edge_shift"]))


# --------------------------------------------------------------------------- impossible atoms (issue 21, item 3)
def _labelled(positions, cell, pbc=True, z=(1, 8)):
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator

    a = Atoms(numbers=list(z), positions=positions, cell=cell, pbc=pbc)
    a.calc = SinglePointCalculator(a, energy=-1.0, forces=np.zeros((len(z), 3)))
    return a


BOX = np.eye(3) * 5.0
IMPOSSIBLE = {
    "1e-6 apart": (_labelled([[1, 1, 1], [1 + 1e-6, 1, 1]], BOX),
                   "frame 1: atom 0 (H) and atom 1 (O) are 1e-06 Å apart, closer than atoms.min_distance (0.5 Å)"),
    "coincident": (_labelled([[1, 1, 1], [1, 1, 1]], BOX),
                   "frame 1: atom 0 (H) and atom 1 (O) are 0 Å apart, closer than atoms.min_distance (0.5 Å)"),
    "across the boundary": (_labelled([[0.1, 1, 1], [4.8, 1, 1]], BOX),
                            "frame 1: atom 0 (H) and atom 1 (O) in the periodic image (-1, 0, 0) are 0.3 Å apart"),
    "0.05 A cell": (_labelled([[0, 0, 0], [0.01, 0.01, 0.01]], np.eye(3) * 0.05, z=(29, 29)),
                    "frame 1: periodic along axis 0 but the cell's height along it is 0.05 Å, below "
                    "atoms.min_distance (0.5 Å): a zero, degenerate or tiny cell"),
    "pbc with a zero cell": (_labelled([[0, 0, 0], [1, 0, 0]], np.zeros((3, 3))),
                             "frame 1: periodic along axis 0 but the cell's height along it is 0 Å"),
    "degenerate cell": (_labelled([[0, 0, 0], [1, 0, 0]], [[3, 0, 0], [6, 0, 0], [0, 0, 3]]),
                        "frame 1: periodic along axis 0 but the cell's height along it is 0 Å"),
    "NaN position": (_labelled([[0, 0, 0], [np.nan, 0, 0]], BOX),
                     "frame 1: atom 1 (O) has a non-finite position [nan, 0.0, 0.0]"),
}


@pytest.mark.parametrize("case", list(IMPOSSIBLE))
def test_impossible_structures_are_refused_naming_file_row_and_atoms(tmp_path, case):
    """Two atoms 1e-6 Å apart trained to force errors of 1e19; coincident atoms were dropped from the
    graph; a 0.05 Å cell was accepted; pbc with a zero cell was a NaN ValueError in radius_graph; a
    NaN position said "has no energy and forces"."""
    import ase.io

    atoms, message = IMPOSSIBLE[case]
    path = tmp_path / "s.extxyz"
    ase.io.write(path, [_labelled([[0, 0, 0], [0.97, 0, 0]], BOX), atoms])  # frame 0 is fine (OH)
    with pytest.raises(GnnPipeError) as err:
        data.read_structures(path)
    assert str(err.value).startswith(f"{path}: {message}"), str(err.value)
    assert "\n" not in str(err.value)


def test_the_graph_builder_refuses_an_unchecked_systems_file(tmp_path):
    """build_graphs checks every system of a systems.h5 (one written by hand or by an older gnnpipe)
    before radius_graph, which read a zero cell as NaN image counts."""
    ok = _labelled([[0, 0, 0], [0.97, 0, 0]], BOX)
    systems = data._pack([(a.numbers, a.positions, np.zeros(2, bool), np.zeros((2, 3)), a.cell.array, a.pbc, -1.0)
                          for a in (ok, IMPOSSIBLE["pbc with a zero cell"][0])], np.zeros(2), "hand", 0.5,
                         np.arange(2))
    path = tmp_path / "systems.h5"
    data.write_systems(path, systems)
    with pytest.raises(GnnPipeError, match=rf"^{path}: system 1: periodic along axis 0 but the cell's height "):
        data.build_graphs(data.read_systems(path), 4.0, 8, progress=False)


def test_min_distance_is_the_configs_and_the_generator_checks_too(tmp_path):
    import ase.io

    from gnnpipe.config import AtomsConfig

    path = tmp_path / "s.extxyz"
    ase.io.write(path, [_labelled([[0, 0, 0], [0.4, 0, 0]], BOX)])
    with pytest.raises(GnnPipeError, match=r"0.4 Å apart, closer than atoms.min_distance \(0.5 Å\)"):
        data.systems_from_config(AtomsConfig(file=str(path), split="random"))
    systems = data.systems_from_config(AtomsConfig(file=str(path), min_distance=0.3, split="random"))
    assert systems["min_distance"] == 0.3
    data.write_systems(tmp_path / "systems.h5", systems)
    assert data.read_systems(tmp_path / "systems.h5")["min_distance"] == 0.3  # build_graphs checks with it
    data.build_graphs(data.read_systems(tmp_path / "systems.h5"), 4.0, 8, progress=False)
    # bonds are 1.1-2.9 Å long: a 3 Å minimum refuses the first system the generator makes
    with pytest.raises(GnnPipeError, match=r"^atoms.generate: trajectory 0 \(seed 0, \w+ \+ \w+, rattle 0.05 Å\): atom "
                                           r"\d+ \(\w+\) and atom \d+ \(\w+\) are \d.\d+ Å apart, closer than "
                                           r"atoms.min_distance \(3 Å\)$"):
        data.generate(2, size=(2, 2, 2), seed=0, progress=False, min_distance=3.0)


def test_every_reader_of_atoms_goes_through_the_one_check(tmp_path, monkeypatch):
    """Issue 21, item 8: the generator, the file reader and the graph builder call the same
    check_structure, once per structure, with the configured minimum distance."""
    import ase.io

    seen = []
    monkeypatch.setattr(data, "check_structure", lambda *a, min_distance, where: seen.append((where, min_distance)))
    systems = data.generate(2, size=(2, 2, 2), seed=0, progress=False, min_distance=0.7)
    path = tmp_path / "s.extxyz"
    ase.io.write(path, [_labelled([[0, 0, 0], [0.97, 0, 0]], BOX)] * 3)
    data.read_structures(path, min_distance=0.6, split="random")
    data.build_graphs(systems, 4.0, 8, progress=False)
    assert [m for _, m in seen] == [0.7, 0.7, 0.6, 0.6, 0.6, 0.7, 0.7]
    assert [w.split(":")[-1].split(" (")[0].strip() for w, _ in seen] == \
        ["trajectory 0", "trajectory 1", "frame 0", "frame 1", "frame 2", "system 0", "system 1"]


def test_generated_relaxations_give_frames_tagged_by_trajectory_and_split_by_it():
    """Frames along seeded EMT relaxations (first: the rattled start, last: relaxed, energies falling),
    each tagged with its trajectory; no trajectory in two splits; split random mixes them."""
    frames = data.generate(10, size=(2, 2, 2), seed=1, frames_per_trajectory=3, progress=False)
    assert np.array_equal(frames["group"], np.repeat(np.arange(10), 3))  # each relaxation gives its 3 frames
    ptr = frames["atom_ptr"]
    for t in range(10):
        first, last = 3 * t, 3 * t + 2
        assert frames["energy"][first] > frames["energy"][3 * t + 1] > frames["energy"][last]
        free = ~frames["fixed"][ptr[last]:ptr[last + 1]]
        assert np.linalg.norm(frames["forces"][ptr[last]:ptr[last + 1]][free], axis=1).max() < data.RELAX_FMAX
    assert all(len(set(frames["split"][frames["group"] == g])) == 1 for g in range(10))
    assert list(np.bincount(frames["split"])) == [24, 3, 3]  # 8 / 1 / 1 trajectories
    again = data.generate(10, size=(2, 2, 2), seed=1, frames_per_trajectory=3, progress=False)
    assert all(np.array_equal(frames[k], again[k]) for k in data.SYSTEM_ARRAYS)
    mixed = data.generate(10, size=(2, 2, 2), seed=1, frames_per_trajectory=3, split="random", progress=False)
    assert np.array_equal(mixed["pos"], frames["pos"])
    assert any(len(set(mixed["split"][mixed["group"] == g])) > 1 for g in range(10))
    assert list(data.pick_frames(10, 4)) == [0, 3, 6, 9] and list(data.pick_frames(2, 4)) == [0, 1]


def test_a_files_trajectory_key_splits_by_trajectory_and_a_missing_one_is_one_line(tmp_path):
    """extxyz info key and ASE db column name each structure's trajectory: whole trajectories go to one
    split; the key missing on a row is one line naming the row, the key and the two ways out."""
    import ase.db
    import ase.io
    from ase.calculators.singlepoint import SinglePointCalculator

    frames = data.generate(24, size=(2, 2, 2), seed=4, progress=False)
    rows = []
    for s in range(24):
        a, b = frames["atom_ptr"][s], frames["atom_ptr"][s + 1]
        at = __import__("ase").Atoms(numbers=frames["z"][a:b], positions=frames["pos"][a:b],
                                     cell=frames["cell"][s], pbc=frames["pbc"][s])
        at.calc = SinglePointCalculator(at, energy=float(frames["energy"][s]), forces=frames["forces"][a:b])
        at.info["md_run"] = f"run{s % 10}"  # ten trajectories, interleaved
        rows.append(at)
    xyz, db = tmp_path / "mine.extxyz", tmp_path / "mine.db"
    ase.io.write(xyz, rows, format="extxyz")
    with ase.db.connect(str(db)) as c:
        for at in rows:
            c.write(at, md_run=at.info["md_run"])
    for path in (xyz, db):
        got = data.read_structures(path, group_key="md_run")
        assert list(got["group"]) == [s % 10 for s in range(24)]  # numbered as they first appear
        assert all(len(set(got["split"][got["group"] == g])) == 1 for g in range(10)), path
        assert set(got["split"]) == {0, 1, 2} and "group_key=md_run" in got["source"]
    with pytest.raises(GnnPipeError) as e:
        data.read_structures(xyz, group_key="trajectory")
    assert str(e.value) == (f"{xyz}: frame 0 has no info key 'trajectory' naming its trajectory (atoms.group_key; "
                            "splits keep each trajectory in one of train/val/test): set atoms.group_key to the info "
                            "key that does, or atoms.split: random to split structure by structure")
    with pytest.raises(GnnPipeError, match=r"mine.db: row id 1 has no column 'traj' naming its trajectory"):
        data.read_structures(db, group_key="traj")
    assert list(data.read_structures(db, split="random", group_key="traj")["group"]) == list(range(24))


@functools.lru_cache
def _slabs(n: int) -> dict:
    return data.generate(n, size=(2, 2, 2), seed=5, progress=False)


def _labelled_files(tmp_path, n: int = 12, **info) -> tuple:
    """``n`` generated slabs as extxyz and ASE db with their energies and forces, each structure's ``info``
    entries (key -> list of values, ``None``: left out) as extxyz info keys and db columns."""
    import ase
    import ase.db
    import ase.io
    from ase.calculators.singlepoint import SinglePointCalculator

    frames = _slabs(n)
    rows = []
    for s in range(n):
        a, b = frames["atom_ptr"][s], frames["atom_ptr"][s + 1]
        at = ase.Atoms(numbers=frames["z"][a:b], positions=frames["pos"][a:b], cell=frames["cell"][s],
                       pbc=frames["pbc"][s])
        at.calc = SinglePointCalculator(at, energy=float(frames["energy"][s]), forces=frames["forces"][a:b])
        at.info.update({k: v[s] for k, v in info.items() if v[s] is not None})
        rows.append(at)
    xyz, db = tmp_path / "mine.extxyz", tmp_path / "mine.db"
    ase.io.write(xyz, rows, format="extxyz")
    with ase.db.connect(str(db)) as c:
        for at in rows:
            c.write(at, **at.info)
    return xyz, db


NAMES = ["train"] * 7 + ["val"] * 2 + ["test"] * 3


def test_a_split_fixed_by_a_key_or_an_index_file_is_the_users(tmp_path):
    """#37 item 18: a published split, from the data (``split: key``: an extxyz info key / db column naming
    train, val or test) or from an index file (``split: file``: JSON lists, or NPZ arrays as schnetpack's
    split.npz names them), is taken as it is; the trajectories are the group_key's where every structure has
    one, else one per structure."""
    order = np.random.default_rng(0).permutation(NAMES).tolist()
    want = [data.SPLITS.index(s) for s in order]
    xyz, db = _labelled_files(tmp_path, part=order, trajectory=[f"t{s // 3}" for s in range(12)])
    for path in (xyz, db):
        got = data.read_structures(path, split="key", split_key="part")
        assert list(got["split"]) == want and list(got["group"]) == [s // 3 for s in range(12)], path
        assert got["source"] == f"file:{path.name} split=key split_key=part"
    ids = {name: [i for i, s in enumerate(order) if s == name] for name in data.SPLITS}
    (tmp_path / "split.json").write_text(json.dumps(ids))
    np.savez(tmp_path / "split.npz", **{f"{k}_idx": np.array(v) for k, v in ids.items()})
    for index in ("split.json", "split.npz"):
        got = data.read_structures(xyz, split="file", split_file=str(tmp_path / index), group_key="none")
        assert list(got["split"]) == want and list(got["group"]) == list(range(12)), index
    (tmp_path / "no-test.json").write_text('{"train": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], "val": [10, 11]}')
    got = data.read_structures(db, split="file", split_file=str(tmp_path / "no-test.json"))
    assert list(got["split"]) == [0] * 10 + [1, 1]  # a split left out is empty


@pytest.mark.parametrize("index,message", [
    ('{"train": [0, 1, 2, 3, 4, 5, 6, 7], "dev": [8, 9, 10, 11]}', "unknown split 'dev'; name the index lists "
                                                                   "train, val and test (or train_idx, "),
    ('{"train": [0, 1, 2, 3, 4, 5, 6, 7], "val": [7, 8], "test": [9, 10, 11]}',
     "structure 7 is listed twice (train and val); each structure belongs to exactly one split"),
    ('{"train": [0, 1, 2, 3, 4, 5], "test": [9, 10, 11]}',
     "3 of the 12 structures of {xyz} are in no split (the first: 6, 7, 8); list each in train, val or test"),
    ('{"train": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12]}', "train must list structure indices 0 .. 11 ({xyz} "
                                                          "holds 12 structures, numbered from 0 in file order)"),
    ('{"train": [0.0, 1.5]}', "train must list structure indices 0 .. 11"),
    ('{"val": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]}', "no structure is in the train split"),
    ('[0, 1]', "holds a list, not an object of train/val/test index lists"),
    ('{"train": [0, 1,', "not a JSON or NPZ index file (JSONDecodeError"),
], ids=["unknown", "overlap", "missing", "range", "float", "no-train", "list", "broken"])
def test_a_bad_index_file_is_one_line_naming_it(tmp_path, index, message):
    xyz, _ = _labelled_files(tmp_path)
    split = tmp_path / "split.json"
    split.write_text(index)
    with pytest.raises(GnnPipeError) as e:
        data.read_structures(xyz, split="file", split_file=str(split))
    assert str(e.value).startswith(f"{split} (atoms.split_file): ") and message.format(xyz=xyz) in str(e.value)
    assert "\n" not in str(e.value)


def test_a_split_key_missing_or_naming_no_split_is_one_line(tmp_path):
    xyz, db = _labelled_files(tmp_path, split=NAMES[:5] + [None] + NAMES[6:])
    with pytest.raises(GnnPipeError) as e:
        data.read_structures(xyz, split="key")
    assert str(e.value) == (f"{xyz}: frame 5 has no info key 'split' naming its split (atoms.split_key, with "
                            "atoms.split: key): give every structure one of train, val, test, or set atoms.split_key "
                            "to the info key that does")
    (tmp_path / "dev").mkdir()
    xyz, db = _labelled_files(tmp_path / "dev", split=NAMES[:8] + ["dev"] + NAMES[9:])
    with pytest.raises(GnnPipeError) as e:
        data.read_structures(db, split="key")
    assert str(e.value) == (f"{db}: row id 9: column 'split' is 'dev', not a split name: use train, val or test "
                            "(atoms.split: key)")


def test_a_fixed_split_through_gnnpipe_data_and_the_config_check(tmp_path, capsys):
    """``gnnpipe data`` writes the given split into systems.h5 (what the runs train on) and refuses a bad index
    file in one line; the config refuses a fixed split of generated data and an index file split: file does
    not read (and split: file without one), before any job."""
    import yaml

    from gnnpipe import cli
    from gnnpipe.config import ConfigError, load_workflow_config

    xyz, _ = _labelled_files(tmp_path, split=NAMES)
    spec = tmp_path / "dataset.yaml"
    spec.write_text(yaml.safe_dump({"kind": "atoms", "atoms": {"file": str(xyz), "split": "key"}}))
    argv = ["data", "--spec", str(spec), "--name", "mine", "--out", str(tmp_path / "systems.h5")]
    assert cli.main(argv) == 0
    assert list(data.read_systems(tmp_path / "systems.h5")["split"]) == [data.SPLITS.index(s) for s in NAMES]
    (tmp_path / "split.json").write_text('{"train": [0, 1], "val": [1]}')
    spec.write_text(yaml.safe_dump({"kind": "atoms", "atoms": {"file": str(xyz), "split": "file",
                                                               "split_file": str(tmp_path / "split.json")}}))
    capsys.readouterr()
    assert cli.main(argv) != 0
    err = capsys.readouterr().err
    assert err.strip() == (f"gnnpipe: error: {tmp_path / 'split.json'} (atoms.split_file): structure 1 is listed twice "
                           "(train and val); each structure belongs to exactly one split"), err
    for atoms, message in [({"split": "key"}, "config.datasets.a.atoms.split: key fixes a split of a user's "
                                              "structures (atoms.file); generated data is split by trajectory or random"),
                           ({"file": "x.db", "split_file": "s.json"}, "config.datasets.a.atoms.split_file: an index "
                                                                       "file is read with split: file only (split is trajectory)"),
                           ({"file": "x.db", "split": "file"}, "config.datasets.a.atoms.split_file: split: file needs "
                                                               "the index file here")]:
        with pytest.raises(ConfigError) as e:
            load_workflow_config({"datasets": {"a": {"kind": "atoms", "atoms": atoms}}, "models": {"d": {"kind": "dimenetpp"}},
                                  "runs": [{"dataset": "a", "model": "d"}]})
        assert str(e.value) == message
