"""The cost model's prediction beside every run: :class:`Predictor` predicts a run from its
``run.yaml``, its graph's partition statistics and a hardware profile (calibrated to the
run's model when the workflow fitted one) with :func:`gnnpipe.planning.predict.predict_layout`;
a run it cannot predict gets an unavailable :class:`Prediction` with the reason."""

from __future__ import annotations

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
