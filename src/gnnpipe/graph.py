"""The canonical graph: an in-memory ``Graph`` and its HDF5 file ``graph.h5``.

Layout of ``results/data/<dataset>/graph.h5`` (format version ``FORMAT_VERSION``)::

    /indptr      int64 (N+1,)   CSR of in-edges: the sources of node v are
    /indices     int32 (E,)     indices[indptr[v]:indptr[v+1]], sorted ascending
                                (int64 when N > 2^31 - 1: ``index_dtype(N)``)
    /features    float32 (N, F)
    /labels      int64 (N,)
    /train_mask, /val_mask, /test_mask   bool (N,)
    attrs: format_version, num_nodes, num_edges, num_features, num_classes,
           source, name, symmetric, self_loops, content_hash, params (JSON)

``content_hash`` is SHA-256 over every dataset; a reader recomputes it and refuses a
file whose content does not match (a truncated or edited file), as it refuses a
file of another format version. Both errors name the file and the rule that
rebuilds it. Version 2 stores ``indices`` as int32 whenever the node ids fit (half the
bytes of the largest array, on disk and in every process that reads it). A version-1 file
(int64 ids, otherwise the same) is still read: ``Graph`` holds its ``indices`` in
``index_dtype(N)`` whatever it was built or read from, and the content hash takes the ids
as int64 (``HASH_AS``), so one graph has one content hash in either version — the runs,
partitions, chunk stores and checkpoints fingerprinted with a version-1 graph stay valid
(nothing is rebuilt or retrained for the new format).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from .io import GnnPipeError, atomic_path, hash_arrays

FORMAT_VERSION = 2  # 2: int32 source ids when they fit (index_dtype)
READABLE_VERSIONS = (1, 2)  # 1: int64 ids (read, converted on load; same content hash)
HASH_AS = {"indices": np.dtype("<i8")}  # the content hash takes node ids as int64 in every version
_INT32_MAX = 2**31 - 1
_ARRAYS = ("indptr", "indices", "features", "labels", "train_mask", "val_mask", "test_mask")


def index_dtype(num_nodes: int) -> np.dtype:
    """The dtype of node ids in a graph of ``num_nodes`` nodes: int32 when they fit."""
    return np.dtype(np.int32) if num_nodes <= _INT32_MAX else np.dtype(np.int64)


#: Edges placed per step when building a CSR: bounds the builder's temporaries (a few
#: hundred MB) whatever the graph's size.
CSR_CHUNK = 1 << 23


def row_entries(indptr: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``rows`` of a CSR, in that order: their row pointer ``(len(rows) + 1,)`` and the
    positions of their entries in the CSR's ``indices`` (``(nnz,)``, row by row, each row's
    entries in their order): ``indices[pos]`` are the rows' entries."""
    deg = indptr[rows + 1] - indptr[rows]
    ptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(deg, out=ptr[1:])
    pos = np.repeat(indptr[rows] - ptr[:-1], deg)
    pos += np.arange(int(ptr[-1]), dtype=np.int64)
    return ptr, pos


@dataclass
class Graph:
    """A node-classification graph held as a CSR of in-edges.

    ``indices[indptr[v]:indptr[v+1]]`` are the sources of the edges into ``v``.
    """

    indptr: np.ndarray  # int64 (N+1,)
    indices: np.ndarray  # (E,) index_dtype(N): int32 when the ids fit, else int64
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

    def __post_init__(self):
        self.indptr = np.asarray(self.indptr, dtype=np.int64)
        self.indices = np.asarray(self.indices).astype(index_dtype(self.num_nodes), copy=False)

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

    def renumbered(self, order: np.ndarray, *, chunk: int = CSR_CHUNK) -> "Graph":
        """The same graph with node ``i`` being this graph's node ``order[i]`` (a permutation).

        Features, labels and masks move with their nodes; every row keeps its in-neighbours in
        the order it had (renamed), so each node's aggregation adds the same numbers in the same
        order as before. The rows are then not sorted by the new ids: an in-memory graph for
        training, not one to write as ``graph.h5``. Temporaries beyond the result: O(N) and
        O(``chunk``) entries.
        """
        n = self.num_nodes
        order = np.asarray(order, dtype=np.int64)
        if order.shape != (n,) or not np.array_equal(np.bincount(order, minlength=n), np.ones(n, np.int64)):
            raise GnnPipeError(f"a renumbering of {n} nodes must be a permutation of 0..{n - 1}")
        new_id = np.empty(n, dtype=self.indices.dtype)
        new_id[order] = np.arange(n, dtype=self.indices.dtype)
        deg = np.diff(self.indptr)[order]
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(deg, out=indptr[1:])
        indices = np.empty_like(self.indices)
        lo = 0
        while lo < n:  # new rows [lo, hi) hold about `chunk` entries
            hi = max(int(np.searchsorted(indptr, indptr[lo] + chunk, side="right")) - 1, lo + 1)
            indices[indptr[lo]:indptr[hi]] = new_id[self.indices[row_entries(self.indptr, order[lo:hi])[1]]]
            lo = hi
        return Graph(indptr, indices, self.features[order], self.labels[order], self.train_mask[order],
                     self.val_mask[order], self.test_mask[order], self.num_classes, name=self.name,
                     source=self.source, symmetric=self.symmetric, self_loops=self.self_loops,
                     params=dict(self.params))

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in _ARRAYS}

    def content_hash(self) -> str:
        return hash_arrays(self.arrays(), HASH_AS)

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
                   self_loops: str = "remove", chunk: int = CSR_CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """Build the in-edge CSR ``(indptr, indices)`` from an edge list ``src -> dst``
    (``indptr`` int64, ``indices`` of ``index_dtype(num_nodes)``).

    ``symmetrize`` adds the reverse of every edge; duplicates are always merged.
    ``self_loops`` is ``"remove"`` (drop them), ``"add"`` (one per node) or ``"keep"``
    (as given). Streamed: a counting pass over the edges sizes the rows, a second pass
    places them, ``chunk`` edges at a time, into one ``indices`` array; then every row is
    sorted and its repeats merged in place (scipy's C++). Beyond the result, the edge
    list given and O(N), the temporaries are O(chunk): at 10^8 stored edges the result
    (0.4 GB of int32 ids) is the largest array the builder makes.
    """
    if self_loops not in ("remove", "add", "keep"):
        raise GnnPipeError(f"self_loops must be 'remove', 'add' or 'keep', got {self_loops!r}")
    import scipy.sparse as sp

    n, src, dst = int(num_nodes), np.asarray(src), np.asarray(dst)
    itype = index_dtype(n)
    directions = [(dst, src), (src, dst)] if symmetrize else [(dst, src)]

    def pieces():  # (destinations int64, sources) of every stored entry, chunk by chunk
        for to, frm in directions:
            for i in range(0, to.shape[0], chunk):
                d, s = to[i:i + chunk].astype(np.int64), frm[i:i + chunk].astype(itype)
                if self_loops != "keep":
                    keep = d != s
                    d, s = d[keep], s[keep]
                yield d, s

    counts = np.zeros(n, dtype=np.int64)
    for d, _ in pieces():
        counts += np.bincount(d, minlength=n)
    if self_loops == "add":
        counts += 1
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    del counts
    indices = np.empty(int(indptr[-1]), dtype=itype)
    fill = indptr[:-1].copy()  # next free slot of every row
    for d, s in pieces():
        if not d.shape[0]:
            continue
        order = np.argsort(d, kind="stable")
        d, s = d[order], s[order]
        first = np.flatnonzero(np.concatenate(([True], d[1:] != d[:-1])))  # each row's run
        rank = np.arange(d.shape[0]) - np.repeat(first, np.diff(np.append(first, d.shape[0])))
        indices[fill[d] + rank] = s
        fill[d[first]] += np.diff(np.append(first, d.shape[0]))
    if self_loops == "add":
        indices[fill] = np.arange(n, dtype=itype)
    del fill
    # sort every row and merge its repeats, in place (data: one byte per entry)
    a = sp.csr_array((np.ones(indices.shape[0], dtype=bool), indices, indptr), shape=(n, n))
    del indices
    a.sum_duplicates()
    return a.indptr.astype(np.int64), a.indices.astype(itype, copy=False)


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
    if version not in READABLE_VERSIONS:
        raise _refuse(path, f"graph format version {version}, this gnnpipe reads versions "
                            f"{', '.join(map(str, READABLE_VERSIONS))}")
    return attrs


def read_graph(path: str | os.PathLike, *, verify: bool = True, features: bool = True) -> Graph:
    """Read a graph file, refusing another format version or a content-hash mismatch.

    ``features=False``: everything but the features, which become an ``(N, 0)`` array (the
    partition rule: METIS needs the structure only; at Physics' 8,415 features they are most of
    the file). The content hash is checked all the same, the features read through it in slabs.
    """
    attrs = read_graph_attrs(path)
    try:
        with h5py.File(path, "r") as f:
            arrays = {name: f[name][()] for name in _ARRAYS if features or name != "features"}
            digest = (hash_arrays({**arrays, "features": f["features"]}, HASH_AS) if verify and not features
                      else None)
    except (OSError, KeyError) as e:
        raise _refuse(path, f"damaged or truncated ({e})") from None
    if not features:
        arrays["features"] = np.zeros((arrays["labels"].shape[0], 0), dtype=np.float32)
    graph = Graph(**arrays, num_classes=int(attrs["num_classes"]), name=str(attrs["name"]),
                  source=str(attrs["source"]), symmetric=bool(attrs["symmetric"]),
                  self_loops=bool(attrs["self_loops"]), params=json.loads(attrs["params"]))
    if verify and (digest or graph.content_hash()) != attrs["content_hash"]:
        raise _refuse(path, "content hash does not match the file's data (damaged or edited)")
    return graph


def graph_path(results: str | os.PathLike, dataset: str) -> Path:
    return Path(results) / "data" / dataset / "graph.h5"
