"""The chunk store: renumbering, halos, send lists and blocks against the original graph."""

import h5py
import numpy as np
import pytest
import torch

from gnnpipe.io import GnnPipeError
from gnnpipe.partition import partition_graph, partition_stats
from gnnpipe.store import FORMAT_VERSION, NODE_ARRAYS, ChunkStore, materialize
from helpers import make_graph, random_graph


def aggregate(block, x_src: torch.Tensor) -> torch.Tensor:
    """GCN-normalised sum over in-edges, with the block's (whole-graph) degrees."""
    row = block.dst_of_edge()
    w = ((block.deg_dst[row] + 1) * (block.deg_src[block.indices] + 1)).rsqrt()
    out = torch.zeros(block.n_dst, x_src.shape[1], dtype=x_src.dtype)
    return out.index_add_(0, row, x_src[block.indices] * w[:, None])


def dense_reference(graph) -> np.ndarray:
    """The same aggregation of ``graph.features`` with a dense matrix, original ids."""
    n = graph.num_nodes
    a = np.zeros((n, n))
    a[np.repeat(np.arange(n), graph.in_degrees()), graph.indices] = 1.0  # a[v, u]: edge u -> v
    d_in, d_out = a.sum(1), a.sum(0)
    return (a / np.sqrt(np.outer(d_in + 1, d_out + 1))) @ graph.features.astype(np.float64)


def edges_of(indptr, indices):
    return np.repeat(np.arange(len(indptr) - 1), np.diff(indptr)), indices


@pytest.fixture(scope="module")
def directed():
    return random_graph(n=200, avg_degree=6, seed=5, symmetrize=False)  # deg_in != deg_out


@pytest.fixture(scope="module", params=[("metis", 4), ("random", 3), ("contiguous", 2), ("metis", 1)],
                ids=lambda x: f"{x[0]}-{x[1]}")
def built(request, directed, tmp_path_factory):
    method, parts = request.param
    a = partition_graph(directed, method, parts, seed=2)
    path = tmp_path_factory.mktemp("store") / f"{method}-{parts}.h5"
    materialize(directed, a, path, method=method)
    with ChunkStore(path, expect_graph_hash=directed.content_hash(), expect_parts=parts) as store:
        yield directed, a, store


def test_header_and_renumbering(built):
    graph, a, store = built
    k = store.num_parts
    assert (store.num_nodes, store.num_edges, store.num_features, store.num_classes) == (
        graph.num_nodes, graph.num_edges, graph.num_features, graph.num_classes)
    assert store.graph_hash == graph.content_hash() and store.method in ("metis", "random", "contiguous")
    assert np.array_equal(np.sort(store.perm), np.arange(graph.num_nodes))  # a permutation
    assert np.array_equal(np.diff(store.offsets), np.bincount(a, minlength=k))
    for p in range(k):  # part p is exactly the range [offsets[p], offsets[p+1])
        assert np.all(a[store.perm[store.offsets[p]:store.offsets[p + 1]]] == p)
    assert np.array_equal(store.deg_in(), graph.in_degrees()[store.perm])
    assert np.array_equal(store.deg_out(), graph.out_degrees()[store.perm])
    assert np.array_equal(store.part_of(np.arange(graph.num_nodes)), a[store.perm])


def test_every_edge_appears_once(built):
    graph, _, store = built
    perm = store.perm
    got = []
    for p in range(store.num_parts):
        part = store.part(p)
        dst, src = edges_of(part.indptr, part.indices)
        assert np.all(np.diff(part.indices)[np.diff(dst) == 0] > 0)  # sorted per row
        got.append(perm[src] * graph.num_nodes + perm[dst + part.start])  # original (src, dst)
    got = np.sort(np.concatenate(got))
    dst, src = edges_of(graph.indptr, graph.indices)
    assert np.array_equal(got, np.sort(src * graph.num_nodes + dst))


def test_node_arrays_follow_perm(built):
    graph, _, store = built
    for name in NODE_ARRAYS:
        assert np.array_equal(store.read_all(name), getattr(graph, name)[store.perm]), name
    part = store.part(store.num_parts - 1)
    assert np.array_equal(part.features, graph.features[store.perm[part.start:part.end]])
    with pytest.raises(ValueError, match="read_all reads one of"):
        store.read_all("halo")


def test_inner_nodes_first_then_boundary(built):
    _, _, store = built
    for p in range(store.num_parts):
        part = store.part(p)
        dst, src = edges_of(part.indptr, part.indices)
        outside = np.bincount(dst[(src < part.start) | (src >= part.end)], minlength=part.num_nodes) > 0
        assert not outside[:part.n_inner].any() and outside[part.n_inner:].all()
        orig = store.perm[part.start:part.end]
        assert np.all(np.diff(orig[:part.n_inner]) > 0) and np.all(np.diff(orig[part.n_inner:]) > 0)


def test_halos_match_stats(built):
    graph, a, store = built
    stats = partition_stats(graph, a)
    for p in range(store.num_parts):
        part = store.part(p)
        outside = part.indices[(part.indices < part.start) | (part.indices >= part.end)]
        assert np.array_equal(part.halo, np.unique(outside))
        assert len(part.halo) == stats["mirrors"][p]


def test_local_block_matches_full_graph(built):
    graph, _, store = built
    ref = dense_reference(graph)[store.perm]  # new-id order
    x = torch.from_numpy(store.read_all("features")).double()
    for p in range(store.num_parts):
        block = store.local_block(p, torch.float64)
        start, end = store.offsets[p], store.offsets[p + 1]
        halo = torch.from_numpy(store.part(p).halo)
        assert block.n_src == end - start + len(halo) and block.dst_offset == 0
        x_src = torch.cat([x[start:end], x[halo]])
        assert torch.allclose(aggregate(block, x_src), torch.from_numpy(ref[start:end]), atol=1e-12)


def test_chunk_and_full_blocks_match_full_graph(built):
    graph, _, store = built
    ref = torch.from_numpy(dense_reference(graph)[store.perm])
    x = torch.from_numpy(store.read_all("features")).double()
    full = store.full_block(torch.float64)
    assert (full.n_dst, full.n_src, full.nnz) == (graph.num_nodes, graph.num_nodes, graph.num_edges)
    assert torch.allclose(aggregate(full, x), ref, atol=1e-12)
    for c in range(store.num_parts):
        block = store.chunk_block(c, torch.float64)
        start, end = int(store.offsets[c]), int(store.offsets[c + 1])
        assert block.dst_offset == start and block.n_src == graph.num_nodes
        assert torch.allclose(aggregate(block, x), ref[start:end], atol=1e-12)


def test_send_lists_reproduce_halos(built):
    _, _, store = built
    k, off = store.num_parts, store.offsets
    sends = [store.send_index(p) for p in range(k)]
    for q in range(k):
        halo = store.part(q).halo
        assert len(sends[q][q]) == 0
        # q's halo is the concatenation, over owners p, of the rows p sends q
        assert np.array_equal(np.concatenate([off[p] + sends[p][q] for p in range(k)]), halo)
        assert store.recv_counts(q) == [len(sends[p][q]) for p in range(k)]
        assert sum(store.recv_counts(q)) == len(halo)


def test_halo_exchange_gives_the_full_graph_result(built):
    """One simulated all-to-all from the send lists, then aggregation: the exact full-graph result."""
    graph, _, store = built
    k, off = store.num_parts, store.offsets
    x = torch.from_numpy(store.read_all("features")).double()
    own = [x[off[p]:off[p + 1]] for p in range(k)]
    out = []
    for q in range(k):
        received = [own[p][torch.from_numpy(store.send_index(p)[q])] for p in range(k)]
        assert [len(r) for r in received] == store.recv_counts(q)
        out.append(aggregate(store.local_block(q, torch.float64), torch.cat([own[q], *received])))
    assert torch.allclose(torch.cat(out), torch.from_numpy(dense_reference(graph)[store.perm]), atol=1e-12)


def test_hand_example(tmp_path):
    # path 0-1-2-3-4-5, parts {1,3,5} -> 0 and {0,2,4} -> 1 (interleaved on purpose)
    g = make_graph([0, 1, 2, 3, 4], [1, 2, 3, 4, 5], 6)
    materialize(g, np.array([1, 0, 1, 0, 1, 0]), tmp_path / "s.h5")
    with ChunkStore(tmp_path / "s.h5") as s:
        # part 0 = {1, 3, 5}: 5's only neighbour 4 is outside too -> every node is boundary
        assert s.perm.tolist() == [1, 3, 5, 0, 2, 4] and s.offsets.tolist() == [0, 3, 6]
        p0, p1 = s.part(0), s.part(1)
        assert (p0.n_inner, p1.n_inner) == (0, 0)
        assert p0.halo.tolist() == [3, 4, 5] and p1.halo.tolist() == [0, 1, 2]
        assert [x.tolist() for x in s.send_index(0)] == [[], [0, 1, 2]]
        assert s.recv_counts(0) == [0, 3]
    # path 0-1-2-3-4-5, parts {0,1,2} {3,4,5}: 0 and 1 inner, 2 boundary; 3 boundary, 4 and 5 inner
    materialize(g, np.array([0, 0, 0, 1, 1, 1]), tmp_path / "t.h5")
    with ChunkStore(tmp_path / "t.h5") as s:
        assert s.perm.tolist() == [0, 1, 2, 4, 5, 3]
        assert [s.part(p).n_inner for p in range(2)] == [2, 2]
        assert s.part(0).halo.tolist() == [5] and s.part(1).halo.tolist() == [2]
        assert [x.tolist() for x in s.send_index(0)] == [[], [2]]
        assert [x.tolist() for x in s.send_index(1)] == [[2], []]  # node 3 is row 2 of part 1
        block = s.local_block(1)
        # rows are original 4, 5, 3; row 3's sources are new ids [2, 3] = original 2 (halo,
        # position 3 + 0) and original 4 (own row 0): in global new-id order
        assert block.indptr.tolist() == [0, 2, 3, 5] and block.indices.tolist() == [1, 2, 0, 3, 0]
        assert block.deg_src.tolist() == [2, 1, 2, 2]


def test_one_part(tmp_path, directed, capsys):
    materialize(directed, np.zeros(directed.num_nodes, dtype=np.int64), tmp_path / "one.h5", progress=True)
    assert "materialize one.h5" in capsys.readouterr().err  # the tqdm bar
    with ChunkStore(tmp_path / "one.h5", expect_parts=1) as s:
        assert np.array_equal(s.perm, np.arange(directed.num_nodes))
        assert s.part(0).n_inner == directed.num_nodes and len(s.part(0).halo) == 0
        assert [len(x) for x in s.send_index(0)] == [0] and s.recv_counts(0) == [0]
        local, full = s.local_block(0), s.full_block()
        assert torch.equal(local.indptr, full.indptr) and torch.equal(local.indices, full.indices)


def test_empty_part_is_refused_and_nothing_written(tmp_path, directed):
    a = np.zeros(directed.num_nodes, dtype=np.int64)
    a[:10] = 2  # part 1 empty
    with pytest.raises(GnnPipeError, match="part 1 of the 3 parts is empty"):
        materialize(directed, a, tmp_path / "bad.h5")
    with pytest.raises(GnnPipeError, match=r"has shape \(5,\)"):
        materialize(directed, a[:5], tmp_path / "bad.h5")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture()
def store_file(tmp_path, directed):
    path = tmp_path / "metis-2.h5"
    materialize(directed, partition_graph(directed, "metis", 2), path, method="metis")
    return path


RULE = r"'materialize' rule .*`gnnpipe materialize`"


def test_refuses_missing_and_non_hdf5(tmp_path):
    with pytest.raises(GnnPipeError, match=r"missing\.h5: no such chunk store; build it with the 'materi"):
        ChunkStore(tmp_path / "missing.h5")
    (tmp_path / "junk.h5").write_bytes(b"this is not HDF5" * 10)
    with pytest.raises(GnnPipeError, match=r"junk\.h5: not a readable HDF5 file.*" + RULE):
        ChunkStore(tmp_path / "junk.h5")


def test_refuses_truncated(store_file):
    data = store_file.read_bytes()
    store_file.write_bytes(data[:len(data) // 2])
    with pytest.raises(GnnPipeError, match=r"metis-2\.h5: .*truncated.*" + RULE):
        with ChunkStore(store_file) as s:  # whichever read first meets the missing bytes
            s.verify()


def test_refuses_other_version(store_file):
    with h5py.File(store_file, "a") as f:
        f.attrs["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(GnnPipeError, match=f"format version {FORMAT_VERSION + 1}, this gnnpipe reads "
                                           f"version {FORMAT_VERSION}.*" + RULE):
        ChunkStore(store_file)


def test_refuses_stale_graph_and_wrong_parts(store_file, directed):
    ChunkStore(store_file, expect_graph_hash=directed.content_hash(), expect_parts=2).close()
    with pytest.raises(GnnPipeError, match=r"metis-2\.h5: stale: made from graph .*" + RULE):
        ChunkStore(store_file, expect_graph_hash="0" * 64)
    with pytest.raises(GnnPipeError, match=r"chunk store made for 2 parts, this run needs 4.*" + RULE):
        ChunkStore(store_file, expect_parts=4)


def test_damage_is_detected_per_dataset(store_file):
    with h5py.File(store_file, "a") as f:
        f["parts/1/features"][0, 0] += 1.0
    with ChunkStore(store_file) as s:
        s.part(0), s.local_block(0), s.local_block(1)  # part 1's features are not read
        with pytest.raises(GnnPipeError, match=r"content hash of /parts/1/features does not match"):
            s.part(1)
        with pytest.raises(GnnPipeError, match="content hash of /parts/1/features"):
            s.verify()
    with ChunkStore(store_file, verify=False) as s:
        assert s.part(1).features.shape[0] == s.offsets[2] - s.offsets[1]


def test_reopens_after_close_and_verifies(store_file):
    s = ChunkStore(store_file)
    s.verify()
    s.close()
    assert s.part(1).num_nodes == s.offsets[2] - s.offsets[1]  # reopened lazily
    s.close()
    with pytest.raises(IndexError, match="part 2 out of range"):
        s.part(2)


@pytest.mark.parametrize("where, key, value", [
    ("/", "num_classes", 20), ("/", "num_features", 2), ("/", "name", "another"),
    ("parts/1", "start", 1), ("parts/0", "n_inner", 0)])
def test_edited_attributes_are_refused_on_open(store_file, where, key, value):
    with h5py.File(store_file, "a") as f:
        f[where].attrs[key] = value
    with pytest.raises(GnnPipeError, match=r"attributes .* do not match their hash \(damaged or edited\).*" + RULE):
        ChunkStore(store_file)
    with pytest.raises(GnnPipeError, match="do not match their hash"):
        ChunkStore(store_file, verify=False)  # cheap: checked even when the datasets are not


def test_content_hash_covers_the_attributes(tmp_path, directed):
    a = partition_graph(directed, "metis", 2)
    materialize(directed, a, tmp_path / "x.h5", method="metis")
    materialize(directed, a, tmp_path / "y.h5", method="other")  # the same datasets, one attribute apart
    with ChunkStore(tmp_path / "x.h5") as x, ChunkStore(tmp_path / "y.h5") as y:
        x.verify(), y.verify()
        assert x.attrs_hash != y.attrs_hash and x.content_hash != y.content_hash


def test_engines_refuse_a_store_cut_from_another_graph(tmp_path, directed):
    """A run's store must come from the run's graph.h5, whatever the file names say."""
    from dataclasses import replace

    from gnnpipe.config import (GraphParallelConfig, ModelConfig, PartitionConfig, PipelineConfig,
                                RunConfig, TrainingConfig)
    from gnnpipe.graph import write_graph
    from gnnpipe.parallel.layout_engine import LayoutEngine

    other = random_graph(n=200, avg_degree=6, seed=6, symmetrize=False)
    graph_path, store_path = tmp_path / "graph.h5", tmp_path / "metis-2.h5"
    write_graph(graph_path, directed)
    materialize(other, partition_graph(other, "metis", 2), store_path, graph_hash=other.content_hash())
    cfg = RunConfig(run_id="t", mode="pipeline", dataset_name="d", graph_path=str(graph_path),
                    store_path=str(store_path), out_dir="", model=ModelConfig(kind="gcn", layers=2, hidden=4),
                    training=TrainingConfig(epochs=1), partitioning=PartitionConfig(),
                    pipeline=PipelineConfig(balance="uniform"), graph_parallel=GraphParallelConfig(),
                    workers=1, stages=1, ways=1, chunks=2)
    with pytest.raises(GnnPipeError, match=r"metis-2\.h5: stale: made from graph " + other.content_hash()[:12]):
        LayoutEngine(cfg, None, None, "cpu")
    materialize(directed, partition_graph(directed, "metis", 2), store_path, graph_hash=directed.content_hash())
    assert LayoutEngine(cfg, None, None, "cpu").N == directed.num_nodes
    with pytest.raises(GnnPipeError, match="no such graph file"):
        LayoutEngine(replace(cfg, graph_path=str(tmp_path / "nope.h5")), None, None, "cpu")
