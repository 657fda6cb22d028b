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
* **neighbour cap** ``max_neighbors``, two conventions (``datasets.<name>.atoms.neighbors``):

  - ``project`` (the default): each target ranks its neighbours in that order and *nominates*
    the first ``max_neighbors``; an edge is kept if it or its reverse is nominated (an edge is
    dropped only if both of its directions were dropped). So every atom keeps its
    ``max_neighbors`` nearest, the edge set stays symmetric, and the result does not depend on
    how atoms are numbered, except among neighbours at exactly the same distance (tie-break by
    source, then image). An atom may end with more than ``max_neighbors`` neighbours (those
    that nominated it).
  - ``fairchem``: the graph fairchem's GemNet-T/-dT computes on (fairchem-core 1.x,
    ``radius_graph_pbc`` + ``GemNetT.reorder_symmetric_edges``), reproduced edge for edge. Each
    target nominates its ``max_neighbors`` nearest by fairchem's squared distance, in float32 (in
    float64 from float64 positions and float32 offsets for a float64 model: ``dtype``)
    (``|pos_i - (pos_j + n @ cell)|² <= cutoff²`` and ``> 1e-4``, images ``|n_k| <=
    ceil(cutoff / h_k)`` with ``h_k`` the cell's height along axis k), strictly: among equal
    distances at the cut, the order of ``torch.sort`` (not stable) over each target's
    candidates listed by source, then image, in a row as wide as the most candidates of any
    target (up to 16 candidates that is the listed order; beyond, torch's introsort decides).
    Then a pair ``{a, b}`` with ``a < b`` is kept, in both directions, only if **b** nominated
    ``a`` (what ``a`` nominated does not count), and an atom's own image ``n`` only if ``n`` was
    nominated and is lexicographically negative. The set depends on the numbering of the atoms
    and an atom may keep fewer than its ``max_neighbors`` nearest (on Cu bulk, 32 atoms
    rattled, 6 Å / 50: 1,588 edges where ``project`` keeps 1,612). ``directed_graph`` gives
    the nominated edges as they are, the graph fairchem's DimeNet++ computes on. The shifts are
    fairchem's float32 offsets (``_fairchem_shifts``), not ``n @ cell``.

  The project's default differs because its graph should be a property of the structure:
  ``fairchem`` drops a pair when the higher-numbered atom did not nominate it, so renumbering
  the atoms changes the energy, and an atom can lose some of its nearest neighbours; a mutual
  cut (both directions nominated) would bound degrees but drop nearest neighbours too.
  ``fairchem`` is there to run fairchem's models on the neighbourhoods they were trained on.
* triplets ``k -> j -> i`` (``triplets``): every input edge of ``j`` but ``i``'s own image;
  ``triplet_rank`` numbers each output edge's triplets ``0, 1, ...`` in triplet order.
"""

from __future__ import annotations

import numpy as np

from ..config import NEIGHBOR_CONVENTIONS as CONVENTIONS
from ..io import GnnPipeError

__all__ = ["CONVENTIONS", "radius_graph", "directed_graph", "reverse_edges", "triplets", "triplet_rank", "system_graph"]


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


def radius_graph(pos, cell, pbc, cutoff: float, max_neighbors: int | None = None, convention: str = "project",
                 dtype: str = "float32") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric edges ``j -> i`` with ``0 < |pos_i - pos_j - shift| < cutoff`` (see the module
    docstring for the order and the cap; ``convention`` ``fairchem``: fairchem's GemNet graph, see
    there, as fairchem's model computes it in ``dtype``). Returns ``src`` (j), ``dst`` (i), ``shift`` (E, 3)."""
    import vesin

    pos, cell, pbc = _inputs(pos, cell, pbc, max_neighbors, convention)
    if len(pos) < 2 and not pbc.any():
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 3))
    if convention == "fairchem":
        i, j, image = _fairchem_nominated(pos, cell, pbc, cutoff, max_neighbors, dtype)
        first = (j < i) | ((j == i) & _earlier(image))  # GemNet keeps the edges a -> b with a < b, then mirrors
        i, j, image = np.concatenate([i[first], j[first]]), np.concatenate([j[first], i[first]]), \
            np.concatenate([image[first], -image[first]])
        return _in_order(pos, cell, i, j, image, fairchem=True)
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


def directed_graph(pos, cell, pbc, cutoff: float, max_neighbors: int | None = None, convention: str = "project",
                   dtype: str = "float32") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The per-target cut, not symmetric where the cap binds: each target's nominated neighbours
    alone, ``src`` (j), ``dst`` (i), ``shift`` in the order of ``radius_graph``. ``project``: the
    graphs of ``graphs.h5`` format 1 (the uncapped edges, each target's first ``max_neighbors``);
    ``fairchem``: the edges of fairchem's ``radius_graph_pbc`` (its DimeNet++ graph) in ``dtype``."""
    pos, cell, pbc = _inputs(pos, cell, pbc, max_neighbors, convention)
    if convention == "fairchem":
        return _in_order(pos, cell, *_fairchem_nominated(pos, cell, pbc, cutoff, max_neighbors, dtype), fairchem=True)
    src, dst, shift = radius_graph(pos, cell, pbc, cutoff)
    if max_neighbors is not None:
        keep = np.arange(len(dst)) - np.searchsorted(dst, dst) < max_neighbors  # rank among the target's
        src, dst, shift = src[keep], dst[keep], shift[keep]
    return src, dst, shift.reshape(-1, 3)


def _earlier(image: np.ndarray) -> np.ndarray:
    """Images before their negative in lexicographic order (first non-zero component < 0)."""
    return (image[:, 0] < 0) | ((image[:, 0] == 0) & (image[:, 1] < 0)) | \
        ((image[:, 0] == 0) & (image[:, 1] == 0) & (image[:, 2] < 0))


def _in_order(pos, cell, i, j, image, fairchem: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Edges ``j -> i`` (image ``n``) as ``(src, dst, shift)`` in the module's order (target, distance,
    source, image), the distances as the project's convention computes them. ``fairchem``: the shifts
    are fairchem's (``_fairchem_shifts``), not ``n @ cell``."""
    shift = _fairchem_shifts(cell, image) if fairchem else image @ cell
    d = np.linalg.norm(pos[i] - pos[j] - shift, axis=1)
    order = np.lexsort((image[:, 2], image[:, 1], image[:, 0], j, d, i))
    return j[order], i[order], shift[order].reshape(-1, 3)


def _inputs(pos, cell, pbc, max_neighbors: int | None, convention: str):
    """``pos`` (N, 3), ``cell`` (3, 3) float64 and ``pbc`` (3,) bool; a bad cap or convention refused."""
    if convention not in CONVENTIONS:
        raise GnnPipeError(f"neighbors: {convention!r} is no neighbour convention (one of {', '.join(CONVENTIONS)})")
    if max_neighbors is not None and max_neighbors < 1:
        raise GnnPipeError(f"max_neighbors must be >= 1 (or None: no cap), got {max_neighbors}")
    return (np.ascontiguousarray(pos, dtype=np.float64).reshape(-1, 3), np.asarray(cell, dtype=np.float64).reshape(3, 3),
            np.broadcast_to(np.asarray(pbc, dtype=bool), (3,)))


def _fairchem_offsets(cell: np.ndarray, pbc: np.ndarray, cutoff: float):
    """fairchem's image range and image offsets, with its float32 operations: ``rep`` (3,) the images
    ``-rep..rep`` it searches per axis (0 on an open axis) and ``offsets`` (3, K) of its ``K`` images in
    its order (``torch.cartesian_prod``: the first axis slowest)."""
    import torch

    c = torch.tensor(cell, dtype=torch.float32).view(1, 3, 3)
    cross = [torch.cross(c[:, a], c[:, b], dim=-1) for a, b in ((1, 2), (2, 0), (0, 1))]
    volume = torch.sum(c[:, 0] * cross[0], dim=-1, keepdim=True)
    rep = [torch.ceil(cutoff * torch.norm(cross[k] / volume, p=2, dim=-1)) if pbc[k] else c.new_zeros(1)
           for k in range(3)]
    if not all(bool(torch.isfinite(r).all()) for r in rep):
        raise GnnPipeError("neighbors: fairchem needs three independent cell vectors when an axis is periodic "
                           f"(its image count divides by the cell's volume), got cell {cell.tolist()}")
    images = torch.cartesian_prod(*[torch.arange(-r.max(), r.max() + 1, dtype=torch.float) for r in rep])
    k = len(images)
    offsets = torch.bmm(torch.transpose(c, 1, 2), torch.transpose(images.view(-1, 3), 0, 1).view(1, 3, k))
    return np.array([int(r.max()) for r in rep]), offsets[0].numpy()


def _fairchem_shifts(cell: np.ndarray, image: np.ndarray) -> np.ndarray:
    """(E, 3) the shifts fairchem's models add to ``pos[j] - pos[i]`` (``get_pbc_distances``:
    ``cell_offsets.float() @ cell.float()``, float32 whatever the model's dtype), as float64 numbers.
    A float64 model then sees fairchem's own edge vectors, not ``n @ cell`` (they differ by float32's
    rounding: up to 2e-5 of the energy of a gp-gemnet-dT model on a Pt slab); negated images give
    exactly negated shifts, so reverse edges and own images still match."""
    import torch

    if not len(image):
        return np.zeros((0, 3))
    n = torch.from_numpy(np.ascontiguousarray(image, dtype=np.float32)).view(-1, 1, 3)
    c = torch.tensor(cell, dtype=torch.float32).view(1, 3, 3).expand(len(n), 3, 3)
    return n.bmm(c).view(-1, 3).numpy().astype(np.float64)


def _fairchem_nominated(pos, cell, pbc, cutoff: float, max_neighbors: int | None, dtype: str = "float32"):
    """fairchem's ``radius_graph_pbc`` with ``enforce_max_neighbors_strictly`` (what GemNet-T and
    DimeNet++ call): ``(i, j, image)`` of the edges ``j -> i`` it returns, in its order (target,
    source, image). Candidates come from vesin at a slightly larger radius; which of them fairchem
    keeps is decided with its own arithmetic: the squared distance ``|pos_i - (pos_j + n @ cell)|²``
    in ``dtype`` (``<= cutoff²``, ``> 1e-4``), images within its range, and per target the
    ``max_neighbors`` first of ``torch.sort`` (not stable; on the CPU, as fairchem's calculator runs it)
    over a row of the targets' common width. ``dtype``: the precision of fairchem's positions (its
    model's): ``float64`` takes the positions as they are and the squared distances and their sort in
    float64 (the offsets stay float32, as fairchem's), which decides near-ties otherwise than float32
    (an atom's own images at ``±n`` tie exactly in float32; in float64 their rounding differs)."""
    import torch
    import vesin

    if len(pos) < 2 and not pbc.any():
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 3), np.int64)
    rep, offsets = _fairchem_offsets(cell, pbc, cutoff)
    fdtype = np.dtype(dtype)  # fairchem's positions, squared distances and sort table
    if fdtype not in (np.float32, np.float64):
        raise GnnPipeError(f"neighbors: fairchem's graph in {dtype!r}: float32 or float64")
    posf = pos.astype(fdtype)
    # vesin's radius: above the cutoff by more than float32's rounding of positions and offsets can move a distance
    margin = 1e-3 + 1e-6 * (np.abs(pos).max(initial=0.0) + np.abs(offsets).sum(axis=0).max(initial=0.0))
    nl = vesin.NeighborList(cutoff=float(cutoff) + margin, full_list=True)
    i, j, image = nl.compute(pos, cell if pbc.any() else np.zeros((3, 3)), pbc.tolist(), "ijS")
    i, j, image = i.astype(np.int64), j.astype(np.int64), image.astype(np.int64).reshape(-1, 3)
    inside = np.all(np.abs(image) <= rep, axis=1)
    i, j, image = i[inside], j[inside], image[inside]
    col = ((image[:, 0] + rep[0]) * (2 * rep[1] + 1) + image[:, 1] + rep[1]) * (2 * rep[2] + 1) + image[:, 2] + rep[2]
    diff = posf[i] - (posf[j] + offsets[:, col].T)  # as fairchem: pos1 - (pos2 + offset), offsets float32
    d2 = torch.from_numpy((diff[:, 0] * diff[:, 0] + diff[:, 1] * diff[:, 1]) + diff[:, 2] * diff[:, 2])
    ok = (torch.le(d2, cutoff * cutoff) & torch.gt(d2, 0.0001)).numpy()
    order = np.lexsort((col[ok], j[ok], i[ok]))  # fairchem's candidate order
    i, j, image, col, d2 = i[ok][order], j[ok][order], image[ok][order], col[ok][order], d2.numpy()[ok][order]
    count = np.bincount(i, minlength=len(pos))
    if max_neighbors is None or count.max(initial=0) <= max_neighbors:
        return i, j, image
    width, start = int(count.max()), np.cumsum(count) - count
    keep = count[i] <= max_neighbors
    over = np.nonzero(count > max_neighbors)[0]
    for rows in np.array_split(over, -(-len(over) // 4096)):  # torch.sort sorts row by row: chunks change nothing
        table = np.full((len(rows), width), np.inf, dtype=fdtype)
        mine = np.repeat(np.arange(len(rows)), count[rows])
        first = np.repeat(start[rows], count[rows])
        slot = np.arange(len(first)) - np.repeat(np.cumsum(count[rows]) - count[rows], count[rows])
        table[mine, slot] = d2[first + slot]
        _, idx = torch.sort(torch.from_numpy(table), dim=1)
        keep[(start[rows][:, None] + idx[:, :max_neighbors].numpy()).ravel()] = True
    return i[keep], j[keep], image[keep]


def system_graph(pos, cell, pbc, cutoff: float, max_neighbors: int | None = None, convention: str = "project",
                 symmetric: bool = True, dtype: str = "float32") -> dict:
    """One system's symmetric radius graph and the index sets models declare (local ids):
    ``edge_src, edge_dst, edge_shift, id_swap, idx_kj, idx_ji`` (``triplet_rank`` is derived
    from ``idx_ji`` when a batch is sharded). ``symmetric`` false: the per-target cut
    (``directed_graph``), without ``id_swap``. ``dtype``: the model's, for the ``fairchem`` convention."""
    src, dst, shift = (radius_graph if symmetric else directed_graph)(pos, cell, pbc, cutoff, max_neighbors, convention,
                                                                      dtype)
    kj, ji = triplets(src, dst, shift) if len(src) else (np.zeros(0, np.int64), np.zeros(0, np.int64))
    out = {"edge_src": src, "edge_dst": dst, "edge_shift": shift, "idx_kj": kj, "idx_ji": ji}
    return {**out, "id_swap": reverse_edges(src, dst, shift)} if symmetric else out
