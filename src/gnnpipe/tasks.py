"""What a run trains: one :class:`Task` per kind of run, chosen once (:func:`task_for`).

The trainer (``train.py``) and ``evaluate`` drive any run through its task and its engine
(``engine.Engine``) and never ask which kind of run it is. A task owns:

* building its engine (``build_engine(cfg, groups, comm, device)``: the one constructor order of
  every engine), and what the process sets up first (``prepare``);
* its loss and metrics: what ``EpochStats.loss`` is (``loss``, computed by its engine), the metrics
  at the top of the run record (``metrics``), the one the progress bar shows (``progress_metric``);
* its record fields: what each epoch's row adds (``epoch_fields``), the per-epoch metrics its
  evaluation adds to a row, which MLflow logs beside the trainer's (``epoch_metrics``), what the run
  record says of the model (``record_fields``);
* its per-epoch check (``check_epoch``: the divergence guard of the engine's habits,
  ``gnnpipe.habits``), after the row's evaluation and before it is recorded or checkpointed;
* its final payload: what the finished ``model.pt`` carries beside the weights (``final_payload``:
  an atomic run's model file, ``atomic.modelfile``);
* its ``evaluate``: the metrics of a checkpoint, in one process whatever mode trained it; whether
  the train job runs it on the finished model itself (``evaluates_in_training``: ``eval.json`` comes
  out of training, no process of its own) or leaves it to ``gnnpipe evaluate``.

The tasks are entries of ``kinds.TASKS`` (the one registry mechanism, ``registry.Registry``):
``node_classification`` (a graph dataset: a node model, cross-entropy, accuracies), ``s2ef``
(atomistic systems with forces: energies and forces, OC20's S2EF metrics) and ``energy_only``
(systems without forces, or ``force_weight: 0``: the energy term alone, no force metric).
"""

from __future__ import annotations

import abc
import itertools
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .config import RunConfig
from .engine import DTYPES, SPLITS, exact_metrics, graph_tensors, retain_freed_memory
from .io import GnnPipeError
from .kinds import TASKS


class Task(abc.ABC):
    """A kind of run (the module docstring): every task builds its engine and evaluates a checkpoint;
    the other hooks' defaults are what a task without them does."""

    name: str = ""
    loss: str = ""  # what EpochStats.loss is for this task (docs, the record's "loss")
    metrics: tuple[str, ...] = ()  # the test split's metrics, at the top of the run record
    progress_metric: str = ""  # the evaluation's value the progress bar shows
    epoch_metrics: tuple[str, ...] = ()  # what an evaluation adds to an epoch's row, logged per epoch
    #: the train job scores its finished model (``evaluate``, rank 0) and writes ``eval.json`` itself
    evaluates_in_training: bool = False

    def prepare(self) -> None:
        """Process-wide set-up before anything is allocated."""

    @abc.abstractmethod
    def build_engine(self, cfg: RunConfig, groups, comm, device):
        """The run's engine (``engine.Engine``), in the one constructor order."""

    def epoch_fields(self, engine, epoch: int, rank: int) -> dict:
        """What one epoch's row of the history adds to the trainer's."""
        return {}

    def check_epoch(self, engine, epoch: int, row: dict, where: str) -> None:
        """The per-epoch check on the epoch's row (raises a GnnPipeError to stop the run): the divergence
        guard of the engine's habits (``gnnpipe.habits.Guard``; a node run's is off by default)."""
        engine.habits.check(epoch, row, where)

    def metric_fields(self, last_eval: dict) -> dict:
        return {k: last_eval.get(k) for k in self.metrics}

    def record_fields(self, cfg: RunConfig, engine) -> dict:
        """The run record's description of the model where the config's ``layers``/``hidden`` is not it."""
        return {}

    def final_payload(self, engine, payload: dict) -> None:
        """Add what the finished model file carries beside the weights (rank 0, ``payload["model"]``)."""

    @abc.abstractmethod
    def evaluate(self, cfg: RunConfig, state: dict, checkpoint: Path, *, predictions=None,
                 train_systems=None) -> dict:
        """The metrics of a checkpoint of the run, in one process whatever mode trained it."""

    def __repr__(self) -> str:
        return f"Task({self.name})"


class NodeClassification(Task):
    """A node model on one graph: the layout's engine, cross-entropy, accuracies per split."""

    name = "node_classification"
    loss = "the mean cross-entropy over all training nodes of the whole graph"
    progress_metric = "val_acc"
    epoch_metrics = ("train_acc", "val_acc", "test_acc")
    evaluates_in_training = True  # one full-graph pass: a fraction of the evaluate job's start-up

    def prepare(self) -> None:
        retain_freed_memory()  # the epochs' (N, hidden) tensors reuse their pages (docs/ARCHITECTURE.md)

    def build_engine(self, cfg: RunConfig, groups, comm, device):
        """The one branch on the mode: single, or one S x G x C engine for graph, pipeline, hybrid."""
        if cfg.mode == "single":
            from .parallel.single import SingleEngine as cls
        else:
            from .parallel.layout_engine import LayoutEngine as cls
        return cls(cfg, groups, comm, device)

    def record_fields(self, cfg: RunConfig, engine) -> dict:
        """A parallel run's partition: its chunk store's parts (graph: one a worker; pipeline,
        hybrid: the chunks), what they were balanced in (``partitioning``), their nodes and
        in-edges and the balance of each (max part / mean: ``gnnpipe.partition.part_balance``)."""
        if cfg.store_path is None:
            return {}
        from .partition import balance_name, part_balance
        from .store import ChunkStore

        with ChunkStore(cfg.store_path) as store:
            offsets = store.offsets
            edges = np.add.reduceat(store.deg_in(), offsets[:-1])  # parts are never empty
        pt = cfg.partitioning
        return {"partition": {"method": pt.method, "balance": balance_name(pt.method, pt.balance_nodes, pt.balance_edges),
                              "parts": len(offsets) - 1, **part_balance(np.diff(offsets), edges)}}

    def evaluate(self, cfg: RunConfig, state: dict, checkpoint: Path, *, predictions=None,
                 train_systems=None) -> dict:
        """Exact full-graph inference in one process: accuracy per split and the training loss."""
        from .graph import read_graph
        from .models.block import Block
        from .models.model import GNN

        dtype = DTYPES[cfg.training.dtype]
        graph = read_graph(cfg.graph_path)
        model = GNN(cfg.model, graph.num_features, graph.num_classes).to(dtype)
        try:
            model.load_state_dict(state["model"])
        except (RuntimeError, KeyError) as e:
            raise GnnPipeError(f"{checkpoint}: does not fit model {cfg.model.kind} "
                               f"(layers {cfg.model.layers}, hidden {cfg.model.hidden}): {e}") from None
        x, y, masks = graph_tensors(graph, dtype, "cpu")
        return exact_metrics(model, Block.full(graph.indptr, graph.indices, dtype), x, y, masks)


class S2EF(Task):
    """Atomistic structures to energies and forces (OC20's S2EF): ``atomic.atomic_engine.AtomicEngine``."""

    name = "s2ef"
    loss = ("the mean over the epoch's optimizer steps of the normalised energy and force loss "
            "(atomic.atomic_engine.step_loss)")
    metrics = ("energy_mae", "force_mae", "force_cos", "efwt")
    progress_metric = "val_energy_mae"
    epoch_metrics = tuple(f"{s}_{m}" for s, m in itertools.product(SPLITS, metrics))  # OC20 S2EF, per split
    energy_only = False

    def build_engine(self, cfg: RunConfig, groups, comm, device):
        from .atomic.atomic_engine import AtomicEngine
        engine = AtomicEngine(cfg, groups, comm, device)
        if bool(engine.energy_only) != self.energy_only:  # the same rule on the same file: never
            raise GnnPipeError(f"run {cfg.run_id}: task {self.name} but the engine says energy-only "
                               f"{engine.energy_only!r}")
        return engine

    def epoch_fields(self, engine, epoch: int, rank: int) -> dict:
        """Its own batches' closed form beside its ledger (each epoch draws other batches), rank 0."""
        return {"comm_bytes_predicted": int(engine.predicted_bytes(epoch))} if rank == 0 else {}

    def record_fields(self, cfg: RunConfig, engine) -> dict:
        """Interaction blocks and their width (the kind says which); the edge split's ways."""
        return {"layers": engine.model_cfg.num_blocks, "hidden": getattr(engine.model_cfg, engine.kind.width),
                "parts": cfg.ways}

    def final_payload(self, engine, payload: dict) -> None:
        """The inference payload (normaliser, cutoff, elements, ...): ``GNNPipeCalculator.from_run``
        needs nothing else; its weights are the checkpoint's (torch.save stores them once)."""
        from .atomic.modelfile import PAYLOAD_KEY, payload_from_engine
        fingerprint = {k: payload[k] for k in ("config_hash", "graph_hash", "store_hash") if k in payload}
        payload[PAYLOAD_KEY] = payload_from_engine(engine, fingerprint, state_dict=payload["model"])
        payload[PAYLOAD_KEY]["state_dict"] = payload["model"]

    def evaluate(self, cfg: RunConfig, state: dict, checkpoint: Path, *, predictions=None,
                 train_systems=None) -> dict:
        """S2EF metrics of the checkpoint in one process, and the test split's per-system predictions
        (``predictions``, default ``<out_dir>/predictions.h5``) by the model file it carries (a
        checkpoint without one, e.g. a partial one: the engine's model, as ``upgrade_run`` builds it)."""
        import dataclasses

        from .atomic.inference import Predictor
        from .atomic.modelfile import PAYLOAD_KEY, decode, payload_from_engine
        from .atomic.predict import PREDICTIONS_FILE, split_predictions, write_predictions

        predictions = Path(predictions or Path(cfg.out_dir) / PREDICTIONS_FILE)
        one = dataclasses.replace(cfg, mode="single", workers=1, ways=1, data_parallel=1)
        engine = self.build_engine(one, None, None, torch.device("cpu"))
        if train_systems is not None:
            engine.eval_train_systems = None if train_systems == "all" else int(train_systems)
        try:
            engine.model.load_state_dict(state["model"])
        except (RuntimeError, KeyError) as e:
            raise GnnPipeError(f"{checkpoint}: does not fit the run's {engine.kind.name} ({engine.model_cfg}): "
                               f"{' '.join(str(e).split())[:300]}") from None
        result = {k: v for k, v in {**engine.evaluate(), **engine.baselines()}.items() if v is not None}
        payload = state[PAYLOAD_KEY] if PAYLOAD_KEY in state else payload_from_engine(engine)
        preds = split_predictions(Predictor(decode(payload, str(checkpoint))), engine.systems, engine.graphs,
                                  engine.ids["test"], batch_size=engine.batch_size)
        write_predictions(predictions, preds, split="test", run_id=cfg.run_id, dtype=cfg.training.dtype)
        return result


class EnergyOnly(S2EF):
    """S2EF without forces (data of energies alone, or ``force_weight: 0``): the engine runs no force
    pass; the force metrics keep their names in the record, None."""

    name = "energy_only"
    loss = "the mean over the epoch's optimizer steps of the normalised energy loss (atomic.atomic_engine.step_loss)"
    energy_only = True


NODE_CLASSIFICATION, S2EF_TASK, ENERGY_ONLY = NodeClassification(), S2EF(), EnergyOnly()


def task_for(cfg: RunConfig) -> Task:
    """The run's task, decided once: its dataset's kind (a graph: node classification; atoms: S2EF) and,
    for atoms, whether it fits forces (``atomic.atomic_engine.energy_only``, on the systems' forces alone)."""
    if not cfg.atomic:
        return TASKS["node_classification"]
    from .atomic.data import read_forces
    from .atomic.atomic_engine import energy_only

    forces = read_forces(cfg.systems_path)  # None where unreadable: the engine's read says why
    if forces is None:
        return TASKS["s2ef"]
    return TASKS["energy_only" if energy_only({"forces": forces}, cfg.model.spec.force_weight) else "s2ef"]
