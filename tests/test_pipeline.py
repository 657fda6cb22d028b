"""GNNPipe (the layout engine with one way, ``gnnpipe.parallel.layout_engine``) against single-process references.

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
from gnnpipe.engine import exact_metrics
from gnnpipe.io import GnnPipeError
from gnnpipe.models.model import GNN
from gnnpipe.parallel.balance import (StageAssignment, assign_stages, balanced_bounds, profile_costs,
                                      stage_costs, uniform_bounds)
from gnnpipe.costmodel.bytes import pipeline_bytes
from gnnpipe.parallel.layout_engine import LayoutEngine, check_config
from gnnpipe.parallel.stage import (NO_HALO, Cached, Chunk, Exchanged, ExchangedIntoHistory, FromHistory, Given,
                                    History, Stage, WayData, chunk_order)
from gnnpipe.parallel.testing import spawn_multi_process
from gnnpipe.partition import partition_graph
from gnnpipe.store import ChunkStore, materialize
from helpers import make_graph, random_graph

KINDS = ("gcn", "sage", "gat", "gcnii", "resgcn")
OFF = dict(shuffle_chunks=False, grad_correction=False, snapshot_every=0, momentum=0.0, recompute=False)
TECHNIQUES = {  # name -> PipelineConfig overrides on top of OFF
    "off": {},
    "shuffle": dict(shuffle_chunks=True),
    "grad_correction": dict(grad_correction=True, grad_scale=2.0),
    "snapshot": dict(snapshot_every=3),  # epochs 0-2 read the warm start
    "momentum": dict(momentum=0.9),
    "recompute": dict(recompute=True),
    "all": dict(shuffle_chunks=True, grad_correction=True, grad_scale=2.0, snapshot_every=3,
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


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These graphs are tiny: extra threads only contend with the other workers on the box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
        losses.append(float(loss.detach()))
    return losses, model


def realized_training(cfg: RunConfig):
    """GNNPipe's training, formulated on whole-graph tensors (independent of the engine).

    In epoch ``e``, conv ``l >= 1`` of chunk ``c`` reads its own rows and the rows of
    chunks earlier in the order *live*, the rows of later chunks from the *history*:
    the exact initial embeddings at first (the warm start), then the previous epoch's
    inputs (or their moving average with ``momentum``), read from a snapshot refreshed
    every ``snapshot_every`` epochs when that is on. Conv 0's input (features, or the
    encoder on every row) is always live. Gradients:

    * ``grad_correction``: historical rows are constants; the gradient reaching a live
      row of an *earlier* chunk is multiplied by ``grad_scale`` (value unchanged);
    * otherwise the gradient a historical row collects in epoch ``e`` is added to that
      row's live input gradient in epoch ``e + 1`` (the term ``<h_l, deferred_l>``).

    Returns (losses, model, {name: grad of epoch 0}).
    """
    pc = cfg.pipeline
    x, y, masks, full, f, ncls = data(cfg.store_path)
    with ChunkStore(cfg.store_path) as s:
        C, offsets = s.num_parts, [int(o) for o in s.offsets]
        blocks = [s.chunk_block(c, torch.float64) for c in range(C)]
        chunk_of = torch.as_tensor(s.part_of(np.arange(s.num_nodes)))[:, None]
    torch.manual_seed(cfg.training.seed)
    model = GNN(cfg.model, f, ncls).to(torch.float64)
    opt = make_optimizer(model.parameters(), cfg.training)
    n_train = int(masks["train"].sum())
    hist = {}
    with torch.no_grad():  # warm start: every conv's exact input under the initial weights
        h = model.encode(x)
        x0 = h if model.needs_x0 else None
        for l, conv in enumerate(model.convs):
            hist[l] = h
            h = conv(h, full, x0)
    snap = dict(hist)
    deferred = {l: torch.zeros_like(v) for l, v in hist.items()}
    losses, grads0 = [], None
    for epoch in range(cfg.training.epochs):
        if pc.snapshot_every and epoch % pc.snapshot_every == 0 and epoch > 0:
            snap = dict(hist)
        stale = snap if pc.snapshot_every else hist
        order = chunk_order(C, epoch, cfg.training.seed, pc.shuffle_chunks)
        pos = torch.empty(C, dtype=torch.int64)
        pos[torch.as_tensor(order)] = torch.arange(C)
        opt.zero_grad(set_to_none=True)
        h = model.encode(x)
        x0 = h if model.needs_x0 else None
        scale = pc.grad_scale if pc.grad_correction else 1.0
        extra, live_in, leaves = 0.0, {}, {}
        for l, conv in enumerate(model.convs):
            if l > 0:
                live_in[l] = h.detach()
                leaves[l] = stale[l].clone().requires_grad_(not pc.grad_correction)
                if not pc.grad_correction:
                    extra = extra + (h * deferred[l]).sum()
                fresh = h if scale == 1.0 else scale * h - (scale - 1.0) * h.detach()  # grad x scale
            outs = []
            for c in range(C):
                src = h if l == 0 else torch.where(
                    chunk_of == c, h, torch.where(pos[chunk_of] < pos[c], fresh, leaves[l]))
                outs.append(conv(src, blocks[c], None if x0 is None else x0[offsets[c]:offsets[c + 1]]))
            h = torch.cat(outs)
        loss = ce_sum(model.decode(h), y, masks["train"]) / n_train
        (loss + extra).backward()
        losses.append(float(loss.detach()))
        if epoch == 0:
            grads0 = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        for l in live_in:
            if not pc.grad_correction:
                deferred[l] = leaves[l].grad if leaves[l].grad is not None else torch.zeros_like(hist[l])
            hist[l] = pc.momentum * hist[l] + (1 - pc.momentum) * live_in[l] if pc.momentum else live_in[l]
    return losses, model, grads0


# --------------------------------------------------------------------------- the worker
def _pipeline_worker(rank, world, jobs):
    """Run each (cfg, epochs) job as a pipeline of ``world`` stages; report what the tests check."""
    from gnnpipe.parallel.comm import Communicator
    from gnnpipe.layout import ParallelDims
    from gnnpipe.parallel.groups import build_groups

    groups = build_groups(ParallelDims("pipeline", world, world, 1), rank)
    results = []
    for cfg in jobs:
        comm = Communicator(groups, "cpu")
        engine = LayoutEngine(cfg, groups, comm, "cpu")
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
    return spawn_multi_process(_pipeline_worker, world, jobs, timeout=300)


def assert_state_close(state, model, tol=TOL):
    ref = model.state_dict()
    assert list(state) == list(ref)  # same names, same order as the single-process model
    for k, v in ref.items():
        assert state[k].shape == v.shape
        assert torch.allclose(state[k], v, rtol=0, atol=tol), k


# --------------------------------------------------------------------------- the spawned runs
CROSS = {2: ("gcnii", tuple(TECHNIQUES)),  # gcnii: x0 travels with the rows
         4: ("resgcn", ("off", "grad_correction", "all"))}


@pytest.fixture(scope="module")
def spawned(stores):
    """Every multi-process job, one spawn per world size: {key: (cfg, [result of each rank])}."""
    jobs: dict[int, dict] = {2: {}, 3: {}, 4: {}}
    for S in jobs:  # C = 1: exact model parallelism, every kind
        for kind in KINDS:
            jobs[S][("c1", S, kind)] = run_cfg(stores["connected-1"], kind, stages=S, chunks=1, epochs=3)
    for S, (kind, techs) in CROSS.items():  # a connected graph in 4 chunks
        for t in techs:
            jobs[S][("cross", S, t)] = run_cfg(stores["connected-4"], kind, stages=S, chunks=4, epochs=3,
                                               **TECHNIQUES[t])
    for kind, techs in (("gcnii", TECHNIQUES), ("gat", ("off", "all"))):  # 6 disjoint chunks
        for t in techs:
            jobs[3][("disjoint", kind, t)] = run_cfg(stores["disjoint-6"], kind, stages=3, chunks=6, layers=3,
                                                     epochs=3, **TECHNIQUES[t])
    # an uneven estimated split (gcnii's encoder F -> H counts on stage 0: convs [0,1) | [1,3))
    jobs[2][("balanced",)] = run_cfg(stores["connected-1"], "gcnii", stages=2, chunks=1, layers=3, epochs=2,
                                     balance="estimate")
    out = {}
    for S, named in jobs.items():
        per_rank = spawn(list(named.values()), S)
        for i, (key, cfg) in enumerate(named.items()):
            out[key] = (cfg, [per_rank[r][i] for r in range(S)])
    return out


def select(spawned, kind):
    return {k: v for k, v in spawned.items() if k[0] == kind}


def assert_ledger(cfg, ranks):
    predicted = ranks[0]["predicted"]
    assert all(r["predicted"] == predicted for r in ranks)
    for epoch in range(cfg.training.epochs):
        assert sum(r["sent"][epoch] for r in ranks) == predicted, (cfg.model.kind, epoch)


# --------------------------------------------------------------------------- exactness, C = 1
def test_c1_pipeline_matches_unsharded(spawned):
    runs = select(spawned, "c1")
    assert len(runs) == 3 * len(KINDS)
    for (_, S, kind), (cfg, ranks) in runs.items():
        ref_losses, ref_model = reference_training(cfg)
        for r in ranks:  # every rank reports the same (global) loss
            assert np.allclose(r["losses"], ref_losses, rtol=0, atol=TOL), (S, kind)
        assert_state_close(ranks[0]["state"], ref_model)
        assert all(r["state"] is None for r in ranks[1:])
        x, y, masks, block, _, _ = data(cfg.store_path)
        ref_eval = exact_metrics(ref_model, block, x, y, masks)
        for r in ranks:
            assert r["eval"].keys() == ref_eval.keys()
            assert all(abs(r["eval"][k] - ref_eval[k]) < 1e-9 for k in ref_eval), (S, kind)


def test_ledger_matches_closed_form(spawned):
    with ChunkStore(spawned[("c1", 2, "gcn")][0].store_path) as s:
        n = s.num_nodes
    for (_, S, kind), (cfg, ranks) in select(spawned, "c1").items():
        # every boundary carries one hidden-width row (H = 8, float64) per node, GCNII's x0 too
        assert ranks[0]["predicted"] == 2 * (S - 1) * n * 8 * 8 * (2 if kind == "gcnii" else 1)
        assert_ledger(cfg, ranks)
    for key in ("cross", "disjoint", "balanced"):
        for cfg, ranks in select(spawned, key).values():
            assert_ledger(cfg, ranks)
    # control traffic (warm start, evaluation, weights, loss) is counted, but apart
    assert all(r["control"] > 0 for r in spawned[("cross", 2, "off")][1])


def test_time_split_is_reported(spawned):
    for S in (2, 3, 4):
        ranks = spawned[("c1", S, "gcnii")][1]
        for r in ranks:
            for compute, comm, bubble in r["stats"]:
                assert compute > 0 and comm >= 0 and bubble >= 0
        # the last stage waits for its first chunk every epoch: idle time, not compute
        assert all(b > 0 for _, _, b in ranks[-1]["stats"])


def test_balanced_assignment_runs_exactly(spawned):
    cfg, ranks = spawned[("balanced",)]
    ref_losses, ref_model = reference_training(cfg)
    assert np.allclose(ranks[1]["losses"], ref_losses, rtol=0, atol=TOL)
    assert_state_close(ranks[0]["state"], ref_model)
    assert ranks[0]["bounds"] == ranks[1]["bounds"] and ranks[0]["bounds"] != uniform_bounds(3, 2)


# --------------------------------------------------------------------------- C > 1
def test_disjoint_chunks_exact_with_every_technique(spawned):
    """No edge between chunks: no halo, no history read, so every technique stays exact."""
    runs = select(spawned, "disjoint")
    assert {t for (_, k, t) in runs if k == "gcnii"} == set(TECHNIQUES)
    for (_, kind, tech), (cfg, ranks) in runs.items():
        ref_losses, ref_model = reference_training(cfg)
        assert np.allclose(ranks[0]["losses"], ref_losses, rtol=0, atol=TOL), (kind, tech)
        assert_state_close(ranks[0]["state"], ref_model)


def assert_matches_realized(cfg, losses, state, grads0, what):
    ref_losses, ref_model, ref_grads0 = realized_training(cfg)
    assert np.allclose(losses, ref_losses, rtol=0, atol=TOL), what
    assert_state_close(state, ref_model)
    assert grads0.keys() == ref_grads0.keys()
    for k, g in ref_grads0.items():
        assert torch.allclose(grads0[k], g, rtol=0, atol=TOL), (what, k)


def test_cross_chunk_matches_realized_reference(spawned):
    """Connected graph, 4 chunks, 2 stages (gcnii, every technique), 4 stages (resgcn)."""
    runs = select(spawned, "cross")
    assert len(runs) == len(TECHNIQUES) + 3
    for (_, S, tech), (cfg, ranks) in runs.items():
        merged = {k: v for r in ranks for k, v in r["grads0"].items()}
        assert_matches_realized(cfg, ranks[0]["losses"], ranks[0]["state"], merged, (S, tech))
        ref_losses, _ = reference_training(cfg)
        assert abs(ranks[0]["losses"][0] - ref_losses[0]) < TOL, (S, tech)  # warm start: epoch 0 exact
        assert abs(ranks[0]["losses"][1] - ref_losses[1]) > 1e-8, (S, tech)  # then the history is stale
        # evaluation is exact inference of the weights actually trained
        x, y, masks, block, f, c = data(cfg.store_path)
        model = GNN(cfg.model, f, c).to(torch.float64)
        model.load_state_dict(ranks[0]["state"])
        ref_eval = exact_metrics(model, block, x, y, masks)
        assert all(abs(r["eval"][k] - ref_eval[k]) < 1e-9 for r in ranks for k in ref_eval)


@pytest.mark.parametrize("kind", ["gcn", "sage", "gat"])
def test_one_stage_matches_realized_reference(stores, kind):
    """In process (one stage, 6 chunks), the other kinds, techniques off and all on."""
    for tech in ("off", "grad_correction", "all"):
        cfg = run_cfg(stores["connected-6"], kind, chunks=6, layers=3, epochs=3, **TECHNIQUES[tech])
        eng = LayoutEngine(cfg, None, None, "cpu")
        losses, grads0 = [], None
        for e in range(3):
            losses.append(eng.train_epoch(e).loss)
            if e == 0:
                grads0 = {k: p.grad.clone() for k, p in eng.named_parameters().items()}
        assert_matches_realized(cfg, losses, eng.full_state_dict(), grads0, (kind, tech))


def test_realized_reference_is_not_trivially_exact(stores):
    """Each technique changes the reference's result: the comparisons above can fail."""
    finals = {t: realized_training(run_cfg(stores["connected-4"], "gcn", chunks=4, epochs=3,
                                           **TECHNIQUES[t]))[0][-1] for t in TECHNIQUES}
    for t in ("shuffle", "grad_correction", "snapshot", "momentum", "all"):
        assert abs(finals[t] - finals["off"]) > 1e-9, t
    exact, _ = reference_training(run_cfg(stores["connected-4"], "gcn", chunks=4, epochs=3))
    assert abs(finals["off"] - exact[-1]) > 1e-9


def test_recompute_is_bitwise_storing_with_dropout(stores):
    """One stage, in process: recompute rebuilds each (conv, chunk) with its RNG state."""
    for kind in ("gcnii", "resgcn", "gat"):
        base = dict(TECHNIQUES["all"])
        runs = {}
        for recompute in (False, True):
            cfg = run_cfg(stores["connected-6"], kind, chunks=6, epochs=3, dropout=0.3,
                          **{**base, "recompute": recompute})
            eng = LayoutEngine(cfg, None, None, "cpu")
            runs[recompute] = ([eng.train_epoch(e).loss for e in range(3)], eng.full_state_dict())
        assert runs[False][0] == runs[True][0], kind
        for k, v in runs[False][1].items():
            assert torch.equal(v, runs[True][1][k]), (kind, k)


# --------------------------------------------------------------------------- pieces
def test_each_convs_halo_source_is_chosen_once_at_set_up(stores):
    """#33: a stage picks each conv's halo source when it is built (training chunks, and the
    way's exact pass), from what its worker loaded (``WayData``), instead of switches per call."""
    names = lambda sources: ["none" if s is NO_HALO else type(s).__name__ for s in sources.values()]  # noqa: E731
    eng = LayoutEngine(run_cfg(stores["connected-4"], "gcn", chunks=4, layers=3), None, None, "cpu")
    assert isinstance(eng.data, WayData) and len(eng.data.chunks) == 4 and eng.data.n_own == 72
    assert set(eng.data.masks) == {"train", "val", "test"} and eng.data.labels.shape == (72,)
    assert names(eng.stage.sources) == ["Cached", "FromHistory", "FromHistory"]
    assert names(eng.stage.exact_sources) == ["Cached", "none", "none"]  # the exact pass goes chunk by chunk

    def with_ways(store, chunks, cache_input):  # a stand-in graph group: choosing sends nothing
        cfg = replace(run_cfg(store, "gcn", chunks=chunks, layers=3),
                      graph_parallel=GraphParallelConfig(cache_input_halo=cache_input))
        e = LayoutEngine(cfg, None, None, "cpu")
        gnn = GNN(cfg.model, e.in_features, e.num_classes).double()
        return Stage(gnn, e.data, layers=[0, 1, 2], first=True, last=True, comm=None, group=object(), cfg=cfg,
                     n_train=e.n_train, device=e.device)

    buffered = with_ways(stores["connected-4"], 4, True)
    assert names(buffered.sources) == ["Cached", "ExchangedIntoHistory", "ExchangedIntoHistory"]
    assert names(buffered.exact_sources) == ["Cached", "Exchanged", "Exchanged"]
    assert buffered.sources[1].history.hist is buffered.hist[1]
    one = with_ways(stores["connected-1"], 1, False)
    assert names(one.sources) == names(one.exact_sources) == ["Exchanged"] * 3
    assert [s.op for s in one.sources.values()] == ["halo"] * 3
    assert [s.op for s in one.exact_sources.values()] == ["control"] * 3
    assert one.overlapped == {0, 1, 2} and buffered.overlapped == {1, 2}


def test_halo_sources_read_this_epochs_rows_where_fresh():
    hist = History(4, 1, device="cpu", dtype=torch.float64, keep_history=True)
    hist.fill(torch.zeros(4, 1))
    hist.cur[:] = torch.arange(4.0)[:, None]  # this epoch's rows; the history holds zeros
    steps = torch.zeros(2, dtype=torch.int64)
    ch = Chunk(0, 2, None, torch.tensor([2, 3]), steps, None)
    rows = lambda t: t.flatten().tolist()  # noqa: E731
    assert rows(FromHistory(hist).receive(ch, None, None, torch.tensor([True, False]))) == [2.0, 0.0]
    assert rows(FromHistory(hist).receive(ch, None, None, None)) == [2.0, 3.0]
    assert FromHistory(hist).receive(Chunk(0, 2, None, steps[:0], steps[:0], None), None, None, None) is None
    h0 = torch.arange(4.0)[:, None] * 10
    assert rows(Cached(h0).receive(ch, None, None, None)) == [20.0, 30.0]
    assert Cached(h0).receive(Chunk(0, 4, None, torch.tensor([1]), steps[:1], None, whole_way=True),
                              None, None, None) is None  # the way: its own rows are the source space
    given = torch.ones(2, 1)
    assert Given(given).receive(ch, None, None, None) is given and NO_HALO.receive(ch, None, None, None) is None
    assert Given(given).send(ch, given) is None and isinstance(ExchangedIntoHistory(None, None, "halo", hist), Exchanged)


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
    assert pipeline_bytes(100, [16, 16, 16], 4)["total"] == 2 * 3 * 100 * 16 * 4
    assert pipeline_bytes(100, [16], 4, carries_x0=True)["total"] == 2 * 2 * 100 * 16 * 4
    assert pipeline_bytes(100, [], 4, carries_x0=True)["total"] == 0


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


def test_a_dominant_conv_does_not_pile_the_rest_onto_one_stage():
    """Conv 0 outweighs all others (Coauthor-Physics' 8415-wide input): every split has
    its bottleneck; the other 31 convs are still spread evenly, not 25 on one stage."""
    costs = [100.0] + [1.0] * 31
    bounds = balanced_bounds(costs, 8)
    _valid(bounds, 32, 8)
    loads = stage_costs(costs, bounds)
    assert bounds[0] == (0, 1) and max(loads) == 100.0
    assert max(loads[1:]) - min(loads[1:]) <= 1.0  # 31 convs over 7 stages: 4 or 5 each


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


# --------------------------------------------------------------------------- refusals
def test_bad_combinations(stores):
    good = run_cfg(stores["connected-4"], stages=2, chunks=4)
    check_config(good)
    with pytest.raises(GnnPipeError, match="only 4 graph layers"):
        check_config(replace(good, stages=5, workers=5, chunks=8))
    with pytest.raises(GnnPipeError, match=r"chunks \(2\) must be >= stages \(3\)"):
        check_config(replace(good, stages=3, workers=3, chunks=2))
    with pytest.raises(GnnPipeError, match="no graph layers"):
        check_config(replace(good, model=model_cfg("mlp")))
    with pytest.raises(GnnPipeError, match="modes graph, pipeline and hybrid, not 'single'"):
        check_config(replace(good, mode="single"))
    with pytest.raises(GnnPipeError, match="momentum"):
        check_config(replace(good, pipeline=replace(good.pipeline, momentum=1.0)))
    with pytest.raises(GnnPipeError, match="made for 4 parts, this run needs 6"):
        LayoutEngine(run_cfg(stores["connected-4"], chunks=6), None, None, "cpu")
    with pytest.raises(GnnPipeError, match="no such chunk store"):
        LayoutEngine(run_cfg(stores["connected-4"].parent / "missing.h5", chunks=4), None, None, "cpu")


def test_run_overrides_cover_every_pipeline_setting():
    """``runs[i].pipeline`` (the ablations) can override every PipelineConfig key, and only those."""
    from dataclasses import fields

    from gnnpipe.config import PipelineOverride, load_workflow_config, resolve_runs
    assert [f.name for f in fields(PipelineOverride)] == [f.name for f in fields(PipelineConfig)]
    wf = load_workflow_config({
        "datasets": {"d": {}}, "models": {"m": {"kind": "gcnii", "layers": 4}},
        "pipeline": {"momentum": 0.5, "snapshot_every": 7},
        "runs": [{"mode": "pipeline", "dataset": "d", "model": "m", "workers": 2, "name": "a",
                  "pipeline": {"momentum": 0.0, "chunks_per_stage": 2}},
                 {"mode": "pipeline", "dataset": "d", "model": "m", "workers": 2, "name": "b"}]})
    runs = resolve_runs(wf)
    assert (runs["a"].pipeline.momentum, runs["a"].pipeline.snapshot_every, runs["a"].chunks) == (0.0, 7, 4)
    assert (runs["b"].pipeline.momentum, runs["b"].chunks) == (0.5, 8)


def test_an_epoch_leaves_no_graph_behind(stores):
    """Each (conv, chunk)'s halo tap refers to its saved tensors, whose graph refers to the tap: a
    cycle through autograd's nodes that the collector cannot free (it leaked a graph per conv
    and epoch: 12 GB by epoch 24 of the report's GCNII). After an epoch the live tensors are as
    many as after the one before."""
    import gc
    import warnings

    cfg = run_cfg(stores["connected-6"], "gcnii", chunks=6, epochs=4, **TECHNIQUES["grad_correction"])
    eng = LayoutEngine(cfg, None, None, "cpu")
    live = []
    for e in range(4):
        eng.train_epoch(e)
        gc.collect()
        with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated reduce_op warns
            warnings.simplefilter("ignore")
            live.append(sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor)))
    assert live[1] == live[2] == live[3], live
