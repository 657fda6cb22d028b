"""The analytical cost model: bytes per epoch (exact), epoch time and peak memory (estimated).

Pure functions of sizes and a hardware profile: no torch, no process group. The closed
forms here are the single source of the byte counts that the engines' ``predicted_bytes()``
and ``gnnpipe plan`` both use (docs/ARCHITECTURE.md, docs/DESIGN.md §4).

Bytes (``b`` bytes per value, ``d_l`` the input width of conv ``l`` = ``GNN.exchange_dims()``)

* graph parallelism over ``P`` parts with ``M_p`` mirrors each:
  ``halo = 2 · Σ_p M_p · Σ_l d_l · b`` (halo rows forward, their gradients backward) and
  ``allreduce = 2 (P-1) · num_params · b`` (the ring rule ``2 (P-1)/P`` per rank, summed);
* GNNPipe over ``S`` stages: ``p2p = 2 · Σ_{s=1}^{S-1} N · d_{first conv of s} · b``, doubled
  when the initial residual ``x0`` (same width) travels too (GCNII);
* hybrid ``S × G``: the pipeline term (each way sends its own rows; the ways' rows sum to
  ``N``), the halo term of the G ways (way ``g`` = chunks ``g·C/G ..``) for every conv (whichever stage owns it),
  and per stage the all-reduce of that stage's parameters across its ``G`` ways.
  ``G = P`` is graph parallelism, ``G = 1`` GNNPipe (tested identities).

Time (:func:`estimate`). Every mode is one layout ``S × G`` with ``C`` chunks (``C / G``
per way): graph is ``1 × P`` with one chunk per way, GNNPipe ``S × 1``. Per chunk, stage
``s`` runs the forward of its convs on the chunk's rows against the way's source rows
(own rows plus halo), exchanges halo rows with the other ways before each aggregation
(``comm_overlap`` of it overlapped with the inner rows' work when ``overlap``) and sends
the chunk's output to stage ``s+1``; the backward mirrors it. GPipe over ``c = C / G`` chunks takes
``Σ_s F_s + (c-1) max_s F_s`` forward (``F_s``: stage ``s``'s time per chunk) and the same
backward, so the slowest stage idles ``(S-1)/(c+S-1)`` of the epoch when balanced: the
bubble. Then the weight gradients are all-reduced across the ways of every stage.
A conv's time is ``dense FLOPs / dense rate + sparse work (entries × width) / sparse
rate + elementwise values / elementwise rate + a fixed per-call overhead``; the work
counts follow the layers' own choice of transform-then-aggregate or the reverse
(``gnnpipe.models.gcn.aggregate_first``). Links: per-worker bandwidth and a per-message
latency inside a node (optionally a bisection limit, e.g. two CPU sockets under PCIe),
a NIC per node shared by its workers between nodes. More workers than cores
(``oversubscribe``, the CPU profile): compute and loopback transfers run at the share of
a core each worker gets (not a link of its own rate: ``link_on_cores: false``), and every
blocking exchange costs ``oversubscribed_wait_us`` more (its peers must each get a turn on
a core first).

Memory (:func:`estimate`): per worker, the graph structure of its rows (the CSR and its
cached transpose, ``STRUCT_BYTES_PER_ENTRY`` per stored entry), input features of its
source rows (first stage), the per-layer embedding buffers of the pipeline (and their
gradients), the activations kept for backward for all its chunks (GPipe keeps every
chunk's until the backward), parameters with gradients and Adam's two moments, and the
largest temporary of one conv.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional, Sequence

from .io import GnnPipeError
from .layout import check_layout

# ===================================================================== bytes (exact)


def allreduce_bytes(num_params: int, bytes_per_value: int, ranks: int) -> int:
    """Bytes all ``ranks`` send together in a ring all-reduce of ``num_params`` values:
    ``2 (n-1) · num_params · b`` (the communicator counts each rank's exact share)."""
    if ranks <= 1:
        return 0
    return 2 * (int(ranks) - 1) * int(num_params) * int(bytes_per_value)


def _bytes(halo: int = 0, p2p: int = 0, allreduce: int = 0) -> dict:
    return {"halo": int(halo), "p2p": int(p2p), "allreduce": int(allreduce),
            "total": int(halo) + int(p2p) + int(allreduce)}


FIRST_INPUT = ("exchanged", "forward", "local")


def _halo_values(exchange_dims: Sequence[int], first_input: str) -> int:
    """Values one mirror costs per epoch over all convs, both directions.

    ``first_input``: what the first conv's input costs: ``"exchanged"`` (rows forward,
    gradients back: docs/DESIGN.md's ``2 · Σ_l d_l``), ``"forward"`` (raw features: rows forward
    only, no gradient) or ``"local"`` (the input halo is cached at set-up: nothing).
    """
    if first_input not in FIRST_INPUT:
        raise GnnPipeError(f"first_input must be one of {', '.join(FIRST_INPUT)}, got {first_input!r}")
    dims = [int(d) for d in exchange_dims]
    if not dims:
        return 0
    return 2 * sum(dims[1:]) + {"exchanged": 2, "forward": 1, "local": 0}[first_input] * dims[0]


def first_input(model, graph_parallel_cfg) -> str:
    """What the first conv's halo costs graph parallelism (one of ``FIRST_INPUT``), as the
    graph engine runs ``model`` (a built ``GNN``: its ``convs`` and ``encoder``) under
    ``graph_parallel_cfg`` (``config.GraphParallelConfig``): ``"local"`` when the input
    halo is cached at set-up (``cache_input_halo``) or there is no graph layer; else
    ``"exchanged"`` when the first conv reads an encoder's output (its gradient goes
    back) and ``"forward"`` when it reads the raw features (no gradient)."""
    if graph_parallel_cfg.cache_input_halo or not len(model.convs):
        return "local"
    return "exchanged" if model.encoder is not None else "forward"


def graph_parallel_bytes(mirrors_per_part: Sequence[int], exchange_dims: Sequence[int],
                         bytes_per_value: int, num_params: int, world: int,
                         first_input: str = "exchanged") -> dict:
    """Bytes sent per epoch by all ranks of graph parallelism (``world`` parts).

    ``halo = 2 · Σ_p M_p · Σ_l d_l · b`` (``first_input="exchanged"``; see
    :func:`_halo_values` for the cheaper first-conv variants); ``allreduce = 2 (P-1) ·
    num_params · b``. For a GCN of ``L`` layers ``Σ_l d_l = F + (L-1) H``.
    """
    if len(mirrors_per_part) != world:
        raise GnnPipeError(f"graph parallelism on {world} workers needs {world} mirror counts, "
                           f"got {len(mirrors_per_part)}")
    halo = sum(int(m) for m in mirrors_per_part) * _halo_values(exchange_dims, first_input) \
        * int(bytes_per_value)
    return _bytes(halo=halo, allreduce=allreduce_bytes(num_params, bytes_per_value, world))


def pipeline_bytes(num_nodes: int, stage_boundary_dims: Sequence[int], bytes_per_value: int,
                   carries_x0: bool = False) -> dict:
    """Bytes sent per epoch by all stages of GNNPipe.

    ``stage_boundary_dims[k]``: the width of the rows crossing boundary ``k`` (the input
    width of the first conv of stage ``k+1``). Every node's row crosses every boundary
    once forward and its gradient once backward: ``2 · Σ_k N · d_k · b``; doubled when
    ``x0`` (of the same width) travels with it.
    """
    per_row = sum(int(d) for d in stage_boundary_dims) * (2 if carries_x0 else 1)
    return _bytes(p2p=2 * int(num_nodes) * per_row * int(bytes_per_value))


def boundary_dims(exchange_dims: Sequence[int], stage_bounds: Sequence[tuple[int, int]]) -> list[int]:
    """The width crossing each stage boundary: the input width of stages 1..S-1's first conv."""
    return [int(exchange_dims[a]) for a, _ in list(stage_bounds)[1:]]


def hybrid_bytes(num_nodes: int, mirrors_per_way: Sequence[int], exchange_dims: Sequence[int],
                 stage_bounds: Sequence[tuple[int, int]], params_per_stage: Sequence[int],
                 bytes_per_value: int, carries_x0: bool = False,
                 nodes_per_way: Optional[Sequence[int]] = None, first_input: str = "exchanged") -> dict:
    """Bytes sent per epoch by all ranks of hybrid ``S × G`` (``G = len(mirrors_per_way)``).

    * p2p: every way sends its ``N_g`` rows across every stage boundary and their
      gradients back (``Σ_g N_g = N``): the pipeline term;
    * halo: inside the stage that owns conv ``l``, the ``G`` ways exchange the mirrors of
      the G-way partition, ``2 · Σ_g M_g · d_l · b`` per conv (so ``Σ_l`` over all convs;
      ``first_input`` as in :func:`graph_parallel_bytes`);
    * allreduce: stage ``s``'s parameters across its ``G`` ways, ``2 (G-1) · params_s · b``.

    ``G = P`` (one stage) equals :func:`graph_parallel_bytes`, ``G = 1``
    :func:`pipeline_bytes`.
    """
    ways = len(mirrors_per_way)
    if ways < 1:
        raise GnnPipeError("hybrid needs at least one way")
    if len(params_per_stage) != len(stage_bounds):
        raise GnnPipeError(f"{len(stage_bounds)} stages but {len(params_per_stage)} parameter counts")
    if nodes_per_way is None:
        nodes_per_way = [num_nodes]  # only the sum matters for the total
    elif len(nodes_per_way) != ways or sum(int(n) for n in nodes_per_way) != num_nodes:
        raise GnnPipeError(f"nodes_per_way must hold {ways} counts summing to {num_nodes}")
    dims = boundary_dims(exchange_dims, stage_bounds)
    p2p = sum(pipeline_bytes(n, dims, bytes_per_value, carries_x0)["p2p"] for n in nodes_per_way)
    covered = sorted(l for a, b in stage_bounds for l in range(a, b))
    if covered != list(range(len(exchange_dims))):
        raise GnnPipeError(f"stage bounds {list(stage_bounds)} do not cover convs 0..{len(exchange_dims) - 1} "
                           "exactly once")
    halo = sum(int(m) for m in mirrors_per_way) * _halo_values(exchange_dims, first_input) \
        * int(bytes_per_value)
    allreduce = sum(allreduce_bytes(p, bytes_per_value, ways) for p in params_per_stage)
    return _bytes(halo=halo, p2p=p2p, allreduce=allreduce)


# ===================================================================== hardware profiles

#: Where the profiles of this repository live (``config/hardware/<name>.yaml``).
HARDWARE_DIR = Path(__file__).resolve().parents[2] / "config" / "hardware"


@dataclass
class Hardware:
    """One kind of worker and how workers are connected; read from ``config/hardware/*.yaml``.

    Units in the file are the human ones (GFLOP/s, GB/s with GB = 10^9 bytes, µs, GiB);
    the ``*_per_s``/``*_s``/``*_bytes`` properties give SI values.
    """

    name: str
    workers_per_node: int  # workers that run at full rate on one node (GPUs, or cores)
    memory_gib: float  # memory one worker may use
    dense_gflops: float  # dense matmul throughput of one worker, GFLOP/s
    sparse_gvalues: float  # CSR SpMM throughput: 10^9 (stored entry x feature) per second
    elementwise_gvalues: float  # memory-bound per-value ops (norm, ReLU, dropout): 10^9 values/s
    intra_bandwidth_gbs: float  # per worker, per direction, to a worker on the same node
    intra_latency_us: float  # per message inside a node
    layer_overhead_us: float = 0.0  # fixed cost of one conv call (launches, autograd, Python)
    random_gvalues: Optional[float] = None  # random numbers drawn (dropout masks), 10^9/s (None: elementwise)
    shared_node_efficiency: float = 1.0  # rate factor when every worker of a node computes at once
    # rate factor of a process that trains alone (single mode): its tensors stay in cache from
    # conv to conv, which the rates above (timed cold) do not assume (gnnpipe calibrate fits it)
    single_worker_speedup: float = 1.0
    intra_bisection_gbs: Optional[float] = None  # per direction between the two halves of a node (None: non-blocking)
    nodes: Optional[int] = None  # how many nodes exist (None: as many as a plan needs)
    oversubscribe: bool = False  # more workers than workers_per_node time-share a node (CPU)
    # Oversubscribed only: what one blocking exchange (all-to-all, a stage's receive, an
    # all-reduce) costs on top of its transfer, because the peers it waits for must each get
    # their turn on a core first (about a scheduler time slice; bench_calibrate measures it)
    oversubscribed_wait_us: float = 0.0
    # Oversubscribed only: the link's bytes are copied by the cores the workers compute on
    # (loopback, shared memory), so each worker gets its share of the link as of a core.
    # False where the link is a rate of its own: a NIC, or an emulated link whose rate was
    # measured with every worker on the cores (benchmarks/bench_netem.py)
    link_on_cores: bool = True
    # the share of a transfer that proceeds while its worker computes: 1 where a DMA engine
    # or the NIC moves the bytes (GPUs), less where the worker's own cores copy them (gloo
    # over loopback on a CPU; bench_calibrate measures it)
    comm_overlap: float = 1.0
    # memory a worker holds before any tensor of the run: CPU, the process's resident set
    # after importing torch (what ru_maxrss counts on top of the tensors); GPU: 0 (the run
    # record's figure is max_memory_allocated, tensors only)
    process_overhead_gib: float = 0.0
    inter_bandwidth_gbs: Optional[float] = None  # per node (its NIC, shared by its workers), per direction
    inter_latency_us: Optional[float] = None
    description: str = ""
    source: str = ""  # where the numbers come from
    measured: dict = field(default_factory=dict)  # raw measurements / provenance (free form)

    def check(self, path: str = "hardware") -> None:
        positive = ("workers_per_node", "memory_gib", "dense_gflops", "sparse_gvalues",
                    "elementwise_gvalues", "intra_bandwidth_gbs")
        for key in positive:
            if not getattr(self, key) > 0:
                raise GnnPipeError(f"{path}.{key}: must be > 0, got {getattr(self, key)!r}")
        for key in ("intra_latency_us", "layer_overhead_us", "oversubscribed_wait_us", "process_overhead_gib"):
            if getattr(self, key) < 0:
                raise GnnPipeError(f"{path}.{key}: must be >= 0, got {getattr(self, key)!r}")
        if not self.single_worker_speedup >= 1:
            raise GnnPipeError(f"{path}.single_worker_speedup: must be >= 1, got {self.single_worker_speedup!r}")
        if not 0 <= self.comm_overlap <= 1:
            raise GnnPipeError(f"{path}.comm_overlap: must lie in [0, 1], got {self.comm_overlap!r}")
        if not 0 < self.shared_node_efficiency <= 1:
            raise GnnPipeError(f"{path}.shared_node_efficiency: must lie in (0, 1], "
                               f"got {self.shared_node_efficiency!r}")
        if self.random_gvalues is not None and not self.random_gvalues > 0:
            raise GnnPipeError(f"{path}.random_gvalues: must be > 0 or null")
        if self.intra_bisection_gbs is not None and not self.intra_bisection_gbs > 0:
            raise GnnPipeError(f"{path}.intra_bisection_gbs: must be > 0 or null")
        if self.nodes is not None and self.nodes < 1:
            raise GnnPipeError(f"{path}.nodes: must be >= 1 or null, got {self.nodes!r}")
        if self.nodes != 1 and (self.inter_bandwidth_gbs is None or self.inter_latency_us is None):
            raise GnnPipeError(f"{path}: a profile with more than one node needs "
                               "inter_bandwidth_gbs and inter_latency_us (or set nodes: 1)")
        if self.inter_bandwidth_gbs is not None and not self.inter_bandwidth_gbs > 0:
            raise GnnPipeError(f"{path}.inter_bandwidth_gbs: must be > 0")

    # SI views
    @property
    def dense_flops(self) -> float:
        return self.dense_gflops * 1e9

    @property
    def sparse_rate(self) -> float:
        return self.sparse_gvalues * 1e9

    @property
    def elementwise_rate(self) -> float:
        return self.elementwise_gvalues * 1e9

    @property
    def random_rate(self) -> float:
        return (self.random_gvalues or self.elementwise_gvalues) * 1e9

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    @property
    def intra_bandwidth(self) -> float:
        return self.intra_bandwidth_gbs * 1e9

    @property
    def intra_latency(self) -> float:
        return self.intra_latency_us * 1e-6

    @property
    def inter_bandwidth(self) -> float:
        return (self.inter_bandwidth_gbs or 0.0) * 1e9

    @property
    def inter_latency(self) -> float:
        return (self.inter_latency_us or 0.0) * 1e-6

    @property
    def layer_overhead(self) -> float:
        return self.layer_overhead_us * 1e-6

    def max_workers(self) -> Optional[int]:
        """The most workers this hardware runs (None: unbounded)."""
        if self.nodes is None or self.oversubscribe:
            return None
        return self.nodes * self.workers_per_node

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def hardware_path(name_or_path: str | os.PathLike) -> Path:
    """A profile's file: a path as given, or ``<name>`` under ``config/hardware/``
    (of the working directory first, then of this repository)."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    for base in (Path("config") / "hardware", HARDWARE_DIR):
        cand = base / f"{p.name}.yaml"
        if cand.exists():
            return cand
    known = sorted(q.stem for q in HARDWARE_DIR.glob("*.yaml"))
    raise GnnPipeError(f"no hardware profile {str(name_or_path)!r}: give a YAML file or one of "
                       f"{', '.join(known) or '(none found)'}")


def load_hardware(name_or_path: str | os.PathLike) -> Hardware:
    """Read a hardware profile, refusing unknown keys, wrong types and bad values."""
    from .config import from_dict, load_yaml

    path = hardware_path(name_or_path)
    data = load_yaml(path)
    if not isinstance(data, dict):
        raise GnnPipeError(f"{path}: a hardware profile is a mapping of keys to values")
    measured = data.pop("measured", {}) or {}
    if not isinstance(measured, dict):
        raise GnnPipeError(f"{path}.measured: expected a mapping, got {type(measured).__name__}")
    hw = from_dict(_HardwareFields, data, path=str(path))
    return Hardware(**hw.__dict__, measured=measured)


@dataclass
class _HardwareFields:
    """``Hardware`` minus its free-form ``measured`` block (typed loading via ``from_dict``)."""

    name: str
    workers_per_node: int
    memory_gib: float
    dense_gflops: float
    sparse_gvalues: float
    elementwise_gvalues: float
    intra_bandwidth_gbs: float
    intra_latency_us: float
    layer_overhead_us: float = 0.0
    random_gvalues: Optional[float] = None
    shared_node_efficiency: float = 1.0
    single_worker_speedup: float = 1.0
    intra_bisection_gbs: Optional[float] = None
    nodes: Optional[int] = None
    oversubscribe: bool = False
    oversubscribed_wait_us: float = 0.0
    link_on_cores: bool = True
    comm_overlap: float = 1.0
    process_overhead_gib: float = 0.0
    inter_bandwidth_gbs: Optional[float] = None
    inter_latency_us: Optional[float] = None
    description: str = ""
    source: str = ""

    def check(self, path: str) -> None:
        Hardware(**self.__dict__).check(path)


# ===================================================================== work of one conv


@dataclass(frozen=True)
class LayerSpec:
    """What the cost model needs to know about one conv (see ``plan.model_shape``)."""

    kind: str  # gcn | sage | gat | gcnii | resgcn
    d_in: int
    d_out: int
    norm: bool = False  # LayerNorm after the conv (GraphLayer)
    act: bool = False  # ReLU after the conv
    dropout: bool = False  # dropout after the conv
    heads: int = 1  # gat
    head_dim: int = 0  # gat: width of one head (d_out = heads * head_dim when heads are concatenated)
    input_grad: bool = True  # False for a first conv fed raw features (no gradient flows there)
    params: int = 0
    # gcn/sage first conv on raw features: it memoises the aggregation of an input that comes
    # back unchanged (``gnnpipe.models.ops.static_aggregate``), paid once a run, not per epoch
    static_input: bool = False


@dataclass(frozen=True)
class ModelShape:
    """A GNN as the cost model sees it: its convs and its per-node encoder/decoder."""

    layers: tuple[LayerSpec, ...]
    in_features: int
    num_classes: int
    encoder: tuple[tuple[int, int], ...] = ()  # Linear (d_in, d_out) maps, in order
    decoder: tuple[tuple[int, int], ...] = ()
    encoder_params: int = 0
    decoder_params: int = 0
    carries_x0: bool = False  # GCNII: x0 crosses stage boundaries with h
    x0_dim: int = 0
    encoder_dropout: int = 0  # values per row the encoder drops out (GCNII: H)

    @property
    def exchange_dims(self) -> list[int]:
        return [l.d_in for l in self.layers]

    @property
    def num_params(self) -> int:
        return sum(l.params for l in self.layers) + self.encoder_params + self.decoder_params

    def params_per_stage(self, bounds: Sequence[tuple[int, int]]) -> list[int]:
        out = [sum(self.layers[l].params for l in range(a, b)) for a, b in bounds]
        out[0] += self.encoder_params
        out[-1] += self.decoder_params
        return out


@dataclass
class Work:
    """Work of one pass: dense FLOPs, sparse entries × width, elementwise values, random
    values drawn (dropout masks), calls."""

    dense: float = 0.0
    sparse: float = 0.0
    elem: float = 0.0
    calls: float = 0.0
    rng: float = 0.0

    def __add__(self, o: "Work") -> "Work":
        return Work(self.dense + o.dense, self.sparse + o.sparse, self.elem + o.elem,
                    self.calls + o.calls, self.rng + o.rng)

    def scale(self, k: float) -> "Work":
        return Work(self.dense * k, self.sparse * k, self.elem * k, self.calls * k, self.rng * k)

    def seconds(self, hw: Hardware, efficiency: float = 1.0) -> float:
        return ((self.dense / hw.dense_flops + self.sparse / hw.sparse_rate
                 + self.elem / hw.elementwise_rate + self.rng / hw.random_rate) / efficiency
                + self.calls * hw.layer_overhead)


@dataclass
class LayerCost:
    """Forward and backward work of one conv on one block, and what it keeps for backward
    beyond its input (values per destination row, per source row, per stored entry)."""

    fwd: Work
    bwd: Work
    saved_dst: float = 0.0
    saved_src: float = 0.0
    saved_entry: float = 0.0
    temp_src: float = 0.0  # largest temporary, values per source row

    def training(self) -> Work:
        return self.fwd + self.bwd


def _aggregate_first(n_src: float, n_dst: float, nnz: float, d_in: float, d_out: float) -> bool:
    # the layers' rule (gnnpipe.models.gcn.aggregate_first), restated without torch
    return nnz * d_in + n_dst * d_in * d_out <= n_src * d_in * d_out + nnz * d_out


def _linear_aggregate(n_dst, n_src, m, d_in, d_out, input_grad) -> LayerCost:
    """A linear map ``d_in -> d_out`` and a fixed-weight aggregation over ``m`` entries,
    in the order the layer picks."""
    g = 2.0 if input_grad else 1.0  # backward: weight gradient, and input gradient if needed
    if _aggregate_first(n_src, n_dst, m, d_in, d_out):
        mm = 2.0 * n_dst * d_in * d_out
        return LayerCost(Work(dense=mm, sparse=m * d_in), Work(dense=g * mm, sparse=m * d_in if input_grad else 0.0),
                         saved_dst=d_in, temp_src=0.0)
    mm = 2.0 * n_src * d_in * d_out
    return LayerCost(Work(dense=mm, sparse=m * d_out), Work(dense=g * mm, sparse=m * d_out),
                     temp_src=d_out)  # saves its input x: the block's source rows themselves


def layer_cost(spec: LayerSpec, n_dst: float, n_src: float, nnz: float,
               memoised: Optional[bool] = None) -> LayerCost:
    """Work of conv ``spec`` on a block of ``n_dst`` destinations, ``n_src`` sources and
    ``nnz`` stored in-edges (self loops, where the layer adds them, on top).

    ``memoised`` (default ``spec.static_input``): the conv's input is the same tensor every
    call, so its aggregation is memoised and costs nothing per epoch (a first conv on raw
    features, held for the run: single, GNNPipe's stage 0, graph parallelism with the input
    halo cached); False where the input is rebuilt every epoch (its halo forwarded anew)."""
    k, d_in, d_out = spec.kind, float(spec.d_in), float(spec.d_out)
    memo = spec.static_input if memoised is None else bool(memoised and spec.static_input)
    if k in ("gcn", "sage") and memo:  # (A x) W with A x memoised: the matmul and its weight gradient
        mm = 2.0 * n_dst * d_in * d_out
        c = LayerCost(Work(dense=mm), Work(dense=mm), saved_dst=d_in)
        if k == "sage":
            c.fwd.dense += mm  # the self term, and its weight gradient
            c.bwd.dense += mm
            c.saved_dst += d_in
    elif k == "gcn":
        c = _linear_aggregate(n_dst, n_src, nnz + n_dst, d_in, d_out, spec.input_grad)
    elif k == "sage":
        c = _linear_aggregate(n_dst, n_src, nnz, d_in, d_out, spec.input_grad)
        self_mm = 2.0 * n_dst * d_in * d_out
        c.fwd.dense += self_mm
        c.bwd.dense += self_mm * (2.0 if spec.input_grad else 1.0)
        c.saved_dst += d_in
    elif k == "gcnii":
        m = nnz + n_dst
        mm = 2.0 * n_dst * d_in * d_in
        c = LayerCost(Work(dense=mm, sparse=m * d_in, elem=6.0 * n_dst * d_in,
                           rng=n_dst * d_in if spec.dropout else 0.0),
                      Work(dense=2.0 * mm, sparse=m * d_in if spec.input_grad else 0.0,
                           elem=8.0 * n_dst * d_in),
                      saved_dst=2.25 * d_in, temp_src=0.0)
    elif k == "resgcn":
        # pre-activation (LayerNorm, ReLU, dropout) on every *source* row, then a GCN conv
        c = _linear_aggregate(n_dst, n_src, nnz + n_dst, d_in, d_out, True)
        c.fwd.elem += 10.0 * n_src * d_in + n_dst * d_out
        c.fwd.rng += n_src * d_in if spec.dropout else 0.0
        c.bwd.elem += 13.0 * n_src * d_in + n_dst * d_out
        c.saved_src += 2.25 * d_in
        c.temp_src = max(c.temp_src, d_in)
    elif k == "gat":
        H, D = float(spec.heads), float(spec.head_dim or spec.d_out)
        m = nnz + n_dst  # with self edges
        score = 2.0 * (n_src + n_dst) * d_in * H  # x . (W^T a) for sources and destinations
        g = 2.0 if spec.input_grad else 1.0
        if m * d_in + n_dst * d_in * D <= n_src * d_in * D + m * D:  # gat._aggregate_first
            mm, width, saved_dst, saved_src = 2.0 * n_dst * H * d_in * D, d_in, H * d_in, 0.0
        else:
            mm, width, saved_dst, saved_src = 2.0 * n_src * d_in * H * D, D, 0.0, H * D
        # edge scores, softmax and dropout per (entry, head); backward adds the SDDMM
        fwd = Work(dense=score + mm, sparse=H * m * width, elem=9.0 * m * H)
        bwd = Work(dense=g * (score + mm), sparse=2.0 * H * m * width, elem=12.0 * m * H)
        c = LayerCost(fwd, bwd, saved_dst=saved_dst, saved_src=saved_src, saved_entry=2.0 * H,
                      temp_src=H * D)
    else:
        raise GnnPipeError(f"cost model: unknown conv kind {k!r}")
    # bias and the GraphLayer post-processing act on the destination rows
    post = n_dst * d_out * ((1.0 if k in ("gcn", "sage", "gat") else 0.0) + (8.0 if spec.norm else 0.0)
                            + (1.0 if spec.act else 0.0) + (1.0 if spec.dropout else 0.0))
    c.fwd.elem += post
    c.bwd.elem += 1.5 * post
    if spec.dropout and k in ("gcn", "sage", "gat"):
        c.fwd.rng += n_dst * d_out  # the mask
    c.saved_dst += d_out * ((1.0 if spec.norm else 0.0) + (1.0 if spec.act else 0.0)
                            + (0.25 if spec.dropout else 0.0))
    c.fwd.calls += 1.0
    c.bwd.calls += 1.0
    return c


def rowwise_work(linears: Sequence[tuple[int, int]], rows: float, input_grad: bool,
                 dropout_per_row: float = 0.0) -> Work:
    """Training work (forward + backward) of a per-node stack of Linear maps (with an
    activation after each) on ``rows`` rows; ``dropout_per_row`` values get a dropout mask."""
    w = Work(rng=rows * dropout_per_row)
    for i, (a, b) in enumerate(linears):
        mm = 2.0 * rows * a * b
        g = 2.0 if (input_grad or i > 0) else 1.0
        w = w + Work(dense=mm * (1.0 + g), elem=6.0 * rows * b)
    if linears:
        w.calls += 2.0
    return w


def loss_work(rows: float, num_classes: int) -> Work:
    """Cross-entropy forward + backward on ``rows`` rows (log-softmax, gather, gradients)."""
    return Work(elem=8.0 * rows * num_classes, calls=1.0)


# ===================================================================== layout and time


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


def _gather_work(n_dst: float, n_src: float, d: float, input_grad: bool) -> tuple[Work, Work]:
    """Assembling a block's source rows ``cat(own rows, halo rows)`` and, backward (when the
    input takes a gradient), adding the halo rows' gradients back where they belong
    (index_select / index_add)."""
    halo = max(n_src - n_dst, 0.0)
    return Work(elem=2.0 * n_src * d), Work(elem=(2.0 * halo * d + n_dst * d) if input_grad else 0.0)


def estimate(shape: ModelShape, *, mode: str, stages: int, ways: int, chunks: int,
             bounds: Sequence[tuple[int, int]], way_stats: WayStats, num_nodes: int,
             num_edges: int, hw: Hardware, chunk_stats: Optional[WayStats] = None,
             bytes_per_value: int = 4, overlap: bool = True, first_input: str = "exchanged",
             history_buffers: int = 3, recompute: bool = False) -> Estimate:
    """Predict one epoch of layout ``stages × ways`` with ``chunks`` chunks (module docstring).

    ``bounds[s] = (a, b)``: stage ``s`` owns convs ``a..b-1``. ``way_stats``: the
    ``ways``-way partition (``WayStats.whole`` for one way); ``chunk_stats``: the
    ``chunks``-way partition when a way has several chunks (way ``g`` owns chunks
    ``g·C/G ..``). ``first_input``: what the first conv's halo costs (graph engine:
    ``"local"``, the input halo cached at set-up). ``history_buffers``: whole-graph
    buffers per buffered conv input (current, gradient, snapshot, history).
    ``recompute``: activations are recomputed in the backward instead of kept.
    """
    _check_layout(mode, shape, stages, ways, chunks, bounds, way_stats, chunk_stats)
    _halo_values([1], first_input)  # validates first_input
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
    buffered = S > 1 or cw > 1  # per-conv whole-way buffers instead of one pass

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
                    gf, gb = (_gather_work(n_c, src_c, dims[l], shape.layers[l].input_grad)
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
                        th = _a2a_seconds(halo_rows * dims[l] * b, G, busy_on_node, hw, wpn)
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
    # GPipe: every chunk's forward through the stages and the links between them, then every
    # backward in reverse; the slowest of those 2S - 1 steps paces the other chunks; stage
    # 0's encoder runs before the first chunk and its backward after the last
    steps_f = Fs + [r["link_fwd_s"] for r in stage_rows[:-1]]
    steps_b = Bs + [r["link_bwd_s"] for r in stage_rows[1:]]
    pipe = sum(steps_f) + (cw - 1) * max(steps_f) + sum(steps_b) + (cw - 1) * max(steps_b) \
        + stage_rows[0]["encoder_s"]
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
                                  buffered, history_buffers, recompute)
    breakdown["runtime"] = hw.process_overhead_gib * 2**30  # the process itself (CPU: resident set)
    mem += breakdown["runtime"]
    mirrors = [int(round(m)) for m in way_stats.mirrors]
    if mode == "graph":
        nbytes = graph_parallel_bytes(mirrors, dims, b, shape.num_params, G, first_input)
    elif mode == "pipeline":
        nbytes = pipeline_bytes(num_nodes, boundary_dims(dims, bounds), b, shape.carries_x0)
    elif mode == "single":
        nbytes = _bytes()
    else:
        nbytes = hybrid_bytes(num_nodes, mirrors, dims, bounds, params, b, shape.carries_x0,
                              first_input=first_input)
    return Estimate(mode=mode, workers=P, stages=S, ways=G, chunks=chunks, stage_bounds=list(bounds),
                    bytes=nbytes, epoch_s=epoch, compute_s=compute, comm_s=comm, bubble_s=bubble,
                    bubble_fraction=bubble / epoch if epoch > 0 else 0.0, imbalance=imbalance,
                    peak_mem_bytes=mem, memory=breakdown, stage_times=stage_rows)


def _peak_memory(shape: ModelShape, S: int, G: int, cw: int, bounds, way_stats: WayStats,
                 chunk_stats: Optional[WayStats], b: int, params: Sequence[int], buffered: bool,
                 history_buffers: int, recompute: bool) -> tuple[float, dict]:
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
            if buffered:
                for l in range(a, bnd):
                    if l > 0:
                        buf += history_buffers * rows * dims[l] * b
                    elif shape.encoder:  # the encoder's output on every row, and its gradient
                        buf += 2 * rows * dims[0] * b
                if shape.carries_x0 and s > 0:
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
            bd["activations"] = max(act) if recompute else sum(act)
            if s == 0 and shape.encoder:
                bd["activations"] += rows * sum(d for _, d in shape.encoder) * 2 * b
            bd["temporaries"] = temp
            bd["parameters"] = 4.0 * params[s] * b  # weights, gradients, Adam's two moments
            total = sum(bd.values())
            if total > best:
                best, best_bd = total, dict(bd, stage=s, way=g)
    return best, best_bd


def scale_links(hw: Hardware, factor: float) -> Hardware:
    """``hw`` with every link bandwidth (intra, bisection, inter) multiplied by ``factor``."""
    return replace(hw, intra_bandwidth_gbs=hw.intra_bandwidth_gbs * factor,
                   intra_bisection_gbs=None if hw.intra_bisection_gbs is None else hw.intra_bisection_gbs * factor,
                   inter_bandwidth_gbs=None if hw.inter_bandwidth_gbs is None else hw.inter_bandwidth_gbs * factor)


def with_rates(hw: Hardware, **rates: Any) -> Hardware:
    """A copy of ``hw`` with some fields replaced (e.g. calibrated compute rates)."""
    return replace(hw, **rates)
