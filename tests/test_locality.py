"""The single engine's locality order computed once per graph (``gnnpipe locality``, rule locality)
and read by every single-process run on it: the same numbering as computing it, bit for bit."""

import numpy as np
import pytest
import torch

from gnnpipe import partition
from gnnpipe.cli import main
from gnnpipe.io import GnnPipeError
from helpers import run_cfg, two_community_graph

MODEL = {"kind": "sage", "layers": 2, "hidden": 8, "dropout": 0.0}


@pytest.fixture
def parts_of_50(monkeypatch):
    monkeypatch.setattr(partition, "LOCALITY_PART_NODES", 50)  # 200 nodes: four parts


def no_metis(*args, **kwargs):
    raise AssertionError("METIS ran: the order should have been read from its file")


def test_the_file_holds_the_order_computing_gives(tmp_path, parts_of_50, monkeypatch):
    graph = two_community_graph()
    digest = graph.content_hash()
    computed = partition.node_order(graph, "locality", seed=3)
    assert computed["parts"] == 4 and "file" not in computed
    path = tmp_path / "locality.npz"
    assert partition.write_locality(path, graph, seed=3)["parts"] == 4
    monkeypatch.setattr(partition, "_metis", no_metis)
    read = partition.node_order(graph, "locality", seed=3, path=path, graph_hash=digest)
    assert np.array_equal(read.pop("order"), computed.pop("order"))
    read.pop("seconds"), computed.pop("seconds")  # METIS's time, this call's and the file's
    assert read == {**computed, "file": str(path)}
    # "given" never reads it; a missing file is computed (gnnpipe train outside the workflow)
    assert partition.node_order(graph, "given", path=path) == {"node_order": "given", "parts": 0, "seconds": 0.0}
    monkeypatch.undo()
    monkeypatch.setattr(partition, "LOCALITY_PART_NODES", 50)
    assert partition.node_order(graph, "locality", seed=3, path=tmp_path / "none.npz")["parts"] == 4


def test_a_file_of_another_graph_or_seed_is_refused_in_one_line(tmp_path, parts_of_50):
    graph, other = two_community_graph(), two_community_graph(seed=1)
    path = tmp_path / "locality.npz"
    partition.write_locality(path, graph, seed=0)
    for g, seed, what in ((other, 0, "computed for another graph"), (graph, 1, "computed with seed 0")):
        with pytest.raises(GnnPipeError, match=what) as e:
            partition.node_order(g, "locality", seed=seed, path=path)
        assert "\n" not in str(e.value) and "rule locality" in str(e.value)
    path.write_bytes(b"not a zip")
    with pytest.raises(GnnPipeError, match="not a readable locality order"):
        partition.node_order(graph, "locality", path=path)


def test_a_small_graph_keeps_its_ids_through_the_file(tmp_path, capsys):
    graph = two_community_graph()  # 200 nodes < 2 * 1,024
    path = tmp_path / "locality.npz"
    partition.write_locality(path, graph)
    assert partition.node_order(graph, "locality", path=path) == {
        "node_order": "given", "parts": 0, "seconds": 0.0, "file": str(path)}


def test_the_single_engine_reads_the_rules_file(tmp_path, parts_of_50, monkeypatch, capsys):
    """``gnnpipe locality`` writes the file at the run's locality_path; the engine built from it holds
    the graph exactly as one that ran METIS itself."""
    from gnnpipe.parallel.single import SingleEngine

    cfg = run_cfg(tmp_path, MODEL, epochs=1)
    assert cfg.locality_path == f"{tmp_path}/results/partitions/two/locality.npz"
    computed = SingleEngine(cfg, None, None, torch.device("cpu"))
    assert "file" not in computed.extra_info()["node_order"]
    assert main(["locality", "--graph", cfg.graph_path, "--seed", str(cfg.partitioning.seed),
                 "--out", cfg.locality_path]) == 0
    assert "4 METIS parts" in capsys.readouterr().err
    monkeypatch.setattr(partition, "_metis", no_metis)
    read = SingleEngine(cfg, None, None, torch.device("cpu"))
    assert read.extra_info()["node_order"]["file"] == cfg.locality_path
    for a, b in ((computed.x, read.x), (computed.y, read.y), (computed.block.indptr, read.block.indptr),
                 (computed.block.indices, read.block.indices)):
        assert torch.equal(a, b)
