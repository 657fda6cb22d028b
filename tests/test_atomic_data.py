"""Atomistic datasets (gnnpipe.atomic.data): EMT structures, readers, radius graphs, triplets, HDF5."""

from __future__ import annotations

import itertools

import h5py
import numpy as np
import pytest

from gnnpipe.atomic import data
from gnnpipe.io import GnnPipeError


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
    src, dst, shift = data.radius_graph(pos, cell, pbc, 3.3, 10_000)
    got = {(int(j), int(i), tuple(np.round(s, 6))) for j, i, s in zip(src, dst, shift)}
    assert got == _brute_edges(pos, cell, pbc, 3.3)
    assert {(i, j, tuple(np.round(-np.array(s), 6)) if any(s) else s) for j, i, s in got} == got  # symmetric
    d = np.linalg.norm(pos[dst] - pos[src] - shift, axis=1)
    for i in range(4):  # sorted by distance per target; max_neighbors keeps the nearest
        assert np.all(np.diff(d[dst == i]) >= 0)
    s2, d2, sh2 = data.radius_graph(pos, cell, pbc, 3.3, 3)
    for i in range(4):
        assert np.allclose(np.linalg.norm(pos[i] - pos[s2[d2 == i]] - sh2[d2 == i], axis=1), d[dst == i][:3])


def test_triplets_match_brute_force_including_periodic_self_images():
    cell = np.eye(3) * 2.0
    pos = np.array([[0.1, 0.2, 0.3], [1.1, 0.9, 1.2]])
    src, dst, shift = data.radius_graph(pos, cell, np.array([True] * 3), 2.1, 100)
    kj, ji = data.triplets(src, dst, shift)
    want = {(f, e) for e in range(len(src)) for f in range(len(src))
            if dst[f] == src[e] and not (src[f] == dst[e] and np.allclose(shift[f] + shift[e], 0))}
    assert set(zip(kj.tolist(), ji.tolist())) == want and len(kj) == len(want)
    assert any(src[f] == dst[e] for f, e in want)  # k == i on another image is kept


def test_h5_round_trip_and_refusals(tmp_path, systems):
    p = tmp_path / "systems.h5"
    digest = data.write_systems(p, systems)
    back = data.read_systems(p)
    assert back["content_hash"] == digest and np.array_equal(back["pos"], systems["pos"])
    g = data.build_graphs(systems, 4.0, 12, progress=False)
    gp = tmp_path / "graphs.h5"
    data.write_graphs(gp, g, 4.0, 12, digest)
    assert np.array_equal(data.read_graphs(gp, digest)["idx_kj"], g["idx_kj"])
    with pytest.raises(GnnPipeError, match="rule atom_graphs"):
        data.read_graphs(gp, "another")
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
    got = data.read_structures(xyz)
    assert list(got["atom_ptr"]) == [0, 2, 5] and np.allclose(got["energy"], -1.5)
    db = tmp_path / "s.db"
    with ase.db.connect(str(db)) as c:
        c.write(atoms([1, 8]))
        c.write(atoms([6, 8], with_labels=False))
    with pytest.raises(GnnPipeError, match="row id 2 has no energy and forces"):
        data.read_structures(db)
    ase.io.write(xyz, [atoms([1, 118])])
    with pytest.raises(GnnPipeError, match=r"frame 0: element\(s\) \[118\]"):
        data.read_structures(xyz)


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
