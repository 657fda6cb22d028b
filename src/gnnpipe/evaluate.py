"""Exact inference of a trained run from its checkpoint: the metrics every mode is judged by.

Training in the pipeline mode reads stale embeddings; evaluation never does. The run's task
(``tasks.task_for``) scores the checkpoint in one process (node classification: the whole model
on the whole graph; S2EF and energy-only: every split's systems, and the test split's predictions),
so that ``evaluate`` gives the same numbers whichever mode trained the weights. A node run's
train job makes the same pass itself after training (``score``, from ``train.evaluate_finished``:
#36); ``gnnpipe evaluate`` re-scores a model file, with every check.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Optional

from .checkpoint import check_checkpoint, load_checkpoint
from .config import RunConfig
from .io import write_json
from .tasks import Task, task_for


def evaluate_run(cfg: RunConfig, checkpoint: str | Path | None = None, out: str | Path | None = None,
                 *, allow_partial: bool = False, predictions: str | Path | None = None,
                 train_systems: int | str | None = None) -> dict:
    """Exact inference of a trained run on its data; writes ``eval.json`` and logs to MLflow.

    The checkpoint must be the run's finished model (``allow_partial``: any epoch) and
    have been trained from the run's config, graph and chunk store (``check_checkpoint``).
    Atomic runs also write the test split's per-system predictions (``predictions``, default
    ``<out_dir>/predictions.h5``; ``atomic.predict.write_predictions``), and score of the training
    split a seeded sample of the model's ``eval_train_systems`` systems, or ``train_systems`` (a
    number, or ``"all"``); ``eval.json`` says how many (``train_systems_scored`` of ``train_systems``).
    """
    checkpoint = Path(checkpoint or Path(cfg.out_dir) / "model.pt")
    out = Path(out or Path(cfg.out_dir) / "eval.json")
    mlflow_id = _mlflow_run_id(cfg)
    imports = _import_tracking() if mlflow_id else None
    state = load_checkpoint(checkpoint)
    check_checkpoint(state, cfg, checkpoint, final=not allow_partial)
    result = score(cfg, state, checkpoint, out, predictions=predictions, train_systems=train_systems)
    if mlflow_id:
        imports.join()
        from .tracking import log_evaluation
        log_evaluation(cfg, mlflow_id, result, out)
    return result


def score(cfg: RunConfig, state: dict, checkpoint: str | Path, out: str | Path, *, task: Optional[Task] = None,
          predictions: str | Path | None = None, train_systems: int | str | None = None) -> dict:
    """The run's task scores the model ``state`` (a checkpoint's fields: ``model``, ``epoch`` and what
    its task's payload adds) and ``eval.json`` is written (atomically) to ``out``: what ``evaluate_run``
    does after its checks, and the train job after training with the model it holds (``train.py``;
    ``checkpoint``: the file the state is, or will be, named by in messages)."""
    result = (task or task_for(cfg)).evaluate(cfg, state, Path(checkpoint), predictions=predictions,
                                              train_systems=train_systems)
    result = {"run_id": cfg.run_id, "checkpoint_epoch": int(state.get("epoch", -1)), **result}
    write_json(out, result)
    return result


def _mlflow_run_id(cfg: RunConfig) -> Optional[str]:
    """The MLflow run the training logged to (its ``metrics.json``), if any."""
    metrics_path = Path(cfg.out_dir) / "metrics.json"
    return json.loads(metrics_path.read_text()).get("mlflow_run_id") if metrics_path.exists() else None


def _import_tracking() -> threading.Thread:
    """MLflow's client and SQL store imported on a thread, while the checkpoint loads and the
    inference runs (which release the GIL): the imports (sqlalchemy, alembic) took longer than
    the inference of a 10^5-node graph, and were paid after it. An import that fails here is
    left to the logging, which reports it."""
    def run():
        try:
            import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
            import mlflow.tracking  # noqa: F401
        except Exception:  # noqa: BLE001 (the logging names it)
            pass

    thread = threading.Thread(target=run, name="import-mlflow", daemon=True)
    thread.start()
    return thread
