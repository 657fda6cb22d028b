"""The prediction of one layout (``predict_layout``): the stage split the engine would make, the
buffers it would keep, the cost model's estimate on the partition statistics. What ``gnnpipe
plan`` does for every layout and the report does for every run."""

from __future__ import annotations

from typing import Optional

from ..config import PipelineConfig
from ..costmodel.estimate import Estimate, WayStats, estimate
from ..io import heap_retained
from ..costmodel.hardware import Hardware
from ..costmodel.work import ModelShape, gather_work, layer_cost, loss_work, rowwise_work
from ..io import GnnPipeError


def stage_bounds(model, stages: int, balance: str, num_nodes: int, num_edges: int,
                 shape: ModelShape, hw: Hardware,
                 sample: Optional[tuple[float, float, float]] = None) -> list[tuple[int, int]]:
    """The stage split the pipeline engine would use (``gnnpipe.parallel.balance``):
    ``estimate`` from the model's whole-graph FLOPs, ``profile`` from per-conv times on a
    sample chunk (the engine times its largest chunk; here the cost model's prediction for
    ``sample = (rows, source rows, in-edges)``), ``uniform``."""
    # the engine's own split functions, imported here: their module imports torch (the engine's
    # profiling), and importing the report or the planner must not (#36: ~3 s a job)
    from ..parallel.balance import balanced_bounds, estimate_costs, uniform_bounds

    L = len(model.convs)
    if stages == 1:
        return [(0, L)]
    if balance == "uniform":
        return uniform_bounds(L, stages)
    if balance == "estimate":
        costs, first, last = estimate_costs(model, num_nodes, num_edges)
    elif balance == "profile":
        n, src, e = sample or (num_nodes, num_nodes, num_edges)
        costs = []
        for spec, d in zip(shape.layers, shape.exchange_dims):
            lc = layer_cost(spec, n, src, e)
            gf, gb = gather_work(n, src, d, spec.input_grad)
            costs.append((lc.training() + gf + gb).seconds(hw))
        first = rowwise_work(shape.encoder, n, False, shape.encoder_dropout).seconds(hw)
        last = (rowwise_work(shape.decoder, n, True) + loss_work(n, shape.num_classes)).seconds(hw)
    else:
        raise GnnPipeError(f"unknown stage balance {balance!r} (uniform, estimate, profile)")
    return balanced_bounds(costs, stages, first, last)


def history_buffers(pc: PipelineConfig) -> int:
    """Whole-graph buffers the pipeline engine keeps per buffered conv input: the current
    rows and their gradients, a snapshot (technique 3), a second history (momentum, or
    recompute without snapshots)."""
    return 2 + (pc.snapshot_every > 0) + (pc.momentum > 0 or (pc.recompute and pc.snapshot_every == 0))


def predict_layout(graph_stats: dict, gnn, shape: ModelShape, hardware: Hardware, mode: str,
                   stages: int, ways: int, chunks: int, *, dtype_bytes: int = 4, overlap: bool = True,
                   balance: str = "estimate", first_input: str = "local",
                   pipeline_cfg: Optional[PipelineConfig] = None, retained_heap: Optional[bool] = None) -> Estimate:
    """The estimate of one layout (``mode``, ``stages`` x ``ways``, ``chunks``) of the built
    model ``gnn`` (``shape = model_shape(gnn)``), with ``memory["fits"]`` set. ``retained_heap``:
    whether the run's processes keep freed memory (default: as a training process started from
    this one's environment would, ``heap_retained``)."""
    pc = pipeline_cfg or PipelineConfig()
    N, E = int(graph_stats["num_nodes"]), int(graph_stats["num_edges"])
    parts = graph_stats.get("partitions", {})
    for k in {ways, chunks}:
        if k > 1 and str(k) not in parts:
            raise GnnPipeError(f"graph statistics lack a {k}-part partition (needed by {mode} "
                               f"{stages} x {ways}, {chunks} chunks); have "
                               f"{', '.join(sorted(parts, key=int)) or 'none'}")
    # a hybrid's ways are blocks of chunks: their statistics where the file has them (graph_stats),
    # else those of a G-way partition of their own (extrapolated statistics)
    of_chunks = graph_stats.get("chunk_ways", {}).get(str(chunks), {}).get(str(ways))
    if ways > 1 and chunks > ways and of_chunks is not None:
        way_stats = WayStats.from_partition(of_chunks)
    else:
        way_stats = WayStats.from_partition(parts[str(ways)]) if ways > 1 else WayStats.whole(N, E)
    chunk_stats = WayStats.from_partition(parts[str(chunks)]) if chunks > ways else None
    sample_of = chunk_stats or way_stats
    big = max(range(sample_of.ways), key=lambda c: sample_of.edges[c])  # the engine profiles its largest chunk
    sample = (sample_of.nodes[big], sample_of.nodes[big] + sample_of.mirrors[big], sample_of.edges[big])
    bounds = stage_bounds(gnn, stages, balance, N, E, shape, hardware, sample)
    est = estimate(shape, mode=mode, stages=stages, ways=ways, chunks=chunks, bounds=bounds,
                      way_stats=way_stats, chunk_stats=chunk_stats, num_nodes=N, num_edges=E,
                      hw=hardware, bytes_per_value=dtype_bytes, overlap=overlap,
                      first_input=first_input if ways > 1 else "local",
                      history_buffers=history_buffers(pc), recompute=pc.recompute,
                      retained_heap=heap_retained() if retained_heap is None else retained_heap)
    est.memory["fits"] = bool(est.peak_mem_bytes <= hardware.memory_bytes)
    return est
