"""GemNet's building blocks (Gasteiger et al., 2021): bases, dense layers, scale factors, the
efficient bilinear triplet layer. Written from the paper and fairchem-core's ``models/gemnet``
(read, not copied); shapes as comments, ``E`` edges, ``T`` triplets, ``K`` the padded width.

* ``RadialBasis``: Gaussians on ``d/c`` (centres ``linspace(0, 1, R)``, width their spacing)
  times the polynomial envelope ``1 + a x^p + b x^(p+1) + c x^(p+2)`` (p = exponent; value,
  slope and curvature 0 at x = 1);
* ``CircularBasis``: the real spherical harmonics ``Y_l^0(cos φ) = sqrt((2l+1)/4π) P_l(cos φ)``,
  l < S;
* ``Dense``: bias-free linear layer, optionally followed by ``SiLU(x) / 0.6`` (unit variance
  under He-orthogonal weights); ``ResidualLayer``: ``(x + dense(dense(x))) / sqrt 2``;
* ``ScaleFactor``: a constant each activation is multiplied by, fitted once on one process
  (``fit_scale_factors``) and stored with the model as a *buffer* (``...scale_factor`` in the
  state dict, not a parameter: no gradient, nothing for the gradient all-reduce); 1 until fitted;
* ``EfficientBilinear``: GemNet's bilinear layer in its efficient (padded) order.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from typing import Iterable, Optional

import torch
from torch import Tensor, nn

from ..models import ops

INV_SQRT2 = 1 / math.sqrt(2.0)


def he_orthogonal_(w: Tensor) -> Tensor:
    """A (semi-)orthogonal matrix, standardised per output to mean 0 and variance ``1/fan_in``
    (fan_in: every dimension but the last for a 3-d weight, else the second)."""
    if w.is_meta:
        return w
    with torch.no_grad():
        nn.init.orthogonal_(w)
        fan_in = w.shape[:-1].numel() if w.dim() == 3 else w.shape[1]
        dims = [0, 1] if w.dim() == 3 else [1]
        var, mean = torch.var_mean(w, dim=dims, unbiased=True, keepdim=True)
        w.copy_((w - mean) / (var + 1e-6).sqrt() / math.sqrt(fan_in))
    return w


class ScaledSiLU(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.silu(x).mul_(1 / 0.6)


def _will_run(w: Tensor) -> bool:
    """Whether the backward pass now running reaches ``w``: a force pass (``autograd.grad`` into
    positions) does not need the weights' gradients. ``w`` must not be a leaf (the engine answers
    only for inner nodes under ``autograd.grad``): ``_DenseSiLU`` is given a view of its weight."""
    return torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(w).node)


#: below m·k·n of this, MKL's call is cheaper than oneDNN's set-up (~11 µs a call here)
_ONEDNN_MIN_MACS = 1 << 23


def _by_onednn(a: Tensor, b: Tensor) -> bool:
    """Whether ``a b`` goes to oneDNN (``ops.onednn_linear``): where ``ops.by_onednn`` allows it (float32
    rows on CPU), ``a`` row-major (activation rows: oneDNN was slower than MKL with a transposed ``a``, the
    weight gradients' ``g^T x``), large, and not recorded by autograd (that op has no derivative; a
    differentiable backward under ``create_graph`` takes addmm)."""
    return (ops.by_onednn(a, b) and a.is_contiguous()
            and a.shape[0] * a.shape[1] * b.shape[1] >= _ONEDNN_MIN_MACS
            and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)))


def _mm(a: Tensor, b: Tensor, alpha: float = 1.0, out: Optional[Tensor] = None) -> Tensor:
    """``alpha · a b`` for rows ``a`` times a weight-sized ``b``, the constant on the product (BLAS's alpha;
    beta = 0, so addmm's 0-d ``input`` is never read) or on ``b`` (oneDNN): no pass over the rows. Differentiable.

    In float32 on CPU outside autograd (:func:`_by_onednn`) it is oneDNN's product (as ``ops.linear``'s
    for the node models), not MKL's sgemm: GemNet's (rows, 512) x (512, 512) products ran 8-10 % faster
    alone (1 thread, AMD EPYC; 5-9 % for the 64- and 128-wide ones), a default-dT step 4 % faster; the
    same float32 product up to the order of its sums (tests/test_gemnet.py compares whole steps). The
    result is then a fresh tensor and ``out`` is not written: use the return value. float64 (the
    exactness checks), other devices and small products: ``addmm``."""
    if _by_onednn(a, b):
        return ops.onednn_linear(a, (b if alpha == 1.0 else b * alpha).t(), None)
    kw = {} if out is None else {"out": out}
    return torch.addmm(a.new_zeros(()), a, b, beta=0, alpha=alpha, **kw)


def _silu_grad(g: Tensor, z: Tensor) -> Tensor:
    """``g ⊙ SiLU'(z)``: ATen's fused kernel, or (when autograd records it, which that kernel does not
    allow) the formula ``SiLU'(z) = s (1 + z (1 - s))``, s = sigmoid(z)."""
    if torch.is_grad_enabled() and (g.requires_grad or z.requires_grad):
        s = torch.sigmoid(z)
        return g * (s * (1 + z * (1 - s)))
    return torch.ops.aten.silu_backward(g, z)


class _DenseSiLU(torch.autograd.Function):
    """``SiLU(x W^T) / 0.6`` (and the pre-activation ``z = x W^T``, a second output nobody reads: saved
    as an output, it carries the force pass's gradient in z back into this node), keeping ``x``, ``W``
    and ``z`` (what the linear layer and SiLU keep apart). Its point is the backward graph a force pass
    (``create_graph``) records: there ``dx = (g ⊙ SiLU'(z) / 0.6) W`` is one ``_DenseSiLUGrad`` node
    keeping ``g`` — not ``g / 0.6`` and ``g ⊙ SiLU'(z) / 0.6`` both, as the unfused ops do — and the
    weight gradient, which that pass does not reach, is not computed."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor):
        z = _mm(x, w.t())
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, w, z)
        return torch.nn.functional.silu(z).mul_(1 / 0.6), z

    @staticmethod
    def backward(ctx, g: Optional[Tensor], g_z: Optional[Tensor]):
        x, w, z = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and _will_run(w)
        if g is not None and g_z is None and torch.is_grad_enabled() and not need_w:  # a force pass
            return (_DenseSiLUGrad.apply(g, z, w) if need_x else None), None
        gz = _silu_grad(g * (1 / 0.6), z) if g is not None else None
        gz = g_z if gz is None else gz if g_z is None else gz + g_z
        if gz is None:
            return None, None
        return (_mm(gz, w) if need_x else None), (gz.t() @ x if need_w else None)


class _DenseSiLUGrad(torch.autograd.Function):
    """``(g ⊙ SiLU'(z) / 0.6) W``: ``_DenseSiLU``'s input gradient, keeping ``g, z, W`` (``z`` that node's
    saved output). Backward (the force loss's pass), for ``ĝ`` the gradient of the output and
    ``u = ĝ W^T / 0.6``: ``∂g = u ⊙ SiLU'(z)``, ``∂z = u ⊙ g ⊙ SiLU''(z)`` (into ``_DenseSiLU``'s z,
    which adds it to its own and runs one pair of products for x and W), ``∂W = (g ⊙ SiLU'(z)/0.6)^T ĝ``."""

    @staticmethod
    def forward(ctx, g: Tensor, z: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(g, z, w)
        return _mm(_silu_grad(g, z), w, 1 / 0.6)  # the constant on W: an (out, in) op, not a pass over the rows

    @staticmethod
    def backward(ctx, gg: Tensor):
        g, z, w = ctx.saved_tensors
        u = _mm(gg, w.t(), 1 / 0.6)
        d_g = _silu_grad(u, z) if ctx.needs_input_grad[0] else None
        d_z = None
        if ctx.needs_input_grad[1]:  # u ⊙ g ⊙ SiLU''(z), SiLU''(z) = s(1-s)(2 + z(1-2s)), s = sigmoid(z)
            s = torch.sigmoid(z)
            if torch.is_grad_enabled():  # differentiable (a third derivative)
                d_z = u * g * (s * (1 - s) * (2 + z * (1 - 2 * s)))
            else:  # the same products in place: 7 passes over the rows after sigmoid, no temporaries
                d_z = torch.addcmul(s, s, s, value=-1).mul_(torch.rsub(s, 1, alpha=2).mul_(z).add_(2)).mul_(u).mul_(g)
        d_w = (_silu_grad(g, z).t() @ gg) * (1 / 0.6) if ctx.needs_input_grad[2] else None
        return d_g, d_z, d_w


class _LinearSiLU(torch.autograd.Function):
    """``SiLU(x W^T) · k`` for one backward (GemNet-dT's Denses; k = 1/0.6, or that times a constant the
    caller folds in), keeping ``x``, ``W`` and ``z = x W^T`` (what the plain ops keep): backward makes
    ``g ⊙ SiLU'(z)`` once and puts ``k`` on its two products (the GEMM's alpha, ``_mm``) — two (rows, out)
    passes fewer than the plain ops' backward (their ``g · k`` and its buffer). Under ``create_graph`` it rebuilds ``z``
    from its inputs and differentiates the plain formula, so higher derivatives are right too."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, k: float = 1 / 0.6) -> Tensor:
        z = _mm(x, w.t())
        ctx.save_for_backward(x, w, z)
        ctx.k = k
        return torch.nn.functional.silu(z).mul_(k)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, w, z = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        k = ctx.k
        if torch.is_grad_enabled():
            z = torch.nn.functional.linear(x, w)
        gz = _silu_grad(g, z)
        if gz.shape[0] <= w.shape[1] and not torch.is_grad_enabled():  # few rows: k on gz, in place
            gz.mul_(k)
            return (gz @ w if need_x else None), (gz.t() @ x if need_w else None), None
        return (_mm(gz, w, k) if need_x else None), (_mm(gz.t(), x, k) if need_w else None), None


class _EdgeDenseSiLU(torch.autograd.Function):
    """GemNet-dT's edge embedding ``SiLU([h_src, h_dst, x] W^T) / 0.6`` as one node: ``z = (h W_s^T)[src]
    + (h W_d^T)[dst] + x W_x^T`` (the atom halves projected on the N atom rows), the two gathered rows
    summed by one ``embedding_bag`` into z's buffer and the edge half added there by ``addmm_``; it keeps
    ``h, x, W, z``. Against the plain ops (two gathers, two sums, an activation and its 1/0.6, the weight
    sliced three ways and concatenated): 4 passes over the (E, out) rows fewer forward, 1 backward, no
    accumulating ``index_put`` (its gathers' adjoint: two ``index_add_`` here) and one (out, 2A + F)
    weight gradient, not three zero-padded slices summed. Under ``create_graph`` it rebuilds ``z``
    differentiably, so higher derivatives are right too."""

    @staticmethod
    def forward(ctx, h: Tensor, x: Tensor, w: Tensor, src: Tensor, dst: Tensor) -> Tensor:
        a = h.shape[1]
        hw = torch.stack([h @ w[:, :a].t(), h @ w[:, a:2 * a].t()], 1).view(2 * h.shape[0], -1)  # (2N, out)
        rows = torch.stack([2 * src, 2 * dst + 1], 1)  # (E, 2): each edge's source and target rows of hw
        z = torch.nn.functional.embedding_bag(rows, hw, mode="sum").addmm_(x, w[:, 2 * a:].t())
        ctx.save_for_backward(h, x, w, z, rows)
        return torch.nn.functional.silu(z).mul_(1 / 0.6)

    @staticmethod
    def backward(ctx, g: Tensor):
        h, x, w, z, rows = ctx.saved_tensors
        need_h, need_x, need_w = ctx.needs_input_grad[:3]
        a, k = h.shape[1], 1 / 0.6
        ws, wd, wx = w[:, :a], w[:, a:2 * a], w[:, 2 * a:]
        if torch.is_grad_enabled():
            z = (h @ ws.t())[rows[:, 0] // 2] + (h @ wd.t())[rows[:, 1] // 2] + x @ wx.t()
        gz = _silu_grad(g, z)
        d_x = _mm(gz, wx, k) if need_x else None
        d_h = d_w = None
        if need_h or need_w:
            ghw = gz.new_zeros((2 * h.shape[0], gz.shape[1])).index_add(0, rows[:, 0], gz).index_add(0, rows[:, 1], gz)
            ghw = (ghw * k).view(h.shape[0], 2, -1)  # (N, 2, out): the atom rows' gradients
            gs, gd = ghw[:, 0], ghw[:, 1]
            d_h = gs @ ws + gd @ wd if need_h else None
            d_w = torch.cat([gs.t() @ h, gd.t() @ h, _mm(gz.t(), x, k)], 1) if need_w else None
        return d_h, d_x, d_w, None, None


class Dense(nn.Module):
    """``act(x W^T)``, no bias; ``act`` = scaled SiLU or the identity. ``fused`` (set by GemNet-T, whose
    forces are a gradient): with the activation, one ``_DenseSiLU`` — the same values, a smaller force-pass
    graph; a model with one backward (dT) runs ``_LinearSiLU``, which is faster there."""

    def __init__(self, fan_in: int, fan_out: int, activation: bool = True):
        super().__init__()
        self.linear = nn.Linear(fan_in, fan_out, bias=False)
        self.act = ScaledSiLU() if activation else nn.Identity()
        self.fused = False
        he_orthogonal_(self.linear.weight)

    def forward(self, x: Tensor, scale: float = 1.0) -> Tensor:
        """``act(x W^T) · scale``: a constant the caller would multiply the output by rides on ``_LinearSiLU``'s
        1/0.6 (no pass over the rows, none for its gradient); the other paths multiply."""
        if self.fused and isinstance(self.act, ScaledSiLU):
            w = self.linear.weight
            y = _DenseSiLU.apply(x, w.view_as(w) if w.requires_grad else w)[0]  # a view: see _will_run
        elif isinstance(self.act, ScaledSiLU):
            return _LinearSiLU.apply(x, self.linear.weight, scale / 0.6)
        else:
            y = self.linear(x)
        return y if scale == 1.0 else y * scale


class _SiLULinear(torch.autograd.Function):
    """``(SiLU(z) / 0.6) W^T`` keeping ``z`` and ``W`` for backward, not ``SiLU(z) / 0.6``: backward
    recomputes the activation (elementwise) instead of autograd keeping a second (rows, in) tensor.
    Its backward is plain differentiable torch ops, so a second derivative is right too."""

    @staticmethod
    def forward(ctx, z: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(z, w)
        return torch.nn.functional.linear(torch.nn.functional.silu(z) * (1 / 0.6), w)

    @staticmethod
    def backward(ctx, g: Tensor):
        z, w = ctx.saved_tensors
        gz = _silu_grad((g @ w) * (1 / 0.6), z) if ctx.needs_input_grad[0] else None
        gw = g.t() @ (torch.nn.functional.silu(z) * (1 / 0.6)) if ctx.needs_input_grad[1] else None
        return gz, gw


class _ResidualSiLU(torch.autograd.Function):
    """A two-Dense residual layer ``(x + SiLU(SiLU(x W1^T)/0.6 · W2^T)/0.6)/√2`` as one node keeping
    ``x``, ``z1 = x W1^T`` and ``z2`` (what ``_SiLULinear`` and the plain ops keep): the constants ride
    on the products (``1/0.6`` on z2's forward; ``1/0.6²√2`` on W2's and z1's backward: the GEMM's alpha,
    ``_mm``, not (rows, units) passes nor scaled weight copies), so backward runs 4 elementwise passes over
    the rows (two SiLU derivatives, the inner activation recomputed, the skip connection's gradient added)
    where the plain ops and ``_SiLULinear`` run 8. Forward and (one backward) backward write their rows into buffers they
    made and have read (2 and 2 (rows, units) allocations, not 4 and 5): fresh buffers cost page faults
    and cache misses that showed as ~2 % of a GemNet-dT step. That holds where ``_mm`` is ``addmm``; where
    it is oneDNN's (large float32 products on CPU) the products come back in fresh tensors, which measured
    faster than MKL into the reused buffers (a default-dT step 0.99). Same values up to rounding; under
    ``create_graph`` its backward rebuilds z1 and z2 by differentiable torch ops, so a second
    derivative is right too (at two GEMMs more)."""

    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
        z1 = _mm(x, w1.t())
        a = torch.nn.functional.silu(z1)
        z2 = _mm(a, w2.t(), 1 / 0.6)
        ctx.save_for_backward(x, w1, w2, z1, z2)
        a = torch.ops.aten.silu.out(z2, out=a)  # a read: the output is made in its buffer
        return torch.add(x, a, alpha=1 / 0.6, out=a).mul_(INV_SQRT2)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, w1, w2, z1, z2 = ctx.saved_tensors
        need_x, need_w1, need_w2 = ctx.needs_input_grad
        if torch.is_grad_enabled():  # a differentiable backward: z1, z2 rebuilt from the inputs, with their graph
            z1 = torch.nn.functional.linear(x, w1)
            z2 = torch.nn.functional.linear(torch.nn.functional.silu(z1), w2 * (1 / 0.6))
        k = INV_SQRT2 / 0.6 ** 2  # out = x/√2 + SiLU(z2)/(0.6√2), z2 = SiLU(z1) W2^T / 0.6
        h2 = _silu_grad(g, z2)  # ∂out/∂z2 = h2 / (0.6√2)
        if not torch.is_grad_enabled() and need_x and need_w1 and need_w2:  # the usual case, in two row buffers
            a1 = torch.nn.functional.silu(z1)
            d_w2 = _mm(h2.t(), a1, k)
            d_z1 = _mm(h2, w2, k, out=a1)  # a1 read: its buffer takes h2 W2 k (addmm), then d_z1 in place
            torch.ops.aten.silu_backward.grad_input(d_z1, z1, grad_input=d_z1)
            d_w1 = d_z1.t() @ x
            return _mm(d_z1, w1, out=h2).add_(g, alpha=INV_SQRT2), d_w1, d_w2  # h2 read: d_x in its buffer (addmm)
        d_w2 = (h2.t() @ torch.nn.functional.silu(z1)) * k if need_w2 else None
        d_x = d_w1 = None
        if need_x or need_w1:
            d_z1 = _silu_grad(h2 @ (w2 * k), z1)
            d_w1 = d_z1.t() @ x if need_w1 else None
            d_x = torch.addmm(g, d_z1, w1, beta=INV_SQRT2) if need_x else None
        return d_x, d_w1, d_w2


class ResidualLayer(nn.Module):
    """``(x + Dense(Dense(x))) / sqrt 2``.

    ``recompute``: each inner Dense's activation is recomputed in backward from its input
    (``_ResidualSiLU`` for the usual two Dense, else ``_SiLULinear``) rather than kept — one (rows,
    units) tensor less per inner pair, same values.
    Worth it for one backward (direct forces); under a double backward (gradient forces) the force
    pass would also compute the weight gradient it does not need, so GemNet-T leaves it off."""

    def __init__(self, units: int, layers: int = 2, recompute: bool = False):
        super().__init__()
        self.mlp = nn.Sequential(*[Dense(units, units) for _ in range(layers)])
        self.recompute = recompute

    def forward(self, x: Tensor) -> Tensor:
        if not self.recompute:
            return (x + self.mlp(x)).mul_(INV_SQRT2)
        if len(self.mlp) == 2:
            return _ResidualSiLU.apply(x, self.mlp[0].linear.weight, self.mlp[1].linear.weight)
        z = self.mlp[0].linear(x)
        for dense in self.mlp[1:]:
            z = _SiLULinear.apply(z, dense.linear.weight)
        return (x + self.mlp[-1].act(z)).mul_(INV_SQRT2)


def mlp(fan_in: int, units: int, residual_layers: int, recompute: bool = False) -> nn.Sequential:
    """Dense(fan_in -> units) then ``residual_layers`` residual layers (atom and force heads)."""
    return nn.Sequential(Dense(fan_in, units), *[ResidualLayer(units, recompute=recompute)
                                                 for _ in range(residual_layers)])


# --------------------------------------------------------------------------- scale factors
class ScaleFactor(nn.Module):
    """``x * s`` with a fitted constant ``s`` (a buffer; 1 until ``fit_scale_factors``).

    While fitting, each call accumulates the variance of its output and of ``ref`` (its
    input's scale); ``s = sqrt(Var[ref] / Var[x])`` then makes the output's variance the
    reference's. Variances are per feature over the rows (unbiased), averaged over features,
    weighted by rows across batches (fairchem's statistic).
    """

    def __init__(self):
        super().__init__()
        self.register_buffer("scale_factor", torch.tensor(1.0))
        self._stats: list[float] | None = None  # [Σ n·Var(ref), Σ n·Var(x), Σ n] while fitting
        self._seen: list | None = None  # execution order while tracing

    @property
    def fitting(self) -> bool:
        """Whether ``fit_scale_factors`` is fitting this factor now (the only time ``ref`` is read)."""
        return self._stats is not None

    @property
    def foldable(self) -> bool:
        """Whether a caller may fold ``s`` into a neighbouring linear op instead of calling this module
        (not while ``fit_scale_factors`` traces or fits: it reads the calls)."""
        return self._stats is None and self._seen is None

    def value(self, dtype) -> Tensor:
        """``s`` in ``dtype``: what :meth:`forward` multiplies by, and what a fold puts on a weight."""
        return self.scale_factor.to(dtype)

    def forward(self, x: Tensor, ref: Tensor) -> Tensor:
        x = x * self.value(x.dtype)
        if self._seen is not None and self not in self._seen:
            self._seen.append(self)
        if self._stats is not None and x.shape[0] > 1 and ref.shape[0] > 1:
            with torch.no_grad():
                n = x.shape[0]
                self._stats[0] += float(ref.var(dim=0).mean()) * n
                self._stats[1] += float(x.var(dim=0).mean()) * n
                self._stats[2] += n
        return x


def fit_scale_factors(model: nn.Module, graphs: Iterable, forward=None) -> dict[str, float]:
    """Fit every ``ScaleFactor`` of ``model`` in execution order, each with the earlier ones
    fitted (fairchem's procedure), on whole batches in **one process**; returns name -> value.

    ``forward(g)`` runs the part of the model that holds the factors (default
    ``model.embed``), without gradients. Under graph parallelism the fitted buffers are just
    loaded (the state dict), so every layout computes with the same constants.
    """
    graphs = list(graphs)
    for g in graphs:
        if g.num_local_edges != g.num_edges or g.atom_lo != 0 or g.atom_hi != g.num_atoms:
            raise ValueError("fit_scale_factors runs on whole batches in one process, not on a shard: "
                             "fit once, then load the state dict on every rank")
    forward = forward or model.embed
    factors = {name: m for name, m in model.named_modules() if isinstance(m, ScaleFactor)}
    names = {m: name for name, m in factors.items()}
    for m in factors.values():
        m.scale_factor.fill_(1.0)
    seen: list = []
    with _setting(factors.values(), "_seen", seen), torch.no_grad():
        forward(graphs[0])
    order = seen + [m for m in factors.values() if m not in seen]
    out = {}
    for m in order:
        stats = [0.0, 0.0, 0]
        with _setting([m], "_stats", stats), torch.no_grad():
            for g in graphs:
                forward(g)
        if stats[2] == 0 or stats[1] <= 0:  # never ran on > 1 row (e.g. no triplets): leave it 1
            out[names[m]] = 1.0
            continue
        m.scale_factor.fill_(math.sqrt(stats[0] / stats[1]))
        out[names[m]] = float(m.scale_factor)
    return out


@contextmanager
def _setting(modules, attr: str, value):
    modules = list(modules)
    for m in modules:
        setattr(m, attr, value)
    try:
        yield
    finally:
        for m in modules:
            setattr(m, attr, None)


# --------------------------------------------------------------------------- bases
class PolynomialEnvelope(nn.Module):
    """``u(x) = 1 + a x^p + b x^(p+1) + c x^(p+2)`` for x < 1, else 0: u(0) = 1, and u, u', u''
    vanish at x = 1."""

    def __init__(self, exponent: int):
        super().__init__()
        if exponent < 1:
            raise ValueError(f"envelope exponent must be >= 1, got {exponent}")
        p = float(exponent)
        self.p, self.a, self.b, self.c = p, -(p + 1) * (p + 2) / 2, p * (p + 2), -p * (p + 1) / 2

    def forward(self, x: Tensor) -> Tensor:
        xp = x.pow(self.p)
        u = 1 + self.a * xp + self.b * xp * x + self.c * xp * x * x
        return torch.where(x < 1, u, torch.zeros_like(x))


class RadialBasis(nn.Module):
    """(E,) distances -> (E, R): ``u(d/c) · exp(-(d/c - μ_n)² / (2 Δ²))``, ``μ = linspace(0, 1, R)``,
    ``Δ`` their spacing (no parameters). ``centres`` ``float32``: μ rounded to float32 and Δ their
    float32 spacing, the numbers of an imported fairchem model (``GemNetTConfig.gaussian_centres``:
    its float64 forward still reads its checkpoint's float32 centres; in float64 they move energies
    by up to 1e-5 relative at R = 128)."""

    def __init__(self, num_radial: int, cutoff: float, envelope_exponent: int, centres: str = "float64"):
        super().__init__()
        self.cutoff = float(cutoff)
        self.envelope = PolynomialEnvelope(envelope_exponent)
        dtype = getattr(torch, centres)
        self.register_buffer("centres", torch.linspace(0, 1, num_radial, dtype=dtype).to(torch.float64), persistent=False)
        mu = torch.linspace(0, 1, num_radial, dtype=dtype, device="cpu")  # a number, also for a model on meta
        self.gamma = 0.5 / float(mu[1] - mu[0]) ** 2 if num_radial > 1 else 0.5

    def forward(self, d: Tensor) -> Tensor:
        x = d / self.cutoff
        gauss = torch.exp(-self.gamma * (x.unsqueeze(-1) - self.centres.to(x.dtype)) ** 2)
        return self.envelope(x).unsqueeze(-1) * gauss


class CircularBasis(nn.Module):
    """(T,) cos φ -> (T, S): ``Y_l^0 = sqrt((2l+1)/4π) P_l(cos φ)``, l = 0..S-1 (Bonnet's recurrence)."""

    def __init__(self, num_spherical: int):
        super().__init__()
        self.num_spherical = num_spherical
        self.register_buffer("pref", torch.tensor([math.sqrt((2 * l + 1) / (4 * math.pi))
                                                   for l in range(num_spherical)], dtype=torch.float64),
                             persistent=False)

    def forward(self, cos: Tensor) -> Tensor:
        leg = [torch.ones_like(cos), cos]
        for l in range(2, self.num_spherical):
            leg.append(((2 * l - 1) * cos * leg[l - 1] - (l - 1) * leg[l - 2]) / l)
        return torch.stack(leg[:self.num_spherical], -1) * self.pref.to(cos.dtype)


# --------------------------------------------------------------------------- efficient bilinear
class CircularDown(nn.Module):
    """The radial half of the circular basis, projected per output edge: (E, R) -> (E, C, S)
    with one weight (S, R, C) (fairchem's ``EfficientInteractionDownProjection``)."""

    def __init__(self, num_spherical: int, num_radial: int, emb_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_spherical, num_radial, emb_size))
        he_orthogonal_(self.weight)

    def forward(self, rbf: Tensor) -> Tensor:
        return torch.einsum("er,src->ecs", rbf, self.weight)  # (E, C, S)


def pad_triplets(x: Tensor, idx_ji: Tensor, rank: Tensor, num_edges: int) -> Tensor:
    """(T, w) per triplet -> (E, K, w) zero-padded per output edge, K = max rank + 1."""
    k = int(rank.max()) + 1 if rank.numel() else 0
    out = x.new_zeros((num_edges, k, *x.shape[1:]))
    return out.index_put((idx_ji, rank), x)


def triplet_slots(idx_kj: Tensor, idx_ji: Tensor, rank: Tensor, num_edges: int) -> Tensor:
    """(E, K): 1 + the input edge row of each output edge's k-th triplet, 0 where it has fewer
    (``EfficientBilinear`` reads its padded input rows by it in one gather: row 0 is zeros)."""
    k = int(rank.max()) + 1 if rank.numel() else 0
    slots = idx_kj.new_zeros((num_edges, k))
    slots[idx_ji, rank] = idx_kj + 1
    return slots


class TripletRows:
    """The padded read of the triplets' input rows, ``(rows, w) -> (E·K, w)`` by ``triplet_slots``
    (row 0 of ``[0; x]`` where an edge has fewer than K triplets), and its adjoint, the sum of each
    slot's gradient into the row it read. Both are one pass each (``_PaddedGather``: ``index_select``;
    ``_PaddedScatter``: ``embedding_bag`` over each row's readers, grouped by one stable sort of the
    slots made once per forward and shared by every block) — not autograd's ``index`` and its
    accumulating ``index_put`` (several times slower on CPU). Each is the other's backward, so a
    double backward (GemNet-T) runs them too."""

    def __init__(self, slots: Tensor):
        self.slots = slots
        self.flat = slots.reshape(-1)
        self._bags: dict[int, tuple[Tensor, Tensor]] = {}

    def bags(self, rows: int) -> tuple[Tensor, Tensor]:
        """(positions of the filled slots grouped by the row they read, each row's first position)."""
        if rows not in self._bags:
            order = torch.argsort(self.flat, stable=True)
            counts = torch.bincount(self.flat, minlength=rows + 1)
            self._bags[rows] = (order[int(counts[0]):], torch.cumsum(counts[1:], 0) - counts[1:])
        return self._bags[rows]

    def gather(self, x: Tensor) -> Tensor:
        """(rows, w) -> (E, K, w)."""
        return _PaddedGather.apply(x, self).view(*self.slots.shape, x.shape[1])


class _PaddedGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, plan: TripletRows) -> Tensor:
        ctx.plan, ctx.rows = plan, x.shape[0]
        return torch.cat([x.new_zeros((1, x.shape[1])), x]).index_select(0, plan.flat)

    @staticmethod
    def backward(ctx, g: Tensor):
        return _PaddedScatter.apply(g, ctx.plan, ctx.rows), None


class _PaddedScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: Tensor, plan: TripletRows, rows: int) -> Tensor:
        ctx.plan = plan
        pos, first = plan.bags(rows)
        return torch.nn.functional.embedding_bag(pos, g.reshape(-1, g.shape[-1]), first, mode="sum")

    @staticmethod
    def backward(ctx, gg: Tensor):
        return _PaddedGather.apply(gg, ctx.plan), None, None


class TripletSum:
    """``Σ_k Y[e, k, s] x[slot(e, k), i]`` — the triplet sum of ``EfficientBilinear`` — as one sparse
    product ``A x`` for an angular basis ``Y`` that needs no gradient (GemNet-dT's step, any energy-only
    step: the positions need none), and its adjoint ``A^T g``: ``A`` is (E·S, rows) in CSR, row
    ``(e, s)`` holding ``Y[e, k, s]`` at column ``slot(e, k)`` for each of the K slots (empty slots: 0
    at column 0), ``A^T`` its transpose (T·S entries, grouped by the input row as ``TripletRows.bags``).
    Each is built at most once per forward (per row count; ``A^T`` only when a backward runs) and
    shared by every block; no padded (E, K, I) input messages are gathered, kept or scattered back
    (what the padded gather and ``_SlotSum`` do).
    Same sums, in another order (float64: to rounding)."""

    def __init__(self, sph_p: Tensor, rows: TripletRows):
        self.y = sph_p.detach().contiguous()  # (E, S, K): A's values in row order
        self.rows = rows
        self._mats: dict[tuple[int, bool], Tensor] = {}

    def matrix(self, rows: int, adjoint: bool = False) -> Tensor:
        """``A`` (or, ``adjoint``, ``A^T``) for ``rows`` input rows, int32 indices, each built on its first
        use: a forward that is never differentiated (inference, no_grad) builds no ``A^T``."""
        if (rows, adjoint) not in self._mats:
            e, s, k = self.y.shape
            idx = torch.int32
            if not adjoint:
                col = (self.rows.slots - 1).clamp_(min=0).to(idx)  # (E, K): slot -> input row (empty: row 0, value 0)
                m = _csr(torch.arange(e * s + 1, dtype=idx) * k, col[:, None, :].expand(e, s, k).reshape(-1),
                         self.y.reshape(-1), (e * s, rows))
            else:
                pos, first = self.rows.bags(rows)  # filled slots e·K + k grouped by the row they read
                counts = torch.diff(first, append=first.new_tensor([pos.numel()]))
                col_t = ((pos // max(k, 1))[:, None] * s + torch.arange(s)).reshape(-1).to(idx)
                val_t = self.y.transpose(1, 2).reshape(e * k, s).index_select(0, pos).reshape(-1)
                crow_t = torch.cat([counts.new_zeros(1), (counts * s).cumsum(0)]).to(idx)
                m = _csr(crow_t, col_t, val_t, (rows, e * s))
            self._mats[rows, adjoint] = m
        return self._mats[rows, adjoint]

    def __call__(self, x: Tensor) -> Tensor:
        """(rows, I) input rows -> (E, S, I)."""
        e, s, _ = self.y.shape
        return _SparseSum.apply(x, self).view(e, s, x.shape[1])


def _csr(crow: Tensor, col: Tensor, val: Tensor, size: tuple) -> Tensor:
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state": products are all it is used for
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support")
        return torch.sparse_csr_tensor(crow, col, val, size, check_invariants=False)


class _SparseSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, plan: TripletSum) -> Tensor:
        ctx.plan, ctx.rows = plan, x.shape[0]
        return plan.matrix(x.shape[0]) @ x

    @staticmethod
    def backward(ctx, g: Tensor):
        return _SparseSumT.apply(g.reshape(-1, g.shape[-1]), ctx.plan, ctx.rows), None


class _SparseSumT(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: Tensor, plan: TripletSum, rows: int) -> Tensor:
        ctx.plan = plan
        return plan.matrix(rows, adjoint=True) @ g

    @staticmethod
    def backward(ctx, gg: Tensor):
        return _SparseSum.apply(gg, ctx.plan), None, None


class _SlotSum(torch.autograd.Function):
    """``Σ_k Y[e, k, s] x[e, k, i]`` for Y (E, K, S), x (E, K, I) -> (E, S, I), and its derivatives
    ``dY = x g^T``, ``dx = Y g``, each product made in the order MKL's batched GEMM runs fast: an (E, K, S)
    result with S columns is made as its (E, S, K) transpose (several times faster), every (E, K, ·)
    gradient contiguous. Autograd's own ``bmm`` backward does neither, and in a double backward (GemNet-T)
    hands the padded input messages their gradient as a transposed (E, I, K) view, added and copied
    strided. The force pass's gradient is one ``_SlotSumGrad`` node (differentiable once more)."""

    @staticmethod
    def forward(ctx, y: Tensor, x: Tensor) -> Tensor:
        need_y, need_x = ctx.needs_input_grad
        ctx.save_for_backward(y if need_x else None, x if need_y else None)  # dY reads x, dx reads Y
        return torch.bmm(y.transpose(1, 2), x)

    @staticmethod
    def backward(ctx, g: Tensor):
        y, x = ctx.saved_tensors
        need_y, need_x = ctx.needs_input_grad
        if need_y and need_x:
            dy_t, dx = _SlotSumGrad.apply(y, x, g)
            return dy_t.transpose(1, 2), dx
        return (torch.bmm(g, x.transpose(1, 2)).transpose(1, 2) if need_y else None,
                torch.bmm(y, g) if need_x else None)


class _SlotSumGrad(torch.autograd.Function):
    """``(g x^T, Y g)``: ``_SlotSum``'s derivatives (the first as (E, S, K)), and their own derivatives
    in the same layouts (the force loss's pass of a double backward)."""

    @staticmethod
    def forward(ctx, y: Tensor, x: Tensor, g: Tensor):
        ctx.save_for_backward(y, x, g)
        ctx.set_materialize_grads(False)
        return torch.bmm(g, x.transpose(1, 2)), torch.bmm(y, g)

    @staticmethod
    def backward(ctx, a: Optional[Tensor], b: Optional[Tensor]):
        y, x, g = ctx.saved_tensors
        need_y, need_x, need_g = ctx.needs_input_grad
        d_y = torch.bmm(g, b.transpose(1, 2)).transpose(1, 2) if need_y and b is not None else None
        d_x = torch.bmm(a.transpose(1, 2), g) if need_x and a is not None else None
        d_g = None
        if need_g:
            d_g = torch.bmm(a, x) if a is not None else None
            if b is not None:
                d_g = torch.bmm(y.transpose(1, 2), b) if d_g is None else d_g.baddbmm_(y.transpose(1, 2), b)
        return d_y, d_x, d_g


class EfficientBilinear(nn.Module):
    """Σ over an output edge's triplets of a bilinear form, in the efficient order.

    For output edge e with triplets τ (input message ``x_τ`` (I,), angular basis ``Y_τ`` (S,))
    and the edge's radial projection ``r_e`` (C, S)::

        out[e, o] = Σ_τ Σ_{s, c, i} r_e[c, s] · Y_τ[s] · x_τ[i] · W[i, c, o]

    computed as ``Σ_τ Y_τ ⊗ x_τ`` first (one padded (E, S, K) @ (E, K, I) product), then the
    radial projection and W, so no (T, C, ·) tensor is ever formed. The angular basis comes
    padded (built once per forward and shared by every block, as fairchem does), the input
    messages as edge rows, padded here by one gather through ``TripletRows`` (no (T, I) copy).
    """

    def __init__(self, emb_in: int, emb_cbf: int, emb_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(emb_in, emb_cbf, emb_out))  # (I, C, O)
        he_orthogonal_(self.weight)

    def forward(self, rad: Tensor, sph_p: Tensor, x: Tensor, slots) -> Tensor:
        # rad (E, C, S), sph_p (E, S, K) per output edge; x (rows, I) the input edges' rows;
        # slots: a TripletRows (or its (E, K) slots into [0; x]), or a TripletSum of sph_p -> (E, O)
        if isinstance(slots, TripletSum):  # Y needs no gradient: one sparse product, no padded rows
            sum_k = slots(x)  # (E, S, I)
        else:
            rows = slots if isinstance(slots, TripletRows) else TripletRows(slots)
            x_p = rows.gather(x)  # (E, K, I)
            sum_k = _SlotSum.apply(sph_p.transpose(1, 2), x_p)  # (E, S, I)
        rs = torch.bmm(rad, sum_k)  # (E, C, I)
        return torch.einsum("eci,ico->eo", rs, self.weight)
