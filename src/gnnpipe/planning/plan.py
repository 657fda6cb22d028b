"""``gnnpipe plan``: every layout of P workers predicted, the fastest that fits recommended,
with the reason in one paragraph (the overview is the package's docstring).

Usage::

    gnnpipe plan --graph results/data/synth/graph.h5 --layers 32 --hidden 100 \\
                 --hardware 8xgpu-pcie --workers 8 --out plan.json
    gnnpipe plan --graph g20k.h5 --graph g50k.h5 --graph g100k.h5 --at-nodes 232965 ...
    gnnpipe plan --graph graph.h5 --hardware cpu-2core --calibrate --workers 2 ...

``--calibrate`` times each conv of the model forward and backward on samples of the real
graph (and the bare kernels), on this machine, and fits the profile's compute rates to
them (:func:`gnnpipe.planning.calibrate.calibrate`) before planning.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..config import ModelConfig, PipelineConfig, from_dict, load_yaml, to_dict
from ..costmodel.bytes import boundary_dims, halo_values
from ..costmodel.estimate import Estimate
from ..costmodel.hardware import Hardware, load_hardware, scale_links
from ..costmodel.stages import graph_stage_memory
from ..costmodel.work import ModelShape
from ..graph import read_graph
from ..io import GnnPipeError, write_json
from ..layout import DEFAULT_CHUNKS_PER_STAGE, resolve_layout
from .calibrate import calibrate
from .predict import history_buffers, predict_layout, stage_bounds  # noqa: F401  (plan's API too)
from .shape import DTYPE_BYTES, build_model, model_shape
from .stats import cached_graph_stats, extrapolate_stats, override_mirror_ratio


@dataclass
class Plan:
    workers: int
    hardware: str
    graph: dict  # name, num_nodes, num_edges, num_features, num_classes, mirror ratios
    model: dict
    rows: list[Estimate]
    best: Optional[Estimate]
    reason: str
    dtype_bytes: int = 4
    notes: list[str] = field(default_factory=list)
    first_input: str = "local"
    sensitivity: dict = field(default_factory=dict)  # link-speed factor -> layout -> epoch s
    graph_stages: dict = field(default_factory=dict)  # data/partition/materialize -> peak bytes
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
                "sensitivity": self.sensitivity, "break_even": self.break_even,
                "graph_stages_peak_bytes": self.graph_stages}


def describe(r: Estimate) -> str:
    layout = {"graph": f"graph, {r.ways} parts", "pipeline": f"pipeline, {r.stages} stages, {r.chunks} chunks",
              "hybrid": f"hybrid, {r.stages} stages x {r.ways} ways, {r.chunks} chunks",
              "single": "single"}[r.mode]
    return f"{layout}: {r.epoch_s:.4g} s/epoch, {r.bytes['total'] / 1e9:.3f} GB/epoch"


def layouts(workers: int, num_layers: int, chunks_per_stage: int) -> list[tuple[str, int, int, int]]:
    """``(mode, stages, ways, chunks)`` of every layout of ``workers`` workers that
    ``gnnpipe.layout.resolve_layout`` (the workflow's rule) accepts."""
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


def plan(graph_stats: dict, model: ModelConfig, in_features: int, num_classes: int,
         hardware: Hardware, workers: int, *, chunks_per_stage: int = DEFAULT_CHUNKS_PER_STAGE,
         dtype_bytes: int = 4,
         overlap: bool = True, balance: str = "estimate", first_input: str = "local",
         pipeline_cfg: Optional[PipelineConfig] = None) -> Plan:
    """Enumerate the layouts of ``workers`` workers, predict each, recommend one.

    ``graph_stats``: ``num_nodes``, ``num_edges`` and ``partitions[str(K)]`` (per-part
    ``nodes_per_part``, ``edges_per_part``, ``mirrors``, ``inner_per_part``) for every
    K > 1 a layout uses (:func:`part_counts`: the ways and the chunks). ``first_input``:
    the graph engine caches the first conv's input halo at set-up (``"local"``, its
    default); ``"exchanged"`` is docs/DESIGN.md's upper bound. ``pipeline_cfg``: buffers and
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
    # the whole-graph stages run before any job, one process holding the whole graph on one node
    stages_mem = graph_stage_memory(N, int(graph_stats["num_edges"]), in_features)
    node_bytes = hardware.memory_bytes * hardware.workers_per_node
    over = {k: v for k, v in stages_mem.items() if v > node_bytes}
    if over:
        notes.append("does not fit before training: " + ", ".join(
            f"{k} needs about {v / 2**30:.1f} GiB" for k, v in over.items())
            + f" in one process, a node has {node_bytes / 2**30:g} GiB ({hardware.workers_per_node} x "
              f"{hardware.memory_gib:g}); run those rules on a larger machine")
    p = Plan(workers=workers, hardware=hardware.name, graph=gdesc, model=mdesc, rows=rows, best=best,
             reason="", dtype_bytes=dtype_bytes, notes=notes, first_input=first_input, graph_stages=stages_mem)

    def at(row: Estimate, factor: float) -> float:
        return predict_layout(graph_stats, gnn, shape, scale_links(hardware, factor), row.mode, row.stages,
                              row.ways, row.chunks, dtype_bytes=dtype_bytes, overlap=overlap, balance=balance,
                              first_input=first_input, pipeline_cfg=pc).epoch_s

    if workers > 1:
        p.sensitivity = {str(k): {_key(r): at(r, k) for r in rows} for k in SENSITIVITY}
        g = next((r for r in rows if r.mode == "graph"), None)
        pp = next((r for r in rows if r.mode == "pipeline"), None)
        if g is not None and pp is not None:
            p.break_even = _break_even(lambda k: at(g, k) - at(pp, k), hardware)
    p.reason = _reason(p, shape, N, hardware)
    return p


#: Link-speed factors of the sensitivity table (every bandwidth of the profile scaled).
SENSITIVITY = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0)


def _key(r: Estimate) -> str:
    return f"{r.mode} {r.stages}x{r.ways} c{r.chunks}"


def _break_even(diff, hw: Hardware, lo: float = 1e-3, hi: float = 1e3) -> Optional[dict]:
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


def _reason(p: Plan, shape: ModelShape, N: int, hw: Hardware) -> str:
    by_mode = {}
    for r in p.rows:
        if r.mode not in by_mode or r.epoch_s < by_mode[r.mode].epoch_s:
            by_mode[r.mode] = r
    L, b = len(shape.layers), p.dtype_bytes
    per_mirror = halo_values(shape.halo_dims, p.first_input)  # both directions, graph mode's narrow side
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
        dims = boundary_dims(shape.exchange_dims, pp.stage_bounds)
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


def _pipeline_overheads(pp: Estimate, shape: ModelShape) -> str:
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


def part_counts(workers: int, num_layers: int = 1 << 30,
                chunks_per_stage: int = DEFAULT_CHUNKS_PER_STAGE) -> list[int]:
    """Every partition (parts > 1) the layouts of ``workers`` need: the ways G of each
    layout (graph: G = P; hybrid: G = P/S) and its chunks C when a way has several."""
    need = set()
    for _, s, g, c in layouts(workers, num_layers, chunks_per_stage):
        need.update(k for k in (g, c) if k > 1)
    return sorted(need)


def _load_model_cfg(model_cfg) -> ModelConfig:
    if isinstance(model_cfg, ModelConfig):
        return model_cfg
    if isinstance(model_cfg, dict):
        return from_dict(ModelConfig, model_cfg, path="model")
    return from_dict(ModelConfig, load_yaml(model_cfg), path=str(model_cfg))


def run_plan(graph_path, model_cfg, hardware_path, workers: int, out_json=None, *,
             stats_path=None, at_nodes: Optional[int] = None, at_edges: Optional[int] = None,
             chunks_per_stage: int = DEFAULT_CHUNKS_PER_STAGE, dtype: str = "float32",
             method: str = "metis",
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
    model = _load_model_cfg(model_cfg)
    hw = load_hardware(hardware_path)
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
