"""``results/report.md`` and ``results/plots/*.png``: every run of a workflow, side by side.

    gnnpipe report --runs-dir results/runs --out results/report.md --plots results/plots

Input: each run directory's ``metrics.json`` (the run record, DESIGN.md §6) and, when
present, its ``eval.json`` (exact inference from ``model.pt``; its accuracies win over
the record's). Output:

* one table over all runs: layout, epoch time and its compute / comm / bubble split,
  bytes per epoch measured and predicted by the closed form, peak memory, accuracy;
* per dataset × model (kind, layers, hidden), the runs of every mode together, and the
  ratios **graph ÷ pipeline** (and graph ÷ hybrid) for each worker count where both
  exist: above 1 means the model-parallel run is faster / moves fewer bytes;
* runs that differ only in their seed, pooled: accuracy mean ± std over seeds per
  dataset × model × mode × layout, and graph ÷ pipeline / graph ÷ hybrid of the seed
  means (epoch time, bytes) at equal worker counts;
* every run next to the cost model's prediction (``gnnpipe.plan.predict_layout`` on the
  run's graph statistics (the workflow's ``plan_stats`` rule) and a hardware profile, default
  ``cpu-2core``): predicted bytes, epoch time, its compute / comm / bubble split and peak
  memory, each with its relative error to the measured figure; a run whose
  prediction fails (no run.yaml, no graph file, ...) is listed with the reason;
* per dataset × model whose pipeline / hybrid runs differ in a convergence technique
  (shuffle, grad correction, snapshot, momentum: an ablation), a table "Pipeline
  techniques": each run's settings from its run.yaml, test accuracy and Δ to the
  single-process reference (seeds pooled); left out when no model has such runs;
* plots (matplotlib, Agg canvas, no pyplot state): loss and accuracy curves per
  dataset × model with a line per run, bytes per epoch, epoch-time split, and per
  dataset × model bytes vs P and epoch time vs P per mode (measured and predicted) and
  loss / test accuracy per mode and layout (mean over seeds, ± std band).

Every file is written atomically.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Optional

from .io import GnnPipeError, atomic_path, write_text

#: The run record fields the report reads (a subset of DESIGN.md §6).
REQUIRED = ("run_id", "mode", "dataset", "num_nodes", "num_edges", "in_features", "model", "layers",
            "hidden", "world_size", "stages", "ways", "chunks", "epochs", "epoch_time_s",
            "epoch_time_breakdown_s", "comm_bytes_per_epoch", "comm_bytes_predicted",
            "peak_mem_bytes", "test_acc", "history")
MODE_ORDER = {"single": 0, "graph": 1, "pipeline": 2, "hybrid": 3}
SPLITS = ("train", "val", "test")
DASH = "—"


@dataclass
class Run:
    """One run record, with the accuracies of exact evaluation when there is one."""

    record: dict
    evaluation: Optional[dict] = None
    path: Path = field(default_factory=Path)

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
        try:
            from .config import load_yaml

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
        from .config import load_run_config

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
    """``run_dir/metrics.json`` (required, checked) and ``run_dir/eval.json`` (optional)."""
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
    return Run(record, evaluation, run_dir)


def load_runs(run_dirs: list[Path]) -> list[Run]:
    runs = [load_run(d) for d in run_dirs]
    ids = [r.run_id for r in runs]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise GnnPipeError(f"run ids appear twice: {', '.join(dup)}")
    return sorted(runs, key=lambda r: (r.group, MODE_ORDER[r["mode"]], r["world_size"], r.run_id))


# --------------------------------------------------------------------------- formatting
def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return DASH
    if n == 0:
        return "0"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_s(x: Optional[float]) -> str:
    if x is None:
        return DASH
    if x == 0:
        return "0"
    if x < 1e-3:
        return f"{x * 1e6:.3g} µs"
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def fmt_acc(x: Optional[float]) -> str:
    return DASH if x is None else f"{x:.4f}"


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """a ÷ b; None when undefined (a missing value, or 0 ÷ 0); inf for x ÷ 0."""
    if a is None or b is None or (a == 0 and b == 0):
        return None
    return math.inf if b == 0 else a / b


def fmt_ratio(x: Optional[float]) -> str:
    if x is None:
        return DASH
    return "∞" if math.isinf(x) else f"{x:.3g}×"


def layout(run: Run) -> str:
    return f"{run['stages']}×{run['ways']}"


def group_title(group: tuple) -> str:
    dataset, model, layers, hidden = group
    return f"{dataset} · {model} ({layers} layers, hidden {hidden})"


def group_slug(group: tuple) -> str:
    dataset, model, layers, hidden = group
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{dataset}_{model}-L{layers}-H{hidden}")


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- tables
RUN_HEADER = ["run", "mode", "dataset", "model", "layers", "workers", "S×G", "chunks", "epoch",
              "compute", "comm", "bubble", "bytes/epoch", "predicted", "meas ÷ pred", "peak mem",
              "test acc"]


def run_row(run: Run) -> list[str]:
    r = run.record
    chunks = str(r["chunks"]) if r["mode"] in ("pipeline", "hybrid") else DASH
    return [f"`{run.run_id}`", r["mode"], r["dataset"], r["model"], str(r["layers"]),
            str(r["world_size"]), layout(run), chunks, fmt_s(r["epoch_time_s"]),
            fmt_s(run.breakdown("compute")), fmt_s(run.breakdown("comm")), fmt_s(run.breakdown("bubble")),
            fmt_bytes(r["comm_bytes_per_epoch"]), fmt_bytes(r["comm_bytes_predicted"]),
            fmt_ratio(ratio(r["comm_bytes_per_epoch"], r["comm_bytes_predicted"])),
            fmt_bytes(r["peak_mem_bytes"]), fmt_acc(run.acc("test"))]


@dataclass
class Comparison:
    """graph ÷ other (pipeline or hybrid) at one worker count."""

    graph: Run
    other: Run

    @property
    def ratios(self) -> dict[str, Optional[float]]:
        g, o = self.graph.record, self.other.record
        return {key: ratio(g[key], o[key]) for key in
                ("epoch_time_s", "comm_bytes_per_epoch", "comm_bytes_predicted", "peak_mem_bytes")}


def comparisons(runs: list[Run]) -> list[Comparison]:
    """Every (graph, pipeline|hybrid) pair of one group with the same number of workers
    and the same seed (seeds are compared as means in :func:`aggregate_comparisons`)."""
    out = []
    for g in (r for r in runs if r["mode"] == "graph"):
        for o in runs:
            if o["mode"] in ("pipeline", "hybrid") and o["world_size"] == g["world_size"] \
                    and o.seed == g.seed:
                out.append(Comparison(g, o))
    return sorted(out, key=lambda c: (MODE_ORDER[c.other["mode"]], c.graph["world_size"], c.other.run_id))


def group_section(group: tuple, runs: list[Run], plots: dict[str, str]) -> str:
    single = next((r for r in runs if r["mode"] == "single"), None)
    header = ["run", "mode", "workers", "S×G", "chunks", "epoch", "bytes/epoch", "predicted",
              "peak mem", "train acc", "val acc", "test acc", "Δ test vs single"]
    rows = []
    for run in runs:
        delta = DASH
        if single is not None and run is not single and None not in (run.acc("test"), single.acc("test")):
            delta = f"{100 * (run.acc('test') - single.acc('test')):+.2f} pt"
        rows.append([f"`{run.run_id}`", run["mode"], str(run["world_size"]), layout(run),
                     str(run["chunks"]) if run["mode"] in ("pipeline", "hybrid") else DASH,
                     fmt_s(run["epoch_time_s"]), fmt_bytes(run["comm_bytes_per_epoch"]),
                     fmt_bytes(run["comm_bytes_predicted"]), fmt_bytes(run["peak_mem_bytes"]),
                     fmt_acc(run.acc("train")), fmt_acc(run.acc("val")), fmt_acc(run.acc("test")), delta])
    parts = [f"### {group_title(group)}", "", md_table(header, rows), ""]
    comps = comparisons(runs)
    if comps:
        parts += ["Ratios graph ÷ model-parallel at equal workers (> 1: the model-parallel run "
                  "is faster, moves fewer bytes, or uses less memory):", ""]
        rows = []
        for c in comps:
            rt = c.ratios
            rows.append([str(c.graph["world_size"]), f"`{c.graph.run_id}`", f"`{c.other.run_id}`",
                         f"graph ÷ {c.other['mode']}", fmt_ratio(rt["epoch_time_s"]),
                         fmt_ratio(rt["comm_bytes_per_epoch"]), fmt_ratio(rt["comm_bytes_predicted"]),
                         fmt_ratio(rt["peak_mem_bytes"]),
                         f"{fmt_acc(c.graph.acc('test'))} / {fmt_acc(c.other.acc('test'))}"])
        parts += [md_table(["workers", "graph run", "model-parallel run", "ratio", "epoch time",
                            "bytes/epoch", "predicted bytes", "peak mem", "test acc (graph / other)"],
                           rows), ""]
    elif any(r["mode"] == "graph" for r in runs) or any(r["mode"] in ("pipeline", "hybrid") for r in runs):
        parts += ["No graph ÷ pipeline ratio: this model has no graph-parallel and model-parallel "
                  "runs with the same number of workers.", ""]
    if "curves" in plots:
        parts += [f"![loss and accuracy, {group_title(group)}]({plots['curves']})", ""]
    return "\n".join(parts)


def datasets_table(runs: list[Run]) -> str:
    seen = {}
    for run in runs:
        r = run.record
        seen.setdefault(r["dataset"], [r["dataset"], f"{r['num_nodes']:,}", f"{r['num_edges']:,}",
                                       str(r["in_features"])])
    return md_table(["dataset", "nodes", "edges (CSR entries)", "features"], list(seen.values()))


# --------------------------------------------------------------------------- plots
def _figure(width: float, height: float, **subplots):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(**subplots)


def _save(fig, path: Path) -> None:
    with atomic_path(path, ".png") as tmp:
        fig.savefig(tmp, format="png", dpi=110)


def _label(run: Run, runs: list[Run]) -> str:
    """Short x-axis label of a run; names the dataset only when there are several."""
    prefix = f"{run['dataset']}\n" if len({r["dataset"] for r in runs}) > 1 else ""
    return f"{prefix}{run['model']}-{run['layers']} {run['mode']}\nP={run['world_size']}"


def plot_curves(group: tuple, runs: list[Run], path: Path):
    """Loss and train/val/test accuracy against the epoch, one line per run."""
    fig, axes = _figure(11, 7.5, nrows=2, ncols=2)
    panels = [("loss", "training loss"), ("train_acc", "train accuracy"),
              ("val_acc", "validation accuracy"), ("test_acc", "test accuracy")]
    for ax, (key, title) in zip(axes.flat, panels):
        for run in runs:
            pts = [(h["epoch"], h[key]) for h in run["history"] if h.get(key) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if key != "loss" else None, markersize=3,
                        label=f"{run['mode']} P={run['world_size']} ({run.run_id})")
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        losses = [h.get("loss") for r in runs for h in r["history"]]
        if key == "loss" and losses and all(v is not None and v > 0 for v in losses) \
                and max(losses) > 10 * min(losses):
            ax.set_yscale("log")  # only when the loss spans more than a decade
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(group_title(group))
    _save(fig, path)
    return fig


def plot_bytes(runs: list[Run], path: Path):
    """Bytes per epoch of every parallel run, measured next to the closed form."""
    par = [r for r in runs if r["mode"] != "single"]
    fig, ax = _figure(max(6.0, 1.1 * len(par) + 2), 4.5)
    if not par:
        ax.text(0.5, 0.5, "no parallel runs: nothing crosses the wire", ha="center", va="center")
        ax.set_axis_off()
    else:
        xs = list(range(len(par)))
        values = {"measured": [r["comm_bytes_per_epoch"] for r in par],
                  "predicted": [r["comm_bytes_predicted"] for r in par]}
        for (name, vals), dx in zip(values.items(), (-0.2, 0.2)):
            bars = ax.bar([x + dx for x in xs], [v / 1e6 for v in vals], 0.4, label=name)
            ax.bar_label(bars, [fmt_bytes(v) for v in vals], fontsize=6, rotation=90, padding=2)
        every = values["measured"] + values["predicted"]
        if min(every) > 0 and max(every) > 100 * min(every):
            ax.set_yscale("log")  # graph parallelism can move orders of magnitude more
        ax.set_xticks(xs, [f"{_label(r, runs)}\nS×G={layout(r)}" for r in par], fontsize=7)
        ax.set_ylabel("MB sent per epoch (all ranks)")
        ax.margins(y=0.15)
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
    ax.set_title("communication volume per epoch")
    _save(fig, path)
    return fig


def plot_times(runs: list[Run], path: Path):
    """Median epoch time split into compute, communication and pipeline bubble."""
    fig, ax = _figure(max(6.0, 0.9 * len(runs) + 2), 4.5)
    xs = list(range(len(runs)))
    bottom = [0.0] * len(runs)
    for part in ("compute", "comm", "bubble"):
        vals = [run.breakdown(part) or 0.0 for run in runs]
        ax.bar(xs, vals, 0.6, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.scatter(xs, [r["epoch_time_s"] for r in runs], color="black", marker="_", s=300, zorder=3,
               label="epoch wall time")
    ax.set_xticks(xs, [_label(r, runs) for r in runs], fontsize=7)
    ax.set_ylabel("seconds per epoch (median)")
    ax.set_title("epoch time split (mean over ranks)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path)
    return fig


# --------------------------------------------------------------------------- the cost model
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


def fmt_err(x: Optional[float]) -> str:
    if x is None:
        return DASH
    return "∞" if math.isinf(x) else f"{100 * x:+.1f} %"


class Predictor:
    """Predicts runs with :func:`gnnpipe.plan.predict_layout` on one hardware profile.

    Per run: its ``run.yaml`` (graph path, model, partitioning, pipeline and graph-parallel
    settings), the graph's partition statistics from :func:`gnnpipe.plan.cached_graph_stats`
    (computed once and cached next to the graph file), the built model's shape. Any
    failure becomes an unavailable :class:`Prediction` with the reason.
    """

    def __init__(self, hardware=DEFAULT_HARDWARE, cost_model_dir=None):
        from . import costmodel as cm

        self.cost_model_dir = Path(cost_model_dir) if cost_model_dir is not None else None
        self.calibrated: set[str] = set()  # names of the calibrated profiles used
        self.hardware, self.error = None, None
        if isinstance(hardware, cm.Hardware):
            self.hardware = hardware
        else:
            try:
                self.hardware = cm.load_hardware(hardware)
            except (GnnPipeError, OSError) as e:
                self.error = f"hardware profile: {e}"
        self.name = self.hardware.name if self.hardware is not None else str(hardware)
        self._models: dict = {}
        self._fitted: dict = {}  # (dataset, model, dtype, graph path) -> calibrated profile or None

    def __call__(self, run: Run) -> Prediction:
        if self.error is not None:
            return Prediction(reason=self.error)
        try:
            return self._predict(run)
        except GnnPipeError as e:
            return Prediction(reason=str(e))
        except (OSError, KeyError, ValueError, TypeError) as e:  # unreadable files, odd records
            return Prediction(reason=f"{type(e).__name__}: {e}")

    def _fitted_profile(self, where: Path, cfg):
        """The profile in ``where`` calibrated to the run's model, dtype and graph content (None:
        none); looked up once per (dataset, model, dtype, graph), not once per run."""
        from .config import to_dict
        from .graph import read_graph_attrs
        from .plan import find_calibration

        key = (str(where), repr(to_dict(cfg.model)), cfg.training.dtype, str(cfg.graph_path))
        if key not in self._fitted:
            digest = str(read_graph_attrs(cfg.graph_path)["content_hash"])
            self._fitted[key] = (find_calibration(where, cfg.model, digest, cfg.training.dtype)
                                 if where.is_dir() else None)
        return self._fitted[key]

    def _predict(self, run: Run) -> Prediction:
        from . import costmodel as cm
        from .config import ConfigError, load_run_config, to_dict
        from .plan import build_model, cached_graph_stats, model_shape, predict_layout

        if not run.config_path.exists():
            return Prediction(reason=f"{run.config_path}: no run.yaml (run the 'run_config' rule)")
        try:
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
                                   balance_edges=pt.balance_edges, cache_file=cache)
        key = (repr(to_dict(cfg.model)), int(stats["num_features"]), int(stats["num_classes"]))
        if key not in self._models:
            gnn = build_model(cfg.model, key[1], key[2])
            self._models[key] = (gnn, model_shape(gnn))
        gnn, shape = self._models[key]
        est = predict_layout(stats, gnn, shape, hw, mode, S, G, C,
                             dtype_bytes=int(r.get("dtype_bytes", 4)), overlap=cfg.graph_parallel.overlap,
                             balance=cfg.pipeline.balance,
                             first_input=cm.first_input(gnn, cfg.graph_parallel),
                             pipeline_cfg=cfg.pipeline)
        return Prediction(bytes=float(est.bytes["total"]), epoch_s=float(est.epoch_s),
                          compute_s=float(est.compute_s), comm_s=float(est.comm_s),
                          bubble_s=float(est.bubble_s), peak_mem_bytes=float(est.peak_mem_bytes))


#: Bytes and epoch time get a column each for measured, predicted and error; the split and
#: peak memory one column each, a cell "measured / predicted (error)" (:func:`beside`).
PREDICTION_HEADER = ["run", "mode", "workers", "S×G", "bytes/epoch", "cost model", "error",
                     "epoch", "cost model", "error", "compute", "comm", "bubble", "peak mem", "note"]


def beside(measured: Optional[float], predicted: Optional[float], fmt) -> str:
    """``measured / predicted (error)``; a missing value is "—", an undefined error (a value
    missing, 0 vs 0) is left out."""
    err = rel_error(predicted, measured)
    cell = f"{fmt(measured)} / {fmt(predicted)}"
    return cell if err is None else f"{cell} ({fmt_err(err)})"


def prediction_row(run: Run, pred: Prediction) -> list[str]:
    r = run.record
    note = "" if pred.available else f"prediction unavailable: {pred.reason}"
    return [f"`{run.run_id}`", r["mode"], str(r["world_size"]), layout(run),
            fmt_bytes(r["comm_bytes_per_epoch"]), fmt_bytes(pred.bytes),
            fmt_err(rel_error(pred.bytes, r["comm_bytes_per_epoch"])),
            fmt_s(r["epoch_time_s"]), fmt_s(pred.epoch_s), fmt_err(rel_error(pred.epoch_s, r["epoch_time_s"])),
            beside(run.breakdown("compute"), pred.compute_s, fmt_s),
            beside(run.breakdown("comm"), pred.comm_s, fmt_s),
            beside(run.breakdown("bubble"), pred.bubble_s, fmt_s),
            beside(r["peak_mem_bytes"], pred.peak_mem_bytes, fmt_bytes),
            note]


# --------------------------------------------------------------------------- seeds pooled
def mean_std(values) -> tuple[Optional[float], Optional[float], int]:
    """Mean, sample standard deviation (None below 2 values) and count of the non-None values."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None, None, 0
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else None), len(vals)


def fmt_mean_std(values, fmt=fmt_acc) -> str:
    m, sd, n = mean_std(values)
    if m is None:
        return DASH
    return f"{fmt(m)} ± {fmt(sd)}" if sd is not None else fmt(m)


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


SEEDS_HEADER = ["mode", "workers", "S×G", "chunks", "seeds", "train acc", "val acc", "test acc",
                "epoch", "bytes/epoch", "cost model bytes", "cost model epoch"]


def seeds_row(agg: Aggregate) -> list[str]:
    seeds = ", ".join(DASH if s is None else str(s) for s in agg.seeds)
    return [agg["mode"], str(agg["world_size"]), layout(agg.first),
            str(agg["chunks"]) if agg["mode"] in ("pipeline", "hybrid") else DASH,
            f"{len(agg.runs)} ({seeds})",
            *(fmt_mean_std([r.acc(s) for r in agg.runs]) for s in SPLITS),
            fmt_mean_std([r["epoch_time_s"] for r in agg.runs], fmt_s),
            fmt_bytes(agg.mean("comm_bytes_per_epoch")),
            fmt_bytes(agg.predicted("bytes")), fmt_s(agg.predicted("epoch_s"))]


def aggregate_comparisons(aggs: list[Aggregate]) -> list[tuple[Aggregate, Aggregate]]:
    """(graph, pipeline|hybrid) pairs of pooled layouts of one group with equal workers."""
    out = []
    for g in (a for a in aggs if a["mode"] == "graph"):
        for o in aggs:
            if o["mode"] in ("pipeline", "hybrid") and o["world_size"] == g["world_size"] \
                    and o.group == g.group:
                out.append((g, o))
    return sorted(out, key=lambda p: (MODE_ORDER[p[1]["mode"]], p[0]["world_size"], p[1]["stages"]))


POOLED_RATIO_HEADER = ["workers", "ratio", "layouts", "seeds", "epoch time", "cost model epoch",
                       "bytes/epoch", "cost model bytes", "test acc (graph / other)"]


def pooled_ratio_row(g: Aggregate, o: Aggregate) -> list[str]:
    return [str(g["world_size"]), f"graph ÷ {o['mode']}", f"{layout(g.first)} ÷ {layout(o.first)}",
            f"{len(g.runs)} / {len(o.runs)}",
            fmt_ratio(ratio(g.mean("epoch_time_s"), o.mean("epoch_time_s"))),
            fmt_ratio(ratio(g.predicted("epoch_s"), o.predicted("epoch_s"))),
            fmt_ratio(ratio(g.mean("comm_bytes_per_epoch"), o.mean("comm_bytes_per_epoch"))),
            fmt_ratio(ratio(g.predicted("bytes"), o.predicted("bytes"))),
            f"{fmt_mean_std([r.acc('test') for r in g.runs])} / {fmt_mean_std([r.acc('test') for r in o.runs])}"]


def pooled_section(group: tuple, aggs: list[Aggregate]) -> str:
    parts = [f"Over seeds (mean ± sample std; the cost model predicts each layout once):", "",
             md_table(SEEDS_HEADER, [seeds_row(a) for a in aggs]), ""]
    pairs = aggregate_comparisons(aggs)
    if pairs:
        parts += ["Seed means, graph ÷ model-parallel at equal workers, measured and predicted "
                  "(> 1: the model-parallel layout is faster / moves fewer bytes):", "",
                  md_table(POOLED_RATIO_HEADER, [pooled_ratio_row(g, o) for g, o in pairs]), ""]
    return "\n".join(parts)


# --------------------------------------------------------------------------- pipeline techniques
#: The pipeline's convergence techniques (DESIGN.md §4, ``PipelineConfig``) as table columns.
TECHNIQUES_HEADER = ["run", "S×G", "chunks", "shuffle", "grad correction", "snapshot", "momentum",
                     "test acc", "Δ test vs single (pt)"]


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


def technique_cells(t: Optional[tuple]) -> list[str]:
    if t is None:
        return [DASH] * 4
    shuffle, scale, snapshot, momentum = t
    return ["on" if shuffle else "off",
            "off" if scale is None else f"×{scale:g}",
            "off" if snapshot == 0 else ("every epoch" if snapshot == 1 else f"every {snapshot} epochs"),
            "off" if momentum == 0 else f"{momentum:g}"]


def has_technique_ablation(runs: list[Run]) -> bool:
    """Whether the pipeline / hybrid runs among ``runs`` (one dataset × model) differ in at
    least one technique setting; runs without a readable run.yaml do not count."""
    return len({t for t in map(techniques, runs) if t is not None}) > 1


def techniques_section(group: tuple, runs: list[Run], aggs: list[Aggregate]) -> str:
    """One dataset × model's table of :data:`TECHNIQUES_HEADER`: the single-process reference
    first (its seeds pooled as in "Over seeds": the group's single :class:`Aggregate`), then
    a row per pipeline / hybrid run, every technique on first, then by how many are off
    (ties: shuffle off before grad correction off before snapshot off before momentum off,
    then layout and run id), runs without a readable run.yaml last."""
    ref = next((a for a in aggs if a["mode"] == "single"), None)
    ref_acc = ref.acc("test")[0] if ref is not None else None
    rows = []
    if ref is not None:
        ids = ", ".join(f"`{r.run_id}`" for r in ref.runs)
        if len(ref.runs) > 1:
            ids += f" ({len(ref.runs)} seeds)"
        rows.append([ids, layout(ref.first), DASH, *[DASH] * 4,
                     fmt_mean_std([r.acc("test") for r in ref.runs]), DASH])

    def order(run: Run):
        t = techniques(run)
        off = techniques_off(t) if t is not None else (True,) * 4
        return (t is None, sum(off), tuple(not o for o in off), MODE_ORDER[run["mode"]],
                run["world_size"], run["stages"], run["chunks"], run.run_id)

    for run in sorted((r for r in runs if r["mode"] in ("pipeline", "hybrid")), key=order):
        acc = run.acc("test")
        delta = DASH if acc is None or ref_acc is None else f"{100 * (acc - ref_acc):+.2f}"
        rows.append([f"`{run.run_id}`", layout(run), str(run["chunks"]), *technique_cells(techniques(run)),
                     fmt_acc(acc), delta])
    note = [] if ref is not None else ["No single-process run of this model: no Δ.", ""]
    return "\n".join([f"### Pipeline techniques: {group_title(group)}", "", *note,
                      md_table(TECHNIQUES_HEADER, rows), ""])


TECHNIQUES_INTRO = (
    "The pipeline and hybrid runs of each dataset × model whose convergence techniques "
    "(DESIGN.md §4; the `pipeline:` block of the run's run.yaml) are not all set alike, as in "
    "an ablation (config/experiments/ablation.yaml): shuffle = a new chunk order every epoch, "
    "grad correction = stale gradients dropped and fresh cross-chunk ones scaled (×scale), "
    "snapshot = not-yet-computed rows read from a snapshot refreshed every N epochs, "
    "momentum = moving average of the history. The first row is the single-process reference "
    "(its seeds pooled: mean ± sample std), then every technique on, then by how many are off; "
    "Δ is the run's test accuracy minus the reference's mean, in percentage points. A run "
    "without a readable run.yaml shows — for its settings. Models whose pipeline runs all share "
    "one setting have no table here (the section is left out when none has one).")


# --------------------------------------------------------------------------- per-mode plots
def _mode_series(aggs: list[Aggregate], what: str, predicted: bool):
    """mode -> sorted [(P, mean, std)] of measured ``what`` (or the prediction) per layout."""
    series: dict[str, list] = defaultdict(list)
    for a in aggs:
        if predicted:
            v = a.predicted({"comm_bytes_per_epoch": "bytes", "epoch_time_s": "epoch_s"}[what])
            sd = None
        else:
            v, sd, _ = mean_std(r[what] for r in a.runs)
        if v is not None:
            series[a.label() if a["mode"] == "hybrid" else a["mode"]].append((a["world_size"], v, sd))
    return {k: sorted(v) for k, v in sorted(series.items(), key=lambda kv: MODE_ORDER[kv[0].split()[0]])}


def plot_vs_workers(group: tuple, aggs: list[Aggregate], what: str, path: Path):
    """``what`` (bytes or epoch time) against the worker count P, a line per mode: seed
    mean (± std) measured, the cost model's prediction dashed."""
    scale, unit, title = {"comm_bytes_per_epoch": (1e6, "MB sent per epoch (all ranks)", "bytes per epoch vs P"),
                          "epoch_time_s": (1.0, "seconds per epoch (median)", "epoch time vs P")}[what]
    aggs = [a for a in aggs if what == "epoch_time_s" or a["mode"] != "single"]
    fig, ax = _figure(6.5, 4.5)
    measured, predicted = _mode_series(aggs, what, False), _mode_series(aggs, what, True)
    colors = {}
    for name, pts in measured.items():
        ps, vs, sds = zip(*pts)
        line = ax.errorbar(ps, [v / scale for v in vs], yerr=[(s or 0) / scale for s in sds], marker="o",
                           capsize=3, label=f"{name} (measured)")
        colors[name] = line.lines[0].get_color()
    for name, pts in predicted.items():
        ps, vs, _ = zip(*pts)
        ax.plot(ps, [v / scale for v in vs], linestyle="--", marker="x", color=colors.get(name),
                label=f"{name} (cost model)")
    if not measured and not predicted:
        ax.text(0.5, 0.5, "no runs", ha="center", va="center")
    every = [v for pts in list(measured.values()) + list(predicted.values()) for _, v, _ in pts]
    if every and min(every) > 0 and max(every) > 100 * min(every):
        ax.set_yscale("log")
    xs = sorted({p for pts in measured.values() for p, _, _ in pts} |
                {p for pts in predicted.values() for p, _, _ in pts})
    if xs:
        ax.set_xticks(xs)
    ax.set_xlabel("workers P")
    ax.set_ylabel(unit)
    ax.set_title(f"{title}\n{group_title(group)}", fontsize=10)
    ax.grid(alpha=0.3)
    if measured or predicted:
        ax.legend(fontsize=7)
    _save(fig, path)
    return fig


def plot_mode_curves(group: tuple, aggs: list[Aggregate], path: Path):
    """Training loss and test accuracy against the epoch, a line per mode and layout:
    mean over seeds with a ± std band."""
    fig, axes = _figure(11, 4.2, nrows=1, ncols=2)
    for ax, (key, title) in zip(axes, (("loss", "training loss"), ("test_acc", "test accuracy"))):
        for a in aggs:
            pts = a.history(key)
            if not pts:
                continue
            es, ms, sds = zip(*pts)
            line, = ax.plot(es, ms, marker="o" if key != "loss" else None, markersize=3,
                            label=f"{a.label()} (n={len(a.runs)})")
            if len(a.runs) > 1:
                lo = [m - (s or 0) for m, s in zip(ms, sds)]
                hi = [m + (s or 0) for m, s in zip(ms, sds)]
                ax.fill_between(es, lo, hi, color=line.get_color(), alpha=0.2)
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{group_title(group)}: mean over seeds ± std")
    _save(fig, path)
    return fig


# --------------------------------------------------------------------------- the report
def build_report(run_dirs: list[Path], out_md: Path, plots_dir: Path, *,
                 hardware=DEFAULT_HARDWARE, predict: bool = True, cost_model_dir=None) -> None:
    """Read the runs in ``run_dirs`` and write ``out_md`` and the PNGs in ``plots_dir``.

    ``hardware``: the profile (name, path or ``costmodel.Hardware``) the cost model
    predicts each run on; ``cost_model_dir``: the workflow's partition statistics and
    calibrated profiles (``Predictor``); ``predict=False`` leaves the predictions out
    (marked so)."""
    if not run_dirs:
        raise GnnPipeError("no runs to report on")
    from .atomic import report as atomic_report

    runs = load_runs([Path(d) for d in run_dirs])
    out_md, plots_dir = Path(out_md), Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    rel = lambda p: Path(os.path.relpath(p, out_md.parent)).as_posix()  # noqa: E731
    atomic = atomic_report.section([r for r in runs if atomic_report.is_atomic(r)], plots_dir, rel,
                                   md_table=md_table, fmt_s=fmt_s, fmt_bytes=fmt_bytes, figure=_figure, save=_save)
    runs = [r for r in runs if not atomic_report.is_atomic(r)]
    if not runs:
        write_text(out_md, "\n".join(["# GNNPipe report", "", atomic]))
        return

    if predict:
        predictor = Predictor(hardware, cost_model_dir)
        predictions = {r.run_id: predictor(r) for r in runs}
        hw_name = f"hardware profile `{predictor.name}`"
        if predictor.calibrated:
            hw_name += (" with its compute rates fitted to each dataset and model on this machine "
                        f"({', '.join(f'`{n}`' for n in sorted(predictor.calibrated))}; rule calibrate, "
                        "`gnnpipe calibrate`)")
    else:
        hw_name = None
        predictions = {r.run_id: Prediction(reason="predictions switched off") for r in runs}
    aggs = aggregate(runs, predictions)

    groups: dict[tuple, list[Run]] = defaultdict(list)
    for run in runs:
        groups[run.group].append(run)
    sections, technique_tables = [], []
    for group, members in groups.items():
        slug = group_slug(group)
        g_aggs = [a for a in aggs if a.group == group]
        curves = plots_dir / f"curves_{slug}.png"
        plot_curves(group, members, curves)
        modes = plots_dir / f"modes_{slug}.png"
        plot_mode_curves(group, g_aggs, modes)
        links = [f"![loss and test accuracy per mode, {group_title(group)}]({rel(modes)})", ""]
        if any(r["mode"] != "single" for r in members):
            for what, stem, alt in (("comm_bytes_per_epoch", "bytes_vs_p", "bytes per epoch vs P"),
                                    ("epoch_time_s", "time_vs_p", "epoch time vs P")):
                png = plots_dir / f"{stem}_{slug}.png"
                plot_vs_workers(group, g_aggs, what, png)
                links += [f"![{alt}, {group_title(group)}]({rel(png)})", ""]
        sections.append("\n".join([group_section(group, members, {"curves": rel(curves)}),
                                   pooled_section(group, g_aggs), *links]))
        if has_technique_ablation(members):
            technique_tables.append(techniques_section(group, members, g_aggs))
    plot_bytes(runs, plots_dir / "comm_bytes.png")
    plot_times(runs, plots_dir / "epoch_time.png")

    n_eval = sum(r.evaluation is not None for r in runs)
    n_pred = sum(p.available for p in predictions.values())
    text = "\n".join([
        "# GNNPipe report",
        "",
        f"{len(runs)} runs over {len({r['dataset'] for r in runs})} dataset(s). Epoch times are "
        "medians over the timed epochs (wall time of the slowest rank; the split is the mean over "
        "ranks); bytes are sent per epoch, summed over ranks, training traffic only; "
        "*predicted* is the closed form of DESIGN.md §4; peak memory is the maximum over ranks. "
        f"Accuracies come from exact full-graph inference of the final model (eval.json, {n_eval} "
        f"of {len(runs)} runs), else from the run record.",
        "",
        "## Datasets",
        "",
        datasets_table(runs),
        "",
        "## All runs",
        "",
        md_table(RUN_HEADER, [run_row(r) for r in runs]),
        "",
        "## Measured vs cost model",
        "",
        (f"The cost model (gnnpipe.plan.predict_layout, on each graph's partition statistics) "
         f"on {hw_name}, {n_pred} of {len(runs)} runs predicted; "
         "error = (predicted − measured) ÷ measured. The compute, comm, bubble and peak mem "
         "cells read measured / predicted (error); the measured split is the mean over ranks, "
         "the predicted one the critical path's (the slowest stage); peak memory is the "
         "largest worker's in both." if predict else
         "Predictions switched off."),
        "",
        md_table(PREDICTION_HEADER, [prediction_row(r, predictions[r.run_id]) for r in runs]),
        "",
        "## By dataset and model",
        "",
        *sections,
        *(["## Pipeline techniques", "", TECHNIQUES_INTRO, "", *technique_tables] if technique_tables else []),
        "## Communication and time",
        "",
        f"![bytes per epoch]({rel(plots_dir / 'comm_bytes.png')})",
        "",
        f"![epoch time split]({rel(plots_dir / 'epoch_time.png')})",
        "",
        atomic,
    ])
    write_text(out_md, text)
