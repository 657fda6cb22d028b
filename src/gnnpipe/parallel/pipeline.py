r"""GNNPipe: pipelined layer-level model parallelism over graph chunks (docs/DESIGN.md §4).

``S`` processes, one per **stage**; stage ``s`` owns a contiguous block of convs
(``balance.py`` chooses it; stage 0 also runs the encoder, the last stage the decoder
and the loss). The graph is cut into ``C`` **chunks** (the chunk store's parts:
METIS, contiguous new ids). Launch, e.g. 4 stages on one node::

    torchrun --standalone --nproc-per-node 4 -m gnnpipe.cli train --run-config run.yaml

**Buffers.** For every conv ``l`` it owns, a stage keeps a whole-graph buffer of that
conv's *input* (``N`` rows of ``exchange_dims()[l]`` values). Stage 0's first buffer is
the input features (no encoder) or the encoder's output, recomputed for the whole graph
at the start of each epoch from the local features: those never cross the wire and are
never stale. A chunk ``c`` aggregates its own rows and its **halo** (the rows of other
chunks with an edge into ``c``): a halo row whose chunk has already been computed this
epoch is *fresh*, the rest are *historical* (see "Where stale rows come from").

**One epoch** (GPipe): the forwards of all chunks, in this epoch's chunk order, flow
through the stages (stage ``s`` computes chunk ``c`` while stage ``s+1`` computes the
chunk before it: every receive is posted ahead, every send is asynchronous); then the
backwards in the reverse order; then one optimizer step with the gradients of all
chunks summed (weights are never stale). Between stages travel only the chunk's rows
(forward) and their gradients (backward), point to point; for GCNII the chunk's rows of
the initial residual ``x0`` travel with them (and their gradients back). Bytes per
epoch, over all ranks: ``sum_{s>=1} 2 N (d_s + d_x0) b``, i.e. ``2 (S-1) N H b``
(doubled for GCNII), with ``d_s`` the input width of stage ``s``'s first conv and ``b``
bytes per value: independent of ``L``, of the edges and of the cut. The loss of chunk
``c`` is the *sum* of its training nodes' cross-entropy over the *global* training
count, so the chunks' gradients add up to the whole graph's.

**Backward, layer by layer.** Each (conv, chunk) is its own small autograd graph, from
leaf inputs (the chunk's rows and halo rows gathered from the buffer) to the chunk's
output rows. Back-propagating chunk ``c`` through conv ``l`` gives gradients for the
chunk's own input rows and for its halo rows. The halo rows' gradients belong to other
chunks: they are added to conv ``l``'s *gradient buffer* (``N`` rows) and delivered
when that chunk is back-propagated through conv ``l`` (added to its own-row gradient).
With ``C = 1`` there is no halo and the epoch is exactly single-process training
(``C = 1`` is accepted for any ``S``: plain model parallelism, the exactness
configuration; otherwise ``C >= S``, or some stage would idle all epoch).

Why this order works: chunk ``c`` read chunk ``c'``'s row fresh iff ``c'`` came earlier
in the forward order, and ``c'`` is back-propagated after ``c`` iff it came earlier in
the forward order (backward runs in reverse). So exactly the *fresh* dependencies can
deliver their gradient in the same epoch; a gradient for a *historical* row arrives
after that row's chunk was already back-propagated. By default such a gradient waits
in the buffer and is delivered in the next epoch (a stale gradient, the mirror image of
a stale embedding).

**Convergence techniques** (``PipelineConfig``; docs/DESIGN.md §4):

1. ``shuffle_chunks``: a new chunk order every epoch, the same on every stage
   (``numpy.random.default_rng((seed, epoch))``), so that no chunk is always the one that
   reads only historical rows.
2. ``grad_correction``: drop the gradients of historical rows (they are not carried to
   the next epoch) and multiply the gradients delivered to *fresh* halo rows by
   ``grad_scale``. Derivation: the whole-graph gradient of row ``j`` of conv ``l``'s
   input is ``sum_i A_ij^T g_i`` over its out-neighbours ``i``. The pipeline delivers the
   term of a neighbour ``i`` in another chunk iff ``chunk(j)`` precedes ``chunk(i)`` in
   the order. Under a uniformly random order (technique 1) that holds with probability
   exactly 1/2 for every pair of distinct chunks, so
   ``E[grad_scale * 1{delivered} * A_ij^T g_i] = A_ij^T g_i`` for ``grad_scale = 2``:
   together with the own-chunk terms (always delivered, not scaled) the estimate is
   unbiased in the order, instead of a stale term from the previous epoch's weights.
   (It is unbiased only up to the staleness of the ``g_i`` and of the forward values.)
   With ``grad_scale = 1`` the step is the exact gradient of the computation actually
   done, historical rows taken as constants.
3. ``snapshot_every = K``: historical rows are read from a snapshot of the history taken
   at the start of every epoch ``e`` with ``e % K == 0``, instead of from the previous
   epoch; the snapshot is one consistent model version for ``K`` epochs.
4. ``momentum = m``: PipeGCN-style smoothing: the history of a row is the moving
   average ``hist <- m hist + (1 - m) h`` of its values at the end of each epoch.

**Where stale rows come from.** Before the first epoch (``C > 1``), one exact
full-graph forward through the stages fills every buffer (and history, and snapshot)
with the initial model's embeddings (op ``control``, filed before epoch 0): epoch 0's
forward is then exact (with dropout off), where zeros would bias the first epochs.
Without techniques 3/4 and without recompute, the buffer itself is the history (a row
still holds last epoch's value until its chunk is recomputed); otherwise a second
buffer holds it.

**Recompute** (``recompute``): the forward keeps no activations (only the buffers it
writes anyway and each (conv, chunk)'s RNG state); the backward rebuilds each
(conv, chunk) graph from the buffers, one at a time, so the peak activation memory is
that of one conv on one chunk. The RNG state is restored for the rebuild (dropout draws
the same mask) and the global RNG is left as it was, so recompute gives bitwise the
result of storing.

**Evaluation** is exact: the whole graph as one chunk through the stages, no history
(op ``control``); the correct counts are all-reduced so every rank returns them.

**Time split** (``EpochStats``, this rank): ``bubble_s`` is the time blocked waiting for
a neighbour stage's rows or gradients (posted ahead, so it is idle time with nothing
to do, plus the final drain before the loss is known everywhere; it includes the
transfer of the awaited message itself, small next to a chunk's compute on loopback or
NVLink); ``comm_s`` the time blocked completing this stage's own sends; ``compute_s``
the rest of the epoch.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from ..config import RunConfig
from ..costmodel.bytes import boundary_dims, pipeline_bytes
from ..engine import DTYPES, EpochStats, ce_sum, correct_counts, make_optimizer
from ..io import GnnPipeError
from ..models.block import Block
from ..models.model import GNN
from ..store import ChunkStore, open_run_store
from .balance import StageAssignment, assign_stages
from ..layout import check_layout

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")


def check_pipeline_config(cfg: RunConfig, groups=None) -> None:
    """Refuse layouts GNNPipe cannot run, with the reason (before anything is read)."""
    where = f"run {cfg.run_id}"
    if cfg.mode != "pipeline":
        raise GnnPipeError(f"{where}: PipelineEngine runs mode 'pipeline', not {cfg.mode!r}")
    if cfg.model.kind == "mlp":
        raise GnnPipeError(f"{where}: model kind 'mlp' has no graph layers to pipeline; use mode single")
    # C = 1 is the exactness configuration (plain model parallelism, no history): allowed
    check_layout(cfg.mode, cfg.workers, cfg.stages, cfg.ways, cfg.chunks, layers=cfg.model.layers,
                 exact_ok=True, where=where)
    if not cfg.store_path:
        raise GnnPipeError(f"{where}: mode pipeline needs a chunk store (store_path)")
    check_schedule_config(cfg, groups)


def check_schedule_config(cfg: RunConfig, groups=None) -> None:
    """The checks GNNPipe and the hybrid share: the techniques' values and the process groups."""
    where = f"run {cfg.run_id}"
    pc = cfg.pipeline
    if not 0.0 <= pc.momentum < 1.0:
        raise GnnPipeError(f"{where}: pipeline.momentum must lie in [0, 1), got {pc.momentum}")
    if pc.snapshot_every < 0:
        raise GnnPipeError(f"{where}: pipeline.snapshot_every must be >= 0 (0: off), got {pc.snapshot_every}")
    if pc.grad_scale <= 0:
        raise GnnPipeError(f"{where}: pipeline.grad_scale must be > 0, got {pc.grad_scale}")
    if groups is not None and (groups.dims.stages != cfg.stages or groups.dims.ways != cfg.ways):
        raise GnnPipeError(f"{where}: process groups are laid out {groups.dims.stages} stages x "
                           f"{groups.dims.ways} ways, the run needs {cfg.stages} x {cfg.ways}")


def chunk_order(num_chunks: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """This epoch's forward order of the chunks: the same on every stage."""
    if not shuffle:
        return np.arange(num_chunks, dtype=np.int64)
    return np.random.default_rng((int(seed), int(epoch))).permutation(num_chunks).astype(np.int64)


class History:
    """The buffers behind one conv's input on one stage.

    ``cur`` (N, d): this epoch's values (a row is overwritten when its chunk is computed).
    ``stale()``: where rows of chunks not yet computed this epoch are read from:

    * the snapshot (``snapshot_every > 0``), taken from the history at the start of
      every epoch ``e`` with ``e % snapshot_every == 0``;
    * else ``hist``, a second buffer: the previous epoch's values (swapped in at the end
      of the epoch) or, with ``momentum``, their moving average; it exists when momentum
      is on or when recompute needs the history to outlive the forward phase;
    * else ``cur`` itself, whose not-yet-recomputed rows still hold last epoch's values.

    ``grad`` (N, d): gradients waiting for their chunk's backward (None when unneeded).
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
class EpochState:
    """What one epoch's phases share (public: the hybrid engine's phases take it too)."""

    order: list[int]  # forward order of the chunks
    fresh: dict  # chunk -> which of its halo rows are fresh (bool, (M_c,))
    scale: dict = field(default_factory=dict)  # chunk -> grad_correction's factor for its fresh halo rows
    rng: dict = field(default_factory=dict)  # (conv, chunk) -> RNG state, for recompute
    saved: dict = field(default_factory=dict)  # (conv, chunk) -> (h_src, x0, out) without recompute
    h0_graph: Optional[Tensor] = None  # the encoder's output with its graph (stage 0)


class EpochClock:
    """Blocked time by kind; compute is the epoch's remainder (public: the hybrid engine books
    its halo exchanges and all-reduce on it)."""

    def __init__(self, comm, device: torch.device):
        self.comm, self.cuda = comm, device.type == "cuda"
        self.device = device
        self.bubble = self.comm_s = 0.0
        self.t0 = time.perf_counter()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)  # pending kernels are compute, not waiting

    def wait(self, work, kind: str):
        self.sync()
        t = time.perf_counter()
        out = self.comm.wait(work)
        dt = time.perf_counter() - t
        if kind == "bubble":
            self.bubble += dt
        else:
            self.comm_s += dt
        return out

    def stats(self, loss: float) -> EpochStats:
        self.sync()
        wall = time.perf_counter() - self.t0
        return EpochStats(loss=loss, compute_s=max(wall - self.bubble - self.comm_s, 0.0),
                          comm_s=self.comm_s, bubble_s=self.bubble)


class PipelineEngine:
    """The GNNPipe engine of one stage (the ``Engine`` protocol of ``gnnpipe.engine``).

    Written over one *way*'s block of chunks (``my_chunks``) and its source space (own
    rows ``[A, A + n_own)`` then ``n_src - n_own`` halo rows): here ``G = 1``, the block
    is the whole graph and the source space the ``N`` new ids. ``hybrid.HybridEngine``
    overrides ``_load`` (the way's partition), ``_exchange_halo`` / ``_route`` /
    ``_halo_src`` (the ``G``-way halo exchange), ``_halo_grad_scale`` and ``_reduce_grads``.
    """

    check_config = staticmethod(check_pipeline_config)
    label = "GNNPipe"

    def __init__(self, cfg: RunConfig, groups, comm, device):
        self.check_config(cfg, groups)
        if comm is None:  # one stage, no process group: the communicator's one-rank shortcut
            from .comm import Communicator
            comm = Communicator(groups, device)
        self.cfg, self.groups, self.comm = cfg, groups, comm
        self.device = torch.device(device)
        self.dtype = DTYPES[cfg.training.dtype]
        pc = self.pc = cfg.pipeline
        self.S, self.G, self.C = cfg.stages, cfg.ways, cfg.chunks
        self.Cw = self.C // self.G  # chunks per way
        self.stage = groups.stage_index if groups is not None else 0
        self.way = groups.way_index if groups is not None else 0
        self.first, self.last = self.stage == 0, self.stage == self.S - 1
        self.prev = groups.prev_rank() if groups is not None else None
        self.next = groups.next_rank() if groups is not None else None

        store = open_run_store(cfg, self.C)
        try:
            self.N, self.E = store.num_nodes, store.num_edges
            self.in_features, self.num_classes = store.num_features, store.num_classes
            self.offsets = [int(o) for o in store.offsets]
            self._load(store)
        finally:
            store.close()

        torch.manual_seed(cfg.training.seed)  # every rank and mode starts from the same weights
        gnn = GNN(cfg.model, self.in_features, self.num_classes).to(self.device, self.dtype)
        self.dims = gnn.exchange_dims()
        self.out_dims = gnn.conv_out_dims()
        self.needs_x0 = gnn.needs_x0
        self.x0_dim = self.dims[0] if self.needs_x0 else 0
        self.has_encoder = gnn.encoder is not None

        sample = max(self.my_chunks, key=lambda c: self.blocks[c].nnz)
        self.assignment: StageAssignment = assign_stages(
            gnn, self.S, pc.balance, num_nodes=self.N, num_edges=self.E,
            sample_block=self.blocks[sample], comm=comm, dtype=self.dtype)
        a, b = self.assignment.bounds[self.stage]
        self.layers = list(range(a, b))
        if self.stage == 0 and self.way == 0:
            log.info("%s %s", self.label, self.assignment)

        # the modules this stage owns, under their single-process names
        self.full_keys = [(k, tuple(v.shape), v.dtype) for k, v in gnn.state_dict().items()]
        for k, _, _ in self.full_keys:
            self._owner(k)  # every weight has an owner stage
        self.params_per_stage = [0] * self.S
        for k, p in gnn.named_parameters():
            if p.requires_grad:
                self.params_per_stage[self._owner(k)] += p.numel()
        self.encoder = gnn.encoder if self.first else None
        self.decoder = gnn.decoder if self.last else None
        self.convs = {l: gnn.convs[l] for l in self.layers}
        self.owned: list[tuple[str, torch.nn.Module]] = (
            ([("encoder", self.encoder)] if self.encoder is not None else [])
            + [(f"convs.{l}", self.convs[l]) for l in self.layers]
            + ([("decoder", self.decoder)] if self.decoder is not None else []))
        del gnn  # the other stages' convs are not ours to keep
        self.params = [p for _, m in self.owned for p in m.parameters() if p.requires_grad]
        self.opt = make_optimizer(self.params, cfg.training)

        # buffers over the source space (own rows, then halo rows)
        keep_history = pc.recompute and pc.snapshot_every == 0
        self.hist: dict[int, History] = {}
        for l in self.layers:
            if l == 0:
                continue  # conv 0's input is never stale: features, or the encoder on all rows
            self.hist[l] = History(self.n_src, self.dims[l], device=self.device, dtype=self.dtype,
                                   momentum=pc.momentum, snapshot_every=pc.snapshot_every,
                                   keep_history=keep_history, grad_buffer=True)
        if self.first:
            if self.has_encoder:
                self.h0 = torch.zeros(self.n_src, self.dims[0], device=self.device, dtype=self.dtype)
                self.g0 = torch.zeros_like(self.h0)
            else:
                self.h0 = self.x_src
        if self.needs_x0 and not self.first:
            self.x0buf = torch.zeros(self.n_own, self.x0_dim, device=self.device, dtype=self.dtype)
        self.warm_started = self.Cw > 1
        if self.warm_started:
            self._full_pass(fill=True)

    def _load(self, store: ChunkStore) -> None:
        """The way's block: here every chunk, the source space the whole graph (new ids).

        Sets ``my_chunks``, ``A``, ``n_own``, ``n_src``; per chunk ``blocks[c]`` (against its
        own rows then its halo), ``halo[c]`` (the halo rows' positions in the source space)
        and ``halo_chunk[c]`` (their owner chunk, as an index into the way's chunk order);
        ``full_block`` (the exact passes); ``x_src`` (stage 0: the input features of the
        source space); ``labels``, ``masks``, ``n_train`` (last stage: own rows, global count).
        """
        dev = self.device
        self.my_chunks = list(range(self.C))
        self.A, self.n_own = 0, self.N
        self.n_src = self.N
        self.blocks: list[Block] = [store.local_block(c, self.dtype).to(dev) for c in range(self.C)]
        halos = [store.read_part(c, "halo") for c in range(self.C)]
        self.halo = [torch.as_tensor(h, dtype=torch.int64).to(dev) for h in halos]
        self.halo_chunk = [torch.as_tensor(store.part_of(h), dtype=torch.int64).to(dev) for h in halos]
        self.full_block = store.full_block(self.dtype).to(dev)
        # data: features on stage 0 only, labels and masks on the last stage only
        if self.first:
            self.x_src = torch.as_tensor(store.read_all("features")).to(dev, self.dtype)
        if self.last:
            self.labels = torch.as_tensor(store.read_all("labels")).to(dev)
            self.masks = {s: torch.as_tensor(store.read_all(f"{s}_mask")).to(dev) for s in SPLITS}
            self.n_train = max(int(self.masks["train"].sum()), 1)

    # ------------------------------------------------------------------ helpers
    def _owner(self, key: str) -> int:
        head = key.split(".")[0]
        if head == "encoder":
            return 0
        if head == "decoder":
            return self.S - 1
        if head == "convs":
            return self.assignment.stage_of(int(key.split(".")[1]))
        raise GnnPipeError(f"model weight {key!r} belongs to no pipeline stage (only encoder, convs "
                           f"and decoder are placed)")

    def _rows(self, c: int) -> tuple[int, int]:
        """Chunk ``c``'s rows in the source space."""
        return self.offsets[c] - self.A, self.offsets[c + 1] - self.A

    def _train_mode(self, on: bool) -> None:
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

    def _stage_in_width(self) -> int:
        return self.dims[self.layers[0]] + self.x0_dim

    def _stage_out_width(self) -> int:
        return self.out_dims[self.layers[-1]] + self.x0_dim

    def _x0_rows(self, s: int, e: int) -> Tensor:
        return (self.h0 if self.first else self.x0buf)[s:e]

    # ------------------------------------------------------------------ one (conv, chunk)
    def _layer(self, l: int, c: int, fresh: Tensor, grad: bool):
        """Conv ``l`` on chunk ``c`` from the buffers: (h_src leaf, x0 leaf, output rows)."""
        s, e = self._rows(c)
        halo = self.halo[c]
        if l == 0:
            src = self.h0
            h_src = torch.cat([src[s:e], src.index_select(0, halo)])
        else:
            st = self.hist[l]
            stale = st.stale()
            if stale is st.cur:
                halo_rows = st.cur.index_select(0, halo)
            else:
                halo_rows = torch.where(fresh[:, None], st.cur.index_select(0, halo), stale.index_select(0, halo))
            h_src = torch.cat([st.cur[s:e], halo_rows])  # (n_c + M_c, d_l)
        x0 = None
        with torch.set_grad_enabled(grad):
            if grad and (l > 0 or self.has_encoder):
                h_src.requires_grad_()
            if self.needs_x0:
                x0 = self._x0_rows(s, e)
                if grad:
                    x0 = x0.clone().requires_grad_()
            out = self.convs[l](h_src, self.blocks[c], x0)  # (n_c, out_l)
        return h_src, x0, out

    def _chunk_loss(self, out: Tensor, c: int) -> Tensor:
        s, e = self._rows(c)
        logits = out if self.decoder is None else self.decoder(out)
        return ce_sum(logits, self.labels[s:e], self.masks["train"][s:e]) / self.n_train

    # ------------------------------------------------------------------ training
    def train_epoch(self, epoch: int) -> EpochStats:
        """One GPipe epoch: all forwards, all backwards (reverse order), one optimizer step."""
        clock = EpochClock(self.comm, self.device)
        self._train_mode(True)
        self.opt.zero_grad(set_to_none=True)
        ep = self._begin_epoch(epoch)
        loss_sum = self._forward_phase(ep, clock)
        self._backward_phase(ep, clock)
        for st in self.hist.values():
            st.end_epoch()
        self._reduce_grads(clock)
        self.opt.step()
        # the loss is known on the last stage; every rank returns it (waiting here is the drain)
        loss = float(self._all_reduce_timed(loss_sum.reshape(1), clock)[0])
        return clock.stats(loss)

    def _reduce_grads(self, clock: EpochClock) -> None:
        """Sum the weight gradients over the replicas of this stage: one replica here."""

    def _begin_epoch(self, epoch: int) -> "EpochState":
        Cw = self.Cw
        order = chunk_order(Cw, epoch, self.cfg.training.seed, self.pc.shuffle_chunks)  # in the way's block
        pos = np.empty(Cw, dtype=np.int64)
        pos[order] = np.arange(Cw)
        pos_t = torch.as_tensor(pos).to(self.device)
        base = self.way * Cw
        ep = EpochState([base + int(j) for j in order], {})
        for c in self.my_chunks:
            # fresh: the halo rows whose chunk comes earlier in the order (read fresh, gradient
            # delivered in time); equal position: another way's chunk of the same step (hybrid)
            p_halo = pos_t.index_select(0, self.halo_chunk[c])
            me = int(pos[c - base])
            ep.fresh[c] = p_halo <= me
            if self.pc.grad_correction:
                ep.scale[c] = self._halo_grad_scale(p_halo, me)
        for st in self.hist.values():
            st.begin_epoch(epoch)
        if self.first and self.has_encoder:  # the encoder on every row, once per epoch
            if self.pc.recompute:
                ep.rng["enc"] = self._rng_state()
                with torch.no_grad():
                    self.h0.copy_(self.encoder(self.x_src))
            else:
                ep.h0_graph = self.encoder(self.x_src)
                self.h0.copy_(ep.h0_graph.detach())
            self.g0.zero_()
        return ep

    def _halo_grad_scale(self, p_halo: Tensor, me: int):
        """``grad_correction``'s factor for the gradients of a chunk's fresh halo rows: every one
        belongs to an earlier chunk, so ``grad_scale`` (see the module doc)."""
        return self.pc.grad_scale

    def _post_recvs(self, chunks: list[int], src: int, width: int, op: str, tag0: int) -> dict:
        """Post every receive of a phase up front (into fresh buffers, not the embedding buffers:
        a row must not turn fresh while an earlier chunk may still read its history)."""
        works = {}
        for c in chunks:
            s, e = self._rows(c)
            buf = torch.empty(e - s, width, device=self.device, dtype=self.dtype)
            works[c] = self.comm.irecv(buf, src, op=op, tag=tag0 + c)
        return works

    def _forward_phase(self, ep: "EpochState", clock: EpochClock) -> Tensor:
        """Every chunk through this stage's convs, in order; returns the last stage's loss sum."""
        recompute = self.pc.recompute
        recvs = {} if self.first else self._post_recvs(ep.order, self.prev, self._stage_in_width(),
                                                       "pipeline_fwd", 0)
        sends = []
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # no host sync per chunk
        a = self.layers[0]
        for c in ep.order:
            s, e = self._rows(c)
            if not self.first:
                payload = clock.wait(recvs.pop(c), "bubble")  # (n_c, d_a [+ d_x0])
                self.hist[a].cur[s:e] = payload[:, :self.dims[a]]
                if self.needs_x0:
                    self.x0buf[s:e] = payload[:, self.dims[a]:]
            with torch.set_grad_enabled(not recompute):
                for l in self.layers:
                    if l > 0:
                        self._exchange_halo(l, c, clock)
                    if recompute:
                        ep.rng[(l, c)] = self._rng_state()
                    h_src, x0, out = self._layer(l, c, ep.fresh[c], grad=not recompute)
                    if l + 1 in self.convs:
                        self.hist[l + 1].cur[s:e] = out.detach()
                    if not recompute:
                        ep.saved[(l, c)] = (h_src, x0, out)
                if self.last:
                    loss = self._chunk_loss(out, c)
                    loss_sum += loss.detach()
                    if not recompute:
                        ep.saved[("loss", c)] = loss
            if not self.last:
                parts = [out.detach()] + ([self._x0_rows(s, e)] if self.needs_x0 else [])
                payload = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
                sends.append(self.comm.isend(payload, self.next, op="pipeline_fwd", tag=c))
        for w in sends:
            clock.wait(w, "comm")
        return loss_sum

    def _exchange_halo(self, l: int, c: int, clock: EpochClock) -> None:
        """Before conv ``l`` of chunk ``c``: bring in the rows other ways computed at this step
        (none: one way)."""

    def _backward_phase(self, ep: "EpochState", clock: EpochClock) -> None:
        """Every chunk back through this stage's convs, in reverse order, conv by conv."""
        C, top = self.C, self.layers[-1]
        rev = ep.order[::-1]
        grecvs = {} if self.last else self._post_recvs(rev, self.next, self._stage_out_width(),
                                                       "pipeline_bwd", C)
        sends = []
        for c in rev:
            s, e = self._rows(c)
            g_out = gx0 = None  # gradients of this stage's output rows of c (and of x0's rows)
            if not self.last:
                g = clock.wait(grecvs.pop(c), "bubble")
                d = self.out_dims[top]
                g_out, gx0 = g[:, :d], (g[:, d:].clone() if self.needs_x0 else None)
            for l in reversed(self.layers):
                if self.pc.recompute:
                    with self._replay(ep.rng.pop((l, c))):
                        h_src, x0, out = self._layer(l, c, ep.fresh[c], grad=True)
                        loss = self._chunk_loss(out, c) if self.last and l == top else None
                else:
                    h_src, x0, out = ep.saved.pop((l, c))
                    loss = ep.saved.pop(("loss", c)) if self.last and l == top else None
                if loss is not None:
                    loss.backward()
                else:
                    out.backward(g_out)
                if x0 is not None:
                    gx0 = x0.grad if gx0 is None else gx0.add_(x0.grad)
                g_out = self._route(l, c, h_src.grad, ep, clock)
            if not self.first:
                parts = [g_out] + ([gx0] if self.needs_x0 else [])
                payload = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
                sends.append(self.comm.isend(payload, self.prev, op="pipeline_bwd", tag=C + c))
            elif self.needs_x0:
                self.g0[s:e] += gx0  # x0 is the encoder's output too
        if self.first and self.has_encoder:
            if self.pc.recompute:
                with self._replay(ep.rng.pop("enc")):
                    ep.h0_graph = self.encoder(self.x_src)
            ep.h0_graph.backward(self.g0)
        for w in sends:
            clock.wait(w, "comm")

    def _route(self, l: int, c: int, gsrc: Optional[Tensor], ep: "EpochState", clock: EpochClock) -> Optional[Tensor]:
        """Split conv ``l``'s input gradient of chunk ``c`` (own rows, then halo rows): the halo
        part goes to the gradient buffer for the chunks that own those rows; returns the
        gradient of the chunk's own input rows, with what other chunks delivered to them."""
        s, e = self._rows(c)
        n_c, halo = e - s, self.halo[c]
        if l == 0:  # the encoder's output, back-propagated at the end: every contribution counts
            if gsrc is not None:
                self.g0[s:e] += gsrc[:n_c]
                self.g0.index_add_(0, halo, gsrc[n_c:])
            return None
        st = self.hist[l]
        g_own = gsrc[:n_c] + st.grad[s:e]  # (n_c, d_l); a chunk's halo never holds its own rows
        st.grad[s:e] = 0
        g_halo = gsrc[n_c:]  # (M_c, d_l)
        if self.pc.grad_correction:  # historical rows: dropped; fresh rows: scaled (see module doc)
            fresh = ep.fresh[c]
            st.grad.index_add_(0, halo[fresh], g_halo[fresh] * ep.scale[c])
        else:  # fresh rows: delivered this epoch; historical rows: next epoch
            st.grad.index_add_(0, halo, g_halo)
        return g_own

    def _all_reduce_timed(self, t: Tensor, clock: EpochClock) -> Tensor:
        clock.sync()
        t0 = time.perf_counter()
        self.comm.all_reduce_(t, op="control")
        clock.bubble += time.perf_counter() - t0
        return t

    # ------------------------------------------------------------------ exact passes
    @torch.no_grad()
    def _full_pass(self, fill: bool) -> Optional[Tensor]:
        """The way's whole block as one chunk through the stages, dropout off (op ``control``).

        ``fill``: also write every conv input into the buffers (the warm start).
        Returns the logits of the own rows on the last stage, None elsewhere.
        """
        was = [m.training for _, m in self.owned]
        self._train_mode(False)
        tag = 2 * self.C
        a = self.layers[0]
        src0 = None  # conv 0's source rows (stage 0)
        if self.first:
            src0 = self.x_src if self.encoder is None else self.encoder(self.x_src)  # (n_src, d_0)
            h = src0[:self.n_own]
            x0 = h if self.needs_x0 else None
        else:
            buf = torch.empty(self.n_own, self._stage_in_width(), device=self.device, dtype=self.dtype)
            self.comm.recv(buf, self.prev, op="control", tag=tag)
            h, x0 = buf[:, :self.dims[a]], (buf[:, self.dims[a]:] if self.needs_x0 else None)
        for l in self.layers:
            h_src = src0 if l == 0 else self._halo_src(h)
            if fill and l in self.hist:
                self.hist[l].fill(h_src)
            h = self.convs[l](h_src, self.full_block, x0)
        for (_, m), w in zip(self.owned, was):
            m.train(w)
        if not self.last:
            payload = torch.cat([h, x0], dim=1) if self.needs_x0 else h
            self.comm.send(payload.contiguous(), self.next, op="control", tag=tag)
            return None
        return h if self.decoder is None else self.decoder(h)

    def _halo_src(self, h: Tensor) -> Tensor:
        """The own rows ``h`` of a conv's input, extended to the source space (nothing to add)."""
        return h

    def evaluate(self) -> dict[str, float]:
        """Exact full-graph inference: accuracy per split and the training loss, on every rank."""
        logits = self._full_pass(fill=False)
        vals = torch.zeros(2 * len(SPLITS) + 1, dtype=torch.float64, device=self.device)
        if self.last:
            counts = correct_counts(logits, self.labels, {s: self.masks[s] for s in SPLITS})
            for i, s in enumerate(SPLITS):
                vals[2 * i], vals[2 * i + 1] = counts[s]
            vals[-1] = float(ce_sum(logits, self.labels, self.masks["train"]) / self.n_train)
        self.comm.all_reduce_(vals, op="control")
        v = vals.tolist()
        out = {f"{s}_acc": (v[2 * i] / v[2 * i + 1] if v[2 * i + 1] else 0.0) for i, s in enumerate(SPLITS)}
        out["loss"] = v[-1]
        return out

    # ------------------------------------------------------------------ weights and bytes
    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """This stage's parameters under their single-process names."""
        return {f"{prefix}.{k}": p for prefix, m in self.owned for k, p in m.named_parameters()}

    def local_state_dict(self) -> "OrderedDict[str, Tensor]":
        out = OrderedDict()
        for prefix, m in self.owned:
            for k, v in m.state_dict().items():
                out[f"{prefix}.{k}"] = v.detach()
        return out

    def full_state_dict(self) -> Optional[dict[str, Tensor]]:
        """The whole model's weights under the single-process names on rank 0 (None elsewhere).

        Collective: every stage sends its weights to rank 0, grouped by dtype, one
        message per dtype (op ``control``); rank 0 knows every shape from the model it built.
        """
        local = self.local_state_dict()
        rank = self.groups.rank if self.groups is not None else 0
        tag = 2 * self.C + 1
        root = self.groups.dims.rank_of(0, 0) if self.groups is not None else 0
        if self.S == 1:
            return OrderedDict((k, local[k].cpu().clone()) for k, _, _ in self.full_keys)
        if rank != root:
            for dtype, names in self._by_dtype(self.stage):
                flat = torch.cat([local[k].reshape(-1) for k in names])
                self.comm.send(flat.contiguous(), root, op="control", tag=tag)
            return None
        state = {k: v.cpu().clone() for k, v in local.items()}
        shapes = {k: shape for k, shape, _ in self.full_keys}
        for s in range(1, self.S):
            src = self.groups.dims.rank_of(s, 0)
            for dtype, names in self._by_dtype(s):
                numel = [int(np.prod(shapes[k], dtype=np.int64)) for k in names]
                flat = torch.empty(sum(numel), dtype=dtype, device=self.device)
                self.comm.recv(flat, src, op="control", tag=tag)
                for k, piece in zip(names, flat.cpu().split(numel)):
                    state[k] = piece.view(shapes[k]).clone()
        return OrderedDict((k, state[k]) for k, _, _ in self.full_keys)

    #: the buffers of a ``History`` that carry over from epoch to epoch
    _BUFFERS = ("cur", "hist", "snap", "grad")

    def state_dict(self) -> dict:
        """This stage's training state: its weights and Adam's moments, the convs it owns, and
        the history buffers (values, snapshot or moving average, gradients waiting for the next
        epoch), which a resumed run must continue from exactly."""
        out = {"model": self.local_state_dict(), "optimizer": self.opt.state_dict(), "layers": list(self.layers),
               "buffers": {l: {k: getattr(st, k) for k in self._BUFFERS if getattr(st, k) is not None}
                           for l, st in self.hist.items()}}
        if self.needs_x0 and not self.first:
            out["x0buf"] = self.x0buf
        return out

    def load_state_dict(self, state: dict) -> None:
        if list(state["layers"]) != self.layers:
            raise ValueError(f"stage {self.stage} owns convs {self.layers}, the checkpoint's stage owned "
                             f"{list(state['layers'])} (pipeline.balance 'profile' measures, it may differ)")
        model = state["model"]
        for prefix, m in self.owned:
            m.load_state_dict({k[len(prefix) + 1:]: v for k, v in model.items() if k.startswith(prefix + ".")})
        if len(model) != len(self.local_state_dict()):
            raise ValueError(f"the checkpoint holds {len(model)} weights, stage {self.stage} has "
                             f"{len(self.local_state_dict())}")
        self.opt.load_state_dict(state["optimizer"])
        targets = [(f"buffers.{l}.{k}", getattr(st, k), state["buffers"].get(l, {}).get(k))
                   for l, st in self.hist.items() for k in self._BUFFERS]
        if self.needs_x0 and not self.first:
            targets.append(("x0buf", self.x0buf, state.get("x0buf")))
        for name, t, saved in targets:
            if (t is None) != (saved is None) or (t is not None and t.shape != saved.shape):
                raise ValueError(f"{name}: {None if saved is None else tuple(saved.shape)} in the checkpoint, "
                                 f"{None if t is None else tuple(t.shape)} here")
            if t is not None:
                t.copy_(saved)

    def _by_dtype(self, stage: int) -> list[tuple[torch.dtype, list[str]]]:
        groups: dict[torch.dtype, list[str]] = {}
        for k, _, dtype in self.full_keys:
            if self._owner(k) == stage:
                groups.setdefault(dtype, []).append(k)
        return list(groups.items())

    def predicted_bytes(self) -> int:
        """Closed form of the bytes sent per epoch over all ranks (independent of the ledger)."""
        return pipeline_bytes(self.N, boundary_dims(self.dims, self.assignment.bounds), self.dtype.itemsize,
                              self.needs_x0)["total"]

    def graph_info(self) -> dict:
        return {"num_nodes": self.N, "num_edges": self.E, "in_features": self.in_features}

    def extra_info(self) -> dict:
        pc = self.pc
        return {"stage_assignment": self.assignment.as_dict(), "chunks": self.C,
                "chunk_rows": [b - a for a, b in zip(self.offsets[:-1], self.offsets[1:])],
                "halo_rows": [int(h.numel()) for h in self.halo], "warm_start": self.warm_started,
                "techniques": {"shuffle_chunks": pc.shuffle_chunks, "grad_correction": pc.grad_correction,
                               "grad_scale": pc.grad_scale, "snapshot_every": pc.snapshot_every,
                               "momentum": pc.momentum, "recompute": pc.recompute}}
