"""The communicator: every collective and point-to-point op of every mode goes through here.

One ``Communicator`` per rank, over ``torch.distributed`` (gloo on CPU, NCCL on CUDA;
the backend is whatever the process group was initialised with, the buffers live on
the communicator's ``device``). It keeps two things the comparison between modes is
built on:

* a **byte ledger**, ``ledger[epoch][op] = {"sent", "recv", "calls"}``: bytes this rank
  put on / took off the wire. Rows a rank "sends" to itself are a local copy and are not
  counted. All-reduce is counted as a ring all-reduce moves it (each of ``n`` ranks sends
  ``2 (n-1)/n`` of the buffer; the exact integer split is in ``ring_allreduce_bytes``), a
  broadcast as ``(n-1)`` copies leaving the source. ``op="control"`` (metrics,
  evaluation, statistics) is kept apart from the training traffic the closed forms
  predict (``epoch_bytes`` excludes it by default);
* **comm time**: the wall time this rank spends *blocked* in communication (a blocking
  call, or ``wait()`` on an async one), per epoch. On CUDA the device is synchronised
  before the clock starts (pending kernels are compute, not comm) and after the op
  completes (NCCL is asynchronous to the host); pass ``sync_cuda_timing=False`` to trade
  that accuracy for fewer synchronisations.

Every method takes ``group`` (``None``: the default world group) and names an ``op``
(the ledger key). A group of one rank, or no initialised process group at all, takes a
shortcut: nothing is sent, nothing is counted.

The autograd pair for graph-parallel halo exchange (``HaloPlan``, ``start_halo``,
``finish_halo``, ``halo_exchange``) is in :mod:`gnnpipe.parallel.halo`, with its derivation.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_BUCKET_BYTES = 25 * 2**20  # as DDP: big enough to amortise latency, small enough to pipeline


def ring_allreduce_bytes(numel: int, elem_bytes: int, n: int, rank: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``numel`` elements.

    The buffer is cut into ``n`` chunks (sizes differ by at most one element; chunk ``r``
    has ``numel // n + (r < numel % n)`` elements). In the reduce-scatter and in the
    all-gather phase every rank forwards ``n - 1`` chunks, i.e. all but one; we take
    that one to be its own chunk. So rank ``r`` sends ``2 (numel - chunk_r)`` elements, and
    the sum over all ranks is exactly ``2 (n-1) numel`` elements: the ``2 (n-1)/n`` rule.
    """
    if n <= 1:
        return 0
    chunk = numel // n + (1 if rank < numel % n else 0)
    return 2 * (numel - chunk) * elem_bytes


class Work:
    """An operation in flight. ``comm.wait(work)`` (or ``work.wait()``) returns its result."""

    __slots__ = ("comm", "works", "result", "op", "done")

    def __init__(self, comm: "Communicator", works: list, result, op: str):
        self.comm, self.works, self.result, self.op, self.done = comm, works, result, op, False

    def wait(self):
        return self.comm.wait(self)

    def is_completed(self) -> bool:
        return self.done or all(w.is_completed() for w in self.works)


class Communicator:
    """Collectives, p2p, a byte ledger and a comm timer for one rank (docs/ARCHITECTURE.md)."""

    def __init__(self, groups=None, device: torch.device | str = "cpu", *, sync_cuda_timing: bool = True):
        self.groups = groups  # gnnpipe.parallel.groups.ProcessGroups (None: the default world, or no world)
        self.device = torch.device(device)
        self.initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.initialized else 0
        self.world_size = dist.get_world_size() if self.initialized else 1
        self.sync_cuda_timing = sync_cuda_timing and self.device.type == "cuda"
        self.epoch = -1  # traffic before the first set_epoch (set-up) is filed under -1
        self.ledger: dict[int, dict[str, dict[str, int]]] = defaultdict(
            lambda: defaultdict(lambda: {"sent": 0, "recv": 0, "calls": 0}))
        self._comm_s: dict[int, float] = defaultdict(float)
        self._comm_s_op: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    # ------------------------------------------------------------------ bookkeeping
    def set_epoch(self, epoch: int) -> None:
        """File the following traffic and comm time under ``epoch`` (``-1``: not training)."""
        self.epoch = int(epoch)

    def _count(self, op: str, sent: int, recv: int) -> None:
        row = self.ledger[self.epoch][op]
        row["sent"] += int(sent)
        row["recv"] += int(recv)
        row["calls"] += 1

    def record(self, op: str, sent: int, recv: int) -> None:
        """Count traffic that went around the communicator's own collectives (e.g. the payload arrays of
        a ``dist.all_gather_object``) under ``op``, as one call."""
        self._count(op, sent, recv)

    def _add_time(self, op: str, seconds: float) -> None:
        self._comm_s[self.epoch] += seconds
        self._comm_s_op[self.epoch][op] += seconds

    def _sync(self) -> None:
        if self.sync_cuda_timing:
            torch.cuda.synchronize(self.device)

    def _blocking(self, op: str, fn):
        """Run ``fn`` (a blocking call) and add its wall time to the epoch's comm time."""
        self._sync()
        t0 = time.perf_counter()
        out = fn()
        self._sync()
        self._add_time(op, time.perf_counter() - t0)
        return out

    def epoch_bytes(self, epoch: int, exclude: Sequence[str] = ("control",)) -> int:
        """Bytes this rank sent in ``epoch``, over every op not in ``exclude``."""
        return sum(r["sent"] for op, r in self.ledger.get(epoch, {}).items() if op not in exclude)

    def epoch_comm_s(self, epoch: int, op: Optional[str] = None) -> float:
        """Seconds this rank was blocked in communication in ``epoch`` (all ops, or one)."""
        if op is None:
            return float(self._comm_s.get(epoch, 0.0))
        return float(self._comm_s_op.get(epoch, {}).get(op, 0.0))

    def ledger_dict(self) -> dict:
        """The ledger as plain nested dicts (JSON / pickling)."""
        return {e: {op: dict(r) for op, r in ops.items()} for e, ops in self.ledger.items()}

    # ------------------------------------------------------------------ groups
    def group_size(self, group=None) -> int:
        return dist.get_world_size(group) if self.initialized else 1

    def group_rank(self, group=None) -> int:
        return dist.get_rank(group) if self.initialized else 0

    # ------------------------------------------------------------------ all-to-all
    def all_to_all_rows(self, send: Tensor, send_rows: Sequence[int], recv_rows: Sequence[int],
                        group=None, op: str = "halo", async_op: bool = False):
        """All-to-all of row blocks held in one flat buffer (the fast path).

        ``send`` is ``(sum(send_rows), *D)``, the rows for group rank ``q`` at
        ``[sum(send_rows[:q]), sum(send_rows[:q+1]))``; the result is
        ``(sum(recv_rows), *D)``, the rows from ``q`` likewise in rank order. Uneven splits
        (zeros included) are fine. One ``all_to_all_single``: no per-peer tensors, no copies
        beyond the output buffer. With ``async_op`` returns a ``Work`` whose result is
        the output buffer (valid after ``wait``).
        """
        n, me = self.group_size(group), self.group_rank(group)
        send_rows, recv_rows = [int(r) for r in send_rows], [int(r) for r in recv_rows]
        if len(send_rows) != n or len(recv_rows) != n:
            raise ValueError(f"all_to_all over {n} ranks needs {n} send and recv counts, "
                             f"got {len(send_rows)} and {len(recv_rows)}")
        if send.shape[0] != sum(send_rows):
            raise ValueError(f"send buffer has {send.shape[0]} rows, send_rows sum to {sum(send_rows)}")
        tail = tuple(send.shape[1:])
        row = 1
        for d in tail:
            row *= d
        if n == 1:  # the world-size-1 shortcut: the only peer is this rank
            out = send.clone() if recv_rows[0] else send.new_empty((0, *tail))
            return Work(self, [], out, op) if async_op else out
        send = send.contiguous()
        out = send.new_empty((sum(recv_rows), *tail))
        rb = row * send.element_size()
        self._count(op, (sum(send_rows) - send_rows[me]) * rb, (sum(recv_rows) - recv_rows[me]) * rb)
        in_splits, out_splits = [r * row for r in send_rows], [r * row for r in recv_rows]

        def launch(async_):
            return dist.all_to_all_single(out.view(-1), send.view(-1), out_splits, in_splits,
                                          group=group, async_op=async_)
        if async_op:
            return Work(self, [launch(True)], out, op)
        self._blocking(op, lambda: launch(False))
        return out

    def all_to_all(self, send: list[Tensor], recv_rows: Sequence[int], group=None, op: str = "halo",
                   async_op: bool = False):
        """All-to-all of per-peer tensors: ``send[q]`` (``(rows_q, *D)``) goes to group rank ``q``;
        returns ``recv[q]`` (``(recv_rows[q], *D)``) from each ``q`` (or a ``Work`` whose
        result is that list). Implemented on one flat buffer (``all_to_all_rows``)."""
        if not send:
            raise ValueError("all_to_all needs one send tensor per rank of the group")
        tail = tuple(send[0].shape[1:])
        for q, t in enumerate(send):
            if tuple(t.shape[1:]) != tail or t.dtype != send[0].dtype:
                raise ValueError(f"all_to_all: send[{q}] is {tuple(t.shape)} {t.dtype}, "
                                 f"send[0] is {tuple(send[0].shape)} {send[0].dtype}")
        flat = torch.cat([t.reshape(t.shape[0], *tail) for t in send]) if len(send) > 1 else send[0]
        res = self.all_to_all_rows(flat, [t.shape[0] for t in send], recv_rows, group, op, async_op)
        split = [int(r) for r in recv_rows]
        if async_op:
            res.result = list(res.result.split(split))
            return res
        return list(res.split(split))

    # ------------------------------------------------------------------ all-reduce
    def all_reduce_(self, t: Tensor, group=None, op: str = "grad_allreduce", reduce: str = "sum",
                    async_op: bool = False):
        """All-reduce ``t`` in place (``reduce``: sum, max, min); counted by the ring rule."""
        n = self.group_size(group)
        if n == 1:
            return Work(self, [], t, op) if async_op else t
        b = ring_allreduce_bytes(t.numel(), t.element_size(), n, self.group_rank(group))
        self._count(op, b, b)
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[reduce]
        if async_op:
            return Work(self, [dist.all_reduce(t, op=red, group=group, async_op=True)], t, op)
        self._blocking(op, lambda: dist.all_reduce(t, op=red, group=group))
        return t

    def all_reduce_coalesced_(self, tensors: Sequence[Tensor], group=None, op: str = "grad_allreduce",
                              bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        """Sum-all-reduce many tensors in place through flat buckets (not one call per tensor).

        Tensors are grouped by dtype and device, packed in order into buffers of at most
        ``bucket_bytes`` (a larger tensor gets a bucket of its own), all buckets are
        launched asynchronously and then unpacked. The ledger counts one ring all-reduce
        per bucket.
        """
        tensors = [t for t in tensors if t is not None and t.numel()]
        if not tensors or self.group_size(group) == 1:
            return
        buckets = bucket_tensors(tensors, bucket_bytes)
        flats = [torch.cat([t.reshape(-1) for t in b]) for b in buckets]
        works = [self.all_reduce_(f, group=group, op=op, async_op=True) for f in flats]
        for w, flat, b in zip(works, flats, buckets):
            self.wait(w)
            offset = 0
            for t in b:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    # ------------------------------------------------------------------ broadcast
    def broadcast_(self, t: Tensor, src: int, group=None, op: str = "control") -> Tensor:
        """Broadcast ``t`` from global rank ``src`` in place; ``(n-1)`` copies leave ``src``."""
        n = self.group_size(group)
        if n == 1:
            return t
        if self.rank == src:
            self._count(op, (n - 1) * t.nbytes, 0)
        else:
            self._count(op, 0, t.nbytes)
        self._blocking(op, lambda: dist.broadcast(t, src, group=group))
        return t

    def barrier(self, group=None, op: str = "control") -> None:
        if self.group_size(group) > 1:
            self._count(op, 0, 0)
            self._blocking(op, lambda: dist.barrier(group=group))

    # ------------------------------------------------------------------ point to point
    def isend(self, t: Tensor, dst: int, op: str = "p2p", tag: int = 0, group=None) -> Work:
        """Start sending ``t`` to global rank ``dst``; ``t`` must not change until waited."""
        t = t.contiguous()
        self._count(op, t.nbytes, 0)
        return Work(self, [dist.isend(t, dst, group=group, tag=tag)], t, op)

    def irecv(self, t: Tensor, src: int, op: str = "p2p", tag: int = 0, group=None) -> Work:
        """Start receiving into ``t`` (contiguous) from global rank ``src``; result: ``t``."""
        if not t.is_contiguous():
            raise ValueError("irecv needs a contiguous buffer")
        self._count(op, 0, t.nbytes)
        return Work(self, [dist.irecv(t, src, group=group, tag=tag)], t, op)

    def send(self, t: Tensor, dst: int, op: str = "p2p", tag: int = 0, group=None) -> None:
        self.wait(self.isend(t, dst, op=op, tag=tag, group=group))

    def recv(self, t: Tensor, src: int, op: str = "p2p", tag: int = 0, group=None) -> Tensor:
        return self.wait(self.irecv(t, src, op=op, tag=tag, group=group))

    # ------------------------------------------------------------------ waiting
    def wait(self, work: Work):
        """Block until ``work`` completes (time counted as comm time); return its result."""
        if not work.done:
            if work.works:
                self._sync()
                t0 = time.perf_counter()
                for w in work.works:
                    w.wait()
                self._sync()
                self._add_time(work.op, time.perf_counter() - t0)
            work.done = True
        return work.result

    def wait_all(self, works: Sequence[Work]) -> list:
        return [self.wait(w) for w in works]


def bucket_tensors(tensors: Sequence[Tensor], bucket_bytes: int) -> list[list[Tensor]]:
    """Pack tensors, in order, into buckets of one dtype/device and at most ``bucket_bytes``."""
    buckets: list[list[Tensor]] = []
    open_: dict[tuple, tuple[list[Tensor], int]] = {}
    for t in tensors:
        key = (t.dtype, t.device)
        cur, size = open_.get(key, (None, 0))
        if cur is None or (size + t.nbytes > bucket_bytes and cur):
            cur, size = [], 0
            buckets.append(cur)
        cur.append(t)
        open_[key] = (cur, size + t.nbytes)
    return buckets

