"""GemNet-T and GemNet-dT (Gasteiger et al., 2021) on torch primitives, written against ``AtomGraph``.

The triplets-only GemNet of fairchem-core's ``models/gemnet`` (registered there as ``gemnet_t``,
``direct_forces`` switching T to dT), the model Sriram et al. (ICLR 2022) scaled to GemNet-XL
with graph parallelism. Like DimeNet++ here, every parameterised op runs on local edges, local
triplets or own atoms, and the model reduces only through the ``AtomGraph`` calls, so the same
code is the single-process reference and one rank of a graph-parallel group.

Per batch (E_loc local edges ``j -> i``, T_loc local triplets ``k -> j -> i``, N_own atoms)::

    d, u  = |v|, v/|v|,  v = pos_i - pos_j - shift                   (E_loc,), (E_loc, 3)
    rbf   = u_env(d/c) · gauss_n(d/c)                                 (E_loc, R)
    cbf   = Y_l^0(cos φ),  cos φ = -u_ji · u_kj   (angle at j)        (E_loc, S, K) padded once, every block's
    h     = emb(z)                                                    (N, A)        replicated lookup
    m     = Dense([h_j, h_i, rbf])                                    (E_loc, Ed)
    per block:
      x     = down(scale(Dense(m) ⊙ W rbf))                           (E_loc, Tr)
      x_kj  = gather_edges(x)[slots]                                  (E_loc, K, Tr) all-gather, padded
      t     = scale(bilinear_τ→ji(W_cbf rbf_ji, cbf, x_kj))           (E_loc, Bt)   efficient layer
      t_rev = gather_edges(t)[id_swap]                                (E_loc, Bt)   all-gather
      m     = residuals(m, Dense(m) + (up_ca(t_rev) + up_ac(t))/√2)   (E_loc, Ed)
      h_own = (h_own + MLP(scale(edges_to_atoms(m ⊙ W rbf))))/√2      (N_own, A)    reduce-scatter
      h     = gather_atoms(h_own)                                     (N, A)        all-gather
      m     = (m + residual(Dense([h_j, h_i, m])))/√2                 (E_loc, Ed)
    per output block: E_own += Dense(MLP(scale(edges_to_atoms(m ⊙ W rbf))))     (N_own, 1)
                      F_e   += Dense(scale(MLP(m) ⊙ W rbf))            (E_loc, 1)   dT only
    energy = sum_systems(E_own)                                       (B,)          all-reduce
    forces = -sum_atoms(dE/dpos)  (T)   or  edges_to_atoms(F_e · u)  (dT)   (N_own, 3)

**Orientation.** fairchem's triplets share their *target* atom (input ``b -> a``, output
``c -> a``) and add each edge's reverse aggregate through ``id_swap``. Ours are the project's
``k -> j -> i`` (input edge into the output edge's *source*), i.e. fairchem's with the output
edge reversed: our per-edge aggregate ``t[e]`` is fairchem's aggregate of the reverse edge, so
fairchem's ``up_ca(X)[e] + up_ac(X)[swap e]`` is ``up_ca(t[swap e]) + up_ac(t[e])`` here (a
test checks it against a literal transcription of fairchem's order). The radial half of the
circular basis belongs to the output edge (``d_ji = d_ij``), the angle is at the shared atom.

Differences from fairchem, by choice: the element embedding has ``num_elements`` rows indexed
by ``z`` (95 by default: the project's element table, like DimeNet++; fairchem: 83 rows indexed
by ``z - 1``); scale factors are buffers, not frozen parameters; energies are extensive (sums).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from .batch import AtomGraph, gradient_forces
from .gemnet_config import GemNetTConfig
from .gemnet_layers import (INV_SQRT2, CircularBasis, CircularDown, Dense, EfficientBilinear, RadialBasis,
                            ResidualLayer, ScaleFactor, TripletRows, TripletSum, _EdgeDenseSiLU, mlp, pad_triplets,
                            triplet_slots)
from .parallel import collective_passes


#: ``small`` runs on 2 CPU cores in seconds (GemNet-T, energy-conserving forces); ``default`` is
#: fairchem-core's ``configs/oc20/s2ef/all/gp_gemnet/gp-gemnet-dT.yml`` and ``xl`` its
#: ``gp-gemnet-xl.yml`` (GemNet-XL of Sriram et al.), both direct forces; their graphs use
#: cutoff 6 Å and 50 neighbours (the dataset's settings here).
PRESETS = {
    "small": dict(num_spherical=4, num_radial=8, num_blocks=2, emb_size_atom=32, emb_size_edge=32,
                  emb_size_trip=16, emb_size_rbf=8, emb_size_cbf=8, emb_size_bil_trip=16, num_after_skip=1,
                  num_atom=2, force_head="gradient"),
    "default": {},
    "xl": dict(num_blocks=6, emb_size_atom=128, emb_size_edge=1536, emb_size_trip=384, emb_size_bil_trip=192),
}


def preset(name: str, **over) -> GemNetTConfig:
    return GemNetTConfig(**{**PRESETS[name], **over})


# --------------------------------------------------------------------------- blocks
class EdgeEmbedding(nn.Module):
    """``Dense([h_src, h_dst, x])``: (N, A), (E_loc, F) -> (E_loc, out).

    Computed as ``act((h W_src^T)[src] + (h W_dst^T)[dst] + x W_x^T)`` with ``W = [W_src W_dst W_x]``:
    the atom halves are projected on the N atom rows and gathered, not on E_loc concatenated rows,
    and autograd keeps no (E_loc, 2A + F) concatenation (one weight, fairchem's, either way)."""

    def __init__(self, atom: int, fan_in: int, out: int):
        super().__init__()
        self.atom = atom
        self.dense = Dense(2 * atom + fan_in, out)

    def forward(self, h: Tensor, x: Tensor, g: AtomGraph) -> Tensor:
        w, a = self.dense.linear.weight, self.atom  # (out, 2A + F)
        if not self.dense.fused:  # GemNet-dT: one node (gemnet_layers._EdgeDenseSiLU), the same sums
            return _EdgeDenseSiLU.apply(h, x, w, g.edge_src, g.edge_dst)
        hw = torch.nn.functional.linear(h, torch.cat([w[:, :a], w[:, a:2 * a]])).view(h.shape[0], 2, -1)  # (N, 2, out)
        return self.dense.act(hw[g.edge_src, 0] + hw[g.edge_dst, 1] + torch.nn.functional.linear(x, w[:, 2 * a:]))


class AtomUpdate(nn.Module):
    """Edges -> own atoms: ``MLP(scale(Σ_{e -> i} m_e ⊙ W rbf_e))``, (N_own, A)."""

    def __init__(self, c: GemNetTConfig):
        super().__init__()
        self.dense_rbf = Dense(c.emb_size_rbf, c.emb_size_edge, activation=False)
        self.scale_sum = ScaleFactor()
        self.mlp = mlp(c.emb_size_edge, c.emb_size_atom, c.num_atom)

    def forward(self, m: Tensor, rbf: Tensor, g: AtomGraph) -> Tensor:
        x = g.edges_to_atoms(m * self.dense_rbf(rbf))  # (N_own, Ed): reduce-scatter
        return self.mlp(self.scale_sum(x, ref=m))


class OutputBlock(AtomUpdate):
    """Per-atom energies (N_own, 1) and, for GemNet-dT, per-edge force magnitudes (E_loc, 1)."""

    def __init__(self, c: GemNetTConfig):
        super().__init__(c)
        self.out_energy = Dense(c.emb_size_atom, 1, activation=False)
        self.direct = c.force_head == "direct"
        if self.direct:
            self.mlp_forces = mlp(c.emb_size_edge, c.emb_size_edge, c.num_atom, recompute=True)
            self.dense_rbf_forces = Dense(c.emb_size_rbf, c.emb_size_edge, activation=False)
            self.scale_rbf_forces = ScaleFactor()
            self.out_forces = Dense(c.emb_size_edge, 1, activation=False)

    def forward(self, m: Tensor, rbf: Tensor, g: AtomGraph, forces: bool = True) -> tuple[Tensor, Optional[Tensor]]:
        energy = self.out_energy(super().forward(m, rbf, g))
        if not (self.direct and forces):
            return energy, None
        x = self.mlp_forces(m)
        sf = self.scale_rbf_forces
        if not sf.foldable:
            x = sf(x * self.dense_rbf_forces(rbf), ref=x)
            return energy, self.out_forces(x)
        # out_forces(s · x ⊙ (rbf W^T)) = Σ_q rbf_q (x M)_q, M = diag(s w_out) W (Ed, Rb): (E, Rb) products
        # where the plain order makes three (E, Ed) ones (and their gradients); the same sum, reassociated
        w, w_out = self.dense_rbf_forces.linear.weight, self.out_forces.linear.weight  # (Ed, Rb), (1, Ed)
        return energy, ((x @ (w * (w_out.t() * sf.value(x.dtype)))) * rbf).sum(-1, keepdim=True)


class TripletInteraction(nn.Module):
    """The triplet message of every local edge: (E_loc, Ed) -> (E_loc, Ed). Reads other ranks'
    edge rows twice (``gather_edges``): the input messages and the reverse edges' aggregates."""

    def __init__(self, c: GemNetTConfig):
        super().__init__()
        ed = c.emb_size_edge
        self.dense_ba = Dense(ed, ed)
        self.mlp_rbf = Dense(c.emb_size_rbf, ed, activation=False)
        self.scale_rbf = ScaleFactor()
        self.down = Dense(ed, c.emb_size_trip)
        self.bilinear = EfficientBilinear(c.emb_size_trip, c.emb_size_cbf, c.emb_size_bil_trip)
        self.scale_cbf_sum = ScaleFactor()
        self.up_ca = Dense(c.emb_size_bil_trip, ed)
        self.up_ac = Dense(c.emb_size_bil_trip, ed)

    def forward(self, m: Tensor, rbf3: Tensor, rad3: Tensor, sph_p: Tensor, slots: Tensor, g: AtomGraph,
                scale: float = 1.0) -> Tensor:
        """``scale``: a constant multiplying the message (dT: on up_ca's and up_ac's activations, no pass)."""
        x = self.dense_ba(m)
        if self.scale_rbf.foldable:  # the scale factor on the (Ed, Rb) weight, not on (E_loc, Ed) rows
            x = self.down(x * torch.nn.functional.linear(rbf3, self.mlp_rbf.linear.weight * self.scale_rbf.value(x.dtype)))
        else:
            x = self.down(self.scale_rbf(x * self.mlp_rbf(rbf3), ref=x))  # (E_loc, Tr)
        x_all = g.gather_edges(x)  # the rows idx_kj reads: all-gather
        t = self.bilinear(rad3, sph_p, x_all, slots)  # (E_loc, Bt)
        t = self.scale_cbf_sum(t, ref=x_all[g.idx_kj] if self.scale_cbf_sum.fitting else x)  # ref: the (T_loc, Tr) inputs
        t_rev = g.gather_edges(t, "swap")[g.id_swap]  # (E_loc, Bt): the reverse edge's aggregate
        if self.up_ca.fused:  # GemNet-T (_DenseSiLU): the plain order
            return (self.up_ca(t_rev) + self.up_ac(t)).mul_(INV_SQRT2 * scale)
        return self.up_ca(t_rev, INV_SQRT2 * scale).add_(self.up_ac(t, INV_SQRT2 * scale))


class InteractionBlock(nn.Module):
    """Edge update by triplets and residual layers, atom update, edges re-embedded with atoms."""

    def __init__(self, c: GemNetTConfig):
        super().__init__()
        ed = c.emb_size_edge
        self.dense_ca = Dense(ed, ed)
        self.trip = TripletInteraction(c)
        rec = c.force_head == "direct"  # recompute activations in backward: one backward only (ResidualLayer)
        self.layers_before_skip = nn.ModuleList([ResidualLayer(ed, recompute=rec) for _ in range(c.num_before_skip)])
        self.layers_after_skip = nn.ModuleList([ResidualLayer(ed, recompute=rec) for _ in range(c.num_after_skip)])
        self.atom_update = AtomUpdate(c)
        self.concat = EdgeEmbedding(c.emb_size_atom, ed, ed)
        self.residual_m = nn.ModuleList([ResidualLayer(ed, recompute=rec) for _ in range(c.num_concat)])

    def forward(self, h_own: Tensor, m: Tensor, bases: tuple, g: AtomGraph) -> tuple[Tensor, Tensor]:
        rbf3, rad3, sph_p, slots, rbf_h = bases
        if self.dense_ca.fused:  # GemNet-T (_DenseSiLU): the plain order
            x = (self.dense_ca(m) + self.trip(m, rbf3, rad3, sph_p, slots, g)).mul_(INV_SQRT2)
        else:  # dT: the 1/√2 on the three Denses' activations (_LinearSiLU), no pass over the rows nor its gradient
            x = self.dense_ca(m, INV_SQRT2).add_(self.trip(m, rbf3, rad3, sph_p, slots, g, INV_SQRT2))
        for layer in self.layers_before_skip:
            x = layer(x)
        m = (m + x).mul_(INV_SQRT2)
        for layer in self.layers_after_skip:
            m = layer(m)
        h_own = (h_own + self.atom_update(m, rbf_h, g)).mul_(INV_SQRT2)  # (N_own, A)
        m2 = self.concat(g.gather_atoms(h_own), m, g)  # every atom's row: all-gather
        for layer in self.residual_m:
            m2 = layer(m2)
        return h_own, (m + m2).mul_(INV_SQRT2)


# --------------------------------------------------------------------------- the model
class GemNetT(nn.Module):
    """GemNet-T / -dT: ``forward(g) -> {"energy": (B,), "forces": (N_own, 3)}`` (module docstring)."""

    def __init__(self, cfg: GemNetTConfig):
        super().__init__()
        self.cfg = c = cfg
        self.radial = RadialBasis(c.num_radial, c.cutoff, c.envelope_exponent, c.gaussian_centres)
        self.circular = CircularBasis(c.num_spherical)
        # shared across blocks (fairchem divides their gradients by the number of users: shared_parameters)
        self.mlp_rbf3 = Dense(c.num_radial, c.emb_size_rbf, activation=False)
        self.mlp_cbf3 = CircularDown(c.num_spherical, c.num_radial, c.emb_size_cbf)
        self.mlp_rbf_h = Dense(c.num_radial, c.emb_size_rbf, activation=False)
        self.mlp_rbf_out = Dense(c.num_radial, c.emb_size_rbf, activation=False)
        self.atom_emb = nn.Embedding(c.num_elements, c.emb_size_atom)
        if not self.atom_emb.weight.is_meta:
            nn.init.uniform_(self.atom_emb.weight, -math.sqrt(3), math.sqrt(3))
        self.edge_emb = EdgeEmbedding(c.emb_size_atom, c.num_radial, c.emb_size_edge)
        self.int_blocks = nn.ModuleList([InteractionBlock(c) for _ in range(c.num_blocks)])
        self.out_blocks = nn.ModuleList([OutputBlock(c) for _ in range(c.num_blocks + 1)])
        if c.force_head == "gradient":  # the double backward's force pass keeps less (gemnet_layers._DenseSiLU)
            for m in self.modules():
                if isinstance(m, Dense):
                    m.fused = True

    def __repr__(self) -> str:
        c = self.cfg
        return (f"GemNetT(blocks={c.num_blocks}, atom={c.emb_size_atom}, edge={c.emb_size_edge}, "
                f"trip={c.emb_size_trip}, bil_trip={c.emb_size_bil_trip}, cutoff={c.cutoff}, forces={c.force_head})")

    def shared_parameters(self) -> list[tuple[nn.Parameter, int]]:
        """(parameter, number of blocks using it): fairchem's trainer divides their gradients by it."""
        k = self.cfg.num_blocks
        return [(self.mlp_rbf3.linear.weight, k), (self.mlp_cbf3.weight, k), (self.mlp_rbf_h.linear.weight, k),
                (self.mlp_rbf_out.linear.weight, k + 1)]

    def embed(self, g: AtomGraph, forces: bool = True) -> tuple[Tensor, Optional[Tensor], Tensor]:
        """Per-own-atom energies (N_own, 1), per-edge force magnitudes (E_loc, 1) or None (T, or
        ``forces=False``: the direct head is skipped), and the unit edge vectors (E_loc, 3)."""
        if g.id_swap is None or g.triplet_rank is None:
            raise ValueError("GemNet needs a symmetric edge set with id_swap and triplet_rank "
                             "(gnnpipe.atomic.neighbors: radius_graph, reverse_edges)")
        v = g.edge_vectors()  # (E_loc, 3)
        d = v.norm(dim=-1)
        u = v / d.unsqueeze(-1)
        v_kj = g.kj_vectors()  # (T_loc, 3)
        cos = -(u[g.idx_ji] * v_kj).sum(-1) / v_kj.norm(dim=-1)  # angle at j between j->i and j->k
        rbf = self.radial(d)  # (E_loc, R)
        e = g.num_local_edges
        # built once, shared by every block: the padded angular basis (E_loc, S, K) and the input rows of each
        # triplet slot (E_loc, K)
        sph_p = pad_triplets(self.circular(cos), g.idx_ji, g.triplet_rank, e).transpose(1, 2)
        slots = TripletRows(triplet_slots(g.idx_kj, g.idx_ji, g.triplet_rank, e))
        if not sph_p.requires_grad:  # dT, or energy only: the triplet sum as one sparse product (TripletSum)
            slots = TripletSum(sph_p, slots)
        bases = (self.mlp_rbf3(rbf), self.mlp_cbf3(rbf), sph_p, slots, self.mlp_rbf_h(rbf))
        rbf_out = self.mlp_rbf_out(rbf)
        h = self.atom_emb(g.z)  # (N, A): a lookup, replicated
        m = self.edge_emb(h, rbf, g)  # (E_loc, Ed)
        energy, f_edge = self.out_blocks[0](m, rbf_out, g, forces)
        h_own = h[g.own_atoms]
        for block, out in zip(self.int_blocks, self.out_blocks[1:]):
            h_own, m = block(h_own, m, bases, g)
            e, f = out(m, rbf_out, g, forces)
            energy = energy + e
            f_edge = f_edge + f if f is not None else None
        return energy, f_edge, u

    def forward(self, g: AtomGraph, forces: bool = True) -> dict[str, Tensor]:
        """Energies (B,) and the forces on the own atoms (N_own, 3). Gradient forces differentiate
        ``g.pos`` (a leaf copy is made if it does not require grad), keeping the graph for a loss
        on the forces (double backward) when the model is in training mode. ``forces=False``:
        ``{"energy"}`` alone, by the forward pass alone (no force head, no gradient in positions)."""
        if not forces:
            return {"energy": g.sum_systems(self.embed(g, forces=False)[0]).squeeze(-1)}
        if self.cfg.force_head == "gradient":
            return gradient_forces(lambda g: g.sum_systems(self.embed(g)[0]).squeeze(-1), g, self.training)
        e_own, f_edge, u = self.embed(g)
        return {"energy": g.sum_systems(e_own).squeeze(-1),  # (B,): all-reduce
                "forces": g.edges_to_atoms(f_edge * u)}  # along each edge, summed into its target


# --------------------------------------------------------------------------- sizes and costs
def _on_meta(cfg: GemNetTConfig) -> GemNetT:
    with torch.device("meta"):
        return GemNetT(cfg)


def count_parameters(cfg: GemNetTConfig) -> int:
    """Trainable parameters, exactly, without allocating (built on the meta device).

    fairchem counts 83 embedding rows and its scale factors too: at ``num_elements=83``,
    ``count_parameters + count_scale_factors`` is fairchem's ``num_params``.
    """
    return sum(p.numel() for p in _on_meta(cfg).parameters())


def count_scale_factors(cfg: GemNetTConfig) -> int:
    """Fitted constants (buffers): 3 per interaction block, 1 (T) or 2 (dT) per output block."""
    return sum(isinstance(m, ScaleFactor) for m in _on_meta(cfg).modules())


def widths(cfg: GemNetTConfig) -> dict:
    """Row widths of what crosses the wire per interaction block (edge rows twice, atom rows
    twice) and per output block (atom rows)."""
    return {"edge_gather": cfg.emb_size_trip + cfg.emb_size_bil_trip,
            "atom_reduce": cfg.emb_size_edge, "atom_gather": cfg.emb_size_atom}


def step_bytes(cfg: GemNetTConfig, edges: Sequence[int], atoms: Sequence[int], systems: Sequence[int],
               ways: int, dtype_bytes: int, params: int, training: bool = True, forces: bool = True) -> int:
    """Bytes one training step sends, summed over every rank (what the ledger counts).

    ``edges[d], atoms[d], systems[d]``: the batch of replica d; P ways, K blocks, b dtype bytes.
    An all-gather or reduce-scatter of n rows of width w sends ``(P-1)·n·w·b``. Per replica, each
    of these crosses the wire once forward and once per backward pass through it — ``passes`` =
    2 for direct forces (forward, loss backward), 4 for gradient forces (forward, the force pass,
    and both again in the parameter pass of the double backward):

    * per interaction block: edge rows ``E·(Tr + Bt)`` (input messages, reverse aggregates),
      atom rows ``N·Ed`` (reduce-scatter of the atom update) and ``N·A`` (all-gather of h);
    * per output block (K + 1): atom rows ``N·Ed``;
    * forces ``2·(P-1)·3N·b`` (direct: the edge sum's reduce-scatter and its adjoint; gradient:
      ``sum_atoms`` of -dE/dpos and its adjoint); energies ``2·(P-1)·B·b`` (ring all-reduce,
      identity backward);
    * parameters ``2·(P-1)·params·b`` per replica, ``2·(D-1)·params·b`` per way.

    ``training=False``: one inference call (energies and forces, no loss): half the passes, the
    forces' exchange once, no parameters. ``forces=False`` (energy-only training): the direct head's
    two passes, either head, and no forces.
    """
    p, d, b = ways, len(edges), dtype_bytes
    c, k = cfg, cfg.num_blocks
    passes, once = collective_passes(cfg.force_head, training, forces)
    total = 0
    for e, n, s in zip(edges, atoms, systems):
        rows = k * e * (c.emb_size_trip + c.emb_size_bil_trip) + k * n * (c.emb_size_edge + c.emb_size_atom) \
            + (k + 1) * n * c.emb_size_edge
        total += (p - 1) * b * (passes * rows + once * 3 * n + 2 * s)
    return total + training * (d * 2 * (p - 1) * params * b + p * 2 * (d - 1) * params * b)




def halo_widths(cfg: GemNetTConfig) -> dict:
    """Row widths of the atoms layout's halo exchanges per interaction block (``atomic/halo.py``): the
    input messages (Tr), the reverse edges' aggregates (Bt), the ghosts' atom embeddings (A)."""
    return {"kj": cfg.emb_size_trip, "swap": cfg.emb_size_bil_trip, "atoms": cfg.emb_size_atom}


def memory_per_worker(cfg: GemNetTConfig, atoms: int, edges: int, triplets: int, ways: int,
                      dtype_bytes: int = 4, padding: float = 1.3) -> dict:
    """Estimated bytes one of P ways holds for a training step on a batch of that size.

    Parameters, gradients and Adam's moments: 4 copies, replicated. Activations autograd keeps
    for backward, per row of what they index, all divided by P (local edges and triplets; the
    atom MLPs run on own atoms; gathered rows are read by index and not kept):

    * per edge, the direct head (dT) by counting the ops: a Dense with activation keeps its input
      and pre-activation, a residual layer 3 rows of its width (its inner activation is recomputed
      in backward, ``gemnet_layers.ResidualLayer``), a product both factors; per interaction block
      ``(11 + 3·(before + after + concat))·Ed + (1 + S + C)·Tr + 2·Bt``, per output block
      ``(3 + 3·num_atom)·Ed`` (the force output folds its radial gate and scale factor into one
      (Ed, Rb) weight: no (E, Ed) products), once ``2·Ed + R + 3·Rb + C·S``;
    * the gradient head (T) keeps the graph of the force pass as well: measured with
      ``saved_tensors_hooks`` (distinct storages), by finite differences in every width (each Dense
      with activation one ``_DenseSiLU``, whose force-pass node keeps only its incoming gradient),
      the residual layers keep 6 rows instead of 3, the bases and triplet parts twice as much;
      per interaction block ``(24 + 6·(...))·Ed + 2·(1 + S + C)·Tr + 3·Bt``, per
      output block ``3·Ed``, once ``8·Ed + 7·R + 6·Rb + 2·C·S``;
    * per padded triplet slot (E_loc·K_max ≈ ``padding``·T_loc, K_max the most triplets of one
      edge): (T) the padded angular basis, ``S`` once (built once, shared by the blocks), and the
      padded input messages ``Tr`` per block; per triplet ``3·S + 11``; (dT) the two matrices of
      ``TripletSum`` (built once, held for backward outside autograd's saved tensors): ``S`` values
      and ``S`` int32 column indices per slot and per triplet;
    * per atom: each of the 2K + 1 atom MLPs ``Ed + (a + 4·num_atom)·A`` (T: ``6·num_atom``,
      a = 2; dT: a = 1), ``A`` per output block, and the K + 1 edge embeddings' atom rows ``A``
      (their atom halves are projected per atom, then gathered: no (E, 2A) rows), T also ``2K·Ed``;
    * ``gathered``: one block's all-gathered edge rows and atom rows, alive at once.

    An estimate for sizing (tests: within 20 % of a measured step of each head), not an
    allocator trace.
    """
    c, k, b = cfg, cfg.num_blocks, dtype_bytes
    ed, a, tr, bt, s, cb, r, rb = (c.emb_size_edge, c.emb_size_atom, c.emb_size_trip, c.emb_size_bil_trip,
                                   c.num_spherical, c.emb_size_cbf, c.num_radial, c.emb_size_rbf)
    res = c.num_before_skip + c.num_after_skip + c.num_concat
    if c.force_head == "direct":
        per_block = (11 + 3 * res) * ed + (1 + s + cb) * tr + 2 * bt
        per_edge = k * per_block + (k + 1) * (3 + 3 * c.num_atom) * ed + 2 * ed + r + 3 * rb + cb * s
        per_slot = per_triplet = s * (1 + 4 / b)  # TripletSum's A (padded) and A^T: values, int32 columns
        mlp_a, res_a, atom_ed = 1, 4, 0
    else:
        per_block = (24 + 6 * res) * ed + 2 * (1 + s + cb) * tr + 3 * bt
        per_edge = k * per_block + (k + 1) * 3 * ed + 8 * ed + 7 * r + 6 * rb + 2 * cb * s
        per_slot, per_triplet, mlp_a, res_a, atom_ed = s + k * tr, 3 * s + 11, 2, 6, 2 * k * ed
    per_atom = (2 * k + 1) * (ed + (mlp_a + res_a * c.num_atom) * a) + 2 * (k + 1) * a + atom_ed
    local = lambda n: -(-n // ways)  # noqa: E731 - the largest block of np.array_split
    out = {"parameters": 4 * count_parameters(cfg) * b,
           "triplet": int((per_triplet + per_slot * padding) * b * local(triplets)),
           "edge": int(per_edge * b * local(edges)),
           "atom": int(per_atom * b * local(atoms)),
           "gathered": int((edges * (tr + bt) + atoms * (ed + a)) * b)}
    out["total"] = sum(out.values())
    return out


#: An inference call's activations (energy and gradient forces, no loss, no parameter gradients) over
#: a training step's at the same sizes (:func:`memory_per_worker` at one way without its 4 parameter
#: copies), plus ``HALO_EDGE_WORDS`` words per halo edge: the peak RSS above a worker's RSS before the
#: call, measured on Cu fcc with GemNet-T small, float32, cutoff 3 Å (benchmarks/results/
#: domains_weak_gemnet_t.json: 6,912 own atoms at P = 1, 2, 4; one process on 2,048 atoms, 331 MB:
#: ``bench_domains.py --kind gemnet_t --shape 8,8,8 --workers 1``), fitted by least squares: within
#: 3 % of each. Refitted after #34's fused Dense+SiLU node lowered :func:`memory_per_worker` (a training
#: step keeps less for its double backward; an inference call's peaks were unchanged). A halo edge costs
#: ~2 times an own edge (26 kB against 13.8 kB in float32): more than its view's rows explain (not
#: attributed yet; both P > 1 runs have ~9,950 halo edges, so the term is fitted on one halo size).
INFERENCE_FRACTION = 0.64
HALO_EDGE_WORDS = 6_500


def inference_memory(cfg: GemNetTConfig, atoms: int, edges: int, triplets: int, halo_edges: int,
                     dtype_bytes: int = 4) -> dict:
    """Estimated bytes one worker holds at the peak of an inference call (energy and forces) on a view of
    ``atoms`` own atoms, the ``edges`` into them, their ``triplets`` and ``halo_edges`` (the edges into
    its ring: the triplets' input edges and the reverse edges that other workers own).

    ``parameters``: one copy; ``activations``: ``INFERENCE_FRACTION`` × the training step's
    (:func:`memory_per_worker` at one way): the forward's saved tensors and the force pass's transients,
    without the double backward's graph; ``halo``: ``HALO_EDGE_WORDS`` per halo edge. Calibrated for
    the gradient head (GemNet-T) only (the direct head's call keeps no force pass: the same fraction
    overestimates it). Not counted: the process's own RSS before the call (torch, the model)."""
    train = memory_per_worker(cfg, atoms, edges, triplets, 1, dtype_bytes)
    out = {"parameters": count_parameters(cfg) * dtype_bytes,
           "activations": int(INFERENCE_FRACTION * (train["total"] - train["parameters"])),
           "halo": HALO_EDGE_WORDS * halo_edges * dtype_bytes}
    out["total"] = sum(out.values())
    return out
