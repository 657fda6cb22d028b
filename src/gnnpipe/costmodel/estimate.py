"""Epoch time and peak memory of a layout, estimated: the cost model's prediction of a run.

Time (:func:`estimate`). Every mode is one layout ``S × G`` with ``C`` chunks (``C / G``
per way): graph is ``1 × P`` with one chunk per way, GNNPipe ``S × 1``. Per chunk, stage
``s`` runs the forward of its convs on the chunk's rows against the way's source rows
(own rows plus halo), exchanges halo rows with the other ways before each aggregation
(``comm_overlap`` of it overlapped with the inner rows' work when ``overlap``) and sends
the chunk's output to stage ``s+1``; the backward mirrors it. The epoch is the engine's own
schedule (``gnnpipe.schedule.gpipe``) priced by :func:`gnnpipe.schedule.simulate` with these
per-chunk times: for GPipe over ``c = C / G`` chunks that is ``Σ_s F_s + (c-1) max_s F_s``
forward (``F_s``: stage ``s``'s time per chunk, the links between stages as steps of their own)
and the same backward, so the slowest stage idles ``(S-1)/(c+S-1)`` of the epoch when
balanced: the bubble. Then the weight gradients are all-reduced across the ways of every stage.
A conv's time is ``dense FLOPs / dense rate + sparse work (entries × width) / sparse
rate + elementwise values / elementwise rate + a fixed per-call overhead``, its work counts
its kind's own declaration (``gnnpipe.costmodel.work``, ``gnnpipe.models.<kind>.work``),
which follow the layers' choice of transform-then-aggregate or the reverse. Links: per-worker
bandwidth and a per-message latency inside a node (optionally a bisection limit, e.g. two CPU
sockets under PCIe), a NIC per node shared by its workers between nodes. More workers than
cores (``oversubscribe``, the CPU profile): compute and loopback transfers run at the share of
a core each worker gets (not a link of its own rate: ``link_on_cores: false``), and every
blocking exchange costs ``oversubscribed_wait_us`` more (its peers must each get a turn on
a core first).

Memory (:func:`estimate`): per worker, the graph structure of its rows (the CSR and its
cached transpose, ``STRUCT_BYTES_PER_ENTRY`` per stored entry), input features of its
source rows (first stage), the per-layer history buffers of a way with several chunks (and
their gradients), the activations kept for backward for the chunks the schedule holds at once
(:func:`gnnpipe.schedule.in_flight`; GPipe keeps every chunk's until the backward),
parameters with gradients and Adam's two moments, and the largest temporary of one conv.
With ``recompute``, one chunk's activations at a time, and each conv's halo rows of every chunk
as its forward read them (the rebuild reads the same). On a CPU, the heap a training process
keeps (``engine.retain_freed_memory``) holds ``retained_heap_fraction`` of the activations more
(the hardware profile's; ``benchmarks/bench_memory_modes.py`` measures it: 0.33–0.49 in every
mode on DC-SBM 4·10^4 nodes, GCNII 16 × 128), and the process itself ``process_overhead_gib``.

Bytes are the exact closed forms of :mod:`gnnpipe.costmodel.bytes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Optional, Sequence

from .. import schedule
from ..io import GnnPipeError
from ..layout import check_layout
from .bytes import halo_values, hybrid_bytes
from .hardware import Hardware
from .work import ModelShape, Work, gather_work, layer_cost, loss_work, rowwise_work


@dataclass
class WayStats:
    """The G-way partition the ways (or graph-parallel parts) own: per way, its nodes,
    its in-edges, its mirrors (halo size) and its inner nodes (no in-neighbour outside)."""

    nodes: list[float]
    edges: list[float]
    mirrors: list[float]
    inner: list[float]

    @classmethod
    def whole(cls, num_nodes: int, num_edges: int) -> "WayStats":
        return cls([float(num_nodes)], [float(num_edges)], [0.0], [float(num_nodes)])

    @classmethod
    def from_partition(cls, stats: dict) -> "WayStats":
        """From a ``partition_stats``-like dict (``nodes_per_part``, ``edges_per_part``,
        ``mirrors``, optionally ``inner_per_part``)."""
        nodes = [float(x) for x in stats["nodes_per_part"]]
        inner = stats.get("inner_per_part")
        return cls(nodes, [float(x) for x in stats["edges_per_part"]],
                   [float(x) for x in stats["mirrors"]],
                   [float(x) for x in inner] if inner is not None else [0.0] * len(nodes))

    @property
    def ways(self) -> int:
        return len(self.nodes)


@dataclass
class Estimate:
    """One layout's predicted epoch: times in seconds, bytes (exact), memory per worker."""

    mode: str
    workers: int
    stages: int
    ways: int
    chunks: int
    stage_bounds: list[tuple[int, int]]
    bytes: dict
    epoch_s: float
    compute_s: float  # the slowest stage's compute (the critical path's)
    comm_s: float  # communication on the critical path (halo, p2p, all-reduce)
    bubble_s: float  # the slowest stage's pipeline idle time
    bubble_fraction: float
    imbalance: float  # slowest stage's time per chunk over the mean stage's
    peak_mem_bytes: float  # max over workers
    memory: dict = field(default_factory=dict)  # breakdown of the largest worker's memory
    stage_times: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["stage_bounds"] = [list(b) for b in self.stage_bounds]
        return d


#: Persistent bytes of graph structure per stored block entry: the block's int64 indices
#: (8) and its cached destination-of-edge (8); the kernel CSR with int32 indices (4), int64
#: rows (8), its transpose's int32 indices (4) and int64 permutation (8); one value (4).
#: See gnnpipe.models.ops (block_csr / self_loop_csr / gcn_values).
STRUCT_BYTES_PER_ENTRY = 44


def _a2a_seconds(bytes_per_worker: float, group: int, busy_on_node: int, hw: Hardware,
                 wpn: Optional[int] = None) -> float:
    """One all-to-all in which each of ``group`` workers (contiguous ranks) sends and
    receives about ``bytes_per_worker``, spread evenly over its peers. ``busy_on_node``
    workers of every node exchange at the same time: they share the node's NIC and, where
    the profile has one, the bisection between the node's two halves (e.g. CPU sockets)."""
    if group <= 1 or bytes_per_worker <= 0:
        return 0.0
    wpn = wpn or hw.workers_per_node  # workers placed on one node
    peers = group - 1
    on_node = min(group, wpn)  # members of the group on each of its nodes
    local, remote = on_node - 1, peers - (on_node - 1)
    v_local, v_remote = bytes_per_worker * local / peers, bytes_per_worker * remote / peers
    t = v_local / hw.intra_bandwidth
    if hw.intra_bisection_gbs is not None and local and on_node > wpn // 2:
        # about half of a worker's on-node peers sit across the bisection, and half of the
        # node's busy workers send across it in each direction
        cross = v_local * (on_node / 2) / local
        t = max(t, busy_on_node / 2 * cross / (hw.intra_bisection_gbs * 1e9))
    t += local * hw.intra_latency
    if remote:
        t = max(t, v_remote / (hw.inter_bandwidth / busy_on_node)) + remote * hw.inter_latency
    return t


def _p2p_seconds(nbytes: float, same_node: bool, senders_on_node: int, hw: Hardware) -> float:
    if nbytes <= 0:
        return 0.0
    if same_node:
        return hw.intra_latency + nbytes / hw.intra_bandwidth
    return hw.inter_latency + nbytes / (hw.inter_bandwidth / max(1, senders_on_node))


def _allreduce_seconds(nbytes: float, group: int, spans_nodes: bool, groups_per_node: int,
                       hw: Hardware, bucket_bytes: float = 25 * 2**20) -> float:
    """Ring all-reduce of ``nbytes`` across ``group`` workers (bucketed as the communicator)."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    buckets = max(1, math.ceil(nbytes / bucket_bytes))
    if spans_nodes:
        bw, lat = hw.inter_bandwidth / max(1, groups_per_node), hw.inter_latency
    else:
        bw, lat = hw.intra_bandwidth, hw.intra_latency
    return 2.0 * (group - 1) / group * nbytes / bw + buckets * 2.0 * (group - 1) * lat


def _row_time(row: dict) -> float:
    """What one (stage, way) adds per chunk to the pipeline: its steps and its links."""
    return row["F"] + row["B"] + row["encoder_s"] + max(row["link_fwd_s"], row["link_bwd_s"])


def _check_layout(mode: str, shape: ModelShape, stages: int, ways: int, chunks: int,
                  bounds: Sequence[tuple[int, int]], way_stats: WayStats,
                  chunk_stats: Optional[WayStats]) -> None:
    check_layout(mode, stages * ways, stages, ways, chunks, layers=len(shape.layers), exact_ok=True,
                 where=f"{mode} {stages} x {ways}, {chunks} chunks")
    if len(bounds) != stages:
        raise GnnPipeError(f"{stages} stages but {len(bounds)} stage bounds")
    if way_stats.ways != ways:
        raise GnnPipeError(f"{ways} ways but partition statistics for {way_stats.ways} parts")
    if chunks > ways and (chunk_stats is None or chunk_stats.ways != chunks):
        raise GnnPipeError(f"{chunks} chunks need the statistics of a {chunks}-part partition "
                           "(each chunk aggregates over its rows and its halo)")
    covered = [l for a, b in bounds for l in range(a, b)]
    if covered != list(range(len(shape.layers))) or any(b <= a for a, b in bounds):
        raise GnnPipeError(f"stage bounds {list(bounds)} must split convs 0..{len(shape.layers) - 1} "
                           "into non-empty contiguous blocks")


def _chunks_of_way(g: int, cw: int, way_stats: WayStats, chunk_stats: Optional[WayStats]):
    """``(rows, in-edges, source rows)`` of every chunk of way ``g``: the way itself when it
    is one chunk (its rows and its halo), else chunks ``g·cw .. (g+1)·cw - 1`` of the
    C-way partition, each aggregating over its rows and its own halo."""
    if cw == 1:
        return [(way_stats.nodes[g], way_stats.edges[g], way_stats.nodes[g] + way_stats.mirrors[g])]
    cs = chunk_stats
    return [(cs.nodes[c], cs.edges[c], cs.nodes[c] + cs.mirrors[c]) for c in range(g * cw, (g + 1) * cw)]


def estimate(shape: ModelShape, *, mode: str, stages: int, ways: int, chunks: int,
             bounds: Sequence[tuple[int, int]], way_stats: WayStats, num_nodes: int,
             num_edges: int, hw: Hardware, chunk_stats: Optional[WayStats] = None,
             bytes_per_value: int = 4, overlap: bool = True, first_input: str = "exchanged",
             history_buffers: int = 3, recompute: bool = False, retained_heap: bool = True) -> Estimate:
    """Predict one epoch of layout ``stages × ways`` with ``chunks`` chunks (module docstring).

    ``bounds[s] = (a, b)``: stage ``s`` owns convs ``a..b-1``. ``way_stats``: the
    ``ways``-way partition (``WayStats.whole`` for one way); ``chunk_stats``: the
    ``chunks``-way partition when a way has several chunks (way ``g`` owns chunks
    ``g·C/G ..``). ``first_input``: what the first conv's halo costs (graph engine:
    ``"local"``, the input halo cached at set-up). ``history_buffers``: whole-graph
    buffers per buffered conv input (current, gradient, snapshot, history).
    ``recompute``: activations are recomputed in the backward instead of kept.
    ``retained_heap``: the run's process keeps freed memory (``gnnpipe.io.heap_retained``), so its peak
    holds ``hw.retained_heap_fraction`` of the activations more.
    """
    _check_layout(mode, shape, stages, ways, chunks, bounds, way_stats, chunk_stats)
    halo_values([1], first_input)  # validates first_input
    S, G, b = stages, ways, int(bytes_per_value)
    P = S * G
    cw = chunks // G  # chunks per way
    wpn = hw.workers_per_node
    cap = hw.max_workers()
    if cap is not None and P > cap:
        raise GnnPipeError(f"{P} workers do not fit {hw.name} ({hw.nodes} node(s) x {wpn} workers)")
    slowdown, wait = 1.0, 0.0
    if hw.oversubscribe and hw.nodes is not None and P > hw.nodes * wpn:
        slowdown = P / (hw.nodes * wpn)  # time-sharing the cores
        wpn = math.ceil(P / hw.nodes)  # ... of the nodes there are: all workers sit on them
        # the cores move the bytes too (loopback), at the share of a core a worker gets,
        # and every blocking exchange waits for its peers' turns on a core
        if hw.link_on_cores:
            hw = replace(hw, intra_bandwidth_gbs=hw.intra_bandwidth_gbs / slowdown)
        wait = hw.oversubscribed_wait_us * 1e-6
    eff = (hw.shared_node_efficiency if P > 1 else hw.single_worker_speedup) / slowdown
    dims = shape.exchange_dims
    params = shape.params_per_stage(bounds)
    x0 = 2 if shape.carries_x0 else 1
    busy_on_node = min(P, wpn)
    buffered = cw > 1  # per-conv whole-way buffers (history) only where a way has several chunks
    hdims = dims if buffered else shape.halo_dims  # the narrow side where nothing is buffered

    stage_rows = []
    for s, (a, bnd) in enumerate(bounds):
        worst = None
        for g in range(G):
            inner = way_stats.inner[g] / way_stats.nodes[g] if way_stats.nodes[g] else 0.0
            halo_rows = way_stats.mirrors[g] / cw  # mirrors to exchange per chunk
            f = bw = halo_f = halo_b = 0.0
            for n_c, e_c, src_c in _chunks_of_way(g, cw, way_stats, chunk_stats):
                for l in range(a, bnd):
                    lc = layer_cost(shape.layers[l], n_c, src_c, e_c,
                                    memoised=not (l == 0 and first_input == "forward"))
                    gf, gb = (gather_work(n_c, src_c, hdims[l], shape.layers[l].input_grad)
                              if src_c > n_c else (Work(), Work()))
                    fwd, bwd = lc.fwd + gf, lc.bwd + gb
                    if overlap and G > 1:  # inner and boundary rows are two conv calls
                        fwd.calls += 1.0
                        bwd.calls += 1.0
                    tf, tb = fwd.seconds(hw, eff), bwd.seconds(hw, eff)
                    if recompute:
                        tb += tf
                    th = 0.0
                    if G > 1 and not (l == 0 and first_input == "local"):
                        th = _a2a_seconds(halo_rows * hdims[l] * b, G, busy_on_node, hw, wpn)
                    thb = 0.0 if (l == 0 and first_input != "exchanged") else th
                    # the halo is in flight while the inner rows aggregate (forward), and
                    # while the inner rows' backward runs (the engine overlaps both); the
                    # wait for oversubscribed peers is not hidden; comm_overlap of the
                    # transfer proceeds during that work, the rest is paid after it
                    hide_f = inner * tf if overlap else 0.0
                    hide_b = inner * tb if overlap else 0.0
                    f += tf
                    bw += tb
                    halo_f += th - hw.comm_overlap * min(th, hide_f) + (wait if th > 0 else 0.0)
                    halo_b += thb - hw.comm_overlap * min(thb, hide_b) + (wait if thb > 0 else 0.0)
                if s == S - 1:
                    dec = rowwise_work(shape.decoder, n_c, True) + loss_work(n_c, shape.num_classes)
                    f += dec.scale(1 / 3).seconds(hw, eff)
                    bw += dec.scale(2 / 3).seconds(hw, eff)
            enc = 0.0
            if s == 0 and shape.encoder:  # once per epoch on the way's rows and halo
                enc = rowwise_work(shape.encoder, way_stats.nodes[g] + way_stats.mirrors[g],
                                   False, shape.encoder_dropout).seconds(hw, eff)
            n_row = way_stats.nodes[g] / cw  # rows per chunk crossing a stage boundary
            rank = s * G + g
            # The chunk's rows to the same way of the next stage, their gradients back: sent
            # asynchronously (receives posted up front), so a transfer is a pipeline stage of
            # its own, the link, overlapping the next chunk's compute; the sender's cores pay
            # the share of it that does not proceed during compute (1 - comm_overlap), and a
            # receive on oversubscribed cores waits for the sender's turn (``wait``)
            p2p_f = p2p_b = 0.0
            if s < S - 1:
                p2p_f = _p2p_seconds(n_row * dims[bnd] * b * x0, rank // wpn == (rank + G) // wpn,
                                     min(G, wpn), hw)
            if s > 0:
                p2p_b = _p2p_seconds(n_row * dims[a] * b * x0, rank // wpn == (rank - G) // wpn,
                                     min(G, wpn), hw)
            own_f = (1.0 - hw.comm_overlap) * p2p_f + (wait if s < S - 1 else 0.0)
            own_b = (1.0 - hw.comm_overlap) * p2p_b + (wait if s > 0 else 0.0)
            row = dict(stage=s, way=g, fwd_compute_s=f, bwd_compute_s=bw, encoder_s=enc,
                       halo_fwd_s=halo_f, halo_bwd_s=halo_b, p2p_fwd_s=p2p_f * cw, p2p_bwd_s=p2p_b * cw,
                       link_fwd_s=p2p_f, link_bwd_s=p2p_b,
                       F=(f + halo_f) / cw + own_f, B=(bw + halo_b) / cw + own_b)
            if worst is None or _row_time(row) > _row_time(worst):
                worst = row
        worst["allreduce_s"] = _allreduce_seconds(params[s] * b, G, G > wpn, max(1, wpn // G), hw) \
            + (wait if G > 1 else 0.0)
        worst["optimizer_s"] = Work(elem=16.0 * params[s], calls=1.0).seconds(hw, eff)  # Adam
        stage_rows.append(worst)

    Fs = [r["F"] for r in stage_rows]
    Bs = [r["B"] for r in stage_rows]
    # The engine's schedule, priced: every chunk's forward through the stages and the links
    # between them, then every backward in reverse (GPipe: the slowest of those 2S - 1 steps
    # paces the other chunks); stage 0's encoder runs before its first chunk (its backward,
    # after its last, is counted there too)
    acts = schedule.gpipe(S, range(cw))
    done = schedule.simulate(
        acts, lambda a: (Fs if a.kind == schedule.F else Bs)[a.stage],
        lambda a: stage_rows[a.stage]["link_fwd_s" if a.kind == schedule.SEND_F else "link_bwd_s"],
        start={0: stage_rows[0]["encoder_s"]})
    pipe = max(done.values())
    epoch = pipe + max(r["allreduce_s"] + r["optimizer_s"] for r in stage_rows)
    busy = [r["fwd_compute_s"] + r["bwd_compute_s"] + r["encoder_s"] for r in stage_rows]
    slow = max(range(S), key=lambda k: Fs[k] + Bs[k] + stage_rows[k]["encoder_s"] / cw)
    r = stage_rows[slow]
    compute = busy[slow] + r["optimizer_s"]
    # as the engines book it: the stage-to-stage transfers are waited for in the receive,
    # i.e. they fall in the bubble (epoch - compute - comm); rounding leftovers are 0
    comm = r["halo_fwd_s"] + r["halo_bwd_s"] + r["allreduce_s"]
    bubble = epoch - compute - comm
    bubble = bubble if bubble > 1e-9 * epoch else 0.0
    per_chunk = [f + bb for f, bb in zip(Fs, Bs)]
    imbalance = max(per_chunk) / (sum(per_chunk) / S) if sum(per_chunk) > 0 else 1.0

    mem, breakdown = _peak_memory(shape, S, G, cw, bounds, way_stats, chunk_stats, b, params,
                                  buffered, history_buffers, recompute, schedule.in_flight(acts))
    # the heap a process that keeps freed memory holds beyond its live tensors (hw's fraction)
    breakdown["heap"] = hw.retained_heap_fraction * breakdown["activations"] if retained_heap else 0.0
    mem += breakdown["heap"]
    breakdown["runtime"] = hw.process_overhead_gib * 2**30  # the process itself (CPU: resident set)
    mem += breakdown["runtime"]
    mirrors = [int(round(m)) for m in way_stats.mirrors]
    # one closed form for every mode: G = P is graph parallelism, G = 1 GNNPipe, 1 x 1 nothing
    nbytes = hybrid_bytes(num_nodes, mirrors, dims, bounds, params, b, shape.carries_x0, first_input=first_input,
                          halo_dims=hdims)
    return Estimate(mode=mode, workers=P, stages=S, ways=G, chunks=chunks, stage_bounds=list(bounds),
                    bytes=nbytes, epoch_s=epoch, compute_s=compute, comm_s=comm, bubble_s=bubble,
                    bubble_fraction=bubble / epoch if epoch > 0 else 0.0, imbalance=imbalance,
                    peak_mem_bytes=mem, memory=breakdown, stage_times=stage_rows)


def _peak_memory(shape: ModelShape, S: int, G: int, cw: int, bounds, way_stats: WayStats,
                 chunk_stats: Optional[WayStats], b: int, params: Sequence[int], buffered: bool,
                 history_buffers: int, recompute: bool, held: int) -> tuple[float, dict]:
    """The largest worker's peak memory (bytes) and its breakdown (see the module docstring)."""
    dims = shape.exchange_dims
    best, best_bd = -1.0, {}
    for s, (a, bnd) in enumerate(bounds):
        for g in range(G):
            n, m = way_stats.nodes[g], way_stats.mirrors[g]
            rows = n + m  # the way's rows and its halo (the whole graph for one way)
            chunks = _chunks_of_way(g, cw, way_stats, chunk_stats)
            entries = sum(e_c + n_c for n_c, e_c, _ in chunks)
            halo_ids = sum(src - n_c for n_c, _, src in chunks)
            bd = {"structure": STRUCT_BYTES_PER_ENTRY * entries + 8.0 * (n + len(chunks))
                  + 16.0 * halo_ids + 2.0 * b * rows}
            bd["features"] = rows * shape.in_features * b if s == 0 else 0.0
            bd["labels"] = n * 11.0 if s == S - 1 else 0.0
            buf = 0.0
            for l in range(a, bnd):
                if l > 0 and buffered:  # the history of conv l's input
                    buf += history_buffers * rows * dims[l] * b
                elif l == 0 and shape.encoder:  # the encoder's output on every row, and its gradient
                    buf += 2 * rows * dims[0] * b
            if shape.carries_x0 and s > 0:  # the x0 rows received with the chunks
                buf += rows * shape.x0_dim * b
            bd["buffers"] = buf
            act, temp = [], 0.0
            for n_c, e_c, src_c in chunks:
                kept = 0.0
                for l in range(a, bnd):
                    spec = shape.layers[l]
                    lc = layer_cost(spec, n_c, src_c, e_c)
                    kept += (src_c * (dims[l] + lc.saved_src) + n_c * (lc.saved_dst + spec.d_out)
                             + (e_c + n_c) * lc.saved_entry) * b
                    temp = max(temp, (src_c * (lc.temp_src + dims[l]) + n_c * (dims[l] + 2 * spec.d_out)) * b)
                act.append(kept)
            # recompute rebuilds one chunk's graph at a time, and keeps from every chunk's forward
            # each conv's halo rows as it read them (the rebuild reads the same rows: the buffers
            # move on); else the schedule's chunks in flight
            if recompute:
                bd["activations"] = max(act) + halo_ids * sum(dims[l] for l in range(a, bnd)) * b
            else:
                bd["activations"] = sum(act) if held >= len(act) else sum(sorted(act)[-held:])
            if s == 0 and shape.encoder:
                bd["activations"] += rows * sum(d for _, d in shape.encoder) * 2 * b
            bd["temporaries"] = temp
            bd["parameters"] = 4.0 * params[s] * b  # weights, gradients, Adam's two moments
            total = sum(bd.values())
            if total > best:
                best, best_bd = total, dict(bd, stage=s, way=g)
    return best, best_bd
