r"""Hybrid: ``S`` pipeline stages x ``G`` graph-parallel ways (docs/DESIGN.md §4 "Hybrid").

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
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from ..config import ConfigError, RunConfig
from ..costmodel.bytes import hybrid_bytes
from ..io import GnnPipeError
from ..models.block import Block
from ..store import ChunkStore
from ..layout import check_layout
from .pipeline import SPLITS, EpochClock, EpochState, PipelineEngine, check_schedule_config

log = logging.getLogger(__name__)


def check_hybrid_config(cfg: RunConfig, groups=None) -> None:
    """Refuse layouts the hybrid engine cannot run, with the reason."""
    where = f"run {cfg.run_id}"
    if cfg.mode != "hybrid":
        raise GnnPipeError(f"{where}: HybridEngine runs mode 'hybrid', not {cfg.mode!r}")
    if cfg.model.kind == "mlp":
        raise GnnPipeError(f"{where}: model kind 'mlp' has no graph layers; use mode single")
    # C = G (one chunk per way) is the exactness configuration: allowed
    check_layout(cfg.mode, cfg.workers, cfg.stages, cfg.ways, cfg.chunks, layers=cfg.model.layers,
                 exact_ok=True, where=where)
    if not cfg.store_path:
        raise GnnPipeError(f"{where}: mode hybrid needs a chunk store (store_path)")
    if not cfg.graph_parallel.cache_input_halo:
        raise ConfigError(f"{where}: mode hybrid always fetches the input features' halo once at set-up; "
                          f"graph_parallel.cache_input_halo: false is not supported there (set it to true, "
                          f"or use mode graph to exchange the input every epoch)")
    check_schedule_config(cfg, groups)


class HybridEngine(PipelineEngine):
    """One worker (stage ``s``, way ``g``) of hybrid training (the ``Engine`` protocol): the
    pipeline engine over the way's block of chunks, plus the ``G``-way halo exchange."""

    check_config = staticmethod(check_hybrid_config)

    @property
    def label(self) -> str:
        return f"hybrid {self.S} x {self.G}:"

    # ------------------------------------------------------------------ set-up
    def _load(self, store: ChunkStore) -> None:
        """The way's block of chunks against its source space (own rows, then ``H_g``), and
        the exchanges (``_setup_exchanges``); the attributes of ``PipelineEngine._load``."""
        dev = self.device
        # the stage group of the G ways; with G = 1 there is nothing to exchange (and
        # build_groups hands out the world there, which is not a group of one)
        self.group = self.groups.graph if (self.groups is not None and self.G > 1) else None
        g, Cw = self.way, self.Cw
        self.my_chunks = list(range(g * Cw, (g + 1) * Cw))
        A, B = self.offsets[g * Cw], self.offsets[(g + 1) * Cw]
        self.A, self.n_own = A, B - A
        halos = {c: store.read_part(c, "halo").astype(np.int64) for c in self.my_chunks}
        allh = np.concatenate([halos[c] for c in self.my_chunks]) if halos else np.zeros(0, np.int64)
        self.way_halo = np.unique(allh[(allh < A) | (allh >= B)])  # H_g, sorted, grouped by owner way
        self.n_halo = len(self.way_halo)
        self.n_src = self.n_own + self.n_halo

        def loc(ids: np.ndarray) -> np.ndarray:
            own = (ids >= A) & (ids < B)
            return np.where(own, ids - A, self.n_own + np.searchsorted(self.way_halo, ids))

        self.blocks: dict[int, Block] = {}
        self.halo: dict[int, Tensor] = {}  # chunk halo -> positions in the way's source space
        self.halo_chunk: dict[int, Tensor] = {}  # chunk halo -> local chunk index of its owner
        for c in self.my_chunks:
            self.blocks[c] = store.local_block(c, self.dtype).to(dev)
            h = halos[c]
            self.halo[c] = torch.as_tensor(loc(h), dtype=torch.int64).to(dev)
            self.halo_chunk[c] = torch.as_tensor(store.part_of(h) % Cw, dtype=torch.int64).to(dev)
        # the way's whole block (exact passes): its rows against own rows then H_g
        ptrs = [store.read_part(c, "indptr") for c in self.my_chunks]
        base = np.cumsum([0] + [int(q[-1]) for q in ptrs[:-1]])
        indptr = np.concatenate([[0]] + [q[1:] + b for q, b in zip(ptrs, base)])
        indices = np.concatenate([store.read_part(c, "indices") for c in self.my_chunks]).astype(np.int64)
        deg_out = store.deg_out()
        deg_src = np.concatenate([deg_out[A:B], deg_out[self.way_halo]])
        deg_in = np.concatenate([store.read_part(c, "deg_in") for c in self.my_chunks])
        self.full_block = Block.from_numpy(indptr, loc(indices), self.n_src, 0, deg_in, deg_src,
                                           self.dtype).to(dev)
        self.halo_owner_chunk = store.part_of(self.way_halo)  # (M_g,) global chunk of each halo row
        features = None
        if self.first:
            features = torch.as_tensor(
                np.concatenate([store.read_part(c, "features") for c in self.my_chunks])).to(dev, self.dtype)
        if self.last:
            self.labels = torch.as_tensor(
                np.concatenate([store.read_part(c, "labels") for c in self.my_chunks])).to(dev)
            self.masks = {s: torch.as_tensor(np.concatenate(
                [store.read_part(c, f"{s}_mask") for c in self.my_chunks])).to(dev) for s in SPLITS}
        self._setup_exchanges(features)

    def _setup_exchanges(self, features: Optional[Tensor]) -> None:
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
            halo_x = self._exchange_rows(features, self.send_full, self.send_rows_full,
                                         self.recv_rows_full, "halo_setup")
            self.x_src = torch.cat([features, halo_x])  # (n_own + M_g, F)
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
                       clock: Optional[EpochClock] = None) -> Tensor:
        """All-to-all in the stage group: ``src[send_idx]`` out, the received rows back."""
        if self.G == 1:
            return src.new_zeros((0, *src.shape[1:]))
        send = src.index_select(0, send_idx)
        if clock is None:
            return self.comm.all_to_all_rows(send, send_rows, recv_rows, self.group, op=op)
        work = self.comm.all_to_all_rows(send, send_rows, recv_rows, self.group, op=op, async_op=True)
        return clock.wait(work, "comm")

    # ------------------------------------------------------------------ the G-way additions to the schedule
    def _halo_grad_scale(self, p_halo: Tensor, me: int) -> Tensor:
        """Fresh from an earlier step: ``grad_scale``; from the same step (another way's chunk,
        delivered under any order): 1. Per fresh halo row, as a column."""
        scale = torch.where(p_halo < me, self.pc.grad_scale, 1.0).to(self.dtype)
        return scale[p_halo <= me][:, None]

    def _exchange_halo(self, l: int, c: int, clock: EpochClock) -> None:
        """This step's rows of conv ``l``'s input, to the ways whose halo lists them."""
        j = c - self.way * self.Cw
        cur = self.hist[l].cur
        got = self._exchange_rows(cur, self.send_idx[j], self.send_rows[j], self.recv_rows[j], "halo", clock)
        cur[self.recv_pos[j]] = got

    def _route(self, l: int, c: int, gsrc: Optional[Tensor], ep: EpochState, clock: EpochClock) -> Optional[Tensor]:
        """The pipeline's routing, then the step's exchange: the accumulated gradients of the halo
        rows owned by the other ways' step chunks go to their owners (and are zeroed here), and
        what the other ways accumulated for this chunk's rows is added to its own-row gradient."""
        g_own = super()._route(l, c, gsrc, ep, clock)
        if l > 0 and self.G > 1:
            st = self.hist[l]
            j = c - self.way * self.Cw
            pos = self.recv_pos[j]
            out = st.grad.index_select(0, pos)
            st.grad[pos] = 0
            work = self.comm.all_to_all_rows(out, self.recv_rows[j], self.send_rows[j], self.group,
                                             op="halo", async_op=True)
            back = clock.wait(work, "comm")
            g_own.index_add_(0, self.send_idx[j] - self._rows(c)[0], back)
        return g_own

    def _reduce_grads(self, clock: EpochClock) -> None:
        """The ways' gradients of this stage's weights, summed (bucketed ring all-reduce)."""
        for p in self.params:  # a parameter without a gradient still takes part in the all-reduce
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.G > 1:
            clock.sync()
            t0 = time.perf_counter()
            self.comm.all_reduce_coalesced_([p.grad for p in self.params], group=self.group,
                                            op="grad_allreduce")
            clock.comm_s += time.perf_counter() - t0

    def _halo_src(self, h: Tensor) -> Tensor:
        """Own rows then ``H_g``'s rows, exchanged in the stage group (op ``control``)."""
        halo = self._exchange_rows(h, self.send_full, self.send_rows_full, self.recv_rows_full, "control")
        return torch.cat([h, halo])

    # ------------------------------------------------------------------ weights and bytes
    def full_state_dict(self) -> Optional[dict[str, Tensor]]:
        """The whole model under the single-process names on rank 0 (None elsewhere).

        Collective over way 0 of every stage (the ways hold identical replicas): each
        stage's way 0 sends its weights to rank 0, one message per dtype (op ``control``)."""
        if self.way != 0:
            return None
        return super().full_state_dict()  # the same gather, over the ways 0

    def predicted_bytes_by_kind(self) -> dict[str, int]:
        return hybrid_bytes(self.N, self.mirrors, self.dims, self.assignment.bounds, self.params_per_stage,
                            self.dtype.itemsize, self.needs_x0, nodes_per_way=self.nodes_per_way,
                            first_input="local")

    def predicted_bytes(self) -> int:
        """Closed form of the training bytes all ranks send per epoch (not read from the ledger)."""
        return self.predicted_bytes_by_kind()["total"]

    def extra_info(self) -> dict:
        pc = self.pc
        return {"hybrid": {
            "stage_assignment": self.assignment.as_dict(), "chunks": self.C, "chunks_per_way": self.Cw,
            "mirrors_per_way": self.mirrors, "nodes_per_way": self.nodes_per_way,
            "predicted_bytes": self.predicted_bytes_by_kind(), "warm_start": self.warm_started,
            "techniques": {"shuffle_chunks": pc.shuffle_chunks, "grad_correction": pc.grad_correction,
                           "grad_scale": pc.grad_scale, "snapshot_every": pc.snapshot_every,
                           "momentum": pc.momentum, "recompute": pc.recompute}}}
