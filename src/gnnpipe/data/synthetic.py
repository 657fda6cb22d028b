"""Synthetic node-classification graphs: a degree-corrected SBM with locality, or R-MAT.

``generator: dcsbm`` (the default) is the model below; ``generator: rmat`` is the R-MAT
power law at the end of this docstring. Both share the labels, features and split.

The DC-SBM, for ``N`` nodes in ``K`` communities (``C <= K`` classes):

* **Communities.** Nodes are laid out in a hidden order in which each community is a
  contiguous block; block sizes vary (Dirichlet proportions). The hidden order is
  also a *ring* inside each community: the 1-D embedding the locality knob uses.
* **Degrees.** Every node draws a weight ``theta`` from a power law
  ``P(theta > x) ~ x^-(gamma-1)`` (``degree_exponent = gamma``), capped at the
  structural cut-off ``sqrt(N / avg_degree)`` and normalised to mean 1. Every edge
  endpoint is chosen with probability proportional to ``theta`` (Chung-Lu) within
  the set its edge type allows, so that the expected degree of node ``i`` is about
  ``avg_degree * theta_i`` whatever the mixture below (hubs fall somewhat short where
  their possible neighbours run out: repeated draws are rejected).
* **Edges.** One endpoint ``u`` is drawn over all nodes; the other, ``v``:
  - a share ``1 - intra_fraction`` of the edges outside ``u``'s community (inter);
  - a share ``intra_fraction * locality`` inside ``u``'s community, within
    ``ceil(LOCAL_WINDOW * avg_degree * theta_u)`` ring positions of ``u`` (local: a
    hub's neighbourhood is wider, so that locality does not cap its degree);
  - the rest anywhere in ``u``'s community (intra).
  Local edges are what real graphs have and a plain SBM lacks: they let METIS cut a
  community along its ring instead of through all its edges. Each kind's share is
  exact: self loops and repeats are rejected and re-drawn until every kind has its
  quota of distinct edges. Quotas the communities cannot hold as distinct pairs are
  refused up front (reddit-like's 41 communities are ~90 % full at 2*10^4 nodes and
  too small below ~1.8*10^4), as is a kind whose draws stop finding new edges.
* **Labels and features.** Community ``k`` has class ``k mod C``; a share
  ``label_noise`` of the nodes is relabelled to a uniformly chosen *other* class.
  Features are ``mu[class of the community] + N(0, I_F)``, where the class means
  ``mu`` are random directions of norm ``feature_signal`` (in units of the noise
  standard deviation), so separability does not depend on ``F``.
* **Ids and split.** Node ids are a random permutation of the hidden order (so that
  a contiguous partition is not accidentally good); train/val/test is a uniform
  random split with the configured fractions (test takes the rest).

``avg_degree`` counts *stored* CSR entries per node: a symmetrised graph has
``num_edges = N * avg_degree`` (rounded to even) directed entries, i.e. half as many
undirected edges; an unsymmetrised one ``N * avg_degree`` distinct directed edges.

Everything is a function of the resolved parameters and ``seed``: the structure, the
features, the labels and the split use independent child streams of one
``numpy.random.SeedSequence(seed)``, so e.g. changing ``num_features`` leaves the
edges unchanged. Vectorised numpy throughout (no loop over nodes or edges): 10^6
nodes with 2*10^7 stored edges (default shape, F = 128) take ~9 s of CPU (22 s wall on
a shared 2-core machine); full-size reddit-like (1.15*10^8 edges) ~1 minute of CPU and
5.8 GB peak RSS with METIS included (``benchmarks/bench_synthetic.py``).

**R-MAT** (``generator: rmat``; Chakrabarti, Zhan & Faloutsos 2004, Graph500's initiator by
default): ``N = 2**scale`` nodes and ``edge_factor * N`` drawn edges. Each draw descends
``scale`` levels of the adjacency matrix, picking the top-left / top-right / bottom-left /
bottom-right quadrant with probabilities ``a, b, c, d``: with ``a > d`` the ids with many zero
bits collect the edges, so a few hubs have thousands of neighbours and ~20-40 % of the nodes
none (they keep their features, label and split: isolated nodes, as skewed real graphs have).
The ``K = num_communities`` (a power of two) communities are the top ``log2 K`` bits of an id,
``N / K`` nodes each; a share ``intra_fraction`` of the draws has its second endpoint's top bits
replaced by the first's, so the edge stays in one community while both endpoints keep the
degree R-MAT gave them (communities are equal in nodes, skewed in edges). Self loops are
dropped and repeats merged (``num_edges`` is what is left: R-MAT repeats hub pairs often),
then ids are a random permutation of the R-MAT ids. Labels, features and the split are the
DC-SBM's (community ``k`` has class ``k mod C``, ``label_noise``, class means of norm
``feature_signal``). **Learnable, not trivial**: with ``feature_signal`` ~1 the features alone
barely tell 24 classes apart (an MLP: test accuracy 0.09, chance 0.04), while a node's
neighbours mostly share its community, so averaging their features recovers the class (a
2-layer GCN: 0.57, scale 12, 60 epochs); isolated nodes (features only) and ``label_noise`` cap
every model below 1. ``resolve_shape`` takes the label and feature keys from the named shape
and refuses the DC-SBM's structural keys (``num_nodes``, ``avg_degree``, ``locality``,
``degree_exponent``). Vectorised level by level over all draws (one float64 and a few bool
temporaries of the draws: O(E)): at scale 17 with 100 features, 10^6 draws (1.6*10^6 stored
edges) take 1.4 s of CPU (2.7 s wall on the shared 2-core machine), 2.6*10^6 draws 2.8 s of CPU
and 0.35 GiB peak RSS, CSR and features included.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import numpy as np

from ..config import ConfigError, RmatConfig, SyntheticConfig
from ..costmodel.stages import available_memory, graph_stage_memory
from ..graph import CSR_CHUNK, Graph, csr_from_edges
from ..io import GnnPipeError

#: Bump when the same parameters and seed would give a different graph (any change to
#: the sampling below, including the constants).
GENERATOR_VERSION = 1
#: The same for the R-MAT generator (``generator: rmat``).
RMAT_VERSION = 1

#: Half-width of a node's local window on its community ring, in units of its expected
#: degree (avg_degree * theta).
LOCAL_WINDOW = 2.0

#: Fewest and most candidate edges drawn in one round (the most bounds the sampler's
#: temporaries to ~1 GiB).
MIN_DRAW, MAX_DRAW = 1 << 16, 1 << 23

#: Dirichlet concentration of the community sizes (larger: more equal sizes).
COMMUNITY_SIZE_CONCENTRATION = 8.0

#: The parameters of each named shape; ``SyntheticConfig`` fields left ``None`` take
#: these. ``num_nodes`` is free: every shape is meant to be scaled.
SHAPES: dict[str, dict[str, Any]] = {
    # The embedded default: small enough for a 32-layer model on 2 CPU cores, and
    # learnable but not trivially (test accuracy, 150 full-batch epochs, seeds 0-1:
    # 2-layer GCN 0.74-0.75, logistic regression on the features 0.50-0.52). Label
    # noise caps every model at 0.75, which a 2-layer GCN reaches: the graph recovers
    # the community, the features alone do not. METIS mirrors at 8 parts: 2.17 N at
    # 10^4 nodes, 1.99 N at 10^5.
    "default": dict(
        num_nodes=10_000, avg_degree=16.0, num_features=128, num_classes=8,
        num_communities=16, intra_fraction=0.8, locality=0.9, degree_exponent=2.5,
        feature_signal=2.0, label_noise=0.25,
    ),
    # Reddit (232,965 nodes, 492 stored edges per node, 602 features, 41 classes).
    # METIS mirrors at 8 parts: 2.08 N at full size, 2.24 N at 10^5 nodes, 2.19-2.31 N
    # at 4*10^4 (seeds 0-2; Reddit: ~2.1 N). Logistic regression on the features ~0.54
    # (Reddit's raw features: 0.585).
    "reddit-like": dict(
        num_nodes=232_965, avg_degree=492.0, num_features=602, num_classes=41,
        num_communities=41, intra_fraction=0.992, locality=0.9, degree_exponent=2.3,
        feature_signal=2.8, label_noise=0.05,
    ),
    # Coauthor-Physics (34,493 nodes, 14.4 stored edges per node, 8,415 features,
    # 5 classes). METIS mirrors at 8 parts: 0.31 N at full size, 0.29 N at 2*10^4,
    # 0.28 N at 10^5 (Coauthor-Physics: ~0.3 N); at 32 parts, more parts than
    # communities, locality matters: 0.68 N (1.03 N with locality 0). Logistic
    # regression ~0.88, GCN ~0.95 (measured with F = 256; the real graph: 0.87, 0.93).
    "physics-like": dict(
        num_nodes=34_493, avg_degree=14.4, num_features=8415, num_classes=5,
        num_communities=30, intra_fraction=0.98, locality=0.9, degree_exponent=2.8,
        feature_signal=3.0, label_noise=0.05,
    ),
}

_SHAPE_KEYS = tuple(SHAPES["default"])
#: The DC-SBM's structural keys, which the R-MAT generator does not read.
_DCSBM_ONLY = ("num_nodes", "avg_degree", "locality", "degree_exponent")


def resolve_shape(cfg: SyntheticConfig, path: str = "synthetic") -> dict[str, Any]:
    """The effective parameters of ``cfg``: its shape's values, overridden by every
    field that is not ``None``; validated (``ConfigError`` naming ``path.<key>``)."""
    if cfg.shape not in SHAPES:
        raise ConfigError(f"{path}.shape: {cfg.shape!r} is not one of {', '.join(map(repr, SHAPES))}")
    if cfg.generator == "rmat":
        return _resolve_rmat(cfg, path)
    if cfg.generator != "dcsbm":
        raise ConfigError(f"{path}.generator: {cfg.generator!r} is not 'dcsbm' or 'rmat'")
    if cfg.rmat != RmatConfig():
        raise ConfigError(f"{path}.rmat: read by generator rmat only (generator is dcsbm); remove it or set "
                          "generator: rmat")
    p: dict[str, Any] = {"shape": cfg.shape}
    for key in _SHAPE_KEYS:
        value = getattr(cfg, key)
        p[key] = SHAPES[cfg.shape][key] if value is None else value
    p.update(train_fraction=cfg.train_fraction, val_fraction=cfg.val_fraction, seed=cfg.seed)
    _check(p, path)
    for key in ("num_nodes", "num_features", "num_classes", "num_communities", "seed"):
        p[key] = int(p[key])
    for key in ("avg_degree", "intra_fraction", "locality", "degree_exponent", "feature_signal",
                "label_noise", "train_fraction", "val_fraction"):
        p[key] = float(p[key])
    p["generator_version"] = GENERATOR_VERSION
    return p


def _resolve_rmat(cfg: SyntheticConfig, path: str) -> dict[str, Any]:
    """``resolve_shape`` for ``generator: rmat``: the shape gives the label and feature keys, ``rmat``
    the structure; the DC-SBM's structural keys are refused rather than silently ignored."""
    for key in _DCSBM_ONLY:
        if getattr(cfg, key) is not None:
            raise ConfigError(f"{path}.{key}: read by generator dcsbm only (generator is rmat: its nodes are "
                              "2**rmat.scale, its degrees set by rmat's a, b, c, d and edge_factor); remove it")
    r = cfg.rmat
    p: dict[str, Any] = {"shape": cfg.shape, "generator": "rmat", "num_nodes": 2 ** int(r.scale)}
    for key in _SHAPE_KEYS:
        if key not in _DCSBM_ONLY and key != "num_nodes":
            value = getattr(cfg, key)
            p[key] = SHAPES[cfg.shape][key] if value is None else value
    p.update(train_fraction=cfg.train_fraction, val_fraction=cfg.val_fraction, seed=cfg.seed)
    _check(p, path)
    quadrants = [float(getattr(r, q)) for q in "abcd"]
    if min(quadrants) < 0 or abs(sum(quadrants) - 1.0) > 1e-6:
        raise ConfigError(f"{path}.rmat: a, b, c, d must be >= 0 and sum to 1, got "
                          f"{' + '.join(f'{q:g}' for q in quadrants)} = {sum(quadrants):g}")
    if not 2 <= r.scale <= 30:
        raise ConfigError(f"{path}.rmat.scale: must lie in [2, 30], got {r.scale!r}")
    if not (math.isfinite(r.edge_factor) and r.edge_factor > 0):
        raise ConfigError(f"{path}.rmat.edge_factor: must be > 0, got {r.edge_factor!r}")
    k = int(p["num_communities"])
    if k & (k - 1):
        raise ConfigError(f"{path}.num_communities: generator rmat needs a power of two (the communities are "
                          f"the top bits of the R-MAT ids), got {k}")
    for key in ("num_features", "num_classes", "num_communities", "seed"):
        p[key] = int(p[key])
    for key in ("intra_fraction", "feature_signal", "label_noise", "train_fraction", "val_fraction"):
        p[key] = float(p[key])
    p["rmat"] = dict(zip("abcd", quadrants), scale=int(r.scale), edge_factor=float(r.edge_factor))
    p["generator_version"] = RMAT_VERSION
    return p


def _check(p: dict[str, Any], path: str) -> None:
    def fail(key: str, what: str):
        raise ConfigError(f"{path}.{key}: {what}, got {p[key]!r}")

    def integer(key: str, lo: int):
        v = p[key]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            fail(key, "must be an integer")
        if v < lo:
            fail(key, f"must be >= {lo}")

    def number(key: str):
        v = p[key]
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
                or not math.isfinite(v):
            fail(key, "must be a finite number")
        return float(v)

    def fraction(key: str):
        if not 0.0 <= number(key) <= 1.0:
            fail(key, "must lie in [0, 1]")

    dcsbm = "avg_degree" in p  # the R-MAT generator's parameters lack the DC-SBM's structural keys
    integer("num_nodes", 2)
    integer("num_features", 1)
    integer("num_classes", 2)
    integer("num_communities", 1)
    integer("seed", 0)
    n = p["num_nodes"]
    if dcsbm and number("avg_degree") <= 0:
        fail("avg_degree", "must be > 0")
    if dcsbm and p["avg_degree"] > (n - 1) / 2:
        fail("avg_degree", f"must be <= (num_nodes - 1) / 2 = {(n - 1) / 2:g} for {n} nodes "
                           "(raise num_nodes or lower avg_degree)")
    if p["num_communities"] < p["num_classes"]:
        fail("num_communities", f"must be >= num_classes ({p['num_classes']}): every class "
                                "needs a community")
    if 2 * p["num_communities"] > n:
        fail("num_communities", f"must be <= num_nodes / 2 = {n // 2} (a community needs two nodes)")
    for key in ("intra_fraction", "label_noise", "train_fraction", "val_fraction") + (("locality",) if dcsbm else ()):
        fraction(key)
    if dcsbm and number("degree_exponent") <= 2:
        fail("degree_exponent", "must be > 2 (the mean degree is infinite otherwise)")
    if number("feature_signal") < 0:
        fail("feature_signal", "must be >= 0")
    if p["train_fraction"] + p["val_fraction"] > 1:
        raise ConfigError(f"{path}: train_fraction + val_fraction must be <= 1 (the test set takes "
                          f"the rest), got {p['train_fraction']} + {p['val_fraction']}")


class _Progress:
    def __init__(self, enabled: bool, name: str):
        self.enabled, self.name, self.t0 = enabled, name, time.perf_counter()

    def __call__(self, msg: str) -> None:
        if self.enabled:
            print(f"[{self.name}] {time.perf_counter() - self.t0:7.2f}s {msg}", file=sys.stderr, flush=True)


def generate(cfg: SyntheticConfig, *, symmetrize: bool = True, self_loops: str = "remove",
             name: str = "synthetic", progress: bool = False) -> Graph:
    """Generate the synthetic graph of ``cfg`` (see the module docstring for the model).

    ``symmetrize``: store every edge in both directions (``num_edges`` = N * avg_degree
    stored CSR entries either way). ``self_loops``: the sampler never draws one, so
    ``"remove"`` and ``"keep"`` are the same; ``"add"`` adds one per node.
    ``Graph.params`` holds ``resolve_shape(cfg)`` plus a few realised statistics
    (``realized``: intra-community share of the edges, max degree, isolated nodes).
    Bad parameters raise ``ConfigError`` naming ``config.datasets.<name>.synthetic.<key>``.
    """
    path = f"config.datasets.{name}.synthetic"
    p = resolve_shape(cfg, path=path)
    if self_loops not in ("remove", "add", "keep"):
        raise ConfigError(f"config.datasets.{name}.self_loops: must be 'remove', 'add' or 'keep', "
                          f"got {self_loops!r}")
    log = _Progress(progress, name)
    rng_struct, rng_feat, rng_label, rng_split, rng_perm = (
        np.random.default_rng(s) for s in np.random.SeedSequence(p["seed"]).spawn(5))
    structure = _rmat_structure if p.get("generator") == "rmat" else _dcsbm_structure
    indptr, indices, comm_of, intra_share = structure(p, rng_struct, rng_perm, symmetrize=symmetrize,
                                                      self_loops=self_loops, path=path, log=log)
    log(f"built CSR with {indices.shape[0]:,} stored edges")

    # ---- labels and features (rows in node-id order)
    n, c = p["num_nodes"], p["num_classes"]
    true_class = comm_of % c
    labels = true_class.copy()
    noisy = rng_label.permutation(n)[:int(round(p["label_noise"] * n))]
    labels[noisy] = (labels[noisy] + rng_label.integers(1, c, size=noisy.shape[0])) % c
    features = _features(rng_feat, true_class, c, p["num_features"], p["feature_signal"])
    log(f"features ({n:,} x {p['num_features']:,})")

    order = rng_split.permutation(n)
    n_train = int(round(p["train_fraction"] * n))
    n_val = min(int(round(p["val_fraction"] * n)), n - n_train)
    masks = [np.zeros(n, dtype=bool) for _ in range(3)]
    masks[0][order[:n_train]] = True
    masks[1][order[n_train:n_train + n_val]] = True
    masks[2][order[n_train + n_val:]] = True

    deg = np.diff(indptr)
    params = dict(p, realized=dict(intra_fraction=intra_share, max_degree=int(deg.max()),
                                   isolated_nodes=int(np.count_nonzero(deg == 0))))
    graph = Graph(indptr=indptr, indices=indices, features=features, labels=labels,
                  train_mask=masks[0], val_mask=masks[1], test_mask=masks[2], num_classes=c,
                  name=name, source="synthetic", symmetric=symmetrize,
                  self_loops=self_loops == "add", params=params)
    log("done")
    return graph


def _dcsbm_structure(p: dict, rng_struct, rng_perm, *, symmetrize: bool, self_loops: str, path: str, log):
    """The DC-SBM's CSR ``(indptr, indices)``, each node's community (by node id) and the realised
    share of intra-community edges."""
    n, k = p["num_nodes"], p["num_communities"]
    _check_memory(n, int(round(n * p["avg_degree"])), p["num_features"], path)
    # ---- structure, in hidden order (communities contiguous, rings inside them)
    sizes = _community_sizes(rng_struct, n, k)  # (K,)
    start = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(sizes, out=start[1:])
    community = np.repeat(np.arange(k, dtype=np.int64), sizes)  # (N,) hidden order
    theta = _power_law_weights(rng_struct, n, p["degree_exponent"], math.sqrt(n / p["avg_degree"]))
    target = int(round(n * p["avg_degree"]))
    if symmetrize:
        target -= target % 2
    num_pairs = target // 2 if symmetrize else target
    sampler = _EdgeSampler(theta, start, community, window=LOCAL_WINDOW * p["avg_degree"])
    n_local = int(round(num_pairs * p["intra_fraction"] * p["locality"]))
    n_intra = int(round(num_pairs * p["intra_fraction"])) - n_local
    quotas = {"local": n_local, "intra": n_intra, "inter": num_pairs - n_local - n_intra}
    _check_capacity(quotas, sizes, n, symmetrize, path)
    a, b = _distinct_edges(rng_struct, sampler, n, quotas, undirected=symmetrize, path=path, log=log)
    log(f"sampled {num_pairs:,} distinct {'undirected' if symmetrize else 'directed'} edges")
    # ---- random ids: node id of hidden position h is perm[h]; mapped in place, chunk by
    # chunk, with the intra-community count: no edge-sized temporary beside a and b
    perm = rng_perm.permutation(n).astype(np.int64)
    intra = 0
    for i in range(0, num_pairs, CSR_CHUNK):
        ca, cb = a[i:i + CSR_CHUNK], b[i:i + CSR_CHUNK]
        intra += int(np.count_nonzero(community[ca] == community[cb]))
        ca[:], cb[:] = perm[ca], perm[cb]
    indptr, indices = csr_from_edges(a, b, n, symmetrize=symmetrize, self_loops=self_loops, chunk=CSR_CHUNK)
    del a, b
    comm_of = np.empty(n, dtype=np.int64)
    comm_of[perm] = community
    return indptr, indices, comm_of, intra / num_pairs if num_pairs else 0.0


def _rmat_structure(p: dict, rng_struct, rng_perm, *, symmetrize: bool, self_loops: str, path: str, log):
    """R-MAT over planted communities (the module docstring): ``_dcsbm_structure``'s four results."""
    r, n, k = p["rmat"], p["num_nodes"], p["num_communities"]
    draws = int(round(r["edge_factor"] * n))
    _check_memory(n, 2 * draws, p["num_features"], path)
    a, b = _rmat_edges(rng_struct, draws, r["scale"], k.bit_length() - 1, p["intra_fraction"],
                       (r["a"], r["b"], r["c"]))
    community_bits = r["scale"] - (k.bit_length() - 1)  # a hidden id's community is id >> community_bits
    intra = int(np.count_nonzero((a >> community_bits) == (b >> community_bits)))
    log(f"drew {draws:,} R-MAT edges ({draws - a.shape[0]:,} self loops dropped)")
    perm = rng_perm.permutation(n).astype(np.int64)  # node id of hidden id h: perm[h]
    for i in range(0, a.shape[0], CSR_CHUNK):
        ca, cb = a[i:i + CSR_CHUNK], b[i:i + CSR_CHUNK]
        ca[:], cb[:] = perm[ca], perm[cb]
    indptr, indices = csr_from_edges(a, b, n, symmetrize=symmetrize, self_loops=self_loops, chunk=CSR_CHUNK)
    share = intra / a.shape[0] if a.shape[0] else 0.0
    del a, b
    comm_of = np.empty(n, dtype=np.int64)
    comm_of[perm] = np.arange(n, dtype=np.int64) >> community_bits
    return indptr, indices, comm_of, share


def _rmat_edges(rng: np.random.Generator, m: int, scale: int, top: int, intra_fraction: float,
                abc: tuple[float, float, float]) -> tuple[np.ndarray, np.ndarray]:
    """``m`` R-MAT draws ``(u, v)`` on ``2**scale`` hidden ids, self loops dropped (int64 each).

    R-MAT's recursion picks one quadrant per level (``scale`` levels) with probabilities ``a, b, c,
    1 - a - b - c``: u's bit is the row's, v's the column's. The top ``top`` bits of an id are its
    community; a share ``intra_fraction`` of the draws then has v's top bits replaced by u's (an edge
    inside u's community, to a node as skewed in degree as R-MAT made v). One level at a time over
    all the draws, in place: beyond the two results, one float64 and a few bool arrays of ``m``.
    """
    a, b, c = abc
    low = scale - top
    u, v = np.zeros(m, dtype=np.int64), np.zeros(m, dtype=np.int64)
    for _ in range(scale):
        x = rng.random(m)  # (m,) one quadrant per draw
        u <<= 1
        u |= x >= a + b  # bottom half: c or d
        v <<= 1
        v |= ((x >= a) & (x < a + b)) | (x >= a + b + c)  # right half: b or d
    del x
    inside = np.flatnonzero(rng.random(m) < intra_fraction)
    v[inside] = ((u[inside] >> low) << low) | (v[inside] & ((1 << low) - 1))
    del inside
    keep = u != v
    return u[keep], v[keep]


# --------------------------------------------------------------------------- pieces
def _check_memory(n: int, entries: int, features: int, path: str) -> None:
    """Refuse, before allocating, a graph whose generation needs more than the machine has available
    (``gnnpipe.costmodel.stages.graph_stage_memory``, the data stage's priced peak)."""
    need = graph_stage_memory(n, entries, features)["data"]
    have = available_memory()
    if have is not None and need > have:
        raise GnnPipeError(f"{path}: {n:,} nodes, {entries:,} stored edges and {features} features need about "
                           f"{need / 2**30:,.1f} GiB to generate, {have / 2**30:.1f} GiB are available; lower "
                           "num_nodes, avg_degree or num_features, or generate it on a machine with more memory")


def _check_capacity(quotas: dict[str, int], sizes: np.ndarray, n: int, undirected: bool, path: str):
    """Refuse edge quotas that the communities cannot hold as distinct pairs."""
    per_pair = 1 if undirected else 2  # ordered pairs in a directed graph
    inside = int(per_pair * np.sum(sizes * (sizes - 1) // 2))
    outside = per_pair * (n * (n - 1) // 2) - inside
    need_in, need_out = quotas["local"] + quotas["intra"], quotas["inter"]
    if need_in > inside or need_out > outside:
        where, need, room, move = (("inside", need_in, inside, "lower") if need_in > inside
                                   else ("between", need_out, outside, "raise"))
        raise ConfigError(f"{path}: {need:,} distinct edges {where} communities are asked for but "
                          f"only {room:,} node pairs exist there ({n:,} nodes, {sizes.shape[0]} "
                          f"communities); lower avg_degree, {move} intra_fraction or raise num_nodes")


def _community_sizes(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """``k`` sizes >= 2 summing to ``n``, proportions ~ Dirichlet(concentration)."""
    share = rng.dirichlet(np.full(k, COMMUNITY_SIZE_CONCENTRATION))
    return 2 + rng.multinomial(n - 2 * k, share).astype(np.int64)


def _power_law_weights(rng: np.random.Generator, n: int, gamma: float, cap: float) -> np.ndarray:
    """Pareto weights with tail exponent ``gamma - 1``, clipped to ``cap`` times the
    mean, normalised to mean 1 (float64, (n,))."""
    theta = (1.0 - rng.random(n)) ** (-1.0 / (gamma - 1.0))  # >= 1
    theta /= theta.mean()
    if cap > 1:
        np.minimum(theta, cap, out=theta)
    return theta / theta.mean()


class _EdgeSampler:
    """Draws candidate edges ``(u, v)`` of the DC-SBM with locality, in hidden positions.

    Everything that depends on ``u`` alone (its community's bounds and weight, its local
    window's theta prefix sums) is precomputed per node, so a draw costs a few gathers.
    """

    def __init__(self, theta: np.ndarray, start: np.ndarray, community: np.ndarray, window: float):
        n = theta.shape[0]
        self.cum = np.concatenate([[0.0], np.cumsum(theta)])  # (N+1,) prefix sums of theta
        self.total = float(self.cum[-1])
        self.first = start[community]  # (N,) first position of each node's community
        size = np.diff(start)[community]  # (N,)
        self.last = self.first + size - 1
        self.base = self.cum[self.first]  # (N,) prefix sum where the community starts
        self.wc = self.cum[self.first + size] - self.base  # (N,) the community's theta mass
        # local window [pos - w, pos + w] on the community ring, w = ceil(window * theta)
        # (< size / 2, so it wraps at most once); prefix sums on the unwrapped ring: past
        # the end, cum[pos - size] + W_c; before the start, cum[pos + size] - W_c
        w = np.minimum(np.ceil(window * theta).astype(np.int64), (size - 1) // 2)
        lo, hi = np.arange(n) - w, np.arange(n) + w + 1
        under, over = lo < self.first, hi > self.first + size
        self.f_lo = self.cum[lo + under * size] - under * self.wc
        self.f_span = self.cum[hi - over * size] + over * self.wc - self.f_lo
        # guide table (Chen & Asau): guide[j] is the node whose interval holds j * total / L.
        # A query starts there and steps forward over the few nodes of its bucket: O(1)
        # gathers per query instead of a ~20-step binary search of random memory.
        self.buckets = 2 * n
        self.guide = self._search(np.arange(self.buckets + 1) * (self.total / self.buckets))

    def _search(self, t: np.ndarray) -> np.ndarray:
        pos = np.searchsorted(self.cum, t, side="right") - 1
        return np.clip(pos, 0, self.cum.shape[0] - 2)

    def _invert(self, t: np.ndarray) -> np.ndarray:
        """Hidden position ``i`` with ``cum[i] <= t < cum[i + 1]`` (clipped to the nodes)."""
        j = np.clip((t * (self.buckets / self.total)).astype(np.int64), 0, self.buckets)
        pos = self.guide[j]
        last = self.cum.shape[0] - 2
        todo = np.flatnonzero((self.cum[pos + 1] <= t) & (pos < last))
        while todo.size:  # at most the number of nodes in one bucket (a handful)
            pos[todo] += 1
            p = pos[todo]
            todo = todo[(self.cum[p + 1] <= t[todo]) & (p < last)]
        return pos

    def __call__(self, rng: np.random.Generator, kind: str, m: int) -> tuple[np.ndarray, np.ndarray]:
        """``m`` candidate edges of one ``kind``: ``"local"``, ``"intra"`` or ``"inter"``."""
        u = self._invert(_sorted_uniform(rng, m) * self.total)  # sorted: the gathers below stream
        return u, self.second(kind, u, rng.random(m))

    def second(self, kind: str, u: np.ndarray, x: np.ndarray) -> np.ndarray:
        """The other endpoint of each ``u``, prop. to theta where ``kind`` allows, from U(0,1) ``x``."""
        base, wc = self.base[u], self.wc[u]
        if kind == "inter":  # outside u's community: skip its theta-interval
            t = x * (self.total - wc)
            t += np.where(t >= base, wc, 0.0)
            return self._invert(t)
        if kind == "local":  # within u's ring window, wrapped back onto the ring
            t = self.f_lo[u] + x * self.f_span[u]
            t += np.where(t < base, wc, 0.0) - np.where(t >= base + wc, wc, 0.0)
        else:  # anywhere in u's community
            t = base + x * wc
        # keep every draw inside its community despite floating-point rounding
        return np.clip(self._invert(t), self.first[u], self.last[u])


def _distinct_edges(rng, sampler, n: int, quotas: dict[str, int], *, undirected: bool,
                    path: str = "synthetic", log=None) -> tuple[np.ndarray, np.ndarray]:
    """Draw from ``sampler`` until each kind has its quota of distinct non-loop edges.

    Keys ``a * n + b`` (``a < b`` when ``undirected``) are kept sorted. Each round draws
    the deficit (inflated by the last round's acceptance rate; at least ``MIN_DRAW``, so
    that the last few free pairs of a nearly full community are found, and at most
    ``MAX_DRAW``, to bound the temporaries), drops loops, repeats and edges already held (of any
    kind), and keeps a uniform subset of the new ones. Kinds are drawn one after the
    other, the most repetitive first, so that the realised shares are exactly the quotas.
    A kind whose rounds stop finding new edges is too dense for its communities: error.
    """
    keys = np.empty(0, dtype=np.int64)
    for kind, count in quotas.items():
        goal, accept, rounds, stalled = keys.shape[0] + count, 1.0, 0, 0
        while (deficit := goal - keys.shape[0]) > 0:
            if stalled >= 8:
                raise GnnPipeError(
                    f"{path}: could place only {count - deficit:,} of {count:,} distinct {kind} "
                    "edges; the graph is too dense for its communities: lower avg_degree, "
                    "intra_fraction or locality, or raise num_nodes")
            draw = min(max(int(deficit / max(accept, 0.02) * 1.02), MIN_DRAW), MAX_DRAW)
            u, v = sampler(rng, kind, draw)
            keep = u != v
            u, v = u[keep], v[keep]
            if undirected:
                u, v = np.minimum(u, v), np.maximum(u, v)
            # u comes sorted, so local keys are nearly sorted: timsort ("stable") wins there
            new = np.sort(u * n + v, kind="stable" if kind == "local" else "quicksort")
            del u, v, keep
            new = new[np.concatenate(([True], new[1:] != new[:-1]))]
            if keys.shape[0]:
                at = np.minimum(np.searchsorted(keys, new), keys.shape[0] - 1)
                new = new[keys[at] != new]
            accept = new.shape[0] / draw
            stalled = stalled + 1 if accept < 1e-3 else 0
            if new.shape[0] > deficit:  # a uniform subset of the surplus
                new = new[np.sort(rng.permutation(new.shape[0])[:deficit])]
            keys = np.sort(np.concatenate([keys, new]), kind="stable")  # merge of two sorted runs
            rounds += 1
        if log:
            log(f"{count:,} {kind} edges in {rounds} round(s)")
    a, b = np.divmod(keys, n)
    return a, b


def _sorted_uniform(rng: np.random.Generator, m: int) -> np.ndarray:
    """``m`` sorted U(0, 1) variates in O(m): normalised partial sums of exponentials."""
    e = np.cumsum(rng.standard_exponential(m + 1))
    return e[:-1] / e[-1]


def _features(rng, true_class, num_classes: int, num_features: int, signal: float) -> np.ndarray:
    """``mu[class] + N(0, I)`` with random class means of norm ``signal`` (float32)."""
    mu = rng.standard_normal((num_classes, num_features))
    mu *= signal / np.linalg.norm(mu, axis=1, keepdims=True)
    mu = mu.astype(np.float32)
    x = rng.standard_normal((true_class.shape[0], num_features), dtype=np.float32)
    step = max(1, (1 << 24) // num_features)  # add the means in ~64 MiB slabs, not one N x F temporary
    for i in range(0, x.shape[0], step):
        x[i:i + step] += mu[true_class[i:i + step]]
    return x
