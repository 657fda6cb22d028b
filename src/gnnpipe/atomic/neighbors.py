"""Symmetric neighbour lists with cell lists (vesin), reverse edges, triplets and triplet ranks.

``radius_graph`` is the one neighbour search of every atomic dataset (``data.build_graphs``)
and model (tests: the edges and order of a dense all-pairs × images search without a cap),
and it is **symmetric**: every edge ``j -> i`` (neighbour image at ``pos[j] + shift``) comes with
its reverse ``i -> j`` (image ``-shift``), also when a neighbour cap binds. GemNet takes the
reverse edge's message through ``id_swap`` (``reverse_edges``), which needs that.

Conventions (those of ``AtomGraph``):

* edge vector ``v = pos[i] - pos[j] - shift`` (from the neighbour's image to the target);
  ``0 < |v| < cutoff``; ``shift = n @ cell`` with integer image ``n`` on periodic axes;
* order: by target ``i``, then distance, then source ``j``, then image ``n`` (lexicographic):
  the order of ``data.radius_graph``;
* **neighbour cap** ``max_neighbors``: each target ranks its neighbours in that order and
  *nominates* the first ``max_neighbors``; an edge is kept if it or its reverse is
  nominated (an edge is dropped only if both of its directions were dropped). So every atom
  keeps its ``max_neighbors`` nearest, the edge set stays symmetric, and the result does
  not depend on how atoms are numbered, except among neighbours at exactly the same
  distance (tie-break by source, then image). An atom may end with more than
  ``max_neighbors`` neighbours (those that nominated it). fairchem's GemNet keeps instead
  the direction with ``src < dst`` of the per-target cut and mirrors it, which depends on
  the numbering; a mutual cut (both directions nominated) would bound degrees but drop
  some of an atom's nearest neighbours.
* triplets ``k -> j -> i`` (``triplets``): every input edge of ``j`` but ``i``'s own image;
  ``triplet_rank`` numbers each output edge's triplets ``0, 1, ...`` in triplet order.
"""

from __future__ import annotations

import numpy as np

from ..io import GnnPipeError

__all__ = ["radius_graph", "reverse_edges", "triplets", "triplet_rank", "system_graph"]


def triplets(src: np.ndarray, dst: np.ndarray, shift: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(idx_kj, idx_ji)``: for every edge ji (j -> i) every edge kj (k -> j), except the one whose
    source is i's own image (``k == i`` and ``shift_kj + shift_ji == 0``).

    Order: by ``ji``, then ``kj`` by edge id. Per triplet only index arithmetic (a CSR expansion of
    each edge's source's input edges); the excluded pairs are found per edge (the edges ``i -> j``,
    few), so no per-triplet shifts or id comparisons are built (the graph building timed by
    benchmarks/bench_atom_layout.py)."""
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    shift = np.asarray(shift, dtype=np.float64).reshape(-1, 3)
    e = len(src)
    n = int(max(dst.max(initial=-1), src.max(initial=-1))) + 1
    by_dst = np.argsort(dst, kind="stable")  # the input edges of each atom, by edge id
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=starts[1:])
    counts = starts[src + 1] - starts[src]  # input edges of each edge's source j
    first = np.cumsum(counts) - counts  # each edge's first triplet
    # excluded: the pairs (ji, kj) with kj = i -> j and shift_kj = -shift_ji; the candidates are the
    # edges i -> j (any image), found by their (dst, src) key
    korder = np.argsort(dst * n + src, kind="stable")
    keys, query = (dst * n + src)[korder], src * n + dst
    lo = np.searchsorted(keys, query, side="left")
    many = np.searchsorted(keys, query, side="right") - lo
    pair_ji = np.repeat(np.arange(e), many)
    pair_kj = korder[np.repeat(lo - (np.cumsum(many) - many), many) + np.arange(len(pair_ji))]
    same = np.all(np.abs(shift[pair_kj] + shift[pair_ji]) < 1e-8, axis=1)
    pair_ji, pair_kj = pair_ji[same], pair_kj[same]
    rank = np.empty(e, dtype=np.int64)  # each edge's place among its target's input edges
    rank[by_dst] = np.arange(e) - starts[dst[by_dst]]
    keep = np.ones(int(counts.sum()), dtype=bool)
    keep[first[pair_ji] + rank[pair_kj]] = False
    pos = np.repeat(starts[src] - first, counts)  # the triplet's input edge, as a position in by_dst
    pos += np.arange(len(pos))
    idx_kj = by_dst[pos[keep]]
    idx_ji = np.repeat(np.arange(e), counts - np.bincount(pair_ji, minlength=e))
    return idx_kj, idx_ji


def _reverse(src: np.ndarray, dst: np.ndarray, image: np.ndarray) -> np.ndarray:
    """The index of edge ``(dst, src, -image)`` for every edge ``(src, dst, image)``: the edges and
    their reverses, each sorted the same way, line up row for row when the set is symmetric."""
    table = np.lexsort((image[:, 2], image[:, 1], image[:, 0], dst, src))
    query = np.lexsort((-image[:, 2], -image[:, 1], -image[:, 0], src, dst))
    same = (src[table] == dst[query]) & (dst[table] == src[query]) & np.all(image[table] == -image[query], axis=1)
    if not same.all():
        rows = {(int(a), int(b), *map(int, n)) for a, b, n in zip(src, dst, image)}
        e = next(e for e in range(len(src)) if (int(dst[e]), int(src[e]), *map(int, -image[e])) not in rows)
        raise GnnPipeError(f"the edge set is not symmetric: edge {e} ({int(src[e])} -> {int(dst[e])}, image "
                           f"{image[e].tolist()}) has no reverse edge; build it with atomic.neighbors.radius_graph")
    swap = np.empty(len(src), dtype=np.int64)
    swap[query] = table
    return swap


def reverse_edges(src, dst, shift, resolution: float = 1e-4) -> np.ndarray:
    """``id_swap`` (E,): the index of the reverse edge ``i -> j`` (shift ``-shift``) of every edge.

    Shifts are matched on a grid of ``resolution`` Å (images differ by whole cell vectors,
    and ``-(n @ cell) == (-n) @ cell`` exactly). Works on one system or on a batch (atom ids
    unique in the batch). A non-symmetric edge set is an error naming an edge without reverse.
    """
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    image = np.round(np.asarray(shift, dtype=np.float64).reshape(-1, 3) / resolution).astype(np.int64)
    return _reverse(src, dst, image)


def triplet_rank(idx_ji, num_edges: int) -> np.ndarray:
    """(T,) each triplet's rank among the triplets of its output edge, in triplet order."""
    idx_ji = np.asarray(idx_ji, dtype=np.int64)
    order = np.argsort(idx_ji, kind="stable")
    counts = np.bincount(idx_ji, minlength=num_edges)
    starts = np.cumsum(counts) - counts
    rank = np.empty_like(idx_ji)
    rank[order] = np.arange(len(idx_ji), dtype=np.int64) - starts[idx_ji[order]]
    return rank


def radius_graph(pos, cell, pbc, cutoff: float, max_neighbors: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric edges ``j -> i`` with ``0 < |pos_i - pos_j - shift| < cutoff`` (see the module
    docstring for the order and the cap). Returns ``src`` (j), ``dst`` (i), ``shift`` (E, 3)."""
    import vesin

    pos = np.ascontiguousarray(pos, dtype=np.float64).reshape(-1, 3)
    cell = np.asarray(cell, dtype=np.float64).reshape(3, 3)
    pbc = np.broadcast_to(np.asarray(pbc, dtype=bool), (3,))
    if max_neighbors is not None and max_neighbors < 1:
        raise GnnPipeError(f"max_neighbors must be >= 1 (or None: no cap), got {max_neighbors}")
    if len(pos) < 2 and not pbc.any():
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 3))
    nl = vesin.NeighborList(cutoff=float(cutoff), full_list=True)
    i, j, image = nl.compute(pos, cell if pbc.any() else np.zeros((3, 3)), pbc.tolist(), "ijS")
    i, j, image = i.astype(np.int64), j.astype(np.int64), image.astype(np.int64).reshape(-1, 3)
    shift = image @ cell
    d = np.linalg.norm(pos[i] - pos[j] - shift, axis=1)  # recomputed: the order must not depend on vesin's rounding
    ok = (d < cutoff) & (d > 1e-8)
    i, j, image, shift, d = i[ok], j[ok], image[ok], shift[ok], d[ok]
    order = np.lexsort((image[:, 2], image[:, 1], image[:, 0], j, d, i))
    i, j, image, shift = i[order], j[order], image[order], shift[order]
    if max_neighbors is not None:
        rank = np.arange(len(i)) - np.searchsorted(i, i)  # position among the target's neighbours
        nominated = rank < max_neighbors
        keep = nominated | nominated[_reverse(j, i, image)]
        i, j, shift = i[keep], j[keep], shift[keep]
    return j, i, shift


def system_graph(pos, cell, pbc, cutoff: float, max_neighbors: int | None = None) -> dict:
    """One system's symmetric radius graph and the index sets models declare (local ids):
    ``edge_src, edge_dst, edge_shift, id_swap, idx_kj, idx_ji`` (``triplet_rank`` is derived
    from ``idx_ji`` when a batch is sharded)."""
    src, dst, shift = radius_graph(pos, cell, pbc, cutoff, max_neighbors)
    kj, ji = triplets(src, dst, shift) if len(src) else (np.zeros(0, np.int64), np.zeros(0, np.int64))
    return {"edge_src": src, "edge_dst": dst, "edge_shift": shift, "id_swap": reverse_edges(src, dst, shift),
            "idx_kj": kj, "idx_ji": ji}
