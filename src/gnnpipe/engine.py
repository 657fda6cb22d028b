"""What every mode's engine provides to the trainer, and the pieces they share.

The trainer (``gnnpipe.train``) branches once on the mode and builds one engine; the
engine owns the model shard, the optimizer and the data it needs. See
docs/ARCHITECTURE.md "Engines".
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import TrainingConfig
from .graph import Graph
from .habits import Habits
from .io import GnnPipeError, heap_retained
from .models.block import Block
from .models.model import GNN

DTYPES = {"float32": torch.float32, "float64": torch.float64}
SPLITS = ("train", "val", "test")


class NonFiniteError(GnnPipeError):
    """A non-finite loss or gradient: the run diverged (it stops at once, exit non-zero)."""


@dataclass
class EpochStats:
    """One training epoch as seen by one rank."""

    # the epoch's training loss, the same on all ranks: what the run's task trains (``Task.loss``):
    # node classification the mean cross-entropy over all training nodes of the whole graph; S2EF the
    # mean over the epoch's optimizer steps of each step's normalised energy + force loss (of the whole
    # step batch, every rank's share summed); energy-only the same with the energy term alone
    loss: float
    compute_s: float = 0.0  # this rank's time computing
    comm_s: float = 0.0  # this rank's time blocked in communication
    bubble_s: float = 0.0  # this rank's pipeline idle time (0 outside pipeline/hybrid)
    step_losses: Optional[list] = None  # engines with several optimizer steps an epoch (atomic): each step's


class Engine(Protocol):
    """What the trainer drives; every engine is built as ``Engine(cfg, groups, comm, device)`` (by its task,
    ``gnnpipe.tasks``; ``groups`` and ``comm`` None in one process)."""

    comm: Optional[object]  # gnnpipe.parallel.comm.Communicator, None for single
    habits: Habits  # schedule, clipping, EMA, guard on its optimizer's steps (gnnpipe.habits; the task's check)

    def train_epoch(self, epoch: int) -> EpochStats: ...

    def named_parameters(self) -> dict[str, Tensor]: ...  # this rank's parameters, single-process names

    def register_step_pre_hook(self, hook): ...  # on its optimizer (the habits; the trainer's non-finite gradient stop)

    def register_step_post_hook(self, hook): ...  # on its optimizer (the habits' moving average)

    def evaluate(self) -> dict[str, float]: ...

    def full_state_dict(self) -> Optional[dict[str, Tensor]]: ...

    def predicted_bytes(self) -> int: ...

    def state_dict(self) -> dict: ...  # this rank's training state, for a resumable checkpoint

    def load_state_dict(self, state: dict) -> None: ...

    def graph_info(self) -> dict: ...  # the run record's num_nodes, num_edges, in_features

    def extra_info(self) -> dict: ...  # what the run record keeps about this mode ("extra")


def retain_freed_memory() -> bool:
    """Keep freed memory in this process for its next allocation (glibc's ``mallopt``).

    Every epoch allocates and frees the same large tensors: an ``(N, hidden)`` activation or
    gradient is tens of MB. glibc serves each block above its mmap threshold (at most 32 MB) with
    a fresh ``mmap`` and hands it back with ``munmap`` when freed, so the kernel page-faults and
    zeroes those pages again every epoch: on the issue #27 graph (10^5 nodes, SAGE 3x128) about a
    quarter of a second of system time per epoch (``benchmarks/bench_dgl.py``; PyTorch's CPU
    tuning guide swaps the allocator for the same reason). With mmap off for large blocks and
    the heap trimmed only past 2 GiB free, the next epoch reuses the same pages. The peak is the
    same up to fragmentation, but the process keeps its high-water mark instead of returning it.
    Returns whether it applied: glibc, and no ``MALLOC_*_`` tuning in the environment (a run
    that sets one, as ``bench_memory_cap`` sets ``MALLOC_MMAP_THRESHOLD_``, keeps its own);
    elsewhere it does nothing. Called once per node-model training process (``gnnpipe.train.run``;
    atomic runs keep glibc's defaults: their memory plan is checked against resident peaks).
    """
    if not heap_retained():
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def make_optimizer(params, cfg: TrainingConfig) -> torch.optim.Optimizer:
    """Adam with L2 weight decay, the optimizer of every mode (so modes are comparable)."""
    return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


class OptimizerHooks:
    """The Engine protocol's step hooks on the engine's optimizer ``self.opt`` (every engine's: the
    habits act from them)."""

    opt: torch.optim.Optimizer

    def register_step_pre_hook(self, hook):
        return self.opt.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook):
        return self.opt.register_step_post_hook(hook)


def node_habits(engine, cfg: TrainingConfig, global_norm=None) -> Habits:
    """A node engine's habits, from ``training:`` (off by default), attached to its optimizer: one step an
    epoch at ``training.lr``; ``global_norm`` where this rank holds a share of the parameters only."""
    return Habits(cfg, lr=cfg.lr, steps_per_epoch=1, epochs=cfg.epochs, params=engine.named_parameters(),
                  hint=f"lower training.lr (now {cfg.lr:g}) or see training.guard",
                  global_norm=global_norm).attach(engine)


def train_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The training state of a module and its optimizer (what ``Engine.state_dict`` holds)."""
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def load_train_state(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
    model.load_state_dict(state["model"])  # strict: a shard of another layout raises
    opt.load_state_dict(state["optimizer"])


def ce_sum(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """Sum of cross-entropy over the rows selected by ``mask`` (divide by the global count)."""
    if not bool(mask.any()):
        return logits.sum() * 0.0  # keeps the graph connected for backward
    return F.cross_entropy(logits[mask], labels[mask], reduction="sum")


def correct_counts(logits: Tensor, labels: Tensor, masks: dict[str, Tensor]) -> dict[str, tuple[int, int]]:
    """(correct, total) per split, to be summed across workers before dividing."""
    pred = logits.argmax(dim=-1)
    hit = pred == labels
    return {k: (int(hit[m].sum()), int(m.sum())) for k, m in masks.items()}


# --------------------------------------------------------------------------- exact metrics (single, evaluate)
def graph_tensors(graph: Graph, dtype: torch.dtype, device) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Features, labels and split masks of ``graph`` as tensors on ``device``."""
    x = torch.as_tensor(graph.features).to(device, dtype)
    y = torch.as_tensor(graph.labels).to(device)
    masks = {s: torch.as_tensor(getattr(graph, f"{s}_mask")).to(device) for s in SPLITS}
    return x, y, masks


@torch.no_grad()
def exact_metrics(model: GNN, block: Block, x: Tensor, y: Tensor, masks: dict[str, Tensor]) -> dict[str, float]:
    """Accuracy per split and the training loss, with dropout off, on one block."""
    was_training = model.training
    model.eval()
    logits = model(x, block)
    model.train(was_training)
    out = {f"{k}_acc": (c / t if t else 0.0) for k, (c, t) in correct_counts(logits, y, masks).items()}
    n_train = int(masks["train"].sum())
    out["loss"] = float(ce_sum(logits, y, masks["train"]) / max(n_train, 1))
    return out
