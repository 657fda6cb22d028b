"""The canonical graph file: round trip, and refusal of stale, damaged or foreign files."""

import h5py
import numpy as np
import pytest

from gnnpipe.graph import FORMAT_VERSION, Graph, csr_from_edges, index_dtype, read_graph, write_graph
from gnnpipe.io import GnnPipeError
from helpers import random_graph


def tiny_graph(n=6):
    src = np.array([0, 1, 2, 3, 4, 0])
    dst = np.array([1, 2, 3, 4, 5, 0])  # one self loop
    indptr, indices = csr_from_edges(src, dst, n)
    rng = np.random.default_rng(0)
    return Graph(indptr, indices, rng.normal(size=(n, 3)).astype(np.float32),
                 np.arange(n) % 2, np.arange(n) < 3, np.arange(n) == 3, np.arange(n) > 3,
                 num_classes=2, name="tiny")


def test_csr_symmetrises_dedups_and_drops_self_loops():
    indptr, indices = csr_from_edges(np.array([0, 0, 1, 2]), np.array([1, 1, 1, 0]), 3)
    edges = {(int(s), int(d)) for d in range(3) for s in indices[indptr[d]:indptr[d + 1]]}
    assert edges == {(0, 1), (1, 0), (2, 0), (0, 2)}
    assert indptr[-1] == 4
    indptr, indices = csr_from_edges(np.array([0]), np.array([1]), 3, symmetrize=False, self_loops="add")
    edges = {(int(s), int(d)) for d in range(3) for s in indices[indptr[d]:indptr[d + 1]]}
    assert edges == {(0, 1), (0, 0), (1, 1), (2, 2)}


def _csr_reference(src, dst, n, symmetrize, self_loops):
    """The CSR by one sort of (dst, src) keys: what the streamed builder must equal."""
    src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    if symmetrize:
        src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
    if self_loops != "keep":
        keep = src != dst
        src, dst = src[keep], dst[keep]
    if self_loops == "add":
        src, dst = np.concatenate([src, np.arange(n)]), np.concatenate([dst, np.arange(n)])
    d, s = np.divmod(np.unique(dst * n + src), n)
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(d, minlength=n), out=indptr[1:])
    return indptr, s


@pytest.mark.parametrize("self_loops", ["remove", "add", "keep"])
@pytest.mark.parametrize("symmetrize", [True, False])
def test_streamed_csr_equals_one_shot(symmetrize, self_loops):
    """Chunks of 1, 7 and all edges (repeats and loops across chunk borders) give the same CSR."""
    rng = np.random.default_rng(1)
    n = 40
    src, dst = rng.integers(0, n, 600), rng.integers(0, n, 600)
    want = _csr_reference(src, dst, n, symmetrize, self_loops)
    for chunk in (1, 7, 10**6):
        indptr, indices = csr_from_edges(src, dst, n, symmetrize=symmetrize, self_loops=self_loops, chunk=chunk)
        np.testing.assert_array_equal(indptr, want[0])
        np.testing.assert_array_equal(indices, want[1])
        assert indptr.dtype == np.int64 and indices.dtype == np.int32


def test_ids_are_int32_when_they_fit_and_round_trip(tmp_path):
    assert index_dtype(2**31 - 1) == np.int32 and index_dtype(2**31) == np.int64
    g = tiny_graph()
    g64 = Graph(g.indptr, g.indices.astype(np.int64), g.features, g.labels, g.train_mask, g.val_mask,
                g.test_mask, num_classes=2, name="tiny")
    assert g64.indices.dtype == np.int32 and g64.content_hash() == g.content_hash()  # one canonical dtype
    write_graph(tmp_path / "g.h5", g64)
    with h5py.File(tmp_path / "g.h5") as f:
        assert f["indices"].dtype == np.int32 and f["indptr"].dtype == np.int64
    np.testing.assert_array_equal(read_graph(tmp_path / "g.h5").indices, g.indices)


def test_reads_a_version_1_file_as_the_same_graph_with_the_same_content_hash(tmp_path):
    """Version 1 stored int64 ids: it is read (ids converted on load) and hashes as the graph it
    holds, so runs, stores and checkpoints fingerprinted with it stay valid."""
    g = tiny_graph()
    digest = write_graph(tmp_path / "g.h5", g)
    with h5py.File(tmp_path / "g.h5", "a") as f:
        ids = f["indices"][()].astype(np.int64)
        del f["indices"]
        f["indices"] = ids
        f.attrs["format_version"] = 1
    back = read_graph(tmp_path / "g.h5")
    assert back.indices.dtype == np.int32 and back.content_hash() == digest
    np.testing.assert_array_equal(back.indices, g.indices)
    assert read_graph(tmp_path / "g.h5", features=False).num_edges == g.num_edges  # the streamed digest too
    with h5py.File(tmp_path / "g.h5", "a") as f:
        f["indices"][0] += 1  # an edited id is still caught in the int64 file
    with pytest.raises(GnnPipeError, match="content hash does not match"):
        read_graph(tmp_path / "g.h5")


def test_round_trip(tmp_path):
    g = tiny_graph()
    digest = write_graph(tmp_path / "g.h5", g)
    back = read_graph(tmp_path / "g.h5")
    for name, arr in g.arrays().items():
        np.testing.assert_array_equal(getattr(back, name), arr)
    assert back.content_hash() == digest and back.num_classes == 2 and back.name == "tiny"
    assert not list(tmp_path.glob(".g.h5.*"))  # no temp file left behind


def test_refuses_other_version(tmp_path):
    write_graph(tmp_path / "g.h5", tiny_graph())
    with h5py.File(tmp_path / "g.h5", "a") as f:
        f.attrs["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(GnnPipeError, match=r"g\.h5: graph format version .* 'build_graph' rule"):
        read_graph(tmp_path / "g.h5")


def test_refuses_edited_content(tmp_path):
    write_graph(tmp_path / "g.h5", tiny_graph())
    with h5py.File(tmp_path / "g.h5", "a") as f:
        f["labels"][0] = 1 - f["labels"][0]
    with pytest.raises(GnnPipeError, match="content hash does not match"):
        read_graph(tmp_path / "g.h5")


def test_refuses_truncated_file(tmp_path):
    write_graph(tmp_path / "g.h5", tiny_graph())
    data = (tmp_path / "g.h5").read_bytes()
    (tmp_path / "g.h5").write_bytes(data[: len(data) // 2])
    with pytest.raises(GnnPipeError, match="g.h5: .*(not a readable HDF5|damaged or truncated)"):
        read_graph(tmp_path / "g.h5")


def test_missing_file_names_the_rule(tmp_path):
    with pytest.raises(GnnPipeError, match="no such graph file; build it with the 'build_graph' rule"):
        read_graph(tmp_path / "absent.h5")


def test_invalid_graph_is_not_written(tmp_path):
    g = tiny_graph()
    g.labels[0] = 7
    with pytest.raises(GnnPipeError, match="labels must lie in"):
        write_graph(tmp_path / "g.h5", g)
    assert not list(tmp_path.iterdir())


def test_structure_only_read_still_checks_the_features_streamed_through_the_hash(tmp_path, monkeypatch):
    """features=False (the partition rule): no features held, the same structure, and a damaged
    feature is still refused: the file's features are hashed in slabs (here 3 rows each)."""
    import gnnpipe.io as gio

    g = tiny_graph()
    write_graph(tmp_path / "g.h5", g)
    monkeypatch.setattr(gio, "HASH_SLAB", 3 * 3 * 4)
    with h5py.File(tmp_path / "g.h5") as f:
        assert gio.hash_arrays({"features": f["features"]}) == gio.hash_arrays({"features": g.features})
    s = read_graph(tmp_path / "g.h5", features=False)
    assert s.features.shape == (g.num_nodes, 0)
    np.testing.assert_array_equal(s.indices, g.indices)
    np.testing.assert_array_equal(s.labels, g.labels)
    with h5py.File(tmp_path / "g.h5", "a") as f:
        f["features"][5, 2] += 1.0
    with pytest.raises(GnnPipeError, match="content hash does not match"):
        read_graph(tmp_path / "g.h5", features=False)


def test_renumbered_moves_every_node_with_its_edges_and_data():
    """``Graph.renumbered(order)``: node i is old node order[i]; the edge set is the old one renamed,
    every row keeps its neighbours in their old order, features/labels/masks move with the nodes;
    chunked (small ``chunk``) and whole give the same; a non-permutation is refused."""
    g = random_graph(n=300, avg_degree=8, seed=3)
    order = np.random.default_rng(0).permutation(g.num_nodes)
    new_id = np.empty_like(order)
    new_id[order] = np.arange(g.num_nodes)
    h = g.renumbered(order)
    assert h.indices.dtype == g.indices.dtype and h.num_edges == g.num_edges
    for i in (0, 17, 299):
        old = order[i]
        assert np.array_equal(h.indices[h.indptr[i]:h.indptr[i + 1]], new_id[g.indices[g.indptr[old]:g.indptr[old + 1]]])
    assert np.array_equal(h.features, g.features[order]) and np.array_equal(h.labels, g.labels[order])
    assert np.array_equal(h.test_mask, g.test_mask[order])
    src, dst = np.repeat(np.arange(300), np.diff(h.indptr)), h.indices
    old_edges = set(zip(np.repeat(np.arange(300), np.diff(g.indptr)).tolist(), g.indices.tolist()))
    assert set(zip(order[src].tolist(), order[dst].tolist())) == old_edges
    small = g.renumbered(order, chunk=7)
    assert np.array_equal(small.indptr, h.indptr) and np.array_equal(small.indices, h.indices)
    with pytest.raises(GnnPipeError, match="permutation"):
        g.renumbered(np.zeros(300, dtype=np.int64))
