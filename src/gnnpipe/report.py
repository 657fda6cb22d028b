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
* plots (matplotlib, Agg canvas, no pyplot state): loss and accuracy curves per
  dataset × model with a line per run, bytes per epoch, epoch-time split.

Every file is written atomically.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
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
    """Every (graph, pipeline|hybrid) pair of one group with the same number of workers."""
    out = []
    for g in (r for r in runs if r["mode"] == "graph"):
        for o in runs:
            if o["mode"] in ("pipeline", "hybrid") and o["world_size"] == g["world_size"]:
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


# --------------------------------------------------------------------------- the report
def build_report(run_dirs: list[Path], out_md: Path, plots_dir: Path) -> None:
    """Read the runs in ``run_dirs`` and write ``out_md`` and the PNGs in ``plots_dir``."""
    if not run_dirs:
        raise GnnPipeError("no runs to report on")
    runs = load_runs([Path(d) for d in run_dirs])
    out_md, plots_dir = Path(out_md), Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    rel = lambda p: Path(os.path.relpath(p, out_md.parent)).as_posix()  # noqa: E731

    groups: dict[tuple, list[Run]] = defaultdict(list)
    for run in runs:
        groups[run.group].append(run)
    sections = []
    for group, members in groups.items():
        curves = plots_dir / f"curves_{group_slug(group)}.png"
        plot_curves(group, members, curves)
        sections.append(group_section(group, members, {"curves": rel(curves)}))
    plot_bytes(runs, plots_dir / "comm_bytes.png")
    plot_times(runs, plots_dir / "epoch_time.png")

    n_eval = sum(r.evaluation is not None for r in runs)
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
        "## By dataset and model",
        "",
        *sections,
        "## Communication and time",
        "",
        f"![bytes per epoch]({rel(plots_dir / 'comm_bytes.png')})",
        "",
        f"![epoch time split]({rel(plots_dir / 'epoch_time.png')})",
        "",
    ])
    write_text(out_md, text)
