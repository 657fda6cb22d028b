"""Partitioning: valid and balanced assignments, and stats against a brute-force count."""

import numpy as np
import pytest

from gnnpipe.graph import Graph
from gnnpipe.io import GnnPipeError
from gnnpipe.partition import (METHODS, partition_graph, partition_stats, read_partition,
                               symmetric_adjacency, write_partition)
from helpers import make_graph, random_graph


def brute_force_stats(graph: Graph, a: np.ndarray, parts: int) -> dict:
    """The same stats with plain Python loops over the edges."""
    cut, edges, mirrors = 0, [0] * parts, [set() for _ in range(parts)]
    for v in range(graph.num_nodes):
        for u in graph.indices[graph.indptr[v]:graph.indptr[v + 1]]:
            edges[a[v]] += 1
            if a[u] != a[v]:
                cut += 1
                mirrors[a[v]].add(int(u))
    nodes = [int(np.sum(a == p)) for p in range(parts)]
    return {"edge_cut": cut, "edges_per_part": edges, "nodes_per_part": nodes,
            "mirrors": [len(s) for s in mirrors], "mirrors_total": sum(len(s) for s in mirrors),
            "node_balance": max(nodes) / (sum(nodes) / parts),
            "edge_balance": max(edges) / (sum(edges) / parts)}


@pytest.fixture(scope="module")
def graph():
    return random_graph()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("parts", [2, 3, 5])
def test_partition_is_valid_and_balanced(graph, method, parts):
    a = partition_graph(graph, method, parts, seed=1)
    assert a.dtype == np.int64 and a.shape == (graph.num_nodes,)
    assert a.min() == 0 and a.max() == parts - 1
    assert np.all(np.bincount(a, minlength=parts) > 0)
    s = partition_stats(graph, a)
    # METIS balances the vertex weights (in-degree + 1) to its default 3% tolerance
    assert s["edge_balance"] < 1.1
    assert s["node_balance"] < (1.01 if method == "random" else 1.3)


def test_balance_by_nodes(graph):
    for method in ("metis", "contiguous"):
        s = partition_stats(graph, partition_graph(graph, method, 4, balance_edges=False))
        assert s["node_balance"] < 1.05, method
    a = partition_graph(graph, "contiguous", 4, balance_edges=False)
    assert np.all(np.diff(a) >= 0) and np.ptp(np.bincount(a)) <= 1


def test_metis_cuts_fewer_edges_than_random(graph):
    metis = partition_stats(graph, partition_graph(graph, "metis", 4))
    rnd = partition_stats(graph, partition_graph(graph, "random", 4))
    assert metis["edge_cut"] < 0.5 * rnd["edge_cut"]
    assert metis["mirrors_total"] < 0.5 * rnd["mirrors_total"]


def test_metis_finds_the_obvious_cut():
    # two 10-cliques joined by one edge, given in one direction only: METIS must see it undirected
    i, j = np.triu_indices(10, 1)
    src = np.concatenate([i, i + 10, [9]])
    dst = np.concatenate([j, j + 10, [10]])
    g = make_graph(src, dst, 20, symmetrize=False)
    a = partition_graph(g, "metis", 2, balance_edges=False)
    assert len(set(a[:10])) == 1 and len(set(a[10:])) == 1 and a[0] != a[10]
    s = partition_stats(g, a)
    assert s["edge_cut"] == 1 and sorted(s["mirrors"]) == [0, 1]  # only 9 -> 10 is stored


def test_seeds_are_reproducible(graph):
    for method in ("metis", "random"):
        assert np.array_equal(partition_graph(graph, method, 3, seed=7),
                              partition_graph(graph, method, 3, seed=7))
    assert not np.array_equal(partition_graph(graph, "random", 3, seed=1),
                              partition_graph(graph, "random", 3, seed=2))


def test_contiguous_by_edges_follows_the_degrees():
    # directed star into node 0: weights (in-degree + 1) are 10, 1, ..., 1, so the half
    # weight (9.5) is reached by node 0 alone
    g = make_graph(np.arange(1, 10), np.zeros(9, dtype=np.int64), 10, symmetrize=False)
    a = partition_graph(g, "contiguous", 2, balance_edges=True)
    assert np.all(np.diff(a) >= 0)
    assert np.array_equal(a, [0] + [1] * 9)
    # more parts than the weights ask for: still every part non-empty, ids in order
    a = partition_graph(g, "contiguous", 10)
    assert np.array_equal(a, np.arange(10))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_stats_match_brute_force(method, parts):
    g = random_graph(n=60, avg_degree=5, seed=3, symmetrize=False)  # a directed graph too
    a = partition_graph(g, method, parts, seed=0)
    s = partition_stats(g, a)
    want = brute_force_stats(g, a, parts)
    for key, value in want.items():
        assert s[key] == pytest.approx(value), key
    assert s["parts"] == parts and s["num_nodes"] == 60 and s["num_edges"] == g.num_edges
    assert s["mirrors_over_n"] == pytest.approx(want["mirrors_total"] / 60)


def test_stats_on_a_tiny_graph_by_hand():
    # path 0-1-2-3 (symmetrised), parts {0,1} {2,3}: edges 1->2 and 2->1 are cut
    g = make_graph([0, 1, 2], [1, 2, 3], 4)
    s = partition_stats(g, np.array([0, 0, 1, 1]))
    assert s["edge_cut"] == 2 and s["mirrors"] == [1, 1] and s["edges_per_part"] == [3, 3]
    assert s["mirrors_total"] == 2 and s["mirrors_over_n"] == 0.5 and s["edge_balance"] == 1.0


def test_one_part_needs_no_metis(graph):
    for method in METHODS:
        a = partition_graph(graph, method, 1)
        assert np.array_equal(a, np.zeros(graph.num_nodes))
    s = partition_stats(graph, np.zeros(graph.num_nodes, dtype=np.int64))
    assert s["edge_cut"] == 0 and s["mirrors"] == [0]


def test_symmetric_adjacency_is_undirected_without_loops():
    g = make_graph([0, 0, 1, 2], [1, 0, 2, 2], 4, symmetrize=False)  # directed, with self loops
    xadj, adj = symmetric_adjacency(g)
    pairs = {(v, int(u)) for v in range(4) for u in adj[xadj[v]:xadj[v + 1]]}
    assert pairs == {(0, 1), (1, 0), (1, 2), (2, 1)}


@pytest.mark.parametrize("bad, match", [
    (dict(method="spectral", parts=2), "unknown partition method 'spectral'"),
    (dict(method="metis", parts=0), "parts must be an integer >= 1"),
    (dict(method="random", parts=5), "cannot split a graph of 4 nodes into 5 parts"),
])
def test_bad_requests_are_refused(bad, match):
    g = make_graph([0, 1, 2], [1, 2, 3], 4)
    with pytest.raises(GnnPipeError, match=match):
        partition_graph(g, **bad)


def test_metis_empty_part_is_refused():
    # a 6-node star into 6 parts weighted by degree: METIS leaves parts empty, which no
    # engine can run on (isolated nodes into as many parts, by contrast, work)
    star = make_graph(np.arange(1, 6), np.zeros(5, dtype=np.int64), 6)
    with pytest.raises(GnnPipeError, match=r"into 6 parts left \d part\(s\) empty.*fewer parts"):
        partition_graph(star, "metis", 6)
    isolated = make_graph(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 8)
    assert sorted(partition_graph(isolated, "metis", 8).tolist()) == list(range(8))


def test_partition_file_round_trip(tmp_path, graph):
    a = partition_graph(graph, "metis", 3)
    path = tmp_path / "p" / "metis-3.npy"
    write_partition(path, a)
    assert np.array_equal(read_partition(path, graph.num_nodes, parts=3), a)
    assert [f.name for f in path.parent.iterdir()] == ["metis-3.npy"]  # no temporary left
    with pytest.raises(GnnPipeError, match=r"has shape \(300,\), the graph has 299 nodes.*'partition' rule"):
        read_partition(path, graph.num_nodes - 1)
    with pytest.raises(GnnPipeError, match=r"part ids must lie in \[0, 2\)"):
        read_partition(path, graph.num_nodes, parts=2)
    with pytest.raises(GnnPipeError, match="part 3 of 4 is empty"):
        read_partition(path, graph.num_nodes, parts=4)
    with pytest.raises(GnnPipeError, match="no such partition file"):
        read_partition(tmp_path / "missing.npy", 10)
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    with pytest.raises(GnnPipeError, match="not a readable .npy partition"):
        read_partition(tmp_path / "junk.npy", 10)
    with pytest.raises(GnnPipeError, match="non-negative part ids"):
        write_partition(tmp_path / "neg.npy", np.array([0, -1]))


def test_metis_refuses_early_naming_the_memory_it_needs(graph):
    """Not enough memory for METIS's structures: one line with the need, before any is built."""
    from gnnpipe.costmodel.stages import metis_extra_bytes

    need = metis_extra_bytes(graph.num_nodes, graph.num_edges)
    with pytest.raises(GnnPipeError, match=rf"METIS on .*\({graph.num_nodes:,} nodes, {graph.num_edges:,} "
                                           rf"stored edges\) needs about {need / 2**30:.1f} GiB beside the graph, "
                                           r"0\.0 GiB are available.*'contiguous' or 'random'"):
        partition_graph(graph, "metis", 2, memory_bytes=1000)
    assert partition_graph(graph, "metis", 2, memory_bytes=int(need) + 1).shape == (graph.num_nodes,)
    assert partition_graph(graph, "random", 2, memory_bytes=1000).shape == (graph.num_nodes,)  # no METIS
