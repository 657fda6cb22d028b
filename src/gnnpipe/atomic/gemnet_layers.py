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
from contextlib import contextmanager
from typing import Iterable

import torch
from torch import Tensor, nn

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
        return torch.nn.functional.silu(x) * (1 / 0.6)


class Dense(nn.Module):
    """``act(x W^T)``, no bias; ``act`` = scaled SiLU or the identity."""

    def __init__(self, fan_in: int, fan_out: int, activation: bool = True):
        super().__init__()
        self.linear = nn.Linear(fan_in, fan_out, bias=False)
        self.act = ScaledSiLU() if activation else nn.Identity()
        he_orthogonal_(self.linear.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.linear(x))


class ResidualLayer(nn.Module):
    """``(x + Dense(Dense(x))) / sqrt 2``."""

    def __init__(self, units: int, layers: int = 2):
        super().__init__()
        self.mlp = nn.Sequential(*[Dense(units, units) for _ in range(layers)])

    def forward(self, x: Tensor) -> Tensor:
        return (x + self.mlp(x)) * INV_SQRT2


def mlp(fan_in: int, units: int, residual_layers: int) -> nn.Sequential:
    """Dense(fan_in -> units) then ``residual_layers`` residual layers (atom and force heads)."""
    return nn.Sequential(Dense(fan_in, units), *[ResidualLayer(units) for _ in range(residual_layers)])


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

    def forward(self, x: Tensor, ref: Tensor) -> Tensor:
        x = x * self.scale_factor.to(x.dtype)
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
    ``Δ`` their spacing (no parameters)."""

    def __init__(self, num_radial: int, cutoff: float, envelope_exponent: int):
        super().__init__()
        self.cutoff = float(cutoff)
        self.envelope = PolynomialEnvelope(envelope_exponent)
        self.register_buffer("centres", torch.linspace(0, 1, num_radial, dtype=torch.float64), persistent=False)
        self.gamma = 0.5 / (1.0 / (num_radial - 1)) ** 2 if num_radial > 1 else 0.5

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


class EfficientBilinear(nn.Module):
    """Σ over an output edge's triplets of a bilinear form, in the efficient order.

    For output edge e with triplets τ (input message ``x_τ`` (I,), angular basis ``Y_τ`` (S,))
    and the edge's radial projection ``r_e`` (C, S)::

        out[e, o] = Σ_τ Σ_{s, c, i} r_e[c, s] · Y_τ[s] · x_τ[i] · W[i, c, o]

    computed as ``Σ_τ Y_τ ⊗ x_τ`` first (one padded (E, S, K) @ (E, K, I) product), then the
    radial projection and W, so no (T, C, ·) tensor is ever formed. The angular basis comes
    padded (built once per forward and shared by every block, as fairchem does), the input
    messages as edge rows, padded here by one gather through ``triplet_slots`` (no (T, I) copy).
    """

    def __init__(self, emb_in: int, emb_cbf: int, emb_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(emb_in, emb_cbf, emb_out))  # (I, C, O)
        he_orthogonal_(self.weight)

    def forward(self, rad: Tensor, sph_p: Tensor, x: Tensor, slots: Tensor) -> Tensor:
        # rad (E, C, S), sph_p (E, S, K) per output edge; x (rows, I) the input edges' rows;
        # slots (E, K) into [0; x] -> (E, O)
        e, k = slots.shape
        x_p = torch.cat([x.new_zeros((1, x.shape[1])), x])[slots.reshape(-1)].view(e, k, x.shape[1])  # (E, K, I)
        sum_k = torch.bmm(sph_p, x_p)  # (E, S, I)
        rs = torch.bmm(rad, sum_k)  # (E, C, I)
        return torch.einsum("eci,ico->eo", rs, self.weight)
