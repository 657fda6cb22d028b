"""Exact full-graph inference: the accuracy every mode is judged by.

Training in the pipeline mode reads stale embeddings; evaluation never does. This
module runs the whole model on the whole graph in one process, from a checkpoint, so
that ``evaluate`` gives the same numbers whichever mode trained the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .checkpoint import check_checkpoint, load_checkpoint
from .config import RunConfig
from .engine import DTYPES, exact_metrics, graph_tensors
from .graph import read_graph
from .io import GnnPipeError, write_json
from .models.block import Block
from .models.model import GNN


def evaluate_run(cfg: RunConfig, checkpoint: str | Path | None = None, out: str | Path | None = None,
                 *, allow_partial: bool = False, predictions: str | Path | None = None,
                 train_systems: int | str | None = None) -> dict:
    """Exact inference of a trained run on its graph; writes ``eval.json`` and logs to MLflow.

    The checkpoint must be the run's finished model (``allow_partial``: any epoch) and
    have been trained from the run's config, graph and chunk store (``check_checkpoint``).
    Atomic runs also write the test split's per-system predictions (``predictions``, default
    ``<out_dir>/predictions.h5``; ``atomic.predict.write_predictions``), and score of the training
    split a seeded sample of the model's ``eval_train_systems`` systems, or ``train_systems`` (a
    number, or ``"all"``); ``eval.json`` says how many (``train_systems_scored`` of ``train_systems``).
    """
    checkpoint = Path(checkpoint or Path(cfg.out_dir) / "model.pt")
    out = Path(out or Path(cfg.out_dir) / "eval.json")
    dtype = DTYPES[cfg.training.dtype]
    state = load_checkpoint(checkpoint)
    check_checkpoint(state, cfg, checkpoint, final=not allow_partial)
    if cfg.atomic:
        from .atomic.predict import PREDICTIONS_FILE
        predictions = Path(predictions or Path(cfg.out_dir) / PREDICTIONS_FILE)
        result = _atomic_metrics(cfg, state, checkpoint, predictions, train_systems)
        return _finish(cfg, {"run_id": cfg.run_id, "checkpoint_epoch": int(state.get("epoch", -1)), **result}, out)
    graph = read_graph(cfg.graph_path)
    model = GNN(cfg.model, graph.num_features, graph.num_classes).to(dtype)
    try:
        model.load_state_dict(state["model"])
    except (RuntimeError, KeyError) as e:
        raise GnnPipeError(f"{checkpoint}: does not fit model {cfg.model.kind} "
                           f"(layers {cfg.model.layers}, hidden {cfg.model.hidden}): {e}") from None
    x, y, masks = graph_tensors(graph, dtype, "cpu")
    result = exact_metrics(model, Block.full(graph.indptr, graph.indices, dtype), x, y, masks)
    result = {"run_id": cfg.run_id, "checkpoint_epoch": int(state.get("epoch", -1)), **result}
    return _finish(cfg, result, out)


def _atomic_metrics(cfg: RunConfig, state: dict, checkpoint: Path, predictions: Path,
                    train_systems: int | str | None = None) -> dict:
    """S2EF metrics of an atomic run's checkpoint, in one process whatever mode trained it, and
    the test split's per-system predictions (``predictions.h5``) by the model file it carries
    (a checkpoint without one, e.g. a partial one: the engine's model, as ``upgrade_run`` builds it)."""
    import dataclasses

    from .atomic.engine import AtomicEngine
    from .atomic.inference import Predictor
    from .atomic.modelfile import PAYLOAD_KEY, decode, payload_from_engine
    from .atomic.predict import split_predictions, write_predictions
    one = dataclasses.replace(cfg, mode="single", workers=1, ways=1, data_parallel=1)
    engine = AtomicEngine(one, None, torch.device("cpu"))
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


def _finish(cfg: RunConfig, result: dict, out: Path) -> dict:
    write_json(out, result)
    metrics_path = Path(cfg.out_dir) / "metrics.json"
    mlflow_id = json.loads(metrics_path.read_text()).get("mlflow_run_id") if metrics_path.exists() else None
    if mlflow_id:
        from .tracking import log_evaluation
        log_evaluation(cfg, mlflow_id, result, out)
    return result
