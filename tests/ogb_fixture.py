"""Tiny OGB node-property datasets written in OGB's exact on-disk layout (a helper, not a test).

The CSV datasets (ogbn-arxiv, ogbn-products) are gzipped CSVs without header or index, as
in OGB's zips (``raw/edge.csv.gz`` holds one ``src,dst`` pair per line, the count files one
number, labels one column); the binary one (ogbn-papers100M, ``papers100M-bin``) holds
``raw/data.npz`` with the keys ``read_binary_graph_raw`` expects and ``raw/node-label.npz``
with float labels, NaN for unlabelled nodes. Splits are ``split/<type>/{train,valid,test}.csv.gz``.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

# 10 nodes. Directed edges with a duplicate (0->1 twice), a reverse pair (2->3, 3->2),
# a self loop (4->4) and an isolated node (9).
EDGES = np.array([[0, 1], [0, 1], [1, 2], [2, 3], [3, 2], [4, 4], [4, 5], [5, 6], [6, 7], [7, 8],
                  [8, 0]], dtype=np.int64)
NUM_NODES = 10
SPLITS = {"train": [0, 1, 2, 3, 4], "valid": [5, 6], "test": [7, 8, 9]}


@dataclass
class Tiny:
    root: Path  # the OGB root (cfg.root)
    dir: Path  # root/<name with _>
    edges: np.ndarray  # (E, 2) as written
    features: np.ndarray  # (N, F) float32
    labels: np.ndarray  # (N,) float (NaN = unlabelled) or int
    splits: dict[str, list[int]]


def _csv(path: Path, array) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(array).to_csv(path, header=False, index=False, compression="gzip")


def _splits(ddir: Path, split_type: str, splits) -> None:
    for part, idx in splits.items():
        _csv(ddir / "split" / split_type / f"{part}.csv.gz", np.asarray(idx, dtype=np.int64))


def write_csv_dataset(root: Path, name: str = "ogbn-arxiv", split_type: str = "time",
                      num_features: int = 4, num_classes: int = 40, seed: int = 0) -> Tiny:
    """An ogbn-arxiv (or ogbn-products, split_type='sales_ranking') directory under ``root``."""
    rng = np.random.default_rng(seed)
    ddir = Path(root) / name.replace("-", "_")
    raw = ddir / "raw"
    features = rng.standard_normal((NUM_NODES, num_features)).astype(np.float32)
    labels = rng.integers(0, num_classes, NUM_NODES)
    _csv(raw / "edge.csv.gz", EDGES)
    _csv(raw / "num-node-list.csv.gz", [NUM_NODES])
    _csv(raw / "num-edge-list.csv.gz", [len(EDGES)])
    _csv(raw / "node-feat.csv.gz", features)
    _csv(raw / "node-label.csv.gz", labels.reshape(-1, 1))
    _csv(raw / "node_year.csv.gz", rng.integers(1990, 2020, (NUM_NODES, 1)))
    _splits(ddir, split_type, SPLITS)
    (ddir / "RELEASE_v1.txt").write_text("# Release note for tiny test dataset\n")
    return Tiny(Path(root), ddir, EDGES, features, labels, SPLITS)


def write_binary_dataset(root: Path, name: str = "ogbn-papers100M", num_features: int = 3,
                         num_classes: int = 172, unlabelled=(2, 6, 9), seed: int = 1) -> Tiny:
    """An ogbn-papers100M-style (npz) directory; the nodes in ``unlabelled`` have NaN labels."""
    rng = np.random.default_rng(seed)
    ddir = Path(root) / name.replace("-", "_")
    raw = ddir / "raw"
    raw.mkdir(parents=True)
    features = rng.standard_normal((NUM_NODES, num_features)).astype(np.float32)
    labels = rng.integers(0, num_classes, NUM_NODES).astype(np.float32)
    labels[list(unlabelled)] = np.nan
    np.savez_compressed(raw / "data.npz", edge_index=EDGES.T.copy(), node_feat=features,
                        node_year=rng.integers(1990, 2020, (NUM_NODES, 1)),
                        num_nodes_list=np.array([NUM_NODES]), num_edges_list=np.array([len(EDGES)]))
    np.savez_compressed(raw / "node-label.npz", node_label=labels.reshape(-1, 1))
    _splits(ddir, "time", SPLITS)
    (ddir / "RELEASE_v1.txt").write_text("# Release note for tiny test dataset\n")
    return Tiny(Path(root), ddir, EDGES, features, labels, SPLITS)


def zip_dataset(tiny: Tiny, download_name: str, zip_path: Path) -> Path:
    """Pack ``tiny.dir`` as OGB's download zip does: one top folder named ``download_name``."""
    with zipfile.ZipFile(zip_path, "w") as z:
        for f in sorted(tiny.dir.rglob("*")):
            if f.is_file():
                z.write(f, Path(download_name) / f.relative_to(tiny.dir))
    return zip_path
