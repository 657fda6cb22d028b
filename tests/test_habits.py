"""The training habits on node runs (gnnpipe.habits; the atomic ones: test_atomic_habits.py).

* defaults off: a node engine trains bit for bit as plain Adam on the whole graph;
* on (warmup + cosine, clipping, EMA), float64: the graph run (P = 2) and the pipeline (S = 2, the clip's
  norm summed over the stages) give the single run's per-epoch losses, evaluation and finished weights;
* resume carries the average and the guard; the guard stops a node run on its loss; the keys are
  ``training:``'s, with the atomic sections' names (a force-cosine floor is not a node key).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from gnnpipe.config import (ConfigError, GraphParallelConfig, ModelConfig, PartitionConfig, PipelineConfig,
                            RunConfig, TrainingConfig, load_workflow_config)
from gnnpipe.engine import ce_sum, graph_tensors, make_optimizer
from gnnpipe.graph import write_graph
from gnnpipe.habits import Diverged
from gnnpipe.layout import ParallelDims
from gnnpipe.models.block import Block
from gnnpipe.models.model import GNN
from gnnpipe.parallel.single import SingleEngine
from gnnpipe.parallel.testing import spawn_multi_process
from gnnpipe.partition import partition_graph
from gnnpipe.store import materialize
from gnnpipe.tasks import TASKS
from helpers import random_graph

TOL = 1e-10
EPOCHS = 6
#: every habit on, each where it acts on these runs: the clip below the gradients' norm (asserted)
HABITS = dict(schedule={"warmup_epochs": 2, "decay": "cosine", "min_lr_factor": 0.1}, clip_grad_norm=0.05,
              ema_decay=0.9)
OFF = dict(shuffle_chunks=False, grad_correction=False, snapshot_every=0, momentum=0.0, recompute=False)


def training(dtype="float64", **habits) -> TrainingConfig:
    """``TrainingConfig`` with ``habits`` as ``from_dict`` would build them (nested sections)."""
    tc = TrainingConfig(epochs=EPOCHS, lr=0.02, weight_decay=5e-4, seed=3, dtype=dtype, node_order="given")
    over = {k: (dataclasses.replace(getattr(tc, k), **v) if isinstance(v, dict) else v) for k, v in habits.items()}
    return dataclasses.replace(tc, **over)


def run_cfg(mode="single", *, graph_path="", store="", stages=1, ways=1, chunks=1, **habits) -> RunConfig:
    return RunConfig(run_id="t", mode=mode, dataset_name="t", graph_path=str(graph_path), store_path=str(store),
                     out_dir="", model=ModelConfig(kind="gcn", layers=3, hidden=8, dropout=0.0),
                     training=training(**habits), partitioning=PartitionConfig(), pipeline=PipelineConfig(**OFF),
                     graph_parallel=GraphParallelConfig(), workers=stages * ways, stages=stages, ways=ways,
                     chunks=chunks)


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    root = tmp_path_factory.mktemp("habits")
    g = random_graph(n=60, avg_degree=5, seed=7)
    write_graph(root / "g.h5", g)
    materialize(g, partition_graph(g, "metis", 2, seed=0), root / "s2.h5")
    materialize(g, partition_graph(g, "metis", 1, seed=0), root / "s1.h5")
    return g, root


def train(engine, epochs=EPOCHS, start=0) -> list[float]:
    return [engine.train_epoch(e).loss for e in range(start, epochs)]


def single(graph, **habits) -> SingleEngine:
    return SingleEngine(run_cfg(graph_path=graph[1] / "g.h5", **habits), None, None, torch.device("cpu"))


def test_defaults_off_train_a_node_model_as_plain_adam(graph):
    """No key set: no schedule, no clip, no average, no stop (a node run's history is as before the habits)."""
    g, _ = graph
    eng = single(graph, dtype="float32")
    losses = train(eng)
    torch.manual_seed(3)
    model = GNN(eng.cfg.model, g.num_features, g.num_classes)
    opt = make_optimizer(model.parameters(), eng.cfg.training)
    x, y, masks = graph_tensors(g, torch.float32, "cpu")
    block, ref = Block.full(g.indptr, g.indices, torch.float32), []
    for _ in range(EPOCHS):
        opt.zero_grad(set_to_none=True)
        loss = ce_sum(model(x, block), y, masks["train"]) / int(masks["train"].sum())
        loss.backward()
        opt.step()
        ref.append(float(loss.detach()))
    assert losses == ref
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in eng.full_state_dict().items())
    assert eng.habits.ema is None and eng.habits.clip is None and eng.habits.guard.loss_factor is None


def _worker(rank, world, cfgs):
    from gnnpipe.parallel.comm import Communicator
    from gnnpipe.parallel.layout_engine import LayoutEngine
    from gnnpipe.parallel.groups import build_groups

    out = []
    for cfg in cfgs:
        groups = build_groups(ParallelDims(cfg.mode, world, cfg.stages, cfg.ways), rank)
        engine = LayoutEngine(cfg, groups, Communicator(groups, "cpu"), "cpu")
        out.append({"losses": train(engine), "eval": engine.evaluate(), "state": engine.full_state_dict()})
    return out


@pytest.mark.slow
def test_graph_and_pipeline_runs_with_every_habit_match_the_single_run(graph):
    """float64: warmup + cosine, clipping (the pipeline's norm over both stages) and the weights' average give
    the single run's losses, evaluation (with the average) and finished model, in graph P = 2 and pipeline S = 2."""
    ref = single(graph, **HABITS)
    ref_losses = train(ref)
    unclipped = train(single(graph, **{**HABITS, "clip_grad_norm": None}))
    assert not np.allclose(unclipped, ref_losses, rtol=0, atol=1e-6)  # the clip acts on these runs
    ref_eval, ref_state = ref.evaluate(), ref.full_state_dict()
    assert any(not torch.equal(ref_state[k], p) for k, p in ref.named_parameters().items())  # the average
    cfgs = [run_cfg("graph", store=graph[1] / "s2.h5", ways=2, chunks=2, **HABITS),
            run_cfg("pipeline", store=graph[1] / "s1.h5", stages=2, chunks=1, **HABITS)]
    per_rank = spawn_multi_process(_worker, 2, cfgs, timeout=120)
    for i, cfg in enumerate(cfgs):
        for r in per_rank:
            assert np.allclose(r[i]["losses"], ref_losses, rtol=0, atol=TOL), cfg.mode
            assert r[i]["eval"] == pytest.approx(ref_eval, rel=0, abs=TOL), cfg.mode
        state = per_rank[0][i]["state"]
        assert list(state) == list(ref_state)
        for k, v in ref_state.items():
            assert torch.allclose(state[k], v, rtol=0, atol=TOL), (cfg.mode, k)


def test_a_resumed_node_run_continues_with_its_average_and_guard(graph):
    """The resume state carries the moving average and the guard's record: 2 + 4 epochs train as 6."""
    habits = {**HABITS, "guard": {"loss_factor": 10.0}}
    whole = single(graph, **habits)
    losses = train(whole)
    first = single(graph, **habits)
    train(first, epochs=2)
    for e in range(2):
        TASKS["node_classification"].check_epoch(first, e, {"loss": 1.0 + e}, "w")
    state = first.state_dict()
    assert state["ema"]["updates"] == 2 and state["guard"]["best"] == 1.0
    resumed = single(graph, **habits)
    resumed.load_state_dict(state)
    assert train(resumed, start=2) == losses[2:]
    assert all(torch.equal(v, whole.full_state_dict()[k]) for k, v in resumed.full_state_dict().items())
    assert resumed.habits.guard.best == 1.0


def test_the_guard_stops_a_node_run_whose_loss_stays_high(graph):
    """A node run's guard is off by default; with ``training.guard.loss_factor`` the task's per-epoch check
    stops it in one line naming the lr to lower."""
    node = TASKS["node_classification"]
    off = single(graph)
    for e, loss in enumerate([1.0, 50.0, 60.0, 70.0]):
        node.check_epoch(off, e, {"loss": loss}, "w")
    on = single(graph, guard={"loss_factor": 3.0, "patience": 2})
    node.check_epoch(on, 0, {"loss": 1.0}, "w")
    node.check_epoch(on, 1, {"loss": 5.0}, "w")
    with pytest.raises(Diverged, match=r"^epoch 2, rank 0: training diverged: loss 6 above 3x its best 1 \(epoch 0\) "
                                       r"for 2 epochs; lower training.lr \(now 0.02\) or see training.guard$"):
        node.check_epoch(on, 2, {"loss": 6.0}, "epoch 2, rank 0")
    with pytest.raises(Diverged, match="non-finite loss"):
        node.check_epoch(on, 3, {"loss": math.nan}, "w")


def test_node_habit_keys_are_the_atomic_sections_names_off_by_default(tmp_path):
    """``training:`` takes schedule / clip_grad_norm / ema_decay / guard as an atomic section does (the
    schedule's warmup beside training.warmup_epochs, the timing's); no force-cosine floor on a node run."""
    def wf(training):
        return load_workflow_config({"results": str(tmp_path), "datasets": {"d": {}}, "models": {"m": {"kind": "gcn"}},
                                     "training": training, "runs": [{"mode": "single", "dataset": "d", "model": "m"}]})
    tc = wf({}).training
    assert (tc.schedule.warmup_epochs, tc.schedule.decay, tc.clip_grad_norm, tc.ema_decay, tc.guard.loss_factor) == \
        (0.0, "none", None, None, None)
    tc = wf({"warmup_epochs": 1, "schedule": {"warmup_epochs": 1.5, "decay": "cosine"}, "clip_grad_norm": 1.0,
             "ema_decay": 0.99, "guard": {"loss_factor": 3.0, "patience": 2}}).training
    assert (tc.warmup_epochs, tc.schedule.warmup_epochs, tc.schedule.min_lr_factor, tc.guard.patience) == \
        (1, 1.5, 0.02, 2)
    with pytest.raises(ConfigError, match=r"^config.training.guard: unknown key 'min_force_cos' "
                                          r"\(known: loss_factor, patience\)$"):
        wf({"guard": {"min_force_cos": 0.0}})
    with pytest.raises(ConfigError, match=r"^config.training.ema_decay: 1.0 must be in \[0, 1\)"):
        wf({"ema_decay": 1.0})
