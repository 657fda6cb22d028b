"""Atom-partitioned graph parallelism for atomistic models: each rank exchanges only its boundary, exact.

The ``atoms`` layout beside ``parallel.py``'s ``edges`` one (the objects the engine and the predictor
ask: ``atom_layouts``). The batch's atoms are split into P
spatially compact parts by k-way METIS on the atom graph (pymetis; vertex weight = in-degree + 1,
so the parts hold about as many edges and triplets each). Rank r **owns**

* its atoms (everything per atom: output MLPs, energies, forces, the loss),
* the edges ``j -> i`` into them (``i`` own; ``j`` anywhere, periodic images included: an edge is
  a global id with its image shift, so a halo edge may cross the cell),
* the triplets ``k -> j -> i`` whose output edge ``ji`` it owns.

Every sum of edge messages into atoms is then rank-local (``edges_to_atoms`` has no collective),
and what a rank reads from other ranks is its **halo**, received per interaction block with one
``all_to_all`` of exactly those rows:

==================  ==============================================  ============================
exchange            rows rank r receives                            model call
==================  ==============================================  ============================
edge halo (kj)      input edges ``k -> j`` of its triplets that     ``gather_edges(x, "kj")``
                    another rank owns (``j`` not own)
edge halo (swap)    reverse edges ``i -> j`` of its edges that      ``gather_edges(x, "swap")``
                    another rank owns (GemNet's ``id_swap``)
atom halo           source atoms ``j`` of its edges that another    ``gather_atoms(h_own)``
                    rank owns (GemNet's atom embeddings)
ghost reduction     every non-own atom its edges and triplets       ``sum_atoms(partial)``
                    touch (``j`` and ``k``): their partial sums      (forces: ``-dE/dpos``)
                    go back to the owners
==================  ==============================================  ============================

A view's rows are ``[own; halo]``: edges ``[E_own; H_kj]`` (``idx_kj``) or ``[E_own; H_swap]``
(``id_swap``), atoms ``[own; ghosts with an embedding row; ghosts read for their position only]``,
each halo grouped by owner rank (the ``all_to_all`` order). Positions of the ghosts are data
(the batch), not exchanged.

Exactness: the gather ``[x_own; x[halo]]`` and the ghost reduction (``x_own + Σ`` of the halo rows
the other ranks hold for our atoms) are adjoint linear maps, so each is the other's backward
(:class:`_HaloGather`, :class:`_HaloScatter`), built from the same autograd functions and hence
twice differentiable (energy-conserving forces trained by double backward). Every consumer of a
gathered row is rank-local, so per-rank losses summing to the single-process loss give parameter
gradients summing to the single-process ones, as in ``parallel.py``. Energies are an all-reduce
with identity backward (``ShardedAtomGraph.sum_systems``).

Bytes: each exchange sends ``rows × width × b``, its rows the halo counts of :func:`halo_counts`
(summed over ranks) and its widths the kind's ``halo_widths``; the closed form is :func:`step_bytes`.

Why METIS and not a recursive coordinate bisection: a batch of several systems overlaps in space
(every system sits in its own cell near the origin), so coordinates do not separate systems, while
the atom graph does (disconnected components); METIS minimises the edge cut, which is the halo,
and sees periodic images as ordinary edges. It is deterministic for a given graph and seed, so
every rank computes the same partition of the same batch without a broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from ..io import GnnPipeError
from .batch import AtomGraph, sum_rows
from .neighbors import triplet_rank
from .parallel import EdgeGroup, ShardedAtomGraph, _t, collective_passes

ATOM_KEYS = ("z", "pos", "system", "fixed", "forces")  # per-atom arrays of a batch (graphs.batch_arrays)

OP_EDGE_HALO = "edge_halo"  # forward: halo edge rows to the ranks whose triplets read them
OP_EDGE_HALO_GRAD = "edge_halo_grad"  # their adjoint: halo gradients back to the owners
OP_ATOM_HALO = "atom_halo"  # own atom rows to the ranks with a ghost of them (gather_atoms, sum_atoms' adjoint)
OP_GHOST_SUM = "ghost_sum"  # ghost atoms' partial sums to their owners (sum_atoms, gather_atoms' adjoint)


# --------------------------------------------------------------------------- partition and order
def partition_atoms(b: dict, parts: int, seed: int = 0) -> np.ndarray:
    """(N,) int64 part of every atom of batch ``b``: k-way METIS on its undirected atom graph."""
    n = int(len(b["z"]))
    if parts == 1:
        return np.zeros(n, dtype=np.int64)
    if parts > n:
        raise GnnPipeError(f"the atoms layout over {parts} workers needs at least {parts} atoms in a batch, but "
                           f"this batch has {n}: use fewer workers or the edges layout")
    import pymetis
    import scipy.sparse as sp

    src, dst = np.asarray(b["edge_src"]), np.asarray(b["edge_dst"])
    keep = src != dst  # an atom's own periodic image is not a cut
    a = sp.csr_array((np.ones(int(keep.sum()), dtype=bool), (dst[keep], src[keep])), shape=(n, n))
    s = (a + a.T).tocsr()
    s.sort_indices()
    idx = pymetis.zero_copy_dtype()
    weights = (np.bincount(dst, minlength=n) + 1).astype(idx)
    _, member = pymetis.part_graph(parts, pymetis.CSRAdjacency(s.indptr.astype(idx), s.indices.astype(idx)),
                                   vweights=weights, options=pymetis.Options(seed=int(seed)), recursive=False)
    member = np.asarray(member, dtype=np.int64)
    empty = np.flatnonzero(np.bincount(member, minlength=parts) == 0)
    if len(empty):
        raise GnnPipeError(f"METIS left part {int(empty[0])} of {parts} empty on a batch of {n} atoms: use fewer "
                           "workers, a larger batch or the edges layout")
    return member


def group_by_part(b: dict, part: np.ndarray, parts: int) -> dict:
    """Batch ``b`` reordered so that part r's atoms, and the edges into them, are block r.

    Atoms are sorted by (part, id) and edges by (their target's part, id), both stably; the triplets
    keep their order (so each output edge's triplets keep their ranks), their edge ids are renumbered.
    Adds ``atom_parts`` (P,) atoms per part and ``atom_order`` (N,): the batch atom of each new row
    (``forces_new = forces[atom_order]``).
    """
    part = np.asarray(part, dtype=np.int64)
    order = np.argsort(part, kind="stable")
    new = np.empty_like(order)
    new[order] = np.arange(len(order))
    dst_part = part[np.asarray(b["edge_dst"])]
    eorder = np.argsort(dst_part, kind="stable")
    enew = np.empty_like(eorder)
    enew[eorder] = np.arange(len(eorder))
    out = dict(b)
    for k in ATOM_KEYS:
        if b.get(k) is not None:
            out[k] = np.asarray(b[k])[order]
    out["edge_src"] = new[np.asarray(b["edge_src"])[eorder]]
    out["edge_dst"] = new[np.asarray(b["edge_dst"])[eorder]]
    out["edge_shift"] = np.asarray(b["edge_shift"])[eorder]
    if b.get("id_swap") is not None:
        out["id_swap"] = enew[np.asarray(b["id_swap"])[eorder]]
    out["idx_kj"], out["idx_ji"] = enew[np.asarray(b["idx_kj"])], enew[np.asarray(b["idx_ji"])]
    out["atom_parts"] = np.bincount(part, minlength=parts).astype(np.int64)
    out["atom_order"] = order
    return out


def order_by_part(b: dict, parts: int, seed: int = 0) -> dict:
    """Batch ``b`` reordered by its METIS parts, ``group_by_part(b, partition_atoms(b, parts))``: what every
    rank of a P-way group shards (``atom_layouts.AtomsLayout.arrange``)."""
    return group_by_part(b, partition_atoms(b, parts, seed), parts)


# --------------------------------------------------------------------------- who needs what
@dataclass
class Needs:
    """The global ids (of a ``group_by_part`` batch, each sorted, hence grouped by owner) that one
    rank reads from other ranks."""

    kj: np.ndarray  # input edges of its triplets
    swap: np.ndarray  # reverse edges of its edges (empty without id_swap)
    atoms: np.ndarray  # source atoms of its edges (embedding rows)
    ghosts: np.ndarray  # every non-own atom it touches: atoms, then the triplets' k (sorted together)


def _bounds(sizes) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def rank_needs(b: dict, rank: int) -> Needs:
    """What rank ``rank`` of ``b``'s layout (``atom_parts``) reads from the others."""
    ab = _bounds(b["atom_parts"])
    a0, a1 = int(ab[rank]), int(ab[rank + 1])
    src, dst = np.asarray(b["edge_src"]), np.asarray(b["edge_dst"])
    n, e = len(b["z"]), len(src)
    mine = (dst >= a0) & (dst < a1)
    local = np.flatnonzero(mine)
    idx_ji, idx_kj = np.asarray(b["idx_ji"]), np.asarray(b["idx_kj"])
    kj = idx_kj[mine[idx_ji]]

    def foreign_edges(ids):
        m = np.zeros(e, dtype=bool)
        m[ids] = True
        return np.flatnonzero(m & ~mine)

    def foreign_atoms(ids):
        m = np.zeros(n, dtype=bool)
        m[ids] = True
        m[a0:a1] = False
        return np.flatnonzero(m)
    swap = foreign_edges(np.asarray(b["id_swap"])[local]) if b.get("id_swap") is not None else np.zeros(0, np.int64)
    return Needs(kj=foreign_edges(kj), swap=swap, atoms=foreign_atoms(src[local]),
                 ghosts=foreign_atoms(np.concatenate([src[local], src[kj], dst[kj]])))


HALO_KEYS = ("kj", "swap", "atoms", "ghosts")


def rank_sizes(b: dict) -> list[dict]:
    """Per rank of ``b``'s layout: own ``atoms_own``, ``edges_own``, ``triplets_own`` and its halo rows
    (``kj``, ``swap`` edge rows; ``atoms`` embedding rows; ``ghosts`` atoms reduced to their owners)."""
    parts = len(b["atom_parts"])
    owner = np.repeat(np.arange(parts), b["atom_parts"])
    e_owner = owner[np.asarray(b["edge_dst"])]
    edges = np.bincount(e_owner, minlength=parts)
    trips = np.bincount(e_owner[np.asarray(b["idx_ji"])], minlength=parts)
    out = []
    for r in range(parts):
        need = rank_needs(b, r)
        out.append({"atoms_own": int(b["atom_parts"][r]), "edges_own": int(edges[r]), "triplets_own": int(trips[r]),
                    **{k: int(len(getattr(need, k))) for k in HALO_KEYS}})
    return out


def halo_counts(b: dict) -> dict:
    """Rows received per exchange, summed over the ranks of ``b``'s layout: the closed form's counts."""
    sizes = rank_sizes(b)
    return {k: sum(r[k] for r in sizes) for k in HALO_KEYS}


def step_bytes(kind, cfg, halos, systems, ways: int, dtype_bytes: int, params: int, training: bool = True,
               forces: bool = True) -> int:
    """Bytes one step sends in the atoms layout, summed over every rank (what the ledger counts).

    ``halos[d]``: replica d's halo rows summed over its P ways (:func:`halo_counts`), ``w`` the kind's
    ``halo_widths``, K blocks, b dtype bytes; ``passes`` and ``once`` as the edges layout's
    (``parallel.collective_passes``: 4 and 2 in a training step with gradient forces, 2 and 1 direct;
    half in an inference call; 2 and 0 in an energy-only step, ``forces=False``). Per replica::

        b · ( passes · K · (kj·w_kj + swap·w_swap + atoms·w_atoms)     halo rows per interaction block
              + once · 3 · ghosts     (gradient forces: the ghosts' -dE/dpos to their owners; direct: 0)
              + 2·(P-1)·B )                                             energies (ring all-reduce)

    Nothing for the output blocks and the atom updates: every edge ends at an own atom. Parameters
    (training only): ``2·(P-1)·params·b`` per replica and ``2·(D-1)·params·b`` per way, as the edges
    layout (``kind.step_bytes``).
    """
    p, d, b = ways, len(halos), dtype_bytes
    w = kind.halo_widths(cfg)
    passes, once = collective_passes(cfg.force_head, training, forces)
    forces = once * 3 if cfg.force_head == "gradient" else 0
    total = 0
    for h, s in zip(halos, systems):
        total += b * (passes * cfg.num_blocks * sum(h[k] * w[k] for k in ("kj", "swap", "atoms"))
                      + forces * h["ghosts"] + 2 * (p - 1) * s)
    return total + training * (d * 2 * (p - 1) * params * b + p * 2 * (d - 1) * params * b)


# --------------------------------------------------------------------------- the exchange
@dataclass
class HaloPlan:
    """One rank's side of one exchange: rows ``[own (n_own); halo]`` of ``n_total``."""

    send_idx: Tensor  # (S,) own rows to send, grouped by destination rank
    send_sizes: list
    recv_sizes: list
    recv_slot: Tensor  # (R,) the row of each received row (all_to_all order) in [n_own, n_total)
    n_own: int
    n_total: int

    def to(self, device) -> "HaloPlan":
        return HaloPlan(self.send_idx.to(device), self.send_sizes, self.recv_sizes, self.recv_slot.to(device),
                        self.n_own, self.n_total)


def _plan(needs: list, bounds: np.ndarray, rank: int, slot: np.ndarray, n_total: int) -> HaloPlan:
    """``needs[q]``: sorted global ids rank q reads; ``bounds``: the owners' id ranges; ``slot``: the
    local row of each of this rank's needed ids."""
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    sends = [nd[(nd >= lo) & (nd < hi)] - lo for nd in needs]
    recv = np.searchsorted(needs[rank], bounds[1:]) - np.searchsorted(needs[rank], bounds[:-1])
    return HaloPlan(_t(np.concatenate(sends), torch.long), [len(s) for s in sends], [int(c) for c in recv],
                    _t(slot, torch.long), hi - lo, n_total)


class _HaloGather(torch.autograd.Function):
    """``[x_own; rows of other ranks]`` forward; the ghost reduction (its adjoint) backward."""

    @staticmethod
    def forward(ctx, x, grp: EdgeGroup, plan: HaloPlan, op_fwd: str, op_bwd: str):
        ctx.args = (grp, plan, op_fwd, op_bwd)
        send = x.detach()[plan.send_idx]
        got = grp.comm.all_to_all_rows(send, plan.send_sizes, plan.recv_sizes, grp.group, op_fwd)
        out = x.new_zeros((plan.n_total, *x.shape[1:]))
        out[:plan.n_own] = x.detach()
        out[plan.recv_slot] = got
        return out

    @staticmethod
    def backward(ctx, g):
        grp, plan, op_fwd, op_bwd = ctx.args
        return _HaloScatter.apply(g, grp, plan, op_bwd, op_fwd), None, None, None, None


class _HaloScatter(torch.autograd.Function):
    """``y_own + Σ`` of the rows other ranks hold for our own rows forward; the gather backward."""

    @staticmethod
    def forward(ctx, y, grp: EdgeGroup, plan: HaloPlan, op_fwd: str, op_bwd: str):
        ctx.args = (grp, plan, op_fwd, op_bwd)
        if y.shape[0] != plan.n_total:
            raise ValueError(f"ghost reduction: {y.shape[0]} rows, the plan has {plan.n_total}")
        send = y.detach()[plan.recv_slot]
        got = grp.comm.all_to_all_rows(send, plan.recv_sizes, plan.send_sizes, grp.group, op_fwd)
        return y.detach()[:plan.n_own].clone().index_add_(0, plan.send_idx, got)

    @staticmethod
    def backward(ctx, g):
        grp, plan, op_fwd, op_bwd = ctx.args
        return _HaloGather.apply(g, grp, plan, op_bwd, op_fwd), None, None, None, None


@dataclass
class HaloAtomGraph(ShardedAtomGraph):
    """One rank's view in the atoms layout: own atoms and ghosts, own edges and halo edges.

    ``atom_lo, atom_hi`` are the own atoms' range in the (reordered) batch, as in the edges layout;
    in the view they are rows ``[0, N_own)`` (``own_atoms``).
    """

    kj_plan: Optional[HaloPlan] = None
    swap_plan: Optional[HaloPlan] = None
    atom_plan: Optional[HaloPlan] = None
    ghost_plan: Optional[HaloPlan] = None
    counts: dict = field(default_factory=dict)

    @property
    def own_atoms(self) -> slice:
        return slice(0, self.atom_hi - self.atom_lo)

    def gather_edges(self, x: Tensor, rows: str = "kj") -> Tensor:
        plan = self.kj_plan if rows == "kj" else self.swap_plan
        return _HaloGather.apply(x, self.group, plan, OP_EDGE_HALO, OP_EDGE_HALO_GRAD)

    def sum_atoms(self, partial: Tensor) -> Tensor:
        return _HaloScatter.apply(partial, self.group, self.ghost_plan, OP_GHOST_SUM, OP_ATOM_HALO)

    def gather_atoms(self, x_own: Tensor) -> Tensor:
        return _HaloGather.apply(x_own, self.group, self.atom_plan, OP_ATOM_HALO, OP_GHOST_SUM)

    def edges_to_atoms(self, msg: Tensor) -> Tensor:
        """Every local edge ends at an own atom: the sum is rank-local, no collective."""
        return sum_rows(msg, self.edge_dst, self.atom_hi - self.atom_lo)

    def to(self, device=None, dtype=None) -> "HaloAtomGraph":
        g = super().to(device, dtype)
        if device is not None:
            for name in ("kj_plan", "swap_plan", "atom_plan", "ghost_plan"):
                if getattr(g, name) is not None:
                    setattr(g, name, getattr(g, name).to(device))
        return g


def edge_rows(ids: np.ndarray, halo: np.ndarray, e0: int, e1: int) -> np.ndarray:
    """The view's row of each edge id ``ids``: own edges ``[e0, e1)`` first, then ``halo`` (sorted ids)."""
    own = (ids >= e0) & (ids < e1)
    return np.where(own, ids - e0, (e1 - e0) + np.searchsorted(halo, ids))


def shard_atoms(b: dict, rank: int, group: Optional[EdgeGroup], dtype=torch.float64, device=None) -> AtomGraph:
    """Rank ``rank``'s view of a ``group_by_part`` batch ``b`` (``order_by_part``) in the atoms layout."""
    parts = len(b["atom_parts"])
    src, dst, shift = np.asarray(b["edge_src"]), np.asarray(b["edge_dst"]), np.asarray(b["edge_shift"])
    n, e = len(b["z"]), len(src)
    ab = _bounds(b["atom_parts"])
    owner = np.repeat(np.arange(parts), b["atom_parts"])
    eb = _bounds(np.bincount(owner[dst], minlength=parts))
    if parts == 1:
        from .parallel import single_graph
        return single_graph(b, dtype, device)
    needs = [rank_needs(b, r) for r in range(parts)]
    me = needs[rank]
    a0, a1, e0, e1 = int(ab[rank]), int(ab[rank + 1]), int(eb[rank]), int(eb[rank + 1])
    e_own = e1 - e0
    # atom rows: own, embedding ghosts, position-only ghosts
    extra = np.setdiff1d(me.ghosts, me.atoms, assume_unique=True)
    atoms = np.concatenate([np.arange(a0, a1), me.atoms, extra])
    loc = np.full(n, -1, dtype=np.int64)
    loc[atoms] = np.arange(len(atoms))
    # edge rows: own, then the halo of each index set
    idx_ji, idx_kj = np.asarray(b["idx_ji"]), np.asarray(b["idx_kj"])
    keep = (idx_ji >= e0) & (idx_ji < e1)
    kj = idx_kj[keep]
    kw = dict(
        z=_t(np.asarray(b["z"])[atoms], torch.long), pos=_t(np.asarray(b["pos"])[atoms], dtype),
        system=_t(np.asarray(b["system"])[atoms], torch.long), num_systems=int(b["num_systems"]),
        edge_src=_t(loc[src[e0:e1]], torch.long), edge_dst=_t(loc[dst[e0:e1]], torch.long),
        edge_shift=_t(shift[e0:e1], dtype),
        idx_kj=_t(edge_rows(kj, me.kj, e0, e1), torch.long), idx_ji=_t(idx_ji[keep] - e0, torch.long),
        kj_src=_t(loc[src[kj]], torch.long), kj_dst=_t(loc[dst[kj]], torch.long), kj_shift=_t(shift[kj], dtype),
        num_edges=e_own + len(me.kj), atom_lo=a0, atom_hi=a1,
        triplet_rank=_t(triplet_rank(idx_ji, e)[keep], torch.long))
    if b.get("id_swap") is not None:
        kw["id_swap"] = _t(edge_rows(np.asarray(b["id_swap"])[e0:e1], me.swap, e0, e1), torch.long)
    return halo_view(kw, needs, ab, eb, rank, loc[me.ghosts], len(atoms), group, device)


def halo_view(kw: dict, needs: list, ab: np.ndarray, eb: np.ndarray, rank: int, ghost_rows: np.ndarray,
              n_atoms: int, group: Optional[EdgeGroup], device=None) -> "HaloAtomGraph":
    """The ``HaloAtomGraph`` of rank ``rank`` from its view's tensors ``kw`` (``AtomGraph``'s fields;
    ``id_swap`` present or not) and every rank's ``Needs`` (``needs[rank]`` its own): ``ab``, ``eb`` the
    ranks' atom and edge id bounds, ``ghost_rows`` the view's row of each of its ghosts, ``n_atoms`` its
    rows. Shared by ``shard_atoms`` (from a whole batch) and ``domains`` (from a rank's region)."""
    me = needs[rank]
    n_own, e_own = int(ab[rank + 1] - ab[rank]), int(eb[rank + 1] - eb[rank])
    swap_plan = None
    if kw.get("id_swap") is not None:
        swap_plan = _plan([nd.swap for nd in needs], eb, rank, e_own + np.arange(len(me.swap)), e_own + len(me.swap))
    g = HaloAtomGraph(
        **kw, edge_sizes=[], atom_sizes=[], group=group,
        kj_plan=_plan([nd.kj for nd in needs], eb, rank, e_own + np.arange(len(me.kj)), e_own + len(me.kj)),
        swap_plan=swap_plan,
        atom_plan=_plan([nd.atoms for nd in needs], ab, rank, n_own + np.arange(len(me.atoms)), n_own + len(me.atoms)),
        ghost_plan=_plan([nd.ghosts for nd in needs], ab, rank, ghost_rows, n_atoms),
        counts={k: len(getattr(me, k)) for k in HALO_KEYS})
    return g.to(device) if device is not None else g


__all__ = ["partition_atoms", "group_by_part", "order_by_part", "rank_needs", "rank_sizes", "halo_counts",
           "step_bytes", "shard_atoms", "halo_view", "HaloAtomGraph", "HaloPlan", "Needs", "HALO_KEYS"]
