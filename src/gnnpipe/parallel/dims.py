"""The names this module had before ``gnnpipe.layout`` and ``gnnpipe.parallel.groups`` (kept
for callers not yet moved; import from those two)."""

from ..layout import (MODES, PIPELINED, ParallelDims, RankGroups, check_layout, check_stages,  # noqa: F401
                      default_chunks, resolve_layout)
from .groups import ProcessGroups, build_groups  # noqa: F401
