"""``gnnpipe plan``: which way of spreading a whole-graph GNN over P workers wins, and why.

For a graph, a model, a hardware profile (``config/hardware/*.yaml``) and a worker count,
the plan enumerates every layout the engines run::

    graph     S = 1, G = P        (P METIS parts)
    pipeline  S = P, G = 1        (when P <= layers)
    hybrid    S x G = P, 1 < S < P
    single    (P = 1 only)

and predicts for each, with :mod:`gnnpipe.costmodel`, the bytes per epoch (exact), the
epoch time and its compute / communication / bubble split, the stage imbalance and the
peak memory per worker; it recommends the fastest layout that fits in memory and says
why in one paragraph. Stages are split the way the pipeline engine splits them
(``gnnpipe.parallel.balance``, ``estimate`` by default).

The graph enters through its partition statistics: for every candidate part count G,
METIS's mirrors, nodes, in-edges and inner nodes per part (:func:`graph_stats`),
computed on the real graph and cached next to it (``<graph>.plan-stats.json``, keyed by
the graph's content hash). A graph too large to partition here can be planned from
smaller graphs of the same shape: :func:`extrapolate_stats` fits the mirror ratio
``Σ M / N`` of each G against ``log N`` and scales the largest sample to the target size.

Usage::

    gnnpipe plan --graph results/data/synth/graph.h5 --layers 32 --hidden 100 \\
                 --hardware 8xgpu-pcie --workers 8 --out plan.json
    gnnpipe plan --graph g20k.h5 --graph g50k.h5 --graph g100k.h5 --at-nodes 232965 ...
    gnnpipe plan --graph graph.h5 --hardware cpu-2core --calibrate --workers 2 ...

``--calibrate`` times each conv of the model forward and backward on samples of the real
graph (and the bare kernels), on this machine, and fits the profile's compute rates to
them (:func:`calibrate`) before planning.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from . import costmodel as cm
from .config import ModelConfig, PipelineConfig, from_dict, load_yaml, to_dict
from .io import GnnPipeError, write_json
from .parallel.dims import resolve_layout

DTYPE_BYTES = {"float32": 4, "float64": 8}
STATS_VERSION = 2  # 2: chunk_ways (the hybrid's ways as blocks of chunks)


# ===================================================================== the model, as sizes
def model_shape(model) -> cm.ModelShape:
    """The cost model's view of a built ``GNN``: every conv's kind and widths, the
    encoder's and decoder's Linear maps, the parameter counts."""
    from torch import nn

    from .models.gat import GATConv
    from .models.gcn import GCNConv
    from .models.gcnii import GCNIIConv
    from .models.model import GraphLayer
    from .models.resgcn import ResGCNLayer
    from .models.sage import SAGEConv

    if not len(model.convs):
        raise GnnPipeError(f"model kind {model.kind!r} has no graph layers: there is nothing to "
                           "distribute across workers (train it with mode single)")
    specs = []
    for i, layer in enumerate(model.convs):
        params = sum(p.numel() for p in layer.parameters())
        first_raw = i == 0 and model.encoder is None  # raw features need no gradient
        if isinstance(layer, GraphLayer):
            conv = layer.conv
            kind = {GCNConv: "gcn", SAGEConv: "sage", GATConv: "gat"}.get(type(conv))
            if kind is None:
                raise GnnPipeError(f"cost model: unknown conv {type(conv).__name__}")
            specs.append(cm.LayerSpec(kind, conv.in_dim, conv.out_dim, norm=layer.norm is not None,
                                      act=layer.act, dropout=layer.dropout > 0,
                                      heads=getattr(conv, "heads", 1),
                                      head_dim=getattr(conv, "out_dim_head", 0),
                                      input_grad=not first_raw, params=params))
        elif isinstance(layer, GCNIIConv):
            specs.append(cm.LayerSpec("gcnii", layer.in_dim, layer.out_dim, act=True,
                                      dropout=layer.dropout > 0, params=params))
        elif isinstance(layer, ResGCNLayer):
            specs.append(cm.LayerSpec("resgcn", layer.in_dim, layer.out_dim,
                                      dropout=layer.dropout > 0, params=params))
        else:
            raise GnnPipeError(f"cost model: unknown layer {type(layer).__name__}")

    def linears(module):
        if module is None:
            return ()
        return tuple((m.in_features, m.out_features) for m in module.modules() if isinstance(m, nn.Linear))

    def count(module):
        return 0 if module is None else sum(p.numel() for p in module.parameters())

    def dropped(module):  # values per row behind a Dropout (after the Linear before it)
        if module is None:
            return 0
        width, out = model.in_features, 0
        for m in module.modules():
            if isinstance(m, nn.Linear):
                width = m.out_features
            elif isinstance(m, nn.Dropout) and m.p > 0:
                out += width
        return out

    return cm.ModelShape(layers=tuple(specs), in_features=model.in_features,
                         num_classes=model.num_classes, encoder=linears(model.encoder),
                         decoder=linears(model.decoder), encoder_params=count(model.encoder),
                         decoder_params=count(model.decoder), carries_x0=model.needs_x0,
                         x0_dim=model.hidden if model.needs_x0 else 0,
                         encoder_dropout=dropped(model.encoder))


def build_model(model_cfg: ModelConfig, in_features: int, num_classes: int):
    from .models.model import GNN

    try:
        return GNN(model_cfg, in_features, num_classes)
    except ValueError as e:
        raise GnnPipeError(f"model: {e}") from None


# ===================================================================== graph statistics
def part_counts(workers: int, num_layers: int = 1 << 30, chunks_per_stage: int = 4) -> list[int]:
    """Every partition (parts > 1) the layouts of ``workers`` need: the ways G of each
    layout (graph: G = P; hybrid: G = P/S) and its chunks C when a way has several."""
    need = set()
    for _, s, g, c in layouts(workers, num_layers, chunks_per_stage):
        need.update(k for k in (g, c) if k > 1)
    return sorted(need)


def partition_summary(graph, assignment: np.ndarray, parts: int) -> dict:
    """``partition_stats`` plus the inner nodes of every part (no in-neighbour outside it)."""
    from .partition import partition_stats

    st = partition_stats(graph, assignment, parts)
    deg = graph.in_degrees()
    dst = np.repeat(np.arange(graph.num_nodes, dtype=np.int64), deg)
    cut = assignment[dst] != assignment[graph.indices]
    boundary = np.zeros(graph.num_nodes, dtype=bool)
    boundary[dst[cut]] = True
    inner = np.bincount(assignment[~boundary], minlength=parts)
    keep = ("parts", "edge_cut", "nodes_per_part", "edges_per_part", "mirrors", "mirrors_total",
            "mirrors_over_n", "node_balance", "edge_balance")
    return {**{k: st[k] for k in keep}, "inner_per_part": inner.tolist()}


def graph_stats(graph, parts: Sequence[int], *, method: str = "metis", seed: int = 0,
                balance_edges: bool = True, progress: bool = False) -> dict:
    """What the plan needs of ``graph``: its sizes and, for every G in ``parts``, the
    statistics of its ``method`` partition into G parts (``partitions[str(G)]``).

    A hybrid run's ways are not a G-way partition of their own: way ``g`` owns the block
    ``g·C/G ..`` of the C chunks. So for every C in ``parts`` and every divisor ``1 < G <
    C``, ``chunk_ways[str(C)][str(G)]`` holds the statistics of those ways (the engine's
    halo per way, hence the hybrid's exact bytes)."""
    from .partition import partition_graph

    out = {"version": STATS_VERSION, "name": graph.name, "num_nodes": graph.num_nodes,
           "num_edges": graph.num_edges, "num_features": graph.num_features,
           "num_classes": graph.num_classes, "method": method, "seed": seed,
           "balance_edges": balance_edges, "partitions": {}, "chunk_ways": {}}
    for g in sorted(set(int(p) for p in parts)):
        t0 = time.perf_counter()
        a = partition_graph(graph, method, g, seed=seed, balance_edges=balance_edges)
        out["partitions"][str(g)] = partition_summary(graph, a, g)
        ways = {str(w): partition_summary(graph, a // (g // w), w) for w in range(2, g) if g % w == 0}
        if ways:
            out["chunk_ways"][str(g)] = ways
        if progress:
            r = out["partitions"][str(g)]["mirrors_over_n"]
            print(f"[plan] {method} {g} parts: mirrors {r:.3f} N ({time.perf_counter() - t0:.1f} s)",
                  file=sys.stderr, flush=True)
    return out


def stats_cache_path(graph_path: str | os.PathLike) -> Path:
    p = Path(graph_path)
    return p.with_name(p.stem + ".plan-stats.json")


def cached_graph_stats(graph_path: str | os.PathLike, parts: Sequence[int], *, method: str = "metis",
                       seed: int = 0, balance_edges: bool = True, progress: bool = False,
                       cache_file: str | os.PathLike | None = None) -> dict:
    """:func:`graph_stats` of a graph file, reusing (and extending) the JSON cache
    ``cache_file`` (default: next to the graph, :func:`stats_cache_path`); a cache of
    another graph content, method or seed is ignored and rewritten."""
    import json

    from .graph import read_graph, read_graph_attrs

    attrs = read_graph_attrs(graph_path)
    digest = str(attrs["content_hash"])
    cache_file = Path(cache_file) if cache_file is not None else stats_cache_path(graph_path)
    cached = None
    if cache_file.exists():
        try:
            cached = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cached = None
    key = dict(version=STATS_VERSION, content_hash=digest, method=method, seed=seed,
               balance_edges=balance_edges)
    if not (isinstance(cached, dict) and all(cached.get(k) == v for k, v in key.items())):
        cached = None
    need = [g for g in parts if cached is None or str(g) not in cached["partitions"]]
    if not need and cached is not None:  # (parts = []: no cache yet means compute the sizes)
        return cached
    graph = read_graph(graph_path)
    fresh = graph_stats(graph, need, method=method, seed=seed, balance_edges=balance_edges,
                        progress=progress)
    if cached is not None:
        fresh["partitions"] = {**cached["partitions"], **fresh["partitions"]}
        fresh["chunk_ways"] = {**cached.get("chunk_ways", {}), **fresh["chunk_ways"]}
    fresh["content_hash"] = digest
    write_json(cache_file, fresh)
    return fresh


def extrapolate_stats(samples: Sequence[dict], num_nodes: int, num_edges: Optional[int] = None) -> dict:
    """Statistics of a graph of the samples' shape at ``num_nodes`` nodes.

    For every G in all samples, the mirror ratio ``r = Σ M / N`` is fitted as
    ``r = α + β ln N`` over the samples (constant for one sample) and evaluated at the
    target (clipped to ``[0, G-1]``); the largest sample's per-part arrays are scaled:
    nodes by ``N'/N``, in-edges by ``E'/E``, mirrors to the extrapolated total, inner
    nodes keeping their share. ``num_edges`` defaults to the largest sample's ``E/N``.
    """
    if not samples:
        raise GnnPipeError("extrapolation needs at least one sample graph")
    ref = max(samples, key=lambda s: s["num_nodes"])
    if num_edges is None:
        num_edges = int(round(ref["num_edges"] / ref["num_nodes"] * num_nodes))
    common = set.intersection(*(set(s["partitions"]) for s in samples))
    fn, fe = num_nodes / ref["num_nodes"], num_edges / ref["num_edges"]
    out = {k: v for k, v in ref.items() if k not in ("partitions", "content_hash")}
    out.update(num_nodes=int(num_nodes), num_edges=int(num_edges), partitions={},
               extrapolated_from=[{"name": s.get("name"), "num_nodes": s["num_nodes"],
                                   "num_edges": s["num_edges"],
                                   "mirrors_over_n": {g: s["partitions"][g]["mirrors_over_n"]
                                                      for g in sorted(common, key=int)}}
                                  for s in sorted(samples, key=lambda s: s["num_nodes"])])
    for g in sorted(common, key=int):
        xs = np.log([s["num_nodes"] for s in samples])
        ys = np.array([s["partitions"][g]["mirrors_over_n"] for s in samples])
        if len(samples) > 1 and np.ptp(xs) > 0:
            beta, alpha = np.polyfit(xs, ys, 1)
        else:
            alpha, beta = float(ys.mean()), 0.0
        r = float(np.clip(alpha + beta * math.log(num_nodes), 0.0, int(g) - 1))
        st = ref["partitions"][g]
        m_ref = np.asarray(st["mirrors"], dtype=float)
        m_scale = r * num_nodes / m_ref.sum() if m_ref.sum() > 0 else 0.0
        nodes = np.asarray(st["nodes_per_part"], dtype=float)
        out["partitions"][g] = {
            "parts": int(g),
            "nodes_per_part": (nodes * fn).tolist(),
            "edges_per_part": (np.asarray(st["edges_per_part"], dtype=float) * fe).tolist(),
            "mirrors": (m_ref * m_scale).tolist(),
            "inner_per_part": (np.asarray(st["inner_per_part"], dtype=float) * fn).tolist(),
            "mirrors_total": r * num_nodes, "mirrors_over_n": r,
            "fit": {"alpha": float(alpha), "beta_per_ln_n": float(beta)},
        }
    return out


# ===================================================================== the plan
@dataclass
class Plan:
    workers: int
    hardware: str
    graph: dict  # name, num_nodes, num_edges, num_features, num_classes, mirror ratios
    model: dict
    rows: list[cm.Estimate]
    best: Optional[cm.Estimate]
    reason: str
    dtype_bytes: int = 4
    notes: list[str] = field(default_factory=list)
    first_input: str = "local"
    sensitivity: dict = field(default_factory=dict)  # link-speed factor -> layout -> epoch s
    break_even: Optional[dict] = None  # link speed at which graph and pipeline tie

    def table(self) -> str:
        head = ("mode", "S x G", "C", "GB/epoch", "halo", "p2p", "allred", "epoch s", "compute",
                "comm", "bubble", "imbal", "mem GiB", "fits")
        lines = [head]
        for r in self.rows:
            gb = {k: v / 1e9 for k, v in r.bytes.items()}
            lines.append((r.mode, f"{r.stages} x {r.ways}", str(r.chunks), f"{gb['total']:.3f}",
                          f"{gb['halo']:.3f}", f"{gb['p2p']:.3f}", f"{gb['allreduce']:.4f}",
                          f"{r.epoch_s:.4g}", f"{r.compute_s:.4g}", f"{r.comm_s:.4g}",
                          f"{r.bubble_fraction:.0%}", f"{r.imbalance:.2f}",
                          f"{r.peak_mem_bytes / 2**30:.2f}", "yes" if r.memory["fits"] else "NO"))
        widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
        fmt = lambda row: "  ".join(c.rjust(w) if i > 1 else c.ljust(w)  # noqa: E731
                                    for i, (c, w) in enumerate(zip(row, widths)))
        out = [fmt(lines[0]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in lines[1:]]
        if self.best is not None:
            out.append(f"recommended: {describe(self.best)}")
        return "\n".join(out)

    def as_dict(self) -> dict:
        return {"workers": self.workers, "hardware": self.hardware, "graph": self.graph,
                "model": self.model, "dtype_bytes": self.dtype_bytes,
                "rows": [r.as_dict() for r in self.rows],
                "best": self.best.as_dict() if self.best is not None else None,
                "reason": self.reason, "notes": self.notes, "first_input": self.first_input,
                "sensitivity": self.sensitivity, "break_even": self.break_even}


def describe(r: cm.Estimate) -> str:
    layout = {"graph": f"graph, {r.ways} parts", "pipeline": f"pipeline, {r.stages} stages, {r.chunks} chunks",
              "hybrid": f"hybrid, {r.stages} stages x {r.ways} ways, {r.chunks} chunks",
              "single": "single"}[r.mode]
    return f"{layout}: {r.epoch_s:.4g} s/epoch, {r.bytes['total'] / 1e9:.3f} GB/epoch"


def layouts(workers: int, num_layers: int, chunks_per_stage: int) -> list[tuple[str, int, int, int]]:
    """``(mode, stages, ways, chunks)`` of every layout of ``workers`` workers that
    ``gnnpipe.parallel.dims.resolve_layout`` (the workflow's rule) accepts."""
    if workers < 1:
        raise GnnPipeError(f"workers must be >= 1, got {workers}")
    if workers == 1:
        return [("single", 1, 1, 1)]
    candidates = [("graph", 1), ("pipeline", workers)] + [("hybrid", s) for s in range(2, workers)
                                                          if workers % s == 0]
    out = []
    for mode, s in candidates:
        try:
            _, s, g, c = resolve_layout(mode, workers, stages=s, chunks_per_stage=chunks_per_stage,
                                        layers=num_layers)
        except GnnPipeError:
            continue  # more stages than layers
        out.append((mode, s, g, c))
    return out


def stage_bounds(model, stages: int, balance: str, num_nodes: int, num_edges: int,
                 shape: cm.ModelShape, hw: cm.Hardware,
                 sample: Optional[tuple[float, float, float]] = None) -> list[tuple[int, int]]:
    """The stage split the pipeline engine would use (``gnnpipe.parallel.balance``):
    ``estimate`` from the model's whole-graph FLOPs, ``profile`` from per-conv times on a
    sample chunk (the engine times its largest chunk; here the cost model's prediction for
    ``sample = (rows, source rows, in-edges)``), ``uniform``."""
    from .parallel.balance import balanced_bounds, estimate_costs, uniform_bounds

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
            lc = cm.layer_cost(spec, n, src, e)
            gf, gb = cm._gather_work(n, src, d, spec.input_grad)
            costs.append((lc.training() + gf + gb).seconds(hw))
        first = cm.rowwise_work(shape.encoder, n, False, shape.encoder_dropout).seconds(hw)
        last = (cm.rowwise_work(shape.decoder, n, True) + cm.loss_work(n, shape.num_classes)).seconds(hw)
    else:
        raise GnnPipeError(f"unknown stage balance {balance!r} (uniform, estimate, profile)")
    return balanced_bounds(costs, stages, first, last)


def history_buffers(pc: PipelineConfig) -> int:
    """Whole-graph buffers the pipeline engine keeps per buffered conv input: the current
    rows and their gradients, a snapshot (technique 3), a second history (momentum, or
    recompute without snapshots)."""
    return 2 + (pc.snapshot_every > 0) + (pc.momentum > 0 or (pc.recompute and pc.snapshot_every == 0))


def predict_layout(graph_stats: dict, gnn, shape: cm.ModelShape, hardware: cm.Hardware, mode: str,
                   stages: int, ways: int, chunks: int, *, dtype_bytes: int = 4, overlap: bool = True,
                   balance: str = "estimate", first_input: str = "local",
                   pipeline_cfg: Optional[PipelineConfig] = None) -> cm.Estimate:
    """The estimate of one layout (``mode``, ``stages`` x ``ways``, ``chunks``) of the built
    model ``gnn`` (``shape = model_shape(gnn)``), with ``memory["fits"]`` set."""
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
        way_stats = cm.WayStats.from_partition(of_chunks)
    else:
        way_stats = cm.WayStats.from_partition(parts[str(ways)]) if ways > 1 else cm.WayStats.whole(N, E)
    chunk_stats = cm.WayStats.from_partition(parts[str(chunks)]) if chunks > ways else None
    sample_of = chunk_stats or way_stats
    big = max(range(sample_of.ways), key=lambda c: sample_of.edges[c])  # the engine profiles its largest chunk
    sample = (sample_of.nodes[big], sample_of.nodes[big] + sample_of.mirrors[big], sample_of.edges[big])
    bounds = stage_bounds(gnn, stages, balance, N, E, shape, hardware, sample)
    est = cm.estimate(shape, mode=mode, stages=stages, ways=ways, chunks=chunks, bounds=bounds,
                      way_stats=way_stats, chunk_stats=chunk_stats, num_nodes=N, num_edges=E,
                      hw=hardware, bytes_per_value=dtype_bytes, overlap=overlap,
                      first_input=first_input if ways > 1 else "local",
                      history_buffers=history_buffers(pc), recompute=pc.recompute)
    est.memory["fits"] = bool(est.peak_mem_bytes <= hardware.memory_bytes)
    return est


def plan(graph_stats: dict, model: ModelConfig, in_features: int, num_classes: int,
         hardware: cm.Hardware, workers: int, *, chunks_per_stage: int = 4, dtype_bytes: int = 4,
         overlap: bool = True, balance: str = "estimate", first_input: str = "local",
         pipeline_cfg: Optional[PipelineConfig] = None) -> Plan:
    """Enumerate the layouts of ``workers`` workers, predict each, recommend one.

    ``graph_stats``: ``num_nodes``, ``num_edges`` and ``partitions[str(K)]`` (per-part
    ``nodes_per_part``, ``edges_per_part``, ``mirrors``, ``inner_per_part``) for every
    K > 1 a layout uses (:func:`part_counts`: the ways and the chunks). ``first_input``:
    the graph engine caches the first conv's input halo at set-up (``"local"``, its
    default); ``"exchanged"`` is DESIGN.md's upper bound. ``pipeline_cfg``: buffers and
    recompute of the pipeline engine (defaults: ``PipelineConfig()``).
    """
    pc = pipeline_cfg or PipelineConfig()
    gnn = build_model(model, in_features, num_classes)
    shape = model_shape(gnn)
    N = int(graph_stats["num_nodes"])
    L = len(shape.layers)
    cands = layouts(workers, L, chunks_per_stage)
    cap = hardware.max_workers()
    if cap is not None and workers > cap:
        raise GnnPipeError(f"{workers} workers do not fit hardware {hardware.name!r} "
                           f"({hardware.nodes} node(s) x {hardware.workers_per_node} workers)")
    parts = graph_stats.get("partitions", {})
    rows, notes = [], []
    for mode, s, g, c in cands:
        est = predict_layout(graph_stats, gnn, shape, hardware, mode, s, g, c, dtype_bytes=dtype_bytes,
                             overlap=overlap, balance=balance, first_input=first_input, pipeline_cfg=pc)
        rows.append(est)
    if balance == "estimate":  # the engine's default: would measured balancing do much better?
        for r in list(rows):
            if r.stages > 1:
                alt = predict_layout(graph_stats, gnn, shape, hardware, r.mode, r.stages, r.ways, r.chunks,
                                     dtype_bytes=dtype_bytes, overlap=overlap, balance="profile",
                                     first_input=first_input, pipeline_cfg=pc)
                if alt.epoch_s < 0.8 * r.epoch_s:
                    notes.append(f"{r.mode} {r.stages}x{r.ways}: pipeline.balance: profile (split by "
                                 f"measured time, not FLOPs) would take {alt.epoch_s:.3g} s/epoch "
                                 f"instead of {r.epoch_s:.3g} s (stages {alt.stage_bounds})")
    if workers > 1 and workers > L:
        notes.append(f"pure pipeline needs workers <= layers ({workers} > {L}): not a candidate")
    fitting = [r for r in rows if r.memory["fits"]]
    best = min(fitting, key=lambda r: r.epoch_s) if fitting else None
    ratios = {g: parts[g].get("mirrors_over_n") for g in sorted(parts, key=int)}
    gdesc = {k: graph_stats.get(k) for k in ("name", "num_nodes", "num_edges", "num_features",
                                             "num_classes", "method")}
    gdesc["mirrors_over_n"] = ratios
    for key in ("extrapolated_from", "mirror_override"):
        if key in graph_stats:
            gdesc[key] = graph_stats[key]
    mdesc = {**to_dict(model), "num_params": shape.num_params, "exchange_dims_sum": sum(shape.exchange_dims)}
    p = Plan(workers=workers, hardware=hardware.name, graph=gdesc, model=mdesc, rows=rows, best=best,
             reason="", dtype_bytes=dtype_bytes, notes=notes, first_input=first_input)

    def at(row: cm.Estimate, factor: float) -> float:
        return predict_layout(graph_stats, gnn, shape, cm.scale_links(hardware, factor), row.mode, row.stages,
                              row.ways, row.chunks, dtype_bytes=dtype_bytes, overlap=overlap, balance=balance,
                              first_input=first_input, pipeline_cfg=pc).epoch_s

    if workers > 1:
        p.sensitivity = {str(k): {_key(r): at(r, k) for r in rows} for k in SENSITIVITY}
        g = next((r for r in rows if r.mode == "graph"), None)
        pp = next((r for r in rows if r.mode == "pipeline"), None)
        if g is not None and pp is not None:
            p.break_even = _break_even(lambda k: at(g, k) - at(pp, k), hardware)
    p.reason = _reason(p, shape, N, hardware)
    p.reason = _reason(p, shape, N, hardware)
    return p


#: Link-speed factors of the sensitivity table (every bandwidth of the profile scaled).
SENSITIVITY = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0)


def _key(r: cm.Estimate) -> str:
    return f"{r.mode} {r.stages}x{r.ways} c{r.chunks}"


def _break_even(diff, hw: cm.Hardware, lo: float = 1e-3, hi: float = 1e3) -> Optional[dict]:
    """The link-speed factor ``k`` where ``diff(k) = graph - pipeline`` epoch changes sign
    (graph parallelism gains more from faster links), by bisection on ``log k``; None when
    one layout wins over the whole range."""
    a, b = diff(lo), diff(hi)
    if a <= 0 or b >= 0:
        return None
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        if diff(mid) > 0:
            lo = mid
        else:
            hi = mid
    k = math.sqrt(lo * hi)
    return {"factor": k, "intra_bandwidth_gbs": hw.intra_bandwidth_gbs * k,
            "intra_bisection_gbs": None if hw.intra_bisection_gbs is None else hw.intra_bisection_gbs * k,
            "inter_bandwidth_gbs": None if hw.inter_bandwidth_gbs is None else hw.inter_bandwidth_gbs * k}


def _gb(x: float) -> str:
    return f"{x / 1e9:.3g} GB"


def _reason(p: Plan, shape: cm.ModelShape, N: int, hw: cm.Hardware) -> str:
    by_mode = {}
    for r in p.rows:
        if r.mode not in by_mode or r.epoch_s < by_mode[r.mode].epoch_s:
            by_mode[r.mode] = r
    L, b = len(shape.layers), p.dtype_bytes
    per_mirror = cm._halo_values(shape.exchange_dims, p.first_input)  # both directions
    out = []
    if p.best is None:
        least = min(p.rows, key=lambda r: r.peak_mem_bytes)
        return (f"No layout fits in {hw.memory_gib:g} GiB per worker on {hw.name}; the smallest, "
                f"{describe(least)}, needs {least.peak_mem_bytes / 2**30:.1f} GiB "
                f"({', '.join(f'{k} {v / 2**30:.1f}' for k, v in least.memory.items() if isinstance(v, float))} GiB). "
                "Use more workers, a smaller hidden size, or hardware with more memory.")
    best = p.best
    out.append(f"On {hw.name} with {p.workers} workers, {describe(best)} is predicted fastest"
               + (" among the layouts that fit in memory." if any(not r.memory['fits'] for r in p.rows)
                  else "."))
    g, pp = by_mode.get("graph"), by_mode.get("pipeline")
    if g is not None:
        ratio = g.bytes["halo"] / (per_mirror * b * N) if per_mirror else 0.0
        convs = L - 1 if p.first_input == "local" else L
        out.append(f"Graph parallelism moves {_gb(g.bytes['total'])}/epoch because Σ mirrors = "
                   f"{ratio:.2f}·N at {g.ways} parts and {convs} of the {L} convs exchange them "
                   f"({per_mirror} values per mirror per epoch, forward and backward"
                   + (", the input halo cached" if p.first_input == "local" else "") + ").")
    if pp is not None:
        dims = cm.boundary_dims(shape.exchange_dims, pp.stage_bounds)
        out.append(f"The pipeline moves {_gb(pp.bytes['total'])} regardless of the cut "
                   f"(2·N·{'+'.join(map(str, sorted(set(dims))))}·{b} B across each of its "
                   f"{pp.stages - 1} stage boundaries{', with x0' if shape.carries_x0 else ''}).")
    if g is not None and pp is not None:
        out.append(f"Predicted epochs: graph {g.epoch_s:.3g} s (compute {g.compute_s:.3g} s, comm "
                   f"{g.comm_s:.3g} s) against pipeline {pp.epoch_s:.3g} s (compute {pp.compute_s:.3g} s, "
                   f"comm {pp.comm_s:.3g} s, bubble {pp.bubble_s:.3g} s = {pp.bubble_fraction:.0%} with "
                   f"{pp.chunks} chunks); graph/pipeline: time {g.epoch_s / pp.epoch_s:.2f}x, bytes "
                   f"{g.bytes['total'] / max(pp.bytes['total'], 1):.1f}x.")
        if g.epoch_s <= pp.epoch_s:
            out.append("Graph parallelism wins: " + _pipeline_overheads(pp, shape)
                       + f", while its own exchange costs only {g.comm_s:.3g} s.")
        else:
            out.append(f"The pipeline wins: it saves {g.comm_s - pp.comm_s:.3g} s of communication "
                       f"and pays {pp.bubble_s:.3g} s of bubble and "
                       f"{max(pp.compute_s - g.compute_s, 0.0):.3g} s of extra compute on its slowest stage.")
    be = p.break_even
    if g is not None and pp is not None and be is not None:
        links = f"{be['intra_bandwidth_gbs']:.3g} GB/s per worker"
        if be["intra_bisection_gbs"] is not None:
            links += f", {be['intra_bisection_gbs']:.3g} GB/s across the node"
        if be["inter_bandwidth_gbs"] is not None:
            links += f", {be['inter_bandwidth_gbs']:.3g} GB/s per node between nodes"
        side = "slower" if g.epoch_s <= pp.epoch_s else "faster"
        out.append(f"Break-even: with links {be['factor']:.2g}x this profile's ({links}) both take the same "
                   f"time; on {side} links {'the pipeline' if side == 'slower' else 'graph parallelism'} wins.")
    h = by_mode.get("hybrid")
    if h is not None and best.mode == "hybrid":
        out.append(f"Hybrid {h.stages} x {h.ways} combines both: {_gb(h.bytes['p2p'])} between stages "
                   f"and {_gb(h.bytes['halo'])} of halo inside them.")
    over = [r for r in p.rows if not r.memory["fits"]]
    if over:
        out.append("Excluded, out of memory: " + "; ".join(
            f"{r.mode} {r.stages}x{r.ways} needs {r.peak_mem_bytes / 2**30:.1f} GiB" for r in over) + ".")
    return " ".join(out)


def _pipeline_overheads(pp: cm.Estimate, shape: cm.ModelShape) -> str:
    """What a pipeline row pays on top of an even split of the work, in words."""
    comp = [r["fwd_compute_s"] + r["bwd_compute_s"] + r["encoder_s"] for r in pp.stage_times]
    k = max(range(len(comp)), key=comp.__getitem__)
    a, b = pp.stage_bounds[k]
    mean = sum(comp) / len(comp)
    convs = f"conv {a + 1}" if b - a == 1 else f"convs {a + 1}-{b}"
    text = (f"the pipeline's slowest stage ({k}, {convs}) computes {comp[k]:.3g} s per epoch against a "
            f"mean of {mean:.3g} s per stage and idles {pp.bubble_s:.3g} s in the bubble")
    if (a, b) == (0, 1) and len(comp) > 1:  # one conv that no split can spread
        text += (f" (conv 1 alone, reading the {shape.layers[0].d_in}-wide input for every row, is the "
                 "slowest stage: no split of the layers balances it)")
    return text


def override_mirror_ratio(stats: dict, parts: int, ratio: float) -> dict:
    """``stats`` with the mirrors of every partition scaled by one factor, so that the
    ``parts``-way partition has ``Σ M = ratio · N`` (e.g. a published figure for the real
    graph the statistics stand in for). Recorded under ``mirror_override``."""
    key = str(int(parts))
    if key not in stats.get("partitions", {}):
        raise GnnPipeError(f"--mirror-ratio {parts}:{ratio}: the statistics have no {parts}-part partition")
    if ratio < 0:
        raise GnnPipeError(f"mirror ratio must be >= 0, got {ratio}")
    have = stats["partitions"][key]["mirrors_over_n"]
    factor = ratio / have if have > 0 else 0.0
    out = dict(stats, partitions={}, mirror_override={"parts": int(parts), "ratio": ratio,
                                                       "measured": have, "factor": factor})
    for g, st in stats["partitions"].items():
        m = [x * factor for x in st["mirrors"]]
        inner = st.get("inner_per_part")
        if inner is not None and factor > 1:  # more mirrors: fewer inner rows, in proportion
            inner = [i / factor for i in inner]
        out["partitions"][g] = dict(st, mirrors=m, mirrors_total=sum(m),
                                    mirrors_over_n=min(st["mirrors_over_n"] * factor, int(g) - 1),
                                    inner_per_part=inner)
    return out


# ===================================================================== calibration
FLUSH_BYTES = 128 * 2**20
#: Clocks for timing: wall time, or this thread's CPU time (blind to time spent
#: descheduled on a shared machine; the same as wall time for one compute thread on an
#: idle core).
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def median_time(fn, reps: int, flush=None, clock: str = "wall") -> float:
    """Median time of ``fn()`` over ``reps`` calls on ``clock``, after one warm-up call;
    ``flush()`` (untimed) runs before each timed call."""
    now = CLOCKS[clock]
    fn()
    ts = []
    for _ in range(reps):
        if flush is not None:
            flush()
        t0 = now()
        fn()
        ts.append(now() - t0)
    return float(statistics.median(ts))


def sample_blocks(graph, rows: int, dtype):
    """Two blocks of the real graph's first ``rows`` destination rows (node ids are the
    dataset's; a synthetic graph's are a random permutation): a *chunk* against the whole
    graph (the pipeline's shape) and a *part* against its own rows plus halo (graph
    parallelism's shape)."""
    from .models.block import Block

    n = min(int(rows), graph.num_nodes)
    indptr = graph.indptr[:n + 1]
    idx = graph.indices[:int(indptr[-1])]
    deg_in, deg_out = graph.in_degrees(), graph.out_degrees()
    chunk = Block.from_numpy(indptr, idx, graph.num_nodes, 0, deg_in[:n], deg_out, dtype)
    halo = np.unique(idx[idx >= n])
    src = np.concatenate([np.arange(n, dtype=np.int64), halo])
    remap = np.full(graph.num_nodes, -1, dtype=np.int64)
    remap[src] = np.arange(src.shape[0])
    part = Block.from_numpy(indptr, remap[idx], src.shape[0], 0, deg_in[:n], deg_out[src], dtype)
    return chunk, part


def calibrate(graph, model_cfg: ModelConfig, hardware: Optional[cm.Hardware] = None, *,
              rows: Sequence[int] = (2048, 8192), reps: int = 5, threads: int = 1,
              dtype: str = "float32", clock: str = "wall", evict: bool = True) -> cm.Hardware:
    """Fit the compute rates of ``hardware`` to this machine, on the real graph and model.

    Times (median of ``reps``), with ``threads`` compute threads: each distinct conv of
    the model forward and backward on a chunk block and a part block of ``rows``
    destination rows (:func:`sample_blocks`), the encoder/decoder, and the bare kernels
    (a matmul, the CSR SpMM, an elementwise op, dropout). The cost model's work counts of every
    measurement are fitted to its time by non-negative least squares on relative errors,
    giving seconds per dense FLOP, per sparse value, per elementwise value and per call.
    The result is ``hardware`` (or a one-node CPU profile) with those rates and the fit
    in ``measured["calibration"]``. ``clock``: ``"wall"``, or ``"cpu"`` (this thread's CPU
    time; only meaningful with ``threads=1``) to fit the rates of the work itself on a
    machine that other jobs share. ``evict=False``: time with warm caches (what a
    single process sees; :func:`calibrate_run`).
    """
    if clock not in CLOCKS:
        raise GnnPipeError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    if clock == "cpu" and threads != 1:
        raise GnnPipeError("calibrate: clock='cpu' times this thread only; use threads=1")
    import torch
    from scipy.optimize import nnls

    from .models.ops import gcn_aggregate

    tdtype = {"float32": torch.float32, "float64": torch.float64}[dtype]
    # An epoch's tensors far exceed the caches, a sample's do not: evict them before each
    # timed call (a write over twice a large L3), or the rates come out several times too fast.
    flush = torch.zeros(FLUSH_BYTES // 4) if evict else None
    cold = (lambda: flush.add_(1.0)) if evict else None  # noqa: E731

    old_threads = torch.get_num_threads()
    torch.set_num_threads(int(threads))
    try:
        gnn = build_model(model_cfg, graph.num_features, graph.num_classes).to(tdtype)
        gnn.train()
        shape = model_shape(gnn)
        gen = torch.Generator().manual_seed(0)
        X, y, names = [], [], []

        def add(name, work: cm.Work, seconds: float):
            X.append([work.dense, work.sparse, work.elem, work.rng, work.calls])
            y.append(seconds)
            names.append(name)

        seen = set()
        with torch.random.fork_rng():
            for r in rows:
                for bname, block in zip(("chunk", "part"), sample_blocks(graph, r, tdtype)):
                    for l, (conv, spec) in enumerate(zip(gnn.convs, shape.layers)):
                        key = (spec, r, bname)
                        if key in seen:
                            continue
                        seen.add(key)
                        h = torch.randn(block.n_src, spec.d_in, dtype=tdtype, generator=gen)
                        h.requires_grad_(spec.input_grad)
                        x0 = (torch.randn(block.n_dst, spec.d_in, dtype=tdtype, generator=gen)
                              if gnn.needs_x0 else None)
                        lc = cm.layer_cost(spec, block.n_dst, block.n_src, block.nnz)
                        out = {}

                        def fwd():
                            out["y"] = conv(h, block, x0)

                        def bwd():
                            conv.zero_grad(set_to_none=True)
                            out["y"] = conv(h, block, x0)
                            out["y"].sum().backward()

                        tf = median_time(fwd, reps, cold, clock)
                        tfb = median_time(bwd, reps, cold, clock)
                        add(f"conv{l} {spec.kind} {spec.d_in}->{spec.d_out} {bname} {r} fwd", lc.fwd, tf)
                        add(f"conv{l} {spec.kind} {spec.d_in}->{spec.d_out} {bname} {r} fwd+bwd",
                            lc.training(), tfb)
                    # bare kernels on this block: SpMM and a matmul at the hidden width
                    d = shape.layers[-1].d_in
                    xs = torch.randn(block.n_src, d, dtype=tdtype, generator=gen)
                    add(f"spmm {bname} {r} width {d}", cm.Work(sparse=(block.nnz + block.n_dst) * d),
                        median_time(lambda: gcn_aggregate(xs, block), reps, cold, clock))
                    w = torch.randn(d, d, dtype=tdtype, generator=gen)
                    add(f"matmul {block.n_src}x{d}x{d}", cm.Work(dense=2.0 * block.n_src * d * d),
                        median_time(lambda: xs @ w, reps, cold, clock))
                    add(f"relu+add {block.n_src}x{d}", cm.Work(elem=2.0 * block.n_src * d),
                        median_time(lambda: torch.relu(xs).add_(1.0), reps, cold, clock))
                    add(f"dropout {block.n_src}x{d}", cm.Work(rng=block.n_src * d, elem=block.n_src * d),
                        median_time(lambda: torch.nn.functional.dropout(xs, 0.5), reps, cold, clock))
                n = min(r, graph.num_nodes)
                if shape.encoder:
                    x = torch.randn(n, graph.num_features, dtype=tdtype, generator=gen)
                    add(f"encoder {n} rows", cm.rowwise_work(shape.encoder, n, False, shape.encoder_dropout),
                        median_time(lambda: gnn.encode(x).sum().backward(), reps, cold, clock))
                if shape.decoder:
                    hd = torch.randn(n, shape.decoder[0][0], dtype=tdtype, generator=gen).requires_grad_()
                    add(f"decoder {n} rows", cm.rowwise_work(shape.decoder, n, True),
                        median_time(lambda: gnn.decode(hd).sum().backward(), reps, cold, clock))
    finally:
        torch.set_num_threads(old_threads)

    A = np.asarray(X, dtype=float)
    t = np.asarray(y, dtype=float)
    scale = A.max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls((A / scale) / t[:, None], np.ones_like(t))  # relative errors
    coef = coef / scale  # seconds per unit of each kind of work
    pred = A @ coef
    base = hardware or cm.Hardware(name="calibrated-cpu", workers_per_node=max(1, os.cpu_count() or 1),
                                   memory_gib=8.0, dense_gflops=1.0, sparse_gvalues=1.0,
                                   elementwise_gvalues=1.0, intra_bandwidth_gbs=1.0,
                                   intra_latency_us=50.0, nodes=1)
    rates = {}
    for key, c in (("dense_gflops", coef[0]), ("sparse_gvalues", coef[1]),
                   ("elementwise_gvalues", coef[2]), ("random_gvalues", coef[3])):
        if c > 0:
            rates[key] = float(1.0 / c / 1e9)
    rates["layer_overhead_us"] = float(coef[4] * 1e6)
    rel = (pred - t) / t
    fit = {"threads": int(threads), "dtype": dtype, "clock": clock, "graph": graph.name, "model": to_dict(model_cfg),
           "rows": list(rows), "reps": reps,
           "rates": rates, "median_abs_rel_error": float(np.median(np.abs(rel))),
           "max_abs_rel_error": float(np.max(np.abs(rel))),
           "measurements": [{"what": nm, "seconds": float(s), "predicted": float(pr)}
                            for nm, s, pr in zip(names, t, pred)]}
    return replace(base, **rates, measured={**base.measured, "calibration": fit})


def calibrate_run(run_config, hardware, *, clock: str = "cpu") -> cm.Hardware:
    """:func:`calibrate` on what one run trains: its graph, model, dtype and threads per
    worker. The result is named ``<profile>+<dataset>`` and keeps the profile's links; its
    ``measured["calibration"]`` records the model config and the graph's content hash, so
    that a report can match it to the runs it stands for (:func:`find_calibration`)."""
    from .config import RunConfig, load_run_config
    from .graph import read_graph, read_graph_attrs

    cfg = run_config if isinstance(run_config, RunConfig) else load_run_config(run_config)
    hw = hardware if isinstance(hardware, cm.Hardware) else cm.load_hardware(hardware)
    threads = cfg.training.threads_per_worker
    if clock == "cpu" and threads != 1:
        clock = "wall"  # the CPU clock of one thread says nothing about a team of threads
    graph = read_graph(cfg.graph_path)
    out = calibrate(graph, cfg.model, hw, threads=threads, dtype=cfg.training.dtype, clock=clock)
    # A process training alone keeps its tensors in cache from conv to conv; the workers of
    # a parallel run, between exchanges, do not (measured: single-process epochs match the
    # warm rates, parallel workers' compute the cold ones). The ratio of the two predicted
    # single-process epochs is the profile's single_worker_speedup.
    warm = calibrate(graph, cfg.model, hw, threads=threads, dtype=cfg.training.dtype, clock=clock, evict=False)
    gnn = build_model(cfg.model, graph.num_features, graph.num_classes)
    sizes = {"num_nodes": graph.num_nodes, "num_edges": graph.num_edges, "partitions": {}}
    epoch = {name: predict_layout(sizes, gnn, model_shape(gnn), h, "single", 1, 1, 1,
                                  dtype_bytes=DTYPE_BYTES[cfg.training.dtype]).epoch_s
             for name, h in (("cold", out), ("warm", warm))}
    speedup = max(1.0, epoch["cold"] / epoch["warm"])
    fit = {**out.measured["calibration"], "dataset": cfg.dataset_name,
           "graph_hash": str(read_graph_attrs(cfg.graph_path)["content_hash"]),
           "warm_rates": warm.measured["calibration"]["rates"], "single_epoch_s": epoch,
           "single_worker_speedup": speedup}
    return replace(out, name=f"{hw.name}+{cfg.dataset_name}", single_worker_speedup=speedup,
                   description=f"{hw.description}; compute rates fitted to {cfg.model.kind} "
                               f"{cfg.model.layers}x{cfg.model.hidden} on {cfg.dataset_name}",
                   measured={**out.measured, "calibration": fit})


def write_hardware(hw: cm.Hardware, path: str | os.PathLike) -> None:
    """Write a profile as YAML that :func:`gnnpipe.costmodel.load_hardware` reads back."""
    import yaml

    from .io import write_text

    write_text(path, yaml.safe_dump(hw.as_dict(), sort_keys=False))


def find_calibration(directory: str | os.PathLike, model_cfg: ModelConfig, graph_hash: str,
                     dtype: str = "float32") -> Optional[cm.Hardware]:
    """The profile in ``directory`` (``*.yaml``, written by :func:`calibrate_run`) fitted to
    this model config, dtype and graph content, or None."""
    want = to_dict(model_cfg)
    for path in sorted(Path(directory).glob("*.yaml")):
        hw = cm.load_hardware(path)
        fit = hw.measured.get("calibration") or {}
        if fit.get("model") == want and fit.get("graph_hash") == graph_hash and fit.get("dtype") == dtype:
            return hw
    return None


# ===================================================================== entry points
def _load_model_cfg(model_cfg) -> ModelConfig:
    if isinstance(model_cfg, ModelConfig):
        return model_cfg
    if isinstance(model_cfg, dict):
        return from_dict(ModelConfig, model_cfg, path="model")
    return from_dict(ModelConfig, load_yaml(model_cfg), path=str(model_cfg))


def run_plan(graph_path, model_cfg, hardware_path, workers: int, out_json=None, *,
             stats_path=None, at_nodes: Optional[int] = None, at_edges: Optional[int] = None,
             chunks_per_stage: int = 4, dtype: str = "float32", method: str = "metis",
             seed: int = 0, overlap: bool = True, balance: str = "estimate",
             calibrate_rates: bool = False, threads: int = 1, progress: bool = True,
             mirror_ratio: Optional[tuple[int, float]] = None, first_input: str = "local",
             clock: str = "wall", quiet: bool = False) -> Plan:
    """``gnnpipe plan``: statistics of the graph(s), the hardware profile, the plan; print
    the table and the reason, write the plan as JSON to ``out_json``.

    ``graph_path``: one graph file or several of one shape (then ``at_nodes`` says the
    size to extrapolate to); ``stats_path``: a statistics JSON instead of a graph.
    ``quiet``: print nothing (the plan is returned and written all the same).
    """
    import json

    model = _load_model_cfg(model_cfg)
    hw = cm.load_hardware(hardware_path)
    if dtype not in DTYPE_BYTES:
        raise GnnPipeError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    parts = part_counts(workers, model.layers, chunks_per_stage)
    graphs = [graph_path] if isinstance(graph_path, (str, os.PathLike)) else list(graph_path or [])
    if stats_path is not None:
        try:
            samples = [json.loads(Path(stats_path).read_text())]
        except FileNotFoundError:
            raise GnnPipeError(f"{stats_path}: no such statistics file") from None
        except ValueError as e:
            raise GnnPipeError(f"{stats_path}: not valid JSON ({e})") from None
    elif graphs:
        samples = [cached_graph_stats(g, parts, method=method, seed=seed, progress=progress)
                   for g in graphs]
    else:
        raise GnnPipeError("plan needs --graph (one or more graph files) or --stats")
    if at_nodes is not None:
        stats = extrapolate_stats(samples, at_nodes, at_edges)
    elif len(samples) > 1:
        raise GnnPipeError("several graphs are samples for extrapolation: give --at-nodes")
    else:
        stats = samples[0]
    if mirror_ratio is not None:
        stats = override_mirror_ratio(stats, *mirror_ratio)
    if calibrate_rates:
        if not graphs:
            raise GnnPipeError("--calibrate times the model on a real graph: give --graph")
        from .graph import read_graph

        hw = calibrate(read_graph(graphs[-1]), model, hw, threads=threads, dtype=dtype, clock=clock)
    result = plan(stats, model, int(stats["num_features"]), int(stats["num_classes"]), hw, workers,
                  chunks_per_stage=chunks_per_stage, dtype_bytes=DTYPE_BYTES[dtype], overlap=overlap,
                  balance=balance, first_input=first_input)
    if not quiet:
        stream = sys.stdout
        g = result.graph
        print(f"plan: {g.get('name')} (N={g['num_nodes']:,}, E={g['num_edges']:,}, "
              f"F={g['num_features']}), {model.kind} {model.layers} layers hidden {model.hidden}, "
              f"{workers} workers on {hw.name}", file=stream)
        print(result.table(), file=stream)
        print(result.reason, file=stream)
        for n in result.notes:
            print(f"note: {n}", file=stream)
    if out_json is not None:
        d = result.as_dict()
        d["hardware_profile"] = hw.as_dict()
        write_json(out_json, d)
    return result


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``gnnpipe plan`` on the CLI's sub-parsers."""
    p = subparsers.add_parser(
        "plan", help="predict and compare graph / pipeline / hybrid layouts on a cluster",
        description="Predict, for every layout of --workers workers (graph parallelism, GNNPipe, "
                    "hybrid), the bytes per epoch (exact), the epoch time, the pipeline bubble and "
                    "the peak memory per worker on a hardware profile, and recommend the fastest "
                    "that fits. Partition statistics are computed with METIS on the graph and "
                    "cached next to it.")
    p.add_argument("--graph", action="append", help="graph.h5 (repeat: samples of one shape to "
                                                    "extrapolate to --at-nodes)")
    p.add_argument("--stats", help="a plan statistics JSON instead of --graph")
    p.add_argument("--at-nodes", type=int, help="extrapolate the statistics to this many nodes")
    p.add_argument("--at-edges", type=int, help="... and this many stored edges (default: same E/N)")
    p.add_argument("--mirror-ratio", metavar="G:R", type=_ratio,
                   help="scale every partition's mirrors so that G parts have R*N (e.g. 8:2.1, a "
                        "published figure for the graph the statistics stand in for)")
    p.add_argument("--model", help="YAML of the model config (a models.<name> entry)")
    p.add_argument("--kind", choices=["gcn", "sage", "gat", "gcnii", "resgcn"], help="override model.kind")
    p.add_argument("--layers", type=int, help="override model.layers")
    p.add_argument("--hidden", type=int, help="override model.hidden")
    p.add_argument("--hardware", required=True,
                   help="a profile name under config/hardware (e.g. 8xgpu-pcie) or a YAML file")
    p.add_argument("--workers", type=int, required=True, help="number of workers P")
    p.add_argument("--chunks-per-stage", type=int, default=4, help="pipeline chunks C = this x S")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES))
    p.add_argument("--method", default="metis", choices=["metis", "random", "contiguous"])
    p.add_argument("--seed", type=int, default=0, help="partition seed")
    p.add_argument("--balance", default="estimate", choices=["uniform", "estimate", "profile"],
                   help="stage split, as pipeline.balance")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="graph parallelism without overlap of inner rows and halo exchange")
    p.add_argument("--first-input", default="local", choices=list(cm.FIRST_INPUT),
                   help="graph parallelism's first conv: input halo cached at set-up (local, the "
                        "engine's default), rows forward only, or rows and gradients (exchanged)")
    p.add_argument("--calibrate", action="store_true",
                   help="fit the compute rates to this machine on the (last) graph first")
    p.add_argument("--threads", type=int, default=1, help="compute threads per worker for --calibrate")
    p.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                   help="--calibrate timing: wall clock, or the thread's CPU time (a shared machine)")
    p.add_argument("--out", help="write the plan as JSON here")
    p.set_defaults(func=_cli)
    return p


def add_calibrate_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``gnnpipe calibrate`` (the workflow's ``calibrate`` rule)."""
    p = subparsers.add_parser(
        "calibrate", help="fit a hardware profile's compute rates to a run's graph and model",
        description="Time every distinct conv of the run's model forward and backward on samples "
                    "of its graph (and the bare kernels), fit the cost model's compute rates "
                    "(dense FLOP/s, sparse and elementwise values/s, random numbers/s, per-call "
                    "overhead) and write the profile with those rates as YAML. The links keep the "
                    "profile's values. Takes a few seconds.")
    p.add_argument("--run-config", required=True, help="results/runs/<run_id>/run.yaml of a run to fit to")
    p.add_argument("--hardware", required=True, help="base profile: a name under config/hardware or a YAML file")
    p.add_argument("--clock", default="cpu", choices=sorted(CLOCKS),
                   help="cpu (default): the timing thread's CPU time, blind to other jobs on the "
                        "machine; wall: wall-clock time (used anyway for several threads per worker)")
    p.add_argument("--out", required=True, help="profile to write (YAML)")
    p.set_defaults(func=lambda a: write_hardware(calibrate_run(a.run_config, a.hardware, clock=a.clock), a.out))
    return p


def add_stats_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``gnnpipe plan-stats`` (the workflow's ``plan_stats`` rule)."""
    p = subparsers.add_parser(
        "plan-stats", help="partition statistics the cost model needs, as JSON",
        description="Partition the graph into each of --parts parts (as the partition rule does) "
                    "and write the statistics the cost model reads: rows, inner rows, in-edges and "
                    "mirrors per part. An existing file for the same graph content, method and seed "
                    "is extended, not recomputed.")
    p.add_argument("--graph", required=True, help="graph.h5")
    p.add_argument("--parts", type=int, nargs="*", default=[],
                   help="part counts (none: the graph's sizes only)")
    p.add_argument("--method", default="metis", choices=["metis", "random", "contiguous"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-balance-edges", dest="balance_edges", action="store_false")
    p.add_argument("--out", required=True, help="statistics JSON to write")
    p.set_defaults(func=lambda a: cached_graph_stats(a.graph, a.parts, method=a.method, seed=a.seed,
                                                     balance_edges=a.balance_edges, progress=True,
                                                     cache_file=a.out))
    return p


def _ratio(text: str) -> tuple[int, float]:
    try:
        g, r = text.split(":")
        return int(g), float(r)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PARTS:RATIO such as 8:2.1, got {text!r}") from None


def _cli(a) -> None:
    data = {}
    if a.model:
        data = load_yaml(a.model) or {}
        if not isinstance(data, dict):
            raise GnnPipeError(f"{a.model}: a model config is a mapping")
    for key in ("kind", "layers", "hidden"):
        if getattr(a, key) is not None:
            data[key] = getattr(a, key)
    run_plan(a.graph, data, a.hardware, a.workers, a.out, stats_path=a.stats, at_nodes=a.at_nodes,
             at_edges=a.at_edges, chunks_per_stage=a.chunks_per_stage, dtype=a.dtype, method=a.method,
             seed=a.seed, overlap=a.overlap, balance=a.balance, calibrate_rates=a.calibrate,
             threads=a.threads, mirror_ratio=a.mirror_ratio, first_input=a.first_input, clock=a.clock)


def main(argv=None) -> int:
    """``python -m gnnpipe.plan --graph ... --hardware ... --workers P`` (same flags as
    ``gnnpipe plan``)."""
    parser = argparse.ArgumentParser(prog="python -m gnnpipe.plan")
    add_plan_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    try:
        args.func(args)
    except GnnPipeError as e:
        print(f"gnnpipe plan: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
