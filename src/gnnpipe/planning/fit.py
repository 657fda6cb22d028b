"""Does a node run fit its workers' memory? The launcher's question before any worker starts
(``gnnpipe plan --run-config run.yaml --check``, asked by ``gnnpipe.launch``), answered by the
cost model's memory estimate, as ``gnnpipe plan-atomic --check`` answers it for atomic runs.

* The model is built on torch's ``meta`` device: its shape and parameter counts, no weights (a
  ``hidden`` whose weights would not fit is priced, not allocated).
* The graph is its ``graph.h5`` attributes (nodes, stored edges, features, classes: nothing of the
  graph is read) split evenly over the ways and chunks, **without halo**: what a worker holds at
  the least (a partition's halo rows only add), so a refusal never rests on a partition that was
  not made; what a run needs beyond is the out-of-memory line's to name (``gnnpipe.launch``).
* Stages split the layers evenly (``uniform``: the engine's own balancing costs seconds on deep
  stacks); a worker's process is what this one holds after importing torch and the package
  (``ru_maxrss``), as ``plan-atomic`` counts it.

The cap per worker is ``resources.mem_mb_per_worker`` and the machine's share: the memory of the
job's cgroup (else the machine's ``MemTotal``) divided among the workers on one node. A run that
does not fit is refused in one line naming the cap and the smallest layout that fits (graph or
pipeline, P = 1, 2, 4, ... up to ``MAX_TRIED``, for at most ``SEARCH_S`` seconds); a pipelined run
that stores its activations and would fit with ``pipeline.recompute: true`` is told so first.
Recompute is not turned on for it (#36 item 3): it changes the run's time (one more forward per
chunk) and its schedule's memory, which the user chose; the refusal is where the choice is made.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Optional

from ..costmodel.bytes import first_input
from ..costmodel.hardware import load_hardware
from ..graph import read_graph_attrs
from ..io import GnnPipeError
from .plan import layouts
from .predict import predict_layout
from .shape import DTYPE_BYTES, model_shape

MAX_TRIED = 64  # the largest worker count the smallest fitting layout is looked for at
SEARCH_S = 10.0  # seconds the search may take (deep stacks: the estimate's cost grows with stages x layers)


def even_stats(num_nodes: int, num_edges: int, parts) -> dict:
    """Plan statistics of ``parts``-way partitions that split rows and edges evenly, with no halo."""
    def part(k):
        return {"nodes_per_part": [num_nodes / k] * k, "edges_per_part": [num_edges / k] * k,
                "mirrors": [0.0] * k, "inner_per_part": [num_nodes / k] * k}
    return {"num_nodes": num_nodes, "num_edges": num_edges,
            "partitions": {str(k): part(k) for k in sorted(set(parts)) if k > 1}}


def meta_model(model_cfg, in_features: int, num_classes: int):
    """The run's ``GNN`` built on the meta device: shapes without storage."""
    import torch

    from ..models.model import GNN  # imported outside the meta context (its module probes real ops)

    try:
        with torch.device("meta"):
            return GNN(model_cfg, in_features, num_classes)
    except ValueError as e:
        raise GnnPipeError(f"model: {e}") from None


@dataclass
class Fit:
    """A run's estimated memory per worker against its cap, and the smallest layout that fits."""

    run_id: str
    layout: str  # "graph 1 x 4, 4 chunks"
    need: float  # bytes per worker, at the least
    cap: float  # bytes per worker
    cap_name: str
    smallest: Optional[str]  # the fewest workers' layout that fits (None: none up to MAX_TRIED)
    # a pipelined run that stores its activations: its need with ``pipeline.recompute: true``
    recompute_need: Optional[float] = None

    @property
    def fits(self) -> bool:
        return self.need <= self.cap

    def line(self) -> str:
        gib = 2**30
        head = (f"run {self.run_id} ({self.layout}) needs at least {self.need / gib:.2f} GiB per worker "
                f"(the cost model's estimate, gnnpipe plan)")
        if self.fits:
            return f"{head}, within the cap of {self.cap / gib:.2f} GiB per worker ({self.cap_name})"
        advice = (f"the smallest layout that fits is {self.smallest}" if self.smallest else
                  f"no layout of up to {MAX_TRIED} workers was found to fit: use a smaller model")
        if self.recompute_need is not None and self.recompute_need <= self.cap:
            advice = (f"with pipeline.recompute: true it needs {self.recompute_need / gib:.2f} GiB and fits "
                      f"(one more forward per chunk), or {advice}")
        return (f"{head}, above the cap of {self.cap / gib:.2f} GiB per worker ({self.cap_name}); {advice}, "
                f"or raise the cap if the workers have more memory")


def _describe(mode: str, s: int, g: int, c: int, chunks: bool = True) -> str:
    """``graph 1 x 4, 4 chunks (4 workers)``: mode, stages x ways, chunks, workers."""
    p = s * g
    return ("single (1 worker)" if mode == "single" else
            f"{mode} {s} x {g}{f', {c} chunks' if chunks else ''} ({p} worker{'s' if p > 1 else ''})")


def fit_run(cfg, mem_mb: Optional[int], machine_bytes: Optional[int], overhead: float,
            workers_per_node: Optional[int] = None) -> Fit:
    """The :class:`Fit` of node run ``cfg`` (a ``RunConfig``): its memory per worker at its layout
    against ``min(mem_mb MiB, machine_bytes / workers on a node)``, and the smallest layout that fits."""
    if cfg.atomic:
        raise GnnPipeError(f"run {cfg.run_id} trains an atomic model ({cfg.model.kind}): gnnpipe plan-atomic sizes it")
    if mem_mb is None and machine_bytes is None:
        raise GnnPipeError("no memory to size the run against: give --mem-mb-per-worker")
    attrs = read_graph_attrs(cfg.graph_path)
    N, E = int(attrs["num_nodes"]), int(attrs["num_edges"])
    gnn = meta_model(cfg.model, int(attrs["num_features"]), int(attrs["num_classes"]))
    shape = model_shape(gnn) if len(gnn.convs) else None
    hw = dataclasses.replace(load_hardware("cpu-2core"), process_overhead_gib=overhead / 2**30)
    b = DTYPE_BYTES[cfg.training.dtype]

    def cap(p: int) -> tuple[float, str]:
        caps = [] if mem_mb is None else [(mem_mb * 2**20, f"resources.mem_mb_per_worker = {mem_mb}")]
        if machine_bytes is not None:
            on_node = min(p, workers_per_node or p)
            caps.append((machine_bytes / on_node, f"{machine_bytes / 2**30:.2f} GiB of this machine "
                                                  f"over {on_node} worker{'s' if on_node > 1 else ''}"))
        return min(caps)

    def need(mode: str, s: int, g: int, c: int, pipeline_cfg=cfg.pipeline) -> float:
        if shape is None:  # mlp: no graph layers, a single process holds the features and the model
            params = sum(p.numel() for p in gnn.parameters())
            return overhead + N * (gnn.in_features + 2 * gnn.hidden) * b + 4.0 * params * b
        stats = even_stats(N, E, (g, c))
        return predict_layout(stats, gnn, shape, hw, mode, s, g, c, dtype_bytes=b,
                              overlap=cfg.graph_parallel.overlap, balance="uniform",
                              first_input=first_input(gnn, cfg.graph_parallel),
                              pipeline_cfg=pipeline_cfg).peak_mem_bytes

    own = need(cfg.mode, cfg.stages, cfg.ways, cfg.chunks)
    cap_bytes, cap_name = cap(cfg.workers)
    smallest, p, start = None, 1, time.monotonic()
    while (own > cap_bytes and smallest is None and p <= min(MAX_TRIED, N if shape else 1)
           and time.monotonic() - start < SEARCH_S):
        # graph and pipeline, one chunk per stage: with rows split evenly a worker holds about the same
        # whatever the chunk count (GPipe keeps every chunk's activations), and the estimate's cost
        # grows with chunks x layers
        rows = [r for r in layouts(p, len(gnn.convs), 1) if r[0] != "hybrid"]
        fitting = sorted((need(*row), row) for row in rows)
        if fitting and fitting[0][0] <= cap(p)[0]:
            smallest = _describe(*fitting[0][1], chunks=False)
        p *= 2
    again = None  # recompute is the run's own switch, not turned on for it: it costs a forward per chunk
    if own > cap_bytes and shape is not None and cfg.stages > 1 and not cfg.pipeline.recompute:
        again = need(cfg.mode, cfg.stages, cfg.ways, cfg.chunks, dataclasses.replace(cfg.pipeline, recompute=True))
    return Fit(cfg.run_id, _describe(cfg.mode, cfg.stages, cfg.ways, cfg.chunks), own, cap_bytes, cap_name, smallest,
               again)
