"""The trainer: one loop for every mode, and the single-process engine.

One process (``single``)::

    gnnpipe train --run-config results/runs/<run_id>/run.yaml

P processes on one node (``graph``, ``pipeline``, ``hybrid``)::

    torchrun --standalone --nproc-per-node P -m gnnpipe.cli train --run-config run.yaml

Several nodes (Slurm or by hand)::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
             --rdzv-endpoint $HEAD:29500 -m gnnpipe.cli train --run-config run.yaml

The trainer branches once on the mode to build an engine (``engine.Engine``), then runs
the epochs, reduces the per-rank statistics, checkpoints, and on rank 0 writes the run
record ``<out_dir>/metrics.json`` (docs/DESIGN.md §6) and logs the run to MLflow.
"""

from __future__ import annotations

import datetime
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from .config import RunConfig, dump_run_config, to_dict
from .engine import DTYPES, EpochStats, ce_sum, make_optimizer
from .evaluate import exact_metrics, graph_tensors, run_fingerprint
from .graph import read_graph
from .io import GnnPipeError, atomic_path, write_json, write_text
from .models.block import Block
from .models.model import GNN
from .parallel.dims import ParallelDims, ProcessGroups, build_groups


class SingleEngine:
    """The whole graph and the whole model in one process: the accuracy reference."""

    comm = None

    def __init__(self, cfg: RunConfig, device: torch.device):
        self.cfg = cfg
        dtype = DTYPES[cfg.training.dtype]
        graph = read_graph(cfg.graph_path)
        self.num_nodes, self.num_edges, self.in_features = graph.num_nodes, graph.num_edges, graph.num_features
        self.block = Block.full(graph.indptr, graph.indices, dtype).to(device)
        self.x, self.y, self.masks = graph_tensors(graph, dtype, device)
        self.n_train = max(int(self.masks["train"].sum()), 1)
        torch.manual_seed(cfg.training.seed)
        self.model = GNN(cfg.model, graph.num_features, graph.num_classes).to(device, dtype)
        self.opt = make_optimizer(self.model.parameters(), cfg.training)

    def train_epoch(self, epoch: int) -> EpochStats:
        t0 = time.perf_counter()
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(self.x, self.block)  # (N, C)
        loss = ce_sum(logits, self.y, self.masks["train"]) / self.n_train
        loss.backward()
        self.opt.step()
        return EpochStats(loss=float(loss.detach()), compute_s=time.perf_counter() - t0)

    def evaluate(self) -> dict[str, float]:
        return exact_metrics(self.model, self.block, self.x, self.y, self.masks)

    def full_state_dict(self):
        return self.model.state_dict()

    def predicted_bytes(self) -> int:
        return 0

    def graph_info(self) -> dict:
        return {"num_nodes": self.num_nodes, "num_edges": self.num_edges, "in_features": self.in_features}

    def extra_info(self) -> dict:
        return {}


# --------------------------------------------------------------------------- process set-up
def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def init_distributed(cfg: RunConfig, device: torch.device) -> tuple[int, int]:
    """Join the torchrun world (``single`` needs none); return (rank, world_size)."""
    if cfg.mode == "single":
        return 0, 1
    if "RANK" not in os.environ and not dist.is_initialized():
        raise GnnPipeError(
            f"mode {cfg.mode} runs under torchrun: torchrun --standalone --nproc-per-node "
            f"{cfg.workers} -m gnnpipe.cli train --run-config <run.yaml>")
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(
            seconds=int(os.environ.get("GNNPIPE_DIST_TIMEOUT") or cfg.training.dist_timeout_s)))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != cfg.workers:
        raise GnnPipeError(f"run {cfg.run_id} needs {cfg.workers} workers but torchrun started {world}; "
                           f"use --nproc-per-node {cfg.workers}")
    return rank, world


def build_engine(cfg: RunConfig, groups: Optional[ProcessGroups], comm, device):
    """The one branch on the mode (atomic models: one engine for single and graph)."""
    if cfg.atomic:
        from .atomic.engine import AtomicEngine
        return AtomicEngine(cfg, comm, device, groups)
    if cfg.mode == "single":
        return SingleEngine(cfg, device)
    if cfg.mode == "graph":
        from .parallel.graph_parallel import GraphEngine
        return GraphEngine(cfg, groups, comm, device)
    if cfg.mode == "pipeline":
        from .parallel.pipeline import PipelineEngine
        return PipelineEngine(cfg, groups, comm, device)
    if cfg.mode == "hybrid":
        from .parallel.hybrid import HybridEngine
        return HybridEngine(cfg, groups, comm, device)
    raise GnnPipeError(f"unknown mode {cfg.mode!r}")


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: CUDA allocator peak on GPU, max resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class _Reducer:
    """Reduces per-rank scalars across the world (op ``control``: not training traffic)."""

    def __init__(self, comm, world: int):
        self.comm, self.world = comm, world

    def __call__(self, values: list[float], op: str) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        dist.all_reduce(t, op=red)  # tiny: a handful of floats per epoch
        return t.tolist()


# --------------------------------------------------------------------------- the loop
def run(cfg: RunConfig, *, progress: bool = True) -> Optional[dict]:
    """Train one run. Returns the run record on rank 0 (None elsewhere)."""
    torch.set_num_threads(max(int(os.environ.get("OMP_NUM_THREADS", 0)) or cfg.training.threads_per_worker, 1))
    device = _device()
    rank, world = init_distributed(cfg, device)
    groups = comm = None
    if cfg.mode != "single":
        from .parallel.comm import Communicator
        dims = ParallelDims(cfg.mode, world, cfg.stages, cfg.ways, cfg.data_parallel)
        groups = build_groups(dims, rank)
        comm = Communicator(groups, device)
    try:
        record = _train(cfg, build_engine(cfg, groups, comm, device), comm, rank, world, device, progress)
    finally:
        if cfg.mode != "single" and dist.is_initialized():
            dist.destroy_process_group()
    return record


def _train(cfg: RunConfig, engine, comm, rank: int, world: int, device, progress: bool) -> Optional[dict]:
    tc = cfg.training
    out_dir = Path(cfg.out_dir)
    reduce = _Reducer(comm, world)
    history, times, splits = [], [], []
    last_eval: dict[str, float] = {}
    bar = None
    if rank == 0 and progress:
        from tqdm import tqdm
        bar = tqdm(total=tc.epochs, desc=f"train {cfg.run_id}", unit="epoch", file=sys.stderr,
                   disable=not sys.stderr.isatty() and not os.environ.get("GNNPIPE_PROGRESS"))
    for epoch in range(tc.epochs):
        if comm is not None:
            comm.set_epoch(epoch)
        if world > 1:
            dist.barrier()  # every rank starts the epoch together: the timing is the epoch's
        t0 = time.perf_counter()
        stats = engine.train_epoch(epoch)
        wall = time.perf_counter() - t0
        sent = comm.epoch_bytes(epoch) if comm is not None else 0
        wall_max, = reduce([wall], "max")
        compute, comm_s, bubble, sent_total = reduce(
            [stats.compute_s, stats.comm_s, stats.bubble_s, float(sent)], "sum")
        row = {"epoch": epoch, "loss": stats.loss, "epoch_time_s": wall_max,
               "compute_s": compute / world, "comm_s": comm_s / world, "bubble_s": bubble / world,
               "comm_bytes": int(sent_total), "train_acc": None, "val_acc": None, "test_acc": None}
        if (epoch + 1) % max(tc.eval_every, 1) == 0 or epoch == tc.epochs - 1:
            if comm is not None:
                comm.set_epoch(-1)  # evaluation traffic is not an epoch's training traffic
            last_eval = engine.evaluate()
            row.update({k: v for k, v in last_eval.items() if k != "loss"})
        history.append(row)
        if epoch >= tc.warmup_epochs or tc.epochs <= tc.warmup_epochs:
            times.append(wall_max)
            splits.append(row)
        if tc.checkpoint_every and (epoch + 1) % tc.checkpoint_every == 0 and epoch != tc.epochs - 1:
            _checkpoint(engine, out_dir / "checkpoint.pt", epoch, cfg, rank)  # never model.pt: see _checkpoint
        if bar is not None:
            val = last_eval.get("val_acc") if not cfg.atomic else last_eval.get("val_energy_mae")
            bar.set_postfix(loss=f"{stats.loss:.4f}", val=f"{val if val is not None else float('nan'):.3f}")
            bar.update()
    if bar is not None:
        bar.close()
    _checkpoint(engine, out_dir / "model.pt", tc.epochs - 1, cfg, rank)
    peak, = reduce([float(peak_memory_bytes(device))], "max")
    if rank != 0:
        return None
    record = _record(cfg, engine, history, times, splits, last_eval, int(peak))
    write_text(out_dir / "run.resolved.yaml", dump_run_config(cfg))
    write_json(out_dir / "metrics.json", record)  # kept even if MLflow fails below
    from .tracking import log_training
    log_training(cfg, record, out_dir)  # sets record["mlflow_run_id"], rewrites metrics.json
    return record


#: OC20 S2EF metrics of atomic runs, at the top of the run record (docs/DESIGN.md §4)
ATOMIC_METRICS = ("energy_mae", "force_mae", "force_cos", "efwt")


def _median(values):
    return float(statistics.median(values)) if values else 0.0


def _record(cfg, engine, history, times, splits, last_eval, peak) -> dict:
    """The run record (docs/DESIGN.md §6); parallel-only fields are 0/1 for ``single``."""
    graph_info = engine.graph_info()
    bytes_timed = [r["comm_bytes"] for r in splits]
    record = {
        "run_id": cfg.run_id, "mode": cfg.mode, "dataset": cfg.dataset_name, **graph_info,
        "model": cfg.model.kind, "layers": cfg.model.layers, "hidden": cfg.model.hidden,
        "world_size": cfg.workers, "stages": cfg.stages, "ways": cfg.ways, "data_parallel": cfg.data_parallel,
        "chunks": cfg.chunks if cfg.mode in ("pipeline", "hybrid") else 1,
        "parts": cfg.chunks if cfg.mode != "single" else 1,
        "epochs": cfg.training.epochs, "dtype_bytes": DTYPES[cfg.training.dtype].itemsize,
        "epoch_time_s": _median(times),
        "epoch_time_breakdown_s": {k: _median([r[f"{k}_s"] for r in splits]) for k in ("compute", "comm", "bubble")},
        "comm_bytes_per_epoch": int(statistics.median(bytes_timed)) if bytes_timed else 0,
        "comm_bytes_predicted": int(engine.predicted_bytes()),
        "peak_mem_bytes": peak,
        "train_acc": last_eval.get("train_acc"), "val_acc": last_eval.get("val_acc"),
        "test_acc": last_eval.get("test_acc"), "final_loss": history[-1]["loss"] if history else None,
        **({k: last_eval.get(k) for k in ATOMIC_METRICS} if cfg.atomic else {}),
        "mlflow_run_id": None,
        "extra": engine.extra_info(),
        "history": history,
    }
    if cfg.atomic:  # interaction blocks and their width; the edge split's ways
        record.update(layers=engine.model_cfg.num_blocks, hidden=engine.model_cfg.hidden_channels,
                      parts=cfg.ways)
    return record


def _checkpoint(engine, path: Path, epoch: int, cfg: RunConfig, rank: int) -> None:
    """Save the weights after ``epoch`` with what they were trained from (``run_fingerprint``).

    Intermediate checkpoints go to ``checkpoint.pt``, the finished model alone to ``model.pt``
    (the train rule's output): a run killed half-way never leaves a partial ``model.pt`` that
    ``evaluate`` or Snakemake would take for the result.
    """
    state = engine.full_state_dict()  # collective in model-parallel modes: every rank calls it
    if rank != 0:
        return
    with atomic_path(path, ".pt") as tmp:
        torch.save({"model": {k: v.detach().cpu() for k, v in state.items()}, "epoch": epoch,
                    "epochs_done": epoch + 1, "run_id": cfg.run_id, "config": to_dict(cfg),
                    **run_fingerprint(cfg)}, tmp)
