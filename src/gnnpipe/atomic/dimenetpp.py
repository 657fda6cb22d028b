"""DimeNet++ (Gasteiger et al., 2020) on torch primitives, written against ``AtomGraph``.

The model computes on what an :class:`~gnnpipe.atomic.batch.AtomGraph` holds — local edges,
local triplets, own atoms — and reduces only through its calls, so the same code is the
single-process reference and one rank of edge/triplet graph parallelism
(``gnnpipe.atomic.parallel``). Parameter names and shapes are PyG's
``DimeNetPlusPlus`` (``load_state_dict`` of a PyG model works; the parity test does it).

Per batch (E_loc local edges ``j -> i``, T_loc local triplets ``k -> j -> i``)::

    d_e   = |v_e|,  v_e = pos_i - pos_j - shift                    (E_loc,)
    rbf   = env(d/c) · sin(f_n d/c)            learnable f_n       (E_loc, R)
    sbf   = env(d_kj/c) · j_l(z_ln d_kj/c)/N_ln · Y_l^0(angle)     (T_loc, S·R)
    x     = act(W [h_{z_i}, h_{z_j}, act(W_rbf rbf)])              (E_loc, H)    embedding
    per block:                                                                   interaction
      m     = act(W_down (act(W_kj x) ⊙ W_rbf2 W_rbf1 rbf))        (E_loc, I)
      m_all = gather_edges(m)                                       (E, I)        all-gather
      t     = m_all[idx_kj] ⊙ W_sbf2 W_sbf1 sbf                     (T_loc, I)
      x    += ... act(W_up scatter_{idx_ji}(t)) + act(W_ji x) ...   (E_loc, H)
    per output block: P += MLP(W_up edges_to_atoms(W_rbf rbf ⊙ x))  (N_own, 1)    reduce-scatter
    energy = sum_systems(P)                                         (B,)          all-reduce

That is the math (PyG's order of operations). The triplet lines are computed without any
(T_loc, ·) tensor: ``sbf`` is a product of a radial factor of the input edge alone and an angular
factor ``Y_l^0`` per triplet, and ``W_sbf2 W_sbf1`` is linear, so per block::

    c[kj, l]  = (W_sbf2 W_sbf1[:, l, :]) rad[kj, l, :]             per input edge  (·, S, I)
    scatter_{idx_ji}(t)[ji] = Σ_{kj, l} Y_l^0(angle(kj, ji)) · (m_all[kj] ⊙ c[kj, l])

which, with the triplets of each centre atom j laid out as a dense (output edges × input edges)
block (:class:`TripletBlocks`), is one batched matmul over centres (per bucket of centres of one
block width, so that padding stays small where degrees vary: molecules of 3-13 atoms in one batch).
The two basis layers are multiplied first, ``W_sbf2 W_sbf1[:, l, :]`` (I × R per order l, a few
thousand numbers), so ``c`` is one batched product over l with no (·, S, B) tensor: its backward is
one more (``rad_l^T`` times the gradient, per l) where two narrow products (B = 8 columns) and the
block-diagonal W_sbf1's were. Memory kept for backward per block is then ~ S·I per distinct input
edge instead of ~ 3·I per triplet (T/E ≈ 20 on slabs, ≈ 7 on small molecules: about even there),
and the activation's double backward is one op (:class:`_SiLU`) where forces are differentiated
(autograd's own ``F.silu`` elsewhere: :func:`_geometry_requires_grad`).

Forces: ``energy_and_forces`` — ``"gradient"`` (energy-conserving, ``-dE/dpos`` by autograd;
``create_graph=True`` for training on forces) or ``"direct"`` (an extra edge head:
per-edge magnitudes times unit edge vectors, summed into atoms).

The spherical Bessel zeros are rounded to float32 as in the reference implementation
(DimeNet's and PyG's ``Jn_zeros``), so that the bases agree with PyG to rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn import Embedding, Linear

from ..io import GnnPipeError
from .batch import AtomGraph, gradient_forces
from .dimenetpp_config import DimeNetPPConfig


#: ``small`` runs on 2 CPU cores in seconds; ``xl`` is DimeNet++-XL of Sriram et al. (ICLR 2022):
#: 4 blocks, hidden 2048, output embedding 1536, triplet (interaction) embedding 256.
PRESETS = {
    "small": dict(hidden_channels=32, num_blocks=2, int_emb_size=16, basis_emb_size=4,
                  out_emb_channels=64, num_spherical=4, num_radial=4),
    "default": {},
    "xl": dict(hidden_channels=2048, num_blocks=4, int_emb_size=256, out_emb_channels=1536),
}


def preset(name: str, **over) -> DimeNetPPConfig:
    return DimeNetPPConfig(**{**PRESETS[name], **over})


# --------------------------------------------------------------------------- bases
class Envelope(nn.Module):
    """Smooth cutoff ``1/x + a x^(p-1) + b x^p + c x^(p+1)`` for x < 1, else 0 (p = exponent + 1)."""

    def __init__(self, exponent: int):
        super().__init__()
        self.p = exponent + 1
        self.a = -(self.p + 1) * (self.p + 2) / 2
        self.b = self.p * (self.p + 2)
        self.c = -self.p * (self.p + 1) / 2

    def forward(self, x: Tensor) -> Tensor:
        xp = x.pow(self.p - 1)
        return (1.0 / x + self.a * xp + self.b * xp * x + self.c * xp * x * x) * (x < 1.0).to(x.dtype)


class BesselBasisLayer(nn.Module):
    """``env(d/c) sin(f_n d/c)``, frequencies ``f_n`` learnable (initialised n·π)."""

    def __init__(self, num_radial: int, cutoff: float, envelope_exponent: int):
        super().__init__()
        self.cutoff = cutoff
        self.envelope = Envelope(envelope_exponent)
        self.freq = nn.Parameter(torch.empty(num_radial))
        self.reset_parameters()

    def reset_parameters(self):
        if not self.freq.is_meta:
            with torch.no_grad():
                self.freq.copy_(torch.arange(1, self.freq.numel() + 1, dtype=self.freq.dtype) * math.pi)

    def forward(self, dist: Tensor) -> Tensor:  # (E,) -> (E, R)
        x = dist.unsqueeze(-1) / self.cutoff
        return self.envelope(x) * torch.sin(self.freq * x)


def _sph_jn_np(x: np.ndarray, order: int) -> np.ndarray:
    from scipy import special
    return np.sqrt(np.pi / (2 * x)) * special.jv(order + 0.5, x)


def bessel_zeros(num_spherical: int, num_radial: int) -> np.ndarray:
    """(S, R) the first R positive zeros of j_l, l < S (interlacing bracketing, brentq), float32."""
    from scipy.optimize import brentq
    zeros = np.zeros((num_spherical, num_radial), dtype=np.float32)
    zeros[0] = np.arange(1, num_radial + 1) * np.pi
    points = np.arange(1, num_radial + num_spherical) * np.pi
    roots = np.zeros(num_radial + num_spherical - 1, dtype=np.float32)
    for order in range(1, num_spherical):
        for j in range(num_radial + num_spherical - 1 - order):
            roots[j] = brentq(_sph_jn_np, points[j], points[j + 1], (order,))
        points = roots.copy()
        zeros[order] = roots[:num_radial]
    return zeros


def spherical_jn_rows(y: Tensor) -> Tensor:
    """(..., S, R) -> (..., S, R): ``j_l(y[..., l, :])``, the order l of each row l.

    One upward recurrence ``j_{l+1} = (2l+1)/y j_l - j_{l-1}`` from ``j_0 = sin y / y`` and
    ``j_1 = (j_0 - cos y) / y``, carried only on the rows that still need a higher order
    (S(S+1)/2 rows in all). Like the reference's closed forms (sympy, PyG), it loses digits
    for ``y < l``: relative error ~ eps·(2l+1)!!² / y^(2l+1) (tests: against scipy over the range used).
    """
    s, c = torch.sin(y), torch.cos(y)
    j0 = s / y
    rows = [j0[..., :1, :]]
    if y.shape[-2] > 1:
        j1 = (j0 - c) / y
        rows.append(j1[..., 1:2, :])
        prev, cur = j0[..., 1:, :], j1[..., 1:, :]  # rows [l, S) at order l - 1, l (here l = 1)
        for l in range(1, y.shape[-2] - 1):
            nxt = (2 * l + 1) / y[..., l:, :] * cur - prev  # j_{l+1} on rows [l, S)
            rows.append(nxt[..., 1:2, :])
            prev, cur = cur[..., 1:, :], nxt[..., 1:, :]
    return torch.cat(rows, dim=-2)


class SphericalBasisLayer(nn.Module):
    """DimeNet's 2D basis ``env(d/c) · N_ln j_l(z_ln d/c) · Y_l^0(angle)`` in its two factors.

    ``radial(d)`` (..., S, R) depends only on the input edge's length, so it is computed once per
    distinct input edge; ``angular(cos)`` (..., S) is ``Y_l^0 = sqrt((2l+1)/4π) P_l(cos)`` per
    triplet. Their product per triplet, flattened (l, n), is PyG's (T, S·R) ``sbf``.
    """

    def __init__(self, num_spherical: int, num_radial: int, cutoff: float, envelope_exponent: int):
        super().__init__()
        self.num_spherical, self.num_radial, self.cutoff = num_spherical, num_radial, cutoff
        self.envelope = Envelope(envelope_exponent)
        z = bessel_zeros(num_spherical, num_radial)  # float32, and so the normalisers (as the reference)
        norm = np.stack([1 / np.sqrt(0.5 * _sph_jn_np(z[l], l + 1) ** 2) for l in range(num_spherical)])
        self.register_buffer("zeros", torch.from_numpy(z.astype(np.float64)), persistent=False)  # (S, R)
        self.register_buffer("norm", torch.from_numpy(norm.astype(np.float64)), persistent=False)  # (S, R)
        self.register_buffer("sph_pref", torch.tensor(  # float64 whatever the default dtype (exact as PyG's)
            [math.sqrt((2 * l + 1) / (4 * math.pi)) for l in range(num_spherical)], dtype=torch.float64),
            persistent=False)

    def radial(self, dist: Tensor) -> Tensor:  # (...) -> (..., S, R)
        x = (dist / self.cutoff)[..., None, None]
        return self.envelope(x) * self.norm.to(x.dtype) * spherical_jn_rows(self.zeros.to(x.dtype) * x)

    def angular(self, cos: Tensor) -> Tensor:  # (...) -> (..., S)
        leg = [torch.ones_like(cos), cos]  # Legendre P_l(cos) by Bonnet's recurrence
        for l in range(2, self.num_spherical):
            leg.append(((2 * l - 1) * cos * leg[l - 1] - (l - 1) * leg[l - 2]) / l)
        return torch.stack(leg[:self.num_spherical], -1) * self.sph_pref.to(cos.dtype)


# --------------------------------------------------------------------------- triplets as blocks
@dataclass
class TripletBlocks:
    """The local triplets ``k -> j -> i`` as one dense (rows × columns) block per centre atom j,
    the centres bucketed by their number of columns.

    Rows are j's output edges ji (local) that hold a local triplet, columns its input edges kj
    (gathered ids) that one references. Every triplet is one (row, column) of its centre's block;
    other entries are masked out. A sum over triplets into output edges is then one batched matmul
    per bucket, and whatever depends on the input edge alone is computed once per column, not per
    triplet. Bucket b holds G_b centres whose column counts round to the same width Ki_b
    (:func:`_block_width`: exact up to 15, then at most 12.5 % more), each block padded to Ki_b
    columns and to Ro_b rows (the width of the bucket's largest row count). Rows, columns and
    entries are flat, bucket after bucket: bucket b's rows are ``row_edge.split(sizes("rows"))[b]``
    viewed (G_b, Ro_b), and so on.

    The padding is the price, and bucketing bounds it: on molecules (every atom's in-degree its
    out-degree, degrees 2-13 in one batch) a single width would pad the columns 1.8 × and the
    entries 3 × the triplets; here the columns are the distinct input edges and the entries
    T_loc + the rows (the masked diagonal k = i). Built per forward from the index arrays alone
    (a few ms at 10^5 triplets); its place is ``AtomGraph``, built once per batch view with
    ``idx_kj``/``idx_ji``.
    """

    row_edge: Tensor  # (ΣG·Ro,) local edge id of each row (padding: 0)
    col_edge: Tensor  # (ΣG·Ki,) gathered edge id of each column (padding: 0)
    col_triplet: Tensor  # (ΣG·Ki,) the first local triplet reading the column's edge (its geometry; padding: 0)
    mask: Tensor  # (ΣG·Ro·Ki,) bool: the entry is a triplet
    edge_row: Tensor  # (E_loc,) flat row of each local edge, ΣG·Ro if it has no triplet
    masks: list  # per bucket, ``mask``'s entries as (G, Ro, Ki): the buckets' shapes are theirs

    @property
    def shapes(self) -> tuple:
        """((G, Ro, Ki), ...) of each bucket (tensor sizes: symbolic under ``torch.compile``)."""
        return tuple([tuple(m.shape) for m in self.masks])  # (no generator: torch.compile would break its graph)

    def sizes(self, part: str) -> list[int]:
        """Each bucket's number of ``rows`` (G·Ro), ``columns`` (G·Ki) or ``entries`` (G·Ro·Ki)."""
        if part == "rows":
            return [g * r for g, r, _ in self.shapes]
        return [g * k for g, _, k in self.shapes] if part == "columns" else [g * r * k for g, r, k in self.shapes]

    def count(self, part: str) -> int:
        return sum(self.sizes(part))


def _at(x: Tensor, idx: Tensor) -> Tensor:
    """``x[idx]`` for a 1-D ``idx``: ``index_select`` (advanced indexing costs several times more a call
    on the index arrays here, about 30 of them a build)."""
    return x.index_select(0, idx)


def _distinct(idx: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The distinct values of ``idx`` (in [0, n)) in increasing order, and each entry's position
    among them: a presence mask and its prefix sum, linear in ``len(idx)`` (no sort)."""
    present = torch.zeros(n, dtype=torch.bool, device=idx.device).index_fill_(0, idx, True)
    return present.nonzero().squeeze(1), _at(torch.cumsum(present, 0) - 1, idx)


def _slots(centre: Tensor, num_centres: int) -> tuple[Tensor, Tensor]:
    """Each item's position among the items of its centre (items in increasing id), and each centre's count."""
    counts = torch.bincount(centre, minlength=num_centres)
    order = torch.argsort(centre, stable=True)
    slot = torch.empty_like(centre)
    slot.index_copy_(0, order, torch.arange(len(centre), device=centre.device)
                     - _at(_exclusive_cumsum(counts), _at(centre, order)))
    return slot, counts


def _block_width(count: Tensor) -> Tensor:
    """The block width of ``count`` rows or columns: ``count`` up to 15, above rounded up to a multiple
    of 2^(⌊log2 count⌋ - 3) (at most 12.5 % padding, 8 widths an octave: few buckets whatever the degrees)."""
    step = torch.exp2((torch.log2(count.clamp(min=1).double()).floor() - 3).clamp(min=0)).long()
    return -(-count // step) * step


def _exclusive_cumsum(x: Tensor) -> Tensor:
    return torch.cumsum(x, 0) - x


@torch.compiler.disable  # data-dependent sizes (counts, nonzero): eager under ``compile`` too
def triplet_blocks(g: AtomGraph, single: bool = False) -> TripletBlocks:
    """The :class:`TripletBlocks` of ``g``'s local triplets: index work linear in T_loc, sorts over edges only.
    ``single``: one bucket, every block as wide and as tall as the largest (``torch.compile`` traces one
    layout whatever the batch: a bucket count would be a constant of the compiled code)."""
    if not torch.equal(_at(g.edge_src, g.idx_ji), g.kj_dst):
        raise ValueError("a triplet k -> j -> i must have its output edge ji start where its input edge kj ends")
    t = g.num_local_triplets
    rows, rinv = _distinct(g.idx_ji, g.num_local_edges)  # output edges ji, the rows
    cols, cinv = _distinct(g.idx_kj, g.num_edges)  # input edges kj, the columns
    long = dict(dtype=torch.long, device=rows.device)
    first = torch.full((len(cols),), t, **long).scatter_reduce_(0, cinv, torch.arange(t, **long), "amin")
    centres, rcentre = _distinct(_at(g.edge_src, rows), g.num_atoms)  # the atoms j, each row's
    atom_centre = torch.full((g.num_atoms,), -1, **long)
    atom_centre.index_copy_(0, centres, torch.arange(len(centres), **long))
    ccentre = _at(atom_centre, _at(g.kj_dst, first))  # each column's: the atom its edge ends at
    n = len(centres)
    rslot, rcount = _slots(rcentre, n)
    cslot, ccount = _slots(ccentre, n)
    ki = torch.full_like(ccount, int(ccount.max()) if n else 0) if single else _block_width(ccount)  # padded columns
    order = torch.argsort(ki, stable=True)
    widths, per = torch.unique_consecutive(_at(ki, order), return_counts=True)
    bucket = torch.empty(n, **long)
    bucket.index_copy_(0, order, torch.repeat_interleave(torch.arange(len(widths), **long), per))
    ro_b = torch.zeros(len(widths), **long).scatter_reduce_(0, bucket, rcount, "amax")
    ro_b = ro_b if single else _block_width(ro_b)
    rank = torch.empty(n, **long)  # a centre's place in its bucket
    rank.index_copy_(0, order, torch.arange(n, **long) - _at(_exclusive_cumsum(per), _at(bucket, order)))
    ro, ki = _at(ro_b, bucket), _at(widths, bucket)  # each centre's block shape
    row0 = _at(_exclusive_cumsum(per * ro_b), bucket) + rank * ro  # each centre's first flat row, column, entry
    col0 = _at(_exclusive_cumsum(per * widths), bucket) + rank * ki
    entry0 = _at(_exclusive_cumsum(per * ro_b * widths), bucket) + rank * ro * ki
    shapes = tuple(zip(per.tolist(), ro_b.tolist(), widths.tolist()))
    num_rows = sum(b * r for b, r, _ in shapes)
    num_cols = sum(b * k for b, _, k in shapes)
    row_edge, col_edge, col_triplet = (torch.zeros(w, **long) for w in (num_rows, num_cols, num_cols))
    row = _at(row0, rcentre) + rslot
    row_edge.index_copy_(0, row, rows)
    col = _at(col0, ccentre) + cslot
    col_edge.index_copy_(0, col, cols)
    col_triplet.index_copy_(0, col, first)
    mask = torch.zeros(sum(b * r * k for b, r, k in shapes), dtype=torch.bool, device=rows.device)
    tc = _at(rcentre, rinv)  # each triplet's centre
    mask.index_fill_(0, _at(entry0, tc) + _at(rslot, rinv) * _at(ki, tc) + _at(cslot, cinv), True)
    edge_row = torch.full((g.num_local_edges,), num_rows, **long)
    edge_row.index_copy_(0, rows, row)
    masks = [m.view(shape) for m, shape in zip(mask.split([b * r * k for b, r, k in shapes]), shapes)]
    return TripletBlocks(row_edge, col_edge, col_triplet, mask, edge_row, masks)


# --------------------------------------------------------------------------- blocks
class _SiLU(torch.autograd.Function):
    """``silu(x) = x·σ(x)`` whose gradient is one op (:class:`_SiLUGrad`) saving only ``(grad, x)``.

    Autograd's own silu, differentiated with ``create_graph=True`` (gradient forces), records
    its derivative ``σ(x)(1 + x(1 - σ(x)))`` as five ops, each keeping its (E, H) inputs for the
    second backward; here the force pass keeps two (E, H) tensors per activation and runs one kernel.
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return F.silu(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        x, = ctx.saved_tensors
        if not torch.is_grad_enabled():  # a plain backward (energy-only training): the kernel alone
            return torch.ops.aten.silu_backward(grad, x)
        return _SiLUGrad.apply(grad, x)


class _SiLUGrad(torch.autograd.Function):
    """``grad · silu'(x)``; its own gradient uses ``silu''(x) = σ(1 - σ)(2 + x(1 - 2σ))``."""

    @staticmethod
    def forward(ctx, grad: Tensor, x: Tensor) -> Tensor:
        ctx.save_for_backward(grad, x)
        return torch.ops.aten.silu_backward(grad, x)

    @staticmethod
    def backward(ctx, gg: Tensor) -> tuple[Tensor, Tensor]:
        grad, x = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[1]:  # σ(1 - σ)·A is sigmoid_backward(A, σ); 2 + x(1 - 2σ) = (x + 2) - 2xσ
            s = torch.sigmoid(x)
            dx = torch.ops.aten.sigmoid_backward(gg * grad * torch.addcmul(x + 2, x, s, value=-2), s)
        return torch.ops.aten.silu_backward(gg, x) if ctx.needs_input_grad[0] else None, dx


def silu(x: Tensor) -> Tensor:
    return _SiLU.apply(x)


def _triplet_sum_graph(m_all: Tensor, w: Tensor, rad: Tensor, ang: list, tb: TripletBlocks) -> Tensor:
    """:func:`triplet_sum` as autograd records it op by op (differentiable twice: gradient forces)."""
    s = rad.shape[0]
    m = m_all.index_select(0, tb.col_edge)  # (ΣG·Ki, I)
    mc = (torch.bmm(rad, w) * m).transpose(0, 1).contiguous()  # (ΣG·Ki, S, I)
    out = [torch.bmm(a_, mc_.view(gb, ki * s, -1)).flatten(0, 1)  # (G·Ro, I)
           for (gb, _, ki), a_, mc_ in zip(tb.shapes, ang, mc.split(tb.sizes("columns")))]
    if not out:  # no local triplet: the gathered messages stay in the graph (gather_edges' backward is collective)
        out = [mc.reshape(0, mc.shape[-1])]
    return torch.cat([*out, m.new_zeros(1, m.shape[-1])]).index_select(0, tb.edge_row)  # (E_loc, I)


class _TripletSum(torch.autograd.Function):
    """:func:`triplet_sum` as one node, for a geometry that needs no gradient (energy-only steps, the
    direct force head): the same products, but each result written once into a buffer of its final
    layout (the (ΣG·Ki, S, I) messages, the rows of every bucket) rather than made and then copied,
    transposed or concatenated, and the backward's three (S, ΣG·Ki, I) passes are two. Not
    differentiable twice (``once_differentiable``): gradient forces take :func:`_triplet_sum_graph`."""

    @staticmethod
    def forward(ctx, m_all: Tensor, w: Tensor, rad: Tensor, ang: list, tb: TripletBlocks) -> Tensor:
        s, k, _ = rad.shape
        i = w.shape[-1]
        m = m_all.index_select(0, tb.col_edge)  # (ΣG·Ki, I)
        c = torch.bmm(rad, w)  # (S, ΣG·Ki, I)
        mc = torch.mul(c.transpose(0, 1), m.unsqueeze(1), out=m.new_empty(k, s, i))  # (ΣG·Ki, S, I)
        rows = m.new_empty(tb.count("rows") + 1, i)
        rows[-1] = 0  # the row of edges that hold no triplet
        for (gb, ro, ki), a, r0, r1, c0, c1 in _bucket_slices(tb, ang):
            torch.bmm(a, mc[c0:c1].view(gb, ki * s, i), out=rows[r0:r1].view(gb, ro, i))
        ctx.save_for_backward(m, c, rad, *ang)  # what autograd kept op by op (the saved-memory hooks count them)
        ctx.tb, ctx.num_edges = tb, m_all.shape[0]
        return rows.index_select(0, tb.edge_row)  # (E_loc, I)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        m, c, rad, *ang = ctx.saved_tensors
        tb = ctx.tb
        s, k, i = c.shape
        grows = grad.new_zeros(tb.count("rows") + 1, i).index_add_(0, tb.edge_row, grad)
        gmc = grad.new_empty(k, s, i)  # d/d(mc): A^T times each bucket's rows
        for (gb, ro, ki), a, r0, r1, c0, c1 in _bucket_slices(tb, ang):
            torch.bmm(a.transpose(1, 2), grows[r0:r1].view(gb, ro, i), out=gmc[c0:c1].view(gb, ki * s, i))
        gw = None
        if ctx.needs_input_grad[1]:  # d/dw = rad_l^T (gmc_l ⊙ m), per l: the product in gmc's layout, read per l
            gw = torch.bmm(rad.transpose(1, 2), torch.mul(gmc, m.unsqueeze(1)).transpose(0, 1))
        gm = gmc.mul_(c.transpose(0, 1)).sum(1)  # d/dm = Σ_l gmc_l ⊙ c_l
        gm_all = grad.new_zeros(ctx.num_edges, i).index_add_(0, tb.col_edge, gm)
        return gm_all, gw, None, None, None


def _bucket_slices(tb: TripletBlocks, ang: list):
    """Per bucket: its shape (G, Ro, Ki), its angular block and its [first, last) flat row and column."""
    r0 = c0 = 0
    for (gb, ro, ki), a in zip(tb.shapes, ang):
        yield (gb, ro, ki), a, r0, r0 + gb * ro, c0, c0 + gb * ki
        r0, c0 = r0 + gb * ro, c0 + gb * ki


def triplet_sum(m_all: Tensor, w: Tensor, rad: Tensor, ang: list, tb: TripletBlocks) -> Tensor:
    """(E_loc, I): ``Σ_{kj, l} Y_l^0(angle) · (m_all[kj] ⊙ (W_l^T rad[kj, l]))`` into each output edge ji
    (the module docstring), over ``tb``'s buckets. ``m_all`` (E, I) the gathered messages, ``w`` (S, R, I),
    ``rad`` (S, ΣG·Ki, R) and ``ang`` per bucket (G, Ro, Ki·S) as ``InteractionPPBlock.forward`` gets them.
    One autograd node (:class:`_TripletSum`) unless the bases need a gradient (gradient forces: the
    geometry's) or ``torch.compile`` traces it (its out= products are not traced)."""
    if rad.requires_grad or any(a.requires_grad for a in ang) or torch.compiler.is_compiling():
        return _triplet_sum_graph(m_all, w, rad, ang, tb)
    return _TripletSum.apply(m_all, w, rad, ang, tb)


def _geometry_requires_grad(g: AtomGraph) -> bool:
    """Whether a gradient with respect to ``g``'s geometry (positions, strain) can be taken: gradient
    forces or stress, differentiated again when training on them. Only then is :class:`_SiLU` worth its
    Python Function per activation; otherwise (energy-only steps, the direct force head) autograd's own
    ``F.silu``, the same values and gradients, recorded as one C++ node (3-4 % of an energy-only step)."""
    return g.pos.requires_grad or (g.strain is not None and g.strain.requires_grad)


def _narrow_linear(lin: Linear, x: Tensor) -> Tensor:
    """``lin(x)`` for a layer with few inputs applied to many rows (the bases: R, B = 6-8 wide).

    The same product as ``F.linear``, but with ``W^T`` made row-major first, so that autograd forms
    the weight gradient as ``x^T @ grad`` rather than ``grad^T @ x``: 2-3x faster forward + backward
    for (E, 6) -> (E, 256) and (G·Ki·S, 8) -> (·, 128) here (MKL, one thread), equal for square layers.
    """
    flat = x.reshape(-1, x.shape[-1])
    w = lin.weight.t().contiguous()
    y = flat @ w if lin.bias is None else torch.addmm(lin.bias, flat, w)
    return y.view(*x.shape[:-1], w.shape[1])


def _glorot_orthogonal(weight: Tensor, scale: float = 2.0) -> None:
    if weight.is_meta:
        return
    nn.init.orthogonal_(weight)
    with torch.no_grad():
        weight.mul_(math.sqrt(scale / ((weight.size(0) + weight.size(1)) * float(weight.var()))))


class EmbeddingBlock(nn.Module):
    def __init__(self, num_radial: int, hidden: int):
        super().__init__()
        self.emb = Embedding(95, hidden)
        self.lin_rbf = Linear(num_radial, hidden)
        self.lin = Linear(3 * hidden, hidden)
        if not self.emb.weight.is_meta:
            nn.init.uniform_(self.emb.weight, -math.sqrt(3), math.sqrt(3))

    def forward(self, z: Tensor, rbf: Tensor, i: Tensor, j: Tensor, act=silu) -> Tensor:  # -> (E_loc, H)
        """``act(W [h_{z_i}, h_{z_j}, act(W_rbf rbf)])`` with W's two element parts applied to the
        element table (95 rows), not per edge: they do not depend on positions, so the force pass
        and its double backward skip them."""
        w_i, w_j, w_rbf = self.lin.weight.split(self.emb.embedding_dim, dim=1)
        h = self.emb.weight  # (95, H)
        x_rbf = F.linear(act(_narrow_linear(self.lin_rbf, rbf)), w_rbf, self.lin.bias)  # (E_loc, H)
        return act((h @ w_i.T).index_select(0, z[i]) + (h @ w_j.T).index_select(0, z[j]) + x_rbf)


class ResidualLayer(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.lin1, self.lin2 = Linear(hidden, hidden), Linear(hidden, hidden)
        for lin in (self.lin1, self.lin2):
            _glorot_orthogonal(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, x: Tensor, act=silu) -> Tensor:
        return act(self.lin2(act(self.lin1(x)))).add_(x)  # into act's output: no fresh (E, H) buffer


class InteractionPPBlock(nn.Module):
    """Triplet interaction: the only place edge rows of other ranks are read (``gather_edges``)."""

    def __init__(self, c: DimeNetPPConfig):
        super().__init__()
        h, r, s = c.hidden_channels, c.num_radial, c.num_spherical
        self.lin_rbf1 = Linear(r, c.basis_emb_size, bias=False)
        self.lin_rbf2 = Linear(c.basis_emb_size, h, bias=False)
        self.lin_sbf1 = Linear(s * r, c.basis_emb_size, bias=False)
        self.lin_sbf2 = Linear(c.basis_emb_size, c.int_emb_size, bias=False)
        self.lin_kj, self.lin_ji = Linear(h, h), Linear(h, h)
        self.lin_down = Linear(h, c.int_emb_size, bias=False)
        self.lin_up = Linear(c.int_emb_size, h, bias=False)
        self.layers_before_skip = nn.ModuleList([ResidualLayer(h) for _ in range(c.num_before_skip)])
        self.lin = Linear(h, h)
        self.layers_after_skip = nn.ModuleList([ResidualLayer(h) for _ in range(c.num_after_skip)])
        for lin in (self.lin_rbf1, self.lin_rbf2, self.lin_sbf1, self.lin_sbf2, self.lin_kj, self.lin_ji,
                    self.lin_down, self.lin_up, self.lin):
            _glorot_orthogonal(lin.weight)
            if lin.bias is not None and not lin.bias.is_meta:
                nn.init.zeros_(lin.bias)

    def forward(self, x: Tensor, rbf: Tensor, rad: Tensor, ang: list, g: AtomGraph, tb: TripletBlocks,
                act=silu) -> Tensor:
        """``rad`` (S, ΣG·Ki, R) the radial basis of each block column (the orders first: one product per
        order), ``ang`` per bucket (G, Ro, Ki·S) the angular basis of each triplet (0 off the triplets):
        PyG's ``sbf`` is their product per triplet. ``act``: :func:`silu` or ``F.silu``."""
        x_ji = act(self.lin_ji(x))  # (E_loc, H)
        # W_rbf2 W_rbf1 first (H × R), applied as _narrow_linear does: one product with the basis rows, no (E, B)
        x_kj = act(self.lin_kj(x)) * (rbf @ (self.lin_rbf1.weight.T @ self.lin_rbf2.weight.T))
        x_kj = act(self.lin_down(x_kj))  # (E_loc, I)
        # t = m[kj] ⊙ W_sbf2 W_sbf1 (rad[kj] ⊗ ang) summed into ji: the radial factor and m meet once
        # per input edge, and the sum over (kj, l) is one matmul per centre: no (T, I) tensor at all
        s, _, r = rad.shape
        w = self.lin_sbf1.weight.view(-1, s, r).permute(1, 2, 0) @ self.lin_sbf2.weight.T  # (S, R, I): per l
        x_kj = triplet_sum(g.gather_edges(x_kj), w, rad, ang, tb)  # (E_loc, I)
        # the sums go into act's outputs (neither silu keeps its output for backward): no fresh (E, H) buffer
        h = act(self.lin_up(x_kj)).add_(x_ji)
        for layer in self.layers_before_skip:
            h = layer(h, act)
        h = act(self.lin(h)).add_(x)
        for layer in self.layers_after_skip:
            h = layer(h, act)
        return h


class OutputPPBlock(nn.Module):
    """Edges -> own atoms (``edges_to_atoms``), then a per-atom MLP: (N_own, out)."""

    def __init__(self, c: DimeNetPPConfig, out_channels: int):
        super().__init__()
        self.lin_rbf = Linear(c.num_radial, c.hidden_channels, bias=False)
        self.lin_up = Linear(c.hidden_channels, c.out_emb_channels, bias=c.output_up_bias)
        self.lins = nn.ModuleList([Linear(c.out_emb_channels, c.out_emb_channels)
                                   for _ in range(c.num_output_layers)])
        self.lin = Linear(c.out_emb_channels, out_channels, bias=False)
        for lin in (self.lin_rbf, self.lin_up, *self.lins):
            _glorot_orthogonal(lin.weight)
            if lin.bias is not None and not lin.bias.is_meta:
                nn.init.zeros_(lin.bias)
        if not self.lin.weight.is_meta:
            nn.init.zeros_(self.lin.weight)  # PyG's DimeNet++ default output_initializer="zeros"

    def mlp(self, x: Tensor, act=silu) -> Tensor:
        """``lin(act(lins[-1](... act(lins[0](lin_up(x))))))``. ``lin_up`` has no activation, so where the rows
        outnumber its inputs (H) it and the layer after it are applied as one: ``W_1 W_up`` (O × H; bias
        ``b_1 + W_1 b_up``), built per call from the two parameters (state dict and gradients stay theirs).
        That is rows·O·O multiply-adds fewer forward and twice that backward, for O·O·H on the weights'
        side: 2 % of the products of an energy-only step at PyG's default sizes on 32 molecules (210 atom
        rows), and most of the direct force head's edge MLP (rows: edges). The same function, not the same
        rounding."""
        nxt = self.lins[0] if len(self.lins) else self.lin
        if x.shape[0] > x.shape[-1]:
            b = nxt.bias
            if self.lin_up.bias is not None:
                b = torch.mv(nxt.weight, self.lin_up.bias) if b is None else torch.addmv(b, nxt.weight, self.lin_up.bias)
            x = F.linear(x, nxt.weight @ self.lin_up.weight, b)
        else:
            x = nxt(self.lin_up(x))
        if not len(self.lins):
            return x
        x = act(x)
        for lin in self.lins[1:]:
            x = act(lin(x))
        return self.lin(x)

    def forward(self, x: Tensor, rbf: Tensor, g: AtomGraph, act=silu) -> Tensor:
        return self.mlp(g.edges_to_atoms(_narrow_linear(self.lin_rbf, rbf) * x), act)


# --------------------------------------------------------------------------- the model
class DimeNetPP(nn.Module):
    """DimeNet++: ``forward(g) -> (B,)`` energies of the batch's systems (see the module docstring)."""

    def __init__(self, cfg: DimeNetPPConfig):
        super().__init__()
        self.cfg = cfg
        self.rbf = BesselBasisLayer(cfg.num_radial, cfg.cutoff, cfg.envelope_exponent)
        self.sbf = SphericalBasisLayer(cfg.num_spherical, cfg.num_radial, cfg.cutoff, cfg.envelope_exponent)
        self.emb = EmbeddingBlock(cfg.num_radial, cfg.hidden_channels)
        self.output_blocks = nn.ModuleList([OutputPPBlock(cfg, cfg.out_channels) for _ in range(cfg.num_blocks + 1)])
        self.interaction_blocks = nn.ModuleList([InteractionPPBlock(cfg) for _ in range(cfg.num_blocks)])
        # direct forces: per-edge magnitudes from the last edge embeddings (not in PyG)
        self.force_block = OutputPPBlock(cfg, 1) if cfg.force_head == "direct" else None

    def __repr__(self) -> str:
        c = self.cfg
        return (f"DimeNetPP(hidden={c.hidden_channels}, blocks={c.num_blocks}, int_emb={c.int_emb_size}, "
                f"out_emb={c.out_emb_channels}, cutoff={c.cutoff}, forces={c.force_head})")

    def embed(self, g: AtomGraph) -> tuple[Tensor, Tensor, Tensor]:
        """Energies (B, out), final edge embeddings (E_loc, H) and the edge basis (E_loc, R)."""
        v = g.edge_vectors()  # (E_loc, 3)
        dist = v.norm(dim=-1)
        rbf = self.rbf(dist)  # (E_loc, R)
        tb = triplet_blocks(g, single=torch.compiler.is_compiling())
        v_kj = g.kj_vectors(tb.col_triplet)  # (ΣG·Ki, 3): PyG's pos_jk, from the view's geometry
        d_kj = v_kj.norm(dim=-1)
        u_ji = (v / dist.unsqueeze(-1))[tb.row_edge]  # (ΣG·Ro, 3): PyG's pos_ij, unit
        u_kj = v_kj / d_kj.unsqueeze(-1)
        cos = torch.cat([torch.bmm(u.view(gb, ro, 3), w.view(gb, ki, 3).transpose(1, 2)).flatten()  # cos of the angle
                         for (gb, ro, ki), u, w in zip(tb.shapes, u_ji.split(tb.sizes("rows")),
                                                       u_kj.split(tb.sizes("columns")))]
                        or [u_ji[:0, 0] + u_kj[:0, 0]])  # (ΣG·Ro·Ki,); no triplet: (0,), in the graph
        if not self.cfg.angle_gradient:  # fairchem's DimeNet++: angles of detached positions
            cos = cos.detach()
        rad = self.sbf.radial(d_kj).transpose(0, 1).contiguous()  # (S, ΣG·Ki, R)
        ang = (self.sbf.angular(cos) * tb.mask.unsqueeze(-1)).split(tb.sizes("entries"))  # per bucket (G·Ro·Ki, S)
        ang = [a.view(gb, ro, ki * a.shape[-1]) for (gb, ro, ki), a in zip(tb.shapes, ang)]  # (G, Ro, Ki·S)
        act = silu if _geometry_requires_grad(g) else F.silu
        x = self.emb(g.z, rbf, g.edge_dst, g.edge_src, act)
        p = self.output_blocks[0](x, rbf, g, act)  # (N_own, out)
        for k, inter in enumerate(self.interaction_blocks):  # (no output_blocks[1:]: a new ModuleList a call)
            x = inter(x, rbf, rad, ang, g, tb, act)
            p = p + self.output_blocks[k + 1](x, rbf, g, act)
        return g.sum_systems(p), x, rbf

    def forward(self, g: AtomGraph) -> Tensor:
        energy, _, _ = self.embed(g)
        return energy.squeeze(-1) if self.cfg.out_channels == 1 else energy


def energy_and_forces(model: DimeNetPP, g: AtomGraph, create_graph: bool) -> tuple[Tensor, Tensor]:
    """Energies (B,) and the forces on the own atoms (N_own, 3).

    ``gradient`` head: ``g.pos`` must require grad; ``-dE/dpos`` of this view's computation is
    a partial sum that ``g.sum_atoms`` completes (a reduce-scatter when sharded).
    ``create_graph=True`` keeps the graph for a loss on the forces (double backward).
    """
    if model.cfg.force_head == "direct":
        energy, x, rbf = model.embed(g)
        v = g.edge_vectors()
        mag = _narrow_linear(model.force_block.lin_rbf, rbf) * x  # (E_loc, H)
        mag = model.force_block.mlp(mag)  # (E_loc, 1): per-edge magnitude, along the edge
        forces = g.edges_to_atoms(mag * v / v.norm(dim=-1, keepdim=True))
        return energy.squeeze(-1), forces
    if not g.pos.requires_grad:
        raise ValueError("gradient forces need g.pos to require grad (parallel.with_pos)")
    energy = model(g)
    dpos, = torch.autograd.grad(energy.sum(), g.pos, create_graph=create_graph)
    return energy, -g.sum_atoms(dpos)


class DimeNetPPModel(DimeNetPP):
    """DimeNet++ on the atomic model protocol (``protocol.DIMENETPP``): the same module and state dict
    (PyG's names), ``forward(g) -> {"energy": (B,), "forces": (N_own, 3)}``; ``DimeNetPP.forward``
    keeps PyG's ``DimeNetPlusPlus`` interface (energies), which the parity test and benchmark use.
    ``forces=False``: ``{"energy"}`` alone, by the forward pass alone (energy-only training); with
    ``cfg.compile`` that forward is ``torch.compile``'d (dynamic shapes; built on the first call, kept
    out of the state dict) where the view is a whole batch (one graph way; data-parallel replicas too).
    Steps with forces stay eager (inductor has no double backward), and so do graph ways' views."""

    def forward(self, g: AtomGraph, forces: bool = True) -> dict:
        if not forces:  # energy only: no force head, no gradient with respect to positions
            return {"energy": self._energy_forward(g)(g)}
        if self.cfg.force_head == "direct":
            energy, f = energy_and_forces(self, g, create_graph=False)
            return {"energy": energy, "forces": f}
        return gradient_forces(super().forward, g, self.training)

    def _energy_forward(self, g: AtomGraph):
        """``DimeNetPP.forward`` bound to this model, compiled once if ``cfg.compile`` and ``g`` is a
        whole batch in one process (a graph way's view stays eager: its collectives are not traced)."""
        if not self.cfg.compile or type(g) is not AtomGraph:
            return super().forward
        if "_compiled" not in self.__dict__:  # a plain attribute: no parameters, no state
            self.__dict__["_compiled"] = _refusing(torch.compile(super().forward, dynamic=True))
        return self.__dict__["_compiled"]


def _refusing(compiled):
    """``compiled`` whose build failure (no C++ compiler for inductor, an unsupported platform) is one
    line naming the key, not torch's pages of traceback."""
    def call(g):
        try:
            return compiled(g)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None) or e
            first = next((line for line in str(inner).splitlines() if line.strip()), type(inner).__name__)
            raise GnnPipeError(f"dimenetpp.compile: torch.compile could not build the energy-only step "
                               f"({first.strip()[:200]}); set models.<name>.dimenetpp.compile: false, or "
                               "install a C++ compiler for inductor") from None
    return call


def count_parameters(cfg: DimeNetPPConfig) -> int:
    """Exact parameter count without allocating (the model built on the meta device)."""
    with torch.device("meta"):
        return sum(p.numel() for p in DimeNetPP(cfg).parameters())


def widths(cfg: DimeNetPPConfig) -> dict:
    """Per-row widths of the tensors the cost model and the byte ledger count."""
    return {"edge_gather": cfg.int_emb_size, "atom_reduce": cfg.hidden_channels,
            "triplet": cfg.int_emb_size + cfg.basis_emb_size + cfg.num_spherical * cfg.num_radial}


def halo_widths(cfg: DimeNetPPConfig) -> dict:
    """Row widths of the atoms layout's halo exchanges per interaction block (``atomic/halo.py``): the
    input messages only (I); no reverse edges, no atom embeddings."""
    return {"kj": cfg.int_emb_size, "swap": 0, "atoms": 0}


def config_fields() -> list[str]:
    return [f.name for f in fields(DimeNetPPConfig)]
