"""Partition a graph's nodes into ``parts`` groups, and measure what a partition costs.

Methods (``partition_graph``):

* ``metis``: k-way METIS (pymetis) on the symmetrised adjacency without self loops, with
  one balance constraint per quantity the parts must hold about equally of
  (``partitioning.balance_nodes`` / ``balance_edges``): nodes (every vertex weighs 1: rows,
  activations, dense products) and in-edges (``in-degree + 1``: aggregation work). Both, the
  default, is METIS's multi-constraint partitioning (``ncon = 2``): on a skewed graph balancing
  the edges alone leaves the hubs' parts with few nodes and the others with many (an R-MAT
  graph of 4,096 nodes into 8 parts: 1.65x the mean node count, 1.03 with both; the edge
  balance stays within METIS's 3 %). Refused up front, with the GiB it needs, when the
  machine has not the memory for METIS's structures (``gnnpipe.costmodel.stages``: ~40
  bytes per stored edge beside the graph).
* ``random``: a seeded random assignment with part sizes differing by at most one.
  The worst case for communication; an ablation.
* ``contiguous``: ranges of node ids, balanced by node count, by ``in-degree + 1``
  (``balance_edges`` alone) or, with both, by the sum of a node's shares of the two totals
  (one cut per part cannot hold two constraints). As good as the dataset's own ordering.

``partition_stats`` computes what the modes pay for a partition, whatever made it:
edge cut, balance, and the mirrors (halo) of every part, ``M_p`` in the closed-form
byte counts of graph parallelism (docs/ARCHITECTURE.md). Everything is vectorised:
a graph of 10^6 nodes and 2*10^7 edges costs one sort of its cut edges and, for
METIS, a single pymetis call.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import scipy.sparse as sp

from .costmodel.stages import available_memory, metis_extra_bytes
from .graph import Graph, row_entries
from .io import GnnPipeError, atomic_path

METHODS = ("metis", "random", "contiguous")


# --------------------------------------------------------------------------- partitioning
def partition_graph(graph: Graph, method: str, parts: int, *, seed: int = 0, balance_edges: bool = True,
                    balance_nodes: bool = True, memory_bytes: Optional[int] = None) -> np.ndarray:
    """Assign every node to one of ``parts`` parts: ``(N,) int64`` in ``[0, parts)``.

    ``balance_nodes`` / ``balance_edges``: the parts hold about as many nodes / in-edges each
    (module docstring; neither: node counts, as METIS without weights does). ``random``
    balances node counts whatever they say.

    Raises ``GnnPipeError`` for an unknown method, ``parts < 1``, more parts than
    nodes, a result that leaves a part empty, or (METIS) a graph whose adjacency and METIS
    structures need more than ``memory_bytes`` (default: the machine's available memory;
    ``gnnpipe.costmodel.stages.metis_extra_bytes``), before building them.
    """
    n = graph.num_nodes
    if method not in METHODS:
        raise GnnPipeError(f"unknown partition method {method!r}; use one of {', '.join(METHODS)}")
    if not isinstance(parts, (int, np.integer)) or parts < 1:
        raise GnnPipeError(f"number of parts must be an integer >= 1, got {parts!r}")
    parts = int(parts)
    if parts > n:
        raise GnnPipeError(f"cannot split a graph of {n} nodes into {parts} parts; "
                           f"use at most {n} parts (fewer workers or chunks)")
    if parts == 1:
        return np.zeros(n, dtype=np.int64)
    if method == "metis":
        _check_metis_memory(graph, memory_bytes)
        assignment = _metis(graph, parts, seed, vertex_weights(graph, balance_nodes, balance_edges))
    elif method == "random":
        assignment = _random(n, parts, seed)
    else:
        assignment = _contiguous(parts, vertex_weights(graph, balance_nodes, balance_edges), n)
    sizes = np.bincount(assignment, minlength=parts)
    if np.any(sizes == 0):
        empty = np.flatnonzero(sizes == 0)
        raise GnnPipeError(f"{method} partitioning of {graph.name} ({n} nodes) into {parts} parts left "
                           f"{len(empty)} part(s) empty (e.g. part {int(empty[0])}); use fewer parts "
                           f"or another method")
    return assignment


#: Nodes per METIS part of a locality order: 1,024 rows of 128 float32 features are 512 KiB,
#: so a part's rows stay in a core's L2 cache while its neighbours are gathered.
LOCALITY_PART_NODES = 1024


def locality_order(graph: Graph, *, part_nodes: int = LOCALITY_PART_NODES, seed: int = 0,
                   memory_bytes: Optional[int] = None) -> Optional[np.ndarray]:
    """A renumbering that puts graph neighbours at nearby ids: ``order[new] = old`` (for
    ``Graph.renumbered``), or None for a graph of fewer than two parts' worth of nodes.

    k-way METIS into ``N // part_nodes`` parts, nodes sorted by part (stably: by id within a
    part). An aggregation gathers each destination's neighbour rows; with ids as a dataset or a
    random generator gives them, those rows lie anywhere in the ``(N, d)`` table and most
    gathers miss the caches. Numbered by part, most neighbours of a row lie in its own part:
    on the issue #27 graph (10^5 nodes, 4.9·10^6 edges, a DC-SBM with ids permuted) one
    128-wide sum aggregation takes 38 ms instead of 96 (2 threads; ``benchmarks/bench_dgl.py``
    measures whole epochs). Any ``part_nodes`` from ~200 to ~1,500 does as well; METIS costs
    about 1.5 s there, once per run. Raises ``GnnPipeError`` (naming the GiB) when METIS has
    not the memory, as ``partition_graph`` does.
    """
    parts = graph.num_nodes // max(int(part_nodes), 1)
    if parts < 2:
        return None
    _check_metis_memory(graph, memory_bytes)
    return np.argsort(_metis(graph, parts, seed), kind="stable")


def node_order(graph: Graph, how: str, *, seed: int = 0, path: Optional[str | os.PathLike] = None,
               graph_hash: Optional[str] = None) -> dict:
    """How the single engine numbers the nodes (``training.node_order``; calibration times its
    single-process rates on the same numbering): ``{"node_order", "parts", "seconds"}``, ``"file"``
    when read from one, and, when renumbering, ``"order"`` (``gnnpipe.partition.locality_order``).

    ``"locality"`` renumbers by METIS parts: every node's aggregation then adds the same numbers
    in the same order (rows keep their neighbours' order), the dense products and the loss see the
    rows permuted, so the run equals one on the given ids up to float rounding in the reductions
    over nodes (weight gradients, the loss), and a checkpoint is the same model either way. A
    graph too small to gain, or too large for METIS in the memory available, keeps its ids (the
    latter says so on stderr).

    ``path``: the order computed once per graph (``gnnpipe locality``, the workflow's rule locality;
    :func:`write_locality`), read instead of running METIS when the file exists, and checked against
    the graph (``graph_hash``, its content hash) and ``seed``: the same numbering, bit for bit.
    ``"seconds"`` is METIS's time either way."""
    info = {"node_order": how, "parts": 0, "seconds": 0.0}
    if how != "locality":
        return info
    if path is not None and Path(path).exists():
        held = read_locality(path, graph.num_nodes, graph_hash if graph_hash is not None else graph.content_hash(),
                             seed)
        order, info["seconds"], skipped = held["order"], held["seconds"], held["skipped"]
        info["file"] = str(path)
    else:
        order, info["seconds"], skipped = _timed_locality(graph, seed)
    if skipped:
        print(f"gnnpipe: warning: training.node_order 'locality' skipped, the given ids kept: {skipped}",
              file=sys.stderr, flush=True)
    if order is None:
        return dict(info, node_order="given", seconds=0.0)
    return dict(info, parts=graph.num_nodes // LOCALITY_PART_NODES, order=order)


def _timed_locality(graph: Graph, seed: int) -> tuple[Optional[np.ndarray], float, str]:
    """``(order or None, METIS seconds, why it was skipped or "")``."""
    t0 = time.perf_counter()
    try:
        order = locality_order(graph, part_nodes=LOCALITY_PART_NODES, seed=seed)
    except GnnPipeError as e:
        return None, 0.0, str(e)
    return order, round(time.perf_counter() - t0, 3), ""


def write_locality(path: str | os.PathLike, graph: Graph, *, seed: int = 0,
                   graph_hash: Optional[str] = None) -> dict:
    """Compute the locality order of ``graph`` once and write it atomically (``.npz``): the order
    (empty: the given ids are kept), the graph's content hash, the seed, the nodes per part,
    METIS's seconds and why it was skipped (a graph too large for METIS here). Returns a summary."""
    order, seconds, skipped = _timed_locality(graph, seed)
    digest = graph_hash if graph_hash is not None else graph.content_hash()
    with atomic_path(path, ".npz") as tmp, open(tmp, "wb") as f:
        np.savez(f, order=np.zeros(0, np.int64) if order is None else order.astype(np.int64, copy=False),
                 graph_hash=np.array(digest), seed=np.int64(seed), part_nodes=np.int64(LOCALITY_PART_NODES),
                 seconds=np.float64(seconds), skipped=np.array(skipped))
    return {"nodes": graph.num_nodes, "parts": 0 if order is None else graph.num_nodes // LOCALITY_PART_NODES,
            "seconds": seconds, "skipped": skipped}


def read_locality(path: str | os.PathLike, num_nodes: int, graph_hash: str, seed: int) -> dict:
    """A file of :func:`write_locality`, checked against the graph and seed it must belong to:
    ``{"order": (N,) int64 or None, "seconds", "skipped"}``."""
    fix = "; delete it and rerun the workflow (rule locality) or `gnnpipe locality`"
    try:
        with np.load(Path(path), allow_pickle=False) as z:
            held = {k: z[k] for k in ("order", "graph_hash", "seed", "part_nodes", "seconds", "skipped")}
    except (OSError, ValueError, KeyError, EOFError) as e:
        raise GnnPipeError(f"{path}: not a readable locality order ({' '.join(str(e).split())[:200]}){fix}") from None
    if str(held["graph_hash"]) != graph_hash:
        raise GnnPipeError(f"{path}: computed for another graph (content hash {str(held['graph_hash'])[:12]}, the "
                           f"run's graph has {graph_hash[:12]}){fix}")
    if int(held["seed"]) != seed or int(held["part_nodes"]) != LOCALITY_PART_NODES:
        raise GnnPipeError(f"{path}: computed with seed {int(held['seed'])} and {int(held['part_nodes'])} nodes per "
                           f"part, the run asks seed {seed} and {LOCALITY_PART_NODES}{fix}")
    order = held["order"].astype(np.int64, copy=False)
    if order.size and order.shape != (num_nodes,):
        raise GnnPipeError(f"{path}: an order of {order.size} nodes, the graph has {num_nodes}{fix}")
    return {"order": order if order.size else None, "seconds": float(held["seconds"]),
            "skipped": str(held["skipped"])}


def part_locality_key(graph: Graph, assignment: np.ndarray, parts: int, *,
                      part_nodes: Optional[int] = None, seed: int = 0) -> np.ndarray:
    """Each node's piece inside its part, ``(N,) int64``: METIS on the subgraph a part induces, into
    ``n_p // part_nodes`` pieces (0 everywhere in a part of fewer than two pieces' worth of nodes).

    The chunk store sorts a part's rows by it (``gnnpipe.store``): the locality order of the single
    engine (:func:`locality_order`), inside each part, for graph, pipeline and hybrid runs. One part
    at a time: METIS's structures are those of the largest part, not of the whole graph.
    """
    part_nodes = LOCALITY_PART_NODES if part_nodes is None else int(part_nodes)
    n = graph.num_nodes
    key = np.zeros(n, dtype=np.int64)
    sizes = np.bincount(assignment, minlength=parts)
    for p in np.flatnonzero(sizes >= 2 * part_nodes):
        nodes = np.flatnonzero(assignment == p)  # ascending ids
        m = len(nodes)
        local = np.full(n, -1, dtype=np.int64)
        local[nodes] = np.arange(m, dtype=np.int64)
        ptr, pos = row_entries(graph.indptr, nodes)
        src = local[graph.indices[pos]]  # the part's in-edges, sources renamed (-1: outside the part)
        del local, pos
        inside = src >= 0
        sub_ptr = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(np.bincount(np.repeat(np.arange(m, dtype=np.int64), np.diff(ptr))[inside], minlength=m),
                  out=sub_ptr[1:])
        xadj, adjncy = _symmetric_csr(sub_ptr, src[inside], m)
        del src, inside
        key[nodes] = _part_graph(xadj, adjncy, m // part_nodes, seed)
    return key


def symmetric_adjacency(graph: Graph) -> tuple[np.ndarray, np.ndarray]:
    """CSR ``(xadj, adjncy)`` of the undirected graph: both directions, no self loops, no duplicates.

    Built with scipy's CSR addition ``A + A^T`` (linear time; a sort of 2E keys is ~20x slower).
    """
    return _symmetric_csr(graph.indptr, graph.indices, graph.num_nodes)


def _symmetric_csr(indptr: np.ndarray, indices: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`symmetric_adjacency` of an in-edge CSR ``(indptr, indices)`` of ``n`` nodes."""
    row = np.repeat(np.arange(n, dtype=np.int64), np.diff(indptr))
    keep = indices != row
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(row[keep], minlength=n), out=ptr[1:])
    a = sp.csr_array((np.ones(int(ptr[-1]), dtype=bool), indices[keep], ptr), shape=(n, n))
    s = (a + a.T).tocsr()  # boolean: duplicates and both directions merge to one entry
    s.sort_indices()
    return s.indptr.astype(np.int64, copy=False), s.indices.astype(np.int64, copy=False)


def _check_metis_memory(graph: Graph, memory_bytes: Optional[int]) -> None:
    need = metis_extra_bytes(graph.num_nodes, graph.num_edges)
    have = available_memory() if memory_bytes is None else memory_bytes
    if have is not None and need > have:
        raise GnnPipeError(
            f"METIS on {graph.name} ({graph.num_nodes:,} nodes, {graph.num_edges:,} stored edges) needs "
            f"about {need / 2**30:.1f} GiB beside the graph, {have / 2**30:.1f} GiB are available; free "
            f"memory, partition on a machine with more, or use method 'contiguous' or 'random'")


def _metis(graph: Graph, parts: int, seed: int, vweights: Optional[np.ndarray] = None) -> np.ndarray:
    return _part_graph(*symmetric_adjacency(graph), parts, seed, vweights)


def vertex_weights(graph: Graph, balance_nodes: bool, balance_edges: bool) -> Optional[np.ndarray]:
    """METIS's vertex weights for the balance asked: None (node counts), ``(N,)`` in-degree + 1
    (edges alone), or ``(N, 2)`` one column per constraint, nodes then edges (both)."""
    if not balance_edges:
        return None
    edges = graph.in_degrees() + 1
    return np.stack([np.ones_like(edges), edges], axis=1) if balance_nodes else edges


def _part_graph(xadj: np.ndarray, adjncy: np.ndarray, parts: int, seed: int,
                vweights: Optional[np.ndarray] = None) -> np.ndarray:
    """k-way METIS (one call) on a symmetric adjacency: ``(n,) int64`` parts. ``vweights``:
    ``(n,)`` for one balance constraint, ``(n, ncon)`` for several."""
    import pymetis

    idx = pymetis.zero_copy_dtype()  # METIS's idx_t: no copy when the arrays already match
    xadj, adjncy = xadj.astype(idx, copy=False), adjncy.astype(idx, copy=False)
    if vweights is not None and vweights.ndim == 2:
        return _kway_constraints(xadj, adjncy, parts, seed, vweights.astype(idx))
    _, membership = pymetis.part_graph(
        parts, pymetis.CSRAdjacency(xadj, adjncy),
        vweights=None if vweights is None else vweights.astype(idx), options=pymetis.Options(seed=int(seed)),
        recursive=False)
    return np.asarray(membership, dtype=np.int64)


#: METIS 5's ``METIS_NOPTIONS`` and its return code for success (``metis.h``).
_METIS_NOPTIONS, _METIS_OK = 40, 1


def _kway_constraints(xadj: np.ndarray, adjncy: np.ndarray, parts: int, seed: int,
                      vweights: np.ndarray) -> np.ndarray:
    """``METIS_PartGraphKway`` with ``ncon = vweights.shape[1]`` balance constraints (each within
    METIS's default 3 %), called in the METIS that pymetis carries: pymetis 2025.2 passes
    ``ncon = 1`` whatever the weights, so it would read the first column's worth of a
    flattened ``(n, ncon)`` array as one constraint. Same options as :func:`_part_graph`
    (seed, 0-based numbering); one constraint here gives pymetis's partition bit for bit."""
    import ctypes

    import pymetis._internal as metis
    from pymetis._internal import options_indices

    n, ncon = vweights.shape
    c_idx = np.ctypeslib.as_ctypes_type(xadj.dtype)
    ptr = ctypes.POINTER(c_idx)
    lib = ctypes.CDLL(metis.__file__)  # the loaded extension: its METIS_* symbols are exported
    options = np.zeros(_METIS_NOPTIONS, dtype=xadj.dtype)
    lib.METIS_SetDefaultOptions(options.ctypes.data_as(ptr))
    options[options_indices.SEED] = int(seed)
    options[options_indices.NUMBERING] = 0
    vwgt = np.ascontiguousarray(vweights)  # row-major: vertex i's weights at i*ncon ..
    part, cut = np.zeros(n, dtype=xadj.dtype), np.zeros(1, dtype=xadj.dtype)
    nvtxs, nc, nparts = c_idx(n), c_idx(ncon), c_idx(parts)
    kway = lib.METIS_PartGraphKway
    kway.restype = ctypes.c_int
    rc = kway(ctypes.byref(nvtxs), ctypes.byref(nc), xadj.ctypes.data_as(ptr), adjncy.ctypes.data_as(ptr),
              vwgt.ctypes.data_as(ptr), None, None, ctypes.byref(nparts), None, None,
              options.ctypes.data_as(ptr), cut.ctypes.data_as(ptr), part.ctypes.data_as(ptr))
    if rc != _METIS_OK:
        raise GnnPipeError(f"METIS with {ncon} balance constraints failed (code {rc}) on {n} nodes into "
                           f"{parts} parts; set partitioning.balance_nodes: false (edges alone) or use "
                           f"method 'contiguous'")
    return part.astype(np.int64, copy=False)


def _random(n: int, parts: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    assignment = np.empty(n, dtype=np.int64)
    assignment[rng.permutation(n)] = np.arange(n, dtype=np.int64) % parts
    return assignment


def _contiguous(parts: int, weights: Optional[np.ndarray], n: int) -> np.ndarray:
    """Ranges of ids holding about equal sums of ``weights`` (None: equal node counts; two
    columns: the sum of each node's shares of the two columns' totals)."""
    if weights is None:
        return np.arange(n, dtype=np.int64) * parts // n  # sizes differ by at most one
    if weights.ndim == 2:
        weights = (weights / weights.sum(axis=0)).sum(axis=1)
    prefix = np.zeros(n + 1, dtype=weights.dtype)
    np.cumsum(weights, out=prefix[1:])
    targets = prefix[-1] * np.arange(parts + 1, dtype=np.float64) / parts
    # the cut nearest to each target weight
    hi = np.clip(np.searchsorted(prefix, targets), 1, n)
    bounds = np.where(np.abs(prefix[hi - 1] - targets) <= np.abs(prefix[hi] - targets), hi - 1, hi)
    # strictly increasing, bounds[0] = 0, bounds[parts] = n, every part non-empty
    i = np.arange(parts + 1)
    bounds = np.minimum(np.maximum.accumulate(np.maximum(bounds - i, 0)), n - parts) + i
    return np.repeat(np.arange(parts, dtype=np.int64), np.diff(bounds))


# --------------------------------------------------------------------------- statistics
def halo_sets(indptr: np.ndarray, indices: np.ndarray, assignment: np.ndarray,
              parts: int) -> tuple[np.ndarray, np.ndarray]:
    """The halo of every part as a CSR ``(halo_ptr (parts+1,), halo (sum M_p,))``.

    ``halo[halo_ptr[p]:halo_ptr[p+1]]`` are the distinct nodes outside part ``p`` that
    are the source of an in-edge of a node of ``p``, ascending. One sort of the cut edges.
    """
    n = len(indptr) - 1
    part_dst = np.repeat(assignment, np.diff(indptr))  # (E,)
    part_src = assignment[indices]
    cut = part_dst != part_src
    key = np.sort(part_dst[cut] * n + indices[cut])  # sorted by (part, source)
    # distinct pairs by sort + mask: np.unique is hash-based in numpy >= 2.3, ~10x slower here
    key = key[np.concatenate(([True], key[1:] != key[:-1]))] if key.size else key
    halo_ptr = np.searchsorted(key, np.arange(parts + 1, dtype=np.int64) * n)
    return halo_ptr.astype(np.int64), key - np.repeat(np.arange(parts, dtype=np.int64) * n, np.diff(halo_ptr))


def check_assignment(assignment, num_nodes: int, parts: int | None = None, *, where: str = "assignment",
                     fix: str = "") -> np.ndarray:
    """Return ``assignment`` as int64 after checking its shape and range; ``GnnPipeError`` otherwise."""
    a = np.asarray(assignment)
    if a.shape != (num_nodes,):
        raise GnnPipeError(f"{where}: partition has shape {a.shape}, the graph has {num_nodes} nodes{fix}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise GnnPipeError(f"{where}: partition must hold integer part ids, got dtype {a.dtype}{fix}")
    a = a.astype(np.int64, copy=False)
    hi = parts if parts is not None else (int(a.max()) + 1 if a.size else 0)
    if a.size and (a.min() < 0 or a.max() >= hi):
        raise GnnPipeError(f"{where}: part ids must lie in [0, {hi}), found [{a.min()}, {a.max()}]{fix}")
    return a


def part_balance(nodes, edges) -> dict:
    """``nodes_per_part``, ``edges_per_part`` (in-edges into each part) and the balance of each,
    ``node_balance`` and ``edge_balance``: the largest part over the mean (1.0: even)."""
    def balance(x):
        mean = x.mean()
        return float(x.max() / mean) if mean > 0 else 1.0

    nodes, edges = np.asarray(nodes, dtype=np.int64), np.asarray(edges, dtype=np.int64)
    return {"nodes_per_part": nodes.tolist(), "edges_per_part": edges.tolist(),
            "node_balance": balance(nodes), "edge_balance": balance(edges)}


def balance_name(method: str, balance_nodes: bool, balance_edges: bool) -> str:
    """What a ``method`` partition is balanced in: ``nodes+edges``, ``edges`` or ``nodes`` (``random``: nodes)."""
    if method == "random" or not balance_edges:
        return "nodes"
    return "nodes+edges" if balance_nodes else "edges"


def partition_stats(graph: Graph, assignment: np.ndarray, parts: int | None = None) -> dict:
    """What a partition costs; independent of the method that made it.

    ``edge_cut`` counts stored in-edges whose endpoints lie in different parts;
    ``edges_per_part`` counts the in-edges *into* each part; ``mirrors[p]`` is the
    number of distinct nodes outside ``p`` that are sources of an edge into ``p``
    (``len(halo_p)``); balances are ``max / mean``. ``parts`` defaults to
    ``max(assignment) + 1``.
    """
    n = graph.num_nodes
    a = check_assignment(assignment, n, parts)
    k = int(parts) if parts is not None else int(a.max()) + 1
    deg_in = graph.in_degrees()
    nodes = np.bincount(a, minlength=k)
    edges = np.bincount(a, weights=deg_in, minlength=k).astype(np.int64)
    halo_ptr, _ = halo_sets(graph.indptr, graph.indices, a, k)
    mirrors = np.diff(halo_ptr)
    part_dst = np.repeat(a, deg_in)
    edge_cut = int(np.count_nonzero(part_dst != a[graph.indices]))
    return {
        "parts": k,
        "num_nodes": n,
        "num_edges": graph.num_edges,
        "edge_cut": edge_cut,
        "edge_cut_fraction": edge_cut / graph.num_edges if graph.num_edges else 0.0,
        **part_balance(nodes, edges),
        "mirrors": mirrors.tolist(),
        "mirrors_total": int(mirrors.sum()),
        "mirrors_max": int(mirrors.max()),
        "mirrors_over_n": float(mirrors.sum() / n),
    }


# --------------------------------------------------------------------------- files
def write_partition(path_npy: str | os.PathLike, assignment: np.ndarray) -> None:
    """Write an assignment as a ``.npy`` file of int64, atomically."""
    a = np.asarray(assignment)
    if a.ndim != 1 or (a.size and (not np.issubdtype(a.dtype, np.integer) or a.min() < 0)):
        raise GnnPipeError(f"{path_npy}: a partition is a 1-D array of non-negative part ids")
    with atomic_path(path_npy, ".npy") as tmp, open(tmp, "wb") as f:
        np.save(f, a.astype(np.int64, copy=False), allow_pickle=False)


def read_partition(path: str | os.PathLike, num_nodes: int, parts: int | None = None) -> np.ndarray:
    """Read an assignment written by ``write_partition``, checking its length and range."""
    fix = (f"; delete it and rebuild it with the 'partition' rule (snakemake {path}) "
           f"or `gnnpipe partition`")
    try:
        a = np.load(Path(path), allow_pickle=False)
    except FileNotFoundError:
        raise GnnPipeError(f"{path}: no such partition file; build it with the 'partition' rule "
                           f"or `gnnpipe partition`") from None
    except (OSError, ValueError, EOFError) as e:
        raise GnnPipeError(f"{path}: not a readable .npy partition ({e}){fix}") from None
    a = check_assignment(a, num_nodes, parts, where=str(path), fix=fix)
    if parts is not None and a.size:
        sizes = np.bincount(a, minlength=parts)
        if np.any(sizes == 0):
            raise GnnPipeError(f"{path}: part {int(np.argmin(sizes))} of {parts} is empty{fix}")
    return a
