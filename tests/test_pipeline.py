"""GNNPipe (``gnnpipe.parallel.pipeline``) against single-process references.

* ``C = 1``: pipeline training *is* single-process training (losses, weights), every
  model kind, ``S`` in 2, 3, 4, float64 to 1e-10;
* ``C > 1`` on a graph with no edge between chunks: exact again, with every technique;
* ``C > 1`` on a connected graph: epoch 0 (warm-started history) has the exact loss,
  and its gradient is exactly that of the computation the pipeline does (historical rows
  as constants, fresh cross-chunk gradients scaled by ``grad_scale`` under
  ``grad_correction``), computed here by an independent whole-graph formulation;
* the ledger: bytes per epoch over all ranks == ``predicted_bytes()``;
* recompute is bitwise the same as storing activations, dropout included;
* stage balancing, history buffers, chunk order and the refused layouts.

Multi-process tests run real gloo processes (``spawn_multi_process``); each spawn runs
several engines in turn, to keep the start-up cost down.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch

from gnnpipe.config import (GraphParallelConfig, ModelConfig, PartitionConfig, PipelineConfig,
                            RunConfig, TrainingConfig)
from gnnpipe.engine import ce_sum, make_optimizer
from gnnpipe.evaluate import exact_metrics
from gnnpipe.io import GnnPipeError
from gnnpipe.models.model import GNN
from gnnpipe.parallel.balance import (StageAssignment, assign_stages, balanced_bounds, profile_costs,
                                      stage_costs, uniform_bounds)
from gnnpipe.parallel.pipeline import (History, PipelineEngine, check_pipeline_config, chunk_order,
                                       predicted_pipeline_bytes)
from gnnpipe.parallel.testing import spawn_multi_process
from gnnpipe.partition import partition_graph
from gnnpipe.store import ChunkStore, materialize
from test_partition import make_graph, random_graph

KINDS = ("gcn", "sage", "gat", "gcnii", "resgcn")
OFF = dict(shuffle_chunks=False, grad_correction=False, snapshot_every=0, momentum=0.0, recompute=False)
TECHNIQUES = {  # name -> PipelineConfig overrides on top of OFF
    "off": {},
    "shuffle": dict(shuffle_chunks=True),
    "grad_correction": dict(grad_correction=True, grad_scale=2.0),
    "snapshot": dict(snapshot_every=2),
    "momentum": dict(momentum=0.9),
    "recompute": dict(recompute=True),
    "all": dict(shuffle_chunks=True, grad_correction=True, grad_scale=2.0, snapshot_every=2,
                momentum=0.9, recompute=True),
}
TOL = 1e-10


# --------------------------------------------------------------------------- fixtures
def model_cfg(kind: str, layers: int = 4, dropout: float = 0.0) -> ModelConfig:
    return ModelConfig(kind=kind, layers=layers, hidden=8, dropout=dropout, heads=2, norm="none")


def run_cfg(store, kind="gcn", *, stages=1, chunks=1, layers=4, epochs=3, dropout=0.0, balance="uniform",
            **pipeline) -> RunConfig:
    pc = PipelineConfig(**{**OFF, "balance": balance, **pipeline})
    tc = TrainingConfig(epochs=epochs, lr=0.02, weight_decay=5e-4, seed=3, dtype="float64")
    return RunConfig(run_id="test", mode="pipeline", dataset_name="test", graph_path="", store_path=str(store),
                     out_dir="", model=model_cfg(kind, layers, dropout), training=tc,
                     partitioning=PartitionConfig(), pipeline=pc, graph_parallel=GraphParallelConfig(),
                     workers=stages, stages=stages, ways=1, chunks=chunks)


def disjoint_graph(components: int, size: int, seed: int = 0):
    """``components`` random connected pieces of ``size`` nodes, no edge between them."""
    rng = np.random.default_rng(seed)
    src, dst = [], []
    for k in range(components):
        base = k * size
        ring = np.arange(size)
        src += [base + ring, base + rng.integers(0, size, 2 * size)]
        dst += [base + (ring + 1) % size, base + rng.integers(0, size, 2 * size)]
    g = make_graph(np.concatenate(src), np.concatenate(dst), components * size, features=5, seed=seed)
    return g, np.repeat(np.arange(components), size)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Chunk stores: a connected graph cut into 1 and 4 chunks, and 6 disjoint components."""
    root = tmp_path_factory.mktemp("pipeline")
    g = random_graph(n=72, avg_degree=5, seed=7)
    out = {}
    for c in (1, 4, 6):
        out[f"connected-{c}"] = root / f"connected-{c}.h5"
        materialize(g, partition_graph(g, "metis", c, seed=0), out[f"connected-{c}"])
    dg, comp = disjoint_graph(6, 12, seed=1)
    out["disjoint-6"] = root / "disjoint-6.h5"
    materialize(dg, comp, out["disjoint-6"])
    return out


def data(store_path, dtype=torch.float64):
    with ChunkStore(store_path) as s:
        x = torch.as_tensor(s.read_all("features")).to(dtype)
        y = torch.as_tensor(s.read_all("labels"))
        masks = {k: torch.as_tensor(s.read_all(f"{k}_mask")) for k in ("train", "val", "test")}
        return x, y, masks, s.full_block(dtype), s.num_features, s.num_classes


def reference_training(cfg: RunConfig):
    """Plain single-process training on the store's whole graph (new ids): losses, weights."""
    x, y, masks, block, f, c = data(cfg.store_path)
    torch.manual_seed(cfg.training.seed)
    model = GNN(cfg.model, f, c).to(torch.float64)
    opt = make_optimizer(model.parameters(), cfg.training)
    losses = []
    for _ in range(cfg.training.epochs):
        opt.zero_grad(set_to_none=True)
        loss = ce_sum(model(x, block), y, masks["train"]) / int(masks["train"].sum())
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, model


def realized_epoch0(cfg: RunConfig, *, scale: float):
    """Epoch 0 of the pipeline, formulated on whole-graph tensors (independent of the engine).

    Conv ``l`` of chunk ``c`` reads: its own rows and the rows of chunks earlier in the
    order live (the latter's gradient multiplied by ``scale``, value unchanged), the rows of
    later chunks as constants equal to the exact initial embeddings (the warm start).
    Conv 0's input (features or the encoder on every row) is always live and unscaled.
    Returns (loss, {name: grad}).
    """
    x, y, masks, full, f, ncls = data(cfg.store_path)
    with ChunkStore(cfg.store_path) as s:
        C, offsets = s.num_parts, [int(o) for o in s.offsets]
        blocks = [s.chunk_block(c, torch.float64) for c in range(C)]
        chunk_of = torch.as_tensor(s.part_of(np.arange(s.num_nodes)))
    torch.manual_seed(cfg.training.seed)
    model = GNN(cfg.model, f, ncls).to(torch.float64)
    with torch.no_grad():  # the exact inputs of every conv under the initial weights
        h, exact = model.encode(x), []
        x0 = h if model.needs_x0 else None
        for conv in model.convs:
            exact.append(h)
            h = conv(h, full, x0)
    order = chunk_order(C, 0, cfg.training.seed, cfg.pipeline.shuffle_chunks)
    pos = torch.empty(C, dtype=torch.int64)
    pos[torch.as_tensor(order)] = torch.arange(C)
    h = model.encode(x)
    x0 = h if model.needs_x0 else None
    for l, conv in enumerate(model.convs):
        outs = []
        for c in range(C):
            if l == 0:
                src = h
            else:
                live = chunk_of == c
                earlier = pos[chunk_of] < pos[c]
                scaled = scale * h - (scale - 1.0) * h.detach()  # value h, gradient x scale
                src = torch.where(live[:, None], h, torch.where(earlier[:, None], scaled, exact[l]))
            s, e = offsets[c], offsets[c + 1]
            outs.append(conv(src, blocks[c], None if x0 is None else x0[s:e]))
        h = torch.cat(outs)
    loss = ce_sum(model.decode(h), y, masks["train"]) / int(masks["train"].sum())
    loss.backward()
    return float(loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters()}


# --------------------------------------------------------------------------- the worker
def _pipeline_worker(rank, world, jobs):
    """Run each (cfg, epochs) job as a pipeline of ``world`` stages; report what the tests check."""
    from gnnpipe.parallel.comm import Communicator
    from gnnpipe.parallel.dims import ParallelDims, build_groups

    groups = build_groups(ParallelDims("pipeline", world, world, 1), rank)
    results = []
    for cfg in jobs:
        comm = Communicator(groups, "cpu")
        engine = PipelineEngine(cfg, groups, comm, "cpu")
        losses, sent, stats, grads0 = [], [], [], None
        for epoch in range(cfg.training.epochs):
            comm.set_epoch(epoch)
            st = engine.train_epoch(epoch)
            losses.append(st.loss)
            stats.append((st.compute_s, st.comm_s, st.bubble_s))
            sent.append(comm.epoch_bytes(epoch))
            if epoch == 0:
                grads0 = {k: p.grad.clone() for k, p in engine.named_parameters().items()}
        comm.set_epoch(-1)
        results.append({"losses": losses, "sent": sent, "stats": stats, "grads0": grads0,
                        "predicted": engine.predicted_bytes(), "eval": engine.evaluate(),
                        "state": engine.full_state_dict(), "bounds": engine.assignment.bounds,
                        "control": sum(r.get("control", {}).get("sent", 0) for r in comm.ledger.values())})
    return results


def spawn(jobs, world):
    return spawn_multi_process(_pipeline_worker, world, jobs, timeout=120)


def assert_state_close(state, model, tol=TOL):
    ref = model.state_dict()
    assert list(state) == list(ref)  # same names, same order as the single-process model
    for k, v in ref.items():
        assert state[k].shape == v.shape
        assert torch.allclose(state[k], v, rtol=0, atol=tol), k


# --------------------------------------------------------------------------- exactness, C = 1
@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda s: f"S{s}")
def c1_runs(request, stores):
    S = request.param
    jobs = [run_cfg(stores["connected-1"], kind, stages=S, chunks=1, epochs=3) for kind in KINDS]
    return S, jobs, spawn(jobs, S)


def test_c1_pipeline_matches_unsharded(c1_runs):
    S, jobs, per_rank = c1_runs
    for i, cfg in enumerate(jobs):
        ref_losses, ref_model = reference_training(cfg)
        for r in range(S):  # every rank reports the same (global) loss
            assert np.allclose(per_rank[r][i]["losses"], ref_losses, rtol=0, atol=TOL), cfg.model.kind
        assert_state_close(per_rank[0][i]["state"], ref_model)
        assert all(per_rank[r][i]["state"] is None for r in range(1, S))
        x, y, masks, block, _, _ = data(cfg.store_path)
        ref_eval = exact_metrics(ref_model, block, x, y, masks)
        for r in range(S):
            got = per_rank[r][i]["eval"]
            assert got.keys() == ref_eval.keys()
            assert all(abs(got[k] - ref_eval[k]) < 1e-9 for k in got), cfg.model.kind


def test_ledger_matches_closed_form(c1_runs):
    S, jobs, per_rank = c1_runs
    with ChunkStore(jobs[0].store_path) as s:
        n = s.num_nodes
    for i, cfg in enumerate(jobs):
        predicted = per_rank[0][i]["predicted"]
        x0 = 2 if cfg.model.kind == "gcnii" else 1
        # every boundary carries a hidden-width row per node (these models have H = 8 inside)
        assert predicted == 2 * (S - 1) * n * 8 * 8 * x0
        for epoch in range(cfg.training.epochs):
            assert sum(per_rank[r][i]["sent"][epoch] for r in range(S)) == predicted, (cfg.model.kind, epoch)
        assert all(per_rank[r][i]["predicted"] == predicted for r in range(S))


def test_time_split_is_reported(c1_runs):
    S, _, per_rank = c1_runs
    for r in range(S):
        for compute, comm, bubble in per_rank[r][0]["stats"]:
            assert compute > 0 and comm >= 0 and bubble >= 0
    # a downstream stage waits for its first chunk: idle time, not compute
    assert sum(b for _, _, b in per_rank[S - 1][0]["stats"]) > 0


# --------------------------------------------------------------------------- C > 1
def test_disjoint_chunks_exact_with_every_technique(stores):
    """No edge between chunks: no halo, no history read, so every technique stays exact."""
    jobs = [run_cfg(stores["disjoint-6"], kind, stages=3, chunks=6, layers=3, epochs=3, **TECHNIQUES[t])
            for kind, t in itertools.product(("gcnii", "gat"), TECHNIQUES)]
    per_rank = spawn(jobs, 3)
    n = per_rank[0][0]["predicted"]
    for i, cfg in enumerate(jobs):
        ref_losses, ref_model = reference_training(cfg)
        assert np.allclose(per_rank[0][i]["losses"], ref_losses, rtol=0, atol=TOL), (cfg.model.kind, cfg.pipeline)
        assert_state_close(per_rank[0][i]["state"], ref_model)
        for epoch in range(cfg.training.epochs):
            assert sum(per_rank[r][i]["sent"][epoch] for r in range(3)) == per_rank[0][i]["predicted"]
    assert n > 0


def test_cross_chunk_epoch0_is_the_realized_gradient(stores):
    """Connected graph, 4 chunks over 2 stages (gcnii: x0 travels) and 4 stages (resgcn)."""
    store = stores["connected-4"]
    cases = {  # name: (overrides, scale of fresh cross-chunk gradients)
        "off": ({}, 1.0),
        "correction-x1": (dict(grad_correction=True, grad_scale=1.0), 1.0),
        "correction-x2-shuffled": (dict(grad_correction=True, grad_scale=2.0, shuffle_chunks=True), 2.0),
        "all": (TECHNIQUES["all"], 2.0),
    }
    for S, kind in ((2, "gcnii"), (4, "resgcn")):
        jobs = [run_cfg(store, kind, stages=S, chunks=4, epochs=3, **o) for o, _ in cases.values()]
        per_rank = spawn(jobs, S)
        ref_losses, _ = reference_training(jobs[0])
        for i, (name, (_, scale)) in enumerate(cases.items()):
            loss0, grads = realized_epoch0(jobs[i], scale=scale)
            got = per_rank[0][i]["losses"]
            assert abs(got[0] - ref_losses[0]) < TOL, name  # warm start: epoch 0 is exact
            assert abs(got[0] - loss0) < TOL, name
            merged = {k: v for r in range(S) for k, v in per_rank[r][i]["grads0"].items()}
            assert merged.keys() == grads.keys()
            for k, g in grads.items():
                assert torch.allclose(merged[k], g, rtol=0, atol=TOL), (kind, name, k)
            # after epoch 0 the history is stale: training is no longer the exact one
            assert abs(got[2] - ref_losses[2]) > 1e-8, name
            # evaluation is exact inference of the weights actually trained
            x, y, masks, block, f, c = data(store)
            model = GNN(jobs[i].model, f, c).to(torch.float64)
            model.load_state_dict(per_rank[0][i]["state"])
            ref_eval = exact_metrics(model, block, x, y, masks)
            assert all(abs(per_rank[S - 1][i]["eval"][k] - ref_eval[k]) < 1e-9 for k in ref_eval)
            for epoch in range(3):
                assert sum(per_rank[r][i]["sent"][epoch] for r in range(S)) == per_rank[0][i]["predicted"]


def test_realized_reference_is_not_trivially_exact(stores):
    """The scale matters (so the test above can fail): x2 and x1 gradients differ."""
    cfg = run_cfg(stores["connected-4"], "gcn", chunks=4)
    _, g1 = realized_epoch0(cfg, scale=1.0)
    _, g2 = realized_epoch0(cfg, scale=2.0)
    assert max(float((g1[k] - g2[k]).abs().max()) for k in g1) > 1e-6


def test_recompute_is_bitwise_storing_with_dropout(stores):
    """One stage, in process: recompute rebuilds each (conv, chunk) with its RNG state."""
    for kind in ("gcnii", "resgcn", "gat"):
        base = dict(TECHNIQUES["all"])
        runs = {}
        for recompute in (False, True):
            cfg = run_cfg(stores["connected-6"], kind, chunks=6, epochs=3, dropout=0.3,
                          **{**base, "recompute": recompute})
            eng = PipelineEngine(cfg, None, None, "cpu")
            runs[recompute] = ([eng.train_epoch(e).loss for e in range(3)], eng.full_state_dict())
        assert runs[False][0] == runs[True][0], kind
        for k, v in runs[False][1].items():
            assert torch.equal(v, runs[True][1][k]), (kind, k)


def test_techniques_change_training_on_a_connected_graph(stores):
    """In process (one stage): each technique changes the result, i.e. each switch is live."""
    finals = {}
    for name, over in TECHNIQUES.items():
        cfg = run_cfg(stores["connected-6"], "gcn", chunks=6, layers=3, epochs=4, **over)
        eng = PipelineEngine(cfg, None, None, "cpu")
        losses = [eng.train_epoch(e).loss for e in range(4)]
        finals[name] = losses[-1]
    for name in ("shuffle", "grad_correction", "snapshot", "momentum", "all"):
        assert abs(finals[name] - finals["off"]) > 1e-9, name
    assert finals["recompute"] == finals["off"]


# --------------------------------------------------------------------------- pieces
def test_history_sources():
    h = History(4, 1, device="cpu", dtype=torch.float64, keep_history=True)
    h.fill(torch.zeros(4, 1))
    h.cur[:] = 1.0
    h.end_epoch()  # the history is now last epoch's values, the buffer recycled
    assert h.stale().flatten().tolist() == [1.0] * 4
    m = History(2, 1, device="cpu", dtype=torch.float64, momentum=0.75)
    m.fill(torch.zeros(2, 1))
    m.cur[:] = 4.0
    m.end_epoch()
    assert m.stale().flatten().tolist() == [1.0, 1.0]  # 0.75 * 0 + 0.25 * 4
    s = History(2, 1, device="cpu", dtype=torch.float64, snapshot_every=3)
    s.fill(torch.full((2, 1), 5.0))
    for epoch in range(1, 5):
        s.begin_epoch(epoch)
        s.cur[:] = float(epoch)
        want = 5.0 if epoch < 3 else 2.0  # refreshed at epoch 3 from the end of epoch 2
        assert s.stale().flatten().tolist() == [want, want], epoch
    single = History(2, 1, device="cpu", dtype=torch.float64)
    assert single.stale() is single.cur and single.hist is None and single.snap is None


def test_chunk_order():
    assert chunk_order(5, 3, 0, False).tolist() == [0, 1, 2, 3, 4]
    a, b = chunk_order(8, 1, 0, True), chunk_order(8, 1, 0, True)
    assert np.array_equal(a, b) and sorted(a.tolist()) == list(range(8))
    assert not np.array_equal(a, chunk_order(8, 2, 0, True))
    assert not np.array_equal(a, chunk_order(8, 1, 1, True))


def test_predicted_bytes_closed_form():
    assert predicted_pipeline_bytes(100, [16, 16, 16], 0, 4) == 2 * 3 * 100 * 16 * 4
    assert predicted_pipeline_bytes(100, [16], 16, 4) == 2 * 2 * 100 * 16 * 4
    assert predicted_pipeline_bytes(100, [], 16, 4) == 0


def _valid(bounds, L, S):
    assert len(bounds) == S and bounds[0][0] == 0 and bounds[-1][1] == L
    assert all(a < b for a, b in bounds) and all(b == a2 for (_, b), (a2, _) in zip(bounds, bounds[1:]))


def test_balance_beats_uniform_on_unbalanced_costs():
    costs = [10, 1, 1, 1, 1, 1, 1, 1]
    uni, bal = uniform_bounds(8, 2), balanced_bounds(costs, 2)
    _valid(uni, 8, 2)
    _valid(bal, 8, 2)
    assert uni == [(0, 4), (4, 8)] and max(stage_costs(costs, uni)) == 13
    assert bal == [(0, 1), (1, 8)] and max(stage_costs(costs, bal)) == 10
    # the encoder's cost on stage 0 moves work to the later stages
    with_enc = balanced_bounds([1] * 6, 3, first_extra=2.0)
    assert with_enc[0] == (0, 1) and max(stage_costs([1] * 6, with_enc, 2.0)) == 3


def test_balance_is_optimal_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(40):
        L = int(rng.integers(1, 9))
        S = int(rng.integers(1, L + 1))
        costs = rng.random(L).round(2).tolist()
        fe, le = float(rng.random()), float(rng.random())
        bounds = balanced_bounds(costs, S, fe, le)
        _valid(bounds, L, S)
        best = min(max(stage_costs(costs, [(a, b) for a, b in zip((0,) + cut, cut + (L,))], fe, le))
                   for cut in itertools.combinations(range(1, L), S - 1))
        assert abs(max(stage_costs(costs, bounds, fe, le)) - best) < 1e-12
    assert uniform_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]


def test_assign_stages_methods(stores):
    x, y, masks, block, f, c = data(stores["connected-4"], torch.float32)
    model = GNN(model_cfg("gcn", layers=6), f, c)  # first conv F -> H, last H -> classes
    est = assign_stages(model, 3, "estimate", num_nodes=72, num_edges=block.nnz)
    _valid(est.bounds, 6, 3)
    assert est.stage_costs == stage_costs(est.layer_costs, est.bounds)
    assert est.bottleneck <= max(stage_costs(est.layer_costs, uniform_bounds(6, 3)))
    with ChunkStore(stores["connected-4"]) as s:
        sample = s.local_block(0)
    prof = assign_stages(model, 3, "profile", num_nodes=72, num_edges=block.nnz, sample_block=sample)
    _valid(prof.bounds, 6, 3)
    assert len(prof.layer_costs) == 6 and all(t > 0 for t in prof.layer_costs)
    assert all(p.grad is None for p in model.parameters())  # profiling leaves no gradient behind
    uni = assign_stages(model, 4, "uniform", num_nodes=72, num_edges=block.nnz)
    assert uni.bounds == [(0, 2), (2, 4), (4, 5), (5, 6)]
    d = uni.as_dict()
    assert d["layers_per_stage"] == [2, 2, 1, 1] and d["method"] == "uniform"
    costs, first, last = profile_costs(GNN(model_cfg("gcnii", 2), f, c), sample, reps=1)
    assert len(costs) == 2 and first > 0 and last > 0
    with pytest.raises(GnnPipeError, match="stages"):
        assign_stages(model, 7, "estimate", num_nodes=72, num_edges=block.nnz)
    assert isinstance(est, StageAssignment) and est.stage_of(0) == 0 and est.stage_of(5) == 2


def test_balanced_assignment_runs_exactly(stores):
    """An uneven ``estimate`` split (gcn: a wide first conv) is still exact with C = 1."""
    cfg = run_cfg(stores["connected-1"], "gcn", stages=2, chunks=1, layers=5, epochs=2, balance="estimate")
    per_rank = spawn([cfg], 2)
    ref_losses, ref_model = reference_training(cfg)
    assert np.allclose(per_rank[1][0]["losses"], ref_losses, rtol=0, atol=TOL)
    assert_state_close(per_rank[0][0]["state"], ref_model)
    assert per_rank[0][0]["bounds"] == per_rank[1][0]["bounds"]


# --------------------------------------------------------------------------- refusals
def test_bad_combinations(stores):
    good = run_cfg(stores["connected-4"], stages=2, chunks=4)
    check_pipeline_config(good)
    with pytest.raises(GnnPipeError, match="only 4 graph layers"):
        check_pipeline_config(replace(good, stages=5, workers=5, chunks=8))
    with pytest.raises(GnnPipeError, match="chunks >= stages"):
        check_pipeline_config(replace(good, stages=3, workers=3, chunks=2))
    with pytest.raises(GnnPipeError, match="no graph layers"):
        check_pipeline_config(replace(good, model=model_cfg("mlp")))
    with pytest.raises(GnnPipeError, match="mode 'pipeline'"):
        check_pipeline_config(replace(good, mode="graph"))
    with pytest.raises(GnnPipeError, match="momentum"):
        check_pipeline_config(replace(good, pipeline=replace(good.pipeline, momentum=1.0)))
    with pytest.raises(GnnPipeError, match="made for 4 parts, this run needs 6"):
        PipelineEngine(run_cfg(stores["connected-4"], chunks=6), None, None, "cpu")
    with pytest.raises(GnnPipeError, match="no such chunk store"):
        PipelineEngine(run_cfg(stores["connected-4"].parent / "missing.h5", chunks=4), None, None, "cpu")
