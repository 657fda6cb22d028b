"""The chunk store: a graph renumbered into contiguous parts, in one HDF5 file.

``results/chunks/<dataset>/<method>-<k>.h5`` (format version ``FORMAT_VERSION``) holds
the graph cut into ``K`` parts, renumbered so that part ``p`` is the new-id range
``[offsets[p], offsets[p+1])``. Within a part the *inner* nodes (no in-neighbour outside
the part) come first, then the *boundary* nodes: rows ``[0, n_inner)`` can be aggregated
before the halo arrives. Each group is ordered by locality piece (METIS on the subgraph the part
induces, pieces of ~1,024 nodes: ``gnnpipe.partition.part_locality_key``; none in a part under
2,048 nodes), then by original id: a row's neighbours lie near it, as in the single engine's
numbering, and the gathers of every mode hit the caches. Layout::

    /offsets  int64 (K+1,)      /perm    int64 (N,)  new id -> original id
    /deg_in   int64 (N,)        /deg_out int64 (N,)  whole-graph degrees, new ids
    /parts/<p>/                 attrs start, end, n_inner
        indptr  (n_p+1,)  indices (nnz_p,)   in-edge CSR, sources = GLOBAL new ids, sorted per row
        features (n_p, F) labels (n_p,)  train_mask val_mask test_mask (n_p,)
        deg_in deg_out (n_p,)                whole-graph degrees of the part's nodes
        halo (M_p,)  halo_deg_out (M_p,)     sorted new ids of the part's out-of-part sources
        send (sum_q S_pq,)  send_counts (K,) rows p sends each q: local row indices in p of
                                             the nodes q's halo lists, in q's halo order
        recv_counts (K,)                     how many of p's halo rows each q owns
    attrs: format_version, num_parts, num_nodes, num_edges, num_features, num_classes,
           graph_hash (the source graph's content hash), partition_hash, method, name,
           attrs_hash, content_hash

Every dataset carries its own SHA-256 (attribute ``sha256``) and is checked when it is
read, so that a worker reading only its own part still detects damage. ``attrs_hash``
covers the attributes of the file and of every part (``num_classes``, ``start``, ...),
which say how the datasets are read; it is checked on every open. ``content_hash`` is
the hash of all of them (``ChunkStore.verify`` checks everything). Every refusal names
the file and the rule that rebuilds it. A run opens its store with ``open_run_store``,
which refuses a store made from another graph than the run's ``graph.h5``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import h5py
import numpy as np
import scipy.sparse as sp

from .graph import Graph, read_graph_attrs, row_entries
from .io import GnnPipeError, atomic_path, hash_arrays
from .partition import check_assignment, halo_sets, part_locality_key

if TYPE_CHECKING:  # torch is imported by the readers that build blocks, not by materialize
    import torch

    from .models.block import Block

FORMAT_VERSION = 2  # 2: attrs_hash (the attributes are hashed too)
NODE_ARRAYS = ("features", "labels", "train_mask", "val_mask", "test_mask")


@dataclass(eq=False)
class Part:
    """One part of the store: its rows, their in-edges and data, and its halo."""

    p: int
    start: int  # first new id of the part
    end: int  # one past its last new id
    n_inner: int  # rows [0, n_inner) have no in-neighbour outside the part
    indptr: np.ndarray  # int64 (n_p+1,)
    indices: np.ndarray  # int64 (nnz,) sources as global new ids, sorted per row
    features: np.ndarray  # float32 (n_p, F)
    labels: np.ndarray  # int64 (n_p,)
    train_mask: np.ndarray  # bool (n_p,)
    val_mask: np.ndarray
    test_mask: np.ndarray
    halo: np.ndarray  # int64 (M_p,) sorted new ids outside the part

    @property
    def num_nodes(self) -> int:
        return self.end - self.start


# --------------------------------------------------------------------------- writing
def _renumber(graph: Graph, a: np.ndarray, k: int, piece_nodes: int | None = None):
    """perm (new -> original), offsets, n_inner per part, and the in-edge CSR in new ids."""
    n = graph.num_nodes
    piece = part_locality_key(graph, a, k, part_nodes=piece_nodes)  # first: METIS peaks alone
    row = np.repeat(np.arange(n, dtype=np.int64), graph.in_degrees())  # (E,) destination of each edge
    cut = a[row] != a[graph.indices]
    boundary = np.zeros(n, dtype=bool)
    boundary[row[cut]] = True
    del row, cut
    # part-major, inner before boundary, then by locality piece, then by original id (a stable sort)
    perm = np.lexsort((piece, boundary, a)).astype(np.int64)
    del piece
    inv = np.empty(n, dtype=np.int64)
    inv[perm] = np.arange(n, dtype=np.int64)
    sizes = np.bincount(a, minlength=k)
    offsets = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    n_inner = np.bincount(a[~boundary], minlength=k)

    indptr, gather = row_entries(graph.indptr, perm)  # the rows in new order, their entries' positions
    indices = inv[graph.indices[gather]]
    del gather
    m = sp.csr_array((np.ones(len(indices), dtype=bool), indices, indptr), shape=(n, n))
    m.has_sorted_indices = False
    m.sort_indices()  # per-row sort in C++, linear in the rows
    return perm, inv, offsets, n_inner, indptr, m.indices.astype(np.int64, copy=False)


def _send_lists(halo_ptr: np.ndarray, halo: np.ndarray, offsets: np.ndarray, k: int):
    """Per sender p: local rows to send, grouped by receiver q in q's halo order; counts (K, K)."""
    receiver = np.repeat(np.arange(k, dtype=np.int64), np.diff(halo_ptr))  # (sum M,)
    owner = np.searchsorted(offsets, halo, side="right") - 1
    pair = owner * k + receiver
    order = np.argsort(pair, kind="stable")  # by (p, q), each q's halo order kept
    local = (halo - offsets[owner])[order]
    counts = np.bincount(pair, minlength=k * k).reshape(k, k)  # [p, q]
    send_ptr = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(counts.sum(axis=1), out=send_ptr[1:])
    return local, send_ptr, counts


def materialize(graph: Graph, assignment: np.ndarray, path: str | os.PathLike, *,
                graph_hash: str | None = None, method: str = "", progress: bool = False,
                piece_nodes: int | None = None) -> None:
    """Write the chunk store of ``graph`` cut by ``assignment`` to ``path``, atomically.

    ``graph_hash`` is the source graph's content hash (computed when not given); a
    reader with ``expect_graph_hash`` refuses a store made from another graph.
    ``piece_nodes``: nodes per locality piece (default ``partition.LOCALITY_PART_NODES``; one
    larger than every part keeps the order by id: ``benchmarks/bench_locality.py`` compares).
    """
    from tqdm import tqdm

    n = graph.num_nodes
    a = check_assignment(assignment, n, where=str(path))
    k = int(a.max()) + 1
    sizes = np.bincount(a, minlength=k)
    if np.any(sizes == 0):
        raise GnnPipeError(f"{path}: part {int(np.argmin(sizes))} of the {k} parts is empty; "
                           f"repartition with fewer parts")
    graph_hash = graph.content_hash() if graph_hash is None else graph_hash
    perm, _, offsets, n_inner, indptr, indices = _renumber(graph, a, k, piece_nodes)
    deg_in = graph.in_degrees()[perm]
    deg_out = graph.out_degrees()[perm]
    halo_ptr, halo = halo_sets(indptr, indices, np.repeat(np.arange(k, dtype=np.int64), sizes), k)
    send, send_ptr, counts = _send_lists(halo_ptr, halo, offsets, k)

    hashes: dict[str, str] = {}

    def put(f: h5py.File, name: str, arr: np.ndarray) -> None:
        ds = f.create_dataset(name, data=arr)
        ds.attrs["sha256"] = hashes.setdefault(name, hash_arrays({name: np.asarray(arr)}))

    part_attrs = {}
    with atomic_path(path, ".h5") as tmp, h5py.File(tmp, "w") as f:
        put(f, "offsets", offsets)
        put(f, "perm", perm)
        put(f, "deg_in", deg_in)
        put(f, "deg_out", deg_out)
        for p in tqdm(range(k), desc=f"materialize {Path(path).name}", unit="part", disable=not progress):
            s, e = int(offsets[p]), int(offsets[p + 1])
            g = f.create_group(f"parts/{p}")
            part_attrs[p] = dict(start=s, end=e, n_inner=int(n_inner[p]))
            g.attrs.update(part_attrs[p])
            base = f"parts/{p}/"
            put(f, base + "indptr", indptr[s:e + 1] - indptr[s])
            put(f, base + "indices", indices[indptr[s]:indptr[e]])
            rows = perm[s:e]
            for name in NODE_ARRAYS:
                put(f, base + name, getattr(graph, name)[rows])
            put(f, base + "deg_in", deg_in[s:e])
            put(f, base + "deg_out", deg_out[s:e])
            h = halo[halo_ptr[p]:halo_ptr[p + 1]]
            put(f, base + "halo", h)
            put(f, base + "halo_deg_out", deg_out[h])
            put(f, base + "send", send[send_ptr[p]:send_ptr[p + 1]])
            put(f, base + "send_counts", counts[p])
            put(f, base + "recv_counts", counts[:, p].copy())
        attrs = dict(
            format_version=FORMAT_VERSION, num_parts=k, num_nodes=n, num_edges=graph.num_edges,
            num_features=graph.num_features, num_classes=graph.num_classes, graph_hash=graph_hash,
            partition_hash=hash_arrays({"assignment": a}), method=method, name=graph.name)
        attrs["attrs_hash"] = _attrs_hash(attrs, part_attrs)
        f.attrs.update(attrs, content_hash=_combine(hashes, attrs["attrs_hash"]))


def _combine(hashes: dict[str, str], attrs_hash: str) -> str:
    h = hashlib.sha256()
    for name in sorted(hashes):
        h.update(f"{name}:{hashes[name]}\n".encode())
    h.update(f"@attrs:{attrs_hash}\n".encode())
    return h.hexdigest()


def _canonical(v) -> str:
    """One spelling of an attribute value, whether given in Python or read back by h5py."""
    if isinstance(v, (bool, np.bool_)):
        return f"b:{bool(v)}"
    if isinstance(v, (int, np.integer)):
        return f"i:{int(v)}"
    if isinstance(v, (float, np.floating)):
        return f"f:{float(v)!r}"
    if isinstance(v, bytes):
        v = v.decode()
    if isinstance(v, str):
        return f"s:{v}"
    return f"a:{np.asarray(v).dtype.str}:{np.asarray(v).tolist()!r}"


def _attrs_hash(root: dict, parts: dict[int, dict]) -> str:
    """SHA-256 over the file's attributes (less the hashes themselves) and every part's."""
    h = hashlib.sha256()
    for key in sorted(set(root) - {"attrs_hash", "content_hash"}):
        h.update(f"{key}={_canonical(root[key])}\n".encode())
    for p in sorted(parts):
        for key in sorted(parts[p]):
            h.update(f"parts/{p}.{key}={_canonical(parts[p][key])}\n".encode())
    return h.hexdigest()


def open_run_store(cfg, parts: int) -> "ChunkStore":
    """The chunk store of run ``cfg``, refused unless it was cut from the run's graph into
    ``parts`` parts (the graph's hash is read from ``graph.h5``'s attributes: cheap).

    A config without a ``graph_path`` (engine tests that build a store directly) checks
    the parts only.
    """
    expect = str(read_graph_attrs(cfg.graph_path)["content_hash"]) if cfg.graph_path else None
    return ChunkStore(cfg.store_path, expect_graph_hash=expect, expect_parts=parts)


# --------------------------------------------------------------------------- reading
class ChunkStore:
    """Read a chunk store lazily: only the datasets a method needs, each checked on read.

    Refuses (``GnnPipeError`` naming the file and the 'materialize' rule) a missing or
    damaged file, another format version, a store made from another graph
    (``expect_graph_hash``) or for another number of parts (``expect_parts``).
    Use as a context manager, or call ``close()``.
    """

    def __init__(self, path: str | os.PathLike, *, expect_graph_hash: str | None = None,
                 expect_parts: int | None = None, verify: bool = True):
        self.path = Path(path)
        self.verify_reads = verify
        self._f: h5py.File | None = None
        self._cache: dict[str, np.ndarray] = {}
        attrs = dict(self._file().attrs)
        version = attrs.get("format_version")
        if version != FORMAT_VERSION:
            self.close()
            raise self._refuse(f"chunk store format version {version}, this gnnpipe reads "
                               f"version {FORMAT_VERSION}")
        try:
            self.num_parts = int(attrs["num_parts"])
            self.num_nodes = int(attrs["num_nodes"])
            self.num_edges = int(attrs["num_edges"])
            self.num_features = int(attrs["num_features"])
            self.num_classes = int(attrs["num_classes"])
            self.graph_hash = str(attrs["graph_hash"])
            self.partition_hash = str(attrs["partition_hash"])
            self.content_hash = str(attrs["content_hash"])
            self.attrs_hash = str(attrs["attrs_hash"])
            self.method = str(attrs["method"])
            self.name = str(attrs["name"])
        except KeyError as e:
            self.close()
            raise self._refuse(f"attribute {e} is missing (damaged or not a chunk store)") from None
        try:
            parts = {p: dict(self._file()[f"parts/{p}"].attrs) for p in range(self.num_parts)}
        except KeyError:
            self.close()
            raise self._refuse("a group under /parts is missing (damaged or truncated)") from None
        if _attrs_hash(attrs, parts) != self.attrs_hash:
            self.close()
            raise self._refuse("its attributes (num_classes, num_nodes, part bounds, ...) do not match "
                               "their hash (damaged or edited)")
        if expect_graph_hash is not None and self.graph_hash != expect_graph_hash:
            self.close()
            raise self._refuse(f"stale: made from graph {self.graph_hash[:12]}, the graph is now "
                               f"{expect_graph_hash[:12]}")
        if expect_parts is not None and self.num_parts != expect_parts:
            self.close()
            raise self._refuse(f"chunk store made for {self.num_parts} parts, this run needs {expect_parts}")
        self.offsets = self._read("offsets")
        if self.offsets.shape != (self.num_parts + 1,) or self.offsets[-1] != self.num_nodes:
            self.close()
            raise self._refuse("offsets do not match num_parts/num_nodes (damaged)")

    # ---- file handling
    def _refuse(self, why: str) -> GnnPipeError:
        return GnnPipeError(f"{self.path}: {why}. Delete it and rebuild it with the 'materialize' rule "
                            f"(snakemake {self.path}) or `gnnpipe materialize`.")

    def _file(self) -> h5py.File:
        if self._f is None:
            if not self.path.exists():
                raise GnnPipeError(f"{self.path}: no such chunk store; build it with the 'materialize' "
                                   f"rule (snakemake {self.path}) or `gnnpipe materialize`")
            try:
                self._f = h5py.File(self.path, "r")
            except OSError as e:
                raise self._refuse(f"not a readable HDF5 file, or truncated ({e})") from None
        return self._f

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> "ChunkStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ChunkStore({str(self.path)!r}, parts={self.num_parts}, nodes={self.num_nodes}, "
                f"edges={self.num_edges}, method={self.method!r})")

    def _read(self, name: str) -> np.ndarray:
        """One whole dataset, its hash checked (when ``verify``)."""
        try:
            ds = self._file()[name]
            arr = ds[()]
            want = ds.attrs["sha256"]
        except (KeyError, OSError) as e:
            raise self._refuse(f"cannot read /{name} ({e}): damaged or truncated") from None
        if self.verify_reads and hash_arrays({name: arr}) != want:
            raise self._refuse(f"content hash of /{name} does not match its data (damaged or edited)")
        return arr

    def _part_index(self, p: int) -> int:
        if not 0 <= p < self.num_parts:
            raise IndexError(f"part {p} out of range for a store of {self.num_parts} parts")
        return int(p)

    def _part_attrs(self, p: int) -> dict:
        try:
            return dict(self._file()[f"parts/{self._part_index(p)}"].attrs)
        except KeyError:
            raise self._refuse(f"group /parts/{p} is missing (damaged or truncated)") from None

    def read_part(self, p: int, name: str) -> np.ndarray:
        """One dataset of part ``p`` (``indptr``, ``features``, ``halo``, ``send``, ...)."""
        return self._read(f"parts/{self._part_index(p)}/{name}")

    # ---- global arrays
    @property
    def perm(self) -> np.ndarray:
        """``(N,)`` new id -> original id."""
        if "perm" not in self._cache:
            self._cache["perm"] = self._read("perm")
        return self._cache["perm"]

    def deg_in(self) -> np.ndarray:
        """``(N,)`` whole-graph in-degrees, new ids."""
        return self._read("deg_in")

    def deg_out(self) -> np.ndarray:
        """``(N,)`` whole-graph out-degrees, new ids."""
        return self._read("deg_out")

    def part_of(self, ids: np.ndarray) -> np.ndarray:
        """The part owning each new id."""
        return np.searchsorted(self.offsets, np.asarray(ids), side="right") - 1

    # ---- per part
    def part(self, p: int) -> Part:
        """Everything of part ``p`` except its send lists."""
        attrs = self._part_attrs(p)
        fields = {name: self.read_part(p, name) for name in ("indptr", "indices", *NODE_ARRAYS, "halo")}
        return Part(p=p, start=int(attrs["start"]), end=int(attrs["end"]), n_inner=int(attrs["n_inner"]),
                    **fields)

    def n_inner(self, p: int) -> int:
        return int(self._part_attrs(p)["n_inner"])

    def local_block(self, p: int, dtype: torch.dtype | None = None) -> Block:
        """Part ``p`` against its own rows then its halo rows (graph parallelism).

        Source positions: own node ``v`` -> ``v - start``; halo node -> ``n_p + i`` where
        ``i`` is its position in ``halo``.
        """
        p = self._part_index(p)
        start, end = int(self.offsets[p]), int(self.offsets[p + 1])
        n_p = end - start
        indptr, indices = self.read_part(p, "indptr"), self.read_part(p, "indices")
        halo = self.read_part(p, "halo")
        own = (indices >= start) & (indices < end)
        local = np.where(own, indices - start, n_p + np.searchsorted(halo, indices))
        deg_src = np.concatenate([self.read_part(p, "deg_out"), self.read_part(p, "halo_deg_out")])
        return _block(indptr, local, n_p + len(halo), 0, self.read_part(p, "deg_in"), deg_src, dtype)

    def chunk_block(self, c: int, dtype: torch.dtype | None = None) -> Block:
        """Chunk ``c`` against the whole graph (GNNPipe): sources are global new ids."""
        start = int(self.offsets[self._part_index(c)])
        return _block(self.read_part(c, "indptr"), self.read_part(c, "indices"), self.num_nodes,
                      start, self.read_part(c, "deg_in"), self.deg_out(), dtype)

    def full_block(self, dtype: torch.dtype | None = None) -> Block:
        """The whole graph in new ids (single process, exact inference)."""
        ptrs = [self.read_part(p, "indptr") for p in range(self.num_parts)]
        base = np.cumsum([0] + [int(q[-1]) for q in ptrs[:-1]])
        indptr = np.concatenate([[0]] + [q[1:] + b for q, b in zip(ptrs, base)])
        indices = np.concatenate([self.read_part(p, "indices") for p in range(self.num_parts)])
        return _block(indptr, indices, self.num_nodes, 0, self.deg_in(), self.deg_out(), dtype)

    def send_index(self, p: int) -> list[np.ndarray]:
        """Per receiver q: the local rows of p that q's halo lists, in q's halo order."""
        send, counts = self.read_part(p, "send"), self.read_part(p, "send_counts")
        return np.split(send, np.cumsum(counts)[:-1])

    def recv_counts(self, p: int) -> list[int]:
        """Per owner q: how many of p's halo rows q owns (p's halo is grouped by owner)."""
        return [int(x) for x in self.read_part(p, "recv_counts")]

    def read_all(self, name: str) -> np.ndarray:
        """A per-node array of the whole graph in new-id order (features, labels, masks)."""
        if name not in NODE_ARRAYS:
            raise ValueError(f"read_all reads one of {NODE_ARRAYS}, not {name!r}")
        return np.concatenate([self.read_part(p, name) for p in range(self.num_parts)])

    def verify(self) -> None:
        """Read every dataset, check its hash and the store's content hash."""
        hashes: dict[str, str] = {}

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                hashes[name] = hash_arrays({name: self._read(name)})

        self._file().visititems(visit)
        if _combine(hashes, self.attrs_hash) != self.content_hash:
            raise self._refuse("content hash does not match the store's datasets (damaged or edited)")


def _block(indptr, indices, num_src, start, deg_dst, deg_src, dtype) -> Block:
    """:meth:`Block.from_numpy`, importing torch only here: ``materialize`` (a set-up job) never
    builds a block, and torch's import is seconds of its time."""
    import torch

    from .models.block import Block

    return Block.from_numpy(indptr, indices, num_src, start, deg_dst, deg_src,
                            torch.float32 if dtype is None else dtype)
