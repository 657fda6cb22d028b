"""Exact full-graph inference: the accuracy every mode is judged by.

Training in the pipeline mode reads stale embeddings; evaluation never does. This
module runs the whole model on the whole graph in one process, from a checkpoint, so
that ``evaluate`` gives the same numbers whichever mode trained the weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from pathlib import Path

import torch
from torch import Tensor

from .config import RunConfig, flatten, to_dict
from .engine import DTYPES, ce_sum, correct_counts
from .graph import Graph, read_graph, read_graph_attrs
from .io import GnnPipeError, write_json
from .models.block import Block
from .models.model import GNN

SPLITS = ("train", "val", "test")


def graph_tensors(graph: Graph, dtype: torch.dtype, device) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Features, labels and split masks of ``graph`` as tensors on ``device``."""
    x = torch.as_tensor(graph.features).to(device, dtype)
    y = torch.as_tensor(graph.labels).to(device)
    masks = {s: torch.as_tensor(getattr(graph, f"{s}_mask")).to(device) for s in SPLITS}
    return x, y, masks


@torch.no_grad()
def exact_metrics(model: GNN, block: Block, x: Tensor, y: Tensor, masks: dict[str, Tensor]) -> dict[str, float]:
    """Accuracy per split and the training loss, with dropout off, on one block."""
    was_training = model.training
    model.eval()
    logits = model(x, block)
    model.train(was_training)
    out = {f"{k}_acc": (c / t if t else 0.0) for k, (c, t) in correct_counts(logits, y, masks).items()}
    n_train = int(masks["train"].sum())
    out["loss"] = float(ce_sum(logits, y, masks["train"]) / max(n_train, 1))
    return out


def load_checkpoint(path: str | Path) -> dict:
    """A checkpoint written by the trainer, loaded safely (``weights_only=True``)."""
    from .checkpoint import digest
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise GnnPipeError(f"{path}: no checkpoint; run the 'train' rule for this run first") from None
    except Exception as e:  # unpickling errors, truncated zip
        raise GnnPipeError(f"{path}: not a readable checkpoint ({e}); delete it and re-run 'train'") from None
    want = state.pop("digest", None) if isinstance(state, dict) else None
    if want is not None and want != digest(state):
        raise GnnPipeError(f"{path}: its digest does not match its contents (damaged or edited); delete it "
                           f"and re-run 'train'")
    return state


_PATHS = ("graph_path", "store_path", "out_dir", "systems_path")  # where the run lies, not what it is
# How a run is kept alive and how often its state is saved, not what it computes: left out of
# the fingerprint, so changing them never refuses a checkpoint. Version 1 (gnnpipe before the
# fingerprint named keys) left out only the first two; a version is never changed, only added.
_OPERATIONAL = {1: ("dist_timeout_s", "max_restarts"), 2: ("dist_timeout_s", "max_restarts", "checkpoint_every")}
FINGERPRINT_VERSION = 2


def _fingerprinted(conf: dict, version: int) -> dict:
    """A run config as plain data (``to_dict``), less what fingerprint ``version`` leaves out."""
    conf = {k: v for k, v in conf.items() if k not in _PATHS}
    conf["training"] = {k: v for k, v in conf.get("training", {}).items() if k not in _OPERATIONAL[version]}
    return conf


def _hash(conf: dict) -> str:
    return hashlib.sha256(json.dumps(conf, sort_keys=True).encode()).hexdigest()


def _defaults() -> dict:
    """The flattened defaults of a run config's keys (a key newer than a checkpoint matches it at
    its default: adding a key to the config does not throw users' checkpoints away)."""
    hints, out = typing.get_type_hints(RunConfig), {}
    for f in dataclasses.fields(RunConfig):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(flatten(to_dict(hints[f.name]()), f"{f.name}."))
        elif f.default is not dataclasses.MISSING:
            out[f.name] = f.default
    return out


def _content_hash(path, rule: str) -> str:
    """The ``content_hash`` attribute of an HDF5 file (cheap); an unreadable file is one line
    naming it and the rule that rebuilds it."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            return str(f.attrs.get("content_hash", ""))
    except OSError as e:  # missing, truncated, not HDF5
        raise GnnPipeError(f"{path}: not a readable HDF5 file ({' '.join(str(e).split())[:200]}); delete it "
                           f"and rerun the workflow (rule {rule} rebuilds it)") from None


def _graph_hash(cfg: RunConfig):
    """The content hash of the run's graph file: graph.h5, or an atomic run's graphs.h5 (which
    records the hash of its systems.h5 in turn)."""
    if not cfg.graph_path:
        return None
    if cfg.atomic:
        return _content_hash(cfg.graph_path, "atom_graphs")
    return str(read_graph_attrs(cfg.graph_path)["content_hash"])


def run_fingerprint(cfg: RunConfig) -> dict:
    """What a checkpoint must have been trained from: the config less its paths and operational
    keys (key by key, and hashed), and the content hashes of the graph and (parallel modes) the
    chunk store, read from their attributes (cheap). Every checkpoint carries it;
    ``fingerprint_mismatch`` compares."""
    conf = _fingerprinted(to_dict(cfg), FINGERPRINT_VERSION)
    fp = {"fingerprint_version": FINGERPRINT_VERSION, "fingerprint_config": conf, "config_hash": _hash(conf),
          "graph_hash": _graph_hash(cfg), "store_hash": None}
    if cfg.store_path and Path(cfg.store_path).exists():
        fp["store_hash"] = _content_hash(cfg.store_path, "materialize")
    return fp


def config_differences(stored: dict, cfg: RunConfig) -> list[str]:
    """The keys of a stored run config (``to_dict`` form, as a checkpoint keeps it) that differ from
    ``cfg`` now, as ``key old -> new``; paths and operational keys do not count, nor a key newer
    than the checkpoint that has its default."""
    old = flatten(_fingerprinted(stored, FINGERPRINT_VERSION))
    now = flatten(_fingerprinted(to_dict(cfg), FINGERPRINT_VERSION))
    defaults = _defaults()
    out = []
    for key in sorted(set(old) | set(now)):
        if key not in old:
            if key not in defaults or now[key] != defaults[key]:
                out.append(f"{key} (new) {now[key]!r}")
        elif key not in now:
            out.append(f"{key} {old[key]!r} -> (no such key now)")
        elif old[key] != now[key]:
            out.append(f"{key} {old[key]!r} -> {now[key]!r}")
    return out


def fingerprint_mismatch(stored: dict, cfg: RunConfig, now: dict | None = None) -> str | None:
    """Why a checkpoint (its fingerprint fields, ``stored``) is not of run ``cfg`` as it is now:
    ``"another config: training.lr 0.02 -> 0.05"``, another graph or chunk store; None: it is.
    A checkpoint of gnnpipe before fingerprint v2 carries its config whole (``model.pt``:
    compared key by key) or only its v1 hash (a resume manifest: equal, or a refusal that says so)."""
    now = now or run_fingerprint(cfg)
    conf = stored.get("fingerprint_config", stored.get("config"))
    if isinstance(conf, dict):
        diff = config_differences(conf, cfg)
        if diff:
            return f"another config: {'; '.join(diff[:4])}{f' and {len(diff) - 4} more' if len(diff) > 4 else ''}"
    elif stored.get("config_hash") != _hash(_fingerprinted(to_dict(cfg), 1)):
        return (f"another config, or one of gnnpipe before fingerprint v2, which cannot name the keys that "
                f"differ (config_hash {str(stored.get('config_hash'))[:12]})")
    for key, what in (("graph_hash", "graph"), ("store_hash", "chunk store")):
        if stored.get(key) and now[key] and stored[key] != now[key]:
            return f"another {what} ({key} {stored[key][:12]}, the run's is now {now[key][:12]})"
    return None


def check_checkpoint(state: dict, cfg: RunConfig, path: Path, *, final: bool = True) -> None:
    """Refuse a checkpoint that is not this run's finished model (``final``) or was trained
    from another config, graph or chunk store than ``cfg`` names now."""
    redo = f"re-run 'train' for {cfg.run_id} (delete {path}, or snakemake --forcerun train)"
    if "config_hash" not in state:
        raise GnnPipeError(f"{path}: the checkpoint does not say which config and data it was trained "
                           f"from (an older gnnpipe wrote it); {redo}")
    done = int(state.get("epochs_done", -1))
    if final and done != cfg.training.epochs:
        raise GnnPipeError(f"{path}: checkpoint after {done} of {cfg.training.epochs} epochs, not the "
                           f"finished run (training was cut short?); {redo}")
    why = fingerprint_mismatch(state, cfg)
    if why:
        raise GnnPipeError(f"{path}: trained from {why} (run {cfg.run_id} as it is now); {redo}")


def evaluate_run(cfg: RunConfig, checkpoint: str | Path | None = None, out: str | Path | None = None,
                 *, allow_partial: bool = False, predictions: str | Path | None = None) -> dict:
    """Exact inference of a trained run on its graph; writes ``eval.json`` and logs to MLflow.

    The checkpoint must be the run's finished model (``allow_partial``: any epoch) and
    have been trained from the run's config, graph and chunk store (``check_checkpoint``).
    Atomic runs also write the test split's per-system predictions (``predictions``, default
    ``<out_dir>/predictions.h5``; ``atomic.predict.write_predictions``).
    """
    checkpoint = Path(checkpoint or Path(cfg.out_dir) / "model.pt")
    out = Path(out or Path(cfg.out_dir) / "eval.json")
    dtype = DTYPES[cfg.training.dtype]
    state = load_checkpoint(checkpoint)
    check_checkpoint(state, cfg, checkpoint, final=not allow_partial)
    if cfg.atomic:
        from .atomic.predict import PREDICTIONS_FILE
        predictions = Path(predictions or Path(cfg.out_dir) / PREDICTIONS_FILE)
        result = _atomic_metrics(cfg, state, checkpoint, predictions)
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


def _atomic_metrics(cfg: RunConfig, state: dict, checkpoint: Path, predictions: Path) -> dict:
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
