"""The report's plots (matplotlib, Agg canvas, no pyplot state), each written atomically:
loss and accuracy curves per run, bytes per epoch, the epoch-time split, and per dataset ×
model bytes and epoch time against P, loss / test accuracy per mode (seeds pooled) and
validation accuracy against training time."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ..io import atomic_path
from . import timing
from .records import MODE_ORDER, Aggregate, Run, mean_std
from .tables import fmt_bytes, group_title, layout


DPI = 110


def figure(width: float, height: float, **subplots):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(**subplots)


def save(fig, path: Path) -> None:
    """The figure as a PNG at ``DPI``: drawn once (the constrained layout inside that draw) and
    its pixels encoded, the pixels ``savefig`` writes; ``savefig`` would draw it twice (a draw for
    the layout, then one to render), two thirds of the report's time in plots (#36)."""
    from matplotlib.image import imsave

    fig.canvas.draw()
    with atomic_path(path, ".png") as tmp:
        imsave(tmp, fig.canvas.buffer_rgba(), format="png", origin="upper", dpi=fig.dpi)


def history_panel(ax, runs: list[Run], key: str, title: str, label) -> None:
    """One panel of per-epoch curves: ``key`` of every run's history against the epoch (the
    loss as a line, evaluated metrics with markers), ``label(run)`` in the legend."""
    for run in runs:
        pts = [(h["epoch"], h[key]) for h in run["history"] if h.get(key) is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if key != "loss" else None, markersize=3, label=label(run))
    ax.set_title(title)
    ax.set_xlabel("epoch")
    ax.grid(alpha=0.3)


def _label(run: Run, runs: list[Run]) -> str:
    """Short x-axis label of a run; names the dataset only when there are several."""
    prefix = f"{run['dataset']}\n" if len({r["dataset"] for r in runs}) > 1 else ""
    return f"{prefix}{run['model']}-{run['layers']} {run['mode']}\nP={run['world_size']}"


def plot_curves(group: tuple, runs: list[Run], path: Path):
    """Loss and train/val/test accuracy against the epoch, one line per run."""
    fig, axes = figure(11, 7.5, nrows=2, ncols=2)
    panels = [("loss", "training loss"), ("train_acc", "train accuracy"),
              ("val_acc", "validation accuracy"), ("test_acc", "test accuracy")]
    for ax, (key, title) in zip(axes.flat, panels):
        history_panel(ax, runs, key, title, lambda run: f"{run['mode']} P={run['world_size']} ({run.run_id})")
        losses = [h.get("loss") for r in runs for h in r["history"]]
        if key == "loss" and losses and all(v is not None and v > 0 for v in losses) \
                and max(losses) > 10 * min(losses):
            ax.set_yscale("log")  # only when the loss spans more than a decade
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(group_title(group))
    save(fig, path)
    return fig


def plot_bytes(runs: list[Run], path: Path):
    """Bytes per epoch of every parallel run, measured next to the closed form."""
    par = [r for r in runs if r["mode"] != "single"]
    fig, ax = figure(max(6.0, 1.1 * len(par) + 2), 4.5)
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
    save(fig, path)
    return fig


def plot_times(runs: list[Run], path: Path):
    """Median epoch time split into compute, communication and pipeline bubble."""
    fig, ax = figure(max(6.0, 0.9 * len(runs) + 2), 4.5)
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
    save(fig, path)
    return fig


# --------------------------------------------------------------------------- per-mode plots
def _mode_series(aggs: list[Aggregate], what: str, predicted: bool):
    """mode -> [(P, mean, std)] of measured ``what`` (or the prediction) per layout, by P; a line
    of its own per convergence-technique setting where the pipeline / hybrid runs differ in one."""
    variants = len({timing.techniques_short(a) for a in aggs if a["mode"] in ("pipeline", "hybrid")}) > 1
    series: dict[str, list] = defaultdict(list)
    for a in aggs:
        if predicted:
            v = a.predicted({"comm_bytes_per_epoch": "bytes", "epoch_time_s": "epoch_s"}[what])
            sd = None
        else:
            v, sd, _ = mean_std(r[what] for r in a.runs)
        if v is not None:
            name = a.label() if a["mode"] == "hybrid" else a["mode"]
            tech = timing.techniques_short(a) if variants else ""
            series[f"{name} ({tech})" if tech else name].append((a["world_size"], v, sd))
    return {k: sorted(v, key=lambda p: p[:2]) for k, v in sorted(series.items(), key=lambda kv: MODE_ORDER[kv[0].split()[0]])}


def plot_vs_workers(group: tuple, aggs: list[Aggregate], what: str, path: Path):
    """``what`` (bytes or epoch time) against the worker count P, a line per mode: seed
    mean (± std) measured, the cost model's prediction dashed."""
    scale, unit, title = {"comm_bytes_per_epoch": (1e6, "MB sent per epoch (all ranks)", "bytes per epoch vs P"),
                          "epoch_time_s": (1.0, "seconds per epoch (median)", "epoch time vs P")}[what]
    aggs = [a for a in aggs if what == "epoch_time_s" or a["mode"] != "single"]
    fig, ax = figure(6.5, 4.5)
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
    save(fig, path)
    return fig


def plot_mode_curves(group: tuple, aggs: list[Aggregate], path: Path):
    """Training loss and test accuracy against the epoch, a line per mode and layout:
    mean over seeds with a ± std band."""
    fig, axes = figure(11, 4.2, nrows=1, ncols=2)
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
    save(fig, path)
    return fig


def plot_time_to_accuracy(group: tuple, aggs: list[Aggregate], target, path: Path):
    """Validation accuracy against training wall time, a line per mode and layout (and
    convergence techniques): the mean over seeds at each evaluated epoch; ``target`` (the
    single-process reference's best less a point) dashed."""
    fig, ax = figure(7.5, 4.8)
    for a in aggs:
        pts = timing.curve(a.runs)
        if not pts:
            continue
        xs, ys = zip(*pts)
        tech = timing.techniques_short(a)
        ax.plot(xs, ys, marker="o", markersize=3,
                label=f"{a.label()}{f' ({tech})' if tech else ''} (n={len(a.runs)})")
    if target is not None:
        ax.axhline(target, color="black", linestyle="--", linewidth=1, label="target: single's best − 1 pt")
    ax.set_xlabel("training wall time (s, summed epoch times)")
    ax.set_ylabel("validation accuracy")
    ax.set_title(f"time to accuracy\n{group_title(group)}", fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no evaluated epochs", ha="center", va="center")
    save(fig, path)
    return fig
