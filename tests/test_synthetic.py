"""The synthetic DC-SBM: determinism, structure, the sampler's exact distributions, the
locality knob, the named shapes' METIS mirror targets and learnability of the default."""

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from gnnpipe.config import ConfigError, SyntheticConfig
from gnnpipe.data.synthetic import (GENERATOR_VERSION, SHAPES, _check_capacity, _distinct_edges,
                                    _EdgeSampler, _power_law_weights, generate, resolve_shape)
from gnnpipe.io import GnnPipeError
from gnnpipe.partition import partition_graph, partition_stats

SMALL = dict(num_nodes=2000, avg_degree=12.0, num_features=16)


def small(**kw) -> SyntheticConfig:
    return SyntheticConfig(**{**SMALL, **kw})


def metis_mirrors_over_n(graph, parts=8) -> float:
    return partition_stats(graph, partition_graph(graph, "metis", parts), parts)["mirrors_over_n"]


def adjacency(graph) -> sp.csr_array:
    n = graph.num_nodes
    return sp.csr_array((np.ones(graph.num_edges), graph.indices, graph.indptr), shape=(n, n))


# --------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("shape", list(SHAPES))
def test_resolve_shape_fills_none_from_the_shape(shape):
    p = resolve_shape(SyntheticConfig(shape=shape))
    assert {k: p[k] for k in SHAPES[shape]} == SHAPES[shape]
    assert p["shape"] == shape and p["seed"] == 0 and p["generator_version"] == GENERATOR_VERSION
    assert p["train_fraction"] == 0.6 and p["val_fraction"] == 0.2
    q = resolve_shape(SyntheticConfig(shape=shape, num_nodes=5000, locality=0.25, seed=3))
    assert (q["num_nodes"], q["locality"], q["seed"]) == (5000, 0.25, 3)
    assert q["avg_degree"] == SHAPES[shape]["avg_degree"]  # untouched fields keep the shape's
    assert isinstance(q["num_nodes"], int) and isinstance(q["avg_degree"], float)


def test_named_shapes_have_their_real_graphs_dimensions():
    r, ph = SHAPES["reddit-like"], SHAPES["physics-like"]
    assert (r["num_features"], r["num_classes"]) == (602, 41) and 480 <= r["avg_degree"] <= 500
    assert (ph["num_features"], ph["num_classes"]) == (8415, 5) and 14 <= ph["avg_degree"] <= 16
    d = SHAPES["default"]
    assert d["num_nodes"] <= 20_000 and 15 <= d["avg_degree"] <= 20 and 64 <= d["num_features"] <= 128


@pytest.mark.parametrize("kw, where", [
    (dict(num_nodes=-5), "num_nodes: must be >= 2"),
    (dict(num_nodes=1000.0), "num_nodes: must be an integer"),
    (dict(num_nodes=True), "num_nodes: must be an integer"),
    (dict(avg_degree=0.0), "avg_degree: must be > 0"),
    (dict(avg_degree=float("nan")), "avg_degree: must be a finite number"),
    (dict(num_nodes=20, avg_degree=12.0, num_communities=2, num_classes=2), "avg_degree: must be <="),
    (dict(num_features=0), "num_features: must be >= 1"),
    (dict(num_classes=1), "num_classes: must be >= 2"),
    (dict(num_classes=8, num_communities=4), "num_communities: must be >= num_classes"),
    (dict(num_nodes=30, avg_degree=4.0, num_communities=16), "num_communities: must be <= num_nodes / 2"),
    (dict(intra_fraction=1.2), "intra_fraction: must lie in [0, 1]"),
    (dict(locality=-0.1), "locality: must lie in [0, 1]"),
    (dict(label_noise=2.0), "label_noise: must lie in [0, 1]"),
    (dict(train_fraction=0.7, val_fraction=0.4), "train_fraction + val_fraction must be <= 1"),
    (dict(val_fraction=-0.1), "val_fraction: must lie in [0, 1]"),
    (dict(degree_exponent=2.0), "degree_exponent: must be > 2"),
    (dict(feature_signal=-1.0), "feature_signal: must be >= 0"),
    (dict(num_communities=1, num_classes=1), "num_classes: must be >= 2"),  # so K >= 2 too
    (dict(seed=-1), "seed: must be >= 0"),
    (dict(shape="twitter-like"), "shape: 'twitter-like' is not one of"),
])
def test_bad_parameters_raise_a_config_error_naming_the_key(kw, where):
    with pytest.raises(ConfigError) as e:
        generate(small(**kw), name="synth")
    msg = str(e.value)
    assert msg.startswith("config.datasets.synth.synthetic") and where in msg and "\n" not in msg


def test_bad_self_loop_mode_and_an_impossibly_dense_graph_raise():
    with pytest.raises(ConfigError, match=r"^config.datasets.synthetic.self_loops: must be"):
        generate(small(), self_loops="sometimes")
    # 3 communities of ~20 nodes hold ~570 pairs; 60 * 25 / 2 = 750 intra edges cannot fit
    with pytest.raises(ConfigError, match=r"750 distinct edges inside communities .* lower intra"):
        generate(SyntheticConfig(num_nodes=60, avg_degree=25.0, num_communities=3, num_classes=3,
                                 intra_fraction=1.0, num_features=2))
    # communities of 3 and 7 nodes have 21 pairs between them (42 ordered ones)
    sizes = np.array([3, 7])
    _check_capacity({"local": 0, "intra": 0, "inter": 21}, sizes, 10, True, "x")
    _check_capacity({"local": 0, "intra": 0, "inter": 42}, sizes, 10, False, "x")
    with pytest.raises(ConfigError, match=r"^x: 22 distinct edges between .* raise intra_fraction"):
        _check_capacity({"local": 0, "intra": 0, "inter": 22}, sizes, 10, True, "x")
    with pytest.raises(ConfigError, match=r"^x: 25 distinct edges inside .* lower intra_fraction"):
        _check_capacity({"local": 20, "intra": 5, "inter": 0}, sizes, 10, True, "x")  # 3 + 21 pairs


def test_a_graph_larger_than_the_memory_is_refused_before_it_is_allocated(monkeypatch, capsys):
    """Issue #37, item 4: the data stage's priced peak against the available memory, one line, before
    any array (2^31 - 1 nodes would take terabytes)."""
    from gnnpipe.data import synthetic

    cfg = SyntheticConfig(num_nodes=2**31 - 1, avg_degree=16.0, num_features=128)
    with pytest.raises(GnnPipeError) as e:
        generate(cfg, name="big")
    msg = str(e.value)
    assert msg.startswith("config.datasets.big.synthetic: 2,147,483,647 nodes, 34,359,738,352 stored edges and 128 "
                          "features need about ") and "GiB are available; lower num_nodes" in msg and "\n" not in msg
    monkeypatch.setattr(synthetic, "available_memory", lambda: 2**30)  # 1 GiB: not even 10^6 nodes
    with pytest.raises(GnnPipeError, match=r"need about 1.4 GiB to generate, 1.0 GiB are available"):
        generate(small(num_nodes=10**6, num_features=128), name="synth")


def test_a_sampler_that_stops_finding_new_edges_is_an_error_not_a_hang():
    def three_nodes(rng, kind, m):  # only 3 distinct undirected edges exist
        return rng.integers(0, 3, m), rng.integers(0, 3, m)

    with pytest.raises(GnnPipeError, match="could place only 3 of 10 distinct local edges"):
        _distinct_edges(np.random.default_rng(0), three_nodes, 3, {"local": 10}, undirected=True)


# --------------------------------------------------------------------------- determinism
def test_same_parameters_and_seed_give_identical_graphs():
    a, b = generate(small()), generate(small())
    for name, arr in a.arrays().items():
        np.testing.assert_array_equal(arr, b.arrays()[name], err_msg=name)
    assert a.content_hash() == b.content_hash() and a.params == b.params


@pytest.mark.parametrize("symmetrize", [True, False])
def test_streamed_in_small_chunks_gives_the_one_shot_graph(monkeypatch, symmetrize):
    """Ids mapped and the CSR built 7 edges at a time: the same graph, hash included."""
    import gnnpipe.data.synthetic as synthetic

    cfg = SyntheticConfig(num_nodes=300, avg_degree=6.0, num_features=4)
    whole = generate(cfg, symmetrize=symmetrize)
    monkeypatch.setattr(synthetic, "CSR_CHUNK", 7)
    chunked = generate(cfg, symmetrize=symmetrize)
    assert chunked.content_hash() == whole.content_hash() and chunked.params == whole.params


def test_another_seed_gives_another_graph():
    a, c = generate(small()), generate(small(seed=1))
    assert a.num_edges == c.num_edges  # the edge count is a parameter, not a draw
    assert not np.array_equal(a.indices, c.indices)
    assert not np.array_equal(a.features, c.features)
    assert not np.array_equal(a.train_mask, c.train_mask)
    assert a.content_hash() != c.content_hash()


def test_structure_does_not_depend_on_the_feature_parameters():
    a = generate(small())
    b = generate(small(num_features=3, feature_signal=0.2, label_noise=0.4, train_fraction=0.3))
    np.testing.assert_array_equal(a.indptr, b.indptr)
    np.testing.assert_array_equal(a.indices, b.indices)


# --------------------------------------------------------------------------- structure
def test_arrays_shapes_dtypes_and_ranges():
    cfg = small(train_fraction=0.5, val_fraction=0.3)
    g = generate(cfg, name="toy")
    g.validate()
    n = 2000
    assert g.num_nodes == n and g.num_edges == n * 12  # avg_degree counts stored CSR entries
    assert g.indptr.dtype == g.labels.dtype == np.int64 and g.indices.dtype == np.int32  # ids fit int32
    assert g.features.dtype == np.float32 and g.features.shape == (n, 16)
    assert np.isfinite(g.features).all()
    assert g.num_classes == SHAPES["default"]["num_classes"]
    assert set(np.unique(g.labels)) == set(range(g.num_classes))
    masks = np.stack([g.train_mask, g.val_mask, g.test_mask])
    assert masks.dtype == bool and np.all(masks.sum(axis=0) == 1)  # disjoint, cover every node
    assert masks.sum(axis=1).tolist() == [1000, 600, 400]
    assert (g.name, g.source, g.symmetric, g.self_loops) == ("toy", "synthetic", True, False)
    assert {k: v for k, v in g.params.items() if k != "realized"} == resolve_shape(cfg)
    assert g.params["realized"]["intra_fraction"] == pytest.approx(SHAPES["default"]["intra_fraction"], abs=1e-3)


def test_csr_is_symmetric_sorted_without_duplicates_or_self_loops():
    g = generate(small())
    a = adjacency(g)
    assert (a != a.T).nnz == 0
    assert np.all(a.diagonal() == 0)
    rows = np.repeat(np.arange(g.num_nodes), np.diff(g.indptr))
    same_row = rows[1:] == rows[:-1]
    assert np.all(g.indices[1:][same_row] > g.indices[:-1][same_row])  # strictly ascending


def test_self_loops_added_and_directed_graphs():
    n, d = 2000, 12
    g = generate(small(), self_loops="add")
    assert g.num_edges == n * d + n and g.self_loops
    assert np.all(adjacency(g).diagonal() == 1)
    u = generate(small(), symmetrize=False)
    assert u.num_edges == n * d and not u.symmetric  # N * avg_degree distinct directed edges
    a = adjacency(u)
    assert np.all(a.diagonal() == 0) and a.max() == 1
    assert (a.multiply(a.T)).nnz < 0.5 * u.num_edges  # most edges lack their reverse


@pytest.mark.parametrize("intra", [0.3, 0.9])
def test_intra_fraction_is_the_share_of_edges_inside_a_community(intra):
    # with one community per class and no label noise, the label is the community
    g = generate(small(num_classes=6, num_communities=6, label_noise=0.0, intra_fraction=intra))
    dst = np.repeat(np.arange(g.num_nodes), np.diff(g.indptr))
    share = np.mean(g.labels[dst] == g.labels[g.indices])
    assert share == pytest.approx(intra, abs=2 / g.num_edges)


def test_label_noise_relabels_exactly_that_share_to_another_class():
    clean = generate(small(label_noise=0.0))
    noisy = generate(small(label_noise=0.2))
    np.testing.assert_array_equal(clean.features, noisy.features)
    changed = clean.labels != noisy.labels
    assert changed.sum() == 400  # 0.2 * 2000, every one to a different class


def test_features_are_class_means_plus_unit_noise():
    g = generate(small(num_nodes=8000, num_features=32, feature_signal=2.0, label_noise=0.0))
    x, y = g.features.astype(np.float64), g.labels
    means = np.stack([x[y == c].mean(axis=0) for c in range(g.num_classes)])
    np.testing.assert_allclose(np.linalg.norm(means, axis=1), 2.0, rtol=0.1)
    resid = x - means[y]
    assert resid.std() == pytest.approx(1.0, rel=0.02)
    blank = generate(small(num_features=32, feature_signal=0.0, label_noise=0.0))
    m0 = np.stack([blank.features[blank.labels == c].mean(axis=0) for c in range(8)])
    assert np.linalg.norm(m0, axis=1).max() < 0.6  # only sampling noise: ~ sqrt(32 / 250)


def test_degrees_are_heavy_tailed_with_the_configured_exponent():
    def tail(gamma):
        g = generate(SyntheticConfig(num_nodes=20_000, avg_degree=10.0, num_features=2,
                                     degree_exponent=gamma))
        d = np.sort(np.diff(g.indptr))[::-1].astype(np.float64)
        k = 500  # Hill estimator of the tail exponent over the top k degrees
        return d, 1 + k / np.log(d[:k] / d[k]).sum()

    d, hill = tail(2.5)
    assert d.mean() == 10.0
    assert d[0] > 20 * d.mean()  # Poisson(10) would top out near 25
    assert np.mean(d > 5 * d.mean()) > 0.01  # Poisson(10): P(deg > 50) ~ 1e-17
    assert 2.2 < hill < 3.0
    _, hill_light = tail(3.2)
    assert hill_light > hill + 0.3


def test_node_ids_are_a_random_permutation():
    # contiguous id ranges cut as badly as a random assignment; METIS finds the structure
    g = generate(small(num_nodes=4000))
    mirrors = {m: partition_stats(g, partition_graph(g, m, 8), 8)["mirrors_total"]
               for m in ("contiguous", "random", "metis")}
    assert mirrors["contiguous"] > 0.9 * mirrors["random"]
    assert mirrors["metis"] < 0.8 * mirrors["random"]


def test_progress_reports_to_stderr(capsys):
    generate(small(num_nodes=200), progress=True, name="toy")
    err = capsys.readouterr().err
    assert "[toy]" in err and "distinct undirected edges" in err and "done" in err


# --------------------------------------------------------------------------- the sampler
def _exact_sampler(seed=1):
    """Two communities (10 and 20 nodes) on a ring each, heavy-tailed weights."""
    rng = np.random.default_rng(seed)
    theta = _power_law_weights(rng, 30, 2.5, 5.0)
    start = np.array([0, 10, 30])
    community = np.repeat([0, 1], [10, 20])
    return _EdgeSampler(theta, start, community, window=1.5), theta, start, community


@pytest.mark.parametrize("u0", [0, 9, 10, 17, 29])
def test_sampler_draws_theta_proportionally_where_each_edge_kind_allows(u0):
    s, theta, start, community = _exact_sampler()
    rng = np.random.default_rng(7)
    c = community[u0]
    lo, size = start[c], start[c + 1] - start[c]
    w = min(int(np.ceil(1.5 * theta[u0])), (size - 1) // 2)
    allowed = {
        "local": [lo + (u0 - lo + k) % size for k in range(-w, w + 1)],  # the ring window
        "intra": list(range(lo, lo + size)),
        "inter": [i for i in range(30) if community[i] != c],
    }
    for kind, nodes in allowed.items():
        exact = np.zeros(30)
        exact[nodes] = theta[nodes]
        exact /= exact.sum()
        m = 200_000
        emp = np.bincount(s.second(kind, np.full(m, u0), rng.random(m)), minlength=30) / m
        assert 0.5 * np.abs(emp - exact).sum() < 0.01, kind  # total variation distance


def test_sampler_first_endpoint_is_theta_proportional_and_kinds_stay_in_bounds():
    s, theta, start, community = _exact_sampler()
    rng = np.random.default_rng(3)
    for kind in ("local", "intra", "inter"):
        u, v = s(rng, kind, 200_000)
        emp = np.bincount(u, minlength=30) / u.shape[0]
        assert 0.5 * np.abs(emp - theta / theta.sum()).sum() < 0.01
        same = community[u] == community[v]
        assert same.all() if kind != "inter" else not same.any()


def test_guide_table_inversion_matches_binary_search():
    rng = np.random.default_rng(0)
    theta = _power_law_weights(rng, 5000, 2.2, 50.0)
    s = _EdgeSampler(theta, np.array([0, 5000]), np.zeros(5000, dtype=np.int64), window=4.0)
    t = np.concatenate([rng.random(100_000) * s.total, s.cum[:-1], [0.0, s.total]])
    expect = np.clip(np.searchsorted(s.cum, t, side="right") - 1, 0, 4999)
    np.testing.assert_array_equal(s._invert(t), expect)


# --------------------------------------------------------------------------- partitions
def test_locality_lowers_the_metis_mirror_count():
    # two communities and eight parts: METIS must cut through communities, and the ring
    # lets it cut along the ring instead of through a random graph
    def mirrors(locality):
        return metis_mirrors_over_n(generate(SyntheticConfig(
            num_nodes=4000, avg_degree=16.0, num_features=2, num_classes=2, num_communities=2,
            intra_fraction=0.95, locality=locality)))

    none, most, all_ = mirrors(0.0), mirrors(0.9), mirrors(1.0)
    assert most < 0.8 * none and all_ < 0.5 * none and all_ < most


@pytest.mark.slow
@pytest.mark.parametrize("shape, num_nodes, target, tol", [
    ("physics-like", 34_493, 0.3, 0.1),  # Coauthor-Physics: 0.3 N at 8 parts
    ("reddit-like", 40_000, 2.2, 0.3),  # Reddit: 2.1 N; reddit-like: 2.08 N at full size
])
def test_named_shapes_hit_their_metis_mirror_targets(shape, num_nodes, target, tol):
    g = generate(SyntheticConfig(shape=shape, num_nodes=num_nodes, num_features=4))
    assert metis_mirrors_over_n(g) == pytest.approx(target, abs=tol)


# --------------------------------------------------------------------------- learnability
def _normalised_adjacency(g) -> torch.Tensor:
    """D^-1/2 (A + I) D^-1/2 as a sparse CSR tensor."""
    n = g.num_nodes
    dst = torch.repeat_interleave(torch.arange(n), torch.as_tensor(np.diff(g.indptr)))
    loops = torch.arange(n)
    row, col = torch.cat([dst, loops]), torch.cat([torch.as_tensor(g.indices), loops])
    deg = torch.bincount(row, minlength=n).float()
    val = deg[row].rsqrt() * deg[col].rsqrt()
    return torch.sparse_coo_tensor(torch.stack([row, col]), val, (n, n)).coalesce().to_sparse_csr()


class _SymmetricSpMM(torch.autograd.Function):
    """``a @ h`` for a symmetric sparse ``a``: the backward is ``a @ grad`` (no transpose)."""

    @staticmethod
    def forward(ctx, a, h):
        ctx.a = a
        return a @ h

    @staticmethod
    def backward(ctx, grad):
        return None, ctx.a @ grad


def _test_accuracy(g, model: str, epochs=150, hidden=64) -> float:
    """Test accuracy of a 2-layer ``"gcn"``, the same 2-layer ``"mlp"`` without the graph,
    or ``"logreg"`` (one linear layer) trained full batch with Adam and weight decay (no
    dropout: on CPU it costs more than the rest of an epoch here)."""
    torch.manual_seed(0)
    x, y = torch.as_tensor(g.features), torch.as_tensor(g.labels)
    train, test = torch.as_tensor(g.train_mask), torch.as_tensor(g.test_mask)
    a = _normalised_adjacency(g) if model == "gcn" else None
    if model == "logreg":
        layers = [torch.nn.Linear(g.num_features, g.num_classes)]
    else:
        layers = [torch.nn.Linear(g.num_features, hidden), torch.nn.Linear(hidden, g.num_classes)]
    opt = torch.optim.Adam([p for lin in layers for p in lin.parameters()], lr=0.01, weight_decay=5e-4)

    def forward():
        h = x
        for i, lin in enumerate(layers):
            h = lin(h)
            if a is not None:
                h = _SymmetricSpMM.apply(a, h)  # A (H W): the GCN layer
            if i < len(layers) - 1:
                h = torch.relu(h)
        return h

    for _ in range(epochs):
        opt.zero_grad()
        F.cross_entropy(forward()[train], y[train]).backward()
        opt.step()
    with torch.no_grad():
        return float((forward().argmax(1)[test] == y[test]).float().mean())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_default_shape_is_learnable_but_not_trivial():
    g = generate(SyntheticConfig())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small kernels: a second thread only adds contention here
    try:
        with torch.sparse.check_sparse_tensor_invariants(False):
            acc = {m: _test_accuracy(g, m) for m in ("logreg", "mlp", "gcn")}
    finally:
        torch.set_num_threads(threads)
    features_only = max(acc["logreg"], acc["mlp"])
    assert acc["gcn"] > features_only + 0.10, acc  # the graph carries what features do not
    assert features_only > 3 / g.num_classes, acc  # the features are informative on their own
    assert 0.65 < acc["gcn"] < 0.9, acc  # and the task is not solved: label noise, mixing
