r"""The one layout engine: ``S`` pipeline stages × ``G`` graph ways × ``C`` chunks, for modes
``graph`` (S = 1, C = G = P: graph parallelism), ``pipeline`` (G = 1: GNNPipe) and ``hybrid``.

``S · G`` processes, stage-major (``rank = stage · G + way``, ``gnnpipe.layout``). Each is one
:class:`~gnnpipe.parallel.stage.Stage` (what it owns, how it runs a chunk); this module loads its
piece of the chunk store, builds the model and the stage, and runs each epoch's schedule
(``gnnpipe.schedule.gpipe``: a list of actions per stage, the same list the cost model prices).
Launch, e.g. 2 stages x 2 ways::

    torchrun --standalone --nproc-per-node 4 -m gnnpipe.cli train --run-config run.yaml

**One epoch** (GPipe): every receive of a phase posted ahead, the forwards of the way's chunks in
this epoch's order through the stages (stage ``s`` computes chunk ``c`` while stage ``s+1``
computes the chunk before it; sends are asynchronous), then the backwards in reverse, stage 0's
encoder backward, one optimizer step with the gradients of all chunks summed (weights are never
stale) after the ways of each stage have summed theirs (a bucketed ring all-reduce in the graph
group, op ``grad_allreduce``). Between stages travel only a chunk's rows (op ``pipeline_fwd``)
and their gradients (``pipeline_bwd``), point to point, way ``g`` to way ``g``; for GCNII the
chunk's rows of the initial residual ``x0`` travel with them. The loss of a chunk is the *sum*
of its training nodes' cross-entropy over the *global* training count, so the chunks' and ways'
gradients add up to the whole graph's: with one chunk per way and dropout off, training is
single-process training up to floating-point summation order (tested, every kind).

**Set-up** (ledger epoch -1): stage 0 fetches the input features of its way's halo once (op
``halo_setup``; ``graph_parallel.cache_input_halo``, graph mode may turn it off); the counts
(training rows, mirrors and rows per way) are summed over the world (op ``control``); with more
than one chunk per way one exact pass fills the buffers (the warm start).

**Bytes per epoch** (all ranks; ``costmodel.bytes.hybrid_bytes``, one closed form for every mode):
``2 Σ_{s>=1} N (d_s + d_x0) b`` (the pipeline) ``+ Σ_g M_g · b · (k d_0 + 2 Σ_{l>=1} d_l)``
(the halo; ``k`` = 0 with the input halo cached, 1 for raw features exchanged, 2 behind an
encoder; ``d_l`` for ``l >= 1`` the narrow side with one chunk per way, ``Stage.halo_dims``) ``+ Σ_s 2 (G-1) params_s b`` (the all-reduce). ``G = P`` is graph parallelism's
``2 ΣM Σ d b + 2 (P-1) params b``, ``G = 1`` GNNPipe's ``2 (S-1) N H b``: independent of ``L``,
of the edges and of the cut.

**Time split** (``EpochStats``, this rank): ``bubble_s`` is the time blocked waiting for a
neighbour stage's rows or gradients (posted ahead, so idle time with nothing to do, including
the transfer of the awaited message) and, with several stages, the final wait for the loss;
``comm_s`` the time blocked in halo exchanges, in the all-reduce and completing this stage's
sends; ``compute_s`` the rest of the epoch.
"""

from __future__ import annotations

import logging
import resource
import time
from collections import OrderedDict
from dataclasses import replace
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from .. import schedule
from ..config import ConfigError, RunConfig
from ..costmodel.bytes import first_input, hybrid_bytes
from ..engine import DTYPES, SPLITS, EpochStats, OptimizerHooks, ce_sum, correct_counts, make_optimizer, node_habits
from ..io import GnnPipeError
from ..layout import PIPELINED, check_layout
from ..models.block import Block
from ..models.model import GNN
from ..store import ChunkStore, open_run_store
from .balance import StageAssignment, assign_stages
from .comm import Communicator
from .halo import way_plans
from .stage import Chunk, Stage, WayData

log = logging.getLogger(__name__)


def check_config(cfg: RunConfig, groups=None) -> None:
    """Refuse a run the layout engine cannot run, with the reason (before anything is read)."""
    where = f"run {cfg.run_id}"
    if cfg.mode not in ("graph", *PIPELINED):
        raise GnnPipeError(f"{where}: the layout engine runs modes graph, pipeline and hybrid, not {cfg.mode!r}")
    pipelined = cfg.mode in PIPELINED
    if pipelined and cfg.model.kind == "mlp":
        raise GnnPipeError(f"{where}: model kind 'mlp' has no graph layers to pipeline; use mode single or graph")
    # one chunk per way is the exactness configuration (plain model parallelism, no history): allowed
    check_layout(cfg.mode, cfg.workers, cfg.stages, cfg.ways, cfg.chunks,
                 layers=cfg.model.layers if pipelined else None, exact_ok=True, where=where)
    if not cfg.store_path:
        raise GnnPipeError(f"{where}: mode {cfg.mode} needs a chunk store (store_path)")
    if cfg.mode == "hybrid" and not cfg.graph_parallel.cache_input_halo:
        raise ConfigError(f"{where}: mode hybrid always fetches the input features' halo once at set-up; "
                          f"graph_parallel.cache_input_halo: false is not supported there (set it to true, "
                          f"or use mode graph to exchange the input every epoch)")
    pc = cfg.pipeline
    if not 0.0 <= pc.momentum < 1.0:
        raise GnnPipeError(f"{where}: pipeline.momentum must lie in [0, 1), got {pc.momentum}")
    if pc.snapshot_every < 0:
        raise GnnPipeError(f"{where}: pipeline.snapshot_every must be >= 0 (0: off), got {pc.snapshot_every}")
    if pc.grad_scale <= 0:
        raise GnnPipeError(f"{where}: pipeline.grad_scale must be > 0, got {pc.grad_scale}")
    if groups is not None:
        check_groups(cfg, (groups.dims.world_size, groups.dims.stages, groups.dims.ways))


def check_groups(cfg: RunConfig, have: tuple[int, int, int]) -> None:
    """The process groups (world size, stages, ways) are the run's layout."""
    if have != (cfg.workers, cfg.stages, cfg.ways):
        raise GnnPipeError(f"run {cfg.run_id} is laid out for {cfg.workers} workers, the process group has "
                           f"{have[0]} ({cfg.stages} stages x {cfg.ways} ways in the run, {have[1]} x {have[2]} here)")


class EpochClock:
    """Blocked time by kind; compute is the epoch's remainder."""

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


def peak_memory() -> tuple[int, str]:
    """This process's peak memory and how it was measured."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated()), "cuda.max_memory_allocated"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "ru_maxrss (whole process, KiB*1024)"


class LayoutEngine(OptimizerHooks):
    """One worker (stage ``s``, way ``g``) of an ``S × G`` layout: the ``Engine`` protocol of
    ``gnnpipe.engine`` for modes graph, pipeline and hybrid."""

    def __init__(self, cfg: RunConfig, groups, comm: Optional[Communicator], device):
        check_config(cfg, groups)
        if groups is None:  # one process, no group
            check_groups(cfg, (1, 1, 1))
        if comm is None:  # one process, no group: the communicator's one-rank shortcut
            comm = Communicator(groups, device)
        self.cfg, self.groups, self.comm = cfg, groups, comm
        self.device = torch.device(device)
        self.dtype = DTYPES[cfg.training.dtype]
        self.S, self.G, self.C = cfg.stages, cfg.ways, cfg.chunks
        self.Cw = self.C // self.G  # chunks per way
        self.stage_index = groups.stage_index if groups is not None else 0
        self.way = groups.way_index if groups is not None else 0
        self.first, self.last = self.stage_index == 0, self.stage_index == self.S - 1
        self.prev = groups.prev_rank() if groups is not None else None
        self.next = groups.next_rank() if groups is not None else None
        self.group = groups.graph if (groups is not None and self.G > 1) else None
        gp = cfg.graph_parallel
        self.overlap, self.cache_input = bool(gp.overlap), bool(gp.cache_input_halo)

        store = open_run_store(cfg, self.C)
        try:
            self.N, self.E = store.num_nodes, store.num_edges
            self.in_features, self.num_classes = store.num_features, store.num_classes
            loaded = self._load(store)
        finally:
            store.close()
        torch.manual_seed(cfg.training.seed)  # every rank and mode starts from the same weights
        gnn = GNN(cfg.model, self.in_features, self.num_classes).to(self.device, self.dtype)
        self.data = self._setup_exchanges(loaded, fetch_halo=self.cache_input and len(gnn.convs) > 0)
        self.dims = gnn.exchange_dims()
        self.needs_x0 = gnn.needs_x0
        self.first_input = first_input(gnn, gp) if self.G > 1 else "local"
        L = len(gnn.convs)
        if self.S == 1:
            self.assignment = StageAssignment([(0, L)], "one stage", [0.0] * L)
        else:
            sample = max(self.data.chunks, key=lambda ch: ch.block.nnz)  # profile: the largest chunk
            self.assignment = assign_stages(gnn, self.S, cfg.pipeline.balance, num_nodes=self.N, num_edges=self.E,
                                            sample_block=sample.block, comm=comm, dtype=self.dtype)
            if self.first and self.way == 0:
                log.info("%s x %s: %s", self.S, self.G, self.assignment)
        a, b = self.assignment.bounds[self.stage_index]
        self.layers = list(range(a, b))
        # the modules each stage owns, under their single-process names
        self.full_keys = [(k, tuple(v.shape), v.dtype) for k, v in gnn.state_dict().items()]
        for k, _, _ in self.full_keys:
            self._owner(k)  # every weight has an owner stage
        self.params_per_stage = [0] * self.S
        for k, p in gnn.named_parameters():
            if p.requires_grad:
                self.params_per_stage[self._owner(k)] += p.numel()
        self.stage = Stage(gnn, self.data, layers=self.layers, first=self.first, last=self.last, comm=comm,
                           group=self.group, cfg=cfg, n_train=self.n_train, device=self.device)
        self.halo_dims = self.stage.halo_dims  # the narrow side where nothing is buffered
        del gnn  # the other stages' convs are not ours to keep
        self.params = [p for _, m in self.stage.owned for p in m.parameters() if p.requires_grad]
        self.opt = make_optimizer(self.params, cfg.training)
        self.habits = node_habits(self, cfg.training, self._stages_norm if self.S > 1 else None)
        self.warm_started = self.Cw > 1
        if self.warm_started:
            self._exact_pass(fill=True)

    # ------------------------------------------------------------------ set-up
    def _load(self, store: ChunkStore) -> WayData:
        """The way's block of chunks against its source space (own rows, then its halo ``H_g``),
        and the data this stage reads: stage 0 its own rows' features, the last stage their
        labels and masks."""
        dev, G, Cw, g = self.device, self.G, self.Cw, self.way
        mine = list(range(g * Cw, (g + 1) * Cw))
        offsets = [int(o) for o in store.offsets]
        A, B = offsets[mine[0]], offsets[mine[-1] + 1]
        n_own = B - A
        halos = {c: store.read_part(c, "halo").astype(np.int64) for c in mine}
        allh = np.concatenate(list(halos.values()))
        way_halo = np.unique(allh[(allh < A) | (allh >= B)])  # H_g, sorted, grouped by owner way

        def loc(ids: np.ndarray) -> Tensor:
            own = (ids >= A) & (ids < B)
            return torch.as_tensor(np.where(own, ids - A, n_own + np.searchsorted(way_halo, ids)),
                                   dtype=torch.int64).to(dev)

        steps, whole = way_plans(store, g, G, way_halo, dev, self.group) if G > 1 else ([None] * Cw, None)
        chunks = []
        for j, c in enumerate(mine):
            ch = Chunk(offsets[c] - A, offsets[c + 1] - A, store.local_block(c, self.dtype).to(dev), loc(halos[c]),
                       torch.as_tensor(store.part_of(halos[c]) % Cw, dtype=torch.int64).to(dev), steps[j],
                       whole_way=Cw == 1)
            chunks.append(ch.split(store.n_inner(c) if (G > 1 and self.overlap) else 0))
        if Cw == 1:  # the chunk is the way: the exact passes run on the same blocks
            way_chunk = chunks[0]
        elif G == 1:  # one way: the exact passes run chunk by chunk (no second copy of the graph)
            way_chunk = Chunk(0, n_own, None, loc(way_halo), torch.zeros(0, dtype=torch.int64, device=dev), None,
                              whole_way=True)
        else:  # the way's rows against own rows then H_g
            ptrs = [store.read_part(c, "indptr") for c in mine]
            base = np.cumsum([0] + [int(q[-1]) for q in ptrs[:-1]])
            indptr = np.concatenate([[0]] + [q[1:] + b for q, b in zip(ptrs, base)])
            indices = np.concatenate([store.read_part(c, "indices") for c in mine]).astype(np.int64)
            deg_out = store.deg_out()
            block = Block.from_numpy(indptr, loc(indices).cpu().numpy(), n_own + len(way_halo), 0,
                                     np.concatenate([store.read_part(c, "deg_in") for c in mine]),
                                     np.concatenate([deg_out[A:B], deg_out[way_halo]]), self.dtype)
            way_chunk = Chunk(0, n_own, block.to(dev), loc(way_halo),
                              torch.zeros(len(way_halo), dtype=torch.int64, device=dev), whole, whole_way=True)
        out = WayData(chunks, way_chunk, way_halo)
        read = lambda name: np.concatenate([store.read_part(c, name) for c in mine])  # noqa: E731
        if self.last:
            out.labels = torch.as_tensor(read("labels")).to(dev)
            out.masks = {s: torch.as_tensor(read(f"{s}_mask")).to(dev) for s in SPLITS}
        if self.first:
            out.features = torch.as_tensor(read("features")).to(dev, self.dtype)
        return out

    def _setup_exchanges(self, way: WayData, fetch_halo: bool) -> WayData:
        """Once per run (ledger epoch -1): stage 0 fetches its way's halo features (``fetch_halo``:
        the input halo cached, and a conv to read it); the world sums the training rows and each
        way's mirrors and rows. Returns ``way`` with the source space's features."""
        G, dev, comm = self.G, self.device, self.comm
        if self.first and G > 1 and fetch_halo:
            plan, features = way.whole.plan, way.features  # (n_own, F)
            halo = comm.all_to_all_rows(features.index_select(0, plan.send_index), plan.send_rows,
                                        plan.recv_rows, self.group, op="halo_setup")
            way = replace(way, features=torch.cat([features, halo]))  # (n_own + M_g, F): own rows, then the halo's
        vec = torch.zeros(1 + 2 * G, dtype=torch.float64, device=dev)
        if self.last:
            vec[0] = float(way.masks["train"].sum())
        if self.first:
            vec[1 + self.way], vec[1 + G + self.way] = len(way.halo), way.n_own
        comm.all_reduce_(vec, op="control")
        v = [int(round(x)) for x in vec.tolist()]
        self.n_train = max(v[0], 1)
        self.mirrors, self.nodes_per_way = v[1:1 + G], v[1 + G:]
        return way

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

    # ------------------------------------------------------------------ the schedule's executor
    def train_epoch(self, epoch: int) -> EpochStats:
        """One epoch: this stage's actions of the schedule, then the step (module docstring)."""
        clock = EpochClock(self.comm, self.device)
        st, comm = self.stage, self.comm
        st.train_mode(True)
        self.opt.zero_grad(set_to_none=True)
        self.habits.begin_epoch(epoch)
        ep = st.begin_epoch(epoch, self.cfg.training.seed)
        recvs, ready, sends, direction = {}, {}, [], "forward"
        for a in schedule.gpipe(self.S, ep.order)[self.stage_index]:
            if a.direction != direction:  # the forward's sends complete before the backward starts
                for w in sends:
                    clock.wait(w, "comm")
                sends, direction = [], a.direction
            fwd = a.direction == "forward"
            if a.kind in (schedule.RECV_F, schedule.RECV_B):  # posted ahead, into a buffer of its own
                ch = st.chunks[a.chunk]
                buf = torch.empty(ch.end - ch.start, st.in_width() if fwd else st.out_width(), device=self.device,
                                  dtype=self.dtype)
                recvs[a.direction, a.chunk] = comm.irecv(buf, self.prev if fwd else self.next,
                                            op="pipeline_fwd" if fwd else "pipeline_bwd", tag=a.tag(self.Cw))
            elif a.kind in (schedule.F, schedule.B):
                key = (a.direction, a.chunk)
                arrived = clock.wait(recvs.pop(key), "bubble") if key in recvs else None
                run = st.forward if fwd else st.backward
                ready[a.chunk] = run(a.chunk, ep, arrived, clock)
            else:  # SEND_F / SEND_B
                sends.append(comm.isend(ready.pop(a.chunk), self.next if fwd else self.prev,
                                        op="pipeline_fwd" if fwd else "pipeline_bwd", tag=a.tag(self.Cw)))
        st.end_backward(ep)
        for w in sends:
            clock.wait(w, "comm")
        st.end_epoch()
        # the loss is known on the last stage; every rank returns it
        total = ep.loss.reshape(1)
        loss_work = comm.all_reduce_(total, op="control", async_op=True)
        self._reduce_grads(clock)
        self.opt.step()
        clock.wait(loss_work, "bubble" if self.S > 1 else "comm")  # several stages: the drain
        return clock.stats(float(total[0]))

    def _reduce_grads(self, clock: EpochClock) -> None:
        """The ways' gradients of this stage's weights, summed (bucketed ring all-reduce)."""
        for p in self.params:  # a parameter without a gradient still takes part in the all-reduce
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.G > 1:
            clock.sync()
            t0 = time.perf_counter()
            self.comm.all_reduce_coalesced_([p.grad for p in self.params], group=self.group, op="grad_allreduce")
            clock.comm_s += time.perf_counter() - t0

    def _stages_norm(self, local: Tensor) -> Tensor:
        """The 2-norm of the whole model's gradients from this stage's (``local``): the stages' squares
        summed over the world (op ``control``), way 0's of each stage (its ways hold the same gradients)."""
        sq = (local * local * float(self.way == 0)).reshape(1)
        self.comm.all_reduce_(sq, op="control")
        return sq.sqrt()[0]

    # ------------------------------------------------------------------ exact passes
    def _exact_pass(self, fill: bool) -> Optional[Tensor]:
        """The way's whole block through the stages (op ``control``); the logits of its rows on
        the last stage, None elsewhere. ``fill``: the warm start."""
        st, tag = self.stage, schedule.tag("exact_pass", self.Cw)
        h = x0 = None
        if not self.first:
            buf = torch.empty(self.data.n_own, st.in_width(), device=self.device, dtype=self.dtype)
            self.comm.recv(buf, self.prev, op="control", tag=tag)
            d = self.dims[self.layers[0]]
            h, x0 = buf[:, :d], (buf[:, d:] if self.needs_x0 else None)
        h, x0 = st.exact_forward(h, x0, fill)
        if self.last:
            return h
        payload = torch.cat([h, x0], dim=1) if self.needs_x0 else h
        self.comm.send(payload.contiguous(), self.next, op="control", tag=tag)
        return None

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Exact full-graph inference: accuracy per split and the training loss, on every rank."""
        with self.habits.averaged():  # the weights' moving average where the run keeps one
            logits = self._exact_pass(fill=False)
        vals = torch.zeros(2 * len(SPLITS) + 1, dtype=torch.float64, device=self.device)
        if self.last:
            labels, masks = self.data.labels, self.data.masks
            counts = correct_counts(logits, labels, {s: masks[s] for s in SPLITS})
            for i, s in enumerate(SPLITS):
                vals[2 * i], vals[2 * i + 1] = counts[s]
            vals[-1] = float(ce_sum(logits, labels, masks["train"]))
        self.comm.all_reduce_(vals, op="control")
        v = vals.tolist()
        out = {f"{s}_acc": (v[2 * i] / v[2 * i + 1] if v[2 * i + 1] else 0.0) for i, s in enumerate(SPLITS)}
        out["loss"] = v[-1] / max(v[1], 1.0)
        return out

    # ------------------------------------------------------------------ weights and bytes
    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """This stage's parameters under their single-process names."""
        return {f"{prefix}.{k}": p for prefix, m in self.stage.owned for k, p in m.named_parameters()}

    def full_state_dict(self) -> Optional[dict[str, Tensor]]:
        """The whole model's weights under the single-process names on rank 0 (None elsewhere).

        Collective over way 0 of every stage (the ways hold identical replicas): each stage
        sends its weights to rank 0, one message per dtype (op ``control``); rank 0 knows every
        shape from the model it built."""
        if self.way != 0:
            return None
        local = self.habits.final_state(self.stage.local_state_dict())
        if self.S == 1:
            return OrderedDict((k, local[k].cpu().clone()) for k, _, _ in self.full_keys)
        tag, root = schedule.tag("weights", self.Cw), self.groups.dims.rank_of(0, 0)
        if self.groups.rank != root:
            for dtype, names in self._by_dtype(self.stage_index):
                flat = torch.cat([local[k].reshape(-1) for k in names])
                self.comm.send(flat.contiguous(), root, op="control", tag=tag)
            return None
        state = {k: v.cpu().clone() for k, v in local.items()}
        shapes = {k: shape for k, shape, _ in self.full_keys}
        for s in range(1, self.S):
            for dtype, names in self._by_dtype(s):
                numel = [int(np.prod(shapes[k], dtype=np.int64)) for k in names]
                flat = torch.empty(sum(numel), dtype=dtype, device=self.device)
                self.comm.recv(flat, self.groups.dims.rank_of(s, 0), op="control", tag=tag)
                for k, piece in zip(names, flat.cpu().split(numel)):
                    state[k] = piece.view(shapes[k]).clone()
        return OrderedDict((k, state[k]) for k, _, _ in self.full_keys)

    def _by_dtype(self, stage: int) -> list[tuple[torch.dtype, list[str]]]:
        groups: dict[torch.dtype, list[str]] = {}
        for k, _, dtype in self.full_keys:
            if self._owner(k) == stage:
                groups.setdefault(dtype, []).append(k)
        return list(groups.items())

    def state_dict(self) -> dict:
        """This rank's training state: its weights and Adam's moments and, in the pipelined modes,
        the convs it owns and the history buffers (values, snapshot or moving average, gradients
        waiting for the next epoch), which a resumed run must continue from exactly; the habits' guard
        and moving average (``gnnpipe.habits``) in every mode."""
        out = {"model": self.stage.local_state_dict(), "optimizer": self.opt.state_dict(),
               **self.habits.state_dict()}
        if self.cfg.mode in PIPELINED:
            out.update(layers=list(self.layers), **self.stage.buffer_state())
        return out

    def load_state_dict(self, state: dict) -> None:
        pipelined = self.cfg.mode in PIPELINED
        if pipelined and list(state["layers"]) != self.layers:
            raise ValueError(f"stage {self.stage_index} owns convs {self.layers}, the checkpoint's stage owned "
                             f"{list(state['layers'])} (pipeline.balance 'profile' measures, it may differ)")
        model, local = state["model"], self.stage.local_state_dict()
        for prefix, m in self.stage.owned:  # strict: a shard of another layout raises
            m.load_state_dict({k[len(prefix) + 1:]: v for k, v in model.items() if k.startswith(prefix + ".")})
        if len(model) != len(local):
            raise ValueError(f"the checkpoint holds {len(model)} weights, stage {self.stage_index} has {len(local)}")
        self.opt.load_state_dict(state["optimizer"])
        self.habits.load_state_dict(state)
        if pipelined:
            self.stage.load_buffer_state(state)

    def predicted_bytes_by_kind(self) -> dict[str, int]:
        return hybrid_bytes(self.N, self.mirrors, self.dims, self.assignment.bounds, self.params_per_stage,
                            self.dtype.itemsize, self.needs_x0, nodes_per_way=self.nodes_per_way,
                            first_input=self.first_input, halo_dims=self.halo_dims)

    def predicted_bytes(self) -> int:
        """Closed form of the training bytes all ranks send per epoch (not read from the ledger)."""
        return self.predicted_bytes_by_kind()["total"]

    def graph_info(self) -> dict:
        return {"num_nodes": self.N, "num_edges": self.E, "in_features": self.in_features}

    def extra_info(self) -> dict:
        """What the run record keeps about the layout (rank 0's view; no collective)."""
        pc, peak = self.cfg.pipeline, peak_memory()
        return {"layout": {
            "stages": self.S, "ways": self.G, "chunks": self.C, "chunks_per_way": self.Cw,
            "stage_assignment": self.assignment.as_dict(), "mirrors_per_way": self.mirrors,
            "nodes_per_way": self.nodes_per_way, "chunk_rows": [ch.end - ch.start for ch in self.data.chunks],
            "halo_rows": [int(ch.halo.numel()) for ch in self.data.chunks], "warm_start": self.warm_started,
            "overlap": self.overlap, "cache_input_halo": self.cache_input, "first_input": self.first_input,
            "predicted_bytes": self.predicted_bytes_by_kind(),
            "setup_bytes_rank0": self.comm.epoch_bytes(-1, exclude=("control",)),
            "rank0_peak_mem_bytes": peak[0], "peak_mem_method": peak[1],
            "techniques": {"shuffle_chunks": pc.shuffle_chunks, "grad_correction": pc.grad_correction,
                           "grad_scale": pc.grad_scale, "snapshot_every": pc.snapshot_every,
                           "momentum": pc.momentum, "recompute": pc.recompute}}}
