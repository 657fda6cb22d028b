"""The atomic model protocol and the registry of atomic model kinds.

An atomic model is an ``nn.Module`` built from its config dataclass whose

    forward(g: AtomGraph) -> {"energy": (B,), "forces": (N_own, 3)}

returns the energies of the batch's systems (replicated in a graph-parallel group) and the
forces on the view's own atoms, by gradient (``-dE/dpos``; the graph is kept for a loss on the
forces when the model is in training mode) or by a direct head. The model reads only what the
``AtomGraph`` holds and reduces only through its calls, so it runs unchanged as one rank of a
graph-parallel group. The trainer never reaches into its submodules.

A kind is registered once (its name in ``gnnpipe.atomic.kinds``, its entry here), with
everything the rest of the package asks about it (:class:`AtomicModelKind`): the config class and its presets, the model class, the exact
parameter count, the closed-form bytes of a training step, the memory per worker, and the
``AtomGraph`` index sets and edge symmetry its graphs must have. Schema enums and CLI choices
are ``ATOMIC_MODELS.names()``; a model is ``ATOMIC_MODELS[kind].build(cfg)``.

Kinds:

* ``dimenetpp`` — DimeNet++ (``atomic/dimenetpp.py``) through a thin adapter
  (:class:`DimeNetPPModel`: the same module and state dict, ``forward`` returns the dict);
* ``gemnet_t`` — GemNet-T and GemNet-dT (``atomic/gemnet.py``): one architecture, the force
  head a config field (``force_head: gradient`` = GemNet-T, ``direct`` = GemNet-dT), as
  DimeNet++'s and as fairchem registers it (``gemnet_t`` with ``direct_forces``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Optional, Sequence

from torch import nn

from . import dimenetpp, gemnet, gemnet_layers
from .batch import AtomGraph, gradient_forces
from .kinds import ATOMIC_MODELS

__all__ = ["ATOMIC_MODELS", "AtomicModelKind", "DIMENETPP", "GEMNET_T", "DimeNetPPModel"]


@dataclass(frozen=True)
class AtomicModelKind:
    """What the package knows about one atomic model kind (see the module docstring)."""

    name: str
    description: str
    config: type  # the config dataclass: has num_blocks, cutoff, force_head
    model: Callable[[Any], nn.Module]  # cfg -> the protocol's nn.Module
    presets: Mapping[str, dict]  # preset name -> config overrides
    count_parameters: Callable[[Any], int]  # cfg -> trainable parameters, exact
    # (cfg, edges, atoms, systems, ways, dtype_bytes, params) -> bytes of one step, all ranks
    step_bytes: Callable[..., int]
    # (cfg, atoms, edges, triplets, ways, dtype_bytes) -> {part: bytes, "total": bytes}
    memory_per_worker: Callable[..., dict]
    index_sets: tuple[str, ...]  # AtomGraph index sets the model reads
    symmetric_edges: bool  # needs every edge's reverse (id_swap)
    width: str  # the config field the run record reports as the model's ``hidden`` width
    labels: Mapping[str, str]  # force head -> the model's name in reports ("GemNet-T", "GemNet-dT")
    # (model, whole-batch AtomGraphs in one process) -> {name: value}: constants fitted once before
    # training and kept in the state dict (GemNet's scale factors); None: nothing to fit
    fit: Optional[Callable[[nn.Module, list], dict]] = None

    def preset(self, name: str, **over) -> Any:
        """The config of preset ``name`` with ``over`` replacing fields (None values are ignored)."""
        if name not in self.presets:
            raise ValueError(f"{self.name}: unknown preset {name!r}; known: {', '.join(self.presets)}")
        return self.config(**{**self.presets[name], **{k: v for k, v in over.items() if v is not None}})

    def build(self, cfg) -> nn.Module:
        return self.model(cfg)

    def config_fields(self) -> list[str]:
        return [f.name for f in fields(self.config)]


# --------------------------------------------------------------------------- DimeNet++
class DimeNetPPModel(dimenetpp.DimeNetPP):
    """DimeNet++ on the protocol: the same module (state dict = PyG's names), ``forward`` -> dict."""

    def forward(self, g: AtomGraph) -> dict:
        if self.cfg.force_head == "direct":
            energy, forces = dimenetpp.energy_and_forces(self, g, create_graph=False)
            return {"energy": energy, "forces": forces}
        return gradient_forces(super().forward, g, self.training)


def dimenetpp_step_bytes(cfg, edges: Sequence[int], atoms: Sequence[int], systems: Sequence[int], ways: int,
                         dtype_bytes: int, params: int) -> int:
    """Bytes one DimeNet++ training step sends, summed over every rank (what the ledger counts).

    ``edges[d], atoms[d], systems[d]``: the batch of replica d. With P ways, I = int_emb_size,
    H = hidden, K = num_blocks, b = dtype bytes, per replica:

    * gradient forces (double backward): edge rows ``4·K·(P-1)·E·I·b`` (all-gather forward, its
      reduce-scatter in the force pass, both again in the parameter pass), atom rows
      ``4·(K+1)·(P-1)·N·H·b`` (K+1 output blocks, the same four passes), forces
      ``2·(P-1)·3N·b`` (reduce-scatter, and its all-gather in the parameter pass);
    * direct forces: ``2·K·(P-1)·E·I·b + 2·(K+1)·(P-1)·N·H·b + 2·(P-1)·3N·b``;
    * energies: ``2·(P-1)·B·b`` (ring all-reduce); parameters: ``2·(P-1)·params·b`` per replica
      and ``2·(D-1)·params·b`` per way across replicas.
    """
    p, d, b = ways, len(edges), dtype_bytes
    k, i, h = cfg.num_blocks, cfg.int_emb_size, cfg.hidden_channels
    passes = 4 if cfg.force_head == "gradient" else 2
    total = 0
    for e, n, s in zip(edges, atoms, systems):
        total += (p - 1) * b * (passes * k * e * i + passes * (k + 1) * n * h + 2 * 3 * n + 2 * s)
    return total + d * 2 * (p - 1) * params * b + p * 2 * (d - 1) * params * b


def dimenetpp_memory(cfg, atoms: int, edges: int, triplets: int, ways: int, dtype_bytes: int = 4) -> dict:
    """Estimated bytes one of P ways holds for a DimeNet++ training step on a batch of that size.

    Parameters, gradients and Adam's two moments are replicated (4 copies). Activations kept for
    backward are per row of what they index: triplets and local edges divide by P, the gathered
    edge rows and the atoms do not. The per-row widths are fitted to what autograd keeps in
    a gradient-force step (double backward), measured with ``saved_tensors_hooks`` by
    ``benchmarks/bench_atomic.py`` at two model sizes (S·R = 42): per triplet ``69·S·R`` for the
    spherical basis plus ``7.7·I + 3·S·R + 2·basis_emb`` per block; per edge ``79·H`` per
    interaction block and ``39·H`` per output block. A direct-force step keeps about a third.
    An estimate for sizing (tests: within 15 % of a measured step), not an allocator trace.
    """
    k, h, i = cfg.num_blocks, cfg.hidden_channels, cfg.int_emb_size
    sr, be = cfg.num_spherical * cfg.num_radial, cfg.basis_emb_size
    scale = 1.0 if cfg.force_head == "gradient" else 1 / 3
    b = dtype_bytes
    per_triplet = scale * (69 * sr + k * (7.7 * i + 3 * sr + 2 * be))
    per_edge = scale * (79 * h * k + 39 * h * (k + 1))
    out = {"parameters": 4 * dimenetpp.count_parameters(cfg) * b,
           "triplet": int(per_triplet * b * -(-triplets // ways)),
           "edge": int(per_edge * b * -(-edges // ways)),
           "gathered_edges": int(scale * 3 * k * i * b * edges),
           "atom": int(scale * 3 * (k + 1) * (cfg.num_output_layers + 1) * cfg.out_emb_channels * b * atoms)}
    out["total"] = sum(out.values())
    return out


DIMENETPP = AtomicModelKind(
    name="dimenetpp", description="DimeNet++ (Gasteiger et al. 2020), PyG's parameterisation",
    config=dimenetpp.DimeNetPPConfig, model=DimeNetPPModel, presets=dimenetpp.PRESETS,
    count_parameters=dimenetpp.count_parameters, step_bytes=dimenetpp_step_bytes,
    memory_per_worker=dimenetpp_memory, index_sets=("triplets",), symmetric_edges=False,
    width="hidden_channels", labels={"gradient": "DimeNet++", "direct": "DimeNet++ (direct forces)"})

GEMNET_T = AtomicModelKind(
    name="gemnet_t", description="GemNet-T / GemNet-dT (Gasteiger et al. 2021), fairchem's gemnet_t",
    config=gemnet.GemNetTConfig, model=gemnet.GemNetT, presets=gemnet.PRESETS,
    count_parameters=gemnet.count_parameters, step_bytes=gemnet.step_bytes,
    memory_per_worker=gemnet.memory_per_worker, index_sets=("triplets", "id_swap", "triplet_rank"),
    symmetric_edges=True, width="emb_size_edge", labels={"gradient": "GemNet-T", "direct": "GemNet-dT"},
    fit=gemnet_layers.fit_scale_factors)

