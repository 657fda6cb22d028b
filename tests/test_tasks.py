"""The tasks (``gnnpipe.tasks``, registry ``kinds.TASKS``): which task a run gets, that the trainer and
``evaluate`` have no branch on the kind of run, and the engines' one constructor order."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import run_cfg
from test_faults import setup_atomic_run

SRC = Path(__file__).resolve().parents[1] / "src" / "gnnpipe"


def test_the_tasks_are_a_registry_of_the_one_mechanism():
    from gnnpipe.kinds import TASKS
    from gnnpipe.registry import Registry
    from gnnpipe.tasks import ENERGY_ONLY, NODE_CLASSIFICATION, S2EF_TASK

    assert isinstance(TASKS, Registry)
    assert TASKS.names() == ("node_classification", "s2ef", "energy_only")
    assert [TASKS[n] for n in TASKS] == [NODE_CLASSIFICATION, S2EF_TASK, ENERGY_ONLY]
    assert all(TASKS[n].name == n and TASKS[n].loss for n in TASKS)


def test_a_graph_dataset_is_node_classification(tmp_path):
    from gnnpipe.tasks import task_for

    cfg = run_cfg(tmp_path, {"kind": "gcn", "layers": 2, "hidden": 8}, epochs=1)
    task = task_for(cfg)
    assert task.name == "node_classification" and task.metrics == () and task.progress_metric == "val_acc"


@pytest.mark.parametrize("forces,spec,name", [(True, {}, "s2ef"), (False, {}, "energy_only"),
                                               (True, {"force_weight": 0}, "energy_only")])
def test_atoms_are_s2ef_or_energy_only_as_the_engine_decides(tmp_path, forces, spec, name):
    """``task_for`` reads the systems' forces alone and applies the engine's rule; the engine agrees."""
    from gnnpipe.atomic import data
    from gnnpipe.tasks import task_for

    cfg = setup_atomic_run(tmp_path, "single", 1, epochs=1, dtype="float64", spec=spec)
    if not forces:
        systems = data.read_systems(cfg.systems_path)
        systems["forces"][:] = np.nan
        data.write_systems(cfg.systems_path, systems)
    task = task_for(cfg)
    assert task.name == name and task.metrics == ("energy_mae", "force_mae", "force_cos", "efwt")
    if forces:  # the graphs' file still matches these systems: build the engine
        engine = task.build_engine(cfg, None, None, torch.device("cpu"))
        assert bool(engine.energy_only) == (name == "energy_only")


def _branches_on_the_kind(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [f"{path.name}:{n.lineno}: {ast.unparse(n)}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and (n.attr == "atomic" or isinstance(n.value, ast.Name) and n.value.id == "engine"
                 and n.attr in ("opt", "check_epoch", "model_cfg", "kind"))]


def test_the_trainer_and_evaluate_have_no_branch_on_the_kind_of_run():
    """No ``cfg.atomic`` in train.py or evaluate.py, and the trainer reaches no engine attribute outside
    the protocol (``opt``, ``check_epoch``, ``model_cfg``, ``kind``)."""
    assert _branches_on_the_kind(SRC / "train.py") == []
    assert _branches_on_the_kind(SRC / "evaluate.py") == []


def test_every_engine_has_the_one_constructor_order():
    from gnnpipe.atomic.atomic_engine import AtomicEngine
    from gnnpipe.parallel.layout_engine import LayoutEngine
    from gnnpipe.parallel.single import SingleEngine

    for cls in (SingleEngine, LayoutEngine, AtomicEngine):
        assert list(inspect.signature(cls).parameters) == ["cfg", "groups", "comm", "device"], cls


def test_the_single_engine_refuses_groups(tmp_path):
    from gnnpipe.parallel.single import SingleEngine

    cfg = run_cfg(tmp_path, {"kind": "gcn", "layers": 2, "hidden": 8}, epochs=1)
    with pytest.raises(ValueError, match="one process"):
        SingleEngine(cfg, object(), None, torch.device("cpu"))
