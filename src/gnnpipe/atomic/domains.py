"""A distributed graph build for the atoms layout (#35): spatial domains and each rank's own region.

Today every rank of the atoms layout (``halo.py``) builds its view from the whole batch: the whole
neighbour list and every triplet live on every worker. This module is the first part of a build
whose memory per worker is ∝ N/P:

1. :func:`spatial_partition` chooses an owner for every atom of one structure from its positions
   alone (O(N) memory, no neighbour list): recursive bisection of the cell into P domains balanced
   by atom count, each cut across the domain's longest extent (measured in Å, across the lattice
   planes) at the atom-count quantile, in fractional coordinates wrapped into the cell on periodic
   axes (so an atom's periodic images all have the same owner).
2. :func:`region_graph` builds, on one rank, only the edges that rank needs: the edges into its own
   atoms and, with ``hops`` = 2, the edges into their neighbours (the input edges ``k -> j`` of the
   triplets ``k -> j -> i`` of an own ``i``, and GemNet's reverse edges ``i -> j``, which are among
   them). It takes the images of the atoms within ``cutoff × hops`` of its own atoms' fractional
   bounding box (a *cluster*, open boundaries), runs the neighbour search already used
   (``neighbors.radius_graph``, vesin) on that cluster, and names each edge by its global key
   ``(source, target, image)``, the same edges in the same order as the whole structure's
   ``radius_graph`` restricted to those targets.

A periodic cell thinner than twice the skin needs no special case: the cluster holds as many
images of an atom as fall in the region, and an edge reached through two images of its target is
one key, kept once. Without a neighbour cap only: a capped graph's edge depends on both atoms'
whole neighbourhoods (refused in one line).

3. :func:`boundary`, :func:`region_needs` and :func:`region_view` turn a rank's region graph into its
   view in the atoms layout (``halo.HaloAtomGraph``), equal tensor for tensor to ``halo.shard_atoms``
   of the whole structure grouped by the same owners (``halo.group_by_part``): the same numbering
   (atoms by (owner, id), edges by their target's), the same halo plans. What a rank needs of the
   others besides its region: their own edges' counts and, for the atoms of its ring, their first
   edge id and in-degree (each rank's :class:`Boundary`: its surface), and every rank's
   :class:`halo.Needs` (the ids it reads; what the others must send it): in a run, two all-gathers.
4. The client and a worker (the predictor's ``layout="domains"``): the client (rank 0, the only
   process holding the whole structure: O(N)) :func:`decompose` divides it — owners, and each rank's
   *region*: its atoms and every atom with an image within ``cutoff × hops + skin`` of them — and
   sends worker r its :class:`Domain` (region ids, numbers, frames) once per build and the region's
   positions every call; :func:`domain_view` rebuilds the region graph from them each call. A worker
   holds no O(N) array: its region (O(N/P) atoms and a shell of ``2 cutoffs + skin``), the ranks'
   bounds (P + 1), the others' boundaries and needs (surfaces). The build is kept while no atom moved
   more than ``skin / 2`` (:meth:`Decomposition.holds`, the Verlet-skin rule: every image within
   ``cutoff × hops`` of a rank's atoms now was within ``cutoff × hops + skin`` of them at the build),
   so the model's graph, rebuilt from the positions, stays the whole structure's exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import torch

from ..io import GnnPipeError
from .halo import HALO_KEYS, HaloAtomGraph, Needs, edge_rows, halo_view
from .neighbors import radius_graph, triplet_rank, triplets
from .parallel import EdgeGroup, _t


# --------------------------------------------------------------------------- the frame
def _frame(cell, pbc) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(basis, heights, pbc)``: a non-singular basis (the cell's vectors; on an open axis whose vector
    is missing or dependent, a unit vector orthogonal to the others), the distance between its lattice
    planes along each axis (Å per unit of fractional coordinate) and ``pbc`` (3,) bool."""
    basis = np.array(cell, dtype=np.float64).reshape(3, 3)
    pbc = np.broadcast_to(np.asarray(pbc, dtype=bool), (3,)).copy()
    scale = max(1.0, float(np.abs(basis).max(initial=0.0)))
    if abs(np.linalg.det(basis)) < 1e-9 * scale ** 3:
        if np.linalg.matrix_rank(basis[pbc], tol=1e-9 * scale) < int(pbc.sum()):
            raise GnnPipeError(f"domains: the periodic cell vectors are not independent (cell {basis.tolist()}, "
                               f"pbc {pbc.tolist()}): give the structure a proper cell")
        # complete the periodic vectors with an orthonormal basis of their complement
        q, _ = np.linalg.qr(np.concatenate([basis[pbc].T, np.eye(3)], axis=1))
        rest = iter(q[:, int(pbc.sum()):].T)
        for k in np.flatnonzero(~pbc):
            basis[k] = next(rest)
    inv = np.linalg.inv(basis)
    heights = 1.0 / np.linalg.norm(inv, axis=0)  # plane spacing: 1 / |column k of the inverse|
    return basis, heights, pbc


def fractional(pos, cell, pbc) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(frac, basis, heights)``: every atom's coordinates in ``_frame``'s basis, wrapped into
    ``[0, 1)`` on periodic axes (``pos = frac @ basis`` up to whole cell vectors)."""
    basis, heights, pbc = _frame(cell, pbc)
    frac = np.asarray(pos, dtype=np.float64).reshape(-1, 3) @ np.linalg.inv(basis)
    frac[:, pbc] -= np.floor(frac[:, pbc])
    frac[:, pbc] = np.where(frac[:, pbc] >= 1.0, 0.0, frac[:, pbc])  # -1e-17 wraps to 1.0 in floating point
    return frac, basis, heights


# --------------------------------------------------------------------------- 1. the partition
def spatial_partition(pos, cell, pbc, parts: int) -> np.ndarray:
    """(N,) int64 owner of every atom: ``parts`` spatial domains balanced by atom count.

    Recursive bisection: a domain of ``p`` parts is cut in two of ``p // 2`` and ``p - p // 2`` parts,
    across the axis along which its atoms spread furthest (fractional extent × plane spacing, Å),
    the first ``n · (p // 2) / p`` atoms in order of that coordinate (ties by atom id) going to the
    first half. Every domain holds ``floor`` or ``ceil`` of ``N / parts`` atoms (within one atom of
    the balanced count at each level). Deterministic: positions alone decide, so every rank computes
    the same owners without a broadcast; an atom's owner does not change when it is moved by a
    whole cell vector."""
    frac, _, heights = fractional(pos, cell, pbc)
    return _bisect(frac, heights, parts)


def _bisect(frac: np.ndarray, heights: np.ndarray, parts: int) -> np.ndarray:
    """:func:`spatial_partition` of wrapped fractional coordinates ``frac`` (plane spacings ``heights``)."""
    n = len(frac)
    if parts < 1 or parts > n:
        raise GnnPipeError(f"domains: {parts} parts of a structure of {n} atoms: use between 1 and {n} workers")
    owner = np.zeros(n, dtype=np.int64)
    stack = [(np.arange(n), 0, parts)]  # (atoms, first part, parts)
    while stack:
        atoms, first, p = stack.pop()
        if p == 1:
            owner[atoms] = first
            continue
        f = frac[atoms]
        axis = int(np.argmax((f.max(axis=0) - f.min(axis=0)) * heights))
        order = atoms[np.lexsort((atoms, f[:, axis]))]
        cut = len(atoms) * (p // 2) // p
        stack += [(order[:cut], first, p // 2), (order[cut:], first + p // 2, p - p // 2)]
    return owner


# --------------------------------------------------------------------------- 2. one rank's region
@dataclass
class RegionGraph:
    """One rank's edges, global keys: edge ``src -> dst`` with image ``n`` (``shift = n @ cell``).

    ``own`` (sorted) the rank's atoms; ``src, dst, image, shift`` the edges into ``own`` in
    ``radius_graph``'s order (target, distance, source, image), then (``hops`` = 2) the edges into
    ``ring`` (sorted), the other atoms with an edge into an own atom, in the same order;
    ``own_edges`` how many of the edges are the first kind."""

    own: np.ndarray
    ring: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    image: np.ndarray
    shift: np.ndarray
    own_edges: int


def _cluster(frac: np.ndarray, lo: np.ndarray, hi: np.ndarray, pbc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(atom, n)``: every image ``frac[atom] + n`` inside the box ``[lo, hi]`` (fractional; ``n`` 0 on
    open axes), built axis by axis so no more than the box's images are held at a time."""
    atom = np.arange(len(frac))
    n = np.zeros((len(frac), 3), dtype=np.int64)
    for k in range(3):
        f = frac[atom, k] + n[:, k]
        if not pbc[k]:
            keep = (f >= lo[k]) & (f <= hi[k])
            atom, n = atom[keep], n[keep]
            continue
        shifts = np.arange(int(np.floor(lo[k])) - 1, int(np.ceil(hi[k])) + 1)
        g = f[:, None] + shifts[None, :]
        row, col = np.nonzero((g >= lo[k]) & (g <= hi[k]))
        atom, n = atom[row], n[row].copy()
        n[:, k] += shifts[col]
    return atom, n


def region_graph(pos, cell, pbc, own, cutoff: float, hops: int = 2, max_neighbors: int | None = None,
                 convention: str = "project", images=None) -> RegionGraph:
    """The edges one rank needs (:class:`RegionGraph`) for its atoms ``own`` (indices of ``pos``) of the
    structure ``pos, cell, pbc``, from the images within ``cutoff × hops`` of them alone.

    ``hops`` 1: the edges into ``own`` (a model without triplets or reverse edges); 2: also the edges
    into their neighbours (triplets ``k -> j -> i`` and GemNet's ``id_swap``). ``pos`` may be a
    region's atoms only (every image within ``cutoff × hops`` of ``own`` among them; the ids are then
    indices of the region, in the order of the whole structure's ids); ``images`` (len(pos), 3) int,
    the whole-cell shift of each atom's frame (``frac = pos / cell + images``; default: each atom
    wrapped into the cell), so that a region keeps its frame while its atoms move (:class:`Domain`)."""
    if max_neighbors is not None or convention != "project":
        raise GnnPipeError("domains: the distributed graph build takes no neighbour cap yet (a capped edge depends "
                           "on both atoms' whole neighbourhoods): set max_neighbors to null or use the atoms layout")
    if hops not in (1, 2):
        raise GnnPipeError(f"domains: hops must be 1 or 2, got {hops}")
    pos = np.asarray(pos, dtype=np.float64).reshape(-1, 3)
    own = np.unique(np.asarray(own, dtype=np.int64))
    pbcv = np.broadcast_to(np.asarray(pbc, dtype=bool), (3,))
    if images is None:
        frac, basis, heights = fractional(pos, cell, pbc)
    else:
        basis, heights, _ = _frame(cell, pbc)
        frac = pos @ np.linalg.inv(basis)
        frac[:, pbcv] += np.asarray(images)[:, pbcv]
    cell = np.asarray(cell, dtype=np.float64).reshape(3, 3)
    skin = cutoff * hops / heights * (1 + 1e-9)  # fractional margin holding every point within cutoff × hops (Å)
    lo, hi = frac[own].min(axis=0) - skin, frac[own].max(axis=0) + skin
    atom, n = _cluster(frac, lo, hi, pbcv)
    # the cluster's positions: the atom's framed image (frac @ basis) + n; its image relative to pos
    wrap = np.zeros_like(n)
    if pbcv.any():
        raw = pos[atom] @ np.linalg.inv(basis)
        wrap[:, pbcv] = np.rint(frac[atom][:, pbcv] - raw[:, pbcv]).astype(np.int64)
    img = n + wrap  # the cluster point is pos[atom] + img @ cell (img 0 on open axes)
    points = pos[atom] + img @ cell
    c_src, c_dst, _ = radius_graph(points, np.zeros((3, 3)), False, cutoff)
    # the own atoms' home points: their image inside their own bounding box, n == 0 (framed frac)
    is_own = np.zeros(len(pos), dtype=bool)
    is_own[own] = True
    home = is_own[atom] & np.all(n == 0, axis=1)
    into_own = home[c_dst]
    keys = [(atom[c_src[into_own]], atom[c_dst[into_own]], img[c_src[into_own]] - img[c_dst[into_own]])]
    ring = np.zeros(0, dtype=np.int64)
    if hops == 2:
        first = np.zeros(len(points), dtype=bool)
        first[c_src[into_own]] = True  # every point with an edge into a home point: its edges are complete
        first &= ~home
        ring = np.unique(atom[first])
        into_ring = first[c_dst]
        keys.append((atom[c_src[into_ring]], atom[c_dst[into_ring]], img[c_src[into_ring]] - img[c_dst[into_ring]]))
        ring = ring[~is_own[ring]]
    parts = [_ordered(pos, cell, *k) for k in keys]
    if hops == 2:  # own atoms reached through another image are ring points too: keep the ring's edges
        s, d, m = parts[1]
        keep = ~is_own[d]
        parts[1] = (s[keep], d[keep], m[keep])
    src, dst, image = (np.concatenate(c) for c in zip(*parts))
    return RegionGraph(own=own, ring=ring, src=src, dst=dst, image=image, shift=image @ cell,
                       own_edges=len(parts[0][0]))


def renumber(g: RegionGraph, ids: np.ndarray) -> RegionGraph:
    """Region graph ``g`` of a region's atoms with their structure ids ``ids`` (sorted, so the order
    of the edges is the same)."""
    return RegionGraph(own=ids[g.own], ring=ids[g.ring], src=ids[g.src], dst=ids[g.dst], image=g.image,
                       shift=g.shift, own_edges=g.own_edges)


def _ordered(pos, cell, src, dst, image) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The edges ``src -> dst`` (image ``image``) each once, in ``radius_graph``'s order (target,
    distance as it computes it from the global positions, source, image)."""
    key = np.unique(np.concatenate([dst[:, None], src[:, None], image], axis=1), axis=0)
    dst, src, image = key[:, 0], key[:, 1], key[:, 2:]
    d = np.linalg.norm(pos[dst] - pos[src] - image @ cell, axis=1)
    order = np.lexsort((image[:, 2], image[:, 1], image[:, 0], src, d, dst))
    return src[order], dst[order], image[order]


# --------------------------------------------------------------------------- 3. one rank's view
# From here on the atoms are numbered as the atoms layout numbers them ("arranged" ids: by owner, then
# by structure id, ``halo.group_by_part``), so rank r's atoms are the block ``[ab[r], ab[r + 1])``.
@dataclass
class Boundary:
    """What rank ``q`` tells the others of its atoms in their rings (every atom of ``q`` with an edge
    from another rank's atom: in a symmetric graph, exactly the atoms of ``q`` in other ranks' rings):
    ``edges`` its own edges, ``ids`` those atoms (arranged, sorted), ``offset`` their first edge id
    within ``q``'s block, ``degree`` their in-degree. Its surface, not O(N)."""

    edges: int
    ids: np.ndarray
    offset: np.ndarray
    degree: np.ndarray


def boundary(g: RegionGraph, rank: int, ab: np.ndarray) -> Boundary:
    """Rank ``rank``'s :class:`Boundary` from its region graph (arranged ids)."""
    o, a0, a1 = g.own_edges, int(ab[rank]), int(ab[rank + 1])
    degree = np.bincount(g.dst[:o] - a0, minlength=a1 - a0).astype(np.int64)
    offset = np.cumsum(degree) - degree
    src = g.src[:o]
    ids = np.unique(g.dst[:o][(src < a0) | (src >= a1)])
    return Boundary(o, ids, offset[ids - a0], degree[ids - a0])


@dataclass
class Region:
    """A rank's region graph numbered as the atoms layout numbers the whole structure.

    ``ab`` / ``eb`` the ranks' atom and edge id bounds, ``eid`` the global id of each region edge,
    ``kj, ji`` the own triplets (region edge indices), ``swap`` the region index of each own edge's
    reverse, ``needs`` what the rank reads from the others."""

    graph: RegionGraph
    rank: int
    ab: np.ndarray
    eb: np.ndarray
    eid: np.ndarray
    kj: np.ndarray
    ji: np.ndarray
    swap: np.ndarray
    needs: Needs


def _place(dst: np.ndarray) -> np.ndarray:
    """Each edge's place among its target's edges (``dst`` sorted)."""
    return np.arange(len(dst)) - np.searchsorted(dst, dst)


def _reverse_in(g: RegionGraph) -> np.ndarray:
    """The region index of the reverse ``i -> j`` (image ``-n``) of every own edge ``j -> i``: an edge
    into ``j``, so in the region (``hops`` = 2)."""
    own = slice(0, g.own_edges)
    rows = np.concatenate([np.column_stack([g.src, g.dst, g.image]),
                           np.column_stack([g.dst[own], g.src[own], -g.image[own]])])
    _, key = np.unique(rows, axis=0, return_inverse=True)
    key = key.ravel()
    at = np.full(int(key.max(initial=-1)) + 1, -1, dtype=np.int64)
    at[key[:len(g.src)]] = np.arange(len(g.src))
    swap = at[key[len(g.src):]]
    if (swap < 0).any():
        raise GnnPipeError("domains: an own edge has no reverse in its region: build the region with hops=2")
    return swap


def _disagree() -> GnnPipeError:
    return GnnPipeError("domains: a region's edges disagree with its neighbours' boundaries: build every rank's "
                        "region from the same positions, cutoff and owners")


def region_needs(g: RegionGraph, rank: int, ab: np.ndarray, bounds: list) -> Region:
    """Rank ``rank``'s :class:`Region` from its region graph (``hops`` = 2, arranged ids), the ranks'
    atom bounds ``ab`` and every rank's :class:`Boundary` (``bounds[q]``; in a run, one all-gather):
    an edge's global id is its target's first edge id plus its place among the target's edges."""
    ab = np.asarray(ab, dtype=np.int64)
    a0, a1, o = int(ab[rank]), int(ab[rank + 1]), g.own_edges
    eb = np.concatenate([[0], np.cumsum([b.edges for b in bounds])]).astype(np.int64)
    degree = np.bincount(g.dst[:o] - a0, minlength=a1 - a0)
    first_own = eb[rank] + np.cumsum(degree) - degree
    # the ring atoms' first edge ids and in-degrees, from their owners' boundaries
    t_ids = np.concatenate([b.ids for b in bounds])
    t_first = np.concatenate([eb[q] + b.offset for q, b in enumerate(bounds)])
    t_degree = np.concatenate([b.degree for b in bounds])
    sorter = np.argsort(t_ids)
    at = sorter[np.minimum(np.searchsorted(t_ids, g.ring, sorter=sorter), max(len(t_ids) - 1, 0))] \
        if len(t_ids) else np.zeros(0, dtype=np.int64)
    ring_deg = np.bincount(np.searchsorted(g.ring, g.dst[o:]), minlength=len(g.ring))
    if len(g.ring) and (len(t_ids) == 0 or not np.array_equal(t_ids[at], g.ring)
                        or not np.array_equal(t_degree[at], ring_deg)):
        raise _disagree()
    place = np.concatenate([_place(g.dst[:o]), _place(g.dst[o:])])
    first = np.concatenate([first_own[g.dst[:o] - a0], t_first[at][np.searchsorted(g.ring, g.dst[o:])]])
    eid = first + place
    if not np.array_equal(eid[:o] - eb[rank], np.arange(o)):
        raise _disagree()
    ids, local = np.unique(np.concatenate([g.src, g.dst]), return_inverse=True)
    local = local.ravel()
    kj, ji = triplets(local[:len(g.src)], local[len(g.src):], g.shift) if len(g.src) else (np.zeros(0, np.int64),) * 2
    keep = ji < o
    kj, ji = kj[keep], ji[keep]
    swap = _reverse_in(g)

    def theirs(a):
        return (a < a0) | (a >= a1)

    def foreign(a):
        return np.unique(a[theirs(a)])
    atom_ids = np.concatenate([g.src[:o], g.src[kj], g.dst[kj]])
    needs = Needs(kj=np.unique(eid[kj][theirs(g.dst[kj])]), swap=np.unique(eid[swap][theirs(g.dst[swap])]),
                  atoms=foreign(g.src[:o]), ghosts=foreign(atom_ids))
    return Region(g, rank, ab, eb, eid, kj, ji, swap, needs)


def region_view(reg: Region, needs: list, z, pos, ids, group: EdgeGroup | None = None, dtype=torch.float64,
                device=None, system=None, num_systems: int = 1) -> HaloAtomGraph:
    """Rank ``reg.rank``'s view in the atoms layout, from its region and every rank's ``needs``
    (``needs[q]``: rank q's ``Region.needs``): equal to ``halo.shard_atoms`` of the structure grouped by
    the same owners. ``z``, ``pos``: the region's atoms' (arranged ids ``ids``, sorted; read at the
    view's atoms only); ``system``, ``num_systems``: a batch's (:func:`batch_view`; None: one structure)."""
    g, r = reg.graph, reg.rank
    me, o = reg.needs, g.own_edges
    a0, a1, e0, e1 = int(reg.ab[r]), int(reg.ab[r + 1]), int(reg.eb[r]), int(reg.eb[r + 1])
    atoms = np.concatenate([np.arange(a0, a1), me.atoms, np.setdiff1d(me.ghosts, me.atoms, assume_unique=True)])
    sorter = np.argsort(atoms)

    def loc(a):  # the view's row of atoms given by their arranged ids
        return sorter[np.searchsorted(atoms, a, sorter=sorter)]
    rows = np.searchsorted(ids, atoms)  # the region's row of each view atom
    kw = dict(
        z=_t(np.asarray(z)[rows], torch.long), pos=_t(np.asarray(pos)[rows], dtype),
        system=_t(np.zeros(len(atoms), np.int64) if system is None else np.asarray(system)[rows], torch.long),
        num_systems=int(num_systems),
        edge_src=_t(loc(g.src[:o]), torch.long), edge_dst=_t(loc(g.dst[:o]), torch.long),
        edge_shift=_t(g.shift[:o], dtype),
        idx_kj=_t(edge_rows(reg.eid[reg.kj], me.kj, e0, e1), torch.long), idx_ji=_t(reg.ji, torch.long),
        kj_src=_t(loc(g.src[reg.kj]), torch.long), kj_dst=_t(loc(g.dst[reg.kj]), torch.long),
        kj_shift=_t(g.shift[reg.kj], dtype), num_edges=(e1 - e0) + len(me.kj), atom_lo=a0, atom_hi=a1,
        triplet_rank=_t(triplet_rank(reg.ji, o), torch.long),
        id_swap=_t(edge_rows(reg.eid[reg.swap], me.swap, e0, e1), torch.long))
    return halo_view(kw, needs, reg.ab, reg.eb, r, loc(me.ghosts), len(atoms), group, device)


# --------------------------------------------------------------------------- 4. the client and a worker
@dataclass
class Domain:
    """What worker ``rank`` holds from one build to the next: its region's atoms (arranged ids
    ``ids``, sorted: its own block and every atom with an image within ``cutoff × hops + skin`` of
    them at the build), their numbers ``z`` and frames ``images`` (each atom's whole-cell shift at the
    build, kept while it moves), the ranks' atom bounds ``ab`` and the structure's ``cell, pbc`` and
    the model's ``cutoff``. O(N/P + surface); each call then brings the region's positions only."""

    rank: int
    ids: np.ndarray
    z: np.ndarray
    images: np.ndarray
    ab: np.ndarray
    cell: np.ndarray
    pbc: np.ndarray
    cutoff: float


@dataclass
class Decomposition:
    """The client's build of one structure (rank 0 of a run: O(N), 12 bytes an atom of positions and
    a few integers): ``order`` the structure's atom of each arranged id, ``ab`` the ranks' bounds,
    ``domains`` each rank's :class:`Domain`, and what the Verlet-skin rule compares against: the
    numbers, positions, cell and pbc at the build and ``skin`` (Å)."""

    order: np.ndarray
    ab: np.ndarray
    domains: list
    z: np.ndarray
    pos: np.ndarray
    cell: np.ndarray
    pbc: np.ndarray
    skin: float

    def holds(self, z, pos, cell, pbc) -> bool:
        """The Verlet-skin rule: the build serves this structure as long as its atoms, cell and pbc are
        the build's and no atom moved more than ``skin / 2`` since (then every image within
        ``cutoff × hops`` of a rank's atoms is still in its region, and each region's graph, rebuilt
        from its positions every call, is the whole structure's)."""
        pos = np.asarray(pos, dtype=np.float64).reshape(-1, 3)
        if len(pos) != len(self.pos) or not np.array_equal(z, self.z) or not np.array_equal(cell, self.cell) \
                or not np.array_equal(np.broadcast_to(pbc, (3,)), self.pbc):
            return False
        moved = np.einsum("ij,ij->i", pos - self.pos, pos - self.pos)
        return float(moved.max(initial=0.0)) <= (0.5 * self.skin) ** 2

    def positions(self, pos) -> list:
        """Each rank's region positions (a call's whole message to a worker)."""
        pos = np.asarray(pos, dtype=np.float64).reshape(-1, 3)
        return [pos[self.order[d.ids]] for d in self.domains]


def decompose(z, pos, cell, pbc, parts: int, cutoff: float, skin: float = 0.0, hops: int = 2) -> Decomposition:
    """The client's build: owners by :func:`spatial_partition` and, for each rank, the atoms with an
    image within ``cutoff × hops + skin`` (Å) of its atoms' fractional bounding box (its region)."""
    if skin < 0:
        raise GnnPipeError(f"domains: skin must be >= 0 Å, got {skin}")
    z = np.asarray(z, dtype=np.int64)
    pos = np.asarray(pos, dtype=np.float64).reshape(-1, 3)
    cell = np.asarray(cell, dtype=np.float64).reshape(3, 3)
    pbcv = np.broadcast_to(np.asarray(pbc, dtype=bool), (3,)).copy()
    frac, basis, heights = fractional(pos, cell, pbcv)
    images = np.zeros((len(pos), 3), dtype=np.int64)
    images[:, pbcv] = np.rint(frac[:, pbcv] - (pos @ np.linalg.inv(basis))[:, pbcv]).astype(np.int64)
    owner = _bisect(frac, heights, parts)
    order = np.argsort(owner, kind="stable")
    new = np.empty_like(order)
    new[order] = np.arange(len(order))
    ab = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=parts))]).astype(np.int64)
    margin = (cutoff * hops + skin) / heights * (1 + 1e-9)
    domains = []
    for r in range(parts):
        f = frac[order[ab[r]:ab[r + 1]]]
        atom, _ = _cluster(frac, f.min(axis=0) - margin, f.max(axis=0) + margin, pbcv)
        ids = np.unique(new[atom])
        domains.append(Domain(r, ids, z[order[ids]], images[order[ids]], ab, cell, pbcv, float(cutoff)))
    return Decomposition(order, ab, domains, z, pos.copy(), cell, pbcv, float(skin))


def domain_graph(dom: Domain, pos) -> RegionGraph:
    """Worker ``dom.rank``'s region graph (arranged ids) from its region's positions ``pos``."""
    own = np.searchsorted(dom.ids, np.arange(dom.ab[dom.rank], dom.ab[dom.rank + 1]))
    return renumber(region_graph(pos, dom.cell, dom.pbc, own, dom.cutoff, 2, images=dom.images), dom.ids)


OP_BUILD = "domain_build"  # a call's two all-gathers of the distributed build (boundaries, needs): their payloads


def payload_bytes(obj) -> int:
    """The bytes of the arrays in ``obj`` (numpy arrays, in dicts, lists, tuples and dataclasses, at any
    depth) plus 8 for every int or float field of a dataclass: what the domains layout's ledger counts
    of a message (not the pickle's framing)."""
    import dataclasses

    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(8 if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
                   else payload_bytes(v)
                   for v in (getattr(obj, f.name) for f in dataclasses.fields(obj)))
    return 0


def domain_view(dom: Domain, pos, grp: EdgeGroup, dtype=torch.float64, device=None) -> HaloAtomGraph:
    """Worker ``grp.rank``'s view from its :class:`Domain` and its region's positions ``pos`` (this
    call's): the region graph rebuilt from them, then two all-gathers of the group (every rank's
    :class:`Boundary`, every rank's needs), counted in the ledger as ``OP_BUILD``: their payloads
    (:func:`payload_bytes`), each rank's sent to the P - 1 others.
    Symmetric, uncapped graphs of the ``project`` convention (``region_graph``)."""
    import torch.distributed as dist

    r, ab = dom.rank, dom.ab
    g = domain_graph(dom, pos)
    bounds = [None] * grp.size
    dist.all_gather_object(bounds, boundary(g, r, ab), group=grp.group)
    reg = region_needs(g, r, ab, bounds)
    needs = [None] * grp.size
    dist.all_gather_object(needs, reg.needs, group=grp.group)
    mine = payload_bytes(bounds[r]) + payload_bytes(needs[r])
    grp.comm.record(OP_BUILD, (grp.size - 1) * mine, payload_bytes(bounds) + payload_bytes(needs) - mine)
    return region_view(reg, needs, dom.z, pos, dom.ids, grp, dtype, device)


# --------------------------------------------------------------------------- 5. training: a batch's systems together
# A training step's batch (``data.batch_arrays`` without its graph: per atom ``z, pos, system``, per
# system ``cell, pbc``; the systems' atoms contiguous) is split by cutting *every* system into P spatial
# domains, rank r owning domain r of each: one system is always split across the ranks, and each rank
# builds the region graph of its domain in each system (positions of the whole batch are read, O(N),
# its edges and triplets are its regions' only). Arranged ids as above: atoms by (owner, batch id).
def _system_bounds(b: dict) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.bincount(np.asarray(b["system"]), minlength=int(b["num_systems"])))])


def batch_owners(b: dict, parts: int) -> np.ndarray:
    """(N,) owner of every atom of batch ``b``: each system cut into ``parts`` domains by
    :func:`spatial_partition` (the same on every rank: positions alone decide). A system of fewer
    atoms than ``parts`` is refused in one line (``b["ids"]``: the systems' dataset ids, if given)."""
    ptr = _system_bounds(b)
    owner = np.empty(int(ptr[-1]), dtype=np.int64)
    for s in range(len(ptr) - 1):
        a0, a1 = int(ptr[s]), int(ptr[s + 1])
        if a1 - a0 < parts:
            name = int(b["ids"][s]) if b.get("ids") is not None else s
            raise GnnPipeError(f"atom_layout domains: system {name} has {a1 - a0} atoms, fewer than the {parts} ways "
                               f"(each way owns a domain of every system): use at most {a1 - a0} ways per replica "
                               "or the atoms layout")
        owner[a0:a1] = spatial_partition(b["pos"][a0:a1], b["cell"][s], b["pbc"][s], parts)
    return owner


def batch_region_graph(b: dict, owner: np.ndarray, rank: int, cutoff: float) -> tuple[RegionGraph, np.ndarray]:
    """Rank ``rank``'s region graph of batch ``b`` (batch order; ``owner`` from :func:`batch_owners`) in
    arranged ids, and its own edges per system (S,). Each system's :func:`region_graph` of the rank's
    domain (hops 2), its ids mapped to the batch's arranged ids: the own edges stay sorted by target
    (a rank's atoms are arranged system by system), the ring's edges are sorted by target stably (a
    target's edges keep ``radius_graph``'s order, the order its owner numbers them in)."""
    order = np.argsort(owner, kind="stable")
    new = np.empty_like(order)
    new[order] = np.arange(len(order))
    ptr = _system_bounds(b)
    pos = np.asarray(b["pos"], dtype=np.float64)
    own_parts, ring_parts, owns, rings = [], [], [], []
    per_system = np.zeros(len(ptr) - 1, dtype=np.int64)
    for s in range(len(ptr) - 1):
        a0, a1 = int(ptr[s]), int(ptr[s + 1])
        mine = np.flatnonzero(owner[a0:a1] == rank)
        g = renumber(region_graph(pos[a0:a1], b["cell"][s], b["pbc"][s], mine, cutoff, 2), new[a0:a1])
        o = g.own_edges
        per_system[s] = o
        own_parts.append((g.src[:o], g.dst[:o], g.image[:o], g.shift[:o]))
        ring_parts.append((g.src[o:], g.dst[o:], g.image[o:], g.shift[o:]))
        owns.append(g.own)
        rings.append(g.ring)
    own = [np.concatenate(c) for c in zip(*own_parts)]
    ring = [np.concatenate(c) for c in zip(*ring_parts)]
    by_target = np.argsort(ring[1], kind="stable")
    src, dst, image, shift = (np.concatenate([a, r[by_target]]) for a, r in zip(own, ring))
    return RegionGraph(own=np.sort(np.concatenate(owns)), ring=np.sort(np.concatenate(rings)), src=src, dst=dst,
                       image=image, shift=shift, own_edges=len(own[0])), per_system


def batch_view(b: dict, grp: EdgeGroup, cutoff: float, dtype=torch.float64, device=None, edges=None) -> HaloAtomGraph:
    """Rank ``grp.rank``'s view of an arranged batch ``b`` (``atom_layouts.DomainsTraining.arrange``:
    its atoms by owner, ``atom_parts``, ``atom_order``; no graph) in the atoms layout, from its own
    regions: :func:`batch_region_graph`, then two all-gathers of the group (every rank's
    :class:`Boundary` with its edges per system, every rank's needs; not counted in the ledger: per
    step, not per layer). ``edges`` (S,): the edges each system should have (its graphs.h5 count);
    a system whose regions hold another count (a neighbour cap that binds there) is refused in one line."""
    import torch.distributed as dist

    r, parts = grp.rank, grp.size
    ab = np.concatenate([[0], np.cumsum(b["atom_parts"])]).astype(np.int64)
    inverse = np.argsort(b["atom_order"])  # the arranged row of each batch atom
    batch = {"pos": np.asarray(b["pos"])[inverse], "system": np.asarray(b["system"])[inverse],
             "num_systems": b["num_systems"], "cell": b["cell"], "pbc": b["pbc"]}
    owner = np.repeat(np.arange(parts), b["atom_parts"])[inverse]
    g, per_system = batch_region_graph(batch, owner, r, cutoff)
    got = [None] * parts
    dist.all_gather_object(got, (boundary(g, r, ab), per_system), group=grp.group)
    if edges is not None:
        total = np.sum([c for _, c in got], axis=0)
        bad = np.flatnonzero(total != np.asarray(edges))
        if len(bad):
            s = int(bad[0])
            name = int(b["ids"][s]) if b.get("ids") is not None else s
            raise GnnPipeError(f"atom_layout domains: system {name} has {int(total[s])} edges within the cutoff "
                               f"{cutoff:g} Å, its graphs.h5 {int(edges[s])} (the file's neighbour cap binds): the "
                               "domains layout builds every neighbour within the cutoff; rebuild the graphs with a "
                               "larger atoms.max_neighbors or use the atoms layout")
    reg = region_needs(g, r, ab, [bd for bd, _ in got])
    needs = [None] * parts
    dist.all_gather_object(needs, reg.needs, group=grp.group)
    view = region_view(reg, needs, b["z"], b["pos"], np.arange(len(b["z"])), grp, dtype, device,
                       system=b["system"], num_systems=int(b["num_systems"]))
    # the halo rows every rank reads (its needs, gathered): ``halo.halo_counts`` of the batch grouped by
    # these owners, what the engine prices the step's bytes on without the batch's graph
    view.halo = {k: sum(len(getattr(n, k)) for n in needs) for k in HALO_KEYS}
    return view


__all__ = ["spatial_partition", "fractional", "region_graph", "renumber", "RegionGraph", "Boundary", "boundary",
           "Region", "region_needs", "region_view", "Domain", "Decomposition", "decompose", "domain_graph",
           "domain_view", "payload_bytes", "OP_BUILD", "batch_owners", "batch_region_graph", "batch_view"]
