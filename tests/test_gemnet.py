"""GemNet-T / GemNet-dT (gnnpipe.atomic.gemnet): sizes, bases, the efficient bilinear layer, forces,
symmetries, scale factors, the protocol registry, and exact graph parallelism (float64, 1e-10)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from gnnpipe.atomic import neighbors as nb
from gnnpipe.atomic.gemnet import (GemNetT, GemNetTConfig, count_parameters, count_scale_factors, memory_per_worker,
                                   preset, step_bytes)
from gnnpipe.atomic.gemnet_layers import (CircularBasis, PolynomialEnvelope, RadialBasis, fit_scale_factors, pad_triplets,
                                          triplet_slots)
from gnnpipe.atomic.parallel import EdgeGroup, shard_graph, single_graph, with_pos
from gnnpipe.atomic.protocol import ATOMIC_MODELS, DimeNetPPModel
from gnnpipe.parallel.testing import spawn_multi_process
from test_atomic_parallel import _concat
from test_dimenetpp import f64  # noqa: F401 - the float64 fixture

CUTOFF = 3.0
TINY = GemNetTConfig(num_spherical=3, num_radial=4, num_blocks=2, emb_size_atom=5, emb_size_edge=6,
                     emb_size_trip=3, emb_size_rbf=3, emb_size_cbf=2, emb_size_bil_trip=4, num_before_skip=1,
                     num_after_skip=1, num_concat=1, num_atom=1, cutoff=CUTOFF, num_elements=10)


# --------------------------------------------------------------------------- systems
def _spread(rng, n: int, cell: np.ndarray, pbc, box=None) -> np.ndarray:
    """n positions at least 0.9 Å apart (images included): the bases are smooth there."""
    while True:
        pos = rng.random((n, 3)) @ (cell if box is None else np.eye(3) * box)
        if len(nb.radius_graph(pos, cell, pbc, 0.9)[0]) == 0:
            return pos


def _system(rng, kind: str, dimers: int = 0) -> dict:
    """One system with a symmetric radius graph: ``periodic`` (4 atoms in a 2.8 Å box: neighbours
    on their own images), ``molecule`` (5 atoms), ``dimers`` (isolated pairs: edges, no triplets)."""
    if kind == "periodic":
        cell, pbc = np.array([[2.8, 0, 0], [0.3, 2.9, 0], [0.2, 0.1, 3.0]]), (True, True, True)
        pos = _spread(rng, 4, cell, pbc)
    elif kind == "molecule":
        cell, pbc = np.zeros((3, 3)), (False, False, False)
        pos = _spread(rng, 5, cell, pbc, box=2.2)
    else:
        cell, pbc = np.zeros((3, 3)), (False, False, False)
        pos = np.array([[10.0 * (a // 2), 1.2 * (a % 2), 0.0] for a in range(2 * dimers)])
    g = nb.system_graph(pos, cell, pbc, CUTOFF)
    n = len(pos)
    return dict(z=rng.integers(1, 10, n), pos=pos, system=np.zeros(n, dtype=np.int64), num_systems=1,
                edge_src=g["edge_src"], edge_dst=g["edge_dst"], edge_shift=g["edge_shift"], idx_kj=g["idx_kj"],
                idx_ji=g["idx_ji"], energy=rng.normal(size=1), forces=rng.normal(size=(n, 3)),
                fixed=rng.random(n) < 0.2)


def _with_swap(b: dict) -> dict:
    return {**b, "id_swap": nb.reverse_edges(b["edge_src"], b["edge_dst"], b["edge_shift"])}


def _batch(seed: int, dimers: int = 55) -> dict:
    """A periodic system, a molecule, and a tail of dimers long enough that a rank holds no triplets."""
    rng = np.random.default_rng(seed)
    systems = [_system(rng, "periodic"), _system(rng, "molecule")]
    systems += [_system(rng, "dimers", dimers)] if dimers else []
    return _with_swap(_concat(systems))


def _model(head: str, cfg: GemNetTConfig = TINY, fit_on=None) -> GemNetT:
    torch.manual_seed(0)
    m = GemNetT(dataclasses.replace(cfg, force_head=head)).double()
    if fit_on is not None:
        fit_scale_factors(m, fit_on)
    return m


def _run(model, b: dict, **kw):
    g = single_graph(b)
    out = model(g if not kw else dataclasses.replace(g, **kw))
    return out["energy"].detach(), out["forces"].detach()


# --------------------------------------------------------------------------- sizes
def test_parameter_counts_match_fairchem():
    """fairchem-core's gp-gemnet-dT / gp-gemnet-xl built with its own code: 31,671,825 and
    292,939,552 (83 embedding rows, 17 / 32 frozen scale factors counted), trainable 31,671,808 and
    292,939,520. Ours at num_elements=83: the same trainable count, plus the scale factors
    (buffers here). Our 95-row default adds 12 rows of the atom embedding."""
    for name, trainable, scales in [("default", 31_671_808, 17), ("xl", 292_939_520, 32)]:
        cfg = preset(name, num_elements=83)
        assert count_parameters(cfg) == trainable
        assert count_scale_factors(cfg) == scales
        assert count_parameters(preset(name)) == trainable + 12 * cfg.emb_size_atom
    small = preset("small")
    assert count_parameters(small) == sum(p.numel() for p in GemNetT(small).parameters())


# --------------------------------------------------------------------------- bases
def test_bases_equal_scipys_functions(f64):
    from scipy import special, stats

    d = torch.linspace(0.05, 5.95, 50)
    rbf = RadialBasis(16, 6.0, 5)(d).numpy()
    x = d.numpy()[:, None] / 6.0
    mu, sigma = np.linspace(0, 1, 16), 1 / 15
    env = PolynomialEnvelope(5)(d / 6.0).numpy()[:, None]
    gauss = stats.norm.pdf(x, mu, sigma) * sigma * math.sqrt(2 * math.pi)
    np.testing.assert_allclose(rbf, env * gauss, rtol=1e-12, atol=1e-15)
    # the envelope: 1 at 0; value, slope and curvature 0 at the cutoff; 0 beyond
    u = np.polynomial.Polynomial([1, 0, 0, 0, 0, -21, 35, -15])
    np.testing.assert_allclose(env[:, 0], u(x[:, 0]), rtol=1e-10, atol=1e-13)
    assert [abs(u.deriv(k)(1.0)) < 1e-12 for k in range(3)] == [True] * 3
    assert float(PolynomialEnvelope(5)(torch.tensor([1.0, 1.5])).abs().max()) == 0.0
    cos = torch.linspace(-1, 1, 41)
    got = CircularBasis(7)(cos).numpy()
    theta = np.arccos(cos.numpy())
    want = np.stack([special.sph_harm_y(l, 0, theta, 0.0).real for l in range(7)], 1)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- triplets
def test_efficient_bilinear_equals_a_naive_sum_and_fairchems_orientation(f64):
    """The padded bilinear layer equals the sum triplet by triplet; and the triplet interaction
    (our k -> j -> i triplets, the reverse edge by id_swap) equals a literal transcription of
    fairchem's order: triplets b -> a <- c sharing their target, the reverse aggregate swapped in."""
    b = _batch(0, dimers=2)
    g = single_graph(b)
    model = _model("direct")
    trip = model.int_blocks[0].trip
    e, t = g.num_local_edges, g.num_local_triplets
    torch.manual_seed(1)
    rad, sph, x = torch.randn(e, TINY.emb_size_cbf, TINY.num_spherical), torch.randn(t, TINY.num_spherical), \
        torch.randn(e, TINY.emb_size_trip)
    sph_p = pad_triplets(sph, g.idx_ji, g.triplet_rank, e).transpose(1, 2)
    slots = triplet_slots(g.idx_kj, g.idx_ji, g.triplet_rank, e)
    got = trip.bilinear(rad, sph_p, x, slots)
    per = torch.einsum("tcs,ts,ti,ico->to", rad[g.idx_ji], sph, x[g.idx_kj], trip.bilinear.weight)
    naive = per.new_zeros((e, per.shape[1])).index_add(0, g.idx_ji, per)
    torch.testing.assert_close(got, naive, rtol=1e-12, atol=1e-12)

    # #34: with an angular basis that needs no gradient (dT), the triplet sum is one sparse product
    # (TripletSum): the same values, the same gradient in the input rows and the radial part, and its
    # adjoint pair is differentiable to second order
    from gnnpipe.atomic.gemnet_layers import TripletRows, TripletSum
    plan = TripletSum(sph_p, TripletRows(slots))
    xg, radg = x.clone().requires_grad_(), rad.clone().requires_grad_()
    sparse = trip.bilinear(radg, sph_p, xg, plan)
    torch.testing.assert_close(sparse, naive, rtol=1e-12, atol=1e-12)
    gout = torch.randn_like(sparse)
    torch.testing.assert_close(torch.autograd.grad(sparse, (xg, radg), gout),
                               torch.autograd.grad(trip.bilinear(radg, sph_p, xg, slots), (xg, radg), gout),
                               rtol=1e-12, atol=1e-13)
    assert torch.autograd.gradcheck(plan, (xg,)) and torch.autograd.gradgradcheck(plan, (xg,))
    wide = torch.randn(e + 3, x.shape[1], requires_grad=True)  # more rows than edges (a rank's gathered rows)
    torch.testing.assert_close(plan(wide), torch.bmm(sph_p, TripletRows(slots).gather(wide)), rtol=1e-12, atol=1e-13)

    # fairchem's order, edge by edge: X[c->a] = Σ_{b->a != c->a} bilinear(rad(d_ca), Y(cos φ_cab), x_ba)
    dst, swap = g.edge_dst.tolist(), g.id_swap
    v = g.edge_vectors()
    u = v / v.norm(dim=-1, keepdim=True)  # from source image to target
    rbf = model.radial(v.norm(dim=-1))
    m = torch.randn(e, TINY.emb_size_edge)
    xb = trip.dense_ba(m)
    xb = trip.down(trip.scale_rbf(xb * trip.mlp_rbf(model.mlp_rbf3(rbf)), ref=xb))
    rad3 = model.mlp_cbf3(rbf)
    agg = []
    for ca in range(e):
        terms = [torch.einsum("cs,s,i,ico->o", rad3[ca], model.circular((u[ca] * u[ba]).sum()), xb[ba],
                              trip.bilinear.weight)
                 for ba in range(e) if dst[ba] == dst[ca] and ba != ca]
        agg.append(torch.stack(terms).sum(0) if terms else torch.zeros(TINY.emb_size_bil_trip))
    agg = torch.stack(agg)
    want = (trip.up_ca(agg) + trip.up_ac(agg)[swap]) / math.sqrt(2)
    sph_ours = pad_triplets(model.circular(-(u[g.idx_ji] * u[g.idx_kj]).sum(-1)), g.idx_ji, g.triplet_rank, e)
    got = trip(m, model.mlp_rbf3(rbf), rad3, sph_ours.transpose(1, 2), slots, g)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_the_angular_basis_is_padded_once_and_atom_sums_keep_no_messages(f64):
    """Issue #34's memory goal: GemNet-dT's autograd keeps no padded angular basis (E, K, S) per block (it
    was built and kept per block, then once; now its triplet sums are one sparse product, ``TripletSum``,
    whose matrices are built once per forward outside autograd) and no padded rows at all, no
    (E, 2A + Ed) edge-embedding concatenation, and the sum of edge messages
    into atoms keeps its index alone (``index_add`` kept the messages too)."""
    b = _batch(5, dimers=0)
    g = single_graph(b)
    e, kmax = g.num_local_edges, int(g.triplet_rank.max()) + 1
    cfg = dataclasses.replace(TINY, num_blocks=3)
    model = _model("direct", cfg)
    shapes: dict = {}

    def pack(x):
        shapes.setdefault(x.untyped_storage().data_ptr(), tuple(x.shape))
        return x
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = model(g)
        (out["energy"].pow(2).sum() + out["forces"].pow(2).sum()).backward()
    kept = list(shapes.values())
    assert not [s for s in kept if len(s) == 3 and s[:2] == (e, kmax)], kept  # no (E, K, ·) padded rows
    assert (e, 2 * cfg.emb_size_atom + cfg.emb_size_edge) not in kept
    msg = torch.randn(e, 7, requires_grad=True)
    shapes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        g.edges_to_atoms(msg * 2)
    assert list(shapes.values()) == [(e,)]


def test_fused_dense_nodes_are_exact_to_every_order_and_keep_less(f64):
    """#34: ``_DenseSiLU`` (GemNet-T's Dense), ``_LinearSiLU`` (dT's) and ``_SiLULinear`` against the
    plain ops — values, gradients, a force loss's double backward (gradcheck to third order) — and a
    Dense's force pass keeps fewer (rows, out) tensors than the plain ops (whose SiLU backward is composite
    under ``create_graph``)."""
    from gnnpipe.atomic.gemnet_layers import _DenseSiLU, _LinearSiLU, _SiLULinear

    torch.manual_seed(0)
    x = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    fused = lambda x, w: _DenseSiLU.apply(x, w.view_as(w))[0]  # noqa: E731 - a view, as Dense passes it
    plain = lambda x, w: torch.nn.functional.silu(x @ w.t()) / 0.6  # noqa: E731

    def force_pass(f):  # dE/dx with the graph kept, as gradient forces do
        return lambda x, w: torch.autograd.grad(f(x, w).pow(2).sum(), x, create_graph=True)[0]

    assert torch.autograd.gradcheck(fused, (x, w)) and torch.autograd.gradgradcheck(fused, (x, w))
    assert torch.autograd.gradgradcheck(force_pass(fused), (x, w))
    for f in (lambda f: f, force_pass):
        a, b = f(fused)(x, w), f(plain)(x, w)
        torch.testing.assert_close(a, b, rtol=1e-13, atol=0)
        torch.testing.assert_close(torch.autograd.grad(a.pow(2).sum(), (x, w)),
                                   torch.autograd.grad(b.pow(2).sum(), (x, w)), rtol=1e-12, atol=0)
    # dT's Dense: one node, the 1/0.6 on W in backward; the plain ops' values and gradients, and differentiable
    a, b = _LinearSiLU.apply(x, w), plain(x, w)
    torch.testing.assert_close(a, b, rtol=1e-14, atol=0)
    torch.testing.assert_close(torch.autograd.grad(a.pow(2).sum(), (x, w)),
                               torch.autograd.grad(b.pow(2).sum(), (x, w)), rtol=1e-13, atol=0)
    assert torch.autograd.gradcheck(_LinearSiLU.apply, (x, w)) and torch.autograd.gradgradcheck(_LinearSiLU.apply, (x, w))
    z = torch.randn(6, 4, requires_grad=True)
    assert torch.autograd.gradcheck(_SiLULinear.apply, (z, w)) and torch.autograd.gradgradcheck(_SiLULinear.apply, (z, w))

    def kept_rows(f):
        ptrs: set = set()

        def pack(t):
            if t.shape == (6, 5):
                ptrs.add(t.untyped_storage().data_ptr())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            force_pass(f)(x, w)
        return len(ptrs)
    assert kept_rows(fused) < kept_rows(plain), (kept_rows(fused), kept_rows(plain))  # 4 against 9 at torch 2.13


def test_edge_embedding_node_and_folded_constants_are_exact_to_every_order(f64):
    """#34 (time): GemNet-dT's edge embedding as one node (``_EdgeDenseSiLU``: gathered atom projections
    summed by ``embedding_bag``, the edge half added in place) against the plain ops, and ``_LinearSiLU``
    with a constant folded into its 1/0.6 (``Dense(x, scale)``) against the output times it — values,
    gradients, gradcheck to second order."""
    from gnnpipe.atomic.gemnet_layers import _EdgeDenseSiLU, _LinearSiLU

    torch.manual_seed(0)
    n, e, a, f, out = 4, 9, 3, 2, 5
    h = torch.randn(n, a, requires_grad=True)
    x = torch.randn(e, f, requires_grad=True)
    w = torch.randn(out, 2 * a + f, requires_grad=True)
    src, dst = torch.randint(0, n, (e,)), torch.randint(0, n, (e,))
    plain = torch.nn.functional.silu(torch.cat([h[src], h[dst], x], 1) @ w.t()) / 0.6
    node = _EdgeDenseSiLU.apply(h, x, w, src, dst)
    torch.testing.assert_close(node, plain, rtol=1e-14, atol=1e-15)
    gy = torch.randn_like(plain)
    torch.testing.assert_close(torch.autograd.grad(node, (h, x, w), gy), torch.autograd.grad(plain, (h, x, w), gy),
                               rtol=1e-13, atol=1e-14)
    fn = lambda h, x, w: _EdgeDenseSiLU.apply(h, x, w, src, dst)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (h, x, w)) and torch.autograd.gradgradcheck(fn, (h, x, w))

    c, w = 1 / math.sqrt(2), w[:, :f].detach().requires_grad_()
    y, want = _LinearSiLU.apply(x, w, c / 0.6), _LinearSiLU.apply(x, w) * c
    torch.testing.assert_close(y, want, rtol=1e-14, atol=0)
    gy = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, (x, w), gy), torch.autograd.grad(want, (x, w), gy),
                               rtol=1e-13, atol=1e-14)
    fn = lambda x, w: _LinearSiLU.apply(x, w, c / 0.6)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w)) and torch.autograd.gradgradcheck(fn, (x, w))


def test_triplet_nodes_are_exact_to_every_order(f64):
    """#34 (time): the padded read of the triplets' input rows (``TripletRows``: one ``index_select``, its
    adjoint one ``embedding_bag``), the triplet sum (``_SlotSum``) and the two-Dense residual layer
    (``_ResidualSiLU``) against the plain ops — values, gradients, and gradcheck to second and third
    order (GemNet-T differentiates them twice)."""
    from gnnpipe.atomic.gemnet_layers import ResidualLayer, TripletRows, _ResidualSiLU, _SlotSum

    g = single_graph(_batch(0, dimers=2))
    e = g.num_local_edges
    slots = triplet_slots(g.idx_kj, g.idx_ji, g.triplet_rank, e)
    assert (slots == 0).any() and (slots > 0).any()  # both filled and empty slots
    torch.manual_seed(0)
    x = torch.randn(g.num_edges, 2, requires_grad=True)
    rows = TripletRows(slots)
    plain = torch.cat([x.new_zeros((1, 2)), x])[slots.reshape(-1)].view(*slots.shape, 2)
    torch.testing.assert_close(rows.gather(x), plain, rtol=0, atol=0)
    gp = torch.randn_like(plain)
    torch.testing.assert_close(torch.autograd.grad(rows.gather(x), x, gp)[0],
                               torch.autograd.grad(plain, x, gp)[0], rtol=1e-14, atol=1e-14)
    assert torch.autograd.gradcheck(rows.gather, (x,)) and torch.autograd.gradgradcheck(rows.gather, (x,))

    y = torch.randn(5, 7, 3, requires_grad=True)  # (E, K, S)
    xp = torch.randn(5, 7, 4, requires_grad=True)  # (E, K, I)
    torch.testing.assert_close(_SlotSum.apply(y, xp), torch.bmm(y.transpose(1, 2), xp), rtol=1e-14, atol=0)
    assert torch.autograd.gradcheck(_SlotSum.apply, (y, xp)) and torch.autograd.gradgradcheck(_SlotSum.apply, (y, xp))

    def force_pass(y, xp):  # a gradient in both inputs, the graph kept (GemNet-T's force pass), then differentiated
        return torch.autograd.grad(_SlotSum.apply(y, xp).pow(2).sum(), (y, xp), create_graph=True)
    assert torch.autograd.gradgradcheck(force_pass, (y, xp))

    layer = ResidualLayer(4, recompute=True).double()
    w1, w2 = layer.mlp[0].linear.weight, layer.mlp[1].linear.weight
    h = torch.randn(6, 4, requires_grad=True)
    want = (h + torch.nn.functional.silu(torch.nn.functional.silu(h @ w1.t()) / 0.6 @ w2.t()) / 0.6) / math.sqrt(2)
    torch.testing.assert_close(layer(h), want, rtol=1e-14, atol=0)
    torch.testing.assert_close(torch.autograd.grad(layer(h).pow(2).sum(), (h, w1, w2)),
                               torch.autograd.grad(want.pow(2).sum(), (h, w1, w2)), rtol=1e-13, atol=0)
    args = (h, w1.detach().requires_grad_(), w2.detach().requires_grad_())
    assert torch.autograd.gradcheck(_ResidualSiLU.apply, args) and torch.autograd.gradgradcheck(_ResidualSiLU.apply, args)


@pytest.mark.parametrize("head", ["gradient", "direct"])
def test_scale_factors_folded_into_weights_give_the_modules_step(head, f64):
    """#34 (time): outside fitting, the radial gates' scale factors ride on their (Ed, Rb) weights (the
    triplet input's ``scale_rbf``; dT's force output, whose gate, scale factor and ``out_forces`` are one
    (Ed, Rb) weight). With factors far from 1, a step equals the one that calls the modules (what fitting
    runs: folding is off while ``fit_scale_factors`` traces), values and every parameter gradient."""
    from gnnpipe.atomic.gemnet_layers import ScaleFactor

    b = _batch(2, dimers=2)
    model = _model(head)
    factors = [m for m in model.modules() if isinstance(m, ScaleFactor)]
    torch.manual_seed(3)
    for f in factors:
        f.scale_factor.fill_(0.3 + 2 * torch.rand(()).item())

    def step(fold: bool):
        for f in factors:
            f._seen = None if fold else []  # a list: as while tracing, so the modules are called
        try:
            model.zero_grad(set_to_none=True)
            out = model(single_graph(b))
            (out["energy"].pow(2).sum() + out["forces"].pow(2).sum()).backward()
            return [out["energy"].detach(), out["forces"].detach()] + [p.grad.clone() for p in model.parameters()]
        finally:
            for f in factors:
                f._seen = None
    assert all(f.foldable for f in factors)
    for a, c in zip(step(True), step(False)):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-14 * float(c.abs().max()))


def test_a_gemnet_t_step_runs_no_accumulating_index_put_on_padded_rows(f64):
    """#34 (time): a GemNet-T training step (the force pass under ``create_graph``, then the loss's
    backward) sums the padded slots' gradients into their rows by ``TripletRows``' adjoint, never by
    autograd's accumulating ``index_put`` on (E·K, ·) values (several times slower on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    b = _batch(0, dimers=2)
    g = single_graph(b)
    e, kmax = g.num_local_edges, int(g.triplet_rank.max()) + 1
    model = _model("gradient")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out = model(g)
        (out["energy"].pow(2).sum() + out["forces"].pow(2).sum()).backward()
    puts = [ev.input_shapes for ev in prof.events() if ev.name in ("aten::index_put_", "aten::_index_put_impl_")]
    assert puts, "the step was not profiled"
    padded = [shapes for shapes in puts if any(len(s) == 2 and s[0] == e * kmax for s in shapes)]
    assert not padded, padded


# --------------------------------------------------------------------------- physics
def test_gemnet_t_forces_are_finite_differences(f64):
    b = _batch(1, dimers=1)
    m = _model("gradient")
    _, forces = _run(m, b)
    g = single_graph(b)
    for i, k in [(0, 0), (2, 1), (6, 2), (9, 0)]:
        pos = g.pos.clone()
        pos[i, k] += 1e-6
        up = float(m(with_pos(g, pos))["energy"].sum().detach())
        pos[i, k] -= 2e-6
        down = float(m(with_pos(g, pos))["energy"].sum().detach())
        assert abs(-(up - down) / 2e-6 - float(forces[i, k])) < 1e-6
    assert float(forces.abs().max()) > 1e-3


@pytest.mark.parametrize("head", ["gradient", "direct"])
def test_invariances_and_equivariance(head, f64):
    b = _batch(2, dimers=1)
    m = _model(head)
    rot = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(3)))[0].numpy()
    e0, f0 = _run(m, b)
    e1, f1 = _run(m, {**b, "pos": b["pos"] @ rot.T, "edge_shift": b["edge_shift"] @ rot.T})
    torch.testing.assert_close(e1, e0, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(f1, f0 @ torch.as_tensor(rot).T, rtol=1e-9, atol=1e-9)
    e2, f2 = _run(m, {**b, "pos": b["pos"] + np.array([0.7, -1.3, 2.1])})
    torch.testing.assert_close(e2, e0, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(f2, f0, rtol=1e-9, atol=1e-9)
    assert float(f0.abs().max()) > 1e-3 and float(e0.abs().min()) > 1e-3


def test_scale_factors_are_fitted_once_stored_and_loaded(f64):
    b = _batch(3, dimers=1)
    g = single_graph(b)
    m = _model("direct")
    fitted = fit_scale_factors(m, [g])
    assert len(fitted) == count_scale_factors(TINY) == 3 * 2 + 2 * 3
    assert all(v > 0 for v in fitted.values()) and any(abs(v - 1) > 0.1 for v in fitted.values())
    state = m.state_dict()
    keys = [k for k in state if k.endswith("scale_factor")]
    assert len(keys) == len(fitted) and not any(n.endswith("scale_factor") for n, _ in m.named_parameters())
    again = _model("direct")
    assert not torch.allclose(_run(again, b)[0], _run(m, b)[0])
    again.load_state_dict(state)
    torch.testing.assert_close(_run(again, b)[0], _run(m, b)[0], rtol=0, atol=0)
    # fitted in execution order, each with the earlier ones fitted: every factor's output has its
    # reference's variance on the fitting data
    for name, module in m.named_modules():
        if name in fitted:
            module._stats = stats = [0.0, 0.0, 0]
            with torch.no_grad():
                m.embed(g)
            module._stats = None
            assert abs(stats[0] / stats[1] - 1) < 1e-9, name
    with pytest.raises(ValueError, match="not on a shard"):
        fit_scale_factors(m, [shard_graph(b, 2, 0, None)])


# --------------------------------------------------------------------------- protocol
def test_the_registry_builds_both_kinds_on_one_protocol(f64):
    from gnnpipe.atomic.dimenetpp import DimeNetPP, energy_and_forces
    from gnnpipe.registry import UnknownKind

    assert ATOMIC_MODELS.names() == ("dimenetpp", "gemnet_t")
    with pytest.raises(UnknownKind, match="known: dimenetpp, gemnet_t"):
        ATOMIC_MODELS["gemnet"]
    gem = ATOMIC_MODELS["gemnet_t"]
    assert gem.preset("default").force_head == "direct" and gem.preset("small").force_head == "gradient"
    assert gem.preset("xl", num_blocks=None).num_blocks == 6 and "triplet_rank" in gem.index_sets
    assert gem.count_parameters(gem.preset("small")) == count_parameters(preset("small"))
    b = _batch(4, dimers=1)
    for kind, cfg in [("gemnet_t", dataclasses.replace(TINY, force_head="gradient")),
                      ("dimenetpp", ATOMIC_MODELS["dimenetpp"].preset("small", cutoff=CUTOFF))]:
        torch.manual_seed(0)
        model = ATOMIC_MODELS[kind].build(cfg).double()
        out = model(single_graph(b))
        assert set(out) == {"energy", "forces"} and out["energy"].shape == (b["num_systems"],)
        assert out["forces"].shape == (len(b["z"]), 3)
    # DimeNet++ through the adapter: the same state dict and numbers as DimeNetPP itself
    assert isinstance(model, DimeNetPPModel)
    plain = DimeNetPP(model.cfg).double()
    plain.load_state_dict(model.state_dict())
    g = single_graph(b)
    e, f = energy_and_forces(plain, with_pos(g, g.pos.clone().requires_grad_(True)), create_graph=False)
    out = model(g)
    torch.testing.assert_close(out["energy"].detach(), e.detach(), rtol=0, atol=0)
    torch.testing.assert_close(out["forces"].detach(), f.detach(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="id_swap"):
        _model("direct")(dataclasses.replace(g, id_swap=None))


def test_memory_estimate_is_within_5_percent_of_a_measured_step(f64):
    """memory_per_worker's edge, triplet and atom parts against the activations autograd keeps
    (distinct storages) in a training step of each head, at widths the constants were not
    derived at (dT: with the matrices ``TripletSum`` holds for backward)."""
    from unittest import mock

    from gnnpipe.atomic.gemnet_layers import TripletSum
    b = _batch(5, dimers=0)
    cfg = dataclasses.replace(preset("small", cutoff=CUTOFF), emb_size_edge=24, emb_size_atom=16)
    g = single_graph(b)
    e, t, n = g.num_local_edges, g.num_local_triplets, g.num_atoms
    kmax = int(g.triplet_rank.max()) + 1
    assert len({e, t, n, kmax}) == 4
    for head in ("gradient", "direct"):
        model = _model(head, cfg)
        seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved = {"triplet": 0, "edge": 0, "atom": 0}
        rows = {t: "triplet", e: "edge", n: "atom"}

        def pack(x):  # distinct storages, by the first dimension that is not 1; padded slots count as triplets
            ptr, dims = x.untyped_storage().data_ptr(), [d for d in x.shape if d != 1]
            if ptr not in seen and x.is_floating_point() and dims and dims[0] in rows:
                seen.add(ptr)
                part = "triplet" if dims[0] == e and kmax in dims[1:] and x.dim() == 3 else rows[dims[0]]
                saved[part] += x.untyped_storage().nbytes()
            return x
        mats: list = []  # dT: TripletSum's matrices, held for backward outside autograd's saved tensors
        original = TripletSum.matrix

        def matrix(plan, rows, adjoint=False):
            out = original(plan, rows, adjoint)
            if not any(out is m for m in mats):
                mats.append(out)
            return out
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), \
                mock.patch.object(TripletSum, "matrix", matrix):
            out = model(g)
            (out["energy"].pow(2).sum() + out["forces"].pow(2).sum()).backward()
        assert bool(mats) == (head == "direct")
        saved["triplet"] += sum(t.nbytes for m in mats for t in (m.values(), m.col_indices()))
        padding = g.num_local_edges * (int(g.triplet_rank.max()) + 1) / t
        est = memory_per_worker(model.cfg, n, e, t, 1, dtype_bytes=8, padding=padding)
        for part in saved:
            assert abs(est[part] / saved[part] - 1) < 0.05, (head, part, est[part], saved[part])  # measured < 1 %


# --------------------------------------------------------------------------- graph parallelism
def _step(model, g, b: dict, systems: int, atoms: int, reduce_grads):
    """Energies, own forces and summed parameter gradients of an energy + force loss whose share
    over the ranks sums to the single-process loss (energy term replicated, counted once)."""
    model.train()
    out = model(g)
    own = slice(g.atom_lo, g.atom_hi)
    loss = ((out["energy"] - torch.as_tensor(b["energy"])) ** 2).sum() / systems \
        + ((out["forces"] - torch.as_tensor(b["forces"][own])) ** 2).sum() / (3 * atoms)
    model.zero_grad(set_to_none=False)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    reduce_grads(grads)
    return out["energy"].detach(), out["forces"].detach(), grads


def _sharded(rank: int, world: int, batches: list, ways: int, states: dict) -> dict:
    """One rank of the engine's layout (``rank = replica · P + way``, its groups from ParallelDims)."""
    from gnnpipe.parallel.comm import Communicator
    from gnnpipe.layout import ParallelDims
    from gnnpipe.parallel.groups import build_groups

    torch.set_default_dtype(torch.float64)
    groups = build_groups(ParallelDims("graph", world, ways=ways, data=world // ways), rank)
    replica, way = groups.replica_index, groups.way_index
    comm = Communicator()
    union = _concat(batches)
    b = batches[replica]
    g = shard_graph(b, ways, way, EdgeGroup(comm, groups.graph, ways, way))

    def reduce(gs):
        comm.all_reduce_coalesced_(gs, group=groups.graph)
        if groups.data is not None:
            comm.all_reduce_coalesced_(gs, group=groups.data, op="dp_allreduce")
    out = {"lo": g.atom_lo, "hi": g.atom_hi, "replica": replica, "rank": rank, "triplets": g.num_local_triplets}
    for epoch, head in enumerate(("gradient", "direct")):
        comm.set_epoch(epoch)
        model = _model(head)
        model.load_state_dict(states[head])
        out[head] = _step(model, g, b, union["num_systems"], len(union["z"]), reduce)
        out[f"{head}_sent"] = sum(v["sent"] for v in comm.ledger_dict()[epoch].values())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("ways,replicas", [(2, 1), (3, 1), (4, 1), (2, 2)])
def test_gemnet_sharded_matches_unsharded(ways, replicas):
    """GemNet-T and GemNet-dT on P ways × D replicas, a periodic system, a molecule and a rank
    without triplets: energies, forces and every parameter gradient equal single-process training
    on the union of the replicas' batches (float64, 1e-10), and the ledger the closed form."""
    batches = [_batch(10 + d) for d in range(replicas)]
    union = _with_swap(_concat(batches))
    torch.set_default_dtype(torch.float64)
    try:
        ref, states = {}, {}
        for head in ("gradient", "direct"):  # scale factors fitted once, on one process, then loaded
            model = _model(head, fit_on=[single_graph(union)])
            states[head] = model.state_dict()
            ref[head] = _step(model, single_graph(union), union, union["num_systems"], len(union["z"]),
                              lambda gs: None)
    finally:
        torch.set_default_dtype(torch.float32)
    res = spawn_multi_process(_sharded, ways * replicas, batches, ways, states, timeout=120)
    assert any(r["triplets"] == 0 for r in res), "the case must include a rank with no triplets"
    names = [n for n, _ in _model("direct").named_parameters()]
    for head in ("gradient", "direct"):
        energy, forces, grads = ref[head]  # the union's, cut into the replicas' batches
        energy = energy.split([b["num_systems"] for b in batches])
        forces = forces.split([len(b["z"]) for b in batches])
        for r in res:
            e, f, gr = r[head]
            torch.testing.assert_close(e, energy[r["replica"]], rtol=0, atol=1e-10)
            torch.testing.assert_close(f, forces[r["replica"]][r["lo"]:r["hi"]], rtol=0, atol=1e-10)
            bad = [(n, float((x - y).abs().max())) for n, x, y in zip(names, gr, grads)
                   if not torch.allclose(x, y, rtol=0, atol=1e-10)]
            assert len(gr) == len(grads) and not bad, f"{head}, rank {r['rank']}: gradients differ: {bad}"
        cfg = dataclasses.replace(TINY, force_head=head)
        want = step_bytes(cfg, [len(b["edge_src"]) for b in batches], [len(b["z"]) for b in batches],
                          [b["num_systems"] for b in batches], ways, 8, count_parameters(cfg))
        assert sum(r[f"{head}_sent"] for r in res) == want, head


@pytest.mark.parametrize("head", ["gradient", "direct"])
def test_float32_products_by_onednn_agree_with_mkls(head, monkeypatch):
    """#34 (time): in float32 on CPU the Dense nodes' large products (activation rows times a weight:
    forward and input gradient) are oneDNN's (``gemnet_layers._mm``), not MKL's. A step of each head at
    128-wide embeddings on ~700 edges (products above ``_ONEDNN_MIN_MACS``) agrees with the same step
    by ``addmm`` to float32 rounding — energies, forces and every parameter gradient — and oneDNN did
    run; a product autograd records (a differentiable backward) stays ``addmm``, with its graph."""
    from gnnpipe.atomic import gemnet_layers as gl
    from gnnpipe.models import ops

    if not ops.ONEDNN:
        pytest.skip("this torch has no oneDNN linear: _mm is addmm alone")
    cfg = dataclasses.replace(TINY, emb_size_atom=128, emb_size_edge=128, emb_size_trip=16, force_head=head)
    b = _batch(4, dimers=320)
    torch.manual_seed(0)
    model = GemNetT(cfg)
    with torch.no_grad():  # the zero-initialised output layers would make every other gradient 0
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    g = single_graph(b, torch.float32)
    calls = []
    onednn = ops.onednn_linear

    def counted(*args):
        calls.append(args[0].shape)
        return onednn(*args)

    monkeypatch.setattr(ops, "onednn_linear", counted)

    def step(on: bool):
        monkeypatch.setattr(ops, "ONEDNN", on)
        model.zero_grad(set_to_none=True)
        out = model(g)
        (out["energy"].pow(2).sum() + out["forces"].pow(2).sum()).backward()
        return [out["energy"].detach(), out["forces"].detach()] + [p.grad.clone() for p in model.parameters()]

    by_mkl, by_onednn = step(False), step(True)
    assert calls and all(s[0] * s[1] >= gl._ONEDNN_MIN_MACS // 128 for s in calls)
    worst = max(float((a - c).abs().max() / c.abs().max().clamp_min(1e-30)) for a, c in zip(by_onednn, by_mkl))
    assert worst < 1e-4, worst
    a = torch.randn(700, 128, requires_grad=True)
    y = gl._mm(a, torch.randn(128, 128), 0.5)
    assert y.grad_fn is not None and torch.autograd.grad(y.sum(), a)[0].shape == a.shape
