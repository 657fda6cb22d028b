"""Every model kind's name and where its entry is defined: the registries of kinds.

* ``CONVS``: the node model kinds (a stack of graph layers; ``mlp`` the no-graph baseline),
  each entry a :class:`~gnnpipe.models.conv_kind.ConvKind` defined beside its layer's ``forward``
  (``gnnpipe.models.<kind>.KIND``);
* ``ATOMIC_MODELS``: the atomic model kinds, each entry a
  :class:`~gnnpipe.atomic.protocol.AtomicModelKind` (``gnnpipe.atomic.protocol``);
* ``ATOMIC_CONFIGS``: the same names, each entry the kind's config dataclass (its sizes), in a
  module without torch (``gnnpipe.atomic.<kind>_config``): ``gnnpipe.config`` derives the kind's
  section of a model config (``models.<name>.<kind>``) and its part of the JSON schema from it
  (``preset_size`` marks the sizes a section may override);
* ``TASKS``: what a run trains (node classification, S2EF, energy-only), each entry a
  :class:`~gnnpipe.tasks.Task` (``gnnpipe.tasks``; ``tasks.task_for`` picks a run's).

All are :class:`~gnnpipe.registry.Registry` instances with lazy entries: the names are known
without importing torch (the config's ``model.kind``, the schema's enum, the CLI's choices), and
an entry is imported the first time it is asked for. A new kind is its line(s) here and its entry
beside its ``forward``; an atomic kind also its config class, and nothing in ``gnnpipe.config``;
a node kind with hyperparameters of its own also adds them to ``ModelConfig``
(``key(..., kinds=(...))``). The order here is the order of enums, choices and reports.
"""

from __future__ import annotations

from dataclasses import field

from .registry import Registry

CONVS = Registry("conv")
for _name in ("gcn", "sage", "gat", "gcnii", "resgcn", "mlp"):
    CONVS.register_lazy(_name, f"gnnpipe.models.{_name}:KIND")

ATOMIC_MODELS = Registry("atomic model")
ATOMIC_MODELS.register_lazy("dimenetpp", "gnnpipe.atomic.protocol:DIMENETPP")
ATOMIC_MODELS.register_lazy("gemnet_t", "gnnpipe.atomic.protocol:GEMNET_T")

#: what a run trains (``gnnpipe.tasks``: its engine, loss, metrics, record, check, payload, evaluate)
TASKS = Registry("task")
TASKS.register_lazy("node_classification", "gnnpipe.tasks:NODE_CLASSIFICATION")
TASKS.register_lazy("s2ef", "gnnpipe.tasks:S2EF_TASK")
TASKS.register_lazy("energy_only", "gnnpipe.tasks:ENERGY_ONLY")

ATOMIC_CONFIGS = Registry("atomic model config")  # the same names; entries without torch
ATOMIC_CONFIGS.register_lazy("dimenetpp", "gnnpipe.atomic.dimenetpp_config:DimeNetPPConfig")
ATOMIC_CONFIGS.register_lazy("gemnet_t", "gnnpipe.atomic.gemnet_config:GemNetTConfig")


def preset_size(default: int, doc: str = ""):
    """A field of an atomic kind's config class that the kind's section of a model config may override
    (``metadata["spec"] == "preset"``: ``Optional``, None there keeping the preset's); ``doc`` is its
    description in the section and the schema. ``"spec": "own"`` puts a field in the section with its own
    type and default. ``gnnpipe.config.atomic_spec`` reads these marks."""
    return field(default=default, metadata={"spec": "preset", "doc": doc} if doc else {"spec": "preset"})
