"""How the workers are laid out: the degrees, the rank layout and the layout rules, in one place.

The ground floor of the package (it imports nothing of gnnpipe but ``io``): the config, the
engines, the cost model, ``gnnpipe plan`` and the workflow's run ids all ask it, so a layout
one accepts the others accept too.

``ParallelDims`` is the validated object of the degrees, one per axis, named for what it
splits:

* ``data``   replicas: the batch (atomic runs), each replica a whole ``stages x ways`` layout;
* ``stages`` pipeline stages: the model's layers, in contiguous blocks;
* ``ways``   graph ways: the graph's rows, in contiguous blocks of chunks.

Ranks are laid out replica-major, then stage-major::

    rank = replica * (stages * ways) + stage * ways + way

So, with one replica (``data = 1``, every node-model mode):

* ``graph``    : S = 1, G = P   (every rank is a way of the one stage)
* ``pipeline`` : S = P, G = 1   (every rank is a stage)
* ``hybrid``   : S x G
* ``single``   : S = G = 1, no process group at all.

A rank belongs to three groups, each named for the axis it spans (``RankGroups``):
``graph`` (the G ways of its stage: halo exchange, the stage's gradient all-reduce; the atomic
engine's edge split), ``pipeline`` (the S stages of its way, in order) and ``data`` (its
replicas). ``gnnpipe.parallel.groups.build_groups`` turns them into process groups.

``check_layout`` / ``resolve_layout`` add the chunks (the chunk store's parts) and the
model's depth to the degrees, with the defaults of a run that sets none
(``DEFAULT_CHUNKS_PER_STAGE``, :func:`default_chunks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

from .io import GnnPipeError

MODES = ("single", "graph", "pipeline", "hybrid")
PIPELINED = ("pipeline", "hybrid")  # the modes whose store holds chunks, not one part per worker
#: chunks per stage of a pipelined run that sets no ``chunks`` (``pipeline.chunks_per_stage``)
DEFAULT_CHUNKS_PER_STAGE = 4


class RankGroups(NamedTuple):
    """The global ranks of the groups one rank belongs to (``ParallelDims.rank_groups``)."""

    data: list[int]  # the replicas of this rank's (stage, way): gradient averaging across replicas
    graph: list[int]  # the graph ways of this rank's stage in its replica: halo exchange, the stage's all-reduce
    pipeline: list[int]  # the stages of this rank's way in its replica, in order


@dataclass(frozen=True)
class ParallelDims:
    mode: str
    world_size: int
    stages: int = 1  # pipeline stages
    ways: int = 1  # graph ways
    data: int = 1  # data-parallel replicas of the stages x ways layout

    def __post_init__(self):
        if self.mode not in MODES:
            raise GnnPipeError(f"unknown mode {self.mode!r} (known: {', '.join(MODES)})")
        if self.stages < 1 or self.ways < 1 or self.data < 1:
            raise GnnPipeError(f"mode {self.mode}: data ({self.data}), stages ({self.stages}) and "
                               f"ways ({self.ways}) must be >= 1")
        n = self.data * self.stages * self.ways
        if n != self.world_size:
            raise GnnPipeError(
                f"mode {self.mode}: data ({self.data}) x stages ({self.stages}) x ways ({self.ways}) "
                f"= {n}, but the world has {self.world_size} processes; launch with torchrun "
                f"--nproc-per-node {n}")
        per_replica = self.stages * self.ways
        expected = {"single": (1, 1), "graph": (1, per_replica), "pipeline": (per_replica, 1)}
        if self.mode in expected and (self.stages, self.ways) != expected[self.mode]:
            s, g = expected[self.mode]
            raise GnnPipeError(f"mode {self.mode} on {self.world_size} workers needs stages={s}, "
                               f"ways={g}; got stages={self.stages}, ways={self.ways}")

    @property
    def replica_size(self) -> int:
        """Ranks of one replica: ``stages * ways``."""
        return self.stages * self.ways

    def replica_of(self, rank: int) -> int:
        return rank // self.replica_size

    def stage_of(self, rank: int) -> int:
        return rank % self.replica_size // self.ways

    def way_of(self, rank: int) -> int:
        return rank % self.ways

    def rank_of(self, stage: int, way: int, replica: int = 0) -> int:
        return replica * self.replica_size + stage * self.ways + way

    def graph_ranks(self, stage: int, replica: int = 0) -> list[int]:
        """The ranks of one stage's graph group: its G ways."""
        return [self.rank_of(stage, g, replica) for g in range(self.ways)]

    def pipeline_ranks(self, way: int, replica: int = 0) -> list[int]:
        """The ranks of one way's pipeline: its S stages, in order."""
        return [self.rank_of(s, way, replica) for s in range(self.stages)]

    def data_ranks(self, stage: int, way: int) -> list[int]:
        """The ranks of one (stage, way) across the replicas."""
        return [self.rank_of(stage, way, r) for r in range(self.data)]

    def rank_groups(self, rank: int) -> RankGroups:
        """The ranks of ``rank``'s data-parallel group, graph group and pipeline."""
        if not 0 <= rank < self.world_size:
            raise GnnPipeError(f"rank {rank} is outside a world of {self.world_size}")
        s, g, r = self.stage_of(rank), self.way_of(rank), self.replica_of(rank)
        return RankGroups(data=self.data_ranks(s, g), graph=self.graph_ranks(s, r),
                          pipeline=self.pipeline_ranks(g, r))


# --------------------------------------------------------------------------- chunks and depth
def default_chunks(stages: int, ways: int, chunks_per_stage: int = DEFAULT_CHUNKS_PER_STAGE) -> int:
    """The chunks of a pipelined layout that sets none: ``chunks_per_stage`` per stage,
    rounded up to a multiple of the ways (each way owns ``chunks / ways`` of them)."""
    return -(-chunks_per_stage * stages // ways) * ways


def check_stages(stages: int, layers: int, where: str = "layout") -> None:
    """Every stage owns at least one conv."""
    if stages < 1:
        raise GnnPipeError(f"{where}: need at least one stage, got {stages}")
    if stages > layers:
        raise GnnPipeError(f"{where}: {stages} stages but the model has only {layers} graph layers: "
                           f"every stage needs at least one (use stages <= layers)")


def check_layout(mode: str, workers: int, stages: int, ways: int, chunks: int, *,
                 layers: Optional[int] = None, exact_ok: bool = False, where: str = "layout") -> ParallelDims:
    """Refuse a layout no engine runs, with the reason; returns its ``ParallelDims``.

    ``chunks``: the parts of the chunk store (``graph``: one per way; ``single``: 1).
    Pipelined modes need ``chunks`` a positive multiple of ``ways`` and ``chunks >= stages``
    (fewer chunks leave stages idle all epoch); ``exact_ok`` also accepts one chunk per
    way (plain, exact model parallelism: the engines' exactness configuration, which the
    workflow does not schedule). ``layers``: the model's graph layers (stages <= layers).
    """
    if workers < 1:
        raise GnnPipeError(f"{where}: workers must be >= 1, got {workers}")
    try:
        dims = ParallelDims(mode, workers, stages, ways)
    except GnnPipeError as e:
        raise GnnPipeError(f"{where}: {e}") from None
    if mode not in PIPELINED:
        if chunks != (ways if mode == "graph" else 1):
            raise GnnPipeError(f"{where}: mode {mode} on {workers} workers uses {ways if mode == 'graph' else 1} "
                               f"part(s), got chunks={chunks}")
        return dims
    if layers is not None:
        check_stages(stages, layers, where)
    if chunks < ways or chunks % ways:
        raise GnnPipeError(f"{where}: chunks ({chunks}) must be a positive multiple of ways ({ways}) "
                           f"(each way owns chunks/ways of them)")
    if chunks < stages and not (exact_ok and chunks == ways):
        exact = " (or one chunk per way: plain, exact model parallelism)" if exact_ok else ""
        raise GnnPipeError(f"{where}: chunks ({chunks}) must be >= stages ({stages}){exact}, or some "
                           f"stage idles all epoch")
    return dims


def resolve_layout(mode: str, workers: int, *, stages: Optional[int] = None, chunks: Optional[int] = None,
                   chunks_per_stage: int = DEFAULT_CHUNKS_PER_STAGE, layers: Optional[int] = None,
                   where: str = "layout") -> tuple[int, int, int, int]:
    """``(workers, stages, ways, chunks)`` of ``mode`` on ``workers`` workers, with the mode's
    defaults (pipeline: S = P; hybrid: S = ``stages``, G = P / S; chunks:
    :func:`default_chunks`), validated by :func:`check_layout`."""
    if mode not in MODES:
        raise GnnPipeError(f"{where}: unknown mode {mode!r} (known: {', '.join(MODES)})")
    if workers < 1:
        raise GnnPipeError(f"{where}: workers must be >= 1, got {workers}")
    if mode == "single":
        if workers != 1:
            raise GnnPipeError(f"{where}: mode single takes workers: 1")
        s, g, c = 1, 1, 1
    elif mode == "graph":
        s, g, c = 1, workers, workers
    else:
        s = workers if mode == "pipeline" else (stages or 1)
        if s < 1 or workers % s:
            raise GnnPipeError(f"{where}: workers ({workers}) must be a multiple of stages ({s})")
        g = workers // s
        c = chunks or default_chunks(s, g, chunks_per_stage)
    check_layout(mode, workers, s, g, c, layers=layers, where=where)
    return workers, s, g, c
