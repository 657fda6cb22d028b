"""The atomic model protocol and the registry of atomic model kinds.

An atomic model is an ``nn.Module`` built from its config dataclass whose

    forward(g: AtomGraph, forces: bool = True) -> {"energy": (B,), "forces": (N_own, 3)}

returns the energies of the batch's systems (replicated in a graph-parallel group) and the
forces on the view's own atoms, by gradient (``-dE/dpos``; the graph is kept for a loss on the
forces when the model is in training mode) or by a direct head; ``forces=False`` returns
``{"energy"}`` alone, from the forward pass alone (energy-only training: no force pass, no
double backward, no force head). The model reads only what the
``AtomGraph`` holds and reduces only through its calls, so it runs unchanged as one rank of a
graph-parallel group. The trainer never reaches into its submodules.

A kind is registered once (its name in ``gnnpipe.kinds``, its entry here, its config class —
torch-free, ``ATOMIC_CONFIGS`` — in ``<kind>_config.py``, from which ``gnnpipe.config`` derives
the kind's section of a model config and of the schema), with
everything the rest of the package asks about it (:class:`AtomicModelKind`): the config class and its presets, the model class, the exact
parameter count, the closed-form bytes of a training step, the memory per worker, and the
``AtomGraph`` index sets and edge symmetry its graphs must have. Schema enums and CLI choices
are ``ATOMIC_MODELS.names()``; a model is ``ATOMIC_MODELS[kind].build(cfg)``.

Kinds:

* ``dimenetpp`` — DimeNet++ (``atomic/dimenetpp.py``: :class:`~gnnpipe.atomic.dimenetpp.DimeNetPPModel`,
  the PyG-shaped ``DimeNetPP`` whose ``forward`` returns the dict; its sizes and costs in
  ``atomic/dimenetpp_costs.py``);
* ``gemnet_t`` — GemNet-T and GemNet-dT (``atomic/gemnet.py``): one architecture, the force
  head a config field (``force_head: gradient`` = GemNet-T, ``direct`` = GemNet-dT), as
  DimeNet++'s and as fairchem registers it (``gemnet_t`` with ``direct_forces``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Optional

from torch import nn

from ..kinds import ATOMIC_MODELS
from . import dimenetpp, dimenetpp_costs, gemnet, gemnet_layers
from .dimenetpp import DimeNetPPModel

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
    # cfg -> {"kj", "swap", "atoms": width}: the rows of the atoms layout's halo exchanges per interaction
    # block (input edges, reverse edges, ghost embeddings; 0: not exchanged); halo.step_bytes prices them
    halo_widths: Callable[[Any], dict]
    # (cfg, atoms, edges, triplets, ways, dtype_bytes, **counts) -> {part: bytes, "total": bytes};
    # counts: optional kind-specific sizes, measured on a batch by ``batch_counts``
    memory_per_worker: Callable[..., dict]
    index_sets: tuple[str, ...]  # AtomGraph index sets the model reads
    symmetric_edges: bool  # needs every edge's reverse (id_swap)
    width: str  # the config field the run record reports as the model's ``hidden`` width
    labels: Mapping[str, str]  # force head -> the model's name in reports ("GemNet-T", "GemNet-dT")
    # (model, whole-batch AtomGraphs in one process) -> {name: value}: constants fitted once before
    # training and kept in the state dict (GemNet's scale factors); None: nothing to fit
    fit: Optional[Callable[[nn.Module, list], dict]] = None
    # (batch arrays, ways) -> the counts memory_per_worker takes (DimeNet++: its padded triplet
    # blocks, largest way); None: the kind's estimate needs only atoms, edges and triplets
    batch_counts: Optional[Callable[[dict, int], dict]] = None
    # (cfg, atoms, edges, triplets, halo_edges, dtype_bytes) -> {part: bytes, "total": bytes}: one
    # inference call's peak on a worker's view (the domains layout's plan); None: not estimated yet
    inference_memory: Optional[Callable[..., dict]] = None

    def preset(self, name: str, **over) -> Any:
        """The config of preset ``name`` with ``over`` replacing fields (None values are ignored)."""
        if name not in self.presets:
            raise ValueError(f"{self.name}: unknown preset {name!r}; known: {', '.join(self.presets)}")
        return self.config(**{**self.presets[name], **{k: v for k, v in over.items() if v is not None}})

    def build(self, cfg) -> nn.Module:
        return self.model(cfg)

    def config_fields(self) -> list[str]:
        return [f.name for f in fields(self.config)]


# --------------------------------------------------------------------------- the kinds
DIMENETPP = AtomicModelKind(
    name="dimenetpp", description="DimeNet++ (Gasteiger et al. 2020), PyG's parameterisation",
    config=dimenetpp.DimeNetPPConfig, model=DimeNetPPModel, presets=dimenetpp.PRESETS,
    count_parameters=dimenetpp.count_parameters, step_bytes=dimenetpp_costs.step_bytes,
    halo_widths=dimenetpp.halo_widths,
    memory_per_worker=dimenetpp_costs.memory_per_worker, batch_counts=dimenetpp_costs.block_counts,
    inference_memory=dimenetpp_costs.inference_memory,
    index_sets=("triplets",), symmetric_edges=False,
    width="hidden_channels", labels={"gradient": "DimeNet++", "direct": "DimeNet++ (direct forces)"})

GEMNET_T = AtomicModelKind(
    name="gemnet_t", description="GemNet-T / GemNet-dT (Gasteiger et al. 2021), fairchem's gemnet_t",
    config=gemnet.GemNetTConfig, model=gemnet.GemNetT, presets=gemnet.PRESETS,
    count_parameters=gemnet.count_parameters, step_bytes=gemnet.step_bytes, halo_widths=gemnet.halo_widths,
    memory_per_worker=gemnet.memory_per_worker, inference_memory=gemnet.inference_memory,
    index_sets=("triplets", "id_swap", "triplet_rank"),
    symmetric_edges=True, width="emb_size_edge", labels={"gradient": "GemNet-T", "direct": "GemNet-dT"},
    fit=gemnet_layers.fit_scale_factors)

