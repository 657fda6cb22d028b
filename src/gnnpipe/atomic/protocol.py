"""The atomic model protocol and the registry of atomic model kinds.

An atomic model is an ``nn.Module`` built from its config dataclass whose

    forward(g: AtomGraph) -> {"energy": (B,), "forces": (N_own, 3)}

returns the energies of the batch's systems (replicated in a graph-parallel group) and the
forces on the view's own atoms, by gradient (``-dE/dpos``; the graph is kept for a loss on the
forces when the model is in training mode) or by a direct head. The model reads only what the
``AtomGraph`` holds and reduces only through its calls, so it runs unchanged as one rank of a
graph-parallel group. The trainer never reaches into its submodules.

A kind is registered once, with everything the rest of the package asks about it
(:class:`AtomicModelKind`): the config class and its presets, the model class, the exact
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
from typing import Any, Callable, Mapping

from torch import nn

from ..registry import Registry
from . import dimenetpp, gemnet
from .batch import AtomGraph, gradient_forces


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
    # (cfg, atoms, edges, triplets, ways, dtype_bytes, **counts) -> {part: bytes, "total": bytes};
    # counts: optional kind-specific sizes (DimeNet++: its padded triplet blocks, engine.block_counts)
    memory_per_worker: Callable[..., dict]
    index_sets: tuple[str, ...]  # AtomGraph index sets the model reads
    symmetric_edges: bool  # needs every edge's reverse (id_swap)

    def preset(self, name: str, **over) -> Any:
        """The config of preset ``name`` with ``over`` replacing fields (None values are ignored)."""
        if name not in self.presets:
            raise ValueError(f"{self.name}: unknown preset {name!r}; known: {', '.join(self.presets)}")
        return self.config(**{**self.presets[name], **{k: v for k, v in over.items() if v is not None}})

    def build(self, cfg) -> nn.Module:
        return self.model(cfg)

    def config_fields(self) -> list[str]:
        return [f.name for f in fields(self.config)]


ATOMIC_MODELS: Registry[AtomicModelKind] = Registry("atomic model")


# --------------------------------------------------------------------------- DimeNet++
class DimeNetPPModel(dimenetpp.DimeNetPP):
    """DimeNet++ on the protocol: the same module (state dict = PyG's names), ``forward`` -> dict."""

    def forward(self, g: AtomGraph) -> dict:
        if self.cfg.force_head == "direct":
            energy, forces = dimenetpp.energy_and_forces(self, g, create_graph=False)
            return {"energy": energy, "forces": forces}
        return gradient_forces(super().forward, g, self.training)


def _dimenetpp_bytes(cfg, edges, atoms, systems, ways, dtype_bytes, params) -> int:
    from .engine import step_bytes  # engine imports dimenetpp: no cycle at import time
    return step_bytes(cfg, edges, atoms, systems, ways, dtype_bytes, params)


def _dimenetpp_memory(cfg, atoms, edges, triplets, ways, dtype_bytes=4, **blocks) -> dict:
    from .engine import memory_per_worker
    return memory_per_worker(cfg, atoms, edges, triplets, ways, dtype_bytes, **blocks)


ATOMIC_MODELS.register("dimenetpp", AtomicModelKind(
    name="dimenetpp", description="DimeNet++ (Gasteiger et al. 2020), PyG's parameterisation",
    config=dimenetpp.DimeNetPPConfig, model=DimeNetPPModel, presets=dimenetpp.PRESETS,
    count_parameters=dimenetpp.count_parameters, step_bytes=_dimenetpp_bytes,
    memory_per_worker=_dimenetpp_memory, index_sets=("triplets",), symmetric_edges=False))

ATOMIC_MODELS.register("gemnet_t", AtomicModelKind(
    name="gemnet_t", description="GemNet-T / GemNet-dT (Gasteiger et al. 2021), fairchem's gemnet_t",
    config=gemnet.GemNetTConfig, model=gemnet.GemNetT, presets=gemnet.PRESETS,
    count_parameters=gemnet.count_parameters, step_bytes=gemnet.step_bytes,
    memory_per_worker=gemnet.memory_per_worker, index_sets=("triplets", "id_swap", "triplet_rank"),
    symmetric_edges=True))

