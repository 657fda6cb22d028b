"""Where a workflow's time went: the report's stages table, from Snakemake's benchmark files.

Every rule of the workflow has a ``benchmark:`` file, ``results/benchmarks/<rule>/<job>.tsv``
(``<job>``: the job's wildcards, e.g. ``synth-gcn2-single-p1-seed0`` or ``synth/metis-2``), which
Snakemake writes when the job ends, in its own format: a header line, then one row per repeat
(``benchmark: repeat(...)``), tab-separated::

    s       h:m:s   max_rss max_vms max_uss max_pss io_in   io_out  mean_load       cpu_time
    3.8123  0:00:03 251.02  1210.7  240.1   241.6   0.00    1.27    88.21   3.35

``s`` is the job's wall time, ``max_rss`` its peak resident set in MB and ``cpu_time`` its CPU
seconds (both summed over the job's processes, torchrun's workers included); a job faster than
Snakemake's first sample has ``NA`` there. A job's figures are the mean over its repeats. On a
loaded machine the CPU seconds move less than the wall time: the table gives both.

A node run's exact evaluation is no job of its own: its train job runs it after training
(``train.evaluate_finished``) and its run record says how long it took (``evaluate_s``,
``evaluate_cpu_s``). :func:`evaluations_in_training` moves those seconds out of the train rule's
figures into an ``evaluate`` row marked *in train* (no peak RSS of its own: the train job's).

The table: per rule, its jobs, their summed wall seconds and the largest peak RSS; then the
set-up stages (every rule but ``train``, and ``relax``: IS2RS, a task of its own after training)
summed against the training jobs', and their ratio against issue #36's bound (set-up ≤ 0.5×
training). A train job's wall time includes its own start-up (imports, the launcher's plan check),
so the ratio counts start-up as training: it is what a user waits for either way. Then the
issue's bounds on single stages (:func:`stage_bounds`: a calibrate job ≤ 0.1× a train job, an
evaluate job ≤ 2 epochs of its run, the report ≤ 10 s), each saying why when over.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from ..io import GnnPipeError

#: Issue #36: the stages that are not training cost, summed, at most this many times the training.
SETUP_BOUND = 0.5
#: ... a calibrate job at most this many times a train job (their means), an evaluate job at most
#: EVALUATE_BOUND_EPOCHS epochs of the run it evaluates, and the report at most REPORT_BOUND_S
#: seconds a job (issue #36: for ten runs, plots included).
CALIBRATE_BOUND = 0.1
EVALUATE_BOUND_EPOCHS = 2.0
REPORT_BOUND_S = 10.0
#: Why a stage over its bound costs what it does, and what the user can do about it.
OVER_BECAUSE = {
    "calibrate": ("a first fit fits the layers its train jobs timed as they trained and imports no torch, "
                  "unless no one-process run of that dataset and model recorded them (an older record, "
                  "several threads a worker): then it times every distinct conv of the model, forward and "
                  "backward, on blocks of the real graph, cold and warm, after importing torch (and the "
                  "cold pass alone where no parallel run recorded its workers); a fit found in "
                  "results/calibration_cache costs only its start-up, and `cost_model.calibrate: false` "
                  "skips it (the report then says the cost model is uncalibrated)"),
    "evaluate": ("the exact pass reads the whole graph again and builds the whole model in one process "
                 "(rank 0 of the train job), then runs its forward pass on every node; an epoch of a "
                 "model-parallel run is only each worker's share, and a small model's epoch costs less "
                 "than reading the graph"),
    # an evaluate job of its own (a workflow before #36 moved node runs' evaluation into training)
    "evaluate job": ("each is a process of its own: it imports torch, loads the graph and the checkpoint and "
                     "runs one exact full-graph pass, and imports MLflow's client and store (on a thread "
                     "meanwhile) to log the result; an epoch is only the training pass"),
    "report": ("it draws the plots (matplotlib: every figure laid out and rendered), and without the "
               "workflow's predictions file (rule cost_predictions) it imports torch and builds each run's "
               "model to predict its epoch with the cost model"),
}
TRAINING = frozenset({"train"})
#: Neither set-up nor training: relaxations with the trained model (IS2RS) are a task of their own.
AFTER_TRAINING = frozenset({"relax"})
#: Rules with one job per run, named by the run id: files of runs the report is not about are left out.
PER_RUN = frozenset({"run_config", "train", "evaluate", "evaluate_atomic", "relax"})


@dataclass
class Stage:
    rule: str
    jobs: int = 0
    seconds: float = 0.0
    max_rss_mb: Optional[float] = None  # None: no job of the rule lived long enough to be sampled
    cpu_s: float = 0.0  # the sampled jobs' CPU seconds
    job_seconds: dict = field(default_factory=dict)  # each job's wall seconds, by its file's name (a run id)
    inside: Optional[str] = None  # the rule whose jobs ran this stage (evaluate: train), else its own jobs

    @property
    def kind(self) -> str:
        return ("training" if self.rule in TRAINING else "after training" if self.rule in AFTER_TRAINING
                else "set-up")


def _number(text: str) -> Optional[float]:
    if text in ("NA", "-", ""):
        return None
    x = float(text)
    return x if math.isfinite(x) else None


def read_benchmark(path: Path) -> tuple[float, Optional[float], float]:
    """One job's ``(wall seconds, peak RSS MB or None, CPU seconds)``: the mean over the file's repeats
    (CPU 0 for a job ended before the first sample)."""
    fix = "; delete it and rerun the workflow (Snakemake writes it again)"
    try:
        rows = list(csv.DictReader(path.read_text().splitlines(), delimiter="\t"))
    except OSError as e:
        raise GnnPipeError(f"{path}: unreadable benchmark file ({e.strerror or e})") from None
    if not rows or any(c not in rows[0] for c in ("s", "max_rss", "cpu_time")):
        raise GnnPipeError(f"{path}: not a Snakemake benchmark file (a header with s, max_rss and cpu_time, "
                           f"then a row per repeat){fix}")
    try:
        wall = [_number(r["s"]) for r in rows]
        rss = [x for x in (_number(r["max_rss"]) for r in rows) if x is not None]
        cpu = [_number(r["cpu_time"]) or 0.0 for r in rows]
    except (TypeError, ValueError):
        raise GnnPipeError(f"{path}: a row's s, max_rss or cpu_time is not a number{fix}") from None
    if any(w is None for w in wall):
        raise GnnPipeError(f"{path}: a row without its wall time (s){fix}")
    return sum(wall) / len(wall), (sum(rss) / len(rss) if rss else None), sum(cpu) / len(cpu)


def collect(bench_dir: Path, run_ids: Optional[Iterable[str]] = None) -> list[Stage]:
    """Per rule (the directory under ``bench_dir``), its jobs' summed wall time and largest peak RSS,
    in the order of the rules' first appearance in a workflow (data, partitions, runs, report).
    ``run_ids``: the runs reported on; a per-run rule's file of another run is left out."""
    keep = None if run_ids is None else set(run_ids)
    stages: dict[str, Stage] = {}
    for path in sorted(Path(bench_dir).glob("*/**/*.tsv")):
        rule = path.relative_to(bench_dir).parts[0]
        if keep is not None and rule in PER_RUN and path.stem not in keep:
            continue
        wall, rss, cpu = read_benchmark(path)
        st = stages.setdefault(rule, Stage(rule))
        st.jobs += 1
        st.seconds += wall
        st.cpu_s += cpu
        st.job_seconds[path.stem] = wall
        if rss is not None:
            st.max_rss_mb = rss if st.max_rss_mb is None else max(st.max_rss_mb, rss)
    return _in_rule_order(stages.values())


def evaluations_in_training(stages: list[Stage], evaluations: dict) -> list[Stage]:
    """``stages`` with the train jobs' own evaluations (``evaluations``: run id -> ``(wall s, CPU s)``,
    the run records' ``evaluate_s`` and ``evaluate_cpu_s``) as an ``evaluate`` stage *inside* train:
    their seconds leave the train rule's figures (its jobs' wall time holds them) and count as set-up,
    as an evaluate job of their own did. A run with an evaluate job's file keeps that job's figures."""
    by = {s.rule: s for s in stages}
    train = by.get("train")
    if train is None:
        return stages
    own = by["evaluate"].job_seconds if "evaluate" in by else {}
    moved = {run: t for run, t in evaluations.items() if run in train.job_seconds and run not in own}
    if not moved:
        return stages
    ev = by.get("evaluate") or Stage("evaluate")
    ev.inside = "train" if not own else None
    for run, (wall, cpu) in moved.items():
        ev.jobs += 1
        ev.seconds += wall
        ev.cpu_s += cpu
        ev.job_seconds[run] = wall
        train.seconds -= wall
        train.cpu_s = max(train.cpu_s - cpu, 0.0)
        train.job_seconds[run] -= wall
    return _in_rule_order({**by, "evaluate": ev}.values())


RULE_ORDER = ("dataset_spec", "build_graph", "build_systems", "atom_graphs", "partition", "materialize",
              "locality", "run_config", "train", "evaluate", "evaluate_atomic", "relax", "plan_stats",
              "calibrate", "cost_predictions", "report")


def _in_rule_order(stages: Iterable[Stage]) -> list[Stage]:
    """The stages in the workflow's order (:data:`RULE_ORDER`), rules it does not list last by name."""
    order = {r: i for i, r in enumerate(RULE_ORDER)}
    return sorted(stages, key=lambda s: (order.get(s.rule, len(order)), s.rule))


def _s(x: float) -> str:
    return f"{x:.1f}"


def stages_section(stages: list[Stage], bench_dir: str, epochs: Optional[dict] = None) -> str:
    """The report's "Stages" section: the table, the set-up ÷ training ratio and the bound, and
    single stages against theirs (:func:`stage_bounds`; ``epochs``: each run's epoch seconds)."""
    if not stages:
        return (f"No benchmark files under `{bench_dir}` (the workflow's rules write them: "
                "`results/benchmarks/<rule>/<job>.tsv`), so no stage times.")
    rows = [f"| {s.rule}{f' (in {s.inside})' if s.inside else ''} | {s.kind} | {s.jobs} | {_s(s.seconds)} | {_s(s.cpu_s)} | "
            f"{'—' if s.max_rss_mb is None else f'{s.max_rss_mb:.0f}'} |" for s in stages]
    setup = sum(s.seconds for s in stages if s.kind == "set-up")
    training = sum(s.seconds for s in stages if s.kind == "training")
    cpu = {k: sum(s.cpu_s for s in stages if s.kind == k) for k in ("set-up", "training")}
    top = sorted((s for s in stages if s.kind == "set-up"), key=lambda s: -s.seconds)[:3]
    if training <= 0:
        verdict = "No training job was measured: no ratio."
    else:
        r = setup / training
        verdict = (f"Set-up {_s(setup)} s ÷ training {_s(training)} s = **{r:.2f}×** "
                   + (f"(within the bound of {SETUP_BOUND}×)." if r <= SETUP_BOUND else
                      f"(**over the bound of {SETUP_BOUND}×**; the largest set-up stages: "
                      + ", ".join(f"{s.rule} {_s(s.seconds)} s" for s in top) + ")."))
        if cpu["training"] > 0:
            verdict += f" In CPU seconds: {_s(cpu['set-up'])} ÷ {_s(cpu['training'])} = {cpu['set-up'] / cpu['training']:.2f}×."
    return "\n".join([
        *_intro(bench_dir),
        "",
        "| rule | stage | jobs | wall s (sum) | CPU s (sum) | peak RSS MB (max) |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        verdict,
        *stage_bounds(stages, epochs),
    ])


def stage_bounds(stages: list[Stage], epochs: Optional[dict] = None) -> list[str]:
    """Issue #36's bounds on single stages, each with its figure and, when over, why: a calibrate
    job ≤ :data:`CALIBRATE_BOUND` × a train job (means over their jobs), an evaluate job ≤
    :data:`EVALUATE_BOUND_EPOCHS` epochs of its run (``epochs``: run id -> epoch seconds; runs
    without one are left out), the report ≤ :data:`REPORT_BOUND_S` s a job. Lines of Markdown (a
    list), none where a stage was not run."""
    by = {s.rule: s for s in stages if s.jobs}
    out = []
    ev = by.get("evaluate")
    ratios = {} if ev is None else {run: wall / epochs[run] for run, wall in ev.job_seconds.items()
                                     if (epochs or {}).get(run)}
    if ratios:
        worst = max(ratios, key=ratios.get)
        over = sum(r > EVALUATE_BOUND_EPOCHS for r in ratios.values())
        out.append(f"* evaluate: {over} of {len(ratios)} jobs over {EVALUATE_BOUND_EPOCHS:g} epochs of their run "
                   f"(the most: {worst}, {_s(ev.job_seconds[worst])} s = {ratios[worst]:.1f} epochs)"
                   + (f"; **over**: {OVER_BECAUSE['evaluate' if ev.inside else 'evaluate job']}." if over
                      else ", within."))
    cal, train = by.get("calibrate"), by.get("train")
    if cal is not None and train is not None and train.seconds > 0:
        c, t = cal.seconds / cal.jobs, train.seconds / train.jobs
        out.append(f"* calibrate: {_s(c)} s a job = {c / t:.2f}× a train job's {_s(t)} s (bound "
                   f"{CALIBRATE_BOUND}×)" + (f"; **over**: {OVER_BECAUSE['calibrate']}." if c > CALIBRATE_BOUND * t
                                            else ", within."))
    rep = by.get("report")
    if rep is not None:
        r = rep.seconds / rep.jobs
        out.append(f"* report: {_s(r)} s (bound {_s(REPORT_BOUND_S)} s)"
                   + (f"; **over**: {OVER_BECAUSE['report']}." if r > REPORT_BOUND_S else ", within."))
    return ["", "Single stages against their bounds:", "", *out] if out else []


def _intro(bench_dir: str) -> list[str]:
    return [
        f"Wall time, CPU time and peak resident memory of every job, from Snakemake's benchmark files (`{bench_dir}`; "
        "a job's processes summed, MB; — where a job ended before the first sample). *Set-up* is every "
        "stage but training (and IS2RS relaxations after it); a train job's time includes its own start-up. "
        "An *(in train)* row is a stage the train jobs ran after training (a node run's exact evaluation, timed "
        "in its run record): its seconds are taken out of train's. "
        "The report's own row, if any, is its previous run's. Issue #36 asks set-up ≤ "
        f"{SETUP_BOUND}× training."]
