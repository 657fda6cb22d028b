"""The cost model's prediction beside every run: :class:`Predictor` predicts a run from its
``run.yaml``, its graph's partition statistics and a hardware profile (calibrated to the
run's model when the workflow fitted one) with :func:`gnnpipe.planning.predict.predict_layout`;
a run it cannot predict gets an unavailable :class:`Prediction` with the reason.

The prediction builds each run's model (torch: ~2 s of imports). The workflow makes them in a job
of its own (rule ``cost_predictions``, ``gnnpipe predict-costs``: :func:`write_predictions`, a
JSON file), and the report reads that file (:class:`PredictionsFile`, the same interface as a
:class:`Predictor`), so ``gnnpipe report`` only reads files and draws (#36: ≤ 10 s for ten runs)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ..config import ConfigError, load_run_config, to_dict
from ..costmodel.bytes import first_input
from ..costmodel.hardware import Hardware, load_hardware
from ..graph import read_graph_attrs
from ..io import GnnPipeError
from ..planning.calibrate import find_calibration
from ..planning.predict import predict_layout
from ..planning.shape import build_model, model_shape
from ..planning.stats import cached_graph_stats

if TYPE_CHECKING:
    from .records import Run

DEFAULT_HARDWARE = "cpu-2core"


@dataclass
class Prediction:
    """The cost model's bytes per epoch and epoch time of one run, or why there is none."""

    bytes: Optional[float] = None
    epoch_s: Optional[float] = None
    compute_s: Optional[float] = None  # the epoch's split, as the run record's
    comm_s: Optional[float] = None
    bubble_s: Optional[float] = None
    peak_mem_bytes: Optional[float] = None  # per worker, the largest
    reason: Optional[str] = None  # set when the prediction is unavailable

    @property
    def available(self) -> bool:
        return self.reason is None


def rel_error(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    """(predicted - measured) ÷ measured; None when undefined (a value missing, 0 vs 0)."""
    if predicted is None or measured is None or (predicted == 0 and measured == 0):
        return None
    return math.inf if measured == 0 else (predicted - measured) / measured


class Predictor:
    """Predicts runs with :func:`gnnpipe.planning.predict.predict_layout` on one hardware profile.

    Per run: its ``run.yaml`` (graph path, model, partitioning, pipeline and graph-parallel
    settings), the graph's partition statistics from :func:`gnnpipe.planning.stats.cached_graph_stats`
    (computed once and cached next to the graph file), the built model's shape. Any
    failure becomes an unavailable :class:`Prediction` with the reason.
    """

    def __init__(self, hardware=DEFAULT_HARDWARE, cost_model_dir=None):
        self.cost_model_dir = Path(cost_model_dir) if cost_model_dir is not None else None
        self.calibrated: set[str] = set()  # names of the calibrated profiles used
        self.hardware, self.error = None, None
        if isinstance(hardware, Hardware):
            self.hardware = hardware
        else:
            try:
                self.hardware = load_hardware(hardware)
            except (GnnPipeError, OSError) as e:
                self.error = f"hardware profile: {e}"
        self.name = self.hardware.name if self.hardware is not None else str(hardware)
        self._models: dict = {}
        self._fitted: dict = {}  # (dataset, model, dtype, graph path) -> calibrated profile or None

    def __call__(self, run: Run) -> Prediction:
        if self.error is not None:
            return Prediction(reason=self.error)
        if (run.record.get("extra") or {}).get("atomic"):
            return Prediction(reason="an atomic run: the node cost model does not apply (gnnpipe plan-atomic sizes it)")
        try:
            return self._predict(run)
        except GnnPipeError as e:
            return Prediction(reason=str(e))
        except (OSError, KeyError, ValueError, TypeError) as e:  # unreadable files, odd records
            return Prediction(reason=f"{type(e).__name__}: {e}")

    def _fitted_profile(self, where: Path, cfg):
        """The profile in ``where`` calibrated to the run's model, dtype and graph content (None:
        none); looked up once per (dataset, model, dtype, graph), not once per run."""
        key = (str(where), repr(to_dict(cfg.model)), cfg.training.dtype, str(cfg.graph_path))
        if key not in self._fitted:
            digest = str(read_graph_attrs(cfg.graph_path)["content_hash"])
            self._fitted[key] = (find_calibration(where, cfg.model, digest, cfg.training.dtype)
                                 if where.is_dir() else None)
        return self._fitted[key]

    def _predict(self, run: Run) -> Prediction:
        if not run.config_path.exists():
            return Prediction(reason=f"{run.config_path}: no run.yaml (run the 'run_config' rule)")
        cfg = run.run_config  # loaded once per run for the report's tables too
        if cfg is None:
            try:  # for the reason
                cfg = load_run_config(run.config_path)
            except ConfigError as e:
                return Prediction(reason=f"run.yaml: {e}")
        if not Path(cfg.graph_path).exists():
            return Prediction(reason=f"{cfg.graph_path}: no graph file")
        r = run.record
        mode, S, G, C = r["mode"], int(r["stages"]), int(r["ways"]), int(r["chunks"])
        if mode == "graph":
            S, G, C = 1, int(r["world_size"]), int(r["world_size"])
        parts = sorted({k for k in (G, C) if k > 1})
        pt = cfg.partitioning
        hw, cache = self.hardware, None
        if self.cost_model_dir is not None:
            where = self.cost_model_dir / cfg.dataset_name
            cache = where / "plan-stats.json"
            fitted = self._fitted_profile(where, cfg)
            if fitted is not None:
                hw = fitted
                self.calibrated.add(fitted.name)
        stats = cached_graph_stats(cfg.graph_path, parts, method=pt.method, seed=pt.seed,
                                   balance_edges=pt.balance_edges, balance_nodes=pt.balance_nodes, cache_file=cache)
        key = (repr(to_dict(cfg.model)), int(stats["num_features"]), int(stats["num_classes"]))
        if key not in self._models:
            gnn = build_model(cfg.model, key[1], key[2])
            self._models[key] = (gnn, model_shape(gnn))
        gnn, shape = self._models[key]
        est = predict_layout(stats, gnn, shape, hw, mode, S, G, C,
                             dtype_bytes=int(r.get("dtype_bytes", 4)), overlap=cfg.graph_parallel.overlap,
                             balance=cfg.pipeline.balance,
                             first_input=first_input(gnn, cfg.graph_parallel),
                             pipeline_cfg=cfg.pipeline)
        return Prediction(bytes=float(est.bytes["total"]), epoch_s=float(est.epoch_s),
                          compute_s=float(est.compute_s), comm_s=float(est.comm_s),
                          bubble_s=float(est.bubble_s), peak_mem_bytes=float(est.peak_mem_bytes))


#: ``kind`` of the file :func:`write_predictions` writes (``format_version`` 1)
PREDICTIONS_KIND = "gnnpipe_cost_predictions"


def write_predictions(runs: list[Run], out: Path, hardware=DEFAULT_HARDWARE, cost_model_dir=None) -> dict:
    """Predict every run (a :class:`Predictor`) and write ``out`` (atomically): the profile's
    name, the calibrated profiles used and each run's :class:`Prediction` by run id."""
    from ..io import write_json

    predictor = Predictor(hardware, cost_model_dir)
    predicted = {r.run_id: dataclasses.asdict(predictor(r)) for r in runs}
    doc = {"kind": PREDICTIONS_KIND, "format_version": 1, "hardware": predictor.name,
           "calibrated": sorted(predictor.calibrated), "runs": predicted}
    write_json(out, doc)
    return doc


class PredictionsFile:
    """The predictions :func:`write_predictions` wrote, used as the :class:`Predictor` that made
    them (``name``, ``calibrated``, a call per run): no torch. A run the file lacks is unavailable,
    with the reason."""

    def __init__(self, path):
        self.path = Path(path)
        fix = "rerun the cost_predictions rule (gnnpipe predict-costs)"
        try:
            doc = json.loads(self.path.read_text())
        except OSError as e:
            raise GnnPipeError(f"{self.path}: cannot read the cost model's predictions ({e.strerror or e}); "
                               f"{fix}") from None
        except ValueError:
            raise GnnPipeError(f"{self.path}: not JSON; {fix}") from None
        if not isinstance(doc, dict) or doc.get("kind") != PREDICTIONS_KIND or doc.get("format_version") != 1:
            raise GnnPipeError(f"{self.path}: not a predictions file of this gnnpipe (kind {PREDICTIONS_KIND}, "
                               f"format 1); {fix}")
        names = {f.name for f in dataclasses.fields(Prediction)}
        try:
            self.runs = {rid: Prediction(**{k: v for k, v in p.items() if k in names})
                         for rid, p in doc["runs"].items()}
            self.name, self.calibrated = str(doc["hardware"]), set(doc["calibrated"])
        except (KeyError, TypeError, AttributeError):
            raise GnnPipeError(f"{self.path}: a predictions file without its runs, hardware or calibrated "
                               f"profiles; {fix}") from None

    def __call__(self, run: Run) -> Prediction:
        return self.runs.get(run.run_id) or Prediction(
            reason=f"{self.path}: no prediction of this run (rerun the cost_predictions rule)")
