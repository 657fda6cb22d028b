"""Graph parallelism matches single-process training, and its ledger matches its closed form.

One spawned world per P in {2, 3, 4} (gloo, real processes) trains every model kind with
overlap on and off, in float64 and float32, for a few epochs on a small community graph
cut by METIS; the parent trains the same models in one process on the whole graph (a
plain reference loop: full Block, same seed, same Adam) and compares losses, final
weights and exact-inference metrics. The same runs give the ledger: bytes per epoch
summed over ranks must equal ``predicted_bytes()`` exactly.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gnnpipe.config import (GraphParallelConfig, ModelConfig, PartitionConfig, PipelineConfig, RunConfig,
                            TrainingConfig)
from gnnpipe.engine import ce_sum, make_optimizer
from gnnpipe.engine import exact_metrics
from gnnpipe.graph import Graph, csr_from_edges
from gnnpipe.io import GnnPipeError
from gnnpipe.models.block import Block
from gnnpipe.models.model import GNN
from gnnpipe.parallel.comm import Communicator
from gnnpipe.layout import ParallelDims
from gnnpipe.parallel.groups import build_groups
from gnnpipe.costmodel.bytes import graph_parallel_bytes
from gnnpipe.parallel.layout_engine import LayoutEngine
from gnnpipe.parallel.stage import split_block
from gnnpipe.parallel.testing import spawn_multi_process
from gnnpipe.partition import partition_graph
from gnnpipe.store import ChunkStore, materialize

EPOCHS = 4
KINDS = ("gcn", "sage", "gat", "gcnii", "resgcn")
DTYPES = ("float64", "float32")
TOL = {"float64": dict(rtol=1e-10, atol=1e-10), "float32": dict(rtol=1e-5, atol=1e-5)}


# --------------------------------------------------------------------------- the graph
def community_graph(n: int = 210, k: int = 5, f: int = 12, seed: int = 0, isolate_first: bool = False) -> Graph:
    """``k`` communities, dense inside, sparse between: METIS parts have inner rows and halos.

    Node ids are sorted by community; ``isolate_first`` drops every edge between
    community 0 and the rest (a part that neither needs nor supplies a halo)."""
    rng = np.random.default_rng(seed)
    comm = np.sort(rng.integers(0, k, n))
    src, dst = rng.integers(0, n, 6 * n), rng.integers(0, n, 6 * n)
    keep = (comm[src] == comm[dst]) | (rng.random(src.shape[0]) < 0.08)
    if isolate_first:
        keep &= (comm[src] == 0) == (comm[dst] == 0)
    indptr, indices = csr_from_edges(src[keep], dst[keep], n)
    labels = np.where(rng.random(n) < 0.8, comm, rng.integers(0, k, n)).astype(np.int64)
    features = (rng.normal(size=(n, f)) + 0.8 * np.eye(k, f)[labels]).astype(np.float32)
    split = rng.random(n)
    return Graph(indptr, indices, features, labels, split < 0.6, (split >= 0.6) & (split < 0.8), split >= 0.8,
                 num_classes=k, name="community", params={"community_sizes": np.bincount(comm, minlength=k).tolist()})


def mirrors_brute_force(graph: Graph, a: np.ndarray) -> list[int]:
    """Distinct out-of-part sources of edges into each part (independent of the store)."""
    dst = np.repeat(np.arange(graph.num_nodes), np.diff(graph.indptr))
    return [len({int(s) for s, d in zip(graph.indices, dst) if a[d] == p and a[s] != p})
            for p in range(int(a.max()) + 1)]


def model_cfg(kind: str) -> ModelConfig:
    # 3 layers: first, hidden and last convs; LayerNorm on for sage to cover it
    return ModelConfig(kind=kind, layers=3, hidden=8, dropout=0.0, heads=2 if kind == "gat" else ModelConfig.heads,
                       norm="layer" if kind == "sage" else "none")


def run_cfg(store_path: str, workers: int, kind: str, dtype: str, overlap: bool, cache: bool = True,
            dropout: float = 0.0) -> RunConfig:
    return RunConfig(
        run_id=f"t-{kind}", mode="graph", dataset_name="community", graph_path="", store_path=store_path,
        out_dir="", model=dataclasses.replace(model_cfg(kind), dropout=dropout),
        training=TrainingConfig(epochs=EPOCHS, lr=0.02, weight_decay=5e-4, seed=3, dtype=dtype),
        partitioning=PartitionConfig(), pipeline=PipelineConfig(),
        graph_parallel=GraphParallelConfig(overlap=overlap, cache_input_halo=cache),
        workers=workers, stages=1, ways=workers, chunks=workers)


# cases each world runs: (kind, dtype, overlap, cache_input_halo)
CASES = [(k, d, o, True) for k in KINDS for d in DTYPES for o in (False, True)] + \
        [(k, "float64", o, False) for k in ("gcn", "gcnii") for o in (False, True)]


# --------------------------------------------------------------------------- the workers
def _train_cases(rank: int, world: int, store_path: str, cases: list) -> dict:
    groups = build_groups(ParallelDims("graph", world, 1, world), rank)
    out = {}
    for case in cases:
        kind, dtype, overlap, cache = case[:4]
        dropout = case[4] if len(case) > 4 else 0.0
        comm = Communicator(groups, "cpu")
        engine = LayoutEngine(run_cfg(store_path, world, kind, dtype, overlap, cache, dropout), groups, comm, "cpu")
        losses, stats = [], []
        for e in range(EPOCHS):
            comm.set_epoch(e)
            s = engine.train_epoch(e)
            losses.append(s.loss)
            stats.append((s.compute_s, s.comm_s))
        comm.set_epoch(-1)
        metrics = engine.evaluate()
        weights = torch.cat([p.detach().reshape(-1).double() for p in engine.named_parameters().values()])
        out[case] = {
            "losses": losses, "stats": stats, "metrics": metrics, "state": engine.full_state_dict(),
            "weights": weights,  # every rank: replication check
            "bytes": [comm.epoch_bytes(e) for e in range(EPOCHS)],
            "ledger": comm.ledger_dict(), "predicted": engine.predicted_bytes(),
            "by_kind": engine.predicted_bytes_by_kind(), "mirrors": engine.mirrors,
        }
    return out


def reference(graph: Graph, kind: str, dtype: str, epochs: int = EPOCHS):
    """Single-process training on the whole graph: the ground truth."""
    dt = {"float64": torch.float64, "float32": torch.float32}[dtype]
    cfg = run_cfg("", 1, kind, dtype, False)
    block = Block.full(graph.indptr, graph.indices, dt)
    x = torch.as_tensor(graph.features).to(dt)
    y = torch.as_tensor(graph.labels)
    masks = {s: torch.as_tensor(getattr(graph, f"{s}_mask")) for s in ("train", "val", "test")}
    torch.manual_seed(cfg.training.seed)
    model = GNN(cfg.model, graph.num_features, graph.num_classes).to(dt)
    opt = make_optimizer(model.parameters(), cfg.training)
    losses = []
    for _ in range(epochs):
        opt.zero_grad(set_to_none=True)
        loss = ce_sum(model(x, block), y, masks["train"]) / int(masks["train"].sum())
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, model.state_dict(), exact_metrics(model, block, x, y, masks)


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def graph():
    return community_graph()


@pytest.fixture(scope="module")
def stores(graph, tmp_path_factory):
    root = tmp_path_factory.mktemp("gp")
    out = {}
    for parts in (2, 3, 4):
        a = partition_graph(graph, "metis", parts, seed=1)
        path = root / f"metis-{parts}.h5"
        materialize(graph, a, path, method="metis")
        out[parts] = (str(path), a)
    return out


@pytest.fixture(scope="module")
def references(graph):
    return {(k, d): reference(graph, k, d) for k in KINDS for d in DTYPES}


@pytest.fixture(scope="module", ids=lambda p: f"P{p}",
                params=[2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def world(request, stores):
    p = request.param
    path, a = stores[p]
    with ChunkStore(path) as s:  # the graph is cut for real: some inner rows, some halo everywhere
        assert all(0 < s.n_inner(q) < s.offsets[q + 1] - s.offsets[q] for q in range(p))
    return p, a, spawn_multi_process(_train_cases, p, path, CASES, timeout=120)


# --------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("kind", KINDS)
def test_graph_parallel_matches_single_process(world, references, kind):
    p, _, res = world
    for dtype in DTYPES:
        ref_losses, ref_state, ref_metrics = references[kind, dtype]
        for overlap in (False, True):
            case = (kind, dtype, overlap, True)
            r0 = res[0][case]
            where = f"{kind} {dtype} P={p} overlap={overlap}"
            np.testing.assert_allclose(r0["losses"], ref_losses, **TOL[dtype], err_msg=where)
            assert set(r0["state"]) == set(ref_state), where
            for name, v in ref_state.items():
                torch.testing.assert_close(r0["state"][name], v, **TOL[dtype], msg=f"{where}: {name}")
            for s in ("train_acc", "val_acc", "test_acc"):
                assert r0["metrics"][s] == pytest.approx(ref_metrics[s], abs=1e-12), where
            assert r0["metrics"]["loss"] == pytest.approx(ref_metrics["loss"], rel=1e-5), where
            for r in range(1, p):  # every rank reports the same loss and holds the same weights
                assert res[r][case]["losses"] == r0["losses"], where
                assert torch.equal(res[r][case]["weights"], r0["weights"]), where
                assert res[r][case]["state"] is None


@pytest.mark.parametrize("kind", ["gcn", "gcnii"])
def test_exchanging_input_features_every_epoch_is_exact_too(world, references, kind):
    p, _, res = world
    ref_losses, ref_state, _ = references[kind, "float64"]
    for overlap in (False, True):
        r0 = res[0][(kind, "float64", overlap, False)]
        np.testing.assert_allclose(r0["losses"], ref_losses, **TOL["float64"])
        for name, v in ref_state.items():
            torch.testing.assert_close(r0["state"][name], v, **TOL["float64"])


# --------------------------------------------------------------------------- the ledger
def test_ledger_equals_closed_form(world, graph):
    p, a, res = world
    mirrors = mirrors_brute_force(graph, a)
    for case in CASES:
        kind, dtype, _, cache = case
        per_rank = [res[r][case] for r in range(p)]
        assert per_rank[0]["mirrors"] == mirrors, case
        predicted = per_rank[0]["predicted"]
        for e in range(EPOCHS):
            assert sum(x["bytes"][e] for x in per_rank) == predicted, (case, e)
        # split by kind: halo traffic vs all-reduce, each against its own formula
        halo = sum(x["ledger"][0].get("halo", {}).get("sent", 0) for x in per_rank)
        grad = sum(x["ledger"][0]["grad_allreduce"]["sent"] for x in per_rank)
        by = per_rank[0]["by_kind"]
        assert (halo, grad) == (by["halo"], by["allreduce"]), case
        # independent recomputation from the model's shape
        torch.manual_seed(0)
        model = GNN(model_cfg(kind), graph.num_features, graph.num_classes)
        b = {"float64": 8, "float32": 4}[dtype]
        # the narrow side (#27): after conv 0, GCN / SAGE send min(in, out), GAT min(in, heads x head width)
        projected = {"gcn": lambda c: c.out_dim, "sage": lambda c: c.out_dim,
                     "gat": lambda c: c.heads * c.out_dim_head}.get(kind, lambda c: c.in_dim)
        dims = [c.in_dim if l == 0 else min(c.in_dim, projected(c.conv if hasattr(c, "conv") else c))
                for l, c in enumerate(model.convs)]
        n_params = sum(q.numel() for q in model.parameters())
        first = 0 if cache else (2 if model.encoder is not None else 1)
        assert halo == sum(mirrors) * b * (first * dims[0] + 2 * sum(dims[1:])), case
        assert grad == 2 * (p - 1) * n_params * b, case
        # what the cache costs: the halo's features once, at set-up (epoch -1)
        setup = sum(x["ledger"][-1].get("halo_setup", {}).get("sent", 0) for x in per_rank)
        assert setup == (sum(mirrors) * graph.num_features * b if cache else 0), case


@pytest.mark.parametrize("kind", ["gcn", "gcnii"])
def test_report_predicts_the_measured_bytes_without_the_input_cache(world, graph, tmp_path, kind):
    """cache_input_halo: false: the report's cost model books the first conv's halo as the
    engine does ("forward" for raw features, "exchanged" behind an encoder), so its bytes are
    the bytes measured; booking GCN's as "exchanged" over-predicts by M·F·b."""
    from gnnpipe.config import dump_run_config
    from gnnpipe.graph import write_graph
    from gnnpipe.report.predictions import Predictor
    from gnnpipe.report.records import Run

    p, _, res = world
    case = (kind, "float64", True, False)
    measured = sum(res[r][case]["bytes"][0] for r in range(p))
    assert measured == res[0][case]["predicted"]
    graph_path = tmp_path / "graph.h5"
    write_graph(graph_path, graph)
    cfg = dataclasses.replace(run_cfg("", p, kind, "float64", True, cache=False), graph_path=str(graph_path),
                              out_dir=str(tmp_path), partitioning=PartitionConfig(method="metis", seed=1))
    (tmp_path / "run.yaml").write_text(dump_run_config(cfg))
    record = {"mode": "graph", "world_size": p, "stages": 1, "ways": p, "chunks": p, "dtype_bytes": 8}
    pred = Predictor("cpu-2core")(Run(record, None, tmp_path))
    assert pred.available, pred.reason
    assert pred.bytes == measured


def test_comm_time_is_accounted(world):
    p, _, res = world
    for r in range(p):
        compute, comm = np.array(res[r][("gcn", "float32", True, True)]["stats"]).sum(axis=0)
        assert compute > 0 and comm > 0


def test_closed_form_generalises_design_formula():
    # GCN, L layers: docs/DESIGN.md's 2 ΣM (F + (L-1) H) b is the "exchanged" form
    mirrors, F, H, L = [10, 7, 3], 50, 16, 4
    dims = [F] + [H] * (L - 1)
    full = graph_parallel_bytes(mirrors, dims, 4, 1000, 3, "exchanged")
    assert full["halo"] == 2 * 20 * (F + (L - 1) * H) * 4 and full["allreduce"] == 2 * 2 * 1000 * 4
    assert graph_parallel_bytes(mirrors, dims, 4, 1000, 3, "forward")["halo"] == full["halo"] - 20 * F * 4
    assert graph_parallel_bytes(mirrors, dims, 4, 1000, 3, "local")["halo"] == full["halo"] - 2 * 20 * F * 4
    assert graph_parallel_bytes([0], dims, 4, 1000, 1)["total"] == 0
    with pytest.raises(GnnPipeError, match="3 mirror counts"):
        graph_parallel_bytes(mirrors[:2], dims, 4, 1000, 3)


# --------------------------------------------------------------------------- with dropout
@pytest.mark.slow
def test_dropout_keeps_weights_replicated(stores):
    path, _ = stores[2]
    cases = [("gcn", "float32", True, True, 0.5), ("resgcn", "float32", False, True, 0.5)]
    res = spawn_multi_process(_train_cases, 2, path, cases, timeout=90)
    for case in cases:
        assert torch.equal(res[0][case]["weights"], res[1][case]["weights"])
        assert res[0][case]["losses"] == res[1][case]["losses"]
        assert all(np.isfinite(res[0][case]["losses"]))


# --------------------------------------------------------------------------- the narrow side
def _narrow_run(rank: int, world: int, store_path: str, kind: str) -> dict:
    """Train two epochs of a 3-layer ``kind`` 64->128->128->16, recording every halo row width."""
    groups = build_groups(ParallelDims("graph", world, 1, world), rank)
    comm = Communicator(groups, "cpu")
    widths = []
    send = comm.all_to_all_rows

    def recording(rows, *args, **kw):
        if kw.get("op") == "halo":
            widths.append(int(rows.shape[1]))
        return send(rows, *args, **kw)
    comm.all_to_all_rows = recording
    cfg = run_cfg(store_path, world, kind, "float64", True)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hidden=128, norm="none"))
    engine = LayoutEngine(cfg, groups, comm, "cpu")
    losses = []
    for e in range(2):
        comm.set_epoch(e)
        losses.append(engine.train_epoch(e).loss)
    return {"widths": widths, "losses": losses, "bytes": [comm.epoch_bytes(e) for e in range(2)],
            "by_kind": engine.predicted_bytes_by_kind(), "mirrors": engine.mirrors,
            "halo": comm.ledger_dict()[0]["halo"]["sent"]}


@pytest.mark.parametrize("kind,last", [("sage", 16), ("gcn", 16), ("gat", 32)])
def test_narrow_side_crosses_the_wire(tmp_path, kind, last):
    """Issue #27: a 3-layer conv 64->128->128->16 at P = 2 sends 16-wide rows (and gradients) at
    the last layer (GAT: its 2 heads' projections, 32), 128-wide at the middle one, nothing per
    epoch at the first (cached); the ledger equals the closed form 2 · Σ M · (128 + last) · b, and
    the losses are single-process's (float64)."""
    g = community_graph(n=320, k=16, f=64, seed=2)
    a = partition_graph(g, "metis", 2, seed=1)
    path = tmp_path / "narrow-2.h5"
    materialize(g, a, path, method="metis")
    res = spawn_multi_process(_narrow_run, 2, str(path), kind, timeout=120)
    mirrors = mirrors_brute_force(g, a)
    assert res[0]["mirrors"] == mirrors and sum(mirrors) > 0
    # per epoch: layer 1 forward, layer 2 forward, layer 2 backward, layer 1 backward
    assert res[0]["widths"] == [128, last, last, 128] * 2
    closed = sum(mirrors) * 2 * (128 + last) * 8
    assert sum(r["halo"] for r in res) == res[0]["by_kind"]["halo"] == closed
    for e in range(2):
        assert sum(r["bytes"][e] for r in res) == res[0]["by_kind"]["total"]
    cfg = run_cfg("", 1, kind, "float64", False)
    ref = dataclasses.replace(cfg.model, hidden=128, norm="none")
    torch.manual_seed(cfg.training.seed)
    model = GNN(ref, g.num_features, g.num_classes).to(torch.float64)
    assert model.halo_dims() == [64, 128, last]
    opt = make_optimizer(model.parameters(), cfg.training)
    block = Block.full(g.indptr, g.indices, torch.float64)
    x, y, m = torch.as_tensor(g.features).double(), torch.as_tensor(g.labels), torch.as_tensor(g.train_mask)
    for e in range(2):
        opt.zero_grad(set_to_none=True)
        loss = ce_sum(model(x, block), y, m) / int(m.sum())
        loss.backward()
        opt.step()
        np.testing.assert_allclose(res[0]["losses"][e], float(loss.detach()), **TOL["float64"])


# --------------------------------------------------------------------------- locality pieces
def test_a_store_in_locality_pieces_trains_as_single_process(graph, references, tmp_path):
    """Parts of ~105 rows cut into pieces of 25 (``partition.part_locality_key``): inside each
    part the inner rows still come first, each group runs piece by piece, and graph parallelism
    on that store equals single-process training (float64) as on any other numbering."""
    from gnnpipe.partition import part_locality_key

    a = partition_graph(graph, "metis", 2, seed=1)
    key = part_locality_key(graph, a, 2, part_nodes=25)
    assert [len(np.unique(key[a == p])) for p in range(2)] == [int((a == p).sum()) // 25 for p in range(2)]
    path = tmp_path / "pieces-2.h5"
    materialize(graph, a, path, method="metis", piece_nodes=25)
    with ChunkStore(path) as s:
        for p in range(2):
            lo, hi, ni = int(s.offsets[p]), int(s.offsets[p + 1]), s.n_inner(p)
            assert 0 < ni < hi - lo
            for group in (s.perm[lo:lo + ni], s.perm[lo + ni:hi]):  # pieces in order, ids ascending in each
                k = key[group]
                assert np.all(np.diff(k) >= 0) and len(np.unique(k)) > 1
                assert all(np.all(np.diff(group[k == v]) > 0) for v in np.unique(k))
    cases = [(kind, "float64", False, True) for kind in ("gcn", "sage", "gat")]
    res = spawn_multi_process(_train_cases, 2, str(path), cases, timeout=120)
    for case in cases:
        ref_losses, ref_state, _ = references[case[0], "float64"]
        np.testing.assert_allclose(res[0][case]["losses"], ref_losses, **TOL["float64"], err_msg=case[0])
        for name, v in ref_state.items():
            torch.testing.assert_close(res[0][case]["state"][name], v, **TOL["float64"], msg=f"{case[0]}: {name}")


# --------------------------------------------------------------------------- a part with no halo
@pytest.mark.slow
def test_part_without_halo_takes_part_in_every_exchange(tmp_path):
    """Part 0 is a connected component of its own: all its all-to-alls carry zero rows, its
    boundary is empty (the halo is never used, so its gradient exchange runs on zeros),
    while parts 1 and 2 exchange real rows; training is still exactly single-process."""
    g = community_graph(isolate_first=True)
    n, first = g.num_nodes, g.params["community_sizes"][0]  # community 0: ids [0, first)
    a = np.where(np.arange(n) < first, 0, np.where(np.arange(n) < (first + n) // 2, 1, 2))
    assert mirrors_brute_force(g, a)[0] == 0 and min(mirrors_brute_force(g, a)[1:]) > 0
    path = tmp_path / "isolated-3.h5"
    materialize(g, a, path, method="contiguous")
    cases = [("gcn", "float64", True, True), ("gcn", "float64", False, True), ("gcnii", "float64", True, False),
             ("gat", "float64", True, True)]
    res = spawn_multi_process(_train_cases, 3, str(path), cases, timeout=90)
    for case in cases:
        ref_losses, ref_state, _ = reference(g, case[0], "float64")
        np.testing.assert_allclose(res[0][case]["losses"], ref_losses, **TOL["float64"], err_msg=str(case))
        for name, v in ref_state.items():
            torch.testing.assert_close(res[0][case]["state"][name], v, **TOL["float64"], msg=f"{case}: {name}")
        assert sum(res[r][case]["bytes"][0] for r in range(3)) == res[0][case]["predicted"]
        assert res[0][case]["ledger"][0]["halo"]["sent"] == 0 < res[1][case]["ledger"][0]["halo"]["sent"]


# --------------------------------------------------------------------------- refusals, pieces
def test_store_for_another_part_count_is_refused(stores):
    path, _ = stores[3]
    comm = Communicator(None, "cpu")  # a world of one: this run needs a 1-part store
    with pytest.raises(GnnPipeError, match=r"made for 3 parts, this run needs 1.*materialize"):
        LayoutEngine(run_cfg(path, 1, "gcn", "float32", True), None, comm, "cpu")
    with pytest.raises(GnnPipeError, match="laid out for 3 workers, the process group has 1"):
        LayoutEngine(run_cfg(path, 3, "gcn", "float32", True), None, comm, "cpu")


def test_world_of_one_is_single_process(graph, tmp_path, references):
    path = tmp_path / "metis-1.h5"
    materialize(graph, np.zeros(graph.num_nodes, dtype=np.int64), path, method="metis")
    comm = Communicator(None, "cpu")
    engine = LayoutEngine(run_cfg(str(path), 1, "gcnii", "float64", True), None, comm, "cpu")
    losses = []
    for e in range(EPOCHS):
        comm.set_epoch(e)
        losses.append(engine.train_epoch(e).loss)
    np.testing.assert_allclose(losses, references["gcnii", "float64"][0], **TOL["float64"])
    assert engine.predicted_bytes() == 0 and all(comm.epoch_bytes(e) == 0 for e in range(EPOCHS))


def test_split_block_covers_the_local_block(stores):
    path, _ = stores[4]
    with ChunkStore(path) as s:
        for p in range(4):
            b = s.local_block(p, torch.float64)
            n_own, ni = int(s.offsets[p + 1] - s.offsets[p]), s.n_inner(p)
            inner, boundary = split_block(b, ni, n_own)
            assert (inner.n_dst, boundary.n_dst, inner.n_src, boundary.n_src) == (ni, n_own - ni, n_own, b.n_src)
            assert inner.nnz + boundary.nnz == b.nnz and boundary.dst_offset == ni
            assert torch.equal(torch.cat([inner.indices, boundary.indices]), b.indices)
            assert torch.equal(torch.cat([inner.deg_dst, boundary.deg_dst]), b.deg_dst)
