"""The report's section on atomic runs: S2EF metrics per run, bytes vs the closed form, curves.

One table per atomic dataset and model kind (DimeNet++, GemNet-T, ...: runs side by side: mode,
ways P × replicas D, parameters, epoch time, bytes measured and predicted, peak memory, energy
MAE beside the per-element baseline's, force MAE beside the zero-force baseline's, force cosine, EFwT
from ``eval.json``, and which baselines the model beats), and a
plot of the loss and the validation energy / force MAE against the epoch. A run is atomic when
its record says so (``extra.atomic``: its dataset is of kind ``atoms``).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ..report.plots import figure, history_panel, save
from ..report.tables import DASH, fmt_bytes, fmt_s, md_table

METRICS = ("energy_mae", "force_mae", "force_cos", "efwt")
HEADER = ["run", "mode", "P × D", "params", "epoch", "bytes/epoch", "predicted", "peak mem",
          "energy MAE (eV)", "baseline", "force MAE (eV/Å)", "zero-force baseline", "force cos", "EFwT",
          "vs baselines"]


def is_atomic(run) -> bool:
    return bool((run.record.get("extra") or {}).get("atomic"))


def label(run) -> str:
    """The model's name in the report (``extra.label``: GemNet-T, GemNet-dT, DimeNet++), else its kind."""
    return (run.record.get("extra") or {}).get("label") or run["model"]


def _metric(run, key):
    if run.evaluation is not None and run.evaluation.get(key) is not None:
        return run.evaluation[key]
    return run.record.get(key)


def _f(x, spec=".4f") -> str:
    return DASH if x is None else format(x, spec)


def _baseline(run, key):
    """The baseline's MAE on the test split: eval.json's, else the run record's (``extra``)."""
    if run.evaluation is not None and run.evaluation.get(key) is not None:
        return run.evaluation[key]
    return (run.record.get("extra") or {}).get(key)


def verdict(energy, base_energy, force, base_force) -> str:
    """Which baselines the model beats (lower MAE); **neither** is marked."""
    pairs = [("energy", energy, base_energy), ("forces", force, base_force)]
    if any(m is None or b is None for _, m, b in pairs):
        return DASH
    beats = [name for name, m, b in pairs if m < b]
    if not beats:
        return "**beats neither**"
    return "beats both" if len(beats) == 2 else f"{beats[0]} only"


def run_row(run) -> list[str]:
    r, extra = run.record, run.record.get("extra") or {}
    e, f = _metric(run, "energy_mae"), _metric(run, "force_mae")
    be, bf = _baseline(run, "baseline_energy_mae"), _baseline(run, "baseline_force_mae")
    return [f"`{run.run_id}`", r["mode"], f"{r['ways']} × {r.get('data_parallel', 1)}",
            f"{extra.get('parameters', 0):,}", fmt_s(r["epoch_time_s"]), fmt_bytes(r["comm_bytes_per_epoch"]),
            fmt_bytes(r["comm_bytes_predicted"]), fmt_bytes(r["peak_mem_bytes"]),
            _f(e), _f(be), _f(f), _f(bf), _f(_metric(run, "force_cos"), ".3f"), _f(_metric(run, "efwt"), ".3f"),
            verdict(e, be, f, bf)]


def plot_curves(dataset: str, model: str, runs: list, path: Path) -> None:
    fig, axes = figure(13, 3.8, nrows=1, ncols=3)
    for ax, (key, title) in zip(axes, [("loss", "training loss (normalised)"),
                                       ("val_energy_mae", "validation energy MAE (eV)"),
                                       ("val_force_mae", "validation force MAE (eV/Å)")]):
        history_panel(ax, runs, key, title,
                      lambda run: f"{run['mode']} P={run['ways']}×{run.record.get('data_parallel', 1)}")
        if key == "loss":
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{dataset}: {model}")
    save(fig, path)


def section(runs: list, plots_dir: Path, rel) -> str:
    """Markdown of the atomic runs (empty string when there are none)."""
    if not runs:
        return ""
    groups = defaultdict(list)  # (dataset, kind): the runs of one model kind on one dataset
    for r in runs:
        groups[(r["dataset"], r["model"])].append(r)
    names = sorted({label(r) for r in runs})
    out = [f"## Atomic models ({', '.join(names)}; edge/triplet graph parallelism)", "",
           "Energies and forces of whole systems; mode `graph` splits each batch's edges over P ways "
           "(triplets follow their output edge) and D replicas take different batches. Metrics are "
           "OC20 S2EF on free atoms (eval.json): energy MAE per system, force MAE over components, "
           "force cosine per atom, EFwT = share of systems with |ΔE| < 0.02 eV and max |ΔF| < 0.03 eV/Å. "
           "*baseline*: per-element reference energies fitted on the training systems; *zero-force "
           "baseline*: predicting no force at all (the mean |F| component); both on the test systems. A model "
           "that beats **neither** has learnt nothing a practitioner could use. "
           "*predicted* bytes: the closed form of the model's kind (`AtomicModelKind.step_bytes`).", ""]
    for (ds, kind), members in groups.items():
        png = plots_dir / f"atomic_curves_{ds}_{kind}.png"
        model = " / ".join(sorted({label(r) for r in members}))
        plot_curves(ds, model, members, png)
        out += [f"### {ds}: {model}", "", md_table(HEADER, [run_row(r) for r in members]), "",
                f"![loss and validation MAE per epoch, {ds}, {model}]({rel(png)})", ""]
    return "\n".join(out)
