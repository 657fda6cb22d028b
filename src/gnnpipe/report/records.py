"""Run records: one run's ``metrics.json`` (the run record, docs/DESIGN.md §6) with its
``eval.json`` and ``run.yaml``, loaded and checked (:class:`Run`, :func:`load_runs`), its
convergence techniques, and the runs that differ only in their seed pooled
(:class:`Aggregate`)."""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Optional

from ..config import load_run_config, load_yaml
from ..io import GnnPipeError
from .predictions import Prediction

#: The run record fields the report reads (a subset of docs/DESIGN.md §6).
REQUIRED = ("run_id", "mode", "dataset", "num_nodes", "num_edges", "in_features", "model", "layers",
            "hidden", "world_size", "stages", "ways", "chunks", "epochs", "epoch_time_s",
            "epoch_time_breakdown_s", "comm_bytes_per_epoch", "comm_bytes_predicted",
            "peak_mem_bytes", "test_acc", "history")
MODE_ORDER = {"single": 0, "graph": 1, "pipeline": 2, "hybrid": 3}
SPLITS = ("train", "val", "test")


@dataclass
class Run:
    """One run record, with the accuracies of exact evaluation when there is one."""

    record: dict
    evaluation: Optional[dict] = None
    path: Path = field(default_factory=Path)
    relax: Optional[dict] = None  # relax.json of an atomic run (IS2RS), when the workflow relaxed it

    def __getitem__(self, key):
        return self.record[key]

    @property
    def run_id(self) -> str:
        return self.record["run_id"]

    @property
    def group(self) -> tuple:
        r = self.record
        return (r["dataset"], r["model"], r["layers"], r["hidden"])

    def acc(self, split: str) -> Optional[float]:
        if self.evaluation is not None and self.evaluation.get(f"{split}_acc") is not None:
            return self.evaluation[f"{split}_acc"]
        return self.record.get(f"{split}_acc")

    def breakdown(self, part: str) -> Optional[float]:
        return (self.record.get("epoch_time_breakdown_s") or {}).get(part)

    @property
    def config_path(self) -> Path:
        return self.path / "run.yaml"

    @cached_property
    def seed(self) -> Optional[int]:
        """The training seed: run.yaml's, else the ``-seed<k>`` suffix of a generated run id."""
        if self.run_config is not None:  # (parsed once: YAML is ~0.05 s a file)
            return self.run_config.training.seed
        try:
            seed = (load_yaml(self.config_path).get("training") or {}).get("seed")
            if isinstance(seed, int):
                return seed
        except Exception:  # noqa: BLE001 - a missing or odd run.yaml only loses the seed
            pass
        m = re.search(r"-seed(\d+)$", self.run_id)
        return int(m.group(1)) if m else None

    @cached_property
    def run_config(self):
        """The run's ``run.yaml`` as a ``gnnpipe.config.RunConfig``; None when it is missing
        or does not load (the report then shows "—" for what it would have told)."""
        if not self.config_path.is_file():
            return None
        try:
            return load_run_config(self.config_path)
        except (GnnPipeError, OSError):
            return None

    @property
    def layout_key(self) -> tuple:
        """What runs pooled over seeds share: group, mode, layout and (pipeline, hybrid) the
        convergence techniques, so that an ablation's variants are not pooled as seeds."""
        r = self.record
        return (*self.group, r["mode"], r["world_size"], r["stages"], r["ways"], r["chunks"], techniques(self))


# --------------------------------------------------------------------------- loading
def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise GnnPipeError(f"{path}: no such file; run the 'train' rule for this run first") from None
    except json.JSONDecodeError as e:
        raise GnnPipeError(f"{path}: not valid JSON ({e}); delete it and re-run its rule") from None
    if not isinstance(data, dict):
        raise GnnPipeError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load_run(run_dir: Path) -> Run:
    """``run_dir/metrics.json`` (required, checked), ``run_dir/eval.json`` and ``relax.json`` (optional)."""
    run_dir = Path(run_dir)
    record = _read_json(run_dir / "metrics.json")
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        raise GnnPipeError(f"{run_dir / 'metrics.json'}: not a run record, missing "
                           f"{', '.join(missing)} (re-run the 'train' rule)")
    if record["mode"] not in MODE_ORDER:
        raise GnnPipeError(f"{run_dir / 'metrics.json'}: unknown mode {record['mode']!r}")
    eval_path = run_dir / "eval.json"
    evaluation = _read_json(eval_path) if eval_path.exists() else None
    relax_path = run_dir / "relax.json"
    return Run(record, evaluation, run_dir, _read_json(relax_path) if relax_path.exists() else None)


def load_runs(run_dirs: list[Path]) -> list[Run]:
    runs = [load_run(d) for d in run_dirs]
    ids = [r.run_id for r in runs]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise GnnPipeError(f"run ids appear twice: {', '.join(dup)}")
    return sorted(runs, key=lambda r: (r.group, MODE_ORDER[r["mode"]], r["world_size"], r.run_id))


# --------------------------------------------------------------------------- pipeline techniques
def techniques(run: Run) -> Optional[tuple]:
    """A pipeline or hybrid run's convergence techniques as its run.yaml sets them:
    ``(shuffle_chunks, grad_scale, snapshot_every, momentum)`` with ``grad_scale`` None when
    ``grad_correction`` is off (the scale then does nothing); None for the other modes and
    for a run without a readable run.yaml."""
    if run["mode"] not in ("pipeline", "hybrid") or run.run_config is None:
        return None
    pc = run.run_config.pipeline
    return (bool(pc.shuffle_chunks), float(pc.grad_scale) if pc.grad_correction else None,
            int(pc.snapshot_every), float(pc.momentum))


def techniques_off(t: tuple) -> tuple[bool, bool, bool, bool]:
    """Which of the four techniques ``t`` (:func:`techniques`) switches off, in column order."""
    shuffle, scale, snapshot, momentum = t
    return (not shuffle, scale is None, snapshot == 0, momentum == 0)


# --------------------------------------------------------------------------- seeds pooled
def mean_std(values) -> tuple[Optional[float], Optional[float], int]:
    """Mean, sample standard deviation (None below 2 values) and count of the non-None values."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None, None, 0
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else None), len(vals)


@dataclass
class Aggregate:
    """The runs of one dataset × model × mode × layout, over their seeds."""

    runs: list[Run]
    predictions: list[Prediction]

    @property
    def first(self) -> Run:
        return self.runs[0]

    def __getitem__(self, key):
        return self.first[key]

    @property
    def group(self) -> tuple:
        return self.first.group

    @property
    def seeds(self) -> list:
        return [r.seed for r in self.runs]

    def acc(self, split: str) -> tuple:
        return mean_std(r.acc(split) for r in self.runs)

    def mean(self, key: str) -> Optional[float]:
        return mean_std(r[key] for r in self.runs)[0]

    def predicted(self, what: str) -> Optional[float]:
        """Mean of the available predictions (one layout: equal for every seed); None if none."""
        vals = [getattr(p, what) for p in self.predictions if getattr(p, what) is not None]
        return statistics.fmean(vals) if vals else None

    def history(self, key: str) -> list[tuple[int, float, Optional[float]]]:
        """(epoch, mean, std) of ``key`` over the seeds, at the epochs every run logged it."""
        per = [{h["epoch"]: h[key] for h in r["history"] if h.get(key) is not None} for r in self.runs]
        epochs = sorted(set.intersection(*(set(p) for p in per))) if per else []
        out = []
        for e in epochs:
            m, sd, _ = mean_std(p[e] for p in per)
            out.append((e, m, sd))
        return out

    def label(self) -> str:
        r = self.first.record
        lay = {"single": "", "graph": f" P={r['world_size']}",
               "pipeline": f" S={r['stages']} C={r['chunks']}",
               "hybrid": f" {r['stages']}×{r['ways']} C={r['chunks']}"}[r["mode"]]
        return f"{r['mode']}{lay}"


def aggregate(runs: list[Run], predictions: dict[str, Prediction]) -> list[Aggregate]:
    """Runs pooled by :attr:`Run.layout_key`, in report order (mode, workers, layout)."""
    pools: dict[tuple, list[Run]] = defaultdict(list)
    for run in runs:
        pools[run.layout_key].append(run)
    out = [Aggregate(sorted(rs, key=lambda r: (r.seed is None, r.seed or 0, r.run_id)),
                     [predictions.get(r.run_id, Prediction(reason="not predicted")) for r in rs])
           for rs in pools.values()]
    return sorted(out, key=lambda a: (a.group, MODE_ORDER[a["mode"]], a["world_size"], a["stages"],
                                      a["chunks"]))
