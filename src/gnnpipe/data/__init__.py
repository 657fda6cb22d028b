"""Datasets: one entry point, ``load_dataset``, for every kind of graph the pipeline reads.

* ``synthetic`` -> :mod:`gnnpipe.data.synthetic` (degree-corrected SBM, the default);
* ``ogb``       -> :mod:`gnnpipe.data.ogb` (OGB node-property datasets from their raw files);
* ``files``     -> :mod:`gnnpipe.data.files` (the user's own edge list and ``.npy`` arrays).

Each returns a validated :class:`gnnpipe.graph.Graph` whose edges were symmetrised and whose
self loops were handled as the dataset config says (``symmetrize``, ``self_loops``), never by
accident of the source. The kind modules are imported lazily: loading a synthetic graph does
not import pandas or ogb.
"""

from __future__ import annotations

import numpy as np

from ..config import DatasetConfig
from ..graph import Graph, csr_from_edges
from ..io import GnnPipeError

__all__ = ["load_dataset", "dataset_summary", "build_graph", "random_split"]


def load_dataset(cfg: DatasetConfig, name: str, *, progress: bool = False) -> Graph:
    """Build the graph that dataset ``name`` (its key in the workflow config) describes.

    ``progress`` lets the readers print what they are doing (OGB's loaders, downloads);
    without it they are quiet.
    """
    if cfg.kind == "synthetic":
        from .synthetic import generate

        return generate(cfg.synthetic, symmetrize=cfg.symmetrize, self_loops=cfg.self_loops, name=name,
                        progress=progress)
    if cfg.kind == "ogb":
        from .ogb import load_ogb

        return load_ogb(cfg.ogb, symmetrize=cfg.symmetrize, self_loops=cfg.self_loops, name=name,
                        progress=progress)
    if cfg.kind == "files":
        from .files import load_files

        return load_files(cfg.files, symmetrize=cfg.symmetrize, self_loops=cfg.self_loops, name=name)
    raise GnnPipeError(f"dataset {name!r}: unknown kind {cfg.kind!r} (use synthetic, ogb or files)")


def build_graph(src: np.ndarray, dst: np.ndarray, *, features: np.ndarray, labels: np.ndarray,
                train_mask: np.ndarray, val_mask: np.ndarray, test_mask: np.ndarray,
                num_classes: int, symmetrize: bool, self_loops: str, name: str, source: str,
                params: dict | None = None, already_symmetric: bool = False) -> Graph:
    """Assemble and validate a ``Graph`` from an edge list ``src -> dst`` and per-node arrays.

    ``already_symmetric`` records that the source itself holds every reverse edge (OGB's
    ``add_inverse_edge`` datasets), so the graph is symmetric even without ``symmetrize``.
    """
    n = int(features.shape[0])
    indptr, indices = csr_from_edges(src, dst, n, symmetrize=symmetrize, self_loops=self_loops)
    if self_loops == "keep":
        dst_of_edge = np.repeat(np.arange(n, dtype=np.int64), np.diff(indptr))
        has_loops = bool(np.any(indices == dst_of_edge))
    else:
        has_loops = self_loops == "add"
    graph = Graph(
        indptr=indptr, indices=indices,
        features=np.ascontiguousarray(features, dtype=np.float32),
        labels=np.ascontiguousarray(labels, dtype=np.int64),
        train_mask=np.ascontiguousarray(train_mask, dtype=bool),
        val_mask=np.ascontiguousarray(val_mask, dtype=bool),
        test_mask=np.ascontiguousarray(test_mask, dtype=bool),
        num_classes=int(num_classes), name=name, source=source,
        symmetric=bool(symmetrize or already_symmetric), self_loops=has_loops,
        params=dict(params or {}),
    )
    graph.validate()
    return graph


def random_split(num_nodes: int, train_fraction: float, val_fraction: float, seed: int,
                 where: str = "dataset") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Disjoint random train/val/test masks; test takes every node the other two leave.

    ``round(f * N)`` nodes go to train and to val, drawn by one permutation from ``seed``.
    """
    if not 0.0 < train_fraction < 1.0:
        raise GnnPipeError(f"{where}.train_fraction must lie in (0, 1), got {train_fraction}")
    if not 0.0 <= val_fraction < 1.0 or train_fraction + val_fraction >= 1.0:
        raise GnnPipeError(f"{where}.val_fraction must be >= 0 and leave nodes for test "
                           f"(train_fraction + val_fraction < 1), got {val_fraction}")
    perm = np.random.default_rng(seed).permutation(num_nodes)
    n_train = int(round(train_fraction * num_nodes))
    n_val = int(round(val_fraction * num_nodes))
    masks = [np.zeros(num_nodes, dtype=bool) for _ in range(3)]
    masks[0][perm[:n_train]] = True
    masks[1][perm[n_train:n_train + n_val]] = True
    masks[2][perm[n_train + n_val:]] = True
    return masks[0], masks[1], masks[2]


def _stats(deg: np.ndarray) -> dict:
    return {
        "min": int(deg.min()), "max": int(deg.max()), "mean": float(deg.mean()),
        "median": float(np.median(deg)), "p99": float(np.percentile(deg, 99)),
        "zero": int(np.count_nonzero(deg == 0)),
    }


def dataset_summary(graph: Graph) -> dict:
    """Plain-data statistics of a graph, for the data rule's stats JSON."""
    in_deg = graph.in_degrees()
    out_deg = graph.out_degrees()
    split = {"train": int(graph.train_mask.sum()), "val": int(graph.val_mask.sum()),
             "test": int(graph.test_mask.sum())}
    in_any = graph.train_mask | graph.val_mask | graph.test_mask
    labelled = graph.labels[in_any]
    summary = {
        "name": graph.name,
        "source": graph.source,
        "num_nodes": graph.num_nodes,
        "num_edges": graph.num_edges,
        "avg_degree": graph.num_edges / graph.num_nodes,
        "num_features": graph.num_features,
        "num_classes": graph.num_classes,
        "symmetric": graph.symmetric,
        "self_loops": graph.self_loops,
        "split": split,
        "outside_splits": int(graph.num_nodes - in_any.sum()),
        "class_counts": np.bincount(labelled, minlength=graph.num_classes).tolist(),
        "in_degree": _stats(in_deg),
    }
    if not graph.symmetric:
        summary["out_degree"] = _stats(out_deg)
    summary["params"] = graph.params
    return summary
