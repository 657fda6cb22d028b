"""``ParallelDims``: the one validated object that says how the workers are laid out.

Ranks are laid out stage-major: ``rank = stage * ways + way``. So

* ``graph``    : S = 1, G = P   (every rank is a way of the one stage)
* ``pipeline`` : S = P, G = 1   (every rank is a stage)
* ``hybrid``   : S x G
* ``single``   : S = G = 1, no process group at all.

``build_groups`` creates the sub-groups once (``torch.distributed.new_group`` must be
called by every rank in the same order) and returns them in a ``ProcessGroups``
object that is passed explicitly to the engines: no module-global state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from ..io import GnnPipeError


@dataclass(frozen=True)
class ParallelDims:
    mode: str
    world_size: int
    stages: int = 1
    ways: int = 1
    data: int = 1  # data-parallel replicas (atomic models): rank = replica * stages * ways + ...

    def __post_init__(self):
        if self.mode not in ("single", "graph", "pipeline", "hybrid"):
            raise GnnPipeError(f"unknown mode {self.mode!r}")
        if self.stages < 1 or self.ways < 1:
            raise GnnPipeError(f"stages ({self.stages}) and ways ({self.ways}) must be >= 1")
        if self.data < 1 or (self.data > 1 and self.mode != "graph"):
            raise GnnPipeError(f"mode {self.mode}: data-parallel replicas ({self.data}) are for mode graph only")
        if self.data * self.stages * self.ways != self.world_size:
            n = self.data * self.stages * self.ways
            raise GnnPipeError(
                f"mode {self.mode}: replicas ({self.data}) x stages ({self.stages}) x ways ({self.ways}) = "
                f"{n}, but the world has {self.world_size} processes; launch with torchrun --nproc-per-node {n}")
        expected = {"single": (1, 1), "graph": (1, self.world_size // self.data), "pipeline": (self.world_size, 1)}
        if self.mode in expected and (self.stages, self.ways) != expected[self.mode]:
            s, g = expected[self.mode]
            raise GnnPipeError(f"mode {self.mode} on {self.world_size} workers needs stages={s}, "
                               f"ways={g}; got stages={self.stages}, ways={self.ways}")

    def stage_of(self, rank: int) -> int:
        return rank // self.ways

    def way_of(self, rank: int) -> int:
        return rank % self.ways

    def rank_of(self, stage: int, way: int) -> int:
        return stage * self.ways + way

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks of one stage: its G graph-parallel ways."""
        return [self.rank_of(stage, g) for g in range(self.ways)]

    def replica_ranks(self, replica: int) -> list[int]:
        """The ranks of one data-parallel replica (its graph-parallel group, for mode graph)."""
        n = self.stages * self.ways
        return list(range(replica * n, (replica + 1) * n))

    def data_ranks(self, index: int) -> list[int]:
        """The ranks holding the same shard in every replica (gradient all-reduce across replicas)."""
        n = self.stages * self.ways
        return list(range(index, self.world_size, n))

    def way_ranks(self, way: int) -> list[int]:
        """The ranks of one way: its S pipeline stages, in order."""
        return [self.rank_of(s, way) for s in range(self.stages)]


@dataclass
class ProcessGroups:
    """The groups one rank takes part in. ``None`` groups mean "the default world"."""

    dims: ParallelDims
    rank: int
    world: Optional[dist.ProcessGroup]  # all ranks
    stage: Optional[dist.ProcessGroup]  # the ways of this rank's stage (halo exchange, grad all-reduce)

    @property
    def stage_index(self) -> int:
        return self.dims.stage_of(self.rank)

    @property
    def way_index(self) -> int:
        return self.dims.way_of(self.rank)

    def prev_rank(self) -> Optional[int]:
        """Global rank of the same way on the previous stage, or None on stage 0."""
        s = self.stage_index
        return None if s == 0 else self.dims.rank_of(s - 1, self.way_index)

    def next_rank(self) -> Optional[int]:
        s = self.stage_index
        return None if s == self.dims.stages - 1 else self.dims.rank_of(s + 1, self.way_index)


def build_groups(dims: ParallelDims, rank: int) -> ProcessGroups:
    """Create this rank's sub-groups. Every rank must call it, in the same order."""
    world = dist.group.WORLD if dist.is_initialized() else None
    stage_group = world
    if dims.stages > 1 and dims.ways > 1:
        for s in range(dims.stages):  # every rank creates every group, in order
            g = dist.new_group(dims.stage_ranks(s))
            if s == dims.stage_of(rank):
                stage_group = g
    return ProcessGroups(dims=dims, rank=rank, world=world, stage=stage_group)
