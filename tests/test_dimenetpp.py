"""DimeNet++ (gnnpipe.atomic.dimenetpp) against PyG's DimeNetPlusPlus, and its invariances.

PyG's ``radius_graph``/``triplets`` need compiled pyg-lib/torch-sparse: the parity test
patches those module-level names with our graph (brute force here), which leaves PyG's
own bases, blocks and readout as the oracle.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gnnpipe.atomic.dimenetpp import (DimeNetPP, DimeNetPPConfig, bessel_zeros, count_parameters,
                                      energy_and_forces, preset, silu, spherical_jn_rows, triplet_blocks)
from gnnpipe.atomic.parallel import single_graph, with_pos

CUTOFF = 3.0


def molecules(seed: int, sizes=(5, 4, 6), periodic_cell: float | None = None) -> dict:
    """Random molecules (atoms ≥ 0.9 Å apart), all pairs within CUTOFF; with ``periodic_cell`` one
    cubic periodic box instead (edges to every image within the cutoff)."""
    rng = np.random.default_rng(seed)
    z, pos, system = [], [], []
    for s, n in enumerate(sizes):
        pts = []
        while len(pts) < n:
            p = rng.uniform(0, 2.2, 3) if periodic_cell is None else rng.uniform(0, periodic_cell, 3)
            if all(np.linalg.norm(p - q) > 0.9 for q in pts):
                pts.append(p)
        z += list(rng.choice([1, 6, 7, 8], n)); pos += pts; system += [s] * n
    pos, system = np.array(pos), np.array(system)
    shifts = [np.zeros(3)] if periodic_cell is None else [
        (np.array(v) - 1) * periodic_cell for v in np.ndindex(3, 3, 3)]
    src, dst, shift = [], [], []
    for i in range(len(z)):
        for j in range(len(z)):
            if system[i] != system[j]:
                continue
            for s in shifts:
                d = np.linalg.norm(pos[i] - pos[j] - s)
                if 0 < d < CUTOFF:
                    src.append(j); dst.append(i); shift.append(s)
    src, dst, shift = np.array(src), np.array(dst), np.array(shift, dtype=float)
    kj, ji = [], []
    for e in range(len(src)):
        for f in np.nonzero(dst == src[e])[0]:
            if not (src[f] == dst[e] and np.allclose(shift[f] + shift[e], 0)):
                kj.append(f); ji.append(e)
    return dict(z=np.array(z), pos=pos, system=system, num_systems=len(sizes), edge_src=src,
                edge_dst=dst, edge_shift=shift, idx_kj=np.array(kj, dtype=np.int64),
                idx_ji=np.array(ji, dtype=np.int64))


def _model(force_head="gradient", seed=0, **kw):
    torch.manual_seed(seed)
    cfg = DimeNetPPConfig(hidden_channels=16, num_blocks=2, int_emb_size=8, basis_emb_size=4,
                          out_emb_channels=12, num_spherical=5, num_radial=4, cutoff=CUTOFF,
                          force_head=force_head, **kw)
    m = DimeNetPP(cfg).double()
    with torch.no_grad():  # the zero-initialised output layers would make every energy 0
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m


@pytest.fixture
def f64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.mark.parametrize("built_in", [torch.float64, torch.float32])
def test_matches_pyg_dimenetplusplus(monkeypatch, built_in):
    """Energies, forces and the parameter gradients of a loss on both (double backward) equal PyG's,
    float64, whichever default dtype the models were built under (then cast to float64)."""
    pyg = pytest.importorskip("torch_geometric.nn.models.dimenet")
    b = molecules(0)
    src, dst = torch.as_tensor(b["edge_src"]), torch.as_tensor(b["edge_dst"])
    kj, ji = torch.as_tensor(b["idx_kj"]), torch.as_tensor(b["idx_ji"])
    monkeypatch.setattr(pyg, "radius_graph", lambda pos, r, batch, max_num_neighbors: torch.stack([src, dst]))
    monkeypatch.setattr(pyg, "triplets", lambda edge_index, num_nodes: (
        dst, src, dst[ji], src[ji], src[kj], kj, ji))
    old = torch.get_default_dtype()
    torch.set_default_dtype(built_in)
    try:
        ours = _model()
        ref = pyg.DimeNetPlusPlus(hidden_channels=16, out_channels=1, num_blocks=2, int_emb_size=8,
                                  basis_emb_size=4, out_emb_channels=12, num_spherical=5, num_radial=4,
                                  cutoff=CUTOFF).double()
    finally:
        torch.set_default_dtype(old)
    missing = ref.load_state_dict(ours.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    pos_ref = torch.as_tensor(b["pos"]).requires_grad_(True)
    e_ref = ref(torch.as_tensor(b["z"]), pos_ref, torch.as_tensor(b["system"])).squeeze(-1)
    f_ref = -torch.autograd.grad(e_ref.sum(), pos_ref, create_graph=True)[0]
    (e_ref.pow(2).sum() + f_ref.pow(2).sum()).backward()
    g = single_graph(b)
    g = with_pos(g, g.pos.clone().requires_grad_(True))
    energy, forces = energy_and_forces(ours, g, create_graph=True)
    (energy.pow(2).sum() + forces.pow(2).sum()).backward()
    assert e_ref.abs().min() > 1e-3  # a non-trivial energy
    torch.testing.assert_close(energy.detach(), e_ref.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(forces.detach(), f_ref.detach(), rtol=1e-9, atol=1e-9)
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-9, atol=1e-9, msg=name)


def test_spherical_jn_rows_matches_scipy():
    """j_l(z_ln x) over the range the basis is used at, x = d / cutoff: float64 to 1e-10 down to x = 0.05
    (0.25 Å at a 5 Å cutoff); float32 to 3e-4 from x = 0.1, where upward recurrence (like PyG's sympy
    closed forms, 1e-3 there) loses digits at l = 6."""
    from scipy import special
    z = bessel_zeros(7, 6).astype(np.float64)
    x = np.linspace(0.05, 1.0, 500)
    y = z[None] * x[:, None, None]  # (X, S, R)
    ref = np.stack([special.spherical_jn(l, y[:, l]) for l in range(7)], 1)
    np.testing.assert_allclose(spherical_jn_rows(torch.as_tensor(y)).numpy(), ref, rtol=0, atol=1e-10)
    near = x >= 0.1
    got = spherical_jn_rows(torch.as_tensor(y[near], dtype=torch.float32)).double().numpy()
    np.testing.assert_allclose(got, ref[near], rtol=0, atol=3e-4)


def test_silu_is_twice_differentiable():
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(silu(x), torch.nn.functional.silu(x), rtol=0, atol=0)
    assert torch.autograd.gradcheck(silu, (x,)) and torch.autograd.gradgradcheck(silu, (x,))


def test_sum_rows_is_an_accumulating_sum_twice_differentiable():
    """The edges -> atoms sum (index_add forward, index_select backward, keeping the index alone) is the
    accumulating index_put it replaced, and its gradient and the gradient's gradient are right."""
    from gnnpipe.atomic.batch import sum_rows
    msg = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([2, 0, 2, 1, 4, 2, 0, 4, 4])
    ref = torch.zeros(5, 4, dtype=torch.float64).index_put((index,), msg, accumulate=True)
    torch.testing.assert_close(sum_rows(msg, index, 5), ref, rtol=0, atol=1e-15)
    f = lambda m: sum_rows(m, index, 5).sin()  # noqa: E731 - nonlinear: a second derivative to check
    assert torch.autograd.gradcheck(f, (msg,)) and torch.autograd.gradgradcheck(f, (msg,))


@pytest.mark.parametrize("head", ["gradient", "direct"])
def test_energy_only_steps_equal_the_steps_that_differentiate_positions(head, f64):
    """With no gradient of the geometry the activations are autograd's own silu (no Python Function):
    the energies and every parameter gradient equal those of the same loss with positions requiring
    grad (the force path's _SiLU), to rounding."""
    from gnnpipe.atomic.dimenetpp import DimeNetPPModel, _geometry_requires_grad
    b = molecules(6, periodic_cell=3.2, sizes=(4, 5))
    m = _model(head)
    model = DimeNetPPModel(m.cfg).double()
    model.load_state_dict(m.state_dict())
    g = single_graph(b)
    out = []
    for view in (g, with_pos(g, g.pos.clone().requires_grad_(True))):
        model.zero_grad(set_to_none=True)
        assert _geometry_requires_grad(view) == view.pos.requires_grad
        e = model(view, forces=False)["energy"]
        e.pow(2).sum().backward()
        out.append([e.detach()] + [p.grad for p in model.parameters() if p.grad is not None])  # (no force head)
    head_params = len(list(model.force_block.parameters())) if model.force_block else 0
    assert len(out[0]) == len(out[1]) == 1 + len(list(m.parameters())) - head_params
    for a, ref in zip(*out):
        torch.testing.assert_close(a, ref, rtol=1e-12, atol=1e-12 * float(ref.abs().max()))
    assert float(out[0][0].abs().min()) > 0 and all(float(p.abs().max()) > 0 for p in out[0][1:])


def _block_entries(tb):
    """(flat row, flat column) of every entry of ``tb``'s blocks, in the mask's order."""
    rows, cols, r0, c0 = [], [], 0, 0
    for gb, ro, ki in tb.shapes:
        c, r, k = torch.meshgrid(torch.arange(gb), torch.arange(ro), torch.arange(ki), indexing="ij")
        rows.append((r0 + c * ro + r).flatten())
        cols.append((c0 + c * ki + k).flatten())
        r0, c0 = r0 + gb * ro, c0 + gb * ki
    return torch.cat(rows + [torch.zeros(0, dtype=torch.long)]), torch.cat(cols + [torch.zeros(0, dtype=torch.long)])


@pytest.mark.parametrize("parts", [1, 3])
def test_triplet_blocks_hold_each_triplet_once(parts):
    """Each local triplet is one masked entry (row ji, column kj) of its centre's block; rows map back
    to local edges; the column's geometry comes from a triplet that reads its edge."""
    from gnnpipe.atomic.parallel import shard_graph
    b = molecules(3, periodic_cell=3.2, sizes=(4, 3))
    for rank in range(parts):
        g = shard_graph(b, parts, rank, None)
        tb = triplet_blocks(g)
        rows, cols = _block_entries(tb)
        assert len(tb.mask) == tb.count("entries") == len(rows)
        r, k = rows[tb.mask], cols[tb.mask]
        got = sorted(zip(tb.row_edge[r].tolist(), tb.col_edge[k].tolist()))
        assert got == sorted(zip(g.idx_ji.tolist(), g.idx_kj.tolist()))
        real = torch.zeros(tb.count("columns"), dtype=torch.bool).index_fill_(0, k, True)  # read by some triplet
        assert torch.equal(g.idx_kj[tb.col_triplet[real]], tb.col_edge[real])
        assert bool((g.kj_dst[tb.col_triplet[k]] == g.edge_src[tb.row_edge[r]]).all())  # one centre a block
        flat = torch.cat([tb.row_edge, torch.tensor([-1])])[tb.edge_row]
        has = torch.zeros(g.num_local_edges, dtype=torch.bool).index_fill_(0, g.idx_ji, True)
        assert torch.equal(flat[has], torch.arange(g.num_local_edges)[has]) and bool((flat[~has] == -1).all())


def test_triplet_blocks_pad_within_a_bucket_only():
    """Molecules of 3 to 13 atoms in one batch (in-degrees 2-12): the blocks' columns are the distinct
    input edges and their entries the triplets plus the masked diagonal (k = i), not the largest block's
    size times the centres (1.8 × and 3.6 × here with one width); degrees above 15 pad at most 12.5 %."""
    from gnnpipe.atomic.dimenetpp import _block_width
    b = molecules(5, sizes=(3, 5, 8, 13, 4, 6))
    g = single_graph(b, torch.float64)
    tb = triplet_blocks(g)
    assert tb.count("columns") == len(torch.unique(g.idx_kj))
    assert tb.count("rows") == len(torch.unique(g.idx_ji))
    assert tb.count("entries") == g.num_local_triplets + tb.count("rows")
    widths = [k for _, _, k in tb.shapes]
    assert widths == sorted(set(widths)) and len(widths) >= 5 and max(widths) <= 12  # one bucket a degree
    w = _block_width(torch.arange(1, 300))
    assert torch.equal(w[:15], torch.arange(1, 16)) and bool((w >= torch.arange(1, 300)).all())
    assert float((w / torch.arange(1, 300)).max()) <= 1.125 and len(torch.unique(w[w > 15])) <= 8 * 5


def test_bessel_zeros_are_zeros():
    from scipy import special
    z = bessel_zeros(5, 4).astype(np.float64)
    for l in range(5):
        assert np.all(np.abs(special.spherical_jn(l, z[l])) < 1e-6)  # float32-rounded roots
        assert np.all(np.diff(z[l]) > 0)


@pytest.mark.parametrize("head", ["gradient", "direct"])
def test_invariances_and_equivariance(head, f64):
    b = molecules(1, periodic_cell=3.2, sizes=(4,))
    m = _model(head)
    rot = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(3)))[0]

    def run(pos, shift):
        g = single_graph({**b, "pos": pos, "edge_shift": shift})
        g = with_pos(g, g.pos.clone().requires_grad_(True))
        e, f = energy_and_forces(m, g, create_graph=False)
        return e.detach(), f.detach()

    e0, f0 = run(b["pos"], b["edge_shift"])
    e1, f1 = run(b["pos"] @ rot.numpy().T, b["edge_shift"] @ rot.numpy().T)
    torch.testing.assert_close(e1, e0, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(f1, f0 @ rot.T, rtol=1e-9, atol=1e-9)
    e2, f2 = run(b["pos"] + np.array([3.2, 0, 0]), b["edge_shift"])  # a lattice translation
    torch.testing.assert_close(e2, e0, rtol=1e-10, atol=1e-10)
    assert float(f0.abs().max()) > 1e-6  # forces are not trivially zero


def test_gradient_forces_are_finite_differences(f64):
    b = molecules(2, periodic_cell=3.2, sizes=(4,))
    m = _model()
    g = single_graph(b)
    _, forces = energy_and_forces(m, with_pos(g, g.pos.clone().requires_grad_(True)), create_graph=False)
    for i, k in [(0, 0), (2, 1), (3, 2)]:
        pos = g.pos.clone()
        pos[i, k] += 1e-6
        up = float(m(with_pos(g, pos)).sum().detach())
        pos[i, k] -= 2e-6
        down = float(m(with_pos(g, pos)).sum().detach())
        assert abs(-(up - down) / 2e-6 - float(forces[i, k])) < 1e-6


def test_two_atoms_no_triplets(f64):
    b = molecules(4, sizes=(2,))
    assert len(b["idx_kj"]) == 0 and len(b["edge_src"]) == 2
    m = _model()
    g = single_graph(b)
    e, f = energy_and_forces(m, with_pos(g, g.pos.clone().requires_grad_(True)), create_graph=True)
    (e.sum() + f.pow(2).sum()).backward()
    assert torch.isfinite(e).all() and torch.allclose(f.sum(0), torch.zeros(3), atol=1e-10)


@pytest.mark.parametrize("name", ["small", "default"])
def test_count_parameters_is_exact(name):
    cfg = preset(name)
    assert count_parameters(cfg) == sum(p.numel() for p in DimeNetPP(cfg).parameters())


def test_xl_is_sized_without_allocating():
    n = count_parameters(preset("xl"))
    assert 1.5e8 < n < 3.5e8  # Sriram et al.: DimeNet++-XL is a few hundred million parameters


def _energy_only_step(m, g) -> tuple:
    """One energy-only step (``forces=False``, backward of sum(E²)): energies and parameter gradients."""
    m.zero_grad(set_to_none=True)
    e = m(g, forces=False)["energy"]
    e.pow(2).sum().backward()
    return e.detach(), [p.grad.clone() for p in m.parameters()]


def _compiled_twin(f64):
    """``_model``'s weights in a ``DimeNetPPModel`` with and without the ``compile`` key."""
    from dataclasses import replace

    from gnnpipe.atomic.dimenetpp import DimeNetPPModel

    eager = _model()
    twins = []
    for flag in (False, True):
        m = DimeNetPPModel(replace(eager.cfg, compile=flag)).double()
        m.load_state_dict(eager.state_dict())
        twins.append(m)
    return twins


def test_the_compile_key_keeps_the_state_dict_and_leaves_force_steps_eager(f64):
    """``compile: true`` adds no state (a model file is the same either way) and compiles nothing for a
    step with forces: energies and forces bit for bit the eager model's."""
    eager, comp = _compiled_twin(f64)
    assert eager.state_dict().keys() == comp.state_dict().keys()
    g = single_graph(molecules(0))
    out = [m(with_pos(g, g.pos.clone().requires_grad_(True))) for m in (eager, comp)]
    assert "_compiled" not in comp.__dict__
    for k in ("energy", "forces"):
        torch.testing.assert_close(out[1][k], out[0][k], rtol=0, atol=0)


def test_a_compile_that_cannot_build_is_one_line(f64, monkeypatch):
    """No C++ compiler for inductor (or any backend failure): the first energy-only step says so in one
    line naming the key, not torch's traceback."""
    import torch._dynamo.exc as dynamo_exc

    from gnnpipe.io import GnnPipeError

    def broken(fn, **kw):
        def call(*a):
            raise dynamo_exc.BackendCompilerFailed("inductor", RuntimeError("InvalidCxxCompiler: No working C++ "
                                                                            "compiler found"), None)
        return call
    monkeypatch.setattr(torch, "compile", broken)
    _, comp = _compiled_twin(f64)
    with pytest.raises(GnnPipeError) as err:
        comp(single_graph(molecules(0)), forces=False)
    msg = str(err.value)
    assert msg.startswith("dimenetpp.compile: torch.compile could not build") and "compile: false" in msg
    assert "\n" not in msg and "InvalidCxxCompiler" in msg, msg


@pytest.mark.long
def test_the_compiled_energy_only_step_is_the_eager_one(f64):
    """``compile: true``: the energy-only step (torch.compile'd forward, inductor) gives the eager step's
    energies and parameter gradients to float64 rounding, on two batches of different sizes (dynamic shapes;
    about a minute of compilation on 2 cores)."""
    eager, comp = _compiled_twin(f64)
    for seed, sizes in ((0, (5, 4, 6)), (1, (6, 3))):
        g = single_graph(molecules(seed, sizes))
        (e0, g0), (e1, g1) = _energy_only_step(eager, g), _energy_only_step(comp, g)
        torch.testing.assert_close(e1, e0, rtol=1e-10, atol=1e-12)
        for a, b in zip(g1, g0):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert "_compiled" in comp.__dict__


def test_the_compile_key_of_a_section_reaches_the_model_config():
    """``models.<name>.dimenetpp.compile`` (default false) is the built model's ``cfg.compile``."""
    from types import SimpleNamespace

    from gnnpipe.atomic.atomic_engine import model_config
    from gnnpipe.config import ATOMIC_SPECS

    spec = ATOMIC_SPECS["dimenetpp"]
    assert [model_config(SimpleNamespace(kind="dimenetpp", spec=spec(**kw)), CUTOFF).compile
            for kw in ({}, {"compile": True})] == [False, True]
