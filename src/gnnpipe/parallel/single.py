"""Mode ``single``: the whole graph and the whole model in one process, the accuracy reference.

Every parallel mode is checked against this engine (exactly in float64, docs/DESIGN.md §4):
one full-graph forward over a single CSR block, the mean cross-entropy over the training
nodes, one optimizer step an epoch. No communicator, no bytes. The nodes are numbered for
cache locality first (``training.node_order``, :func:`gnnpipe.partition.node_order`): the same
model, up to float rounding, in less time.
"""

from __future__ import annotations

import time

import torch

from ..config import RunConfig
from ..engine import (DTYPES, EpochStats, NonFiniteError, OptimizerHooks, ce_sum, exact_metrics, graph_tensors,
                      load_train_state, make_optimizer, node_habits, train_state)
from ..graph import read_graph, read_graph_attrs
from ..models.block import Block
from ..models.model import GNN
from ..partition import node_order


class SingleEngine(OptimizerHooks):
    """The whole graph and the whole model in one process: the accuracy reference."""

    comm = None

    def __init__(self, cfg: RunConfig, groups, comm, device: torch.device):
        """The engines' one constructor order; one process has no ``groups`` and no ``comm`` (both None)."""
        if groups is not None or comm is not None:
            raise ValueError("SingleEngine runs in one process: groups and comm are None")
        self.cfg = cfg
        dtype = DTYPES[cfg.training.dtype]
        graph = read_graph(cfg.graph_path)
        self.num_nodes, self.num_edges, self.in_features = graph.num_nodes, graph.num_edges, graph.num_features
        self.order = node_order(graph, cfg.training.node_order, seed=cfg.partitioning.seed, path=cfg.locality_path,
                                graph_hash=str(read_graph_attrs(cfg.graph_path)["content_hash"]))
        if self.order["parts"]:
            graph = graph.renumbered(self.order.pop("order"))
        self.block = Block.full(graph.indptr, graph.indices, dtype).to(device)
        self.x, self.y, self.masks = graph_tensors(graph, dtype, device)
        self.n_train = max(int(self.masks["train"].sum()), 1)
        torch.manual_seed(cfg.training.seed)
        self.model = GNN(cfg.model, graph.num_features, graph.num_classes).to(device, dtype)
        self.opt = make_optimizer(self.model.parameters(), cfg.training)
        self.habits = node_habits(self, cfg.training)

    def train_epoch(self, epoch: int) -> EpochStats:
        t0 = time.perf_counter()
        self.habits.begin_epoch(epoch)
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(self.x, self.block)  # (N, C)
        loss = ce_sum(logits, self.y, self.masks["train"]) / self.n_train
        if not bool(torch.isfinite(loss)):  # before its gradients: the loss is the cause
            raise NonFiniteError(f"epoch {epoch}, rank 0: non-finite training loss ({float(loss.detach())}): "
                                 f"training diverged (lower training.lr?)")
        loss.backward()
        self.opt.step()
        return EpochStats(loss=float(loss.detach()), compute_s=time.perf_counter() - t0)

    def named_parameters(self) -> dict:
        return dict(self.model.named_parameters())

    def evaluate(self) -> dict[str, float]:
        with self.habits.averaged():
            return exact_metrics(self.model, self.block, self.x, self.y, self.masks)

    def full_state_dict(self):
        return self.habits.final_state(self.model.state_dict())

    def state_dict(self) -> dict:
        return {**train_state(self.model, self.opt), **self.habits.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        load_train_state(self.model, self.opt, state)
        self.habits.load_state_dict(state)

    def predicted_bytes(self) -> int:
        return 0

    def graph_info(self) -> dict:
        return {"num_nodes": self.num_nodes, "num_edges": self.num_edges, "in_features": self.in_features}

    def extra_info(self) -> dict:
        return {"node_order": self.order}

