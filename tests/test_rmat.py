"""The R-MAT generator (``synthetic.generator: rmat``): a power law with hubs and isolated nodes over
planted communities; deterministic, streamed, refused when misconfigured, and learnable."""

import numpy as np
import pytest

from gnnpipe.config import ConfigError, RmatConfig, SyntheticConfig, load_workflow_config, resolve_runs
from gnnpipe.data.synthetic import RMAT_VERSION, _rmat_edges, generate, resolve_shape


def rmat(scale=12, edge_factor=8.0, **kw) -> SyntheticConfig:
    return SyntheticConfig(generator="rmat", rmat=RmatConfig(scale=scale, edge_factor=edge_factor),
                           **{"num_features": 8, **kw})


# --------------------------------------------------------------------------- structure
def test_degrees_are_heavy_tailed_with_hubs_and_isolated_nodes():
    g = generate(rmat())
    deg = np.diff(g.indptr)
    assert g.num_nodes == 2**12
    assert deg.max() > 20 * deg.mean(), (deg.max(), deg.mean())  # hubs
    assert 0.05 < np.mean(deg == 0) < 0.5  # isolated nodes, as real skewed graphs have
    assert g.params["realized"] == {"intra_fraction": pytest.approx(g.params["realized"]["intra_fraction"]),
                                    "max_degree": int(deg.max()), "isolated_nodes": int(np.sum(deg == 0))}
    # a DC-SBM of the same size and mean degree has neither
    dc = np.diff(generate(SyntheticConfig(num_nodes=2**12, avg_degree=float(deg.mean()), num_features=8)).indptr)
    assert deg.max() > 3 * dc.max() and np.sum(dc == 0) < np.sum(deg == 0) / 10


def test_rmat_quadrants_skew_the_ids_as_the_recursion_says():
    """Row bits: P(1) = c + d per level, column bits: b + d; the communities (top bits) take the
    intra share of the edges."""
    a, b, c = 0.6, 0.15, 0.2
    u, v = _rmat_edges(np.random.default_rng(0), 200_000, 10, 2, 0.0, (a, b, c))
    for bit in range(10):
        assert np.mean((u >> bit) & 1) == pytest.approx(c + 0.05, abs=0.01)
        assert np.mean((v >> bit) & 1) == pytest.approx(b + 0.05, abs=0.01)
    u, v = _rmat_edges(np.random.default_rng(0), 200_000, 10, 2, 0.7, (a, b, c))
    by_chance = sum(p * q for p, q in zip(np.bincount(u >> 8, minlength=4) / u.size,
                                          np.bincount(v >> 8, minlength=4) / v.size))
    share = np.mean((u >> 8) == (v >> 8))
    assert share == pytest.approx(0.7 + 0.3 * by_chance, abs=0.02)
    assert np.all(u != v) and u.max() < 2**10 and v.max() < 2**10


def test_labels_follow_the_communities_and_the_graph_is_homophilous():
    g = generate(rmat(intra_fraction=0.9, label_noise=0.0, num_classes=4, num_communities=8))
    dst = np.repeat(np.arange(g.num_nodes), np.diff(g.indptr))
    same = np.mean(g.labels[dst] == g.labels[g.indices])
    assert same > 0.85  # 90 % of the draws stay in a community (classes merge 2 communities each)
    assert np.all(np.bincount(g.labels) == g.num_nodes // 4)  # 8 equal communities onto 4 classes
    assert g.params["realized"]["intra_fraction"] > 0.9


def test_symmetric_sorted_no_self_loops_and_directed():
    g = generate(rmat(scale=9))
    n = g.num_nodes
    dst = np.repeat(np.arange(n), np.diff(g.indptr))
    pairs = set(zip(dst.tolist(), g.indices.tolist()))
    assert all((s, d) in pairs for d, s in pairs) and not any(s == d for d, s in pairs)
    assert len(pairs) == g.num_edges
    d = generate(rmat(scale=9), symmetrize=False)
    assert not d.symmetric and d.num_edges < g.num_edges


# --------------------------------------------------------------------------- determinism
def test_same_seed_same_graph_another_seed_another():
    a, b, c = generate(rmat()), generate(rmat()), generate(rmat(seed=1))
    assert a.content_hash() == b.content_hash() and a.params == b.params
    assert a.content_hash() != c.content_hash() and not np.array_equal(a.indices[:100], c.indices[:100])
    assert a.params["generator"] == "rmat" and a.params["generator_version"] == RMAT_VERSION


def test_streamed_in_small_chunks_gives_the_one_shot_graph(monkeypatch):
    """Ids mapped and the CSR built 37 edges at a time: the same graph, hash included."""
    import gnnpipe.data.synthetic as synthetic

    whole = generate(rmat(scale=8))
    monkeypatch.setattr(synthetic, "CSR_CHUNK", 37)
    chunked = generate(rmat(scale=8))
    assert chunked.content_hash() == whole.content_hash() and chunked.params == whole.params


# --------------------------------------------------------------------------- parameters
def test_resolve_takes_the_label_keys_from_the_shape_and_the_structure_from_rmat():
    p = resolve_shape(rmat(scale=10, num_classes=5))
    assert p["num_nodes"] == 1024 and p["num_classes"] == 5 and p["num_communities"] == 16  # the default shape's
    assert p["rmat"] == {"a": 0.57, "b": 0.19, "c": 0.19, "d": 0.05, "scale": 10, "edge_factor": 8.0}
    assert not {"avg_degree", "locality", "degree_exponent"} & set(p)


@pytest.mark.parametrize("cfg, message", [
    (rmat(num_nodes=5000), "config.datasets.r.synthetic.num_nodes: read by generator dcsbm only"),
    (rmat(locality=0.5), "config.datasets.r.synthetic.locality: read by generator dcsbm only"),
    (SyntheticConfig(generator="rmat", rmat=RmatConfig(a=0.5)),
     "config.datasets.r.synthetic.rmat: a, b, c, d must be >= 0 and sum to 1, got 0.5 + 0.19 + 0.19 + 0.05"),
    (rmat(num_communities=24), "config.datasets.r.synthetic.num_communities: generator rmat needs a power of two"),
    (rmat(scale=4, num_communities=16), "config.datasets.r.synthetic.num_communities: must be <= num_nodes / 2"),
    (SyntheticConfig(rmat=RmatConfig(scale=9)), "config.datasets.r.synthetic.rmat: read by generator rmat only"),
])
def test_misconfigurations_are_refused_in_one_line_naming_the_key(cfg, message):
    with pytest.raises(ConfigError) as e:
        generate(cfg, name="r")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def _workflow(tmp_path, runs, synthetic=None):
    return load_workflow_config({
        "results": str(tmp_path / "results"),
        "datasets": {"r": {"kind": "synthetic", "synthetic": synthetic or {
            "generator": "rmat", "rmat": {"scale": 9, "edge_factor": 6}, "num_features": 16,
            "num_classes": 4, "num_communities": 8, "feature_signal": 1.0, "label_noise": 0.0}}},
        "models": {"m": {"kind": "gcn", "layers": 2, "hidden": 32, "dropout": 0.0}},
        "training": {"epochs": 30, "eval_every": 10, "checkpoint_every": 0, "lr": 0.02},
        "runs": runs})


def test_workflow_config_reads_rmat_and_counts_its_nodes(tmp_path):
    """The schema takes the keys; more parts than 2**scale nodes is refused naming rmat.scale."""
    wf = _workflow(tmp_path, [{"mode": "single", "dataset": "r", "model": "m"}])
    assert wf.datasets["r"].synthetic.rmat.scale == 9
    with pytest.raises(ConfigError, match=r"600 parts .* of the 512-node graph 'r' "
                                          r"\(datasets.r.synthetic.rmat.scale\) leave some empty"):
        _workflow(tmp_path, [{"mode": "pipeline", "dataset": "r", "model": "m", "workers": 2, "chunks": 600}])
    with pytest.raises(ConfigError, match="generator"):
        _workflow(tmp_path, [{"mode": "single", "dataset": "r", "model": "m"}], {"generator": "kronecker"})


def test_the_powerlaw_experiment_resolves_every_layout_with_techniques_on_and_off():
    from pathlib import Path

    wf = load_workflow_config(Path(__file__).resolve().parent.parent / "config/experiments/powerlaw.yaml")
    assert wf.datasets["rmat"].synthetic.generator == "rmat"
    runs = resolve_runs(wf).values()
    assert {r.mode for r in runs} == {"single", "graph", "pipeline", "hybrid"}
    stale = [r for r in runs if not r.pipeline.shuffle_chunks]
    assert sorted(r.mode for r in stale) == ["hybrid", "pipeline"]
    assert all(not r.pipeline.grad_correction and r.pipeline.snapshot_every == 0 for r in stale)
    assert wf.training.eval_every == 1  # time to accuracy reads validation accuracy every epoch


# --------------------------------------------------------------------------- learnable
@pytest.mark.slow  # the run's MLflow store and imports: ~10 s on a quiet machine
def test_a_small_rmat_config_trains_in_process_above_chance(tmp_path, monkeypatch):
    from gnnpipe.data import load_dataset
    from gnnpipe.graph import write_graph
    from gnnpipe.train import run

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    wf = _workflow(tmp_path, [{"mode": "single", "dataset": "r", "model": "m"}])
    cfg = next(iter(resolve_runs(wf).values()))
    graph = load_dataset(wf.datasets["r"], "r")
    write_graph(cfg.graph_path, graph)
    record = run(cfg, progress=False)
    assert record["test_acc"] > 2.5 / graph.num_classes, record["test_acc"]  # chance: 0.25
