"""The report's section on atomic runs: S2EF metrics per run, bytes vs the closed form, curves.

One table per atomic dataset and model kind (DimeNet++, GemNet-T, ...: runs side by side: mode,
ways P × replicas D, parameters, epoch time, bytes measured and predicted, peak memory, energy
MAE beside the per-element baseline's, force MAE beside the zero-force baseline's, force cosine, EFwT
from ``eval.json``, and which baselines the model beats; beside a table whose float32 runs differ in
layout, a note that their metrics differ by rounding amplified by training, float64 being the
exactness check), and a
plot of the loss and the validation energy / force MAE against the epoch. A run is atomic when
its record says so (``extra.atomic``: its dataset is of kind ``atoms``).

IS2RS (``relax.json`` of the ``relax`` rule), per dataset: a table of every relaxed run (ADwT, FbT,
AFbT, relaxed-energy MAE, mean steps, converged share) and a plot of the two threshold curves whose
means are ADwT and AFbT; without a reference calculator, the ML relaxations' steps and energies.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from .plots import figure, history_panel, save
from .tables import DASH, fmt_bytes, fmt_s, md_table

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


def energy_only(run):
    """Why the run trained on energies alone (``extra.energy_only``: no forces in its data, or
    ``force_weight`` 0), or None."""
    return (run.record.get("extra") or {}).get("energy_only")


def verdict(energy, base_energy, force, base_force, only_energy: bool = False) -> str:
    """Which baselines the model beats (lower MAE); **neither** is marked. An energy-only run is
    judged on the energy alone, and says so."""
    if only_energy:
        if energy is None or base_energy is None:
            return "energy-only run"
        return "energy-only run: " + ("beats the energy baseline" if energy < base_energy
                                      else "**does not beat the energy baseline**")
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
            verdict(e, be, f, bf, energy_only(run) is not None)]


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


#: beside a table whose float32 runs differ in their layout (#37 item 15: energy MAE 0.81 / 0.87 / 0.60
#: single / edges P=2 / atoms P=2 after 20 epochs, equal to 1e-12 in float64)
FLOAT32_NOTE = ("*float32: a parallel layout sums the same terms in another order than one process, and "
                "training amplifies that rounding epoch after epoch, so float32 runs of different layouts end "
                "at different metrics: that is not a defect. float64 runs are the exactness check (every "
                "layout equals the single run to 1e-10: tests/test_atom_layout.py, tests/test_faults.py).*")


def float32_layouts(runs: list) -> bool:
    """Whether float32 runs of more than one layout (mode, P, D, atom layout) are compared."""
    return len({(r["mode"], r["ways"], r.record.get("data_parallel", 1), getattr(r.run_config, "atom_layout", None))
                for r in runs if r.record.get("dtype_bytes") == 4}) > 1


def sample_note(runs: list) -> list[str]:
    """Lines saying which runs' ``eval.json`` scored the training split on a sample (#37 item 20)."""
    def counts(run):
        ev = run.evaluation or {}
        return ev.get("train_systems_scored"), ev.get("train_systems")
    sampled = [(r, *counts(r)) for r in runs if None not in counts(r) and counts(r)[0] < counts(r)[1]]
    if not sampled:
        return []
    which = ", ".join(f"`{r.run_id}` {n:,} of {m:,}" for r, n, m in sampled)
    return [f"*The train_\\* metrics in eval.json score a seeded sample of the training systems ({which}: the "
            "model's `eval_train_systems`; `gnnpipe evaluate --train-systems all` scores every one); val and "
            "test are scored whole.*", ""]


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
        out += [f"### {ds}: {model}", "", md_table(HEADER, [run_row(r) for r in members]), ""]
        out += [FLOAT32_NOTE, ""] if float32_layouts(members) else []
        out += sample_note(members)
        only = [f"`{r.run_id}` ({energy_only(r)})" for r in members if energy_only(r)]
        if only:
            out += [f"Energy-only training: {', '.join(only)}: the loss is the energy term alone, no force pass "
                    "ran (no forces by autograd, no double backward) and no force metric exists.", ""]
        out += [f"![loss and validation MAE per epoch, {ds}, {model}]({rel(png)})", ""]
    out += is2rs_section(runs, plots_dir, rel)
    return "\n".join(out)


IS2RS_HEADER = ["run", "model", "mode", "systems", "optimizer, fmax, steps", "ADwT", "FbT", "AFbT",
                "energy MAE (eV)", "ML steps", "ML converged", "ref steps"]


def is2rs_row(run) -> list[str]:
    x = run.relax
    return [f"`{run.run_id}`", label(run), run["mode"], str(x["systems"]),
            f"{x['optimizer']}, {x['fmax']:g} eV/Å, {x['steps']}", _f(x.get("adwt"), ".3f"), _f(x.get("fbt"), ".3f"),
            _f(x.get("afbt"), ".3f"), _f(x.get("energy_mae")), _f(x.get("ml_steps_mean"), ".1f"),
            _f(x.get("ml_converged"), ".2f"), _f(x.get("ref_steps_mean"), ".1f")]


def plot_is2rs(dataset: str, runs: list, path: Path) -> None:
    """The share of systems below each threshold: ML-to-reference mean distance (its mean over
    the thresholds is ADwT) and the reference's largest force at the ML-relaxed structure (AFbT);
    without a reference, the steps each ML relaxation took."""
    import numpy as np

    from ..atomic.is2rs import ADWT_THRESHOLDS, AFBT_THRESHOLDS, threshold_curve

    def name(run):
        return f"{label(run)} {run['mode']} P={run['ways']}"

    runs = [r for r in runs if r.relax["per_system"]]  # a run that relaxed none: its table row says so
    with_ref = [r for r in runs if r.relax.get("reference")]
    if with_ref:
        fig, axes = figure(10, 3.6, nrows=1, ncols=2)
        for ax, key, t, title, unit in ((axes[0], "mean_distance", ADWT_THRESHOLDS, "ADwT", "Å"),
                                        (axes[1], "ref_fmax_at_ml", AFBT_THRESHOLDS, "AFbT", "eV/Å")):
            for run in with_ref:
                values = [row[key] for row in run.relax["per_system"]]
                ax.plot(t, threshold_curve(values, t), label=f"{name(run)} ({run.relax[title.lower()]:.2f})")
            ax.set_title(f"{title}: share of systems below the threshold")
            ax.set_xlabel(f"threshold ({unit})")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
    else:
        fig, ax = figure(6, 3.6)
        width = 0.8 / max(len(runs), 1)
        for k, run in enumerate(runs):
            steps = [row["ml_steps"] for row in run.relax["per_system"]]
            ax.bar(np.arange(len(steps)) + k * width, steps, width, label=name(run))
        ax.set_title("ML relaxation steps per system" + ("" if runs else ": none relaxed") +
                     (" (no reference calculator)" if runs else ""))
        ax.set_xlabel("test system")
        if runs:
            ax.legend(fontsize=7)
    fig.suptitle(f"{dataset}: IS2RS")
    save(fig, path)


def is2rs_section(runs: list, plots_dir: Path, rel) -> list[str]:
    relaxed = [r for r in runs if r.relax is not None]
    if not relaxed:
        return []
    out = ["### IS2RS: relaxations of test systems", "",
           "The first test systems of each run, every free atom rattled (seeded Gaussian), relaxed with the "
           "run's model (`GNNPipeCalculator`, one process: a graph-mode run's model is the same function, so "
           "it relaxes the same way) and with the reference calculator (EMT for generated data) from the same "
           "start. As OC20 / fairchem: **ADwT** = share of systems whose mean free-atom distance between the "
           "ML- and the reference-relaxed positions (minimum image) is below each threshold of 0.01 ... 0.5 Å, "
           "averaged; **FbT** = share of ML-relaxed structures whose largest reference force on a free atom is "
           "below 0.05 eV/Å; **AFbT** = FbT averaged over 0.01 ... 0.4 eV/Å; energy MAE = |E_ML(ML-relaxed) - "
           "E_ref(reference-relaxed)|. relax.json holds the per-system figures; trajectories are in "
           "`runs/<run_id>/relax/`.", ""]
    groups = defaultdict(list)
    for r in relaxed:
        groups[r["dataset"]].append(r)
    for ds, members in groups.items():
        png = plots_dir / f"is2rs_{ds}.png"
        plot_is2rs(ds, members, png)
        notes = sorted({r.relax["note"] for r in members if r.relax.get("note")})
        out += [f"#### {ds}", "", md_table(IS2RS_HEADER, [is2rs_row(r) for r in members]), ""]
        out += [f"*{n}*" for n in notes] + ([""] if notes else [])
        out += [f"![IS2RS threshold curves, {ds}]({rel(png)})", ""]
    return out
