r"""Hybrid: ``S`` pipeline stages x ``G`` graph-parallel ways (DESIGN.md §4 "Hybrid").

``S · G`` processes, stage-major (``rank = stage · G + way``, ``dims.py``). Stage ``s``
owns a contiguous block of convs (``balance.py``, as GNNPipe); way ``g`` owns a
contiguous block of ``C_w = C / G`` chunks of the chunk store, chunks
``g·C_w .. (g+1)·C_w - 1``: its rows are the id range ``[A_g, B_g)``, a graph partition.
Launch, e.g. 2 stages x 2 ways::

    torchrun --standalone --nproc-per-node 4 -m gnnpipe.cli train --run-config run.yaml

**The way's source space.** Worker ``(s, g)`` keeps, for every conv ``l`` it owns, a
buffer of that conv's *input* over the way's own rows followed by the way's **halo**
``H_g`` (sorted new ids outside ``[A_g, B_g)`` with an edge into it; ``M_g = |H_g|``
is the mirror count of the ``G``-way partition): ``n_g + M_g`` rows, not ``N``. A chunk
``c`` of the way aggregates its own rows and its chunk halo, which is a mix of rows of
other chunks of the same way (read from the buffer, exactly as in GNNPipe) and rows of
other ways (halo rows of the buffer, written when they arrive).

**Lockstep.** Every way processes its chunks in the same order of *local* chunk
indices, ``chunk_order(C_w, epoch, seed, shuffle)``: at pipeline step ``k`` way ``g``
computes chunk ``g·C_w + order[k]``, every way at once. Before conv ``l`` (``l >= 1``) of
step ``k``, the ways of the stage exchange (one ``all_to_all_single`` in the stage group,
op ``halo``) the rows of *this step's* chunk that the other ways' halos list, i.e. conv
``l``'s input rows just received from the previous stage or just computed by conv
``l - 1``. So, for way ``g``'s chunk at step ``k``, a halo row owned by a chunk at step

* ``k' < k`` is fresh (written this epoch, earlier),
* ``k' = k`` (another way's chunk of the same step) is fresh (exchanged just now),
* ``k' > k`` is historical (last epoch's value, or the snapshot / moving average),

exactly the pipeline's rule with "same step" added. Each halo row crosses the wire once
per conv and epoch forward, when its chunk is computed: ``Σ_g M_g · d_l`` values per
conv, the graph-parallel volume of the ``G``-way partition.

**Backward** runs the steps in reverse, conv by conv (as GNNPipe). The gradient of a
chunk's halo rows is scatter-added into the way's *gradient buffer* of conv ``l``
(own rows and halo rows). After back-propagating conv ``l`` of step ``k``, the ways
exchange the accumulated gradients of the halo rows owned by the other ways' step-``k``
chunks (and zero them): the owner adds them to its chunk's own-row gradient before
going on to conv ``l - 1``. That delivers, in time, the contributions of every chunk
that read the row fresh (steps ``>= k``, back-propagated before or at ``k``); a
contribution of a chunk that read it historical arrives after the row's chunk was
back-propagated and waits in the buffer for the next epoch (as in GNNPipe). Gradients
of rows of the same way move inside the buffer, never on the wire. Again
``Σ_g M_g · d_l`` values per conv.

**Exactness.** With ``C_w = 1`` (``C = G``) every halo row is read at its own step:
fresh, and every gradient delivered in time: the epoch is plain graph parallelism
inside each stage and plain model parallelism across stages, i.e. single-process
training (tested to 1e-10 in float64, dropout off). ``G = 1`` is GNNPipe (same order,
same freshness, same routing as ``pipeline.py``); ``S = 1``, ``C = G = P`` is the
``graph`` mode.

**Conv 0 and the input.** Stage 0 fetches its halo's input features once at set-up
(op ``halo_setup``, filed under epoch ``-1``) and runs the encoder (GCNII, ResGCN+) on
its own and halo rows every epoch; conv 0's input is therefore never exchanged and
never stale (the graph engine's ``cache_input_halo``; costmodel ``first_input="local"``).
``x0`` (GCNII) is needed only for destination rows: it travels with the chunk rows from
stage to stage, as in GNNPipe.

**Between stages** way ``g`` of stage ``s`` sends its chunk's output rows (and ``x0``
rows) to way ``g`` of stage ``s + 1``, point to point (op ``pipeline_fwd``), and the
gradients come back (``pipeline_bwd``); every receive is posted ahead.

**Weights.** Each stage's ``G`` ways hold replicas of the stage's modules; after the
backward phase their gradients are summed with a bucketed ring all-reduce in the stage
group (op ``grad_allreduce``), then one Adam step: weights stay identical across ways.

**Convergence techniques**: the pipeline's (``PipelineConfig``), applied within each
way's block: (1) ``shuffle_chunks`` shuffles the local order (the same on every way);
(2) ``grad_correction`` drops the gradients of historical rows and scales by
``grad_scale`` those of rows read fresh from an *earlier* step. Rows of the same step
are delivered with probability 1 under any order, so they are not scaled: for a pair of
chunks at different local indices the earlier-than relation holds with probability
1/2 under a uniform order, which is the pipeline's derivation, and for the same local
index (different ways) it is replaced by "same step", always delivered;
(3) ``snapshot_every`` and (4) ``momentum`` act on the way's buffers (own and halo rows)
exactly as ``pipeline.History`` does; ``recompute`` rebuilds each (conv, chunk) from the
buffers in backward (the exchanges are not repeated: the buffers hold what was read).

**Warm start and evaluation**: as GNNPipe, but over the way's partition: one exact
forward of each way's whole block through the stages (halo rows exchanged per conv,
op ``control``) fills the buffers before epoch 0 (when ``C_w > 1``); evaluation is the
same exact pass, the correct counts all-reduced.

**Bytes per epoch** (all ranks; ``costmodel.hybrid_bytes``):
``2 Σ_{s>=1} N (d_s + d_x0) b`` (pipeline) ``+ 2 Σ_g M_g Σ_{l>=1} d_l b`` (halo) ``+
Σ_s 2 (G-1) params_s b`` (all-reduce).

Known simplifications: the halo exchange is not overlapped with the inner rows'
aggregation (the graph engine's ``overlap``); the first conv's halo is always cached.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from ..config import RunConfig
from ..costmodel import hybrid_bytes
from ..engine import DTYPES, EpochStats, make_optimizer
from ..io import GnnPipeError
from ..models.block import Block
from ..models.model import GNN
from ..store import ChunkStore
from .balance import StageAssignment, assign_stages
from .pipeline import SPLITS, History, PipelineEngine, _Clock, _Epoch, chunk_order

log = logging.getLogger(__name__)


def check_hybrid_config(cfg: RunConfig, groups=None) -> None:
    """Refuse layouts the hybrid engine cannot run, with the reason."""
    where = f"run {cfg.run_id}"
    S, G, C, L = cfg.stages, cfg.ways, cfg.chunks, cfg.model.layers
    pc = cfg.pipeline
    if cfg.mode != "hybrid":
        raise GnnPipeError(f"{where}: HybridEngine runs mode 'hybrid', not {cfg.mode!r}")
    if cfg.model.kind == "mlp":
        raise GnnPipeError(f"{where}: model kind 'mlp' has no graph layers; use mode single")
    if S < 1 or G < 1:
        raise GnnPipeError(f"{where}: stages ({S}) and ways ({G}) must be >= 1")
    if S > L:
        raise GnnPipeError(f"{where}: {S} stages but the model has only {L} graph layers (stages <= layers)")
    if C < G or C % G:
        raise GnnPipeError(f"{where}: {C} chunks for {G} ways; chunks must be a positive multiple of ways "
                           f"(each way owns chunks/ways of them)")
    if cfg.workers != S * G:
        raise GnnPipeError(f"{where}: hybrid runs stages x ways = {S * G} workers, the run has {cfg.workers}")
    if not cfg.store_path:
        raise GnnPipeError(f"{where}: mode hybrid needs a chunk store (store_path)")
    if not 0.0 <= pc.momentum < 1.0:
        raise GnnPipeError(f"{where}: pipeline.momentum must lie in [0, 1), got {pc.momentum}")
    if pc.snapshot_every < 0:
        raise GnnPipeError(f"{where}: pipeline.snapshot_every must be >= 0 (0: off), got {pc.snapshot_every}")
    if pc.grad_scale <= 0:
        raise GnnPipeError(f"{where}: pipeline.grad_scale must be > 0, got {pc.grad_scale}")
    if groups is not None and (groups.dims.stages != S or groups.dims.ways != G):
        raise GnnPipeError(f"{where}: process groups are laid out {groups.dims.stages} stages x "
                           f"{groups.dims.ways} ways, the run needs {S} x {G}")


class HybridEngine:
    """One worker (stage ``s``, way ``g``) of hybrid training (the ``Engine`` protocol)."""

    def __init__(self, cfg: RunConfig, groups, comm, device):
        check_hybrid_config(cfg, groups)
        if comm is None:
            from .comm import Communicator
            comm = Communicator(groups, device)
        self.cfg, self.groups, self.comm = cfg, groups, comm
        self.device = torch.device(device)
        self.dtype = DTYPES[cfg.training.dtype]
        pc = self.pc = cfg.pipeline
        self.S, self.G, self.C = cfg.stages, cfg.ways, cfg.chunks
        self.Cw = self.C // self.G
        self.rank = groups.rank if groups is not None else 0
        self.stage = groups.stage_index if groups is not None else 0
        self.way = groups.way_index if groups is not None else 0
        self.first, self.last = self.stage == 0, self.stage == self.S - 1
        self.prev = groups.prev_rank() if groups is not None else None
        self.next = groups.next_rank() if groups is not None else None
        # the stage group of the G ways; with G = 1 there is nothing to exchange (and
        # build_groups hands out the world there, which is not a group of one)
        self.group = groups.stage if (groups is not None and self.G > 1) else None

        store = ChunkStore(cfg.store_path, expect_parts=self.C)
        try:
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
        if self.rank == 0:
            log.info("hybrid %d x %d: %s", self.S, self.G, self.assignment)

        self.full_keys = [(k, tuple(v.shape), v.dtype) for k, v in gnn.state_dict().items()]
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
        del gnn
        self.params = [p for _, m in self.owned for p in m.parameters() if p.requires_grad]
        self.opt = make_optimizer(self.params, cfg.training)

        self._setup_exchanges()

        keep_history = pc.recompute and pc.snapshot_every == 0
        self.hist: dict[int, History] = {}
        for l in self.layers:
            if l == 0:
                continue  # conv 0's input: features or the encoder on own + halo rows, never stale
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

    # ------------------------------------------------------------------ set-up
    def _load(self, store: ChunkStore) -> None:
        dev = self.device
        self.N, self.E = store.num_nodes, store.num_edges
        self.in_features, self.num_classes = store.num_features, store.num_classes
        self.offsets = [int(o) for o in store.offsets]
        g, Cw = self.way, self.Cw
        self.my_chunks = list(range(g * Cw, (g + 1) * Cw))
        A, B = self.offsets[g * Cw], self.offsets[(g + 1) * Cw]
        self.A, self.B, self.n_own = A, B, B - A
        halos = {c: store.read_part(c, "halo").astype(np.int64) for c in self.my_chunks}
        allh = np.concatenate([halos[c] for c in self.my_chunks]) if halos else np.zeros(0, np.int64)
        self.way_halo = np.unique(allh[(allh < A) | (allh >= B)])  # H_g, sorted, grouped by owner way
        self.n_halo = len(self.way_halo)
        self.n_src = self.n_own + self.n_halo

        def loc(ids: np.ndarray) -> np.ndarray:
            own = (ids >= A) & (ids < B)
            return np.where(own, ids - A, self.n_own + np.searchsorted(self.way_halo, ids))

        self.blocks: dict[int, Block] = {}
        self.chunk_src: dict[int, Tensor] = {}  # chunk halo -> positions in the way's source space
        self.halo_local: dict[int, Tensor] = {}  # chunk halo -> local chunk index of its owner
        for c in self.my_chunks:
            self.blocks[c] = store.local_block(c, self.dtype).to(dev)
            h = halos[c]
            self.chunk_src[c] = torch.as_tensor(loc(h), dtype=torch.int64).to(dev)
            self.halo_local[c] = torch.as_tensor(store.part_of(h) % Cw, dtype=torch.int64).to(dev)
        # the way's whole block (exact passes): its rows against own rows then H_g
        ptrs = [store.read_part(c, "indptr") for c in self.my_chunks]
        base = np.cumsum([0] + [int(q[-1]) for q in ptrs[:-1]])
        indptr = np.concatenate([[0]] + [q[1:] + b for q, b in zip(ptrs, base)])
        indices = np.concatenate([store.read_part(c, "indices") for c in self.my_chunks]).astype(np.int64)
        deg_out = store.deg_out()
        deg_src = np.concatenate([deg_out[A:B], deg_out[self.way_halo]])
        deg_in = np.concatenate([store.read_part(c, "deg_in") for c in self.my_chunks])
        self.way_block = Block.from_numpy(indptr, loc(indices), self.n_src, 0, deg_in, deg_src,
                                          self.dtype).to(dev)
        self.halo_owner_chunk = store.part_of(self.way_halo)  # (M_g,) global chunk of each halo row
        if self.first:
            self.features = torch.as_tensor(
                np.concatenate([store.read_part(c, "features") for c in self.my_chunks])).to(dev, self.dtype)
        if self.last:
            self.labels = torch.as_tensor(
                np.concatenate([store.read_part(c, "labels") for c in self.my_chunks])).to(dev)
            self.masks = {s: torch.as_tensor(np.concatenate(
                [store.read_part(c, f"{s}_mask") for c in self.my_chunks])).to(dev) for s in SPLITS}

    def _setup_exchanges(self) -> None:
        """Once per run (epoch -1): request lists, input-feature halo, global counts."""
        G, Cw, dev, comm = self.G, self.Cw, self.device, self.comm
        owner_way = self.halo_owner_chunk // Cw
        recv_full = np.bincount(owner_way, minlength=G).astype(np.int64)  # my halo rows owned by each way
        if G > 1:
            counts = comm.all_to_all_rows(torch.as_tensor(recv_full).reshape(G, 1).to(dev), [1] * G, [1] * G,
                                          self.group, op="halo_setup")
            send_full = [int(x) for x in counts.reshape(-1).tolist()]  # how many of my rows each way needs
            ids = comm.all_to_all_rows(torch.as_tensor(self.way_halo).to(dev), recv_full.tolist(), send_full,
                                       self.group, op="halo_setup").cpu().numpy()
        else:
            send_full, ids = [0], np.zeros(0, np.int64)
        req = np.split(ids, np.cumsum(send_full)[:-1])  # per way: the ids of my rows it needs, its halo order
        self.send_full = torch.as_tensor(ids - self.A, dtype=torch.int64).to(dev)
        self.send_rows_full, self.recv_rows_full = list(send_full), [int(x) for x in recv_full]
        # per local chunk index j: what moves at the step that computes chunks g'·C_w + j
        self.send_idx, self.send_rows, self.recv_pos, self.recv_rows = [], [], [], []
        for j in range(Cw):
            s, e = self.offsets[self.way * Cw + j], self.offsets[self.way * Cw + j + 1]
            parts = [r[(r >= s) & (r < e)] - self.A for r in req]
            self.send_idx.append(torch.as_tensor(np.concatenate(parts) if parts else np.zeros(0, np.int64),
                                                 dtype=torch.int64).to(dev))
            self.send_rows.append([len(p) for p in parts])
            pos, rows = [], []
            for q in range(G):
                i = np.flatnonzero(self.halo_owner_chunk == q * Cw + j)
                pos.append(i)
                rows.append(len(i))
            self.recv_pos.append(torch.as_tensor(self.n_own + np.concatenate(pos), dtype=torch.int64).to(dev))
            self.recv_rows.append(rows)
        # stage 0: the halo's input features, once
        self.x_src = None
        if self.first:
            halo_x = self._exchange_rows(self.features, self.send_full, self.send_rows_full,
                                         self.recv_rows_full, "halo_setup")
            self.x_src = torch.cat([self.features, halo_x])  # (n_own + M_g, F)
            self.features = self.x_src[:self.n_own]
        # global counts (world): training nodes (last stage), mirrors and rows per way (stage 0)
        vec = torch.zeros(1 + 2 * G, dtype=torch.float64, device=dev)
        if self.last:
            vec[0] = float(self.masks["train"].sum())
        if self.first:
            vec[1 + self.way], vec[1 + G + self.way] = self.n_halo, self.n_own
        comm.all_reduce_(vec, op="control")
        v = [int(round(x)) for x in vec.tolist()]
        self.n_train = max(v[0], 1)
        self.mirrors, self.nodes_per_way = v[1:1 + G], v[1 + G:]

    def _exchange_rows(self, src: Tensor, send_idx: Tensor, send_rows, recv_rows, op: str,
                       clock: Optional[_Clock] = None) -> Tensor:
        """All-to-all in the stage group: ``src[send_idx]`` out, the received rows back."""
        if self.G == 1:
            return src.new_zeros((0, *src.shape[1:]))
        send = src.index_select(0, send_idx)
        if clock is None:
            return self.comm.all_to_all_rows(send, send_rows, recv_rows, self.group, op=op)
        work = self.comm.all_to_all_rows(send, send_rows, recv_rows, self.group, op=op, async_op=True)
        return clock.wait(work, "comm")

    # ------------------------------------------------------------------ helpers
    def _rows(self, c: int) -> tuple[int, int]:
        """Chunk ``c``'s rows in the way's local numbering."""
        return self.offsets[c] - self.A, self.offsets[c + 1] - self.A

    # ------------------------------------------------------------------ one (conv, chunk)
    def _layer(self, l: int, c: int, ep: _Epoch, grad: bool):
        s, e = self._rows(c)
        idx = self.chunk_src[c]
        if l == 0:
            h_src = torch.cat([self.h0[s:e], self.h0.index_select(0, idx)])
        else:
            st = self.hist[l]
            stale = st.stale()
            if stale is st.cur:
                halo_rows = st.cur.index_select(0, idx)
            else:
                halo_rows = torch.where(ep.fresh[c][:, None], st.cur.index_select(0, idx),
                                        stale.index_select(0, idx))
            h_src = torch.cat([st.cur[s:e], halo_rows])
        x0 = None
        with torch.set_grad_enabled(grad):
            if grad and (l > 0 or self.has_encoder):
                h_src.requires_grad_()
            if self.needs_x0:
                x0 = self._x0_rows(s, e)
                if grad:
                    x0 = x0.clone().requires_grad_()
            out = self.convs[l](h_src, self.blocks[c], x0)
        return h_src, x0, out

    # ------------------------------------------------------------------ training
    def train_epoch(self, epoch: int) -> EpochStats:
        clock = _Clock(self.comm, self.device)
        self._train_mode(True)
        self.opt.zero_grad(set_to_none=True)
        ep = self._begin_epoch(epoch)
        loss_sum = self._forward_phase(ep, clock)
        self._backward_phase(ep, clock)
        for st in self.hist.values():
            st.end_epoch()
        for p in self.params:  # a parameter without a gradient still takes part in the all-reduce
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.G > 1:
            clock._sync()
            t0 = time.perf_counter()
            self.comm.all_reduce_coalesced_([p.grad for p in self.params], group=self.group,
                                            op="grad_allreduce")
            clock.comm_s += time.perf_counter() - t0
        self.opt.step()
        total = loss_sum.reshape(1)
        clock._sync()
        t0 = time.perf_counter()
        self.comm.all_reduce_(total, op="control")  # every rank returns the global loss (the drain)
        clock.bubble += time.perf_counter() - t0
        return clock.stats(float(total[0]))

    def _begin_epoch(self, epoch: int) -> _Epoch:
        Cw = self.Cw
        order = chunk_order(Cw, epoch, self.cfg.training.seed, self.pc.shuffle_chunks)  # local indices
        pos = np.empty(Cw, dtype=np.int64)
        pos[order] = np.arange(Cw)
        pos_t = torch.as_tensor(pos).to(self.device)
        fresh, earlier = {}, {}
        for c in self.my_chunks:
            p_halo = pos_t.index_select(0, self.halo_local[c])
            me = int(pos[c - self.way * Cw])
            fresh[c] = p_halo <= me  # equal: another way's chunk of the same step
            earlier[c] = p_halo < me
        for st in self.hist.values():
            st.begin_epoch(epoch)
        ep = _Epoch([self.way * Cw + int(j) for j in order], fresh)
        ep.earlier = earlier
        if self.first and self.has_encoder:
            if self.pc.recompute:
                ep.rng["enc"] = self._rng_state()
                with torch.no_grad():
                    self.h0.copy_(self.encoder(self.x_src))
            else:
                ep.h0_graph = self.encoder(self.x_src)
                self.h0.copy_(ep.h0_graph.detach())
            self.g0.zero_()
        return ep

    def _forward_phase(self, ep: _Epoch, clock: _Clock) -> Tensor:
        recompute = self.pc.recompute
        recvs = {} if self.first else self._post_recvs(ep.order, self.prev, self._stage_in_width(),
                                                       "pipeline_fwd", 0)
        sends = []
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        a = self.layers[0]
        for c in ep.order:
            j = c - self.way * self.Cw
            s, e = self._rows(c)
            if not self.first:
                payload = clock.wait(recvs.pop(c), "bubble")
                self.hist[a].cur[s:e] = payload[:, :self.dims[a]]
                if self.needs_x0:
                    self.x0buf[s:e] = payload[:, self.dims[a]:]
            for l in self.layers:
                if l > 0:  # this step's rows of conv l's input, to the ways whose halo lists them
                    cur = self.hist[l].cur
                    got = self._exchange_rows(cur, self.send_idx[j], self.send_rows[j], self.recv_rows[j],
                                              "halo", clock)
                    cur[self.recv_pos[j]] = got
                with torch.set_grad_enabled(not recompute):
                    if recompute:
                        ep.rng[(l, c)] = self._rng_state()
                    h_src, x0, out = self._layer(l, c, ep, grad=not recompute)
                    if l + 1 in self.convs:
                        self.hist[l + 1].cur[s:e] = out.detach()
                    if not recompute:
                        ep.saved[(l, c)] = (h_src, x0, out)
            if self.last:
                with torch.set_grad_enabled(not recompute):
                    loss = self._chunk_loss(out, c)
                loss_sum += loss.detach()
                if not recompute:
                    ep.saved[("loss", c)] = loss
            else:
                parts = [out.detach()] + ([self._x0_rows(s, e)] if self.needs_x0 else [])
                payload = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
                sends.append(self.comm.isend(payload, self.next, op="pipeline_fwd", tag=c))
        for w in sends:
            clock.wait(w, "comm")
        return loss_sum

    def _backward_phase(self, ep: _Epoch, clock: _Clock) -> None:
        C, top = self.C, self.layers[-1]
        rev = ep.order[::-1]
        grecvs = {} if self.last else self._post_recvs(rev, self.next, self._stage_out_width(),
                                                       "pipeline_bwd", C)
        sends = []
        for c in rev:
            s, e = self._rows(c)
            g_out = gx0 = None
            if not self.last:
                g = clock.wait(grecvs.pop(c), "bubble")
                d = self.out_dims[top]
                g_out, gx0 = g[:, :d], (g[:, d:].clone() if self.needs_x0 else None)
            for l in reversed(self.layers):
                if self.pc.recompute:
                    with self._replay(ep.rng.pop((l, c))):
                        h_src, x0, out = self._layer(l, c, ep, grad=True)
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
                self.g0[s:e] += gx0
        if self.first and self.has_encoder:
            if self.pc.recompute:
                with self._replay(ep.rng.pop("enc")):
                    ep.h0_graph = self.encoder(self.x_src)
            ep.h0_graph.backward(self.g0)
        for w in sends:
            clock.wait(w, "comm")

    def _route(self, l: int, c: int, gsrc: Optional[Tensor], ep: _Epoch, clock: _Clock) -> Optional[Tensor]:
        """Conv ``l``'s input gradient of chunk ``c``: halo part into the gradient buffer, then the
        step's exchange; returns the chunk's own-row gradient with everything delivered to it."""
        s, e = self._rows(c)
        n_c, idx = e - s, self.chunk_src[c]
        if l == 0:  # the encoder's output (own + halo rows), back-propagated at the end locally
            if gsrc is not None:
                self.g0[s:e] += gsrc[:n_c]
                self.g0.index_add_(0, idx, gsrc[n_c:])
            return None
        st = self.hist[l]
        g_halo = gsrc[n_c:]
        if self.pc.grad_correction:  # historical: dropped; fresh from an earlier step: scaled; same step: as is
            fresh, earlier = ep.fresh[c], ep.earlier[c]
            scale = torch.where(earlier, self.pc.grad_scale, 1.0).to(g_halo.dtype)
            st.grad.index_add_(0, idx[fresh], g_halo[fresh] * scale[fresh][:, None])
        else:
            st.grad.index_add_(0, idx, g_halo)
        g_own = gsrc[:n_c] + st.grad[s:e]
        st.grad[s:e] = 0
        if self.G > 1:
            j = c - self.way * self.Cw
            pos = self.recv_pos[j]
            out = st.grad.index_select(0, pos)
            st.grad[pos] = 0
            work = self.comm.all_to_all_rows(out, self.recv_rows[j], self.send_rows[j], self.group,
                                             op="halo", async_op=True)
            back = clock.wait(work, "comm")
            g_own.index_add_(0, self.send_idx[j] - s, back)
        return g_own

    # ------------------------------------------------------------------ exact passes
    @torch.no_grad()
    def _full_pass(self, fill: bool) -> Optional[Tensor]:
        """Each way's whole block through the stages, dropout off, halo exchanged per conv
        (op ``control``). Returns the logits of the way's rows on the last stage."""
        was = [m.training for _, m in self.owned]
        self._train_mode(False)
        tag = 2 * self.C
        a = self.layers[0]
        src0 = None
        if self.first:
            src0 = self.x_src if self.encoder is None else self.encoder(self.x_src)  # (n_src, d_0)
            h = src0[:self.n_own]
            x0 = h if self.needs_x0 else None
        else:
            buf = torch.empty(self.n_own, self._stage_in_width(), device=self.device, dtype=self.dtype)
            self.comm.recv(buf, self.prev, op="control", tag=tag)
            h, x0 = buf[:, :self.dims[a]], (buf[:, self.dims[a]:] if self.needs_x0 else None)
        for l in self.layers:
            if l == 0:
                h_src = src0
            else:
                halo = self._exchange_rows(h, self.send_full, self.send_rows_full, self.recv_rows_full, "control")
                h_src = torch.cat([h, halo])
                if fill:
                    self.hist[l].fill(h_src)
            h = self.convs[l](h_src, self.way_block, x0)
        for (_, m), w in zip(self.owned, was):
            m.train(w)
        if not self.last:
            payload = torch.cat([h, x0], dim=1) if self.needs_x0 else h
            self.comm.send(payload.contiguous(), self.next, op="control", tag=tag)
            return None
        return h if self.decoder is None else self.decoder(h)

    # the pieces that are the pipeline's own, unchanged (they read only attributes both engines define)
    _owner = PipelineEngine._owner
    _train_mode = PipelineEngine._train_mode
    _rng_state = PipelineEngine._rng_state
    _replay = PipelineEngine._replay
    _stage_in_width = PipelineEngine._stage_in_width
    _stage_out_width = PipelineEngine._stage_out_width
    _x0_rows = PipelineEngine._x0_rows
    _chunk_loss = PipelineEngine._chunk_loss
    _post_recvs = PipelineEngine._post_recvs
    evaluate = PipelineEngine.evaluate
    named_parameters = PipelineEngine.named_parameters
    local_state_dict = PipelineEngine.local_state_dict
    _by_dtype = PipelineEngine._by_dtype

    def full_state_dict(self) -> Optional[dict[str, Tensor]]:
        """The whole model under the single-process names on rank 0 (None elsewhere).

        Collective over way 0 of every stage (the ways hold identical replicas): each
        stage's way 0 sends its weights to rank 0, one message per dtype (op ``control``)."""
        if self.way != 0:
            return None
        return PipelineEngine.full_state_dict(self)  # the same gather, over the ways 0

    def predicted_bytes_by_kind(self) -> dict[str, int]:
        return hybrid_bytes(self.N, self.mirrors, self.dims, self.assignment.bounds, self.params_per_stage,
                            self.dtype.itemsize, self.needs_x0, nodes_per_way=self.nodes_per_way,
                            first_input="local")

    def predicted_bytes(self) -> int:
        """Closed form of the training bytes all ranks send per epoch (not read from the ledger)."""
        return self.predicted_bytes_by_kind()["total"]

    def graph_info(self) -> dict:
        return {"num_nodes": self.N, "num_edges": self.E, "in_features": self.in_features}

    def extra_info(self) -> dict:
        pc = self.pc
        return {"hybrid": {
            "stage_assignment": self.assignment.as_dict(), "chunks": self.C, "chunks_per_way": self.Cw,
            "mirrors_per_way": self.mirrors, "nodes_per_way": self.nodes_per_way,
            "predicted_bytes": self.predicted_bytes_by_kind(), "warm_start": self.warm_started,
            "techniques": {"shuffle_chunks": pc.shuffle_chunks, "grad_correction": pc.grad_correction,
                           "grad_scale": pc.grad_scale, "snapshot_every": pc.snapshot_every,
                           "momentum": pc.momentum, "recompute": pc.recompute}}}
