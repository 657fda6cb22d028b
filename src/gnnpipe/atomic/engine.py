"""The training step of atomistic models, in one process or sharded (P graph ways × D replicas).

World layout: ``world = D × P``, ``rank = replica * P + way`` (fairchem's ``dp × gp`` grid):
the P ranks of a replica split each batch's edges and triplets (``parallel.shard_graph``);
the D replicas take different batches. The loss of a step is written so that the sum over
every rank is the single-process loss of the union of the replicas' batches:

* energy term  ``Σ_systems ((E - E_ref)/σ)² / n_systems`` — replicated inside a graph
  group (every way holds the same energies), counted once (``sum_systems``' identity
  backward), summed over replicas;
* force term   ``w_F · Σ_own free atoms |(F - F_ref)/σ|² / (3 n_free)`` — each way its own atoms;

with ``n_systems`` and ``n_free`` the counts over the whole step (all replicas). So the
parameter gradients are **summed** over the graph group and then over the data-parallel
group, and equal single-process training on the union batch (tests: ``..._matches_unsharded``).

Targets are normalised by per-element reference energies (a least-squares fit on the
training systems: the "per-element mean energy" baseline) and their residuals' standard
deviation σ: ``E = σ·model(g) + Σ_atoms e_ref[z]``, ``F = σ·model_forces``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from .dimenetpp import DimeNetPP, energy_and_forces
from .parallel import EdgeGroup, shard_graph, with_pos


@dataclass
class Normalizer:
    """``E = scale · y + Σ e_ref[z]``: per-element reference energies and one scale (eV)."""

    e_ref: np.ndarray  # (95,) eV per atom of each element
    scale: float

    @classmethod
    def fit(cls, z: np.ndarray, atom_ptr: np.ndarray, energy: np.ndarray, ids: np.ndarray) -> "Normalizer":
        counts = np.zeros((len(ids), 95))
        for row, s in enumerate(ids):
            np.add.at(counts[row], z[atom_ptr[s]:atom_ptr[s + 1]], 1)
        used = counts.sum(0) > 0
        coef, *_ = np.linalg.lstsq(counts[:, used], energy[ids], rcond=None)
        e_ref = np.zeros(95)
        e_ref[used] = coef
        resid = energy[ids] - counts @ e_ref
        return cls(e_ref, float(resid.std()) if len(ids) > 1 and resid.std() > 1e-8 else 1.0)

    def baseline(self, z: np.ndarray, system: np.ndarray, num_systems: int) -> np.ndarray:
        """(B,) the reference energy of each system: what the per-element baseline predicts."""
        return np.bincount(system, weights=self.e_ref[z], minlength=num_systems)


@dataclass
class StepCounts:
    """Normalising counts of one optimisation step over every replica."""

    systems: int
    free_atoms: int


def step_loss(model: DimeNetPP, g, b: dict, norm: Normalizer, counts: StepCounts,
              force_weight: float, train: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's share of a step's loss, the batch's energies (B,) and own forces (N_own, 3), eV."""
    gradient = model.cfg.force_head == "gradient"
    if gradient:
        g = with_pos(g, g.pos.detach().clone().requires_grad_(True))
    y, f = energy_and_forces(model, g, create_graph=train and gradient)
    dtype = y.dtype
    base = torch.as_tensor(norm.baseline(b["z"], b["system"], b["num_systems"]), dtype=dtype, device=y.device)
    energy = norm.scale * y + base
    forces = norm.scale * f
    own = slice(g.atom_lo, g.atom_hi)
    e_ref = torch.as_tensor(b["energy"], dtype=dtype, device=y.device)
    f_ref = torch.as_tensor(b["forces"][own], dtype=dtype, device=y.device)
    free = torch.as_tensor(~b["fixed"][own], device=y.device).unsqueeze(-1)
    loss_e = ((energy - e_ref) / norm.scale).pow(2).sum() / max(counts.systems, 1)
    loss_f = (((forces - f_ref) / norm.scale).pow(2) * free).sum() / max(3 * counts.free_atoms, 1)
    return loss_e + force_weight * loss_f, energy.detach(), forces.detach()


def rank_view(b: dict, grp: Optional[EdgeGroup], dtype, device):
    """This rank's AtomGraph of batch ``b`` (the whole batch without a group)."""
    parts, rank = (1, 0) if grp is None else (grp.size, grp.rank)
    return shard_graph(b, parts, rank, grp, dtype, device)
