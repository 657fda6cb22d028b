"""Inference with a trained atomic model: one structure's energy, forces and stress, in this process
or graph-parallel across N persistent local worker processes.

* :func:`structure_graph` builds one structure's graph with the *model's* settings (its cutoff,
  neighbour cap and convention, symmetric or not), so inference sees exactly the graphs of training:
  ``atomic.neighbors.system_graph``, what ``graphs.h5`` (format 2) holds for every kind; a model
  file trained on format-1 graphs (``symmetric_edges`` false: a per-target cut) gets that cut,
  from the same cell-list edges (``neighbors.directed_graph``: ``radius_graph`` without a cap gives
  the old dense search's edges in its order; the cut keeps each target's first ``max_neighbors``);
  a model file of the ``fairchem`` convention gets fairchem's graph (symmetric: its GemNet's; not:
  its DimeNet++'s, ``radius_graph_pbc``'s edges as they are).
* :class:`Predictor` is what the ASE calculator and ``predict`` call:
  ``predict(numbers, positions, cell, pbc, stress) -> Prediction`` (eV, eV/Å, eV/Å³, float64).
  ``workers=1`` computes here; ``workers=N`` keeps a :class:`WorkerPool`.
* :class:`WorkerPool`: N processes (a fork server that imported torch once, else spawn; gloo on
  127.0.0.1, the rendezvous store held here on a port the OS picks), each holding the model.
  This process is a pure client: per call it sends the structure's graph to every worker; worker
  r computes its ``parallel.shard_graph`` view (edge block r, the triplets of its edges, atom
  block r) with ``ShardedAtomGraph`` exactly as training's graph mode — or, in the atoms layout
  (``Predictor(layout=...)``; ``auto`` takes it when its closed-form bytes are fewer, as for one large
  system), its ``halo.shard_atoms`` view (METIS part r, receiving only its halo), or in the domains
  layout (``layout="domains"``, #35: the client decomposes the structure into spatial domains, sends
  worker r only its region's positions, and worker r builds its domain's edges and triplets
  itself, ``domains.domain_view``; the decomposition is kept until an atom moved ``skin / 2``,
  ``rebuilds`` counts them) the same view of its domain
  — and returns the energy
  (replicated), the forces of its own atoms and its part of ``dE/dε``. A worker that dies is
  found from its process sentinel within ~0.2 s (one error naming it, the others are stopped,
  nothing hangs); ``close()``, a ``with`` block, garbage collection or interpreter exit shut the
  workers down. Scripts that start workers need the ``if __name__ == "__main__":`` guard, as any
  spawn-based multiprocessing: a worker re-imports the script, and a script without it would start
  workers again there (the worker exits with ``NO_MAIN_GUARD``; the client says so in one line).
  ``workers`` is at most the CPU cores this process may use (:func:`cpu_cores`), or with
  ``oversubscribe=True`` ``OVERSUBSCRIBE`` (4) per core: processes time-sharing the cores, for
  measurements of memory at P above the cores (#35: P = 4 and 8 on 2 cores), not of speed.
  ``mem_mb_per_worker`` (domains layout): a structure whose estimated peak per worker at
  ``workers`` exceeds it is refused in one line naming the fewest workers that fit
  (:func:`check_memory`, at each new decomposition; the estimate needs the structure's radius graph
  on the client, O(E), only when the bound is given). ``auto`` with ``mem_mb_per_worker``
  (:meth:`Predictor.bounded_layout`): a structure whose workers would exceed it in the edges and
  atoms layouts (each holds the whole graph) and not in the domains layout is computed in the
  domains layout (``atom_layouts.choose_for_structure``; a model whose graph the distributed build
  cannot make, capped or not symmetric, is refused in one line instead); one that fits them is
  chosen between them by bytes as without a bound.
  **Bytes**: ``Predictor.last_bytes`` (the last call) and ``Predictor.bytes`` (the calls' sum) are the
  ledger of the calls across workers, by op: the client's payloads (``to_workers``; ``held``: a
  rebuild's Domain), the workers' replies and the workers' own communicator ops; the domains
  layout's closed form is ``DomainsLayout.call_bytes`` (equal, test).

**Checks and threads.** Every structure is checked before it is computed, as ``gnnpipe data``
checks a dataset's (``atomic.checks.check_structure``: finite positions and cell, no degenerate
periodic cell, no two atoms closer than ``min_distance``) and against the model's elements; a
refusal is a :class:`StructureError`, one line naming the structure. Each worker (``workers=1``:
this process, for the call only) computes on ``threads`` torch threads: given, else
``OMP_NUM_THREADS`` as training takes it, else the cores shared out (``cpu_cores() // workers``, at
most this process's own torch threads); ``Predictor.threads`` records it.

**Stress** is the strain derivative ``σ = (1/V) ∂E/∂ε`` at ``ε = 0`` (positions and cell
deformed by ``I + ε``; ``AtomGraph.strain``), symmetrised, in ASE's Voigt order
``xx, yy, zz, yz, xz, xy`` and sign (ASE's ``calculate_numerical_stress`` is its finite
difference; tests check both). For gradient-force models it comes from the forces' backward pass
at no extra cost; direct-force models need one more backward pass (only when asked).

Energies in eV are ``scale · y + mean + Σ e_ref[z]`` (the model file's normaliser), forces
``force_scale · f`` (mean 0 and force_scale = scale but for a model imported from fairchem).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_ready
from numbers import Integral
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from ..io import GnnPipeError
from .atom_layouts import ATOM_LAYOUTS, EDGES, PREDICT_LAYOUTS, AtomLayout, choose_layout
from .modelfile import ModelFile

VOIGT = ((0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1))  # ASE's order: xx yy zz yz xz xy
POLL_S = 0.2  # how often a waiting client looks at its workers' liveness
NO_MAIN_GUARD = 87  # a worker's exit code: it re-imported a script that starts workers at import
DEFAULT_SKIN = 1.0  # Å: the distributed build's Verlet skin (regions rebuilt once an atom moved half of it)


class StructureError(GnnPipeError):
    """A structure the model cannot compute (impossible, or with an element it never saw): one line naming it."""


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity; else the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


OVERSUBSCRIBE = 4  # workers per core allowed when asked (oversubscribe=True): measurements of memory, not speed


def check_workers(workers, oversubscribe: bool = False) -> int:
    """``workers`` as an int, refused in one line if not an integer >= 1 or more than the CPU cores
    this process may use — or, with ``oversubscribe`` (memory measurements at P above the cores:
    processes time-share them), more than ``OVERSUBSCRIBE`` per core."""
    if not isinstance(workers, Integral) or workers < 1:
        raise GnnPipeError(f"workers must be an integer >= 1, got {workers!r}")
    cores = cpu_cores()
    if oversubscribe and workers > OVERSUBSCRIBE * cores:
        raise GnnPipeError(f"workers {workers}: more than {OVERSUBSCRIBE} per CPU core ({cores} cores) even with "
                           f"oversubscribe; use at most {OVERSUBSCRIBE * cores}")
    if not oversubscribe and workers > cores:
        raise GnnPipeError(f"workers {workers}: more than the {cores} CPU cores this process may use; "
                           f"use at most {cores} (each worker is a process), or oversubscribe=True (Predictor, "
                           f"GNNPipeCalculator) to time-share them, up to {OVERSUBSCRIBE} per core")
    return int(workers)


def threads_per_worker(workers: int, threads: Optional[int] = None) -> int:
    """Torch threads of each of ``workers`` inference workers: ``threads`` if given, else
    ``OMP_NUM_THREADS`` (as training's workers take it), else the cores shared out
    (``cpu_cores() // workers``), never more than this process's own torch threads (a caller's
    ``torch.set_num_threads(1)`` holds)."""
    if threads is None:
        env = os.environ.get("OMP_NUM_THREADS", "")
        threads = int(env) if env.isdigit() and int(env) > 0 else \
            max(1, min(cpu_cores() // workers, torch.get_num_threads()))
    if not isinstance(threads, Integral) or threads < 1:
        raise GnnPipeError(f"threads must be an integer >= 1 (torch threads per worker), got {threads!r}")
    return int(threads)


@contextlib.contextmanager
def torch_threads(n: int):
    """``torch.set_num_threads(n)`` for the block only (a calculator must not change its caller's)."""
    old = torch.get_num_threads()
    if old != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if old != n:
            torch.set_num_threads(old)


@dataclass
class Prediction:
    """One structure's results (float64): energy (eV), forces (N, 3) eV/Å, stress (6,) eV/Å³ Voigt."""

    energy: float
    forces: np.ndarray
    stress: Optional[np.ndarray] = None


# --------------------------------------------------------------------------- the graph
def structure_graph(numbers, positions, cell, pbc, mf: ModelFile, dtype: str = "float32") -> dict:
    """One structure's batch arrays (``parallel.shard_graph``'s input) with the model's graph settings
    (``dtype``: the model's, computing; a ``fairchem`` graph is the one fairchem's model builds in it)."""
    from . import neighbors

    pos = np.ascontiguousarray(positions, dtype=np.float64).reshape(-1, 3)
    cell = np.asarray(cell, dtype=np.float64).reshape(3, 3)
    pbc = np.broadcast_to(np.asarray(pbc, dtype=bool), (3,))
    g = neighbors.system_graph(pos, cell, pbc, mf.cutoff, mf.max_neighbors, mf.neighbors, symmetric=mf.symmetric_edges,
                               dtype=dtype)
    z = np.asarray(numbers, dtype=np.int64)
    return {**g, "z": z, "pos": pos, "system": np.zeros(len(z), dtype=np.int64), "num_systems": 1}


def structure_only(numbers, positions, cell, pbc, mf: ModelFile) -> dict:
    """One structure without a graph, for a layout whose workers build their own (``distributed_build``):
    ``z, pos, system, num_systems, cell, pbc`` and the model's ``cutoff``."""
    z = np.asarray(numbers, dtype=np.int64)
    return {"z": z, "pos": np.ascontiguousarray(positions, dtype=np.float64).reshape(-1, 3),
            "system": np.zeros(len(z), dtype=np.int64), "num_systems": 1,
            "cell": np.asarray(cell, dtype=np.float64).reshape(3, 3),
            "pbc": np.broadcast_to(np.asarray(pbc, dtype=bool), (3,)).copy(), "cutoff": float(mf.cutoff)}


# --------------------------------------------------------------------------- one view
def view_outputs(model, g, stress: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """The model on one (possibly sharded) view, in model units: energies y (B,), the own atoms'
    forces (N_own, 3), and this view's part of ``dy/dε`` (3, 3) if ``stress`` (else None)."""
    gradient = getattr(model.cfg, "force_head", "gradient") == "gradient"
    eps = None
    if stress:
        eps = torch.zeros((3, 3), dtype=g.pos.dtype, device=g.pos.device, requires_grad=True)
        g = dataclasses.replace(g, strain=eps)
    with torch.enable_grad() if (stress or gradient) else torch.no_grad():
        out = model(g)
        dy_deps = out.get("strain_grad")
        if stress and dy_deps is None:  # direct forces: one more backward pass, for the stress only
            dy_deps, = torch.autograd.grad(out["energy"].sum(), eps)
    return out["energy"].detach(), out["forces"].detach(), None if dy_deps is None else dy_deps.detach()


def _numpy(t: Optional[Tensor]) -> Optional[np.ndarray]:
    return None if t is None else t.detach().to("cpu", torch.float64).numpy()


def check_input(mf: ModelFile, numbers, positions, cell, pbc, where: str = "",
                min_distance: Optional[float] = None) -> None:
    """Refuse a structure the model cannot compute (:class:`StructureError`, one line starting with
    ``where``): what ``gnnpipe data`` refuses in a dataset (``checks.check_structure``), then
    elements the model never saw."""
    from .checks import MIN_DISTANCE, check_structure
    try:
        check_structure(numbers, positions, cell, np.broadcast_to(np.asarray(pbc, dtype=bool), (3,)),
                        min_distance=MIN_DISTANCE if min_distance is None else min_distance,
                        where=where.removesuffix(": ") or "structure")
    except StructureError:
        raise
    except GnnPipeError as e:
        raise StructureError(str(e)) from None
    check_elements(mf, numbers, where)


def check_elements(mf: ModelFile, numbers, where: str = "") -> None:
    """One line naming the elements of ``numbers`` that the model never saw in training."""
    from ase.data import chemical_symbols

    def name(z: int) -> str:
        return chemical_symbols[z] if 0 <= z < len(chemical_symbols) else f"Z={z}"

    unseen = sorted(set(int(z) for z in np.unique(numbers)) - set(mf.elements))
    if unseen:
        raise StructureError(f"{where}element(s) {', '.join(f'{name(z)} (Z={z})' for z in unseen)} never seen in "
                           f"training; the model knows {', '.join(name(z) for z in mf.elements)}")


def check_memory(mf: ModelFile, b: dict, workers: int, dtype_bytes: int, mem_mb_per_worker: int, where: str = ""):
    """Refuse structure ``b`` (``structure_only``) at ``workers`` in the domains layout, in one line naming
    the fewest workers that fit, when its largest worker's estimated peak RSS (``DOMAINS.costs``, with
    the worker's RSS before the call) exceeds ``mem_mb_per_worker`` MiB."""
    from .atom_layouts import DOMAINS
    from .neighbors import radius_graph

    cap, kind, cfg = mem_mb_per_worker * 2**20, mf.spec, mf.config()
    graph = radius_graph(b["pos"], b["cell"], b["pbc"], b["cutoff"])
    peak = DOMAINS.WORKER_RSS + DOMAINS.costs(kind, cfg, b, workers, dtype_bytes, graph, priced=False)["memory"]
    if peak <= cap:
        return
    need = DOMAINS.smallest_fit(kind, cfg, b, cap, dtype_bytes, graph=graph)
    raise GnnPipeError(f"{where}{len(b['z']):,} atoms at workers={workers} in the domains layout: an estimated "
                       f"{peak / 2**20:,.0f} MB a worker, over mem_mb_per_worker={mem_mb_per_worker} "
                       + (f"(gnnpipe plan-atomic --structure): use workers={need}" if need else
                          "and no workers up to 256 fit: use a smaller model or a larger bound"))


# --------------------------------------------------------------------------- the predictor
class Predictor:
    """A trained model ready to evaluate structures, in this process (``workers=1``) or across
    ``workers`` persistent local processes (graph parallelism); see the module docstring."""

    def __init__(self, model_file: ModelFile, device="cpu", workers: int = 1, dtype: Optional[str] = None,
                 threads: Optional[int] = None, timeout_s: float = 600.0, layout: str = "auto",
                 min_distance: Optional[float] = None, skin: float = DEFAULT_SKIN, oversubscribe: bool = False,
                 mem_mb_per_worker: Optional[int] = None):
        from ..engine import DTYPES

        check_workers(workers, oversubscribe)
        self.threads = threads_per_worker(workers, threads)
        self.min_distance = min_distance
        if layout != "auto" and layout not in PREDICT_LAYOUTS:
            raise GnnPipeError(f"layout {layout!r}: one of auto, {', '.join(PREDICT_LAYOUTS.names())}")
        # the workers' layout (atom_layouts), None: chosen per structure (auto); the last call's
        self.layout = None if layout == "auto" else PREDICT_LAYOUTS[layout]
        # the distributed build takes symmetric, uncapped graphs of the project convention only
        self.builds_distributed = bool(model_file.max_neighbors is None and model_file.neighbors == "project"
                                       and model_file.symmetric_edges)
        if self.layout is not None and self.layout.distributed_build and not self.builds_distributed:
            raise GnnPipeError(f"layout {layout}: the distributed build takes symmetric, uncapped graphs of the project "
                               f"convention; this model file has max_neighbors {model_file.max_neighbors}, neighbors "
                               f"{model_file.neighbors}: use layout atoms")
        priced = workers > 1 and (self.layout is None or self.layout.distributed_build)
        if mem_mb_per_worker is not None and (not priced or isinstance(mem_mb_per_worker, bool)
                                              or not isinstance(mem_mb_per_worker, int) or mem_mb_per_worker < 1):
            raise GnnPipeError(f"mem_mb_per_worker {mem_mb_per_worker!r}: a whole number of MiB >= 1, priced across "
                               f"workers in the auto and domains layouts only (layout {layout!r}, workers {workers}): "
                               "use layout='auto' or 'domains' with workers > 1, or leave it out")
        self.mem_mb_per_worker = mem_mb_per_worker
        self.last_layout: Optional[AtomLayout] = None
        if not isinstance(skin, (int, float)) or not np.isfinite(skin) or skin < 0:
            raise GnnPipeError(f"skin must be a number of Å >= 0 (the distributed build's Verlet skin), got {skin!r}")
        self.skin = float(skin)
        self.domains = None  # the distributed build's last decomposition (domains.Decomposition), kept by the skin rule
        self.rebuilds = 0  # how many times the distributed build decomposed a structure (the first call's included)
        if (dtype or model_file.dtype) not in DTYPES:
            raise GnnPipeError(f"dtype {dtype or model_file.dtype!r}: one of {', '.join(DTYPES)}")
        self.model_file, self.workers = model_file, int(workers)
        self.dtype = DTYPES[dtype or model_file.dtype]
        self.device = torch.device(device)
        self.norm = model_file.normalizer()
        self.model = model_file.build(self.device, self.dtype) if workers == 1 else None
        self.pool = WorkerPool(model_file, workers, device=self.device, dtype=self.dtype, threads=self.threads,
                               timeout_s=timeout_s) if workers > 1 else None
        self.calls = 0
        # the byte ledger of the calls across workers, by op: the client's payloads to the workers
        # (``to_workers``; ``held``: what a worker keeps, a rebuild's Domain), the workers' replies
        # (``replies``: energy, own forces, dE/dε) and the workers' own ops (the communicator's ledger,
        # summed over them); the arrays' bytes (``domains.payload_bytes``), not the pickles' framing.
        # ``last_bytes`` the last call's; the domains layout's closed form: ``DomainsLayout.call_bytes``
        self.bytes: collections.Counter = collections.Counter()
        self.last_bytes: dict = {}

    @property
    def gradient_forces(self) -> bool:
        return self.model_file.model_config.get("force_head", "gradient") == "gradient"

    def predict(self, numbers, positions, cell, pbc, stress: bool = False, where: str = "") -> Prediction:
        """Energy, forces and (``stress=True``; a 3-D periodic cell) stress of one structure."""
        numbers = np.asarray(numbers, dtype=np.int64)
        check_input(self.model_file, numbers, positions, cell, pbc, where, self.min_distance)
        cell = np.asarray(cell, dtype=np.float64).reshape(3, 3)
        volume = abs(float(np.linalg.det(cell)))
        if stress and not (np.all(pbc) and volume > 1e-12):
            raise GnnPipeError(f"{where}stress needs a 3-D periodic cell of non-zero volume "
                               f"(pbc {list(map(bool, np.broadcast_to(pbc, 3)))}, volume {volume:.3g} Å³)")
        chosen = self.layout
        if self.pool is not None and chosen is None and self.mem_mb_per_worker:
            chosen = self.bounded_layout(numbers, positions, cell, pbc, where)
        if self.pool is not None and chosen is not None and chosen.distributed_build:
            b = structure_only(numbers, positions, cell, pbc, self.model_file)  # each worker builds its region's graph
            b.update(skin=self.skin, domains=self.domains)
        else:
            b = structure_graph(numbers, positions, cell, pbc, self.model_file, str(self.dtype).removeprefix("torch."))
        if self.pool is not None:
            self.last_layout = chosen if chosen is not None else self.choose_layout(b)
            b = self.arrange(b, where)
            y, f, dy = self.pool.compute(b, stress, where, self.last_layout)
            self.last_bytes = self.pool.last_bytes
            self.bytes.update(self.last_bytes)
        else:
            from .parallel import single_graph
            g = single_graph(b, self.dtype, self.device)
            with torch_threads(self.threads):
                y, f, dy = map(_numpy, view_outputs(self.model, g, stress))
        self.calls += 1
        s = self.norm.scale
        energy = float(s * y[0] + self.norm.baseline(numbers, b["system"], 1)[0])
        out = Prediction(energy, self.norm.force_scale * np.asarray(f, dtype=np.float64).reshape(-1, 3))
        if stress:
            sym = 0.5 * (dy + dy.T) * s / volume
            out.stress = np.array([sym[i, j] for i, j in VOIGT])
        return out

    def arrange(self, b: dict, where: str = "") -> dict:
        """Structure ``b`` as the workers of ``last_layout`` number it (once, here: the workers' own atoms
        are consecutive blocks of it); the distributed build's decomposition is kept while the
        Verlet-skin rule holds (``rebuilds`` counts the new ones)."""
        edges = len(b["edge_src"]) if "edge_src" in b else self.workers  # a distributed build: the workers' graphs
        if edges < self.workers:
            raise GnnPipeError(f"{where}graph-parallel inference over {self.workers} workers needs at least "
                               f"{self.workers} edges, this structure has {edges} within the cutoff; use fewer workers")
        b = self.last_layout.arrange(b, self.workers)
        if self.last_layout.distributed_build and b["rebuilt"] and self.mem_mb_per_worker and self.layout is not None:
            check_memory(self.model_file, b, self.workers, self.dtype.itemsize, self.mem_mb_per_worker, where)
        if self.last_layout.distributed_build:
            self.domains = b["domains"]
            self.rebuilds += bool(b["rebuilt"])
        return b

    def choose_layout(self, b: dict) -> AtomLayout:
        """The workers' layout for structure ``b``: the one given, or (``auto``) the one whose closed-form
        bytes of this call are fewer (each layout's ``step_bytes``); the edges layout on a tie and for a
        structure of fewer atoms than workers (the atoms layout needs an atom per worker)."""
        if self.layout is not None:
            return self.layout
        if len(b["z"]) < self.workers:
            return EDGES
        spec, cfg, db = self.model_file.spec, self.model_file.config(), torch.finfo(self.dtype).bits // 8
        return choose_layout({name: {"bytes": layout.step_bytes(spec, cfg, [b], self.workers, db, 0, training=False)}
                              for name, layout in ATOM_LAYOUTS.items()})

    def bounded_layout(self, numbers, positions, cell, pbc, where: str = "") -> Optional[AtomLayout]:
        """``auto`` under ``mem_mb_per_worker``: the domains layout when the whole-structure layouts (edges,
        atoms) do not fit the bound and it does, None when they fit (then ``choose_layout`` by bytes),
        refused in one line when none fits (``atom_layouts.choose_for_structure``'s rule). A kept
        decomposition whose Verlet-skin rule holds keeps the domains layout without pricing again."""
        from .atom_layouts import DOMAINS, choose_for_structure

        if self.last_layout is DOMAINS and self.domains is not None and len(self.domains.domains) == self.workers \
                and self.domains.holds(np.asarray(numbers, dtype=np.int64), positions, cell,
                                       np.broadcast_to(np.asarray(pbc, dtype=bool), (3,))):
            return DOMAINS
        if len(numbers) < self.workers:
            return None
        b = structure_only(numbers, positions, cell, pbc, self.model_file)
        try:
            return choose_for_structure(self.model_file.spec, self.model_file.config(), b, self.workers,
                                        self.dtype.itemsize, self.mem_mb_per_worker * 2**20,
                                        domains=self.builds_distributed)
        except GnnPipeError as e:
            raise GnnPipeError(f"{where}{e} (mem_mb_per_worker={self.mem_mb_per_worker})") from None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> "Predictor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- the worker pool
def _context():
    """A fork server that imported torch once (later starts take milliseconds; safe: it forks
    before any thread or CUDA state exists); spawn where there is none."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "numpy", "gnnpipe.atomic.inference"])
        return ctx
    return mp.get_context("spawn")


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class WorkerPool:
    """N persistent graph-parallel inference processes; this process is their client."""

    def __init__(self, model_file: ModelFile, workers: int, device=torch.device("cpu"), dtype=torch.float64,
                 threads: Optional[int] = None, timeout_s: float = 600.0, start_timeout_s: float = 180.0):
        import torch.distributed as dist

        if getattr(mp.current_process(), "_inheriting", False):
            # this is a worker re-importing a script that starts workers at import (no __main__
            # guard): starting more here would fail with a traceback; exit and let the client say why
            os._exit(NO_MAIN_GUARD)
        self.workers, self.timeout_s = workers, timeout_s
        threads = threads_per_worker(workers, threads)
        ctx = _context()
        # the rendezvous store lives here, on a port the OS picks: no race for a port
        self._store = dist.TCPStore("127.0.0.1", 0, workers, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        blob = pickle.dumps(model_file.payload())  # tensors pickled by value: nothing shared with a worker
        kill = os.environ.get("GNNPIPE_TEST_KILL_INFERENCE", "")  # "<worker>:<call>": fault injection (tests)
        self._procs, self._conns = [], []
        for r in range(workers):
            mine, theirs = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_worker_main, name=f"gnnpipe-inference-{r}", daemon=True,
                            args=(r, workers, self._store.port, str(device), dtype, threads, timeout_s,
                                  theirs, kill))
            try:
                p.start()
            except (OSError, EOFError) as e:  # a worker that re-imported the script broke the fork server's pipe
                mine.close(), theirs.close()
                _shutdown(self._procs, self._conns, None, grace_s=2.0)
                if any(q.exitcode == NO_MAIN_GUARD for q in self._procs):
                    raise GnnPipeError(_no_main_guard()) from None
                raise GnnPipeError(f"inference worker {r} of {workers} could not start ({type(e).__name__}: {e})") \
                    from None
            theirs.close()
            self._procs.append(p)
            self._conns.append(mine)
        # the model goes over the pipe once every worker started, not with the process: a worker that
        # dies while importing the main script then leaves its exit code to read, not a broken pipe here
        for c in self._conns:
            try:
                c.send_bytes(blob)
            except (BrokenPipeError, ConnectionError, OSError):
                pass  # that worker is dead: _gather names it
        self.pids = [p.pid for p in self._procs]
        self._broken: Optional[str] = None
        self.last_bytes: dict = {}  # the last call's ledger (Predictor.bytes)
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._conns, self._store)
        try:
            self._gather(start_timeout_s, "starting")
        except BaseException:
            self.close()
            raise

    @property
    def alive(self) -> bool:
        return self._finalizer.alive and self._broken is None

    def compute(self, b: dict, stress: bool, where: str = "",
                layout: AtomLayout = EDGES) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
        """Model-unit energies (1,), every atom's forces (N, 3) and ``dy/dε`` summed over the workers,
        of structure ``b`` arranged by ``layout`` (``Predictor.arrange``; ``atom_layouts``: by edges, by
        METIS atom parts, or by spatial domains), each worker sent its ``layout.messages``."""
        if not self._finalizer.alive:
            raise GnnPipeError("the inference workers were shut down (close()); create a new calculator")
        if self._broken:
            raise GnnPipeError(f"the inference workers stopped after an error ({self._broken}); create a new "
                               "calculator")
        from .domains import payload_bytes

        msgs, blobs = layout.messages(b, self.workers), {}
        ledger = collections.Counter()
        for m in msgs:  # the client's payloads: every worker's message, and what it holds (a rebuild's Domain)
            ledger["to_workers"] += payload_bytes({k: v for k, v in m.items() if k != "hold"})
            ledger["held"] += payload_bytes(m.get("hold", {}))
        for r, c in enumerate(self._conns):
            if id(msgs[r]) not in blobs:  # one pickle of a message every worker gets
                blobs[id(msgs[r])] = pickle.dumps((msgs[r], bool(stress), layout.name))
            try:
                c.send_bytes(blobs[id(msgs[r])])
            except (BrokenPipeError, ConnectionError, OSError):
                self._fail(self._dead_message(r, "before a call"))
        try:
            replies = self._gather(None, "a call")
        except KeyboardInterrupt:  # the workers may be mid-collective: they cannot serve another call
            self._broken = "interrupted"
            _shutdown(self._procs, self._conns, None, grace_s=0.0)
            raise
        for reply in replies:
            ledger["replies"] += payload_bytes(list(reply[:3]))
            ledger.update(reply[3])
        self.last_bytes = dict(ledger)
        y = replies[0][0]
        forces = layout.restore_order(np.concatenate([f for _, f, _, _ in replies]), b)  # the structure's atom order
        dy = sum(d for _, _, d, _ in replies) if stress else None
        return y, forces, dy

    def _gather(self, timeout_s: Optional[float], what: str) -> list:
        """Every worker's reply, by rank; a dead worker or an error is one GnnPipeError (the pool is
        then stopped), found within POLL_S."""
        pending, replies = dict(enumerate(self._conns)), {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            ready = wait_ready(list(pending.values()), timeout=POLL_S)
            for r, c in list(pending.items()):
                if c not in ready:
                    continue
                try:
                    status, *body = c.recv()
                except (EOFError, ConnectionError, OSError):
                    self._procs[r].join(timeout=1.0)
                    self._fail(self._dead_message(r, f"during {what}"))
                if status == "error":
                    died = self._died_meanwhile(r)  # the cause, where this error is a peer's lost socket
                    if died is not None:
                        self._fail(self._dead_message(died, f"during {what}"))
                    self._fail(f"inference worker {r} of {self.workers} raised during {what}:\n{body[0]}")
                replies[r] = body
                del pending[r]
            dead = [r for r in pending if self._procs[r].exitcode is not None]
            if dead:
                self._fail(self._dead_message(dead[0], f"during {what}"))
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"inference worker(s) {sorted(pending)} of {self.workers} did not finish {what} "
                           f"within {timeout_s:.0f} s")
        return [replies[r] for r in range(self.workers)]

    def _died_meanwhile(self, r: int, grace_s: float = 2.0) -> Optional[int]:
        """Another worker than ``r`` that has died, waiting up to ``grace_s`` for its exit: when one worker
        dies mid-collective its peers' collectives fail with a lost connection, and their error can reach
        the client before the death is seen; the death, not the peer's error, is what to report."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [q for q in range(self.workers) if q != r and self._procs[q].exitcode is not None]
            if dead or time.monotonic() > deadline:
                return dead[0] if dead else None
            time.sleep(0.05)

    def _dead_message(self, r: int, when: str) -> str:
        p = self._procs[r]
        if p.exitcode == NO_MAIN_GUARD:
            return _no_main_guard()
        return (f"inference worker {r} of {self.workers} (pid {p.pid}) died {when} "
                f"({_describe_exit(p.exitcode)})")

    def _fail(self, message: str):
        self._broken = message.splitlines()[0]
        _shutdown(self._procs, self._conns, None, grace_s=0.0)
        raise GnnPipeError(message + "; the other workers were stopped") from None

    def close(self) -> None:
        """Stop the workers (idempotent); later calls raise."""
        self._finalizer()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _no_main_guard() -> str:
    script = getattr(sys.modules.get("__main__"), "__file__", None) or "the main script"
    return (f"inference workers cannot start: {script} starts them when it is imported, and each worker imports "
            "it again; put the script's code under 'if __name__ == \"__main__\":' (Python's multiprocessing "
            "needs it)")


def _shutdown(procs, conns, store, grace_s: float = 2.0) -> None:
    """Ask each worker to exit, then terminate, then kill whoever is left (never hangs)."""
    for c in conns:
        try:
            c.send_bytes(pickle.dumps(None))
        except (BrokenPipeError, ConnectionError, OSError):
            pass
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(end - time.monotonic(), 0.0))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=2.0)
    for c in conns:
        c.close()
    del store  # the rendezvous store goes with the finalizer's reference


def _worker_main(rank: int, world: int, port: int, device: str, dtype, threads: int,
                 timeout_s: float, conn, kill: str) -> None:
    """One inference worker: receive the model, join the group, build the model, then serve calls
    until told to stop (``None``) or until the client goes away (EOF)."""
    joined = False
    try:
        blob = conn.recv_bytes()
        import torch.distributed as dist

        from .modelfile import decode
        from .parallel import EdgeGroup
        from ..parallel.comm import Communicator

        torch.set_num_threads(threads)
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dev = torch.device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(dev)
        span = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=span)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world, timeout=span)
        joined = True
        grp = EdgeGroup(Communicator(None, dev), None, world, rank)
        model = decode(pickle.loads(blob), "inference payload").build(dev, dtype)
        kill_rank, kill_call = (int(v) for v in kill.split(":")) if kill else (-1, -1)
        conn.send(("ready", os.getpid()))
        calls, held = 0, {}  # held: what the client's messages asked to keep ("hold"), e.g. a worker's domain
        while True:
            msg = pickle.loads(conn.recv_bytes())
            if msg is None:
                break
            if (rank, calls) == (kill_rank, kill_call):
                os.kill(os.getpid(), signal.SIGKILL)
            b, stress, layout = msg
            held.update(b.pop("hold", {}))
            grp.comm.set_epoch(calls)  # the call's traffic among the workers, filed under its number
            g = PREDICT_LAYOUTS[layout].shard({**held, **b}, grp, dtype, dev)
            y, f, dy = view_outputs(model, g, stress)
            sent = {op: row["sent"] for op, row in grp.comm.ledger.pop(calls, {}).items()}
            conn.send(("ok", _numpy(y), _numpy(f), _numpy(dy), sent))
            calls += 1
    except (EOFError, KeyboardInterrupt):  # the client went away, or Ctrl-C reached the group
        pass
    except BaseException:  # noqa: BLE001 - every failure goes back to the client
        try:
            conn.send(("error", traceback.format_exc()))
        except (BrokenPipeError, ConnectionError, OSError):
            pass
    finally:
        if joined:
            import torch.distributed as dist
            dist.destroy_process_group()
