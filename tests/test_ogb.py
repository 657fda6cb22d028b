"""OGB datasets read from OGB's own raw layout through ogb's readers (gnnpipe.data.ogb)."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import http.server
import socket
import threading

import numpy as np
import pytest

from gnnpipe.config import DatasetConfig, OgbConfig
from gnnpipe.data import dataset_summary, load_dataset
from gnnpipe.data import ogb as ogb_mod
from gnnpipe.io import GnnPipeError
from ogb_fixture import EDGES, NUM_NODES, write_binary_dataset, write_csv_dataset, zip_dataset


def edge_set(graph) -> set[tuple[int, int]]:
    """{(src, dst)} from the in-edge CSR."""
    dst = np.repeat(np.arange(graph.num_nodes), np.diff(graph.indptr))
    return set(zip(graph.indices.tolist(), dst.tolist()))


def expected_edges(symmetrize: bool, self_loops: str) -> set[tuple[int, int]]:
    pairs = {(int(s), int(d)) for s, d in EDGES}
    if symmetrize:
        pairs |= {(d, s) for s, d in pairs}
    if self_loops == "remove":
        pairs = {(s, d) for s, d in pairs if s != d}
    elif self_loops == "add":
        pairs = {(s, d) for s, d in pairs if s != d} | {(v, v) for v in range(NUM_NODES)}
    return pairs


def ogb_cfg(root, name="ogbn-arxiv", download=False, symmetrize=True, self_loops="remove"):
    return DatasetConfig(kind="ogb", symmetrize=symmetrize, self_loops=self_loops,
                         ogb=OgbConfig(name=name, root=str(root), download=download))


@pytest.mark.parametrize("symmetrize,self_loops", [(True, "remove"), (False, "keep"), (True, "add")])
def test_arxiv_raw_layout_loads_through_ogb(tmp_path, symmetrize, self_loops):
    tiny = write_csv_dataset(tmp_path)
    g = load_dataset(ogb_cfg(tmp_path, symmetrize=symmetrize, self_loops=self_loops), "arxiv")
    assert g.num_nodes == NUM_NODES and g.num_classes == 40  # from ogb's master.csv
    assert edge_set(g) == expected_edges(symmetrize, self_loops)
    assert g.num_edges == len(expected_edges(symmetrize, self_loops))  # duplicates merged
    assert g.symmetric is symmetrize and g.self_loops is (self_loops != "remove")
    np.testing.assert_allclose(g.features, tiny.features, rtol=1e-6)
    assert g.features.dtype == np.float32
    np.testing.assert_array_equal(g.labels, tiny.labels)
    for mask, part in [(g.train_mask, "train"), (g.val_mask, "valid"), (g.test_mask, "test")]:
        np.testing.assert_array_equal(np.flatnonzero(mask), tiny.splits[part])
    assert g.source == "ogb:ogbn-arxiv" and g.name == "arxiv"


def test_products_inverse_edges_come_from_ogb_metadata(tmp_path):
    # ogbn-products has add_inverse_edge=True in master.csv: ogb's reader adds the reverse
    # edges itself, so the graph is symmetric even with symmetrize off.
    write_csv_dataset(tmp_path, name="ogbn-products", split_type="sales_ranking")
    g = load_dataset(ogb_cfg(tmp_path, name="ogbn-products", symmetrize=False), "products")
    assert g.num_classes == 47
    assert edge_set(g) == expected_edges(True, "remove")
    assert g.symmetric


def test_papers100m_binary_layout_masks_unlabelled_nodes(tmp_path):
    tiny = write_binary_dataset(tmp_path, unlabelled=(2, 6, 9))
    g = load_dataset(ogb_cfg(tmp_path, name="ogbn-papers100M"), "papers")
    assert g.num_classes == 172
    assert edge_set(g) == expected_edges(True, "remove")
    np.testing.assert_array_equal(g.features, tiny.features)
    labelled = np.isfinite(tiny.labels)
    np.testing.assert_array_equal(g.labels[labelled], tiny.labels[labelled].astype(np.int64))
    assert np.all(g.labels[~labelled] == 0)
    # node 2 was in train, 6 in valid, 9 in test: each is dropped from its split
    np.testing.assert_array_equal(np.flatnonzero(g.train_mask), [0, 1, 3, 4])
    np.testing.assert_array_equal(np.flatnonzero(g.val_mask), [5])
    np.testing.assert_array_equal(np.flatnonzero(g.test_mask), [7, 8])
    assert g.params["unlabelled_nodes"] == 3
    assert g.params["unlabelled_dropped_from_splits"] == {"train": 1, "valid": 1, "test": 1}
    s = dataset_summary(g)
    assert s["split"] == {"train": 4, "val": 1, "test": 2} and s["outside_splits"] == 3
    assert sum(s["class_counts"]) == 7
    assert s["in_degree"]["zero"] == 1  # node 9 is isolated


def test_offline_error_names_directory_files_and_url(tmp_path):
    root = tmp_path / "nowhere" / "ogb"
    with pytest.raises(GnnPipeError) as e:
        load_dataset(ogb_cfg(root, download=False), "arxiv")
    msg = str(e.value)
    assert str(root / "ogbn_arxiv") in msg
    assert "raw/edge.csv.gz" in msg and "split/time/train.csv.gz" in msg
    assert "http://snap.stanford.edu/ogb/data/nodeproppred/arxiv.zip" in msg
    assert "download is off" in msg
    assert not (tmp_path / "nowhere").exists()  # nothing was created


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_failing_download_leaves_nothing_behind(tmp_path, monkeypatch):
    url = f"http://127.0.0.1:{_closed_port()}/arxiv.zip"
    real = ogb_mod.ogb_meta
    monkeypatch.setattr(ogb_mod, "ogb_meta", lambda name: dataclasses.replace(real(name), url=url))
    root = tmp_path / "fresh" / "ogb"
    with pytest.raises(GnnPipeError) as e:
        load_dataset(ogb_cfg(root, download=True), "arxiv")
    msg = str(e.value)
    assert f"download of {url} failed" in msg and str(root / "ogbn_arxiv") in msg
    assert "raw/edge.csv.gz" in msg
    assert not (tmp_path / "fresh").exists()  # no root, no temp dir, no partial zip


def test_download_through_ogb_helpers_from_local_server(tmp_path, monkeypatch):
    src = write_csv_dataset(tmp_path / "src")
    served = tmp_path / "www"
    served.mkdir()
    zip_dataset(src, "arxiv", served / "arxiv.zip")
    handler = functools.partial(_QuietHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/arxiv.zip"
        real = ogb_mod.ogb_meta
        monkeypatch.setattr(ogb_mod, "ogb_meta", lambda name: dataclasses.replace(real(name), url=url))
        root = tmp_path / "root"
        g = load_dataset(ogb_cfg(root, download=True), "arxiv")
    finally:
        server.shutdown()
        server.server_close()
    assert edge_set(g) == expected_edges(True, "remove")
    assert sorted(p.name for p in root.iterdir()) == ["ogbn_arxiv"]  # no zip, no temp dir left
    assert (root / "ogbn_arxiv" / "raw" / "edge.csv.gz").is_file()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_incomplete_directory_is_reported_not_replaced(tmp_path):
    tiny = write_csv_dataset(tmp_path)
    (tiny.dir / "split" / "time" / "valid.csv.gz").unlink()
    with pytest.raises(GnnPipeError, match=r"incomplete.*missing: split/time/valid\.csv\.gz"):
        load_dataset(ogb_cfg(tmp_path, download=True), "arxiv")
    assert (tiny.dir / "raw" / "edge.csv.gz").is_file()  # the user's files are untouched


def test_damaged_raw_file_is_a_clear_error(tmp_path):
    tiny = write_csv_dataset(tmp_path)
    (tiny.dir / "raw" / "edge.csv.gz").write_bytes(gzip.compress(b"0,1\n")[:12])  # truncated
    with pytest.raises(GnnPipeError, match=r"ogbn_arxiv: OGB raw files could not be read"):
        load_dataset(ogb_cfg(tmp_path), "arxiv")


def test_split_ids_out_of_range_are_refused(tmp_path):
    tiny = write_csv_dataset(tmp_path)
    (tiny.dir / "split" / "time" / "test.csv.gz").write_bytes(gzip.compress(b"7\n8\n10\n"))
    with pytest.raises(GnnPipeError, match=r"test\.csv\.gz has node ids outside \[0, 10\)"):
        load_dataset(ogb_cfg(tmp_path), "arxiv")


def test_non_node_classification_dataset_is_refused():
    with pytest.raises(GnnPipeError, match="ogbn-mag is not a homogeneous"):
        ogb_mod.ogb_meta("ogbn-mag")
    with pytest.raises(GnnPipeError, match="not an OGB node-property dataset"):
        ogb_mod.ogb_meta("ogbn-nope")
