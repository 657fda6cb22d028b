"""Symmetric neighbour lists (gnnpipe.atomic.neighbors): vesin against the dense search, the cap,
reverse edges and triplet ranks."""

from __future__ import annotations

import numpy as np
import pytest

from gnnpipe.atomic import data
from gnnpipe.atomic import neighbors as nb
from gnnpipe.io import GnnPipeError
from helpers import dense_radius_graph

SKEWED = np.array([[2.6, 0, 0], [1.1, 2.4, 0], [0.3, 0.2, 3.1]])


def _edges(src, dst, shift) -> set:
    return {(int(j), int(i), tuple(np.round(s, 6) + 0.0)) for j, i, s in zip(src, dst, shift)}


@pytest.fixture(scope="module")
def slabs():
    return data.generate(3, seed=3, progress=False)


@pytest.mark.parametrize("pbc", [(True, True, False), (True, True, True), (False, False, False)])
def test_vesin_edges_equal_the_dense_search_on_a_skewed_cell(pbc):
    pos = np.random.default_rng(0).random((4, 3)) @ SKEWED
    want = dense_radius_graph(pos, SKEWED, np.array(pbc), 3.3, 10_000)
    got = nb.radius_graph(pos, SKEWED, pbc, 3.3)
    assert _edges(*got) == _edges(*want) and len(got[0]) == len(want[0])
    for a, b in zip(got, want):  # and the same order: (target, distance, source, image)
        assert np.array_equal(a, b)


def test_vesin_edges_equal_the_dense_search_on_generated_slabs(slabs):
    ptr = slabs["atom_ptr"]
    for s in range(len(ptr) - 1):
        pos = slabs["pos"][ptr[s]:ptr[s + 1]]
        want = dense_radius_graph(pos, slabs["cell"][s], slabs["pbc"][s], 4.5, 10_000)
        got = nb.radius_graph(pos, slabs["cell"][s], slabs["pbc"][s], 4.5)
        assert _edges(*got) == _edges(*want)


def test_the_cap_keeps_each_atoms_nearest_and_the_edges_symmetric(slabs):
    ptr, k = slabs["atom_ptr"], 12
    for s in range(len(ptr) - 1):
        pos, cell, pbc = slabs["pos"][ptr[s]:ptr[s + 1]], slabs["cell"][s], slabs["pbc"][s]
        full = _edges(*nb.radius_graph(pos, cell, pbc, 4.5))
        src, dst, shift = nb.radius_graph(pos, cell, pbc, 4.5, k)
        got = _edges(src, dst, shift)
        nominated = _edges(*dense_radius_graph(pos, cell, pbc, 4.5, k))  # today's per-target cut
        assert nominated <= got <= full  # every atom keeps its k nearest, nothing else is invented
        mirrored = {(i, j, tuple(-np.array(sh) + 0.0)) for j, i, sh in nominated}
        assert got == nominated | mirrored  # dropped only when dropped in both directions
        d = np.linalg.norm(pos[dst] - pos[src] - shift, axis=1)
        assert np.all(np.diff(dst) >= 0)
        for i in np.unique(dst):  # ordered by (target, distance)
            assert np.all(np.diff(d[dst == i]) >= 0)


def test_reverse_edges_is_an_involution_onto_the_reverse(slabs):
    ptr = slabs["atom_ptr"]
    pos, cell, pbc = slabs["pos"][:ptr[1]], slabs["cell"][0], slabs["pbc"][0]
    g = nb.system_graph(pos, cell, pbc, 4.5, 12)
    src, dst, shift, swap = g["edge_src"], g["edge_dst"], g["edge_shift"], g["id_swap"]
    assert np.array_equal(swap[swap], np.arange(len(src))) and np.all(swap != np.arange(len(src)))
    assert np.array_equal(src[swap], dst) and np.array_equal(dst[swap], src)
    assert np.allclose(shift[swap], -shift)
    with pytest.raises(GnnPipeError, match="not symmetric"):
        nb.reverse_edges(src[1:], dst[1:], shift[1:])


def test_triplets_and_their_ranks():
    cell = np.eye(3) * 2.0
    pos = np.array([[0.1, 0.2, 0.3], [1.1, 0.9, 1.2]])
    g = nb.system_graph(pos, cell, (True, True, True), 2.1)
    kj, ji = data.triplets(g["edge_src"], g["edge_dst"], g["edge_shift"])
    assert np.array_equal(g["idx_kj"], kj) and np.array_equal(g["idx_ji"], ji)
    rank = nb.triplet_rank(ji, len(g["edge_src"]))
    for e in range(len(g["edge_src"])):  # 0, 1, ..., count-1 in triplet order
        assert np.array_equal(rank[ji == e], np.arange(int((ji == e).sum())))
    ji_shuffled = ji[np.random.default_rng(0).permutation(len(ji))]  # any triplet order
    rank = nb.triplet_rank(ji_shuffled, len(g["edge_src"]))
    for e in range(len(g["edge_src"])):
        assert np.array_equal(rank[ji_shuffled == e], np.arange(int((ji == e).sum())))

def _triplets_before(src, dst, shift):
    """``neighbors.triplets`` as it was before its per-edge exclusion (per-triplet shifts and masks):
    the reference its output must equal, order included."""
    by_dst = np.argsort(dst, kind="stable")
    starts = np.searchsorted(dst[by_dst], np.arange(int(max(dst.max(initial=-1), src.max(initial=-1))) + 2))
    counts = starts[src + 1] - starts[src]
    idx_ji = np.repeat(np.arange(len(src)), counts)
    offs = np.arange(len(idx_ji)) - np.repeat(np.cumsum(counts) - counts, counts)
    idx_kj = by_dst[np.repeat(starts[src], counts) + offs]
    same = (src[idx_kj] == dst[idx_ji]) & np.all(np.abs(shift[idx_kj] + shift[idx_ji]) < 1e-8, axis=1)
    return idx_kj[~same].astype(np.int64), idx_ji[~same].astype(np.int64)


def _triplets_by_definition(src, dst, shift):
    """Every edge ji in edge order, its source's input edges kj by edge id, but i's own image."""
    kj, ji = [], []
    for e in range(len(src)):
        for f in range(len(src)):
            if dst[f] == src[e] and not (src[f] == dst[e] and np.all(np.abs(shift[f] + shift[e]) < 1e-8)):
                kj.append(f)
                ji.append(e)
    return np.array(kj, dtype=np.int64), np.array(ji, dtype=np.int64)


def _graphs(slabs):
    """Symmetric graphs (generated slabs, a skewed cell, atoms beside their own images, a Cu cell with a
    cap), asymmetric ones (the dense search's per-target cut, random edges with random images and
    repeated atom pairs), one edge, none."""
    from test_atomic_parallel import _batch

    ptr = slabs["atom_ptr"]
    for s in range(len(ptr) - 1):
        pos = slabs["pos"][ptr[s]:ptr[s + 1]]
        yield "slab", nb.radius_graph(pos, slabs["cell"][s], slabs["pbc"][s], 4.5)
        yield "slab cut", dense_radius_graph(pos, slabs["cell"][s], slabs["pbc"][s], 5.0, 6)
    pos = np.random.default_rng(0).random((4, 3)) @ SKEWED
    yield "skewed", nb.radius_graph(pos, SKEWED, True, 3.3)
    yield "own images", nb.radius_graph(np.array([[0.1, 0.2, 0.3], [1.1, 0.9, 1.2]]), np.eye(3) * 2.0, True, 2.1)
    from ase.build import bulk
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((3, 3, 3))
    atoms.rattle(0.05, seed=1)
    yield "Cu capped", nb.radius_graph(atoms.positions, atoms.cell.array, True, 5.0, 16)
    for seed in range(3):
        b = _batch(seed, quiet_tail=3)
        yield "random", (b["edge_src"], b["edge_dst"], b["edge_shift"])
    yield "one edge", (np.array([0]), np.array([1]), np.zeros((1, 3)))
    yield "none", (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 3)))


def test_triplets_equal_the_per_triplet_function_and_the_definition_in_order(slabs):
    """The CSR expansion with a per-edge exclusion gives what the function before it gave, in the same
    order (by ji, then kj by edge id), and what the definition's loops give on the small graphs."""
    seen = set()
    for name, (src, dst, shift) in _graphs(slabs):
        got = nb.triplets(src, dst, shift)
        want = _triplets_before(np.asarray(src), np.asarray(dst), np.asarray(shift, dtype=float).reshape(-1, 3))
        assert all(np.array_equal(a, b) and a.dtype == np.int64 for a, b in zip(got, want)), name
        if len(src) < 400:
            assert all(np.array_equal(a, b) for a, b in zip(got, _triplets_by_definition(src, dst, shift))), name
        excluded = sum(np.sum(dst == s) for s in src) - len(got[0])
        seen.add((name, bool(len(got[0])), bool(excluded)))
    assert ("own images", True, True) in seen and ("random", True, True) in seen and ("one edge", False, False) in seen


def test_a_lone_atom_and_a_dimer():
    src, dst, shift = nb.radius_graph(np.zeros((1, 3)), np.zeros((3, 3)), False, 3.0)
    assert len(src) == 0
    g = nb.system_graph(np.array([[0.0, 0, 0], [1.0, 0, 0]]), np.zeros((3, 3)), False, 3.0)
    assert len(g["edge_src"]) == 2 and len(g["idx_kj"]) == 0 and list(g["id_swap"]) == [1, 0]


# --------------------------------------------------------------------------- fairchem's convention
def _line(xs) -> np.ndarray:
    return np.array([[x, 0.0, 0.0] for x in xs])


def _pairs(src, dst) -> set:
    return {(int(j), int(i)) for j, i in zip(src, dst)}


def test_fairchem_keeps_a_pair_only_if_the_higher_atom_nominated_the_lower():
    """Cap 1 on a line: 0 at 0, 1 at 1.0, 2 at 1.4. 0 nominates 1, 1 and 2 nominate each other. The
    pair {0, 1} is dropped (1 did not nominate 0; that 0 nominated 1 does not count): atom 0 loses its
    nearest neighbour. Numbered the other way round (0 <-> 2) the same structure keeps it."""
    off = (np.zeros((3, 3)), False, 2.5, 1)
    src, dst, _ = nb.radius_graph(_line([0.0, 1.0, 1.4]), *off, "fairchem")
    assert _pairs(src, dst) == {(1, 2), (2, 1)}
    assert _pairs(*nb.radius_graph(_line([0.0, 1.0, 1.4]), *off)[:2]) == {(0, 1), (1, 0), (1, 2), (2, 1)}  # project
    assert _pairs(*nb.directed_graph(_line([0.0, 1.0, 1.4]), *off, "fairchem")[:2]) == {(1, 0), (2, 1), (1, 2)}
    src, dst, _ = nb.radius_graph(_line([1.4, 1.0, 0.0]), *off, "fairchem")
    assert _pairs(src, dst) == {(0, 1), (1, 0), (1, 2), (2, 1)}


def test_fairchem_breaks_a_tie_at_the_cap_by_source_in_a_short_row():
    """Cap 1: the centre (4, at 0) has two neighbours at exactly 1 Å, 0 at -1 and 1 at +1; each of them
    has a nearer partner (2 at -1.8, 3 at +1.8) that it nominates. The centre's row holds 2 candidates
    (torch.sort is stable up to 16), so it nominates the lower source, 0, and keeps it alone: the
    atom at -1 numbered 0, the one at +1 numbered 0 when the two are swapped."""
    off = (np.zeros((3, 3)), False, 1.5, 1)
    src, dst, _ = nb.radius_graph(_line([-1.0, 1.0, -1.8, 1.8, 0.0]), *off, "fairchem")
    assert _pairs(src, dst) == {(0, 4), (4, 0), (0, 2), (2, 0), (1, 3), (3, 1)}
    src, dst, _ = nb.radius_graph(_line([1.0, -1.0, -1.8, 1.8, 0.0]), *off, "fairchem")
    assert _pairs(src, dst) == {(0, 4), (4, 0), (1, 2), (2, 1), (0, 3), (3, 0)}


def test_fairchem_keeps_an_atoms_own_image_if_nominated_and_negative():
    """One atom in a 2 Å cube, cutoff 2.5: its six images at exactly 2 Å (the next at 2.83). Cap 2
    nominates the first two in image order, (-1,0,0) and (0,-1,0), both lexicographically negative:
    kept and mirrored, 4 edges (x and y). Cap 3 adds (0,0,-1): all six. The project keeps the same
    here (nominated or reverse nominated)."""
    cell = 2.0 * np.eye(3)
    for cap, axes in ((2, {0, 1}), (3, {0, 1, 2})):
        src, dst, shift = nb.radius_graph(np.zeros((1, 3)), cell, True, 2.5, cap, "fairchem")
        assert len(src) == 2 * len(axes) and set(np.nonzero(shift)[1]) == axes
        assert {tuple(s) for s in shift} == {tuple(s) for s in -shift}
    g = nb.system_graph(np.zeros((1, 3)), cell, True, 2.5, 2, "fairchem")
    assert len(g["id_swap"]) == 4 and sorted(g["id_swap"][g["id_swap"]]) == [0, 1, 2, 3]


def test_fairchem_shifts_are_fairchems_float32_offsets():
    """fairchem's models add ``cell_offsets.float() @ cell.float()`` to their edge vectors (float32,
    whatever the model's dtype): the fairchem convention's shifts are those numbers, which differ from
    ``n @ cell`` by float32's rounding (a float64 model fed ``n @ cell`` missed fairchem's energies by
    up to 2e-5 of a gp-gemnet-dT's); reverse edges keep exactly the negated shift."""
    pos = np.random.default_rng(1).random((3, 3)) @ SKEWED
    src, dst, shift = nb.radius_graph(pos, SKEWED, True, 5.0, 20, "fairchem")
    image = np.rint(shift @ np.linalg.inv(SKEWED))
    assert np.array_equal(shift, shift.astype(np.float32).astype(np.float64))  # float32 numbers
    assert not np.array_equal(shift, image @ SKEWED) and np.allclose(shift, image @ SKEWED, atol=1e-5)
    g = nb.system_graph(pos, SKEWED, True, 5.0, 20, "fairchem")
    assert np.array_equal(g["edge_shift"][g["id_swap"]], -g["edge_shift"])
    directed = nb.directed_graph(pos, SKEWED, True, 5.0, 20, "fairchem")[2]  # DimeNet++'s graph: the same shifts
    assert np.array_equal(directed, directed.astype(np.float32).astype(np.float64))


def test_fairchem_in_float64_ranks_by_float64_distances():
    """Cap 1: the centre (2, at 0) has atom 0 at +(1 + 1e-9) and atom 1 at -1. fairchem's model in
    float32 sees them tie (equal float32 squared distances; the short row keeps the listed order) and
    nominates the lower source, 0; in float64 its squared distances are float64 and it nominates the
    nearer, 1. A float64 model must get the float64 graph (the float32 one missed fairchem's float64
    energies by up to 6e-2 on bulk cells, where an atom's own images at ±n tie)."""
    off = (np.zeros((3, 3)), False, 1.5, 1)
    pos = _line([1.0 + 1e-9, -1.0, 0.0])

    def nominated(dtype):
        src, dst, _ = nb.directed_graph(pos, *off, "fairchem", dtype=dtype)
        return {int(j) for j, i in zip(src, dst) if i == 2}

    assert nominated("float32") == {0} and nominated("float64") == {1}
    assert _pairs(*nb.radius_graph(pos, *off, "fairchem", dtype="float64")[:2]) == {(1, 2), (2, 1)}
    assert _pairs(*nb.radius_graph(pos, *off, "fairchem")[:2]) == {(0, 2), (2, 0)}  # float32, the default
    with pytest.raises(GnnPipeError, match="fairchem's graph in 'float16': float32 or float64"):
        nb.radius_graph(pos, *off, "fairchem", dtype="float16")


@pytest.mark.parametrize("rattle, fairchem, directed, project", [(0.05, 1588, 1600, 1612), (0.0, 1598, 1600, 1652)])
def test_fairchem_edge_counts_on_cu_bulk(rattle, fairchem, directed, project):
    """Cu bulk, 2x2x2 cubic cells (32 atoms), 6 Å / 50 neighbours: the counts of fairchem-core
    (05b9595a) radius_graph_pbc + GemNet's reorder_symmetric_edges, run outside the repository on
    these structures (edge sets compared as (src, dst, image): identical). Unrattled, the cap cuts
    through a shell of exactly equal float32 distances, rows of 78 candidates: torch.sort's
    order decides (a stable sort gives another set)."""
    from ase.build import bulk
    a = bulk("Cu", "fcc", cubic=True).repeat((2, 2, 2))
    if rattle:
        a.rattle(rattle, seed=1)
    args = (a.positions, a.cell.array, a.pbc, 6.0, 50)
    src, dst, shift = nb.radius_graph(*args, "fairchem")
    assert len(src) == fairchem and len(nb.radius_graph(*args)[0]) == project
    assert len(nb.directed_graph(*args, "fairchem")[0]) == directed
    assert np.all(np.bincount(nb.directed_graph(*args, "fairchem")[1]) == 50)  # a strict cap per target
    assert len(nb.reverse_edges(src, dst, shift)) == fairchem  # symmetric


def test_an_unknown_convention_and_a_cell_fairchem_cannot_search_are_refused():
    with pytest.raises(GnnPipeError, match="'pyg' is no neighbour convention .*project, fairchem"):
        nb.radius_graph(_line([0.0, 1.0]), np.zeros((3, 3)), False, 2.0, 1, "pyg")
    flat = np.diag([3.0, 3.0, 0.0])  # periodic in x and y, no third vector: fairchem divides by the volume
    with pytest.raises(GnnPipeError, match="fairchem needs three independent cell vectors when an axis is periodic"):
        nb.radius_graph(_line([0.0, 1.0]), flat, (True, True, False), 2.0, 1, "fairchem")
    assert len(nb.radius_graph(_line([0.0, 1.0]), flat, (True, True, False), 2.0, 1)[0]) == 2  # project: fine
