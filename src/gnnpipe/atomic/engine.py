"""The training step of atomistic models, in one process or sharded (P graph ways × D replicas).

World layout: ``world = D × P``, ``rank = replica * P + way`` (fairchem's ``dp × gp`` grid):
the P ranks of a replica split each batch's edges and triplets (``parallel.shard_graph``);
the D replicas take different batches. The loss of a step is written so that the sum over
every rank is the single-process loss of the union of the replicas' batches:

* energy term  ``Σ_systems ((E - E_ref)/σ)² / n_systems`` — replicated inside a graph
  group (every way holds the same energies), counted once (``sum_systems``' identity
  backward), summed over replicas;
* force term   ``w_F · Σ_own free atoms |(F - F_ref)/σ|² / (3 n_free)`` — each way its own atoms;

with ``n_systems`` and ``n_free`` the counts over the whole step (all replicas). So the
parameter gradients are **summed** over the graph group and then over the data-parallel
group, and equal single-process training on the union batch (tests: ``..._matches_unsharded``).

Targets are normalised by per-element reference energies (a least-squares fit on the
training systems: the "per-element mean energy" baseline) and their residuals' standard
deviation σ: ``E = σ·model(g) + Σ_atoms e_ref[z]``, ``F = σ·model_forces``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from ..engine import DTYPES, EpochStats, load_train_state, make_optimizer, train_state
from .dimenetpp import DimeNetPP, energy_and_forces
from .parallel import EdgeGroup, shard_graph, with_pos


@dataclass
class Normalizer:
    """``E = scale · y + Σ e_ref[z]``: per-element reference energies and one scale (eV)."""

    e_ref: np.ndarray  # (95,) eV per atom of each element
    scale: float

    @classmethod
    def fit(cls, z: np.ndarray, atom_ptr: np.ndarray, energy: np.ndarray, ids: np.ndarray) -> "Normalizer":
        counts = np.zeros((len(ids), 95))
        for row, s in enumerate(ids):
            np.add.at(counts[row], z[atom_ptr[s]:atom_ptr[s + 1]], 1)
        used = counts.sum(0) > 0
        coef, *_ = np.linalg.lstsq(counts[:, used], energy[ids], rcond=None)
        e_ref = np.zeros(95)
        e_ref[used] = coef
        resid = energy[ids] - counts @ e_ref
        return cls(e_ref, float(resid.std()) if len(ids) > 1 and resid.std() > 1e-8 else 1.0)

    def baseline(self, z: np.ndarray, system: np.ndarray, num_systems: int) -> np.ndarray:
        """(B,) the reference energy of each system: what the per-element baseline predicts."""
        return np.bincount(system, weights=self.e_ref[z], minlength=num_systems)


@dataclass
class StepCounts:
    """Normalising counts of one optimisation step over every replica."""

    systems: int
    free_atoms: int


def step_loss(model: DimeNetPP, g, b: dict, norm: Normalizer, counts: StepCounts,
              force_weight: float, train: bool = True) -> tuple[Tensor, Tensor, Tensor, float]:
    """This rank's share of a step's loss, the batch's energies (B,) and own forces (N_own, 3), eV,
    and the share to *report*: the loss with the (replicated) energy term divided by the ways."""
    gradient = model.cfg.force_head == "gradient"
    if gradient:
        g = with_pos(g, g.pos.detach().clone().requires_grad_(True))
    y, f = energy_and_forces(model, g, create_graph=train and gradient)
    dtype = y.dtype
    base = torch.as_tensor(norm.baseline(b["z"], b["system"], b["num_systems"]), dtype=dtype, device=y.device)
    energy = norm.scale * y + base
    forces = norm.scale * f
    own = slice(g.atom_lo, g.atom_hi)
    e_ref = torch.as_tensor(b["energy"], dtype=dtype, device=y.device)
    f_ref = torch.as_tensor(b["forces"][own], dtype=dtype, device=y.device)
    free = torch.as_tensor(~b["fixed"][own], device=y.device).unsqueeze(-1)
    loss_e = ((energy - e_ref) / norm.scale).pow(2).sum() / max(counts.systems, 1)
    loss_f = (((forces - f_ref) / norm.scale).pow(2) * free).sum() / max(3 * counts.free_atoms, 1)
    ways = getattr(getattr(g, "group", None), "size", 1) or 1
    report = float(loss_e.detach()) / ways + force_weight * float(loss_f.detach())
    return loss_e + force_weight * loss_f, energy.detach(), forces.detach(), report


def rank_view(b: dict, grp: Optional[EdgeGroup], dtype, device):
    """This rank's AtomGraph of batch ``b`` (the whole batch without a group)."""
    parts, rank = (1, 0) if grp is None else (grp.size, grp.rank)
    return shard_graph(b, parts, rank, grp, dtype, device)


# --------------------------------------------------------------------------- closed form
def step_bytes(cfg, edges: Sequence[int], atoms: Sequence[int], systems: Sequence[int], ways: int,
               dtype_bytes: int, params: int) -> int:
    """Bytes one training step sends, summed over every rank (what the ledger counts).

    ``edges[d], atoms[d], systems[d]``: the batch of replica d. With P ways, I = int_emb_size,
    H = hidden, K = num_blocks, b = dtype bytes, per replica:

    * gradient forces (double backward): edge rows ``4·K·(P-1)·E·I·b`` (all-gather forward, its
      reduce-scatter in the force pass, both again in the parameter pass), atom rows
      ``4·(K+1)·(P-1)·N·H·b`` (K+1 output blocks, the same four passes), forces
      ``2·(P-1)·3N·b`` (reduce-scatter, and its all-gather in the parameter pass);
    * direct forces: ``2·K·(P-1)·E·I·b + 2·(K+1)·(P-1)·N·H·b + 2·(P-1)·3N·b``;
    * energies: ``2·(P-1)·B·b`` (ring all-reduce); parameters: ``2·(P-1)·params·b`` per replica
      and ``2·(D-1)·params·b`` per way across replicas.
    """
    p, d, b = ways, len(edges), dtype_bytes
    k, i, h = cfg.num_blocks, cfg.int_emb_size, cfg.hidden_channels
    passes = 4 if cfg.force_head == "gradient" else 2
    total = 0
    for e, n, s in zip(edges, atoms, systems):
        total += (p - 1) * b * (passes * k * e * i + passes * (k + 1) * n * h + 2 * 3 * n + 2 * s)
    return total + d * 2 * (p - 1) * params * b + p * 2 * (d - 1) * params * b


# --------------------------------------------------------------------------- the engine
SPLIT_NAMES = ("train", "val", "test")


class AtomicEngine:
    """Modes ``single`` and ``graph`` (P ways × D replicas) for atomic models (see the module docstring)."""

    def __init__(self, cfg, comm, device, groups=None):
        from ..io import GnnPipeError
        from .data import read_graphs, read_systems
        from .dimenetpp import DimeNetPP, count_parameters

        self.cfg, self.comm, self.device = cfg, comm, device
        self.dtype = DTYPES[cfg.training.dtype]
        self.systems = read_systems(cfg.systems_path)
        self.graphs = read_graphs(cfg.graph_path, expect_systems_hash=self.systems["content_hash"])
        self.ways, self.replicas = (cfg.ways, cfg.data_parallel) if cfg.mode == "graph" else (1, 1)
        self.replica, self.way = divmod(groups.rank if groups is not None else 0, self.ways)
        spec = cfg.model.dimenetpp
        self.batch_size, self.force_weight = spec.batch_size, spec.force_weight
        self.model_cfg = model_config(spec, float(self.graphs["cutoff"]))
        edges = np.diff(self.graphs["edge_ptr"])
        if self.ways > int(edges.min()):
            s = int(edges.argmin())
            raise GnnPipeError(f"graph parallelism over {self.ways} ways: system {s} has only {int(edges[s])} "
                               f"edges within the cutoff; use at most {int(edges.min())} workers per replica")
        # the groups of gnnpipe.parallel.dims.build_groups: the replica's ways (stage group) and
        # this way's replicas (data group); None where a layout has only one
        self.graph_pg = groups.stage if groups is not None else None
        self.dp_group = groups.data if groups is not None and self.replicas > 1 else None
        self.grp = EdgeGroup(comm, self.graph_pg, self.ways, self.way) if self.ways > 1 else None
        self.ids = {name: np.nonzero(self.systems["split"] == i)[0] for i, name in enumerate(SPLIT_NAMES)}
        self.norm = Normalizer.fit(self.systems["z"], self.systems["atom_ptr"], self.systems["energy"],
                                   self.ids["train"])
        torch.manual_seed(cfg.training.seed)
        self.model = DimeNetPP(self.model_cfg).to(device, self.dtype)
        self.num_params = count_parameters(self.model_cfg)
        import dataclasses
        training = dataclasses.replace(cfg.training, lr=spec.lr) if spec.lr else cfg.training
        self.opt = make_optimizer(self.model.parameters(), training)
        self._epoch_steps: list[list[np.ndarray]] = []

    # ------------------------------------------------------------------ batching
    def _steps(self, ids: np.ndarray, epoch: Optional[int]) -> list[np.ndarray]:
        """The step batches (B·D systems each), shuffled by (seed, epoch) the same on every rank."""
        if epoch is not None:
            ids = np.random.default_rng([self.cfg.training.seed, epoch]).permutation(ids)
        per = self.batch_size * self.replicas
        return [ids[i:i + per] for i in range(0, len(ids), per)]

    def _replica_batch(self, step: np.ndarray, replica: int) -> np.ndarray:
        return np.array_split(step, self.replicas)[replica]

    def _batch(self, ids) -> dict:
        from .data import batch_arrays
        return batch_arrays(self.systems, self.graphs, ids)

    def _reduce_grads(self) -> None:
        grads = []
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if self.grp is not None:
            self.comm.all_reduce_coalesced_(grads, group=self.graph_pg)
        if self.dp_group is not None:
            self.comm.all_reduce_coalesced_(grads, group=self.dp_group, op="dp_allreduce")

    def _sum(self, values: list[float], group="world", reduce: str = "sum") -> list[float]:
        if self.comm is None:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        self.comm.all_reduce_(t, group=None if group == "world" else group, op="control", reduce=reduce)
        return t.tolist()

    # ------------------------------------------------------------------ training
    def train_epoch(self, epoch: int):
        import time

        t0 = time.perf_counter()
        comm0 = self.comm.epoch_comm_s(epoch) if self.comm is not None else 0.0
        self.model.train()
        steps = self._steps(self.ids["train"], epoch)
        self._epoch_steps.append(steps)
        total = 0.0
        for step in steps:
            mine = self._replica_batch(step, self.replica)
            self.opt.zero_grad(set_to_none=False)
            if len(mine):  # a short last step can leave a replica without systems: it adds zeros
                b = self._batch(mine)
                free = int(sum((~self.systems["fixed"][self.systems["atom_ptr"][s]:self.systems["atom_ptr"][s + 1]]).sum()
                               for s in step))
                g = rank_view(b, self.grp, self.dtype, self.device)
                loss, _, _, report = step_loss(self.model, g, b, self.norm, StepCounts(len(step), free),
                                               self.force_weight)
                loss.backward()
                total += report
            self._reduce_grads()
            self.opt.step()
        # the ranks' reported shares sum to the step losses
        loss_sum, = self._sum([total]) if self.comm is not None else (total,)
        wall = time.perf_counter() - t0
        comm_s = (self.comm.epoch_comm_s(epoch) - comm0) if self.comm is not None else 0.0
        return EpochStats(loss=loss_sum / max(len(steps), 1), compute_s=wall - comm_s, comm_s=comm_s)

    def predicted_bytes(self) -> int:
        """Closed form of one epoch's training bytes (the last epoch's batches; every epoch has the
        same step sizes up to the order of systems, and bytes depend on the sizes only)."""
        if self.comm is None or not self._epoch_steps:
            return 0
        total = 0
        b = torch.finfo(self.dtype).bits // 8
        for step in self._epoch_steps[-1]:
            parts = [self._replica_batch(step, r) for r in range(self.replicas)]
            e = [int(sum(np.diff(self.graphs["edge_ptr"])[p])) for p in parts]
            n = [int(sum(np.diff(self.systems["atom_ptr"])[p])) for p in parts]
            total += step_bytes(self.model_cfg, e, n, [len(p) for p in parts], self.ways, b, self.num_params)
        return total

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict:
        """OC20 S2EF metrics per split on free atoms: energy MAE (eV), force MAE (eV/Å, components),
        force cosine (per atom), EFwT (|ΔE| < 0.02 eV and max |ΔF| < 0.03 eV/Å)."""
        self.model.eval()
        out: dict = {"train_acc": None, "val_acc": None, "test_acc": None}
        for split in SPLIT_NAMES:
            sums = np.zeros(6)  # |dE| sum, systems, |dF| sum, components, cos sum, free atoms
            hits = 0.0
            for step in self._steps(self.ids[split], None):
                mine = self._replica_batch(step, self.replica)
                if len(mine) == 0:
                    mine = step[:1]  # every replica takes part in every collective; not counted
                    count = False
                else:
                    count = True
                b = self._batch(mine)
                g = rank_view(b, self.grp, self.dtype, self.device)
                with torch.enable_grad():
                    _, energy, forces, _ = step_loss(self.model, g, b, self.norm, StepCounts(1, 1), 0.0, train=False)
                own = slice(g.atom_lo, g.atom_hi)
                free = ~b["fixed"][own]
                df = (forces.cpu().double().numpy() - b["forces"][own])[free]
                f_ref, f_pred = b["forces"][own][free], forces.cpu().double().numpy()[free]
                cos = (f_ref * f_pred).sum(1) / np.maximum(np.linalg.norm(f_ref, axis=1) * np.linalg.norm(f_pred, axis=1), 1e-12)
                de = np.abs(energy.cpu().double().numpy() - b["energy"])
                maxf = np.zeros(b["num_systems"])
                np.maximum.at(maxf, b["system"][own][free], np.abs(df).max(axis=1, initial=0))
                if self.grp is not None:
                    maxf = np.array(self._sum(maxf.tolist(), self.graph_pg, "max"))
                if count:
                    lead = self.way == 0  # energies are replicated in the group: count them once
                    sums += [de.sum() * lead, len(de) * lead, np.abs(df).sum(), df.size, cos.sum(), len(cos)]
                    hits += float(((de < 0.02) & (maxf < 0.03)).sum()) * lead
            tot = self._sum([*sums.tolist(), hits])
            e_sum, n_sys, f_sum, n_comp, c_sum, n_free, h = tot
            out[f"{split}_energy_mae"] = e_sum / n_sys if n_sys else None
            out[f"{split}_force_mae"] = f_sum / n_comp if n_comp else None
            out[f"{split}_force_cos"] = c_sum / n_free if n_free else None
            out[f"{split}_efwt"] = h / n_sys if n_sys else None
        for k in ("energy_mae", "force_mae", "force_cos", "efwt"):
            out[k] = out[f"test_{k}"]
        out["loss"] = None
        self.model.train()
        return out

    def full_state_dict(self):
        return self.model.state_dict()

    def state_dict(self) -> dict:
        return train_state(self.model, self.opt)

    def load_state_dict(self, state: dict) -> None:
        load_train_state(self.model, self.opt, state)

    def graph_info(self) -> dict:
        return {"num_nodes": int(len(self.systems["z"])), "num_edges": int(len(self.graphs["edge_src"])),
                "in_features": 0, "num_triplets": int(len(self.graphs["idx_kj"])),
                "num_systems": int(len(self.systems["energy"]))}

    def extra_info(self) -> dict:
        n = len(self.systems["energy"])
        base = self.norm.baseline(self.systems["z"], np.repeat(np.arange(n), np.diff(self.systems["atom_ptr"])), n)
        test = self.ids["test"]
        return {"atomic": True, "data_parallel": self.replicas, "ways": self.ways,
                "parameters": self.num_params, "cutoff": float(self.graphs["cutoff"]),
                "force_head": self.model_cfg.force_head, "batch_size": self.batch_size,
                "baseline_energy_mae": float(np.abs(base[test] - self.systems["energy"][test]).mean())
                if len(test) else None}


def model_config(spec, cutoff: float):
    """The DimeNetPPConfig of a run: the spec's preset, its overrides, the graphs' cutoff."""
    from .dimenetpp import preset
    over = {k: getattr(spec, k) for k in ("hidden_channels", "num_blocks", "int_emb_size", "basis_emb_size",
                                          "out_emb_channels", "num_spherical", "num_radial")
            if getattr(spec, k) is not None}
    return preset(spec.preset, **over, cutoff=cutoff, force_head=spec.force_head)


# --------------------------------------------------------------------------- sizing
#: Default padded block counts per worker, per ceil(E/P) local edges or ceil(T/P) local triplets, when
#: the caller does not pass the measured ones (``block_counts``). Measured on the EMT slabs
#: (``data.generate``; cutoff 4.5 Å / 12 neighbours and 5 Å / 24; batches of 1-16 systems, P = 1-8,
#: the largest way): block rows G·Ro 1.2-1.6 × E_loc at P = 1, up to 3.0 at P = 8; block entries
#: G·Ro·Ki 1.3-1.7 × T_loc at P = 1, up to 3.4 at P = 8 (a centre's rows split over ways, its
#: columns not); block columns G·Ki 1.01-1.10 × E_loc at P = 1, more where a system is split over
#: ways (see memory_per_worker).
ROWS_PER_EDGE = 1.5
ENTRIES_PER_TRIPLET = 1.6
COLUMNS_PER_EDGE = 1.1


def block_counts(b: dict, ways: int) -> dict:
    """The padded :class:`~gnnpipe.atomic.dimenetpp.TripletBlocks` sizes of batch ``b`` split ``ways``
    ways, each the largest over the ways: ``rows`` G·Ro, ``columns`` G·Ki, ``entries`` G·Ro·Ki
    (the keyword arguments of :func:`memory_per_worker`). Index work only, no model."""
    from .dimenetpp import triplet_blocks
    out = {"rows": 0, "columns": 0, "entries": 0}
    for way in range(ways):
        tb = triplet_blocks(shard_graph(b, ways, way, None))
        (g, ro), ki = tb.row_edge.shape, tb.col_edge.shape[1]
        for key, n in (("rows", g * ro), ("columns", g * ki), ("entries", g * ro * ki)):
            out[key] = max(out[key], n)
    return out


def saved_bytes_by_rows(model, g, step: Callable[[], None]) -> dict:
    """Bytes autograd keeps for backward while ``step()`` runs (e.g. a training step's forward and
    backward on ``g``), by what the tensors' rows are, as :func:`memory_per_worker` counts them:
    ``edge`` (local edges, and padded block rows G·Ro), ``column`` (block columns G·Ki, also flattened
    with the S orders), ``entry`` (block entries G·Ro·Ki), ``atom`` (the view's atoms or own atoms),
    ``other``. Floating tensors only, each storage once (its whole size; a view counts once),
    ``model``'s parameters not. The block sizes and the model's widths must not coincide."""
    from .dimenetpp import triplet_blocks
    tb = triplet_blocks(g)
    (gc, ro), ki, s = tb.row_edge.shape, tb.col_edge.shape[1], model.cfg.num_spherical
    rows = {g.num_local_edges: "edge", g.num_atoms: "atom", g.atom_hi - g.atom_lo: "atom"}
    atom_widths = {model.cfg.hidden_channels, model.cfg.out_emb_channels, 1, 3}  # (N, w) where G = N
    if gc * ro in rows or gc * ki in rows or ro == ki or atom_widths & {ro, ki, ki * s}:
        raise ValueError(f"ambiguous rows: G·Ro = {gc}·{ro}, G·Ki = {gc}·{ki}, {rows}, widths {atom_widths}")

    def kind(d: list) -> str:
        if d[:3] == [gc, ro, ki] or d == [gc, ro, ki * s]:
            return "entry"  # the angular basis (G, Ro, Ki·S) and its recurrence (G, Ro, Ki)
        if d[:2] == [gc, ro] or d[0] in (gc * ro, gc * ro + 1):
            return "edge"  # block rows: the per-block (G, Ro, I) sums
        if d[:2] in ([gc, ki], [gc, ki * s]) or d[:3] == [gc, 3, ki] or d[0] in (gc * ki, gc * ki * s):
            return "column"  # per input edge: radial basis, messages (G, Ki, S, I)
        return rows.get(d[0], "other")

    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    out = {"edge": 0, "column": 0, "entry": 0, "atom": 0, "other": 0}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen and t.numel() and t.is_floating_point():
            seen.add(ptr)
            out[kind(list(t.shape))] += t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return out


def memory_per_worker(cfg, atoms: int, edges: int, triplets: int, ways: int, dtype_bytes: int = 4, *,
                      rows: Optional[int] = None, columns: Optional[int] = None,
                      entries: Optional[int] = None) -> dict:
    """Estimated bytes one of P ways holds for a training step on a batch of that size.

    Parameters, gradients and Adam's two moments: 4 copies, replicated. Activations autograd keeps
    for backward, by what their rows are (none is per triplet: ``dimenetpp`` lays the triplets out as
    dense per-centre blocks, :class:`~gnnpipe.atomic.dimenetpp.TripletBlocks`):

    * **edge**: per local edge (``ceil(E/P)``), and per padded block row (G·Ro, ``rows``: an output
      edge of a centre; default ``ROWS_PER_EDGE``·E_loc);
    * **column**: per padded block column (G·Ki, ``columns``: a distinct input edge read by the
      way's triplets, padded to the largest in-degree; default ``COLUMNS_PER_EDGE``·E_loc). The
      radial basis and each block's per-column messages live here. The default holds when a way's
      edges cover whole systems; a system split over ways reads the input edges of atoms across
      the cut as well (one 13-atom slab at P = 8: 8 × E_loc, at most ~1.1 × E): pass the measured
      counts (``block_counts``; ``plan_ways``/``gnnpipe plan-atomic`` do);
    * **entry**: per block entry (G·Ro·Ki, ``entries``, 1.3-3.4 × T_loc; default
      ``ENTRIES_PER_TRIPLET``·T_loc): the angular basis and its Legendre recurrence, shared by
      all blocks;
    * **atom**: per own atom (``ceil(N/P)``): the output blocks' MLPs (after ``sum_atoms``);
    * **gathered_edges**: one block's all-gathered input messages (E, I), alive while they are
      indexed into the columns (not kept for backward; P does not divide it).

    Elements per row (K blocks, H hidden, I int_emb, B basis_emb, O out_emb, L output layers,
    S spherical, R radial, n = num_before_skip + num_after_skip):

    ================  ===================================================  ==============================
    rows              gradient forces (double backward)                    direct forces
    ================  ===================================================  ==============================
    local edge        K(22H + 8nH + 4I + 2B) + 12H + 7R + 33               K(11H + 4nH + 2I + B) + 8H
                                                                           + (2L+1)O + 2R + 9
    block row         K·I + 3                                              0
    block column      K((4S+1)I + 2SB) + (3S+17)SR - 8R + 35               K((S+1)I + SB) + SR
    block entry       4S - 5 (S >= 3; 2S at S = 2)                         S
    own atom          (K+1)(H + (4L+2)O) + 5                               (K+1)(H + (2L+1)O) + 4
    ================  ===================================================  ==============================

    A direct step keeps what its ops save (a Linear its input, an activation its input, a
    product both factors: a residual layer 4H, an output MLP layer 2O; the force head's edge MLP
    ``(2L+1)O``); the gradient step's double backward also keeps the graph of the force pass,
    1.7-1.9 times the direct step's per edge and atom and four times per column (the spherical
    Bessel recurrence ``(3S+17)SR`` and the per-column messages ``4S·I`` per block). The
    coefficients were measured, not only counted: ``saved_tensors_hooks`` over one training
    step (``engine.step_loss`` + ``backward``), distinct storages (a view counts once, parameters
    not), by row kind, on 2 EMT slabs at 30 random sizes per head (K 1-4, H 36-56, I 10-20,
    B 4-8, O 36-60, S 2-8, R 2-8, L 1-3, n 0-4): a least-squares fit in the products above is
    exact (integer coefficients, residual < 1e-10 elements per row), and holds at P = 2 and 4
    (``benchmarks/bench_atomic.py`` prints the estimate per part beside the measurement).
    Not counted: index arrays (the graph's 4 int64 per triplet, the blocks' bool mask per entry)
    and parameter-sized copies (transposed weights, W_sbf1's block diagonal), < 1 % here.

    The direct step keeps about half the gradient step's memory (0.48 at the default sizes on the
    slabs; the old per-triplet estimate took a third). An estimate for sizing (tests: each part within 15 % of a measured step of each
    head, at a size not used above), not an allocator trace: transient tensors (a backward's
    gradient buffers) come on top.
    """
    from .dimenetpp import count_parameters
    k, h, i, be, o = cfg.num_blocks, cfg.hidden_channels, cfg.int_emb_size, cfg.basis_emb_size, cfg.out_emb_channels
    s, r, lo = cfg.num_spherical, cfg.num_radial, cfg.num_output_layers
    res = cfg.num_before_skip + cfg.num_after_skip
    b = dtype_bytes
    local = lambda n: -(-n // ways)  # noqa: E731 - the largest block of np.array_split
    e_loc, t_loc, n_own = local(edges), local(triplets), local(atoms)
    rows = ROWS_PER_EDGE * e_loc if rows is None else rows
    columns = COLUMNS_PER_EDGE * e_loc if columns is None else columns
    entries = ENTRIES_PER_TRIPLET * t_loc if entries is None else entries
    if cfg.force_head == "gradient":
        per_edge = k * (22 * h + 8 * res * h + 4 * i + 2 * be) + 12 * h + 7 * r + 33
        per_row = k * i + 3
        per_column = k * ((4 * s + 1) * i + 2 * s * be) + (3 * s + 17) * s * r - 8 * r + 35
        per_entry = max(4 * s - 5, 2 * s)
        per_atom = (k + 1) * (h + (4 * lo + 2) * o) + 5
    else:
        per_edge = k * (11 * h + 4 * res * h + 2 * i + be) + 8 * h + (2 * lo + 1) * o + 2 * r + 9
        per_row = 0
        per_column = k * ((s + 1) * i + s * be) + s * r
        per_entry = s
        per_atom = (k + 1) * (h + (2 * lo + 1) * o) + 4
    out = {"parameters": 4 * count_parameters(cfg) * b,
           "edge": int((per_edge * e_loc + per_row * rows) * b),
           "column": int(per_column * columns * b),
           "entry": int(per_entry * entries * b),
           "atom": int(per_atom * n_own * b),
           "gathered_edges": int(i * edges * b) if ways > 1 else 0}
    out["total"] = sum(out.values())
    return out


def plan_ways(cfg, atoms: int, edges: int, triplets: int, device_bytes: int, dtype_bytes: int = 4,
              max_ways: int = 64, blocks: Optional[Callable[[int], dict]] = None) -> list[dict]:
    """Memory per worker and bytes per step for P = 1, 2, 4, ...; ``fits`` against ``device_bytes``.
    ``blocks(P)``: the padded block counts at P ways (``block_counts`` of a batch), else the defaults."""
    from .dimenetpp import count_parameters
    rows, p = [], 1
    params = count_parameters(cfg)
    while p <= max_ways and p <= edges:
        mem = memory_per_worker(cfg, atoms, edges, triplets, p, dtype_bytes, **(blocks(p) if blocks else {}))
        rows.append({"ways": p, "memory_per_worker": mem["total"], "memory": mem,
                     "bytes_per_step": step_bytes(cfg, [edges], [atoms], [1], p, dtype_bytes, params),
                     "fits": mem["total"] <= device_bytes})
        p *= 2
    return rows
