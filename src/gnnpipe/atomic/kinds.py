"""The names of the atomic model kinds and where each is defined: ``ATOMIC_MODELS``.

A light module (no torch): the config, the schema's enum and the CLI's choices read the names
from here; an entry (``protocol.AtomicModelKind``: config class, model, presets, counts, costs)
is imported from ``gnnpipe.atomic.protocol`` the first time it is asked for. A new kind is one
line here and its entry in ``protocol.py``.
"""

from __future__ import annotations

from ..registry import Registry

ATOMIC_MODELS = Registry("atomic model")
ATOMIC_MODELS.register_lazy("dimenetpp", "gnnpipe.atomic.protocol:DIMENETPP")
ATOMIC_MODELS.register_lazy("gemnet_t", "gnnpipe.atomic.protocol:GEMNET_T")
