r"""One worker's piece of an ``S × G × C`` layout: stage ``s`` of way ``g``, what it owns and how it
runs one chunk (``gnnpipe.parallel.layout_engine`` runs the schedule; ``gnnpipe.schedule`` is the order).

**What a stage owns.** A contiguous block of convs (``balance.py``; stage 0 also the encoder, the
last stage the decoder and the loss), and, for its way ``g``, the way's block of ``c = C / G``
chunks of the chunk store: the rows ``[A, A + n_own)`` and the way's halo ``H_g`` (sorted new ids
outside them with an edge into them). Its *source space* is the own rows, then ``H_g``: graph
parallelism (``c = 1``) is a part against its halo, GNNPipe (``G = 1``) the whole graph.

**Buffers** (``c > 1`` only). For every conv ``l > 0`` it owns, a :class:`History` over the source
space: this epoch's input rows as chunks are computed, where rows of chunks not yet computed are
read from (last epoch's values, a snapshot, a moving average), and the gradients waiting for
their chunk's backward. Stage 0's conv 0 reads the input features (``x_src``: own rows and the
halo's, fetched once at set-up) or the encoder's output on them (``h0``), recomputed every epoch:
never stale. With one chunk per way there is nothing to buffer: a chunk is the whole way.

**One chunk through the stage** (:meth:`Stage._run`, one autograd graph from the chunk's input
rows, a leaf, to its output; :meth:`Stage._conv` per conv): each conv reads the chunk's own rows
and its halo rows, from the conv's :class:`HaloSource` chosen at set-up (``Stage.sources``;
``Stage.exact_sources`` for the way's exact pass): exchanged (one chunk per way), exchanged into
the buffer (several), from the buffer (one way), cached (conv 0's input) or given (recompute's
rebuild, the exact pass chunk by chunk). Before the conv the ``G`` ways exchange (one all-to-all in the graph group, op
``halo``; :func:`gnnpipe.parallel.halo.way_plans`) the rows of *this step's* chunks that the other
ways' halos list; the chunk's rows without an outside neighbour (``n_inner``) are aggregated
while they are in flight (``graph_parallel.overlap``). A chunk's halo row is *fresh* if its chunk
came earlier in the order or is another way's chunk of the same step (exchanged just now), else
*historical*. Backward: a tap on the halo rows (``_Hook``) sends their gradient, as soon as
autograd has it, to the gradient buffer (rows of this way) and, for the rows of the other ways'
chunks of this step, back to their owners by the same all-to-all (overlapping the inner rows'
backward); a join on the own rows (a ``_Hook`` too) adds, once all their uses are back-propagated, what
other chunks left in the buffer and what the other ways sent back. The exchange is a copy, its
adjoint a scatter-add (the derivation is in ``halo.py``). Each halo row crosses the wire once per
conv and epoch, each way: ``Σ_g M_g · d_l`` values per conv and direction (``costmodel.bytes``),
``d_l`` the conv's halo width: with nothing buffered (``c = 1``), the *narrow side* a GCN / SAGE /
GAT conv declares (``GNN.halo_dims()``; the stage's ``narrow`` convs project their own rows
first, send those, and join their gradient at that width; docs/DESIGN.md §4), else its input.
With one chunk per way this is graph parallelism's autograd pair, node for node.

**Why reverse order delivers the right gradients** (GPipe, ``gnnpipe.schedule``): chunk ``c``
read chunk ``c'``'s row fresh iff ``c'`` came earlier in the forward order (or at the same step
in another way), and ``c'`` is back-propagated after ``c`` iff it came earlier (backward runs in
reverse; the same step exchanges in that step). So exactly the *fresh* dependencies deliver their
gradient in the same epoch; a gradient for a *historical* row arrives after that row's chunk was
back-propagated. By default it waits in the buffer and is delivered next epoch (a stale
gradient, the mirror image of a stale embedding). With ``c = 1`` every halo row is read at its own
step: the epoch is exact (graph parallelism inside each stage, model parallelism across them).

**Convergence techniques** (``PipelineConfig``; docs/DESIGN.md §4):

1. ``shuffle_chunks``: a new chunk order every epoch, the same on every stage and way
   (``numpy.random.default_rng((seed, epoch))``), so that no chunk always reads only history.
2. ``grad_correction``: drop the gradients of historical rows (they are not carried to the next
   epoch) and multiply the gradients delivered to rows read fresh from an *earlier* step by
   ``grad_scale``. Derivation: the whole-graph gradient of row ``j`` of conv ``l``'s input is
   ``sum_i A_ij^T g_i`` over its out-neighbours ``i``. The pipeline delivers the term of a
   neighbour ``i`` in another chunk iff ``chunk(j)`` precedes ``chunk(i)`` in the order. Under a
   uniformly random order (technique 1) that holds with probability exactly 1/2 for every pair of
   distinct local chunk indices, so ``E[grad_scale * 1{delivered} * A_ij^T g_i] = A_ij^T g_i`` for
   ``grad_scale = 2``: with the own-chunk terms (always delivered, not scaled) and the same-step
   terms of other ways (delivered under any order, not scaled) the estimate is unbiased in the
   order, instead of a stale term from the previous epoch's weights (unbiased only up to the
   staleness of the ``g_i`` and of the forward values). With ``grad_scale = 1`` the step is the
   exact gradient of the computation actually done, historical rows taken as constants.
3. ``snapshot_every = K``: historical rows are read from a snapshot of the history taken at the
   start of every epoch ``e`` with ``e % K == 0``: one consistent model version for ``K`` epochs.
4. ``momentum = m``: PipeGCN-style smoothing: the history of a row is the moving average
   ``hist <- m hist + (1 - m) h`` of its values at the end of each epoch.

**Where stale rows come from.** Before the first epoch (``c > 1``), one exact pass of each
way's whole block through the stages fills every buffer (and history, and snapshot) with the
initial model's values (op ``control``, filed before epoch 0): epoch 0's forward is exact (with
dropout off). Without techniques 3/4 and without recompute the buffer itself is the history (a
row holds last epoch's value until its chunk is recomputed); otherwise a second buffer holds it.

**Recompute** (``recompute``): the forward keeps no activations, only each (conv, chunk)'s RNG
state, each conv's halo rows as read and, with nothing buffered (``c = 1``), the chunk's input
rows; the backward rebuilds the chunk's graph from them (the buffers hold the rest; the halo
rows are ``Given``, the exchanges not repeated), each conv under its RNG state (dropout draws the same mask), the global RNG left
as it was: bitwise the result of storing, and one chunk's activations at a time.

**Exact passes** (evaluation, the warm start): the way's whole block as one chunk through the
stages, dropout off, every exchange op ``control``.
"""

from __future__ import annotations

import abc
import contextlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from ..config import RunConfig
from ..engine import DTYPES, ce_sum
from ..io import GnnPipeError
from ..models.block import Block
from .halo import HaloPlan


def chunk_order(num_chunks: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """This epoch's forward order of a way's chunks: the same on every stage and way."""
    if not shuffle:
        return np.arange(num_chunks, dtype=np.int64)
    return np.random.default_rng((int(seed), int(epoch))).permutation(num_chunks).astype(np.int64)


def split_block(block: Block, n_inner: int, n_own: int) -> tuple[Block, Block]:
    """The local block cut at ``n_inner``: inner rows against own rows only, and the
    boundary rows ``[n_inner, n_own)`` against own + halo rows (``dst_offset = n_inner``)."""
    ip, idx = block.indptr, block.indices
    cut = int(ip[n_inner])
    inner_idx = idx[:cut]
    if inner_idx.numel() and int(inner_idx.max()) >= n_own:
        raise GnnPipeError(f"chunk store: an 'inner' row has a halo source (rows [0, {n_inner}) "
                           "must only have own in-neighbours); rebuild it with the 'materialize' rule")
    inner = Block(ip[:n_inner + 1].clone(), inner_idx.clone(), n_own, 0, block.deg_dst[:n_inner].clone(),
                  block.deg_src[:n_own].clone())
    boundary = Block(ip[n_inner:] - cut, idx[cut:].clone(), block.n_src, n_inner,
                     block.deg_dst[n_inner:].clone(), block.deg_src.clone())
    return inner, boundary


class History:
    """The buffers behind one conv's input on one stage.

    ``cur`` (n_src, d): this epoch's values (a row is overwritten when its chunk is computed).
    ``stale()``: where rows of chunks not yet computed this epoch are read from:

    * the snapshot (``snapshot_every > 0``), taken from the history at the start of
      every epoch ``e`` with ``e % snapshot_every == 0``;
    * else ``hist``, a second buffer: the previous epoch's values (swapped in at the end
      of the epoch) or, with ``momentum``, their moving average; it exists when momentum
      is on or when recompute needs the history to outlive the forward phase;
    * else ``cur`` itself, whose not-yet-recomputed rows still hold last epoch's values.

    ``grad`` (n_src, d): gradients waiting for their chunk's backward (None when unneeded).
    """

    def __init__(self, n: int, d: int, *, device, dtype, momentum: float = 0.0, snapshot_every: int = 0,
                 keep_history: bool = False, grad_buffer: bool = True):
        z = lambda: torch.zeros(n, d, device=device, dtype=dtype)  # noqa: E731
        self.momentum, self.snapshot_every = float(momentum), int(snapshot_every)
        self.cur = z()
        self.hist: Optional[Tensor] = z() if (keep_history or momentum > 0) else None
        self.snap: Optional[Tensor] = z() if snapshot_every > 0 else None
        self.grad: Optional[Tensor] = z() if grad_buffer else None

    def fill(self, values: Tensor) -> None:
        """Set every buffer of values to ``values`` (the warm start)."""
        for t in (self.cur, self.hist, self.snap):
            if t is not None:
                t.copy_(values)

    def latest(self) -> Tensor:
        """The most recent complete history (at an epoch's start)."""
        return self.hist if self.hist is not None else self.cur

    def stale(self) -> Tensor:
        if self.snap is not None:
            return self.snap
        return self.latest()

    def begin_epoch(self, epoch: int) -> None:
        if self.snap is not None and epoch % self.snapshot_every == 0 and epoch > 0:
            self.snap.copy_(self.latest())  # epoch 0's snapshot is the warm start

    def end_epoch(self) -> None:
        if self.hist is None:
            return
        if self.momentum > 0:
            self.hist.mul_(self.momentum).add_(self.cur, alpha=1.0 - self.momentum)
        else:  # cur is rewritten row by row next epoch: recycle the old history's memory
            self.hist, self.cur = self.cur, self.hist


@dataclass(eq=False)
class Chunk:
    """One chunk of a way (or the way's whole block, for the exact passes) as a stage reads it."""

    start: int  # rows [start, end) of the way's source space
    end: int
    block: Block  # its rows against its own rows, then its halo rows
    halo: Tensor  # (M_c,) its halo rows' positions in the way's source space
    halo_step: Tensor  # (M_c,) the local chunk index (the step) of each halo row's owner
    plan: Optional[HaloPlan]  # the G-way exchange of this step (None: one way)
    n_inner: int = 0  # rows [0, n_inner) read own rows only (overlap with the exchange)
    inner: Optional[Block] = None
    boundary: Optional[Block] = None
    whole_way: bool = False  # the chunk is the way: its source rows are the way's, in order

    def split(self, n_inner: int) -> "Chunk":
        if 0 < n_inner:
            self.n_inner = n_inner
            self.inner, self.boundary = split_block(self.block, n_inner, self.end - self.start)
        return self


@dataclass(eq=False)
class WayData:
    """What a worker loads of its way (``LayoutEngine._load``): the way's block of chunks against
    its source space (own rows, then the way's halo ``H_g``) and the data its stage reads."""

    chunks: list[Chunk]  # per chunk its block, halo positions, halo owners' steps, exchange plan
    whole: Chunk  # the way's whole block (the exact passes; no block: one way, run chunk by chunk)
    halo: np.ndarray  # H_g: the halo's node ids, sorted, grouped by owner way
    features: Optional[Tensor] = None  # stage 0: the source space's input features (own rows; the halo's
    #                                    too once fetched at set-up, ``graph_parallel.cache_input_halo``)
    labels: Optional[Tensor] = None  # the last stage: the own rows' labels
    masks: Optional[dict] = None  # the last stage: the own rows' split masks

    @property
    def n_own(self) -> int:
        return self.whole.end - self.whole.start


class HaloSource(abc.ABC):
    """Where conv ``l``'s halo rows of a chunk come from, chosen once per conv at set-up
    (:meth:`Stage._source`). ``send`` starts what goes out before the chunk's inner rows are
    aggregated (None: nothing); ``receive`` completes it and returns the halo rows (None: the
    chunk has none, or its own rows already are the whole source space). ``fresh``: which of the
    chunk's halo rows are read from this epoch (None: all of them)."""

    def send(self, ch: Chunk, rows: Tensor):
        return None

    @abc.abstractmethod
    def receive(self, ch: Chunk, work, clock, fresh: Optional[Tensor]) -> Optional[Tensor]:
        ...


class Given(HaloSource):
    """Rows handed in: recompute's rebuild (the rows the chunk's forward read, nothing exchanged
    again) and the exact pass chunk by chunk (rows of the one way's input). ``None``: no halo."""

    def __init__(self, rows: Optional[Tensor]):
        self.rows = rows

    def receive(self, ch, work, clock, fresh):
        return self.rows


#: a conv with nothing outside its chunk (one way of one chunk: the chunk is the graph)
NO_HALO = Given(None)


class Cached(HaloSource):
    """Conv 0's halo rows from stage 0's input of the source space (``h0``: the features, own rows
    then the halo's fetched once at set-up, or the encoder's output on them): never stale. None
    where the chunk is the way, whose own rows are then read as the whole source space."""

    def __init__(self, h0: Tensor):
        self.h0 = h0

    def receive(self, ch, work, clock, fresh):
        if ch.whole_way or not ch.halo.numel():
            return None
        return self.h0.index_select(0, ch.halo)


class FromHistory(HaloSource):
    """Conv ``l``'s halo rows from this way's buffers: this epoch's rows where fresh, the
    history (or snapshot) elsewhere."""

    def __init__(self, hist: History):
        self.hist = hist

    def receive(self, ch, work, clock, fresh):
        return self.read(ch, fresh)

    def read(self, ch: Chunk, fresh: Optional[Tensor]) -> Optional[Tensor]:
        if not ch.halo.numel():
            return None
        st = self.hist
        stale = st.stale()
        if stale is st.cur or fresh is None:
            return st.cur.index_select(0, ch.halo)
        return torch.where(fresh[:, None], st.cur.index_select(0, ch.halo), stale.index_select(0, ch.halo))


class Exchanged(HaloSource):
    """The ``G`` ways exchange the rows of this step's chunks that the other ways' halos list (one
    all-to-all in the graph group, op ``op``): the chunk is the way, the halo is what arrives.
    The rows sent are those the conv reads: its input, or its projected rows on the narrow side."""

    def __init__(self, comm, group, op: str):
        self.comm, self.group, self.op = comm, group, op

    def send(self, ch, rows):
        plan = ch.plan
        return self.comm.all_to_all_rows(rows.detach().index_select(0, plan.send_index), plan.send_rows,
                                         plan.recv_rows, self.group, op=self.op, async_op=True)

    def arrived(self, work, clock) -> Tensor:
        return clock.wait(work, "comm") if clock is not None else self.comm.wait(work)

    def receive(self, ch, work, clock, fresh):
        return self.arrived(work, clock)


class ExchangedIntoHistory(Exchanged):
    """Several chunks per way: what arrives are the other ways' rows of this step, fresh for this
    chunk and the later ones: written into the buffer, and the halo read from it."""

    def __init__(self, comm, group, op: str, hist: History):
        super().__init__(comm, group, op)
        self.history = FromHistory(hist)

    def receive(self, ch, work, clock, fresh):
        self.history.hist.cur[ch.plan.recv_pos] = self.arrived(work, clock)
        return self.history.read(ch, fresh)


@dataclass(eq=False)
class EpochState:
    """What one epoch's actions share."""

    order: list[int]  # forward order of the way's chunks (local indices)
    fresh: dict = field(default_factory=dict)  # chunk -> which of its halo rows are fresh (bool, (M_c,))
    scale: dict = field(default_factory=dict)  # chunk -> grad_correction's factor for its fresh halo rows
    rng: dict = field(default_factory=dict)  # (conv, chunk) -> RNG state, for recompute
    saved: dict = field(default_factory=dict)  # chunk -> what its backward needs
    pending: dict = field(default_factory=dict)  # (conv, chunk) -> the halo gradients' exchange in flight
    loss: Optional[Tensor] = None  # the last stage's loss sum (float64, no host sync per chunk)
    h0_graph: Optional[Tensor] = None  # the encoder's output with its graph (stage 0)


class _Hook(torch.autograd.Function):
    """Identity on a chunk's rows whose backward hands their gradient to ``on_grad`` and returns
    what it returns. Two uses: a *tap* on a conv's halo rows (``on_grad`` routes their gradient
    to the buffer and starts the exchange back as soon as autograd has it, before the inner rows'
    backward, and returns None: the rows are not a parameter) and a *join* on its own rows
    (``on_grad`` adds, once every use of them is back-propagated, what other chunks left in the
    buffer and what the other ways sent back). ``on_grad`` is dropped once called: a closure kept
    on a node of the graph it refers to is a cycle through autograd's C++ nodes, which Python's
    collector cannot free."""

    @staticmethod
    def forward(ctx, rows: Tensor, on_grad) -> Tensor:
        ctx.on_grad = on_grad
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad: Tensor):
        on_grad, ctx.on_grad = ctx.on_grad, None
        return on_grad(grad), None


class Stage:
    """Stage ``stage`` of way ``way``: its modules (``owned``, under the single-process names),
    its buffers, ``forward(chunk)`` / ``backward(chunk)`` and the exact pass."""

    def __init__(self, gnn, way: WayData, *, layers: list[int], first: bool, last: bool, comm, group,
                 cfg: RunConfig, n_train: int, device):
        """``gnn``: the whole model (the stage keeps its ``layers``' convs, stage 0 the encoder, the
        last the decoder); ``way``: what the worker loaded; ``comm`` / ``group``: the communicator
        and the graph group (None: one way); ``cfg``: the run (its ``pipeline`` techniques,
        ``graph_parallel`` switches and dtype); ``n_train``: the training rows of the whole graph."""
        self.layers, self.first, self.last = layers, first, last
        self.chunks, self.whole = way.chunks, way.whole  # the way's chunks; its whole block (exact passes)
        self.n_own = way.n_own
        self.comm, self.group, self.pc = comm, group, cfg.pipeline
        gp = cfg.graph_parallel
        self.overlap, self.cache_input = bool(gp.overlap), bool(gp.cache_input_halo)
        self.device, self.dtype = device, DTYPES[cfg.training.dtype]
        self.labels, self.masks, self.n_train = way.labels, way.masks, n_train
        pc, dtype, x_src = self.pc, self.dtype, way.features
        self.dims, self.out_dims = gnn.exchange_dims(), gnn.conv_out_dims()
        self.needs_x0, self.has_encoder = gnn.needs_x0, gnn.encoder is not None
        self.x0_dim = self.dims[0] if self.needs_x0 else 0
        self.encoder = gnn.encoder if first else None
        self.decoder = gnn.decoder if last else None
        self.convs = {l: gnn.convs[l] for l in layers}
        self.owned: list[tuple[str, torch.nn.Module]] = (
            ([("encoder", self.encoder)] if self.encoder is not None else [])
            + [(f"convs.{l}", self.convs[l]) for l in layers]
            + ([("decoder", self.decoder)] if self.decoder is not None else []))
        # one way of several chunks has no whole block (the exact passes go chunk by chunk)
        self.n_src = self.whole.block.n_src if self.whole.block is not None else self.n_own
        self.buffered = len(self.chunks) > 1
        # the narrow side (docs/DESIGN.md §4): with nothing buffered, a conv whose kind declares a
        # narrower halo width exchanges its projected rows (the owner applies the map first)
        self.halo_dims = list(self.dims) if self.buffered else gnn.halo_dims()
        self.narrow = {l for l in layers if self.halo_dims[l] < self.dims[l] and self._exchanges(l)}
        keep_history = pc.recompute and pc.snapshot_every == 0
        self.hist: dict[int, History] = {
            l: History(self.n_src, self.dims[l], device=device, dtype=dtype, momentum=pc.momentum,
                       snapshot_every=pc.snapshot_every, keep_history=keep_history)
            for l in layers if l > 0 and self.buffered}
        self.x_src = x_src  # stage 0: the input features of the source space (own rows only, uncached)
        if first and layers:
            if self.has_encoder:
                self.h0 = torch.zeros(x_src.shape[0], self.dims[0], device=device, dtype=dtype)
                self.g0 = torch.zeros_like(self.h0)
            else:
                self.h0 = x_src
        if self.needs_x0 and not first:
            self.x0buf = torch.zeros(self.n_own, self.x0_dim, device=device, dtype=dtype)
        # each conv's halo source, chosen once: the training chunks', and the exact pass's (the
        # way's whole block: nothing buffered; one way of several chunks passes its rows, Given)
        self.sources = {l: self._source(l, "halo", self.buffered) for l in layers}
        self.exact_sources = {l: self._source(l, "control", False) for l in layers}
        # the convs whose inner rows are aggregated while the halo is in flight (a rebuild too:
        # the same split, the same floating-point result)
        self.overlapped = {l for l in layers if self._exchanges(l) and self.overlap}

    # ------------------------------------------------------------------ helpers
    def train_mode(self, on: bool) -> None:
        for _, m in self.owned:
            m.train(on)

    def _rng_state(self):
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    @contextlib.contextmanager
    def _replay(self, state):
        """Run under a saved RNG state (same dropout masks), leaving the global RNG untouched."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(state[0])
            if state[1] is not None:
                torch.cuda.set_rng_state(state[1], self.device)
            yield

    def in_width(self) -> int:
        """Values per row this stage receives: its first conv's input (and x0)."""
        return self.dims[self.layers[0]] + self.x0_dim

    def out_width(self) -> int:
        return self.out_dims[self.layers[-1]] + self.x0_dim

    def _exchanges(self, l: int) -> bool:
        """Conv ``l``'s halo rows come from the other ways at each step (not a buffer of inputs)."""
        return self.group is not None and (l > 0 or not self.cache_input)

    def _source(self, l: int, op: str, buffered: bool) -> HaloSource:
        """Where conv ``l``'s halo rows come from (op ``op`` for what is exchanged)."""
        if self._exchanges(l):
            if buffered:
                return ExchangedIntoHistory(self.comm, self.group, op, self.hist[l])
            return Exchanged(self.comm, self.group, op)
        if l == 0:
            return Cached(self.h0)
        return FromHistory(self.hist[l]) if buffered else NO_HALO

    def _halo_grads(self, l: int) -> bool:
        """Conv ``l``'s input takes a gradient (raw features do not)."""
        return l > 0 or self.has_encoder

    def _chunk_loss(self, out: Tensor, ch: Chunk) -> Tensor:
        s, e = ch.start, ch.end
        logits = out if self.decoder is None else self.decoder(out)
        return ce_sum(logits, self.labels[s:e], self.masks["train"][s:e]) / self.n_train

    # ------------------------------------------------------------------ one (conv, chunk)
    def _conv(self, l: int, ch: Chunk, own: Tensor, x0: Optional[Tensor], source: HaloSource, *, clock=None,
              fresh: Optional[Tensor] = None, tap=None, join=None) -> tuple[Tensor, Optional[Tensor]]:
        """Conv ``l`` on chunk ``ch`` from its own input rows ``own`` (and ``x0``, its residual rows)
        and the halo rows ``source`` gives (``fresh``: which are this epoch's, for the buffers;
        ``clock``: where waiting is counted, None in the exact passes): returns its output and the
        halo rows it read. ``tap`` routes the halo rows' gradient (None: no gradient wanted); the
        inner rows are aggregated while an exchange is in flight (``self.overlapped``). A narrow
        conv (``self.narrow``) projects its own rows first (``z``, joined by ``join``), sends and
        reads projected rows, and aggregates those (``z_src``): the same maths, the narrow side on
        the wire."""
        conv, n = self.convs[l], ch.end - ch.start
        z = None
        if l in self.narrow:
            z = conv.project(own)  # (n_c, halo_dims[l])
            if join is not None:
                z = _Hook.apply(z, join)
        work = source.send(ch, own if z is None else z)
        ni = ch.n_inner if l in self.overlapped else 0
        outs = []
        narrow = {} if z is None else {"z_src": z}
        if ni:  # these rows need no halo: aggregate them while it is in flight
            outs.append(conv(own, ch.inner, None if x0 is None else x0[:ni], **narrow))
        halo = read = source.receive(ch, work, clock, fresh)
        if halo is not None and tap is not None:
            halo = _Hook.apply(halo.detach().requires_grad_(), tap)  # the tap
        if ni < n:
            blk, x0b = ch.boundary if ni else ch.block, None if x0 is None else (x0[ni:] if ni else x0)
            if z is None:
                src = own if halo is None else torch.cat([own, halo])  # (n_c + M_c, d_l)
                outs.append(conv(src, blk, x0b))
            else:  # the destination rows are own rows; the sources arrive projected
                outs.append(conv(own, blk, x0b, z_src=z if halo is None else torch.cat([z, halo])))
        return (outs[0] if len(outs) == 1 else torch.cat(outs)), read

    def _source0(self, ch: Chunk) -> Tensor:
        """Conv 0's own rows on stage 0: the features or the encoder's output (the whole
        source space when the chunk is the way and the halo is cached: one tensor, reused)."""
        if ch.whole_way and self.cache_input:
            return self.h0
        return self.h0[ch.start:ch.end]

    # ------------------------------------------------------------------ training
    def begin_epoch(self, epoch: int, seed: int) -> EpochState:
        c = len(self.chunks)
        order = chunk_order(c, epoch, seed, self.pc.shuffle_chunks)
        ep = EpochState([int(j) for j in order], loss=torch.zeros((), dtype=torch.float64, device=self.device))
        if self.buffered:
            pos = np.empty(c, dtype=np.int64)
            pos[order] = np.arange(c)
            pos_t = torch.as_tensor(pos).to(self.device)
            for j, ch in enumerate(self.chunks):
                # fresh: the halo rows whose chunk comes earlier in the order (read fresh, gradient
                # delivered in time) or at the same step (another way's chunk, exchanged just now)
                p_halo = pos_t.index_select(0, ch.halo_step)
                me = int(pos[j])
                ep.fresh[j] = p_halo <= me
                if self.pc.grad_correction:  # earlier steps: grad_scale; the same step: always delivered
                    scale = torch.where(p_halo < me, self.pc.grad_scale, 1.0).to(self.dtype)
                    ep.scale[j] = scale[p_halo <= me][:, None]
        for st in self.hist.values():
            st.begin_epoch(epoch)
        if self.first and self.has_encoder and self.layers:  # the encoder on every row, once per epoch
            if self.pc.recompute:
                ep.rng["enc"] = self._rng_state()
                with torch.no_grad():
                    self.h0.copy_(self.encoder(self.x_src))
            else:
                ep.h0_graph = self.encoder(self.x_src)
                self.h0.copy_(ep.h0_graph.detach())
            self.g0.zero_()
        return ep

    def _inputs(self, ch: Chunk, payload: Optional[Tensor]):
        """The chunk's input rows of this stage's first conv (None in a rebuild where a buffer
        holds them), and its x0 rows."""
        a = self.layers[0]
        if self.first:
            return self._source0(ch), (self.h0[ch.start:ch.end] if self.needs_x0 else None)
        own = None
        if payload is not None:
            if self.needs_x0:
                self.x0buf[ch.start:ch.end] = payload[:, self.dims[a]:]
            own = payload[:, :self.dims[a]]
        elif a in self.hist:  # a rebuild (recompute): the rows were written to the buffer
            own = self.hist[a].cur[ch.start:ch.end]
        return own, (self.x0buf[ch.start:ch.end] if self.needs_x0 else None)

    def _run(self, j: int, ch: Chunk, ep: EpochState, h: Tensor, x0_rows: Optional[Tensor], *, grad: bool,
             clock, rebuild: Optional[dict] = None):
        """The chunk through this stage's convs as one graph: from its input rows (a leaf, whose
        gradient goes to the previous stage or the encoder) to its output, each conv's own rows
        joined with what reaches them from elsewhere (buffered gradients, the other ways' answer)
        and its halo rows tapped. Returns the input leaf, each conv's x0 leaf, the output, the
        loss (last stage) and each conv's halo rows (what recompute's rebuild reads).
        ``rebuild`` (recompute's backward): each conv's halo rows as the forward read them; each
        conv runs under the RNG state its forward drew, on those rows (``Given``: nothing is
        exchanged again), and writes no buffer."""
        record = self.pc.recompute and rebuild is None
        leaf = h.detach().requires_grad_() if grad and self._halo_grads(self.layers[0]) else h
        h, x0s, halos = leaf, [], {}
        for l in self.layers:
            if l in self.hist and rebuild is None:
                self.hist[l].cur[ch.start:ch.end] = h.detach()
            if record:
                ep.rng[(l, j)] = self._rng_state()
            with (self._replay(ep.rng.pop((l, j))) if rebuild is not None else contextlib.nullcontext()):
                join = None
                if grad and self._halo_grads(l) and (self._exchanges(l) or l in self.hist):
                    join = self._joiner(l, j, ch, ep, clock)
                    if l not in self.narrow:  # a narrow conv joins on its projected own rows
                        h, join = _Hook.apply(h, join), None  # the join
                x0 = None
                if x0_rows is not None:  # a leaf per conv; stage 0's rows of h0 are not written in the
                    # epoch (a view will do), later stages' x0buf is, chunk by chunk (a copy)
                    x0 = (x0_rows.detach() if self.first else x0_rows.clone()).requires_grad_() if grad else x0_rows
                source = self.sources[l] if rebuild is None else Given(rebuild[l])
                tap = self._router(l, j, ch, ep) if grad and self._halo_grads(l) else None
                h, halos[l] = self._conv(l, ch, h, x0, source, clock=clock, fresh=ep.fresh.get(j), tap=tap,
                                         join=join)
                x0s.append(x0)
        loss = self._chunk_loss(h, ch) if self.last else None
        return leaf, x0s, h, loss, halos

    def forward(self, j: int, ep: EpochState, payload: Optional[Tensor], clock) -> Optional[Tensor]:
        """Chunk ``j`` through this stage's convs; returns what goes to the next stage."""
        ch, recompute = self.chunks[j], self.pc.recompute
        if not self.layers:  # no graph layer (mlp, graph mode): the per-node model on own rows
            loss = self._chunk_loss(self.encoder(self.x_src[ch.start:ch.end]), ch)
            ep.loss += loss.detach()
            ep.saved[j] = (None, [], None, loss)
            return None
        h, x0_rows = self._inputs(ch, payload)
        with torch.set_grad_enabled(not recompute):
            leaf, x0s, out, loss, halos = self._run(j, ch, ep, h, x0_rows, grad=not recompute, clock=clock)
        if loss is not None:
            ep.loss += loss.detach()
        # recompute keeps what no buffer holds: the input rows and each conv's halo rows
        ep.saved[j] = (None if self.buffered else h, halos) if recompute else (leaf, x0s, out, loss)
        if self.last:
            return None
        return torch.cat([out.detach(), x0_rows], dim=1) if self.needs_x0 else out.detach()

    def _router(self, l: int, j: int, ch: Chunk, ep: EpochState):
        """What conv ``l`` of chunk ``j`` does with its halo rows' gradient: into the buffers (rows
        of this way: the fresh ones, scaled, or all of them) and, for this step's rows of other
        ways, back to their owners at once (the exchange's adjoint)."""
        exchange = self._exchanges(l)

        def on_grad(g: Tensor) -> None:
            if l == 0 and not exchange:  # the encoder's output, back-propagated at the end
                self.g0.index_add_(0, ch.halo, g)
                return
            if self.buffered:
                st = self.hist[l]
                if self.pc.grad_correction:  # historical rows: dropped; fresh rows: scaled
                    fresh = ep.fresh[j]
                    st.grad.index_add_(0, ch.halo[fresh], g[fresh] * ep.scale[j])
                else:  # fresh rows: delivered this epoch; historical rows: next epoch
                    st.grad.index_add_(0, ch.halo, g)
                if not exchange:
                    return
                pos = ch.plan.recv_pos
                g = st.grad.index_select(0, pos)
                st.grad[pos] = 0
            ep.pending[(l, j)] = self.comm.all_to_all_rows(g.contiguous(), ch.plan.recv_rows, ch.plan.send_rows,
                                                           self.group, op="halo", async_op=True)
        return on_grad

    def _joiner(self, l: int, j: int, ch: Chunk, ep: EpochState, clock):
        """What reaches conv ``l``'s own input rows of chunk ``j`` besides its own backward: what
        other chunks left in the gradient buffer (and it is taken out), and what the other ways
        sent back for the rows of this step they read."""
        st = self.hist.get(l)

        def on_grad(g: Tensor) -> Tensor:
            if st is not None:
                g = g + st.grad[ch.start:ch.end]  # (n_c, d_l); a chunk's halo never holds its own rows
                st.grad[ch.start:ch.end] = 0
            if self._exchanges(l):
                work = ep.pending.pop((l, j), None)
                if work is None:  # the halo was not on the path to the loss: answer with zeros
                    zeros = g.new_zeros((sum(ch.plan.recv_rows), g.shape[1]))
                    work = self.comm.all_to_all_rows(zeros, ch.plan.recv_rows, ch.plan.send_rows, self.group,
                                                     op="halo", async_op=True)
                back = clock.wait(work, "comm")
                g = g.index_add(0, ch.plan.send_index, back)
            return g
        return on_grad

    def backward(self, j: int, ep: EpochState, g_payload: Optional[Tensor], clock) -> Optional[Tensor]:
        """Chunk ``j`` back through this stage's convs (one backward of its graph); returns what
        goes to the previous stage (the gradients of its input rows, and of x0's)."""
        ch = self.chunks[j]
        if self.pc.recompute and self.layers:  # rebuild the chunk's graph, each conv with its RNG state
            kept_input, halos = ep.saved.pop(j)
            h, x0_rows = self._inputs(ch, None)
            leaf, x0s, out, loss, _ = self._run(j, ch, ep, h if kept_input is None else kept_input, x0_rows,
                                                grad=True, clock=clock, rebuild=halos)
        else:
            leaf, x0s, out, loss = ep.saved.pop(j)
        gx0 = None
        if loss is not None:
            loss.backward()
        else:
            d = self.out_dims[self.layers[-1]]
            out.backward(g_payload[:, :d])
            gx0 = g_payload[:, d:].clone() if self.needs_x0 else None
        for x0 in reversed(x0s):  # the residual's gradient, conv by conv from the top
            if x0 is not None:
                gx0 = x0.grad if gx0 is None else gx0.add_(x0.grad)
        if not self.first:
            return torch.cat([leaf.grad, gx0], dim=1) if self.needs_x0 else leaf.grad
        if self.layers and leaf.grad is not None:  # conv 0's rows: the encoder's output
            if ch.whole_way and self.cache_input:
                self.g0 += leaf.grad
            else:
                self.g0[ch.start:ch.end] += leaf.grad
        if self.needs_x0:
            self.g0[ch.start:ch.end] += gx0  # x0 is the encoder's output too
        return None

    def end_backward(self, ep: EpochState) -> None:
        """Stage 0: the encoder's backward, with every chunk's contribution to its output."""
        if self.first and self.has_encoder and self.layers:
            if self.pc.recompute:
                with self._replay(ep.rng.pop("enc")):
                    ep.h0_graph = self.encoder(self.x_src)
            ep.h0_graph.backward(self.g0)

    def end_epoch(self) -> None:
        for st in self.hist.values():
            st.end_epoch()

    # ------------------------------------------------------------------ exact passes
    @torch.no_grad()
    def exact_forward(self, h: Optional[Tensor], x0: Optional[Tensor], fill: bool) -> tuple[Tensor, Optional[Tensor]]:
        """The way's whole block through this stage's convs (dropout off, op ``control``); ``h``,
        ``x0``: the previous stage's output rows (None on stage 0). ``fill``: write every conv
        input into the buffers (the warm start). Returns the output rows (logits on the last
        stage) and x0."""
        was = [m.training for _, m in self.owned]
        self.train_mode(False)
        try:
            if self.first:
                src0 = self.x_src if self.encoder is None else self.encoder(self.x_src)  # (n_src or n_own, d_0)
                h = src0[:self.n_own]
                x0 = h if self.needs_x0 else None
            for l in self.layers:
                own = src0 if (l == 0 and self.cache_input) else h
                if self.whole.block is None:
                    out, halo = self._exact_by_chunks(l, own, x0), None
                else:
                    out, halo = self._conv(l, self.whole, own, x0, self.exact_sources[l])
                if fill and l in self.hist:
                    self.hist[l].fill(torch.cat([h, halo]) if halo is not None else h)
                h = out
        finally:
            for (_, m), w in zip(self.owned, was):
                m.train(w)
        if self.last and self.decoder is not None:
            h = self.decoder(h)
        return h, x0

    def _exact_by_chunks(self, l: int, h: Tensor, x0: Optional[Tensor]) -> Tensor:
        """Conv ``l`` on one way's every row, chunk after chunk (one way: ``h`` holds every source
        row, a chunk's halo rows are rows of ``h``, its own rows a slice): the whole block's output
        without a second copy of the graph's structure."""
        z = self.convs[l].project(h) if l in self.narrow else None  # the rows a narrow conv reads
        outs = []
        for ch in self.chunks:
            halo = (h if z is None else z).index_select(0, ch.halo)
            out, _ = self._conv(l, ch, h[ch.start:ch.end], None if x0 is None else x0[ch.start:ch.end], Given(halo))
            outs.append(out)
        return torch.cat(outs)

    # ------------------------------------------------------------------ state
    def local_state_dict(self) -> "OrderedDict[str, Tensor]":
        out = OrderedDict()
        for prefix, m in self.owned:
            for k, v in m.state_dict().items():
                out[f"{prefix}.{k}"] = v.detach()
        return out

    #: the buffers of a ``History`` that carry over from epoch to epoch
    BUFFERS = ("cur", "hist", "snap", "grad")

    def buffer_state(self) -> dict:
        out = {"buffers": {l: {k: getattr(st, k) for k in self.BUFFERS if getattr(st, k) is not None}
                           for l, st in self.hist.items()}}
        if self.needs_x0 and not self.first:
            out["x0buf"] = self.x0buf
        return out

    def load_buffer_state(self, state: dict) -> None:
        targets = [(f"buffers.{l}.{k}", getattr(st, k), state["buffers"].get(l, {}).get(k))
                   for l, st in self.hist.items() for k in self.BUFFERS]
        if self.needs_x0 and not self.first:
            targets.append(("x0buf", self.x0buf, state.get("x0buf")))
        for name, t, saved in targets:
            if (t is None) != (saved is None) or (t is not None and t.shape != saved.shape):
                raise ValueError(f"{name}: {None if saved is None else tuple(saved.shape)} in the checkpoint, "
                                 f"{None if t is None else tuple(t.shape)} here")
            if t is not None:
                t.copy_(saved)
