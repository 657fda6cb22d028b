"""Process groups: the groups of ``gnnpipe.layout.ParallelDims``, created once and passed explicitly.

``build_groups`` creates the sub-groups (``torch.distributed.new_group`` must be called by
every rank in the same order) and returns them in a ``ProcessGroups`` object that is passed
explicitly to the engines: no module-global state. Each group is named for the axis it spans
(``gnnpipe.layout``): ``graph`` (the ways of this rank's stage), ``data`` (its replicas); the
pipeline's neighbours are ranks (``prev_rank`` / ``next_rank``), not a group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from ..layout import ParallelDims


# --------------------------------------------------------------------------- process groups
@dataclass
class ProcessGroups:
    """The groups one rank takes part in. ``None`` groups mean "the default world"."""

    dims: ParallelDims
    rank: int
    world: Optional[dist.ProcessGroup]  # all ranks
    # the graph ways of this rank's stage (halo exchange, grad all-reduce); used only with ways > 1
    # (with one way and one replica it is the world, as before; with replicas, not built)
    graph: Optional[dist.ProcessGroup]
    data: Optional[dist.ProcessGroup] = None  # the replicas of this rank's (stage, way); data > 1 only

    @property
    def stage_index(self) -> int:
        return self.dims.stage_of(self.rank)

    @property
    def way_index(self) -> int:
        return self.dims.way_of(self.rank)

    @property
    def replica_index(self) -> int:
        return self.dims.replica_of(self.rank)

    def prev_rank(self) -> Optional[int]:
        """Global rank of the same way on the previous stage, or None on stage 0."""
        s = self.stage_index
        return None if s == 0 else self.dims.rank_of(s - 1, self.way_index, self.replica_index)

    def next_rank(self) -> Optional[int]:
        s = self.stage_index
        return None if s == self.dims.stages - 1 else self.dims.rank_of(s + 1, self.way_index,
                                                                         self.replica_index)


def build_groups(dims: ParallelDims, rank: int) -> ProcessGroups:
    """Create this rank's sub-groups (only those a layout needs). Every rank must call it,
    in the same order."""
    world = dist.group.WORLD if dist.is_initialized() else None
    mine = dims.rank_groups(rank)
    graph_group = world if dims.data == 1 else None
    if dims.ways > 1 and len(mine.graph) < dims.world_size:
        for r in range(dims.data):  # every rank creates every group, in order
            for s in range(dims.stages):
                ranks = dims.graph_ranks(s, r)
                g = dist.new_group(ranks)
                if ranks == mine.graph:
                    graph_group = g
    data_group = None
    if dims.data > 1:
        data_group = world
        if len(mine.data) < dims.world_size:
            for s in range(dims.stages):
                for w in range(dims.ways):
                    ranks = dims.data_ranks(s, w)
                    g = dist.new_group(ranks)
                    if ranks == mine.data:
                        data_group = g
    return ProcessGroups(dims=dims, rank=rank, world=world, graph=graph_group, data=data_group)
