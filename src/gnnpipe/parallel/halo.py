"""Halo exchange: the one plan type (``HaloPlan``, from the chunk store's send lists, for every
layout: :func:`way_plans`) and the autograd pair (``start_halo``, ``finish_halo``,
``halo_exchange``); the bytes go through :class:`~gnnpipe.parallel.comm.Communicator`.

Graph parallelism, one layer. Part p owns rows h_p (n_p, D) and needs, as sources of
its edges, the halo rows owned by other parts. Stack every part's halo as
``halo = S h`` where ``h`` is all parts' own rows stacked and S is a 0/1 selection
matrix with exactly one 1 per row (the owner's row of that halo node). Then for any
loss L:

    dL/dh = S^T dL/dhalo,

i.e. the gradient of a halo row goes back to the row it was copied from and, since a
row can be in several parts' halos (and appears in no part's halo twice), the owner
*adds up* the gradients that come back from every part that used it. In code:

  forward : owner p sends h_p[send_index_p[q]] to each q           (all-to-all)
            q receives its halo rows, grouped by owner in rank order (= sorted halo)
  backward: q sends grad_halo[rows from p] back to each p          (the same all-to-all,
            splits swapped)
            p: grad_h_p += index_add over send_index_p of what came back

No rescaling: the exchange is a linear copy, its adjoint is a scatter-add. The
gradient that h_p receives through its *own* use (self terms, inner edges) flows
through ordinary autograd and is summed with the scattered halo gradients.

Overlap. ``start_halo`` launches the forward all-to-all and returns at once, so the
caller can aggregate the rows that need no halo meanwhile; ``finish_halo`` waits and
returns the halo as an autograd tensor. Backward overlaps the same way: the backward
of ``finish_halo`` only *starts* the gradient all-to-all; the wait and the
scatter-add happen in the backward of an identity node (``_HaloJoin``) that
``start_halo`` put on ``h_own``. Autograd runs that node only after every use of
``h_own`` has been back-propagated (the inner rows' aggregation among them), which is
exactly the work that runs while the halo gradients are in flight. Every rank issues
the collectives in the same order (layer by layer, forward then backward), which is
what gloo and NCCL require.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from .comm import Communicator, Work


@dataclass
class HaloPlan:
    """The static index lists of one halo exchange (from the chunk store).

    ``send_index`` concatenates, in group-rank order, the local rows every peer needs
    (``store.send_index(p)``); ``send_rows[q]`` how many go to ``q``; ``recv_rows[q]`` how
    many of this part's halo rows ``q`` owns (``store.recv_counts(p)``). ``recv_pos``: where
    the received rows go in the receiver's source rows (own rows, then its halo); ``None``:
    right after the own rows, in order (a part whose whole halo arrives at once).
    """

    send_index: Tensor  # int64 (sum(send_rows),) local row ids
    send_rows: list[int]
    recv_rows: list[int]
    n_own: int
    group: object = None
    recv_pos: Optional[Tensor] = None  # int64 (sum(recv_rows),) positions in the source rows

    @classmethod
    def from_lists(cls, send_index: Sequence, recv_counts: Sequence[int], n_own: int,
                   device=None, group=None) -> "HaloPlan":
        idx = [torch.as_tensor(i, dtype=torch.int64).reshape(-1) for i in send_index]
        flat = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n_own):
            raise ValueError(f"send_index holds rows outside [0, {n_own})")
        return cls(flat.to(device), [int(i.numel()) for i in idx], [int(c) for c in recv_counts],
                   int(n_own), group)

    @property
    def n_halo(self) -> int:
        return sum(self.recv_rows)

    @property
    def n_send(self) -> int:
        return sum(self.send_rows)


def way_plans(store, way: int, ways: int, halo: np.ndarray, device=None, group=None
              ) -> tuple[list[HaloPlan], HaloPlan]:
    """The exchanges of way ``way`` of ``ways`` (chunks ``way·c .. (way+1)·c - 1``, ``c = C / ways``),
    derived from the chunk store's send lists alone (no negotiation at run time).

    Returns, per local chunk index ``j``, the plan of the *step* that computes chunks ``q·c + j``
    on every way ``q`` at once: the rows of this way's chunk ``j`` that each other way's halo
    lists (its send list, rows local to the chunk, in that way's halo order) and where the rows
    of the other ways' chunks ``j`` land in this way's source rows; and the plan of the way's
    whole block (the exact passes), every step's at once. ``halo``: the way's halo ``H_g``
    (sorted new ids; grouped by owner way since ways are contiguous id ranges). With one chunk
    per way a step is the whole way: the plan is the store's own list for the part
    (``send_index(p)``, ``recv_counts(p)``): graph parallelism.
    """
    c = store.num_parts // ways
    offsets = store.offsets
    mine = [way * c + j for j in range(c)]
    base = int(offsets[mine[0]])
    owner = store.part_of(halo)  # chunk of each halo row
    steps, way_send = [], [[] for _ in range(ways)]
    for j, chunk in enumerate(mine):
        lists = store.send_index(chunk)  # per chunk q: rows of `chunk` q's halo lists
        send = [np.zeros(0, np.int64) if q == way else
                np.unique(np.concatenate([lists[p] for p in range(q * c, (q + 1) * c)]).astype(np.int64))
                for q in range(ways)]
        pos = [np.flatnonzero(owner == q * c + j) for q in range(ways)]
        for q in range(ways):
            way_send[q].append(send[q] + int(offsets[chunk]) - base)
        steps.append(HaloPlan.from_lists(send, [len(p) for p in pos], int(offsets[chunk + 1] - offsets[chunk]),
                                         device, group))
        steps[-1].recv_pos = torch.as_tensor(store.offsets[mine[-1] + 1] - base + np.concatenate(pos),
                                             dtype=torch.int64).to(device)
    whole = HaloPlan.from_lists([np.concatenate(w) for w in way_send],
                                [int(np.sum(owner // c == q)) for q in range(ways)],
                                int(offsets[mine[-1] + 1]) - base, device, group)
    if sum(whole.recv_rows) != len(halo):
        raise ValueError(f"way {way}: its halo ({len(halo)} rows) is not what its chunks' owners send "
                         f"({sum(whole.recv_rows)}); rebuild the chunk store")
    return steps, whole


class _HaloState:
    __slots__ = ("plan", "comm", "op", "fwd", "bwd", "shape")

    def __init__(self, plan: HaloPlan, comm: Communicator, op: str):
        self.plan, self.comm, self.op = plan, comm, op
        self.fwd: Optional[Work] = None
        self.bwd: Optional[Work] = None
        self.shape = None


class _HaloJoin(torch.autograd.Function):
    """Identity on ``h_own``; backward adds the halo gradients that came back (scatter-add)."""

    @staticmethod
    def forward(ctx, h_own: Tensor, state: _HaloState) -> Tensor:
        ctx.state = state
        return h_own.view_as(h_own)

    @staticmethod
    def backward(ctx, grad_own: Tensor):
        state: _HaloState = ctx.state
        plan, comm = state.plan, state.comm
        if state.bwd is None:
            # The halo was not on the path to the loss on this rank: the peers still
            # expect this layer's gradient exchange, so take part with zeros.
            zeros = grad_own.new_zeros((plan.n_halo, *grad_own.shape[1:]))
            state.bwd = comm.all_to_all_rows(zeros, plan.recv_rows, plan.send_rows, plan.group,
                                             state.op, async_op=True)
        back = comm.wait(state.bwd)  # (n_send, *D): gradients of the rows this part sent
        state.bwd = None
        if back.shape[0] == 0:
            return grad_own, None
        return grad_own.index_add(0, plan.send_index, back.to(grad_own.dtype)), None


class _HaloRecv(torch.autograd.Function):
    """Forward: wait for the halo rows; backward: *start* sending their gradients back."""

    @staticmethod
    def forward(ctx, h_own: Tensor, state: _HaloState) -> Tensor:
        ctx.state = state
        halo = state.comm.wait(state.fwd)
        state.fwd = None
        return halo

    @staticmethod
    def backward(ctx, grad_halo: Tensor):
        state: _HaloState = ctx.state
        plan = state.plan
        state.bwd = state.comm.all_to_all_rows(grad_halo.contiguous(), plan.recv_rows, plan.send_rows,
                                               plan.group, state.op, async_op=True)
        return None, None  # h_own's share arrives in _HaloJoin.backward


@dataclass
class PendingHalo:
    own: Tensor  # h_own behind the join node: use it (not the original) for every later use
    state: _HaloState


def start_halo(h_own: Tensor, plan: HaloPlan, comm: Communicator, op: str = "halo") -> PendingHalo:
    """Launch the halo exchange of ``h_own`` (``(n_own, *D)``) and return at once.

    Use ``pending.own`` in place of ``h_own`` from here on (it carries the backward
    scatter-add), then ``finish_halo(pending)`` for the halo rows.
    """
    if h_own.shape[0] != plan.n_own:
        raise ValueError(f"halo exchange: h_own has {h_own.shape[0]} rows, the plan owns {plan.n_own}")
    state = _HaloState(plan, comm, op)
    own = _HaloJoin.apply(h_own, state) if h_own.requires_grad else h_own
    send = h_own.detach().index_select(0, plan.send_index)  # (n_send, *D), contiguous
    state.fwd = comm.all_to_all_rows(send, plan.send_rows, plan.recv_rows, plan.group, op, async_op=True)
    return PendingHalo(own, state)


def finish_halo(pending: PendingHalo) -> Tensor:
    """Wait for the halo rows (``(n_halo, *D)``, in the part's halo order), as an autograd tensor."""
    if pending.own.requires_grad:
        return _HaloRecv.apply(pending.own, pending.state)
    halo = pending.state.comm.wait(pending.state.fwd)
    pending.state.fwd = None
    return halo


def halo_exchange(h_own: Tensor, plan: HaloPlan, comm: Communicator, op: str = "halo") -> Tensor:
    """Blocking exchange: ``cat(own rows, halo rows)``, ``(n_own + n_halo, *D)``, differentiable."""
    pending = start_halo(h_own, plan, comm, op)
    return torch.cat([pending.own, finish_halo(pending)])
