"""Every model kind's name and where its entry is defined: the two registries of kinds.

* ``CONVS``: the node model kinds (a stack of graph layers; ``mlp`` the no-graph baseline),
  each entry a :class:`~gnnpipe.models.kinds.ConvKind` defined beside its layer's ``forward``
  (``gnnpipe.models.<kind>.KIND``);
* ``ATOMIC_MODELS``: the atomic model kinds, each entry a
  :class:`~gnnpipe.atomic.protocol.AtomicModelKind` (``gnnpipe.atomic.protocol``).

Both are :class:`~gnnpipe.registry.Registry` instances with lazy entries: the names are known
without importing torch (the config's ``model.kind``, the schema's enum that
``workflow/rules/common.smk`` injects, the CLI's choices), and an entry is imported the first
time it is asked for. A new kind is one line here and its entry beside its ``forward``; the
order here is the order of enums, choices and reports.
"""

from __future__ import annotations

from .registry import Registry

CONVS = Registry("conv")
for _name in ("gcn", "sage", "gat", "gcnii", "resgcn", "mlp"):
    CONVS.register_lazy(_name, f"gnnpipe.models.{_name}:KIND")

ATOMIC_MODELS = Registry("atomic model")
ATOMIC_MODELS.register_lazy("dimenetpp", "gnnpipe.atomic.protocol:DIMENETPP")
ATOMIC_MODELS.register_lazy("gemnet_t", "gnnpipe.atomic.protocol:GEMNET_T")
