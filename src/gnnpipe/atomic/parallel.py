"""Edge/triplet graph parallelism for atomistic models (Sriram et al., ICLR 2022), exact.

One batch of systems is split across the P ranks of a graph-parallel group:

* rank r holds a contiguous block of the batch's E edges (``np.array_split`` sizes) and
  every triplet whose **output** edge ``ji`` it holds: triplet features never cross the
  wire, and the triplet part of memory falls as 1/P;
* atoms are replicated (``z``, ``pos``), and rank r *owns* a contiguous block of them
  (``np.array_split`` of N) for everything per atom (output MLPs, forces, the loss).

:class:`ShardedAtomGraph` is the :class:`~gnnpipe.atomic.batch.AtomGraph` of one rank: the
model is the same code as in one process, and the reductions become collectives.

Why the gradients are exact
---------------------------
Write every rank's loss contribution so that the *sum over ranks* is the single-process
loss ``L``; then summing parameter gradients over the group gives ``dL/dθ`` provided each
collective's backward is the adjoint of its forward *with that convention*:

* ``gather_edges`` (all-gather, ``X = [x_0; ...; x_{P-1}]``): every rank's consumer of X
  is rank-local (its own triplets), so ``dL/dx_r = Σ_q (dL_q/dX)[block r]``: the backward
  is a **sum**-reduce-scatter. (A plain gather whose backward keeps only the local slice
  drops the other ranks' contributions: fairchem's first ``gp_utils`` had that bug.)
* ``sum_atoms`` (reduce-scatter of per-rank partial sums to atom blocks): the adjoint of
  a reduce-scatter is an all-gather.
* ``gather_atoms`` (all-gather of the own atom blocks, e.g. GemNet's updated atom embeddings
  that local edges read at both ends): the same argument as ``gather_edges``, every
  consumer is rank-local, so the backward is a **sum**-reduce-scatter to the owners.
* ``sum_systems`` (all-reduce of per-system partial sums): every rank then holds the same
  energies and computes the energy loss on them *replicated*; counting that replicated
  loss once, ``dL/dx_r = dL/dE`` on every rank, so the backward is the **identity**
  (an all-reduce in backward would multiply the energy gradient by P).

Each backward is itself built from these autograd functions, so the graph of a backward
pass is differentiable again: ``create_graph=True`` for energy-conserving forces
``F = -dE/dpos`` and the parameter gradients of a loss on F (double backward) pass
through every collective. The adjoint of a reduce-scatter is an all-gather and vice
versa, and the identity's adjoint is the identity, so the second pass is exact too.

Every rank issues the collectives in the same order (the model's structure is identical
on every rank; zero-size blocks are sent as zero rows, never skipped), which gloo and
NCCL require. All collectives are ``all_to_all_single`` calls of the shared
:class:`~gnnpipe.parallel.comm.Communicator`, so the ledger counts the bytes that are
really sent: an all-gather or reduce-scatter of ``n`` rows of width ``w`` sends
``(P-1)·n·w·b`` bytes over the group (sum over ranks), whatever the split;
the closed form is :func:`step_bytes`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from ..io import GnnPipeError
from .batch import AtomGraph
from .neighbors import triplet_rank

OP_GATHER_EDGES = "edge_all_gather"  # forward all-gathers of edge rows (and their adjoints' adjoints)
OP_SCATTER_EDGES = "edge_reduce_scatter"  # sum-reduce-scatters of edge-row gradients
OP_SCATTER_ATOMS = "atom_reduce_scatter"  # per-atom partial sums to their owners (and gather_atoms' adjoint)
OP_GATHER_ATOMS = "atom_all_gather"  # every atom's row (gather_atoms), and sum_atoms' adjoint
OP_SYSTEMS = "system_all_reduce"  # per-system energies
OP_GRADS = "grad_allreduce"  # parameter gradients, graph group then data-parallel group


def split_sizes(n: int, parts: int) -> list[int]:
    """Block sizes of ``np.array_split(range(n), parts)``: the first ``n % parts`` get one more."""
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def collective_passes(force_head: str, training: bool, forces: bool = True) -> tuple[int, int]:
    """(times a model collective crosses the wire, times the forces' exchange does) in one training
    step or one inference call: forward, the force pass (gradient head), and in training the adjoint
    of each (the loss backward; through the force pass too: double backward). ``forces=False``
    (energy-only training): the forward and the loss backward alone, no forces exchanged."""
    passes = 4 if force_head == "gradient" and forces else 2
    once = 2 if forces else 0
    return (passes, once) if training else (passes // 2, once // 2)


@dataclass
class EdgeGroup:
    """The graph-parallel group one rank computes a batch with (explicit, no global state)."""

    comm: object  # gnnpipe.parallel.comm.Communicator
    group: object  # torch.distributed ProcessGroup of the P ranks (None: the default world)
    size: int
    rank: int  # this rank's index in the group

    def all_gather_rows(self, x: Tensor, sizes: Sequence[int], op: str) -> Tensor:
        """(sizes[rank], *D) -> (sum(sizes), *D): every rank's block, in rank order."""
        if x.shape[0] != sizes[self.rank]:
            raise ValueError(f"all-gather: rank {self.rank} holds {x.shape[0]} rows, the split says {sizes[self.rank]}")
        send = x.detach().contiguous().repeat(self.size, *([1] * (x.dim() - 1)))
        return self.comm.all_to_all_rows(send, [x.shape[0]] * self.size, list(sizes), self.group, op)

    def reduce_scatter_rows(self, x: Tensor, sizes: Sequence[int], op: str) -> Tensor:
        """(sum(sizes), *D) partial sums -> (sizes[rank], *D): block ``rank`` summed over ranks."""
        if x.shape[0] != sum(sizes):
            raise ValueError(f"reduce-scatter: {x.shape[0]} rows, the split sums to {sum(sizes)}")
        mine = int(sizes[self.rank])
        got = self.comm.all_to_all_rows(x.detach().contiguous(), list(sizes), [mine] * self.size,
                                        self.group, op)
        return got.view(self.size, mine, *x.shape[1:]).sum(0)

    def all_reduce(self, x: Tensor, op: str) -> Tensor:
        out = x.detach().clone()
        self.comm.all_reduce_(out, group=self.group, op=op)
        return out


class _GatherRows(torch.autograd.Function):
    """All-gather forward; sum-reduce-scatter backward (the consumer is rank-local)."""

    @staticmethod
    def forward(ctx, x, grp: EdgeGroup, sizes, op_fwd: str, op_bwd: str):
        ctx.grp, ctx.sizes, ctx.ops = grp, sizes, (op_fwd, op_bwd)
        return grp.all_gather_rows(x, sizes, op_fwd)

    @staticmethod
    def backward(ctx, g):
        op_fwd, op_bwd = ctx.ops
        return _ScatterRows.apply(g, ctx.grp, ctx.sizes, op_bwd, op_fwd), None, None, None, None


class _ScatterRows(torch.autograd.Function):
    """Sum-reduce-scatter forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, grp: EdgeGroup, sizes, op_fwd: str, op_bwd: str):
        ctx.grp, ctx.sizes, ctx.ops = grp, sizes, (op_fwd, op_bwd)
        return grp.reduce_scatter_rows(x, sizes, op_fwd)

    @staticmethod
    def backward(ctx, g):
        op_fwd, op_bwd = ctx.ops
        return _GatherRows.apply(g, ctx.grp, ctx.sizes, op_bwd, op_fwd), None, None, None, None


class _SumReplicated(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward: the result's consumer is replicated."""

    @staticmethod
    def forward(ctx, x, grp: EdgeGroup, op: str):
        return grp.all_reduce(x, op)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


@dataclass
class ShardedAtomGraph(AtomGraph):
    """One rank's shard of a batch: local edges and triplets, own atoms, collectives."""

    edge_sizes: list = field(default_factory=list)  # E per rank of the group
    atom_sizes: list = field(default_factory=list)  # own atoms per rank
    group: Optional[EdgeGroup] = None

    def gather_edges(self, x: Tensor, rows: str = "kj") -> Tensor:
        return _GatherRows.apply(x, self.group, self.edge_sizes, OP_GATHER_EDGES, OP_SCATTER_EDGES)

    def sum_atoms(self, partial: Tensor) -> Tensor:
        return _ScatterRows.apply(partial, self.group, self.atom_sizes, OP_SCATTER_ATOMS, OP_GATHER_ATOMS)

    def sum_systems(self, x_own: Tensor) -> Tensor:
        return _SumReplicated.apply(super().sum_systems(x_own), self.group, OP_SYSTEMS)

    def gather_atoms(self, x_own: Tensor) -> Tensor:
        return _GatherRows.apply(x_own, self.group, self.atom_sizes, OP_GATHER_ATOMS, OP_SCATTER_ATOMS)


# --------------------------------------------------------------------------- building views
def _t(a, dtype=None) -> Tensor:
    return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype)


def single_graph(b: dict, dtype=torch.float64, device=None) -> AtomGraph:
    """The whole batch in one process, from ``graphs.batch_arrays`` (numpy, batch-level ids)."""
    return shard_graph(b, 1, 0, None, dtype, device)


def shard_graph(b: dict, parts: int, rank: int, group: Optional[EdgeGroup], dtype=torch.float64,
                device=None) -> AtomGraph:
    """Rank ``rank``'s view of batch ``b`` split ``parts`` ways (``parts == 1``: an ``AtomGraph``).

    ``b`` holds numpy arrays: ``z, pos, system, edge_src, edge_dst, edge_shift, idx_kj, idx_ji``
    with batch-level ids (``graphs.batch_arrays``) and ``num_systems``; optionally ``id_swap``
    (the reverse of each edge, batch-level ids: ``neighbors.reverse_edges``). ``triplet_rank``
    is derived from ``idx_ji`` here (``neighbors.triplet_rank``), before the split, so every
    rank holds the unsharded ranks of its triplets.
    """
    n, e = int(len(b["z"])), int(len(b["edge_src"]))
    if parts > max(e, 1):  # one process computes an empty graph too (isolated atoms: inference)
        raise GnnPipeError(f"graph parallelism over {parts} workers needs at least {parts} edges in a "
                           f"batch, but this batch of {b['num_systems']} system(s) has {e}: use fewer "
                           "workers, a larger batch or a larger cutoff")
    esz, asz = split_sizes(e, parts), split_sizes(n, parts)
    e0, e1 = sum(esz[:rank]), sum(esz[:rank + 1])
    a0, a1 = sum(asz[:rank]), sum(asz[:rank + 1])
    idx_ji, idx_kj = np.asarray(b["idx_ji"]), np.asarray(b["idx_kj"])
    keep = (idx_ji >= e0) & (idx_ji < e1)
    kj = idx_kj[keep]
    src, dst, shift = np.asarray(b["edge_src"]), np.asarray(b["edge_dst"]), np.asarray(b["edge_shift"])
    kw = dict(
        z=_t(b["z"], torch.long), pos=_t(b["pos"], dtype), system=_t(b["system"], torch.long),
        num_systems=int(b["num_systems"]),
        edge_src=_t(src[e0:e1], torch.long), edge_dst=_t(dst[e0:e1], torch.long),
        edge_shift=_t(shift[e0:e1], dtype),
        idx_kj=_t(kj, torch.long), idx_ji=_t(idx_ji[keep] - e0, torch.long),
        kj_src=_t(src[kj], torch.long), kj_dst=_t(dst[kj], torch.long), kj_shift=_t(shift[kj], dtype),
        num_edges=e, atom_lo=a0, atom_hi=a1,
        id_swap=_t(np.asarray(b["id_swap"])[e0:e1], torch.long) if b.get("id_swap") is not None else None,
        triplet_rank=_t(triplet_rank(idx_ji, e)[keep], torch.long))
    g = AtomGraph(**kw) if parts == 1 else ShardedAtomGraph(**kw, edge_sizes=esz, atom_sizes=asz, group=group)
    return g.to(device) if device is not None else g


def with_pos(g: AtomGraph, pos: Tensor) -> AtomGraph:
    """``g`` with other positions (e.g. a leaf that requires grad, for gradient forces)."""
    return dataclasses.replace(g, pos=pos)
