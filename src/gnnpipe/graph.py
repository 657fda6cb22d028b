"""The canonical graph: an in-memory ``Graph`` and its HDF5 file ``graph.h5``.

Layout of ``results/data/<dataset>/graph.h5`` (format version ``FORMAT_VERSION``)::

    /indptr      int64 (N+1,)   CSR of in-edges: the sources of node v are
    /indices     int64 (E,)     indices[indptr[v]:indptr[v+1]], sorted ascending
    /features    float32 (N, F)
    /labels      int64 (N,)
    /train_mask, /val_mask, /test_mask   bool (N,)
    attrs: format_version, num_nodes, num_edges, num_features, num_classes,
           source, name, symmetric, self_loops, content_hash, params (JSON)

``content_hash`` is SHA-256 over every dataset; a reader recomputes it and refuses a
file whose content does not match (a truncated or edited file), as it refuses a
file of another format version. Both errors name the file and the rule that
rebuilds it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from .io import GnnPipeError, atomic_path, hash_arrays

FORMAT_VERSION = 1
_ARRAYS = ("indptr", "indices", "features", "labels", "train_mask", "val_mask", "test_mask")


@dataclass
class Graph:
    """A node-classification graph held as a CSR of in-edges.

    ``indices[indptr[v]:indptr[v+1]]`` are the sources of the edges into ``v``.
    """

    indptr: np.ndarray  # int64 (N+1,)
    indices: np.ndarray  # int64 (E,)
    features: np.ndarray  # float32 (N, F)
    labels: np.ndarray  # int64 (N,)
    train_mask: np.ndarray  # bool (N,)
    val_mask: np.ndarray  # bool (N,)
    test_mask: np.ndarray  # bool (N,)
    num_classes: int
    name: str = "graph"
    source: str = "unknown"
    symmetric: bool = True
    self_loops: bool = False
    params: dict = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        return int(self.indptr.shape[0] - 1)

    @property
    def num_edges(self) -> int:
        return int(self.indices.shape[0])

    @property
    def num_features(self) -> int:
        return int(self.features.shape[1])

    def in_degrees(self) -> np.ndarray:
        return np.diff(self.indptr)

    def out_degrees(self) -> np.ndarray:
        return np.bincount(self.indices, minlength=self.num_nodes).astype(np.int64)

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in _ARRAYS}

    def content_hash(self) -> str:
        return hash_arrays(self.arrays())

    def validate(self) -> None:
        """Check shapes, dtypes and id ranges; raise ``GnnPipeError`` naming the problem."""
        n = self.num_nodes
        if n <= 0:
            raise GnnPipeError("graph has no nodes")
        if self.indptr[0] != 0 or self.indptr[-1] != self.num_edges or np.any(np.diff(self.indptr) < 0):
            raise GnnPipeError("indptr is not a valid CSR row pointer")
        if self.num_edges and (self.indices.min() < 0 or self.indices.max() >= n):
            raise GnnPipeError(f"edge source ids must lie in [0, {n})")
        if self.features.ndim != 2 or self.features.shape[0] != n:
            raise GnnPipeError(f"features must have shape ({n}, F), got {self.features.shape}")
        if self.labels.shape != (n,):
            raise GnnPipeError(f"labels must have shape ({n},), got {self.labels.shape}")
        if self.labels.min() < 0 or self.labels.max() >= self.num_classes:
            raise GnnPipeError(f"labels must lie in [0, {self.num_classes})")
        for m in ("train_mask", "val_mask", "test_mask"):
            if getattr(self, m).shape != (n,):
                raise GnnPipeError(f"{m} must have shape ({n},)")


def csr_from_edges(src: np.ndarray, dst: np.ndarray, num_nodes: int, *, symmetrize: bool = True,
                   self_loops: str = "remove") -> tuple[np.ndarray, np.ndarray]:
    """Build the in-edge CSR ``(indptr, indices)`` from an edge list ``src -> dst``.

    ``symmetrize`` adds the reverse of every edge; duplicates are always merged.
    ``self_loops`` is ``"remove"`` (drop them), ``"add"`` (one per node) or ``"keep"``
    (as given). Vectorised: sorting is the only super-linear step.
    """
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    if symmetrize:
        src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
    if self_loops == "remove":
        keep = src != dst
        src, dst = src[keep], dst[keep]
    elif self_loops == "add":
        keep = src != dst
        loops = np.arange(num_nodes, dtype=np.int64)
        src, dst = np.concatenate([src[keep], loops]), np.concatenate([dst[keep], loops])
    elif self_loops != "keep":
        raise GnnPipeError(f"self_loops must be 'remove', 'add' or 'keep', got {self_loops!r}")
    key = np.sort(dst * num_nodes + src)  # sorted by (dst, src)
    # merge duplicates (np.unique is hash-based in numpy >= 2.3 and ~10x slower at 10^7 keys)
    key = key[np.concatenate(([True], key[1:] != key[:-1]))] if key.size else key
    dst, src = np.divmod(key, num_nodes)
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=num_nodes), out=indptr[1:])
    return indptr, src.astype(np.int64)


def write_graph(path: str | os.PathLike, graph: Graph) -> str:
    """Write ``graph`` to ``path`` atomically; return its content hash."""
    graph.validate()
    digest = graph.content_hash()
    with atomic_path(path, ".h5") as tmp:
        with h5py.File(tmp, "w") as f:
            for name, arr in graph.arrays().items():
                f.create_dataset(name, data=arr)
            f.attrs.update(
                format_version=FORMAT_VERSION, num_nodes=graph.num_nodes, num_edges=graph.num_edges,
                num_features=graph.num_features, num_classes=graph.num_classes, source=graph.source,
                name=graph.name, symmetric=graph.symmetric, self_loops=graph.self_loops,
                content_hash=digest, params=json.dumps(graph.params, sort_keys=True),
            )
    return digest


def _refuse(path, why: str) -> GnnPipeError:
    return GnnPipeError(f"{path}: {why}. Delete it and rebuild it with the 'build_graph' rule "
                        f"(snakemake {path}) or `gnnpipe data`.")


def read_graph_attrs(path: str | os.PathLike) -> dict:
    """The attributes of a graph file, after checking its format version (cheap)."""
    try:
        with h5py.File(path, "r") as f:
            attrs = dict(f.attrs)
    except FileNotFoundError:
        raise GnnPipeError(f"{path}: no such graph file; build it with the 'build_graph' rule") from None
    except OSError as e:
        raise _refuse(path, f"not a readable HDF5 file ({e})") from None
    version = attrs.get("format_version")
    if version != FORMAT_VERSION:
        raise _refuse(path, f"graph format version {version}, this gnnpipe reads version {FORMAT_VERSION}")
    return attrs


def read_graph(path: str | os.PathLike, *, verify: bool = True) -> Graph:
    """Read a graph file, refusing another format version or a content-hash mismatch."""
    attrs = read_graph_attrs(path)
    try:
        with h5py.File(path, "r") as f:
            arrays = {name: f[name][()] for name in _ARRAYS}
    except (OSError, KeyError) as e:
        raise _refuse(path, f"damaged or truncated ({e})") from None
    graph = Graph(**arrays, num_classes=int(attrs["num_classes"]), name=str(attrs["name"]),
                  source=str(attrs["source"]), symmetric=bool(attrs["symmetric"]),
                  self_loops=bool(attrs["self_loops"]), params=json.loads(attrs["params"]))
    if verify and graph.content_hash() != attrs["content_hash"]:
        raise _refuse(path, "content hash does not match the file's data (damaged or edited)")
    return graph


def graph_path(results: str | os.PathLike, dataset: str) -> Path:
    return Path(results) / "data" / dataset / "graph.h5"
