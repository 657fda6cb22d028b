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

Forces: ``energy_and_forces`` — ``"gradient"`` (energy-conserving, ``-dE/dpos`` by autograd;
``create_graph=True`` for training on forces) or ``"direct"`` (an extra edge head:
per-edge magnitudes times unit edge vectors, summed into atoms).

The spherical Bessel zeros are rounded to float32 as in the reference implementation
(DimeNet's and PyG's ``Jn_zeros``), so that the bases agree with PyG to rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn import Embedding, Linear

from .batch import AtomGraph


@dataclass
class DimeNetPPConfig:
    """Sizes of a DimeNet++ (defaults: PyG's ``DimeNetPlusPlus``)."""

    hidden_channels: int = 128
    out_channels: int = 1
    num_blocks: int = 4
    int_emb_size: int = 64  # width of the triplet messages (what is all-gathered per block)
    basis_emb_size: int = 8
    out_emb_channels: int = 256
    num_spherical: int = 7
    num_radial: int = 6
    cutoff: float = 5.0
    envelope_exponent: int = 5
    num_before_skip: int = 1
    num_after_skip: int = 2
    num_output_layers: int = 3
    force_head: Literal["gradient", "direct"] = "gradient"


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


def spherical_jn(order_max: int, x: Tensor) -> list[Tensor]:
    """[j_0(x), ..., j_{order_max-1}(x)] by upward recurrence ``j_{l+1} = (2l+1)/x j_l - j_{l-1}``."""
    s, c = torch.sin(x), torch.cos(x)
    out = [s / x]
    if order_max > 1:
        out.append(s / x.pow(2) - c / x)
    for l in range(1, order_max - 1):
        out.append((2 * l + 1) / x * out[l] - out[l - 1])
    return out


class SphericalBasisLayer(nn.Module):
    """``env(d/c) · N_ln j_l(z_ln d/c) · Y_l^0(angle)``, flattened to (T, S·R) as DimeNet's."""

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

    def forward(self, dist: Tensor, angle: Tensor) -> Tensor:  # (T,), (T,) -> (T, S*R)
        n, k = self.num_spherical, self.num_radial
        x = (dist / self.cutoff).unsqueeze(-1)  # (T, 1)
        zeros, norm = self.zeros.to(x.dtype), self.norm.to(x.dtype)
        rbf = torch.stack([norm[l] * spherical_jn(l + 1, zeros[l] * x)[l] for l in range(n)], 1)  # (T, S, R)
        rbf = self.envelope(x).unsqueeze(-1) * rbf
        cos = torch.cos(angle)
        leg = [torch.ones_like(cos), cos]  # Legendre P_l(cos) by Bonnet's recurrence
        for l in range(2, n):
            leg.append(((2 * l - 1) * cos * leg[l - 1] - (l - 1) * leg[l - 2]) / l)
        cbf = torch.stack(leg[:n], 1) * self.sph_pref.to(x.dtype)  # (T, S)
        return (rbf * cbf.unsqueeze(-1)).reshape(-1, n * k)


# --------------------------------------------------------------------------- blocks
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

    def forward(self, z: Tensor, rbf: Tensor, i: Tensor, j: Tensor) -> Tensor:  # -> (E_loc, H)
        h = self.emb(z)
        return F.silu(self.lin(torch.cat([h[i], h[j], F.silu(self.lin_rbf(rbf))], -1)))


class ResidualLayer(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.lin1, self.lin2 = Linear(hidden, hidden), Linear(hidden, hidden)
        for lin in (self.lin1, self.lin2):
            _glorot_orthogonal(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.lin2(F.silu(self.lin1(x))))


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

    def forward(self, x: Tensor, rbf: Tensor, sbf: Tensor, g: AtomGraph) -> Tensor:
        x_ji = F.silu(self.lin_ji(x))  # (E_loc, H)
        x_kj = F.silu(self.lin_kj(x)) * self.lin_rbf2(self.lin_rbf1(rbf))
        x_kj = F.silu(self.lin_down(x_kj))  # (E_loc, I)
        x_kj = g.gather_edges(x_kj)[g.idx_kj] * self.lin_sbf2(self.lin_sbf1(sbf))  # (T_loc, I)
        x_kj = x_kj.new_zeros((x.shape[0], x_kj.shape[1])).index_add(0, g.idx_ji, x_kj)  # (E_loc, I)
        h = x_ji + F.silu(self.lin_up(x_kj))
        for layer in self.layers_before_skip:
            h = layer(h)
        h = F.silu(self.lin(h)) + x
        for layer in self.layers_after_skip:
            h = layer(h)
        return h


class OutputPPBlock(nn.Module):
    """Edges -> own atoms (``edges_to_atoms``), then a per-atom MLP: (N_own, out)."""

    def __init__(self, c: DimeNetPPConfig, out_channels: int):
        super().__init__()
        self.lin_rbf = Linear(c.num_radial, c.hidden_channels, bias=False)
        self.lin_up = Linear(c.hidden_channels, c.out_emb_channels, bias=False)
        self.lins = nn.ModuleList([Linear(c.out_emb_channels, c.out_emb_channels)
                                   for _ in range(c.num_output_layers)])
        self.lin = Linear(c.out_emb_channels, out_channels, bias=False)
        for lin in (self.lin_rbf, self.lin_up, *self.lins):
            _glorot_orthogonal(lin.weight)
            if lin.bias is not None and not lin.bias.is_meta:
                nn.init.zeros_(lin.bias)
        if not self.lin.weight.is_meta:
            nn.init.zeros_(self.lin.weight)  # PyG's DimeNet++ default output_initializer="zeros"

    def mlp(self, x: Tensor) -> Tensor:
        x = self.lin_up(x)
        for lin in self.lins:
            x = F.silu(lin(x))
        return self.lin(x)

    def forward(self, x: Tensor, rbf: Tensor, g: AtomGraph) -> Tensor:
        return self.mlp(g.edges_to_atoms(self.lin_rbf(rbf) * x))


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
        v_kj, v_ji = g.kj_vectors(), v[g.idx_ji]  # (T_loc, 3): PyG's pos_jk and pos_ij
        angle = torch.atan2(torch.cross(v_ji, v_kj, dim=1).norm(dim=-1), (v_ji * v_kj).sum(-1))
        rbf = self.rbf(dist)  # (E_loc, R)
        sbf = self.sbf(v_kj.norm(dim=-1), angle)  # (T_loc, S*R)
        x = self.emb(g.z, rbf, g.edge_dst, g.edge_src)
        p = self.output_blocks[0](x, rbf, g)  # (N_own, out)
        for inter, out in zip(self.interaction_blocks, self.output_blocks[1:]):
            x = inter(x, rbf, sbf, g)
            p = p + out(x, rbf, g)
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
        mag = model.force_block.lin_rbf(rbf) * x  # (E_loc, H)
        mag = model.force_block.mlp(mag)  # (E_loc, 1): per-edge magnitude, along the edge
        forces = g.edges_to_atoms(mag * v / v.norm(dim=-1, keepdim=True))
        return energy.squeeze(-1), forces
    if not g.pos.requires_grad:
        raise ValueError("gradient forces need g.pos to require grad (parallel.with_pos)")
    energy = model(g)
    dpos, = torch.autograd.grad(energy.sum(), g.pos, create_graph=create_graph)
    return energy, -g.sum_atoms(dpos)


def count_parameters(cfg: DimeNetPPConfig) -> int:
    """Exact parameter count without allocating (the model built on the meta device)."""
    with torch.device("meta"):
        return sum(p.numel() for p in DimeNetPP(cfg).parameters())


def widths(cfg: DimeNetPPConfig) -> dict:
    """Per-row widths of the tensors the cost model and the byte ledger count."""
    return {"edge_gather": cfg.int_emb_size, "atom_reduce": cfg.hidden_channels,
            "triplet": cfg.int_emb_size + cfg.basis_emb_size + cfg.num_spherical * cfg.num_radial}


def config_fields() -> list[str]:
    return [f.name for f in fields(DimeNetPPConfig)]
