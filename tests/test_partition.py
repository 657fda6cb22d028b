"""Partitioning: valid and balanced assignments, and stats against a brute-force count."""

import numpy as np
import pytest

from gnnpipe.graph import Graph
from gnnpipe.io import GnnPipeError
from gnnpipe.partition import (METHODS, partition_graph, partition_stats, read_partition,
                               symmetric_adjacency, write_partition)
from helpers import make_graph, random_graph


def rmat_graph(scale: int = 12, edge_factor: int = 16, seed: int = 0) -> Graph:
    """A skewed graph: R-MAT (a, b, c) = (0.57, 0.19, 0.19), 2^scale nodes, hubs with degrees
    in the thousands and ~18 % isolated nodes (at scale 12), symmetrised."""
    rng = np.random.default_rng(seed)
    n, m = 1 << scale, edge_factor << scale
    src, dst = np.zeros(m, dtype=np.int64), np.zeros(m, dtype=np.int64)
    for bit in range(scale):  # each bit of (src, dst) picks one of the four quadrants
        r = rng.random(m)
        src |= (r >= 0.76).astype(np.int64) << bit
        dst |= (((r >= 0.57) & (r < 0.76)) | (r >= 0.95)).astype(np.int64) << bit
    keep = src != dst
    return make_graph(src[keep], dst[keep], n)


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
    a = partition_graph(g, "contiguous", 2, balance_edges=True, balance_nodes=False)
    assert np.all(np.diff(a) >= 0)
    assert np.array_equal(a, [0] + [1] * 9)
    # nodes too: node 0 holds 1/10 of the nodes and 10/19 of the weights (in-degree + 1), 0.626 of
    # the two shares' sum 2; the cut nearest half (1.0) leaves nodes 0-2 (0.826) in part 0
    a = partition_graph(g, "contiguous", 2)
    assert np.array_equal(a, [0] * 3 + [1] * 7)
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
    # a 6-node star into 6 parts weighted by degree alone: METIS leaves parts empty, which no
    # engine can run on (isolated nodes into as many parts, by contrast, work; so does the star
    # when the node counts are balanced too)
    star = make_graph(np.arange(1, 6), np.zeros(5, dtype=np.int64), 6)
    with pytest.raises(GnnPipeError, match=r"into 6 parts left \d part\(s\) empty.*fewer parts"):
        partition_graph(star, "metis", 6, balance_nodes=False)
    assert sorted(partition_graph(star, "metis", 6).tolist()) == list(range(6))
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


@pytest.fixture(scope="module")
def skewed():
    return rmat_graph()


def test_metis_balances_nodes_and_edges_on_a_skewed_graph(skewed):
    """Issue #36: balancing the edges alone leaves the hubs' parts with few nodes and the others
    with many; the two-constraint METIS (the default) holds both within METIS's tolerance."""
    assert skewed.in_degrees().max() > 50 * skewed.num_edges / skewed.num_nodes  # hubs
    edges_only = partition_stats(skewed, partition_graph(skewed, "metis", 8, balance_nodes=False))
    both = partition_stats(skewed, partition_graph(skewed, "metis", 8))
    assert edges_only["node_balance"] > 1.3  # 1.65 when written
    assert both["node_balance"] < 1.1 and both["edge_balance"] < 1.1  # METIS's 3 %, on in-degree + 1
    assert both["node_balance"] < edges_only["node_balance"] - 0.2
    nodes_only = partition_stats(skewed, partition_graph(skewed, "metis", 8, balance_edges=False))
    assert nodes_only["edge_balance"] > 1.5  # the other way round: the hubs' edges pile up


def test_two_constraints_are_deterministic_by_seed(skewed):
    a = partition_graph(skewed, "metis", 4, seed=3)
    assert np.array_equal(a, partition_graph(skewed, "metis", 4, seed=3))
    assert not np.array_equal(a, partition_graph(skewed, "metis", 4, seed=4))


def test_one_constraint_through_either_call_is_the_same_partition(skewed):
    """The direct METIS call that carries two constraints equals pymetis on one: same options."""
    from gnnpipe.partition import _kway_constraints, _part_graph, vertex_weights
    xadj, adjncy = symmetric_adjacency(skewed)
    w = vertex_weights(skewed, False, True)
    assert w.ndim == 1 and vertex_weights(skewed, True, True).shape == (skewed.num_nodes, 2)
    assert vertex_weights(skewed, True, False) is None
    assert np.array_equal(_part_graph(xadj, adjncy, 4, 5, w), _kway_constraints(xadj, adjncy, 4, 5, w[:, None]))


def test_partition_cli_records_both_balances(tmp_path, skewed, capsys):
    import json

    from gnnpipe.cli import main
    from gnnpipe.graph import write_graph
    write_graph(tmp_path / "g.h5", skewed)
    for flags, name in (([], "nodes+edges"), (["--no-balance-nodes"], "edges")):
        main(["partition", "--graph", str(tmp_path / "g.h5"), "--method", "metis", "--parts", "4",
              *flags, "--out", str(tmp_path / "a.npy"), "--stats", str(tmp_path / "a.json")])
        st = json.loads((tmp_path / "a.json").read_text())
        assert st["balance"] == name and st["balance_nodes"] == (not flags)
        assert {"node_balance", "edge_balance", "nodes_per_part", "edges_per_part"} <= set(st)
        assert f"node balance {st['node_balance']:.3f}, edge balance {st['edge_balance']:.3f}" in capsys.readouterr().err


def test_a_parallel_run_records_and_the_report_shows_both_balances(tmp_path, skewed):
    """The run record's ``partition`` (from the run's chunk store) carries the node and edge
    balance of its parts; the report's runs table shows them; a single run has none."""
    from types import SimpleNamespace

    from gnnpipe.config import PartitionConfig
    from gnnpipe.report.records import Run
    from gnnpipe.report.tables import RUN_HEADER, run_row
    from gnnpipe.store import materialize
    from gnnpipe.tasks import NodeClassification

    a = partition_graph(skewed, "metis", 4, balance_nodes=False)
    materialize(skewed, a, tmp_path / "s.h5", method="metis-4")
    cfg = SimpleNamespace(store_path=str(tmp_path / "s.h5"), partitioning=PartitionConfig(balance_nodes=False))
    got = NodeClassification().record_fields(cfg, engine=None)["partition"]
    want = partition_stats(skewed, a)
    assert got["balance"] == "edges" and got["parts"] == 4 and got["method"] == "metis"
    assert sorted(got["nodes_per_part"]) == sorted(want["nodes_per_part"])  # the store renumbers the parts
    assert got["node_balance"] == pytest.approx(want["node_balance"])
    assert got["edge_balance"] == pytest.approx(want["edge_balance"])
    assert NodeClassification().record_fields(SimpleNamespace(store_path=None), engine=None) == {}

    record = {"run_id": "r", "mode": "graph", "dataset": "d", "model": "sage", "layers": 2, "world_size": 4,
              "stages": 1, "ways": 4, "chunks": 4, "epoch_time_s": 1.0, "comm_bytes_per_epoch": 1,
              "comm_bytes_predicted": 1, "peak_mem_bytes": 1, "test_acc": 0.5, "partition": got}
    cell = dict(zip(RUN_HEADER, run_row(Run(record))))["parts: nodes / edges"]
    assert cell == f"{got['node_balance']:.2f} / {got['edge_balance']:.2f} (edges)"
    record.pop("partition")
    assert dict(zip(RUN_HEADER, run_row(Run(record))))["parts: nodes / edges"] == "—"


def test_plan_statistics_are_cached_per_balance(tmp_path, skewed):
    """The cost model's partition statistics (``plan-stats``) are those of the run's balance: a
    cache made with the other one is recomputed, not reused."""
    from gnnpipe.graph import write_graph
    from gnnpipe.planning.stats import cached_graph_stats
    write_graph(tmp_path / "g.h5", skewed)
    cache = tmp_path / "plan-stats.json"
    both = cached_graph_stats(tmp_path / "g.h5", [4], cache_file=cache)
    edges = cached_graph_stats(tmp_path / "g.h5", [4], balance_nodes=False, cache_file=cache)
    assert both["balance_nodes"] and not edges["balance_nodes"]
    assert both["partitions"]["4"]["node_balance"] < edges["partitions"]["4"]["node_balance"]


@pytest.mark.long  # two Snakemake calls: 15-45 s
def test_a_store_of_another_balance_is_rebuilt(tmp_path):
    """The workflow's partition (and so the chunk store after it) is rebuilt when the balance
    changes: the rule's parameters carry it (Snakemake's params rerun trigger)."""
    from helpers import snakemake, write_config
    target = "results/chunks/tiny/metis-2.h5"
    before = snakemake(tmp_path, write_config(tmp_path, lambda c: None), "--cores", "2", target)
    assert before.returncode == 0, before.stderr[-3000:]

    def edges_only(c):
        c["partitioning"] = {"balance_nodes": False}
    again = snakemake(tmp_path, write_config(tmp_path, edges_only), "-n", target)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "rule partition:" in again.stdout and "rule materialize:" in again.stdout
    assert "--no-balance-nodes" in again.stdout  # the reason: its params changed
