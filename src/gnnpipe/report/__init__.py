"""``results/report.md`` and ``results/plots/*.png``: every run of a workflow, side by side.

    gnnpipe report --runs-dir results/runs --out results/report.md --plots results/plots

Input: each run directory's ``metrics.json`` (the run record, docs/DESIGN.md §6) and, when
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
* every run next to the cost model's prediction (``gnnpipe.planning.plan.predict_layout`` on the
  run's graph statistics (the workflow's ``plan_stats`` rule) and a hardware profile, default
  ``cpu-2core``): predicted bytes, epoch time, its compute / comm / bubble split and peak
  memory, each with its relative error to the measured figure; a run whose
  prediction fails (no run.yaml, no graph file, ...) is listed with the reason;
* time to accuracy (:mod:`.timing`): per run, the epochs and the summed epoch wall time to
  reach the single-process reference's best validation accuracy less 1 point (or "not
  reached"), seeds pooled per layout, a plot of validation accuracy against training time
  per dataset × model, and which runs' training jobs overlapped in time (``started_at`` /
  ``finished_at``): wall clock compares only runs that had the machine to themselves;
* per dataset × model whose pipeline / hybrid runs differ in a convergence technique
  (shuffle, grad correction, snapshot, momentum: an ablation), a table "Pipeline
  techniques": each run's settings from its run.yaml, test accuracy and Δ to the
  single-process reference (seeds pooled); left out when no model has such runs;
* where the workflow's time went (:mod:`.stages`, with ``benchmarks_dir``): per rule, its jobs'
  summed wall time and peak memory from Snakemake's benchmark files, set-up against training;
* plots (matplotlib, Agg canvas, no pyplot state): loss and accuracy curves per
  dataset × model with a line per run, bytes per epoch, epoch-time split, and per
  dataset × model bytes vs P and epoch time vs P per mode (measured and predicted) and
  loss / test accuracy per mode and layout (mean over seeds, ± std band).

Every file is written atomically. The modules: :mod:`.records` (run records, seeds
pooled), :mod:`.predictions` (the cost model's), :mod:`.timing` (time to accuracy,
overlapping runs), :mod:`.tables` (the Markdown), :mod:`.stages` (the stages table), :mod:`.plots`; atomic runs' section is :mod:`.atomic`.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

from ..io import GnnPipeError, write_text
from . import atomic as atomic_report, stages as stage_times, timing
from .plots import plot_bytes, plot_curves, plot_mode_curves, plot_time_to_accuracy, plot_times, plot_vs_workers
from .predictions import DEFAULT_HARDWARE, Prediction, PredictionsFile, Predictor
from .records import Run, aggregate, load_runs
from .tables import (PREDICTION_HEADER, RUN_HEADER, TECHNIQUES_INTRO, TTA_INTRO, datasets_table, group_section,
                     group_slug, group_title, has_technique_ablation, md_table, overlap_note, pooled_section,
                     prediction_row, run_row, techniques_section, tta_section)


def count_line(runs: list[Run], atomic: int) -> str:
    """The report's first line: every run it holds and their datasets, node and atomic alike."""
    n = len(runs)
    split = "" if not atomic else (" (all atomic)" if atomic == n else f" ({n - atomic} node, {atomic} atomic)")
    return f"{n} runs{split} over {len({r['dataset'] for r in runs})} dataset(s)."


def build_report(run_dirs: list[Path], out_md: Path, plots_dir: Path, *,
                 hardware=DEFAULT_HARDWARE, predict: bool = True, cost_model_dir=None,
                 benchmarks_dir=None, predictions=None) -> None:
    """Read the runs in ``run_dirs`` and write ``out_md`` and the PNGs in ``plots_dir``.

    ``hardware``: the profile (name, path or ``costmodel.Hardware``) the cost model
    predicts each run on; ``cost_model_dir``: the workflow's partition statistics and
    calibrated profiles (``Predictor``); ``predict=False`` leaves the predictions out
    (marked so); ``benchmarks_dir``: the workflow's benchmark files (``results/benchmarks``), for the
    stages table (:mod:`.stages`; left out without it); ``predictions``: the file of the runs'
    predictions made beforehand (``gnnpipe predict-costs``, :func:`.predictions.write_predictions`),
    read instead of predicting here (``hardware`` and ``cost_model_dir`` are then the file's: no torch)."""
    if not run_dirs:
        raise GnnPipeError("no runs to report on")

    runs = load_runs([Path(d) for d in run_dirs])
    out_md, plots_dir = Path(out_md), Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    rel = lambda p: Path(os.path.relpath(p, out_md.parent)).as_posix()  # noqa: E731
    overlap = timing.overlaps(runs)  # every run trained, atomic ones included
    atomic_runs = [r for r in runs if atomic_report.is_atomic(r)]
    atomic = atomic_report.section(atomic_runs, plots_dir, rel)
    count = count_line(runs, len(atomic_runs))
    stages = [] if benchmarks_dir is None else [
        "## Stages", "",
        stage_times.stages_section(_stages(Path(benchmarks_dir), run_dirs, runs), str(benchmarks_dir),
                                   {r.run_id: r["epoch_time_s"] for r in runs}), ""]
    runs = [r for r in runs if not atomic_report.is_atomic(r)]
    if not runs:
        write_text(out_md, "\n".join(["# GNNPipe report", "", count, "", *stages, atomic]))
        return

    if predict:
        predictor = PredictionsFile(predictions) if predictions is not None else Predictor(hardware, cost_model_dir)
        predictions = {r.run_id: predictor(r) for r in runs}
        hw_name = f"hardware profile `{predictor.name}`"
        if predictor.calibrated:
            hw_name += (" with its compute rates fitted to each dataset and model on this machine "
                        f"({', '.join(f'`{n}`' for n in sorted(predictor.calibrated))}; rule calibrate, "
                        "`gnnpipe calibrate`)")
        else:
            hw_name += (" with the profile's own compute rates: the cost model is uncalibrated "
                        "(no profile fitted to these runs' graph and model on this machine; "
                        "`cost_model.calibrate: true`, or `gnnpipe calibrate`)")
    else:
        hw_name = None
        predictions = {r.run_id: Prediction(reason="predictions switched off") for r in runs}
    aggs = aggregate(runs, predictions)

    groups: dict[tuple, list[Run]] = defaultdict(list)
    for run in runs:
        groups[run.group].append(run)
    sections, technique_tables, tta_sections = [], [], []
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
        tta_png = plots_dir / f"tta_{slug}.png"
        plot_time_to_accuracy(group, g_aggs, timing.target_of([r for r in members if r["mode"] == "single"]),
                              tta_png)
        tta_sections.append(tta_section(group, members, g_aggs, overlap, rel(tta_png)))
        if has_technique_ablation(members):
            technique_tables.append(techniques_section(group, members, g_aggs))
    plot_bytes(runs, plots_dir / "comm_bytes.png")
    plot_times(runs, plots_dir / "epoch_time.png")

    n_eval = sum(r.evaluation is not None for r in runs)
    n_pred = sum(p.available for p in predictions.values())
    text = "\n".join([
        "# GNNPipe report",
        "",
        f"{count} Epoch times are "
        "medians over the timed epochs (wall time of the slowest rank; the split is the mean over "
        "ranks); bytes are sent per epoch, summed over ranks, training traffic only; "
        "*predicted* is the closed form of docs/DESIGN.md §4; peak memory is the maximum over ranks. "
        f"Accuracies come from exact full-graph inference of the final model (eval.json, {n_eval} "
        f"of {len(runs)} runs), else from the run record.",
        "",
        "## Datasets",
        "",
        datasets_table(runs),
        "",
        *stages,
        "## All runs",
        "",
        md_table(RUN_HEADER, [run_row(r) for r in runs]),
        "",
        "## Time to accuracy",
        "",
        TTA_INTRO,
        "",
        overlap_note(overlap),
        "",
        *tta_sections,
        "## Measured vs cost model",
        "",
        (f"The cost model (gnnpipe.planning.plan.predict_layout, on each graph's partition statistics) "
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


def _stages(benchmarks_dir: Path, run_dirs, runs: list[Run]) -> list:
    """The workflow's stages from its benchmark files, the train jobs' own evaluations (their run
    records' ``evaluate_s``) counted as the evaluate stage (:func:`.stages.evaluations_in_training`)."""
    collected = stage_times.collect(benchmarks_dir, [Path(d).name for d in run_dirs])
    evaluations = {r.run_id: (float(r.record["evaluate_s"]), float(r.record.get("evaluate_cpu_s") or 0.0))
                   for r in runs if r.record.get("evaluate_s") is not None}
    return stage_times.evaluations_in_training(collected, evaluations)
