"""The graph as the plan sees it: its sizes and, for every candidate part count G, the
mirrors, nodes, in-edges and inner nodes per part of its METIS partition (:func:`graph_stats`),
computed on the real graph and cached (``<graph>.plan-stats.json``, keyed by the graph's
content hash, or the workflow's ``plan_stats`` rule's file). A graph too large to partition
here can be planned from smaller graphs of the same shape: :func:`extrapolate_stats` fits
the mirror ratio ``Σ M / N`` of each G against ``log N`` and scales the largest sample to the
target size."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np

from ..graph import read_graph, read_graph_attrs
from ..io import GnnPipeError, write_json

STATS_VERSION = 2  # 2: chunk_ways (the hybrid's ways as blocks of chunks)


def partition_summary(graph, assignment: np.ndarray, parts: int) -> dict:
    """``partition_stats`` plus the inner nodes of every part (no in-neighbour outside it)."""
    from ..partition import partition_stats  # (with scipy: not for the report reading a cached file)

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
                balance_edges: bool = True, balance_nodes: bool = True, progress: bool = False,
                assignments: Optional[Mapping[int, np.ndarray]] = None) -> dict:
    """What the plan needs of ``graph``: its sizes and, for every G in ``parts``, the
    statistics of its ``method`` partition into G parts (``partitions[str(G)]``).
    ``assignments[G]``, where given, is that partition already computed (the workflow's
    ``partition`` rule, same method, seed and balance): it is used instead of partitioning again.

    A hybrid run's ways are not a G-way partition of their own: way ``g`` owns the block
    ``g·C/G ..`` of the C chunks. So for every C in ``parts`` and every divisor ``1 < G <
    C``, ``chunk_ways[str(C)][str(G)]`` holds the statistics of those ways (the engine's
    halo per way, hence the hybrid's exact bytes)."""
    from ..partition import partition_graph

    out = {"version": STATS_VERSION, "name": graph.name, "num_nodes": graph.num_nodes,
           "num_edges": graph.num_edges, "num_features": graph.num_features,
           "num_classes": graph.num_classes, "method": method, "seed": seed,
           "balance_edges": balance_edges, "balance_nodes": balance_nodes, "partitions": {}, "chunk_ways": {}}
    for g in sorted(set(int(p) for p in parts)):
        t0 = time.perf_counter()
        given = (assignments or {}).get(g)
        a = given if given is not None else partition_graph(graph, method, g, seed=seed, balance_edges=balance_edges,
                                                              balance_nodes=balance_nodes)
        out["partitions"][str(g)] = partition_summary(graph, a, g)
        ways = {str(w): partition_summary(graph, a // (g // w), w) for w in range(2, g) if g % w == 0}
        if ways:
            out["chunk_ways"][str(g)] = ways
        if progress:
            r = out["partitions"][str(g)]["mirrors_over_n"]
            how = "given" if given is not None else "computed"
            print(f"[plan] {method} {g} parts ({how}): mirrors {r:.3f} N ({time.perf_counter() - t0:.1f} s)",
                  file=sys.stderr, flush=True)
    return out


def stats_cache_path(graph_path: str | os.PathLike) -> Path:
    p = Path(graph_path)
    return p.with_name(p.stem + ".plan-stats.json")


def cached_graph_stats(graph_path: str | os.PathLike, parts: Sequence[int], *, method: str = "metis",
                       seed: int = 0, balance_edges: bool = True, balance_nodes: bool = True, progress: bool = False,
                       cache_file: str | os.PathLike | None = None,
                       assignments: Optional[Mapping[int, str | os.PathLike]] = None) -> dict:
    """:func:`graph_stats` of a graph file, reusing (and extending) the JSON cache
    ``cache_file`` (default: next to the graph, :func:`stats_cache_path`); a cache of
    another graph content, method, seed or balance is ignored and rewritten.
    ``assignments``: part count -> partition file (``gnnpipe partition``) to read instead of
    partitioning again; :func:`read_assignments` checks that it was made with these settings."""
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
               balance_edges=balance_edges, balance_nodes=balance_nodes)
    if not (isinstance(cached, dict) and all(cached.get(k) == v for k, v in key.items())):
        cached = None
    need = [g for g in parts if cached is None or str(g) not in cached["partitions"]]
    if not need and cached is not None:  # (parts = []: no cache yet means compute the sizes)
        return cached
    graph = read_graph(graph_path)
    given = read_assignments({g: p for g, p in (assignments or {}).items() if g in need}, graph.num_nodes,
                             method=method, seed=seed, balance_edges=balance_edges, balance_nodes=balance_nodes)
    fresh = graph_stats(graph, need, method=method, seed=seed, balance_edges=balance_edges,
                        balance_nodes=balance_nodes, progress=progress, assignments=given)
    if cached is not None:
        fresh["partitions"] = {**cached["partitions"], **fresh["partitions"]}
        fresh["chunk_ways"] = {**cached.get("chunk_ways", {}), **fresh["chunk_ways"]}
    fresh["content_hash"] = digest
    write_json(cache_file, fresh)
    return fresh


def read_assignments(files: Mapping[int, str | os.PathLike], num_nodes: int, *, method: str, seed: int,
                     balance_edges: bool, balance_nodes: bool) -> dict[int, np.ndarray]:
    """Part count -> the assignment in its partition file, refused (one line) when the file's
    statistics JSON beside it (``<name>.json``, written with it by the ``partition`` rule) names
    another method, seed or balance than the ones asked for, or when it has no such JSON."""
    from ..partition import read_partition

    want = dict(method=method, seed=seed, balance_edges=balance_edges, balance_nodes=balance_nodes)
    out = {}
    for g, path in files.items():
        meta_path = Path(path).with_suffix(".json")
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as e:
            raise GnnPipeError(f"{meta_path}: the statistics of partition {path} are unreadable ({e}); "
                               "rebuild both with the 'partition' rule or leave out --assignment") from None
        wrong = {k: meta.get(k) for k, v in want.items() if meta.get(k) != v}
        if wrong:
            raise GnnPipeError(f"{path}: made with {wrong}, not {({k: want[k] for k in wrong})}: "
                               "leave out its --assignment (it is then partitioned afresh) or rebuild it")
        out[int(g)] = read_partition(path, num_nodes, int(g))
    return out


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
