"""Graph parallelism: P workers, one graph partition each, every layer on every worker.

The baseline GNNPipe is compared against (docs/DESIGN.md §4), built to be strong, not a
strawman (compare PipeGCN / BNS-GCN / SAR without their approximations: this engine is
exact). Worker ``p`` reads only part ``p`` of the chunk store: its rows
``[start, end)`` (renumbered so that the ``n_inner`` rows without an outside neighbour
come first), their in-edges, features, labels and masks, its halo and its send lists.
One training step::

    x_src = cat(x_own, x_halo)          x_halo fetched once at set-up (cache_input_halo)
    h     = conv_0(encode(x_src))       the first layer needs no exchange per epoch
    for conv in convs[1:]:
        halo  <- all-to-all(h[send rows])           (n_halo, d)   one flat all_to_all_single
        h     = conv(cat(h, halo), local block)      overlap: rows [0, n_inner) are
                                                     aggregated while the halo is in flight
    loss  = sum of CE over own train rows / global train count
    backward: halo gradients go back by the same all-to-all and are scatter-added into the
              owners' rows (derivation in parallel/halo.py); overlapped with the inner rows
    bucketed sum all-reduce of the weight gradients (flat buffers), Adam

Because degrees are whole-graph degrees and every part holds all in-edges of its rows,
each row's output is the single-process one; the loss normalisation is global, so the
summed gradients are the single-process gradients: with dropout off, training is
single-process training up to floating-point summation order (tested, every model
kind, overlap on and off).

Bytes per epoch (``costmodel.graph_parallel_bytes``, ``costmodel.first_input``): each conv ``l >= 1`` moves its input rows
``Σ_p M_p · d_l`` forward and their gradients back; the first conv moves nothing with
``cache_input_halo`` (default), otherwise its rows forward and, only when its input is
learned (an encoder: GCNII, ResGCN+), their gradients back: raw features need no
gradient, which is the one place this differs from the ``2 · Σ_p M_p · Σ_l d_l · b``
upper bound of docs/DESIGN.md. Plus the ring all-reduce of the parameters,
``2 (P-1) · num_params · b``.

Run it through the trainer::

    torchrun --standalone --nproc-per-node 4 -m gnnpipe.cli train --run-config run.yaml
"""

from __future__ import annotations

import resource
import time
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from ..config import RunConfig
from ..costmodel.bytes import first_input, graph_parallel_bytes
from ..engine import DTYPES, EpochStats, ce_sum, correct_counts, load_train_state, make_optimizer, train_state
from ..io import GnnPipeError
from ..models.block import Block
from ..models.model import GNN
from ..store import ChunkStore, open_run_store
from .comm import Communicator
from .halo import HaloPlan, finish_halo, halo_exchange, start_halo

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


def peak_memory() -> tuple[int, str]:
    """This process's peak memory and how it was measured."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated()), "cuda.max_memory_allocated"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "ru_maxrss (whole process, KiB*1024)"


class GraphEngine:
    """The ``graph`` mode's engine (``engine.Engine``): one partition per rank of the stage group."""

    def __init__(self, cfg: RunConfig, groups, comm: Communicator, device: torch.device):
        self.cfg, self.groups, self.comm = cfg, groups, comm
        self.device = torch.device(device)
        self.dtype = DTYPES[cfg.training.dtype]
        self.group = groups.graph if groups is not None else None
        self.world = comm.group_size(self.group)
        self.part = comm.group_rank(self.group)  # this rank's part: its way index
        if self.world != cfg.workers:
            raise GnnPipeError(f"graph parallelism: run {cfg.run_id} is laid out for {cfg.workers} "
                               f"workers, the process group has {self.world}")
        gp = cfg.graph_parallel
        self.overlap = bool(gp.overlap)
        self.cache_input = bool(getattr(gp, "cache_input_halo", True))

        store = open_run_store(cfg, self.world)
        try:
            self._load(store)
        finally:
            store.close()

        torch.manual_seed(cfg.training.seed)
        self.model = GNN(cfg.model, self.in_features, self.num_classes).to(self.device, self.dtype)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = make_optimizer(self.params, cfg.training)
        self.first_input = first_input(self.model, gp)  # mlp: no graph, plain data parallelism
        self._setup_exchanges()

    # ------------------------------------------------------------------ set-up
    def _load(self, store: ChunkStore) -> None:
        p, dev = self.part, self.device
        self.num_nodes, self.num_edges = store.num_nodes, store.num_edges
        self.in_features, self.num_classes = store.num_features, store.num_classes
        self.start, self.end = int(store.offsets[p]), int(store.offsets[p + 1])
        self.n_own = self.end - self.start
        self.n_inner = store.n_inner(p)
        self.block = store.local_block(p, self.dtype).to(dev)
        self.inner_block, self.boundary_block = split_block(self.block, self.n_inner, self.n_own)
        self.x = torch.as_tensor(store.read_part(p, "features")).to(dev, self.dtype)  # (n_own, F)
        self.y = torch.as_tensor(store.read_part(p, "labels")).to(dev)
        self.masks = {s: torch.as_tensor(store.read_part(p, f"{s}_mask")).to(dev) for s in ("train", "val", "test")}
        self.plan = HaloPlan.from_lists(store.send_index(p), store.recv_counts(p), self.n_own, dev, self.group)
        # M_q of every part, for the closed form (tiny per-part count arrays, not their data)
        self.mirrors = [sum(store.recv_counts(q)) for q in range(self.world)]
        if self.mirrors[p] != self.plan.n_halo or self.block.n_src != self.n_own + self.plan.n_halo:
            raise GnnPipeError(f"{store.path}: part {p}'s halo ({self.block.n_src - self.n_own} rows) does "
                               f"not match its receive counts ({self.plan.n_halo}); rebuild the store")

    def _setup_exchanges(self) -> None:
        """Once per run (ledger epoch -1): the global train count, the halo's features."""
        counts = torch.tensor([int(self.masks["train"].sum())], dtype=torch.int64, device=self.device)
        self.comm.all_reduce_(counts, group=self.group, op="control")
        self.n_train = max(int(counts.item()), 1)
        self.x_src: Optional[Tensor] = None
        if self.cache_input and len(self.model.convs):
            send = self.x.index_select(0, self.plan.send_index)
            halo = self.comm.all_to_all_rows(send, self.plan.send_rows, self.plan.recv_rows, self.group,
                                             op="halo_setup")
            self.x_src = torch.cat([self.x, halo])  # (n_own + n_halo, F): own rows, then halo rows
            self.x = self.x_src[: self.n_own]  # a view: the features are held once

    # ------------------------------------------------------------------ the model, distributed
    def _conv(self, conv, h: Tensor, x0: Optional[Tensor], op: str) -> Tensor:
        """One conv on this part: exchange ``h`` (own rows) for the halo, aggregate."""
        if not self.overlap:
            return conv(halo_exchange(h, self.plan, self.comm, op), self.block, x0)
        ni = self.n_inner
        pending = start_halo(h, self.plan, self.comm, op)
        own = pending.own
        outs = []
        if ni:  # these rows need no halo: aggregate them while it is in flight
            outs.append(conv(own, self.inner_block, None if x0 is None else x0[:ni]))
        halo = finish_halo(pending)
        if ni < self.n_own:
            outs.append(conv(torch.cat([own, halo]), self.boundary_block, None if x0 is None else x0[ni:]))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _forward(self, op: str) -> Tensor:
        """Logits of this part's own rows ``(n_own, C)``."""
        m = self.model
        convs = list(m.convs)
        if not convs:
            return m.decode(m.encode(self.x))
        if self.x_src is not None:
            # first layer from cached halo features: the per-row encoder runs on the halo
            # rows too (recomputed, not exchanged); x0 is the own rows' encoding
            src = m.encode(self.x_src)  # (n_own + n_halo, d_0)
            x0 = src[: self.n_own] if m.needs_x0 else None
            h = convs[0](src, self.block, x0)
            rest = convs[1:]
        else:
            h = m.encode(self.x)  # (n_own, d_0)
            x0 = h if m.needs_x0 else None
            rest = convs
        for conv in rest:
            h = self._conv(conv, h, x0, op)
        return m.decode(h)

    # ------------------------------------------------------------------ Engine
    def train_epoch(self, epoch: int) -> EpochStats:
        comm = self.comm
        c0 = comm.epoch_comm_s(epoch)
        t0 = time.perf_counter()
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        logits = self._forward("halo")
        loss = ce_sum(logits, self.y, self.masks["train"]) / self.n_train  # this part's share
        loss.backward()
        for p in self.params:  # a parameter without a gradient still takes part in the all-reduce
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        total = loss.detach().reshape(1).to(torch.float64)
        loss_work = comm.all_reduce_(total, group=self.group, op="control", async_op=True)
        comm.all_reduce_coalesced_([p.grad for p in self.params], group=self.group, op="grad_allreduce")
        self.opt.step()
        comm.wait(loss_work)
        wall = time.perf_counter() - t0
        comm_s = comm.epoch_comm_s(epoch) - c0
        return EpochStats(loss=float(total.item()), compute_s=max(wall - comm_s, 0.0), comm_s=comm_s)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Exact full-graph inference, distributed the same way (dropout off)."""
        was = self.model.training
        self.model.eval()
        try:
            logits = self._forward("control")
        finally:
            self.model.train(was)
        counts = correct_counts(logits, self.y, self.masks)
        loss_sum = float(ce_sum(logits, self.y, self.masks["train"]))
        vec = torch.tensor([v for s in ("train", "val", "test") for v in counts[s]] + [loss_sum],
                           dtype=torch.float64, device=self.device)
        self.comm.all_reduce_(vec, group=self.group, op="control")
        v = vec.tolist()
        out = {f"{s}_acc": (v[2 * i] / v[2 * i + 1] if v[2 * i + 1] else 0.0)
               for i, s in enumerate(("train", "val", "test"))}
        out["loss"] = v[6] / max(v[1], 1.0)
        return out

    def full_state_dict(self) -> Optional[dict[str, Tensor]]:
        """Weights are replicated: rank 0 returns its own, under the single-process names."""
        return self.model.state_dict() if self.part == 0 else None

    def state_dict(self) -> dict:
        """This rank's training state (weights and Adam's moments, the same on every part)."""
        return train_state(self.model, self.opt)

    def load_state_dict(self, state: dict) -> None:
        load_train_state(self.model, self.opt, state)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.params)

    def predicted_bytes_by_kind(self) -> dict[str, int]:
        return graph_parallel_bytes(self.mirrors, self.model.exchange_dims(), self.dtype.itemsize,
                                    self.num_params(), self.world, self.first_input)

    def predicted_bytes(self) -> int:
        """Closed form of the training bytes all ranks send per epoch (not read from the ledger)."""
        return self.predicted_bytes_by_kind()["total"]

    def graph_info(self) -> dict:
        return {"num_nodes": self.num_nodes, "num_edges": self.num_edges, "in_features": self.in_features}

    def extra_info(self) -> dict:
        """What the run record keeps about this mode (rank 0's view; no collective)."""
        peak, how = peak_memory()
        return {"graph_parallel": {
            "overlap": self.overlap, "cache_input_halo": self.cache_input, "first_input": self.first_input,
            "mirrors_per_part": self.mirrors, "mirrors_total": int(np.sum(self.mirrors)),
            "rank0_rows": self.n_own, "rank0_inner_rows": self.n_inner,
            "predicted_bytes": self.predicted_bytes_by_kind(),
            "setup_bytes_rank0": self.comm.epoch_bytes(-1, exclude=("control",)),
            "rank0_peak_mem_bytes": peak, "peak_mem_method": how,
        }}
