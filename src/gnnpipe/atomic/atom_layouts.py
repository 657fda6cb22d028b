"""How the P graph ways of a replica split a batch of atomic systems: one object per layout.

A run's ``atom_layout`` (the config keeps its string) and a predictor's ``layout`` are looked up once
in :data:`ATOM_LAYOUTS`; the engine, the plan and the inference workers then ask the object, never
the name:

==================  ===================================  ===========================================
question            asked by                             edges / atoms
==================  ===================================  ===========================================
``view``            ``AtomicEngine`` (training, eval)    this rank's ``AtomGraph`` of a batch
``arrange``         ``Predictor.arrange`` (the client)   the batch as the ways number it: itself /
                                                         reordered by METIS part (``halo.order_by_part``)
``messages``        ``WorkerPool.compute``               what each worker is sent: the arranged batch
                                                         (domains: its region's positions)
``shard``           the inference workers                a rank's view of an arranged batch
``restore_order``   ``WorkerPool.compute``               per-atom rows back in the batch's order
``step_bytes``      ``predicted_bytes``, ``Predictor``   the closed form of a step's bytes
``costs``           ``plan_run`` (``RunPlan.need``),     a step's bytes and the memory per worker
                    ``layout_costs``, ``choose_layout``  on one batch at P ways
==================  ===================================  ===========================================

* **edges** (``parallel.py``): way r holds edge block r, the triplets of its edges and atom block r;
  the model's collectives are all-gathers and reduce-scatters.
* **atoms** (``halo.py``): way r holds METIS part r's atoms, the edges into them and their triplets,
  and receives only its halo rows.

At one way both are the whole batch in one process (the same view, bytes and memory), so a run
with ``atom_layout: atoms`` and ``data_parallel`` replicas of one way each computes as the edges
layout.

* **domains** (``domains.py``, #35; the predictor's :class:`DomainsLayout`): the atoms layout's views of one
  structure built by each worker from its own region: spatial domains balanced by atom count
  (``arrange`` adds the client's ``domains.Decomposition`` to a structure *without* a graph, kept
  while the Verlet-skin rule holds), each worker sent only its region's positions (``messages``;
  its ``Domain`` after a rebuild) and building its edges and triplets from them (``shard``:
  ``domains.domain_view``, with the group's collectives). Not in :data:`ATOM_LAYOUTS`: the
  predictor's :data:`PREDICT_LAYOUTS` holds it. Its ``costs`` are an inference call's
  (``rank_sizes`` from the decomposition's owners, the kind's ``inference_memory``; ``gnnpipe
  plan-atomic --structure``), its ``step_bytes`` an inference call's closed form (``call_bytes``: the
  client's payloads, the build's all-gathers, the halo exchanges, the replies; what the predictor's
  ledger counts).
  A training run's ``atom_layout: domains`` is :class:`DomainsTraining` (in :data:`TRAIN_LAYOUTS`, the
  config's names): every system of a batch cut into P domains, each rank building its regions from
  the batch's positions (``domains.batch_view``); its bytes and memory the atoms layout's closed forms
  on those owners. The plan and an ``auto`` predictor choose between :data:`ATOM_LAYOUTS` (edges, atoms).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import numpy as np

from ..io import GnnPipeError
from ..registry import Registry
from . import halo
from .parallel import EdgeGroup, shard_graph, single_graph


class AtomLayout(ABC):
    """One way of splitting a batch across the P ways of a replica (see the module docstring)."""

    name: str
    in_words: str  # what the plan's answer says of the layout ("... at P = 4{in_words}")
    distributed_build = False  # True: ``arrange`` takes a structure without a graph, each worker builds its own

    def view(self, b: dict, grp: Optional[EdgeGroup], dtype, device) -> tuple[dict, object]:
        """This rank's view of batch ``b`` (the whole batch without a group, or with one way), and the
        batch as the view numbers it (the own atoms' rows of its per-atom arrays are
        ``[atom_lo, atom_hi)``)."""
        if grp is None or grp.size == 1:
            return b, single_graph(b, dtype, device)
        b = self.arrange(b, grp.size)
        return b, self.shard(b, grp, dtype, device)

    @abstractmethod
    def arrange(self, b: dict, ways: int) -> dict:
        """Batch ``b`` as ``ways`` > 1 ways number it (what ``shard`` takes)."""

    def messages(self, b: dict, ways: int) -> list:
        """What the client sends each of ``ways`` inference workers of arranged batch ``b`` (``shard``
        takes it; a ``"hold"`` dict in it is kept by the worker and merged into later messages)."""
        return [b] * ways

    @abstractmethod
    def shard(self, b: dict, grp: EdgeGroup, dtype, device=None):
        """Rank ``grp.rank``'s view of an arranged batch ``b``."""

    @abstractmethod
    def restore_order(self, rows: np.ndarray, b: dict) -> np.ndarray:
        """Per-atom ``rows`` of arranged batch ``b`` (the ways' own atoms, concatenated) in the order of
        the batch before ``arrange``."""

    @abstractmethod
    def step_bytes(self, kind, cfg, batches: list, ways: int, dtype_bytes: int, params: int,
                   training: bool = True, forces: bool = True) -> int:
        """Closed-form bytes of one step (training, or an inference call), summed over every rank (what
        the ledger counts): ``batches[d]`` replica d's batch, None for a replica without systems in a
        short last step (it sends only its parameter reduction)."""

    @abstractmethod
    def costs(self, kind, cfg, b: dict, ways: int, dtype_bytes: int) -> dict:
        """A training step on batch ``b`` (one replica) at ``ways`` ways: ``{"bytes": its closed form,
        "memory": the estimated bytes per worker}``."""


class EdgesLayout(AtomLayout):
    """Edge/triplet sharding (``parallel.shard_graph``); at one way, every layout's whole batch."""

    name = "edges"
    in_words = ""

    def arrange(self, b: dict, ways: int) -> dict:
        return b

    def shard(self, b: dict, grp: EdgeGroup, dtype, device=None):
        return shard_graph(b, grp.size, grp.rank, grp, dtype, device)

    def restore_order(self, rows: np.ndarray, b: dict) -> np.ndarray:
        return rows

    def step_bytes(self, kind, cfg, batches: list, ways: int, dtype_bytes: int, params: int,
                   training: bool = True, forces: bool = True) -> int:
        """The kind's closed form (``kind.step_bytes``) on each replica's edges, atoms and systems."""
        sizes = [(0, 0, 0) if b is None else (len(b["edge_src"]), len(b["z"]), int(b["num_systems"]))
                 for b in batches]
        e, n, s = (list(c) for c in zip(*sizes))
        return kind.step_bytes(cfg, e, n, s, ways, dtype_bytes, params, training=training, forces=forces)

    def costs(self, kind, cfg, b: dict, ways: int, dtype_bytes: int) -> dict:
        """Memory: the kind's ``memory_per_worker`` at P ways (its counts measured on ``b``)."""
        counts = kind.batch_counts(b, ways) if kind.batch_counts else {}
        mem = kind.memory_per_worker(cfg, len(b["z"]), len(b["edge_src"]), len(b["idx_kj"]), ways, dtype_bytes,
                                     **counts)["total"]
        return {"bytes": self.step_bytes(kind, cfg, [b], ways, dtype_bytes, kind.count_parameters(cfg)),
                "memory": mem}


class AtomsLayout(AtomLayout):
    """METIS atom parts and halo exchanges (``halo.py``); at one way, the edges layout's whole batch."""

    name = "atoms"
    in_words = " in the atoms layout"

    def arrange(self, b: dict, ways: int) -> dict:
        """Batch ``b`` reordered so that METIS part r's atoms and the edges into them are block r."""
        return halo.order_by_part(b, ways)

    def shard(self, b: dict, grp: EdgeGroup, dtype, device=None):
        return halo.shard_atoms(b, grp.rank, grp, dtype, device)

    def restore_order(self, rows: np.ndarray, b: dict) -> np.ndarray:
        out = np.empty_like(rows)
        out[b["atom_order"]] = rows
        return out

    def step_bytes(self, kind, cfg, batches: list, ways: int, dtype_bytes: int, params: int,
                   training: bool = True, forces: bool = True) -> int:
        """``halo.step_bytes`` on the halo counts of each replica's METIS parts (the partitions the
        ways compute on)."""
        if ways == 1:
            return EDGES.step_bytes(kind, cfg, batches, ways, dtype_bytes, params, training, forces)
        halos = [dict.fromkeys(halo.HALO_KEYS, 0) if b is None else halo.halo_counts(self.arrange(b, ways))
                 for b in batches]
        systems = [0 if b is None else int(b["num_systems"]) for b in batches]
        return halo.step_bytes(kind, cfg, halos, systems, ways, dtype_bytes, params, training, forces)

    def costs(self, kind, cfg, b: dict, ways: int, dtype_bytes: int) -> dict:
        """Also ``"halo"``: the halo rows of each exchange summed over the ways (``halo.HALO_KEYS``).

        Memory: the largest over the ranks of the kind's estimate for its own atoms, edges and
        triplets in one process (the kind's default block counts), plus one block's gathered halo
        rows (``halo_widths``): a part's activations are its own rows', its halo rows are read, not
        kept."""
        if ways == 1:
            return {**EDGES.costs(kind, cfg, b, ways, dtype_bytes), "halo": dict.fromkeys(halo.HALO_KEYS, 0)}
        sizes = halo.rank_sizes(self.arrange(b, ways))
        w = kind.halo_widths(cfg)
        mem = max(kind.memory_per_worker(cfg, r["atoms_own"], r["edges_own"], r["triplets_own"], 1, dtype_bytes)["total"]
                  + sum(r[k] * w[k] for k in ("kj", "swap", "atoms")) * dtype_bytes for r in sizes)
        halos = {k: sum(r[k] for r in sizes) for k in halo.HALO_KEYS}
        return {"bytes": halo.step_bytes(kind, cfg, [halos], [int(b["num_systems"])], ways, dtype_bytes,
                                         kind.count_parameters(cfg)),
                "memory": mem, "halo": halos}


class DomainsLayout(AtomsLayout):
    """The atoms layout of one structure, built per worker (``domains.py``); ``b`` is a structure
    without a graph: ``z, pos, cell, pbc, cutoff`` (``distributed_build``)."""

    name = "domains"
    in_words = " in the domains layout"
    distributed_build = True

    def view(self, b: dict, grp: Optional[EdgeGroup], dtype, device):
        raise GnnPipeError("the predictor's domains layout takes one structure, not a training batch: a training "
                           "run's atom_layout domains is atom_layouts.DOMAINS_TRAINING")

    def arrange(self, b: dict, ways: int) -> dict:
        """Structure ``b`` with ``domains`` (a ``domains.Decomposition``: the build ``b["domains"]`` given
        while its Verlet-skin rule holds, else a new one of skin ``b["skin"]``), ``rebuilt`` (whether it
        is new) and ``atom_order`` (the atoms by owner)."""
        from .domains import decompose

        dec = b.get("domains")
        rebuilt = dec is None or len(dec.domains) != ways or not dec.holds(b["z"], b["pos"], b["cell"], b["pbc"])
        if rebuilt:
            dec = decompose(b["z"], b["pos"], b["cell"], b["pbc"], ways, b["cutoff"], b.get("skin", 0.0))
        return {**b, "domains": dec, "rebuilt": rebuilt, "atom_order": dec.order}

    def messages(self, b: dict, ways: int) -> list:
        """Each worker its region's positions, and after a rebuild its ``Domain`` (held until the next)."""
        dec = b["domains"]
        return [{"pos": p, **({"hold": {"domain": d}} if b["rebuilt"] else {})}
                for d, p in zip(dec.domains, dec.positions(b["pos"]))]

    def shard(self, b: dict, grp: EdgeGroup, dtype, device=None):
        from .domains import domain_view

        return domain_view(b["domain"], b["pos"], grp, dtype, device)

    #: a CPU inference worker's RSS before its first call (torch and the model; bench_domains: 242 MB)
    WORKER_RSS = 250 * 2**20

    #: the ops of an inference call's ledger (``Predictor.last_bytes``, summed into these by :meth:`ledger_parts`)
    CALL_PARTS = ("to_workers", "held", "build", "collectives", "replies")

    def call_bytes(self, kind, cfg, b: dict, ways: int, dtype_bytes: int, stress: bool = False,
                   rebuilt: Optional[bool] = None, graph=None, sizes: Optional[list] = None) -> dict:
        """The closed form of one inference call's bytes on structure ``b`` at ``ways`` workers, by part
        (:data:`CALL_PARTS`) and ``"total"``: what the predictor's ledger counts (``Predictor.last_bytes``),
        the payloads' bytes, not the pickles' or gloo's framing. ``b``: arranged (:meth:`arrange`: its
        decomposition and ``rebuilt``) or a structure (then decomposed with ``b["skin"]``, a rebuild).
        With R_r worker r's region atoms, N the atoms, P the workers, b the model's dtype bytes and the
        halo rows (``kj, swap, atoms, ghosts``) and boundary atoms B_q of :meth:`rank_sizes` (``sizes``,
        computed if None)::

            to_workers   24 · Σ_r R_r                           each region's positions (float64)
            held         Σ_r 40 · R_r + P · (8·(P+1) + 91)      after a rebuild only: each worker's Domain
                                                                (ids, z, images; ab, cell, pbc, rank, cutoff)
            build        (P-1) · Σ_q (8 + 24·B_q                the build's two all-gathers: each worker's
                                 + 8·(kj + swap + atoms + ghosts)_q)   Boundary and needs to the P - 1 others
            collectives  halo.step_bytes(training=False)        the model's halo exchanges, forward and
                         (+ b·K·Σ rows·w, direct head & stress)  force pass (a direct head's stress: one
                                                                backward pass through the forward)
            replies      P · (8 + 72·stress) + 24 · N           energy, own forces, dE/dε (float64)
        """
        from .parallel import collective_passes

        if not b.get("domains") or "rebuilt" not in b:
            b = self.arrange(b, ways)
        if rebuilt is None:
            rebuilt = bool(b["rebuilt"])
        dec, p = b["domains"], ways
        regions = [len(d.ids) for d in dec.domains]
        sizes = sizes or self.rank_sizes(b, ways, graph)
        halos = {k: sum(r[k] for r in sizes) for k in halo.HALO_KEYS}
        collectives = halo.step_bytes(kind, cfg, [halos], [1], p, dtype_bytes, 0, training=False)
        if stress and cfg.force_head != "gradient":
            w = kind.halo_widths(cfg)
            passes, _ = collective_passes(cfg.force_head, False)
            collectives += dtype_bytes * passes * cfg.num_blocks * sum(halos[k] * w[k] for k in ("kj", "swap", "atoms"))
        out = {"to_workers": 24 * sum(regions),
               "held": rebuilt * (40 * sum(regions) + p * (8 * (p + 1) + 91)),
               "build": (p - 1) * sum(8 + 24 * r["boundary"] + 8 * sum(r[k] for k in halo.HALO_KEYS) for r in sizes),
               "collectives": collectives,
               "replies": p * (8 + 72 * bool(stress)) + 24 * len(b["z"])}
        out["total"] = sum(out.values())
        return out

    @classmethod
    def ledger_parts(cls, ledger: dict) -> dict:
        """A call's ledger (``Predictor.last_bytes``: the client's ``to_workers``, ``held``, ``replies`` and
        the workers' ops) by :data:`CALL_PARTS`: every op of the workers' but the build's is ``collectives``."""
        from .domains import OP_BUILD

        out = {k: int(ledger.get(k, 0)) for k in ("to_workers", "held", "replies")}
        out["build"] = int(ledger.get(OP_BUILD, 0))
        out["collectives"] = sum(int(v) for k, v in ledger.items() if k not in out and k != OP_BUILD)
        return {k: out[k] for k in cls.CALL_PARTS} | {"total": sum(out.values())}

    def step_bytes(self, kind, cfg, batches: list, ways: int, dtype_bytes: int, params: int = 0,
                   training: bool = False, forces: bool = True, stress: bool = False) -> int:
        """One inference call's bytes (:meth:`call_bytes`'s total) on the structure ``batches[0]``; a training
        step is the training layout's (``DOMAINS_TRAINING``), refused here in one line."""
        if training or len(batches) != 1 or batches[0] is None or not forces:
            raise GnnPipeError("the predictor's domains layout prices one inference call on one structure with "
                               "forces: a training run's bytes are atom_layouts.DOMAINS_TRAINING's")
        return self.call_bytes(kind, cfg, batches[0], ways, dtype_bytes, stress)["total"]

    @staticmethod
    def rank_sizes(b: dict, ways: int, graph=None) -> list[dict]:
        """Per worker of structure ``b`` (``z, pos, cell, pbc, cutoff``) at ``ways`` spatial domains (the
        owners of ``b["domains"]``, a kept decomposition, else ``domains.spatial_partition``'s): ``atoms_own``, ``edges_own`` (into them),
        ``triplets_own`` (of those edges), ``ring`` (the other atoms with an edge into them) and
        ``halo_edges`` (the edges into the ring: the triplets' input edges a worker reads of others),
        and its halo rows (``halo.HALO_KEYS``, what ``halo.rank_sizes`` counts of the structure grouped
        by the same owners): ``atoms`` (= ``ring``), ``swap`` (its edges from another worker's atom:
        each one's reverse), ``kj`` (the edges into the ring but, for a ring atom with one edge into
        the worker, that edge's reverse: the one input edge no own triplet reads) and ``ghosts`` (the
        ring and the other workers' sources of the ``kj`` edges). ``graph``: the structure's
        ``(src, dst)`` (``neighbors.radius_graph``), computed if None. Counts only, O(E) on the
        client: a symmetric graph's edge ``j -> i`` has in-degree(j) - 1 triplets (every input edge
        of j but i's own reverse)."""
        from .domains import spatial_partition
        from .neighbors import radius_graph

        if graph is None:
            graph = radius_graph(b["pos"], b["cell"], b["pbc"], b["cutoff"])
        src, dst = (np.asarray(a, dtype=np.int64) for a in graph[:2])
        dec = b.get("domains")
        if dec is not None and len(dec.domains) == ways:  # a kept build's owners (atoms have moved since)
            owner = np.empty(len(dec.order), dtype=np.int64)
            owner[dec.order] = np.repeat(np.arange(ways), np.diff(dec.ab))
        else:
            owner = spatial_partition(b["pos"], b["cell"], b["pbc"], ways)
        n = len(owner)
        deg = np.bincount(dst, minlength=n)
        into = owner[dst]
        cross = owner[src] != into
        ring, into_ring = np.unique(into[cross] * n + src[cross], return_counts=True)  # (worker, ring atom) pairs
        w, j = ring // n, ring % n
        # the ghosts: every source k of an edge into a ring atom j of worker w, not w's own (an excluded
        # reverse edge's source is w's own atom: no ghost either way)
        order = np.argsort(dst, kind="stable")
        starts = np.concatenate([[0], np.cumsum(deg)])
        many = deg[j]
        at = np.repeat(starts[j] - (np.cumsum(many) - many), many) + np.arange(int(many.sum()))
        k, kw = src[order[at]], np.repeat(w, many)
        ghosts = np.union1d(ring, (kw * n + k)[owner[k] != kw])
        count = lambda r, v=None: np.bincount(r, weights=v, minlength=ways).astype(np.int64)  # noqa: E731
        cols = (count(owner), count(into), count(into, deg[src] - 1), count(w), count(w, deg[j]), count(w),
                count(into[cross]), count(w, deg[j] - (into_ring == 1)), count(ghosts // n), count(owner[np.unique(j)]))
        keys = ("atoms_own", "edges_own", "triplets_own", "ring", "halo_edges", "atoms", "swap", "kj", "ghosts",
                "boundary")
        return [{k: int(c[r]) for k, c in zip(keys, cols)} for r in range(ways)]

    def costs(self, kind, cfg, b: dict, ways: int, dtype_bytes: int, graph=None, priced: bool = True) -> dict:
        """One inference call on structure ``b`` at ``ways`` workers (not a training step): ``"memory"``
        the largest worker's estimated peak above its RSS before the call (the kind's
        ``inference_memory`` on its :meth:`rank_sizes`), ``"sizes"`` those, ``"bytes"`` the call's
        closed form (:meth:`call_bytes`' total, a rebuild call without stress; ``"call"`` its parts;
        ``priced`` False: None, no decomposition built)."""
        if kind.inference_memory is None:
            raise GnnPipeError(f"the domains layout has no memory estimate for {kind.name} yet (#35 item 4): "
                               "size it with a measured call (benchmarks/bench_domains.py)")
        sizes = self.rank_sizes(b, ways, graph)
        mem = max(kind.inference_memory(cfg, r["atoms_own"], r["edges_own"], r["triplets_own"], r["halo_edges"],
                                        dtype_bytes)["total"] for r in sizes)
        call = self.call_bytes(kind, cfg, b, ways, dtype_bytes, sizes=sizes) if priced else None
        return {"bytes": call and call["total"], "memory": mem, "sizes": sizes, "call": call}

    def smallest_fit(self, kind, cfg, b: dict, cap: int, dtype_bytes: int, most: int = 256, graph=None,
                     shared: bool = False):
        """The fewest workers (up to ``most``) whose largest estimated peak, with ``WORKER_RSS``, is at
        most ``cap`` bytes (``shared``: ``cap`` is one machine's, its P workers' peaks together), or None."""
        if self.WORKER_RSS >= cap:
            return None
        if graph is None:
            from .neighbors import radius_graph
            graph = radius_graph(b["pos"], b["cell"], b["pbc"], b["cutoff"])
        for ways in range(1, min(most, len(b["z"])) + 1):
            peak = self.WORKER_RSS + self.costs(kind, cfg, b, ways, dtype_bytes, graph, priced=False)["memory"]
            if peak * (ways if shared else 1) <= cap:
                return ways
        return None


class DomainsTraining(AtomsLayout):
    """The domains layout of a training run (``atom_layout: domains``): the atoms layout with every
    system of a step's batch cut into P spatial domains (``domains.batch_owners``: rank r owns domain
    r of each system, not METIS parts of the batch) and each rank building its own regions' edges and
    triplets from the batch's positions (``domains.batch_view``; ``view`` takes a batch *without* its
    graph, ``data.batch_arrays(systems, None, ids)``). Its bytes and memory are the atoms layout's
    closed forms on the same owners (``arrange`` of a batch *with* its graph groups the graph too:
    the plan, the engine's prediction), since its views equal ``halo.shard_atoms`` of the batch
    grouped by those owners (tests/test_domains_training.py)."""

    name = "domains"
    in_words = " in the domains layout"
    distributed_build = True

    def arrange(self, b: dict, ways: int) -> dict:
        """Batch ``b`` (``cell, pbc`` per system) with its atoms, and its graph where it has one, grouped by
        their domains (``halo.group_by_part`` of ``domains.batch_owners``)."""
        from .domains import batch_owners

        part = batch_owners(b, ways)
        if "edge_src" in b:
            return halo.group_by_part(b, part, ways)
        empty = np.zeros(0, dtype=np.int64)  # no graph: group_by_part moves the atoms only
        graph = dict.fromkeys(("edge_src", "edge_dst", "idx_kj", "idx_ji"), empty)
        out = halo.group_by_part({**b, **graph, "edge_shift": np.zeros((0, 3))}, part, ways)
        return {k: v for k, v in out.items() if k not in graph and k != "edge_shift"}

    def shard(self, b: dict, grp: EdgeGroup, dtype, device=None):
        from .domains import batch_view

        return batch_view(b, grp, float(b["cutoff"]), dtype, device, edges=b.get("edges"))


EDGES, ATOMS, DOMAINS = EdgesLayout(), AtomsLayout(), DomainsLayout()
DOMAINS_TRAINING = DomainsTraining()

#: name -> layout: the layouts the plan and an ``auto`` predictor choose between (``choose_layout``)
ATOM_LAYOUTS: Registry[AtomLayout] = Registry("atom layout")
for _layout in (EDGES, ATOMS):  # the order breaks ties in choose_layout
    ATOM_LAYOUTS.register(_layout.name, _layout)
#: the config's ``atom_layout`` values (a test keeps them equal): the layouts a training run takes
TRAIN_LAYOUTS: Registry[AtomLayout] = Registry("atom layout")
for _layout in (EDGES, ATOMS, DOMAINS_TRAINING):
    TRAIN_LAYOUTS.register(_layout.name, _layout)
#: the layouts a ``Predictor`` takes: the config's and the distributed build
PREDICT_LAYOUTS: Registry[AtomLayout] = Registry("atom layout")
for _layout in (EDGES, ATOMS, DOMAINS):
    PREDICT_LAYOUTS.register(_layout.name, _layout)


def layout_costs(kind, cfg, b: dict, ways: int, dtype_bytes: int) -> dict:
    """Every layout's ``costs`` of batch ``b`` (one replica) at ``ways`` ways, by name, and ``"halo"``:
    the atoms layout's counts."""
    out = {name: layout.costs(kind, cfg, b, ways, dtype_bytes) for name, layout in ATOM_LAYOUTS.items()}
    out["halo"] = out[ATOMS.name].pop("halo")
    return out


def choose_layout(costs: dict, cap: Optional[int] = None) -> AtomLayout:
    """The layout of ``costs`` (name -> ``{"bytes", "memory"}``) that sends fewer bytes among those whose
    memory fits ``cap`` (None: any, and ``memory`` is not read); the edges layout on a tie or when none fits."""
    fits = [layout for name, layout in ATOM_LAYOUTS.items()
            if cap is None or costs[name]["memory"] <= cap] or [EDGES]
    return min(fits, key=lambda layout: costs[layout.name]["bytes"])  # min keeps the first of equals


def whole_graph_counts(graph, n: int) -> tuple[int, int, int]:
    """``(atoms, edges, triplets)`` of a structure from its symmetric, uncapped radius graph ``(src, dst)``
    alone (O(E), no triplet arrays): an edge ``j -> i`` has in-degree(j) − 1 triplets."""
    src, dst = (np.asarray(a, dtype=np.int64) for a in graph[:2])
    deg = np.bincount(dst, minlength=n)
    return n, len(src), int((deg[src] - 1).sum())


def whole_memory(atoms: int, edges: int, triplets: int, view: int) -> int:
    """A worker's estimated peak above its RSS in an inference call of the edges or atoms layout, whose
    every worker receives the whole structure's graph: the graph's arrays (per atom ``z``, ``pos``,
    ``system``, ``atom_order`` 40 bytes; per edge ``src``, ``dst``, ``shift``, ``id_swap`` 48; per
    triplet ``idx_kj``, ``idx_ji`` 16) on top of ``view``, its view's estimate: the domains layout's
    at the same P (``DOMAINS.costs``; a METIS part has about as many own rows and halo rows as a
    spatial domain). The graph's arrays grow with the whole structure, not with N/P."""
    return 40 * atoms + 48 * edges + 16 * triplets + view


def choose_for_structure(kind, cfg, b: dict, ways: int, dtype_bytes: int, cap: int, graph=None,
                         domains: bool = True) -> Optional[AtomLayout]:
    """The layout a memory bound ``cap`` (bytes a worker, its RSS before the call included) leaves for one
    structure ``b`` (``z, pos, cell, pbc, cutoff``) at ``ways`` workers, by this rule:

    1. the whole-structure layouts (edges, atoms: every worker receives the whole graph) fit when
       ``DOMAINS.WORKER_RSS + whole_memory`` does (the whole graph's arrays on the domains layout's
       view estimate): then :data:`ATOM_LAYOUTS` (None is returned: the caller chooses between them
       by bytes, as without a bound);
    2. else the domains layout, when it may be used (``domains``: a symmetric, uncapped graph of the
       project convention) and its largest worker's estimate (``DOMAINS.costs``) with that RSS fits:
       the same view without the whole graph (its memory per worker falls as N/P);
    3. else the bound fits no layout: refused in one line naming the fewest workers that fit in
       the domains layout (or none).

    ``graph``: the structure's radius graph ``(src, dst)``, computed if None (O(E), counts only)."""
    from .neighbors import radius_graph

    if graph is None:
        graph = radius_graph(b["pos"], b["cell"], b["pbc"], b["cutoff"])
    view = DOMAINS.costs(kind, cfg, b, ways, dtype_bytes, graph, priced=False)["memory"]
    whole = DOMAINS.WORKER_RSS + whole_memory(*whole_graph_counts(graph, len(b["z"])), view)
    if whole <= cap:
        return None
    mb = f"{cap / 2**20:,.0f} MB a worker"
    if not domains:
        raise GnnPipeError(f"{len(b['z']):,} atoms at workers={ways}: the edges and atoms layouts need an estimated "
                           f"{whole / 2**20:,.0f} MB a worker (each holds the whole graph), over {mb}, and this "
                           "model's graph (capped or not symmetric) cannot use the domains layout: use more memory")
    if DOMAINS.WORKER_RSS + view <= cap:
        return DOMAINS
    need = DOMAINS.smallest_fit(kind, cfg, b, cap, dtype_bytes, graph=graph)
    raise GnnPipeError(f"{len(b['z']):,} atoms at workers={ways}: no layout fits {mb} (the edges and atoms layouts "
                       f"an estimated {whole / 2**20:,.0f} MB) " + (f"(gnnpipe plan-atomic --structure): use workers={need} "
                                                              "in the domains layout" if need else
                                                              "and no workers up to 256 fit: use a smaller model "
                                                              "or a larger bound"))


__all__ = ["AtomLayout", "EdgesLayout", "AtomsLayout", "DomainsLayout", "DomainsTraining", "EDGES", "ATOMS", "DOMAINS",
           "DOMAINS_TRAINING", "ATOM_LAYOUTS", "TRAIN_LAYOUTS", "PREDICT_LAYOUTS", "layout_costs", "choose_layout", "whole_graph_counts", "whole_memory", "choose_for_structure"]
