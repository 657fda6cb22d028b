"""Hardware profiles (``config/hardware/<name>.yaml``): one kind of worker and how workers are
connected, read, checked and scaled here (the cost model's only file I/O)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional

from ..config import from_dict, load_yaml
from ..io import GnnPipeError

HARDWARE_DIR = Path(__file__).resolve().parents[3] / "config" / "hardware"


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
    # CPU: what a training process's heap keeps on top of its live tensors, as a fraction of the
    # activations it holds for backward. A node training process keeps freed memory for reuse
    # (``engine.retain_freed_memory``: no mmap, no trim), and the forward's freed temporaries,
    # allocated between the tensors autograd keeps, leave holes later requests do not all fit;
    # ru_maxrss counts them (``benchmarks/bench_memory_modes.py`` measures it). GPU: 0 (the
    # caching allocator's reserve is not what the run record's max_memory_allocated counts)
    retained_heap_fraction: float = 0.0
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
        for key in ("intra_latency_us", "layer_overhead_us", "oversubscribed_wait_us", "process_overhead_gib",
                    "retained_heap_fraction"):
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
    retained_heap_fraction: float = 0.0
    inter_bandwidth_gbs: Optional[float] = None
    inter_latency_us: Optional[float] = None
    description: str = ""
    source: str = ""

    def check(self, path: str) -> None:
        Hardware(**self.__dict__).check(path)


def scale_links(hw: Hardware, factor: float) -> Hardware:
    """``hw`` with every link bandwidth (intra, bisection, inter) multiplied by ``factor``."""
    return replace(hw, intra_bandwidth_gbs=hw.intra_bandwidth_gbs * factor,
                   intra_bisection_gbs=None if hw.intra_bisection_gbs is None else hw.intra_bisection_gbs * factor,
                   inter_bandwidth_gbs=None if hw.inter_bandwidth_gbs is None else hw.inter_bandwidth_gbs * factor)


def with_rates(hw: Hardware, **rates: Any) -> Hardware:
    """A copy of ``hw`` with some fields replaced (e.g. calibrated compute rates)."""
    return replace(hw, **rates)
