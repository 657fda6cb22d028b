"""The training step of atomistic models, in one process or sharded (P graph ways × D replicas).

World layout: ``world = D × P``, ``rank = replica * P + way`` (fairchem's ``dp × gp`` grid):
the P ranks of a replica split each batch's edges and triplets (``parallel.shard_graph``) or, with
``atom_layout: atoms``, its atoms (``halo.shard_atoms``: each way receives only its halo), or with
``atom_layout: domains`` every system's spatial domains, each way building its own regions' graph
from the batch's positions (``domains.batch_view``: the batch's graph is not built), as the
run's layout object says (``atom_layouts``: chosen once, asked for each batch's view and bytes);
the D replicas take different batches. The loss of a step is written so that the sum over
every rank is the single-process loss of the union of the replicas' batches:

* energy term  ``Σ_systems ((E - E_ref)/σ)² / n_systems`` — replicated inside a graph
  group (every way holds the same energies), counted once (``sum_systems``' identity
  backward), summed over replicas;
* force term   ``w_F · Σ_own free atoms |(F - F_ref)/σ|² / (3 n_free)`` — each way its own atoms;

with ``n_systems`` and ``n_free`` the counts over the whole step (all replicas). So the
parameter gradients are **summed** over the graph group and then over the data-parallel
group, and equal single-process training on the union batch (tests: ``..._matches_unsharded``).

**Energy-only** (``energy_only``: data without forces, or ``force_weight: 0``; the one place that
decides): the loss is the energy term alone and the model is asked for energies alone
(``model(g, forces=False)``), so a step is the energy's forward and backward: no forces by autograd,
no double backward, no direct head; the bytes' closed form counts those two passes
(``parallel.collective_passes``), and the force metrics are None.

Targets are normalised by per-element reference energies (a least-squares fit on the
training systems: the "per-element mean energy" baseline) and their residuals' standard
deviation σ: ``E = σ·model(g) + Σ_atoms e_ref[z]``, ``F = σ·model_forces``.

The model is any kind of the registry (``protocol.ATOMIC_MODELS``), built from the run's
section ``models.<name>.<kind>`` and driven only through the protocol: ``model(g)`` returns
``{"energy", "forces"}``, the kind gives the closed-form bytes and, where it has constants
fitted before training (GemNet's scale factors: ``AtomicModelKind.fit``), the fit. That fit
runs once, on rank 0, on whole training batches in one process, before the first step; the
fitted buffers are broadcast (op ``control``) and live in the state dict, so checkpoints and
resumed runs carry them and every layout computes with the same constants.

**Fine-tuning** (``models.<name>.init_from``, ``modelfile.load_init``): the run starts from a model
file's weights, config, normaliser and fitted constants (none refitted), on graphs checked to be the
file's (its convention and cap, cut to its cutoff); every layout starts from the same file, so the
exactness above holds from the first step.

How it trains beyond Adam (``gnnpipe.habits``, keys in the model's section, on by default): the
learning rate per step (warmup, cosine decay), the gradients' norm clipped after their reduction (the
same on every rank), an exponential moving average of the weights that evaluation and the finished
model use, and a divergence guard on each epoch's record (the task's check); the habits act from the
optimizer's step hooks (``self.habits``), the average and the guard's record are in the engine's
state, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from ..engine import DTYPES, EpochStats, OptimizerHooks, load_train_state, make_optimizer, train_state
from ..habits import Habits
from ..io import GnnPipeError
from .halo import HALO_KEYS
from .atom_layouts import EDGES, TRAIN_LAYOUTS, AtomLayout, choose_layout, layout_costs
from .modelfile import check_init_cap, check_init_graphs, load_init
from .parallel import EdgeGroup, single_graph
from .protocol import ATOMIC_MODELS

#: whole step batches (the run's batch size × its replicas) GemNet's scale factors are fitted on
FIT_BATCHES = 4


@dataclass
class Normalizer:
    """``E = scale · y + mean + Σ e_ref[z]``, ``F = force_scale · f``: per-element reference energies
    and one scale (eV); ``mean`` (per structure) and a separate ``force_scale`` only for a model
    imported from fairchem (its normalisers), else 0 and ``scale``."""

    e_ref: np.ndarray  # (95,) eV per atom of each element
    scale: float
    mean: float = 0.0
    force_scale: Optional[float] = None  # None: scale

    def __post_init__(self):
        if self.force_scale is None:
            self.force_scale = self.scale

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
        """(B,) the reference energy of each system: what the per-element baseline predicts (+ mean)."""
        return np.bincount(system, weights=self.e_ref[z], minlength=num_systems) + self.mean


@dataclass
class StepCounts:
    """Normalising counts of one optimisation step over every replica."""

    systems: int
    free_atoms: int


def energy_only(systems: dict, force_weight: float) -> Optional[str]:
    """Why a run trains on energies alone, or None when it fits forces too: the one place that decides.
    Energy-only (data without forces, ``data.has_forces``, or ``force_weight: 0``) means no force pass
    at all (the step is the energy's forward and backward: no forces by autograd, no double backward,
    no direct head) and no force metrics (None in the run record, eval.json and the report)."""
    from .data import has_forces

    if not has_forces(systems):
        return "its data has no forces"
    if force_weight == 0:
        return "force_weight is 0"
    return None


def step_loss(model, g, b: dict, norm: Normalizer, counts: StepCounts, force_weight: float,
              forces: bool = True) -> tuple[Tensor, Tensor, Optional[Tensor], float]:
    """This rank's share of a step's loss, the batch's energies (B,) and own forces (N_own, 3), eV,
    and the share to *report*: the loss with the (replicated) energy term divided by the ways.
    ``model`` is a protocol model: in training mode its gradient forces keep the graph.
    ``forces=False`` (energy-only): the model's energy alone, the energy term alone, forces None."""
    out = model(g, forces=forces)
    y = out["energy"]
    dtype = y.dtype
    base = torch.as_tensor(norm.baseline(b["z"], b["system"], b["num_systems"]), dtype=dtype, device=y.device)
    energy = norm.scale * y + base
    e_ref = torch.as_tensor(b["energy"], dtype=dtype, device=y.device)
    loss_e = ((energy - e_ref) / norm.scale).pow(2).sum() / max(counts.systems, 1)
    ways = getattr(getattr(g, "group", None), "size", 1) or 1
    if not forces:
        return loss_e, energy.detach(), None, float(loss_e.detach()) / ways
    f = norm.force_scale * out["forces"]
    own = slice(g.atom_lo, g.atom_hi)
    f_ref = torch.as_tensor(b["forces"][own], dtype=dtype, device=y.device)
    free = torch.as_tensor(~b["fixed"][own], device=y.device).unsqueeze(-1)
    loss_f = (((f - f_ref) / norm.force_scale).pow(2) * free).sum() / max(3 * counts.free_atoms, 1)
    report = float(loss_e.detach()) / ways + force_weight * float(loss_f.detach())
    return loss_e + force_weight * loss_f, energy.detach(), f.detach(), report


# --------------------------------------------------------------------------- the engine
SPLIT_NAMES = ("train", "val", "test")


class AtomicEngine(OptimizerHooks):
    """Modes ``single`` and ``graph`` (P ways × D replicas) for atomic models (see the module docstring)."""

    def __init__(self, cfg, groups, comm, device):
        import dataclasses

        self.cfg, self.comm, self.device = cfg, comm, device
        self.dtype = DTYPES[cfg.training.dtype]
        self.kind = ATOMIC_MODELS[cfg.model.kind]
        spec = cfg.model.spec
        self.init = load_init(cfg)  # the model file it starts from (models.<name>.init_from), or None
        self.ways, self.replicas = (cfg.ways, cfg.data_parallel) if cfg.mode == "graph" else (1, 1)
        self.layout = TRAIN_LAYOUTS[cfg.atom_layout]  # how the ways split a batch (atom_layouts)
        # the domains layout: each rank builds its regions' graph from the batch's positions (no batch graph)
        self.own_build = self.layout.distributed_build and self.ways > 1
        # ... and reads of graphs.h5 its counts alone where it can (run_data): no neighbour list, no triplets
        self.systems, self.graphs = run_data(cfg, self.init, counts_only=self.own_build)
        self._halos: dict = {}  # the domains layout: epoch -> each step's halo rows per replica (predicted_bytes)
        self.replica, self.way = divmod(groups.rank if groups is not None else 0, self.ways)
        # why it fits energies alone (energy_only), or None; then no force pass runs and the weight is 0
        self.energy_only = energy_only(self.systems, spec.force_weight)
        self.batch_size, self.force_weight = spec.batch_size, 0.0 if self.energy_only else spec.force_weight
        self.eval_train_systems = spec.eval_train_systems  # gnnpipe evaluate --train-systems overrides it
        self.model_cfg = model_config(cfg.model, float(self.graphs["cutoff"]), self.init)
        edges = np.diff(self.graphs["edge_ptr"])
        atoms = np.diff(self.systems["atom_ptr"])
        if self.own_build and self.ways > int(atoms.min()):  # every way owns a domain of every system
            s = int(atoms.argmin())
            raise GnnPipeError(f"atom_layout domains over {self.ways} ways: system {s} has only {int(atoms[s])} "
                               f"atoms; use at most {int(atoms.min())} workers per replica or the atoms layout")
        if self.ways > int(edges.min()):
            s = int(edges.argmin())
            raise GnnPipeError(f"graph parallelism over {self.ways} ways: system {s} has only {int(edges[s])} "
                               f"edges within the cutoff; use at most {int(edges.min())} workers per replica")
        # the groups of gnnpipe.parallel.groups.build_groups: the replica's graph ways (graph group)
        # and this way's replicas (data group); None where a layout has only one
        self.graph_pg = groups.graph if groups is not None else None
        self.dp_group = groups.data if groups is not None and self.replicas > 1 else None
        self.grp = EdgeGroup(comm, self.graph_pg, self.ways, self.way) if self.ways > 1 else None
        self.ids = {name: np.nonzero(self.systems["split"] == i)[0] for i, name in enumerate(SPLIT_NAMES)}
        if self.init is not None:  # its normaliser and weights: the first evaluation is the file's prediction
            self.norm = self.init.normalizer()
            self.model = self.init.build(device, self.dtype).train()
            if groups is None or groups.rank == 0:
                warn_energy_reference(self.init, self.systems, cfg)
        else:
            self.norm = Normalizer.fit(self.systems["z"], self.systems["atom_ptr"], self.systems["energy"],
                                       self.ids["train"])
            torch.manual_seed(cfg.training.seed)
            self.model = self.kind.build(self.model_cfg).to(device, self.dtype)
        self.num_params = self.kind.count_parameters(self.model_cfg)
        # the kind's own (its section's default), not the node models' training.lr; None: a run.yaml of
        # gnnpipe before #37 item 13, whose atomic runs trained at training.lr
        self.lr = spec.lr if spec.lr is not None else cfg.training.lr
        self.opt = make_optimizer(self.model.parameters(), dataclasses.replace(cfg.training, lr=self.lr))
        self.steps_per_epoch = -(-len(self.ids["train"]) // (self.batch_size * self.replicas))
        self.habits = Habits(spec, lr=self.lr, steps_per_epoch=self.steps_per_epoch, epochs=cfg.training.epochs,
                             params=dict(self.model.named_parameters()),
                             hint=f"lower models.<name>.{cfg.model.kind}.lr (now {self.lr:g}) or see its guard keys"
                             ).attach(self)
        # loading a state (resume, evaluate) or a model file (init_from: its fitted buffers) counts as fitted
        self._fitted = self.kind.fit is None or self.init is not None

    def fit_constants(self) -> dict:
        """Fit what the kind fits before training (GemNet's scale factors) on rank 0, on the first
        ``FIT_BATCHES`` whole step batches (B·D systems: what single-process training on the union of the
        replicas' batches fits) in one process (deterministic: a seeded order), and broadcast the model's
        buffers; returns name -> value (rank 0's fit)."""
        fitted = {}
        if self.comm is None or self.comm.rank == 0:
            ids = np.random.default_rng([self.cfg.training.seed, 2**31]).permutation(self.ids["train"])
            per = self.batch_size * self.replicas
            batches = [ids[i:i + per] for i in range(0, len(ids), per)][:FIT_BATCHES]
            fitted = self.kind.fit(self.model, [single_graph(self._graph_batch(b), self.dtype, self.device)
                                                for b in batches])
        if self.comm is not None:  # every rank computes with rank 0's constants, bit for bit
            state = self.model.state_dict()
            for name, buf in self.model.named_buffers():
                if name in state:  # persistent: what a checkpoint carries
                    self.comm.broadcast_(buf.data, src=0)
        self._fitted = True
        return fitted

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
        """Systems ``ids`` as one batch with their graph; in the domains layout (``own_build``) without
        it: the step's view builds each rank's regions from the positions (``domains.batch_view``), and
        gets the cutoff and each system's edge count (its check that the file's neighbour cap does not
        bind). With the graph in every layout: ``_graph_batch``."""
        from .data import batch_arrays
        if not self.own_build:
            return batch_arrays(self.systems, self.graphs, ids)
        ids = np.asarray(ids)
        return {**batch_arrays(self.systems, None, ids), "ids": ids, "cutoff": float(self.graphs["cutoff"]),
                "edges": np.diff(self.graphs["edge_ptr"])[ids]}

    def _graph_batch(self, ids) -> dict:
        """Systems ``ids`` as one batch with their graph: graphs.h5's rows, or where the engine read its
        counts alone (the domains layout, ``run_data``) those systems' graphs built from their positions
        with the file's cutoff, cap and convention (``data.build_graphs``: the function that wrote the
        file, so the same edges in the same order), O(the batch), not the dataset."""
        from .data import batch_arrays, build_graphs

        if "edge_src" in self.graphs:
            return batch_arrays(self.systems, self.graphs, ids)
        sub = subset_systems(self.systems, ids)
        g = self.graphs
        built = build_graphs(sub, float(g["cutoff"]), int(g["max_neighbors"]), progress=False, neighbors=g["neighbors"])
        return batch_arrays(sub, built, np.arange(len(ids)))

    def _record_halos(self, epoch: int, halos: list) -> None:
        """Keep epoch ``epoch``'s halo rows (the domains layout's views count them: ``domains.batch_view``),
        every replica's on every rank: one all-reduce, way 0 of each replica adding its replica's."""
        keys = HALO_KEYS
        mine = np.zeros((len(halos), self.replicas, len(keys)))
        for i, h in enumerate(halos):
            if h is not None and self.way == 0:
                mine[i, self.replica] = [h[k] for k in keys]
        tot = np.array(self._sum(mine.ravel().tolist())).reshape(mine.shape) if mine.size else mine
        self._halos[epoch] = [[dict(zip(keys, map(int, r))) for r in step] for step in tot]

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
        if not self._fitted:
            self.fit_constants()
        self.model.train()
        steps = self._steps(self.ids["train"], epoch)
        reports = []  # this rank's share of each step's loss
        halos = []  # the domains layout: this replica's halo rows of each step (None: no systems)
        self.habits.begin_epoch(epoch)
        for step in steps:
            mine = self._replica_batch(step, self.replica)
            self.opt.zero_grad(set_to_none=False)
            if len(mine):  # a short last step can leave a replica without systems: it adds zeros
                b = self._batch(mine)
                free = int(sum((~self.systems["fixed"][self.systems["atom_ptr"][s]:self.systems["atom_ptr"][s + 1]]).sum()
                               for s in step))
                b, g = self.layout.view(b, self.grp, self.dtype, self.device)
                loss, _, _, report = step_loss(self.model, g, b, self.norm, StepCounts(len(step), free),
                                               self.force_weight, forces=not self.energy_only)
                loss.backward()
            halos.append(getattr(g, "halo", None) if len(mine) else None)
            reports.append(report if len(mine) else 0.0)
            self._reduce_grads()  # every rank holds the step's whole gradients: it clips the same ones
            self.opt.step()  # the habits' hooks: this step's lr and clip before, the moving average after
        losses = self._sum(reports) if reports else []  # the ranks' shares summed: each step's loss
        if self.own_build:
            self._record_halos(epoch, halos)
        wall = time.perf_counter() - t0
        comm_s = (self.comm.epoch_comm_s(epoch) - comm0) if self.comm is not None else 0.0
        return EpochStats(loss=sum(losses) / max(len(steps), 1), compute_s=wall - comm_s, comm_s=comm_s,
                          step_losses=losses)

    def predicted_bytes(self, epoch: Optional[int] = None) -> int:
        """Closed form of epoch ``epoch``'s training bytes, from that epoch's own step batches (None: the
        run's last epoch). Epochs differ: each draws its own order, so its steps hold other systems, and
        the bytes depend on their sizes (edges, atoms) and, in the atoms layout, on their halos (7.05 to
        10.64 MB an epoch on one run, #37 item 9). The trainer records each epoch's beside its ledger.

        The domains layout (whose engine reads no graph): ``halo.step_bytes`` on the halo rows its views
        counted in that epoch (``_record_halos``: the rows each rank's regions need, the same counts as
        ``halo.halo_counts`` of the batch's graph grouped by the domains' owners); an epoch this engine
        has not trained is priced on graphs.h5's rows of its batches (``_graph_batch``)."""
        if self.comm is None:
            return 0
        total = 0
        b = torch.finfo(self.dtype).bits // 8
        epoch = self.cfg.training.epochs - 1 if epoch is None else epoch
        if self.own_build and epoch in self._halos:
            from .halo import step_bytes
            for step, halos in zip(self._steps(self.ids["train"], epoch), self._halos[epoch]):
                systems = [len(self._replica_batch(step, r)) for r in range(self.replicas)]
                total += step_bytes(self.kind, self.model_cfg, halos, systems, self.ways, b, self.num_params,
                                    forces=not self.energy_only)
            return total
        for step in self._steps(self.ids["train"], epoch):  # the batches (and partitions) of training's steps
            batches = [self._graph_batch(p) if len(p) else None for p in
                       (self._replica_batch(step, r) for r in range(self.replicas))]
            total += self.layout.step_bytes(self.kind, self.model_cfg, batches, self.ways, b, self.num_params,
                                            forces=not self.energy_only)
        return total

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict:
        """OC20 S2EF metrics per split on free atoms: energy MAE (eV), force MAE (eV/Å, components),
        force cosine (per atom), EFwT (|ΔE| < 0.02 eV and max |ΔF| < 0.03 eV/Å); with the weights'
        moving average where the run keeps one. An energy-only run: the energy MAE alone (forward
        passes only), the force metrics and EFwT None."""
        with self.habits.averaged():
            return self._evaluate()

    def _evaluate(self) -> dict:
        self.model.eval()
        out: dict = {"train_acc": None, "val_acc": None, "test_acc": None}
        for split in SPLIT_NAMES:
            sums = np.zeros(6)  # |dE| sum, systems, |dF| sum, components, cos sum, free atoms
            hits = 0.0
            for step in self._steps(self.eval_ids(split), None):
                mine = self._replica_batch(step, self.replica)
                if len(mine) == 0:
                    mine = step[:1]  # every replica takes part in every collective; not counted
                    count = False
                else:
                    count = True
                b, g = self.layout.view(self._batch(mine), self.grp, self.dtype, self.device)
                with torch.no_grad() if self.energy_only else contextlib.nullcontext():
                    _, energy, forces, _ = step_loss(self.model, g, b, self.norm, StepCounts(1, 1), 0.0,
                                                     forces=not self.energy_only)
                de = np.abs(energy.cpu().double().numpy() - b["energy"])
                lead = self.way == 0  # energies are replicated in the group: count them once
                if forces is None:  # energy-only: no forces to score
                    sums[:2] += [de.sum() * lead * count, len(de) * lead * count]
                    continue
                own = slice(g.atom_lo, g.atom_hi)
                free = ~b["fixed"][own]
                df = (forces.cpu().double().numpy() - b["forces"][own])[free]
                f_ref, f_pred = b["forces"][own][free], forces.cpu().double().numpy()[free]
                cos = (f_ref * f_pred).sum(1) / np.maximum(np.linalg.norm(f_ref, axis=1) * np.linalg.norm(f_pred, axis=1), 1e-12)
                maxf = np.zeros(b["num_systems"])
                np.maximum.at(maxf, b["system"][own][free], np.abs(df).max(axis=1, initial=0))
                if self.grp is not None:
                    maxf = np.array(self._sum(maxf.tolist(), self.graph_pg, "max"))
                if count:
                    sums += [de.sum() * lead, len(de) * lead, np.abs(df).sum(), df.size, cos.sum(), len(cos)]
                    hits += float(((de < 0.02) & (maxf < 0.03)).sum()) * lead
            tot = self._sum([*sums.tolist(), hits])
            e_sum, n_sys, f_sum, n_comp, c_sum, n_free, h = tot
            out[f"{split}_energy_mae"] = e_sum / n_sys if n_sys else None
            out[f"{split}_force_mae"] = f_sum / n_comp if n_comp else None
            out[f"{split}_force_cos"] = c_sum / n_free if n_free else None
            out[f"{split}_efwt"] = h / n_sys if n_sys and not self.energy_only else None
        for k in ("energy_mae", "force_mae", "force_cos", "efwt"):
            out[k] = out[f"test_{k}"]
        out["train_systems_scored"], out["train_systems"] = len(self.eval_ids("train")), len(self.ids["train"])
        out["loss"] = None
        self.model.train()
        return out

    def eval_ids(self, split: str) -> np.ndarray:
        """The systems an evaluation scores: the split's, but of the training split a seeded sample of
        ``eval_train_systems`` (the same at every evaluation; all where it has no more, or the bound is
        None): scoring 4,000 training molecules with forces took 15-30 s an evaluation (#37 item 20)."""
        ids, cap = self.ids[split], self.eval_train_systems
        if split != "train" or cap is None or len(ids) <= cap:
            return ids
        return np.sort(np.random.default_rng([self.cfg.training.seed, 2**31 + 1]).choice(ids, cap, replace=False))

    def named_parameters(self) -> dict:
        return dict(self.model.named_parameters())

    def full_state_dict(self):
        """The finished model: the weights' moving average where the run keeps one."""
        return self.habits.final_state(self.model.state_dict())

    def state_dict(self) -> dict:
        return {**train_state(self.model, self.opt), **self.habits.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """A resume state (``Habits.load_state_dict``: one of a gnnpipe before the habits resumes with a
        fresh guard and the average started at the loaded weights)."""
        load_train_state(self.model, self.opt, state)
        self.habits.load_state_dict(state)
        self._fitted = True  # the state carries the fitted buffers

    def graph_info(self) -> dict:
        return {"num_nodes": int(len(self.systems["z"])), "num_edges": int(self.graphs["edge_ptr"][-1]),
                "in_features": 0, "num_triplets": int(self.graphs["triplet_ptr"][-1]),
                "num_systems": int(len(self.systems["energy"]))}

    def baselines(self, split: str = "test") -> dict:
        """What a model must beat, on the split's systems (the metrics' own sums): the per-element
        energy baseline's energy MAE (reference energies fitted on the training systems) and the
        zero-force baseline's force MAE (predicting F = 0: the mean |F| component of free atoms; None
        in an energy-only run)."""
        s = self.systems
        n = len(s["energy"])
        ids = self.ids[split]
        if not len(ids):
            return {"baseline_energy_mae": None, "baseline_force_mae": None}
        base = self.norm.baseline(s["z"], np.repeat(np.arange(n), np.diff(s["atom_ptr"])), n)
        atoms = np.concatenate([np.arange(s["atom_ptr"][i], s["atom_ptr"][i + 1]) for i in ids])
        free = atoms[~s["fixed"][atoms]]
        return {"baseline_energy_mae": float(np.abs(base[ids] - s["energy"][ids]).mean()),
                "baseline_force_mae": float(np.abs(s["forces"][free]).mean())
                if len(free) and not self.energy_only else None}

    def extra_info(self) -> dict:
        return {"atomic": True, "kind": self.kind.name, "label": self.kind.labels[self.model_cfg.force_head],
                "data_parallel": self.replicas, "ways": self.ways,
                "parameters": self.num_params, "cutoff": float(self.graphs["cutoff"]),
                "force_head": self.model_cfg.force_head, "batch_size": self.batch_size, "lr": self.lr,
                "energy_only": self.energy_only, **self.baselines()}


def model_config(model, cutoff: float, init=None):
    """The config of a run's atomic model (``ModelConfig``): its kind's preset, the section's sizes
    and force head where set, and the graphs' cutoff (``model_graphs``); a run that starts from a model
    file (``init``: ``modelfile.load_init``), the file's."""
    if init is not None:
        return init.config()
    kind, spec = ATOMIC_MODELS[model.kind], model.spec
    over = {f: getattr(spec, f) for f in kind.config_fields() if hasattr(spec, f) and f != "cutoff"}
    return kind.preset(spec.preset, **over, cutoff=cutoff)


def run_data(cfg, init=None, counts_only: bool = False) -> tuple[dict, dict]:
    """The systems and the model's graphs (``model_graphs``) of atomic run ``cfg`` (its ``run.yaml``); of
    a run that starts from a model file (``init``), at the file's cutoff, checked to be the graphs it
    computes on (``modelfile.check_init_graphs``). ``counts_only`` (the domains layout: its ranks build
    their own regions): of graphs.h5 its attributes and each system's edge and triplet counts alone
    (``data.read_graphs``) where those are the model's, that is without ``init`` and at the file's
    cutoff; otherwise (a smaller model cutoff rebuilds the graphs, a model file checks them) the whole."""
    from .data import read_graphs, read_systems

    if counts_only and init is None:
        systems = read_systems(cfg.systems_path, rows=True)
        graphs = read_graphs(cfg.graph_path, expect_systems_hash=systems["content_hash"], counts_only=True)
        if cfg.model.spec.cutoff is None or cfg.model.spec.cutoff == graphs["cutoff"]:
            return systems, graphs
    systems = read_systems(cfg.systems_path)
    graphs = read_graphs(cfg.graph_path, expect_systems_hash=systems["content_hash"])
    if init is None:
        return systems, model_graphs(graphs, systems, cfg.model.spec.cutoff, cfg.graph_path)
    check_init_graphs(init, graphs, cfg)
    graphs = model_graphs(graphs, systems, init.cutoff, cfg.graph_path)
    check_init_cap(init, graphs, systems, cfg)
    return systems, graphs


def warn_energy_reference(init, systems: dict, cfg) -> None:
    """One line on stderr where the run fine-tunes a model on energies of another origin (say an OC20
    adsorption-energy model on total energies): its normaliser's offsets are the file's, so the first
    errors are the difference of the references; training goes on (the user may mean it)."""
    import sys

    from .modelfile import data_energy_reference, energy_words

    data = data_energy_reference(str(systems.get("source", "")))
    if init.energy_reference and data and data != init.energy_reference:
        print(f"gnnpipe: warning: run {cfg.run_id}: init_from {init.source} predicts "
              f"{energy_words(init.energy_reference)} energies and dataset {cfg.dataset_name} holds {data} "
              "energies: its normaliser's offsets do not fit them (expect large first errors)", file=sys.stderr)


def model_graphs(graphs: dict, systems: dict, cutoff: Optional[float], path) -> dict:
    """The graphs a model with basis cutoff ``cutoff`` computes on (None: the file's). A larger one
    is refused (the file lacks the neighbours beyond its cutoff); a smaller one rebuilds the graphs
    at that cutoff with the file's neighbour cap and convention, in memory (the same edges a rebuild
    would write: each atom's nearest within the smaller cutoff are the nearest it had)."""
    from .data import build_graphs

    if cutoff is None or cutoff == graphs["cutoff"]:
        return graphs
    if cutoff > graphs["cutoff"]:
        raise GnnPipeError(f"the model's cutoff {cutoff:g} Å is larger than the cutoff {graphs['cutoff']:g} Å "
                           f"of the graphs it trains on ({path}): they lack the neighbours between; raise the "
                           f"dataset's atoms.cutoff or lower the model's")
    out = build_graphs(systems, cutoff, int(graphs["max_neighbors"]), progress=False, neighbors=graphs["neighbors"])
    return {**out, "cutoff": float(cutoff), "max_neighbors": graphs["max_neighbors"], "neighbors": graphs["neighbors"],
            "symmetric_edges": graphs["symmetric_edges"], "content_hash": graphs["content_hash"]}


def subset_systems(systems: dict, ids) -> dict:
    """Systems ``ids`` of ``systems`` (in that order) as a systems dict of their own."""
    ptr = systems["atom_ptr"]
    atoms = np.concatenate([np.arange(ptr[s], ptr[s + 1]) for s in ids])
    sizes = [int(ptr[s + 1] - ptr[s]) for s in ids]
    out = {k: systems[k][atoms] for k in ("z", "pos", "fixed", "forces")}
    out.update({k: systems[k][np.asarray(ids)] for k in ("cell", "pbc", "energy", "split", "group")})
    return {**systems, **out, "atom_ptr": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)}


# --------------------------------------------------------------------------- sizing
def largest_batch(systems: dict, graphs: dict, batch_size: int) -> np.ndarray:
    """The ids of a step batch as large as any: the ``batch_size`` systems with the most triplets
    (ties: most edges, then atoms)."""
    order = np.lexsort((np.diff(systems["atom_ptr"]), np.diff(graphs["edge_ptr"]), np.diff(graphs["triplet_ptr"])))
    return np.sort(order[::-1][:batch_size])


def plan_ways(kind, cfg, atoms: int, edges: int, triplets: int, device_bytes: int, dtype_bytes: int = 4,
              max_ways: int = 64, overhead: int = 0, counts=None) -> list[dict]:
    """Memory per worker (the kind's estimate, plus ``overhead`` bytes per process) and bytes per step
    for P = 1, 2, 4, ...; ``fits`` against ``device_bytes``. ``counts(P)``: the kind-specific sizes of
    a batch at P ways (``AtomicModelKind.batch_counts``), else the kind's defaults."""
    rows, p = [], 1
    params = kind.count_parameters(cfg)
    while p <= max_ways and p <= edges:
        mem = kind.memory_per_worker(cfg, atoms, edges, triplets, p, dtype_bytes, **(counts(p) if counts else {}))
        total = mem["total"] + overhead
        rows.append({"ways": p, "memory_per_worker": total, "memory": mem,
                     "bytes_per_step": kind.step_bytes(cfg, [edges], [atoms], [1], p, dtype_bytes, params),
                     "fits": total <= device_bytes})
        p *= 2
    return rows


def batch_plan(kind, model_cfg, b: dict, device_bytes: int, dtype_bytes: int, overhead: int = 0,
               max_ways: int = 64) -> list[dict]:
    """``plan_ways`` on batch ``b`` (``data.batch_arrays``): its sizes, and its kind-specific counts; each
    row with P > 1 also prices every layout on the same batch (``atom_layouts.layout_costs``: ``"layouts"``)
    and names the layout to use (``"layout"``: fewer bytes among those that fit, ``atom_layouts.choose_layout``)."""
    counts = (lambda p: kind.batch_counts(b, p)) if kind.batch_counts else None
    rows = plan_ways(kind, model_cfg, len(b["z"]), len(b["edge_src"]), len(b["idx_kj"]), device_bytes, dtype_bytes,
                     max_ways, overhead, counts)
    for r in rows:
        r["layout"], r["layouts"] = EDGES.name, None
        if 1 < r["ways"] <= len(b["z"]):
            try:
                r["layouts"] = layout_costs(kind, model_cfg, b, r["ways"], dtype_bytes)
            except GnnPipeError:  # METIS could not give every way an atom: the edges layout only
                continue
            r["layout"] = choose_layout(r["layouts"], device_bytes - overhead).name
    return rows


@dataclass
class RunPlan:
    """``plan_ways`` for one run's model on its largest step batch, against a memory cap per worker."""

    kind: object  # protocol.AtomicModelKind
    model_cfg: object
    arrays: dict  # the largest step batch (data.batch_arrays)
    ways: int  # the run's P
    cap: int  # bytes per worker
    overhead: int  # bytes of a worker process before its model (counted in each row)
    rows: list
    layout: AtomLayout  # the run's atom_layout: which layout's memory the run needs
    dtype_bytes: int = 4

    @property
    def batch(self) -> tuple[int, int, int]:
        """Atoms, edges and triplets of the largest step batch."""
        b = self.arrays
        return len(b["z"]), len(b["edge_src"]), len(b["idx_kj"])

    def need(self, ways: int) -> int:
        """Bytes per worker at ``ways`` ways (any P, not only the rows' powers of two), in the run's layout."""
        return self.layout.costs(self.kind, self.model_cfg, self.arrays, ways, self.dtype_bytes)["memory"] \
            + self.overhead

    @property
    def fits(self) -> bool:
        return self.need(self.ways) <= self.cap

    def smallest(self) -> Optional[int]:
        def fits(r):  # a row without "layouts" (P = 1, or no METIS parts) has the edges layout's only
            layouts = r.get("layouts") or {}
            if self.layout.name in layouts:
                return layouts[self.layout.name]["memory"] + self.overhead <= self.cap
            if r["ways"] > 1 and self.layout.distributed_build:  # domains: a system has fewer atoms than P
                return False
            return r["fits"]
        return next((r["ways"] for r in self.rows if fits(r)), None)

    def answer(self, run_id: str, cap_name: str) -> str:
        """The plan's one line on the run's P: it fits, or by how much it does not and which P would."""
        gib, need = 2**30, self.need(self.ways)
        need = (f"{self.kind.name} ({self.kind.count_parameters(self.model_cfg):,} parameters) needs about "
                f"{need / gib:.2f} GiB per worker at P = {self.ways}"
                f"{self.layout.in_words if self.ways > 1 else ''} (gnnpipe plan-atomic: "
                f"{(need - self.overhead) / gib:.2f} GiB for a step on the largest batch, "
                f"{self.batch[0]} atoms / {self.batch[1]} edges / {self.batch[2]} triplets, + "
                f"{self.overhead / gib:.2f} GiB of process)")
        if self.fits:
            return f"run {run_id}: {need}, within the cap of {self.cap / gib:.2f} GiB per worker ({cap_name})"
        p = self.smallest()
        advice = (f"the smallest P that fits is {p} (workers: {p} × data_parallel)" if p else
                  "no P up to the batch's edges fits: use a smaller model or batch")
        return (f"run {run_id}: {need}, above the cap of {self.cap / gib:.2f} GiB per worker ({cap_name}); "
                f"{advice}, or raise the cap if the workers have more memory")


def plan_run(cfg, cap_bytes: int, overhead: int = 0, max_ways: int = 64) -> RunPlan:
    """The plan of an atomic run (its ``run.yaml``): its model on its graphs' largest step batch, in its layout."""
    from .data import batch_arrays

    init = load_init(cfg)
    systems, graphs = run_data(cfg, init)
    kind, dtype_bytes = ATOMIC_MODELS[cfg.model.kind], DTYPES[cfg.training.dtype].itemsize
    model_cfg = model_config(cfg.model, float(graphs["cutoff"]), init)
    b = batch_arrays(systems, graphs, largest_batch(systems, graphs, cfg.model.spec.batch_size))
    rows = batch_plan(kind, model_cfg, b, cap_bytes, dtype_bytes, overhead, max_ways)
    layout = TRAIN_LAYOUTS[cfg.atom_layout]
    if layout.distributed_build:  # domains: not among the layouts a row chooses between; its costs beside them
        for r in rows:
            if r["ways"] > 1:
                try:
                    r["layouts"] = {**(r["layouts"] or {}), layout.name: layout.costs(kind, model_cfg, b, r["ways"],
                                                                                      dtype_bytes)}
                except GnnPipeError:  # a system of fewer atoms than ways: no domain for every way
                    continue
    return RunPlan(kind, model_cfg, b, cfg.ways, cap_bytes, overhead, rows, layout, dtype_bytes)
