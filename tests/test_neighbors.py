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

def test_a_lone_atom_and_a_dimer():
    src, dst, shift = nb.radius_graph(np.zeros((1, 3)), np.zeros((3, 3)), False, 3.0)
    assert len(src) == 0
    g = nb.system_graph(np.array([[0.0, 0, 0], [1.0, 0, 0]]), np.zeros((3, 3)), False, 3.0)
    assert len(g["edge_src"]) == 2 and len(g["idx_kj"]) == 0 and list(g["id_swap"]) == [1, 0]
