"""The report's Markdown: cell formats, the tables over all runs, per dataset × model
(graph ÷ model-parallel ratios), measured vs the cost model, seeds pooled, the pipeline
techniques' ablation and time to accuracy."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from . import timing
from .predictions import Prediction, rel_error
from .records import MODE_ORDER, SPLITS, Aggregate, Run, mean_std, techniques, techniques_off

DASH = "—"


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


def fmt_err(x: Optional[float]) -> str:
    if x is None:
        return DASH
    return "∞" if math.isinf(x) else f"{100 * x:+.1f} %"


def fmt_mean_std(values, fmt=fmt_acc) -> str:
    m, sd, n = mean_std(values)
    if m is None:
        return DASH
    return f"{fmt(m)} ± {fmt(sd)}" if sd is not None else fmt(m)


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
RUN_HEADER = ["run", "mode", "dataset", "model", "layers", "workers", "S×G", "chunks", "parts: nodes / edges",
              "epoch", "compute", "comm", "bubble", "bytes/epoch", "predicted", "meas ÷ pred", "peak mem",
              "test acc"]


def balance_cell(run: Run) -> str:
    """The run's partition balance, largest part over the mean in nodes and in in-edges, and what
    it was balanced in: ``1.03 / 1.02 (nodes+edges)``; "—" for a single run (or an older record)."""
    pt = run.record.get("partition")
    if not pt:
        return DASH
    return f"{pt['node_balance']:.2f} / {pt['edge_balance']:.2f} ({pt['balance']})"


def run_row(run: Run) -> list[str]:
    r = run.record
    chunks = str(r["chunks"]) if r["mode"] in ("pipeline", "hybrid") else DASH
    return [f"`{run.run_id}`", r["mode"], r["dataset"], r["model"], str(r["layers"]),
            str(r["world_size"]), layout(run), chunks, balance_cell(run), fmt_s(r["epoch_time_s"]),
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


# --------------------------------------------------------------------------- measured vs cost model
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
    parts = ["Over seeds (mean ± sample std; the cost model predicts each layout once):", "",
             md_table(SEEDS_HEADER, [seeds_row(a) for a in aggs]), ""]
    pairs = aggregate_comparisons(aggs)
    if pairs:
        parts += ["Seed means, graph ÷ model-parallel at equal workers, measured and predicted "
                  "(> 1: the model-parallel layout is faster / moves fewer bytes):", "",
                  md_table(POOLED_RATIO_HEADER, [pooled_ratio_row(g, o) for g, o in pairs]), ""]
    return "\n".join(parts)


# --------------------------------------------------------------------------- pipeline techniques
#: The pipeline's convergence techniques (docs/DESIGN.md §4, ``PipelineConfig``) as table columns.
TECHNIQUES_HEADER = ["run", "S×G", "chunks", "shuffle", "grad correction", "snapshot", "momentum",
                     "test acc", "Δ test vs single (pt)"]


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
    "(docs/DESIGN.md §4; the `pipeline:` block of the run's run.yaml) are not all set alike, as in "
    "an ablation (config/experiments/ablation.yaml): shuffle = a new chunk order every epoch, "
    "grad correction = stale gradients dropped and fresh cross-chunk ones scaled (×scale), "
    "snapshot = not-yet-computed rows read from a snapshot refreshed every N epochs, "
    "momentum = moving average of the history. The first row is the single-process reference "
    "(its seeds pooled: mean ± sample std), then every technique on, then by how many are off; "
    "Δ is the run's test accuracy minus the reference's mean, in percentage points. A run "
    "without a readable run.yaml shows — for its settings. Models whose pipeline runs all share "
    "one setting have no table here (the section is left out when none has one).")


# --------------------------------------------------------------------------- time to accuracy
TTA_HEADER = ["run", "mode", "S×G", "chunks", "techniques", "target val acc", "best val acc",
              "epochs to target", "time to target", "single ÷ run", "job", "overlapped with"]
TTA_POOLED_HEADER = ["mode", "S×G", "chunks", "techniques", "seeds", "reached", "epochs to target",
                     "time to target", "single ÷ layout"]


def _overlap_cell(others: Optional[list[str]]) -> str:
    if others is None:
        return "unknown"
    if not others:
        return "none"
    return ", ".join(f"`{o}`" for o in others[:3]) + (f" (+{len(others) - 3})" if len(others) > 3 else "")


def tta_row(run: Run, singles: list[Run], overlap: Optional[list[str]]) -> list[str]:
    target, reached, ref_s = timing.to_target(run, singles)
    r = run.record
    return [f"`{run.run_id}`", r["mode"], layout(run), str(r["chunks"]) if r["mode"] in ("pipeline", "hybrid") else DASH,
            timing.techniques_short(run) or DASH, fmt_acc(target), fmt_acc(timing.best_val(run)),
            DASH if target is None else (str(reached.epochs) if reached.epochs else "not reached"),
            DASH if target is None else (fmt_s(reached.seconds) if reached.epochs else "not reached"),
            fmt_ratio(ratio(ref_s, reached.seconds)), fmt_s(timing.job_seconds(run)), _overlap_cell(overlap)]


def tta_pooled_row(agg: Aggregate, singles: list[Run]) -> list[str]:
    got = [timing.to_target(r, singles) for r in agg.runs]
    done = [(reached, ref_s) for target, reached, ref_s in got if reached.epochs is not None]
    has_target = any(target is not None for target, _, _ in got)
    secs = [reached.seconds for reached, _ in done]
    refs = [ref_s for _, ref_s in done if ref_s is not None]
    return [agg["mode"], layout(agg.first), str(agg["chunks"]) if agg["mode"] in ("pipeline", "hybrid") else DASH,
            timing.techniques_short(agg) or DASH, str(len(agg.runs)),
            f"{len(done)} of {len(agg.runs)}" if has_target else DASH,
            fmt_mean_std([reached.epochs for reached, _ in done], lambda x: f"{x:.3g}"),
            fmt_mean_std(secs, fmt_s),
            fmt_ratio(ratio(mean_std(refs)[0], mean_std(secs)[0]) if len(refs) == len(secs) else None)]


def tta_section(group: tuple, runs: list[Run], aggs: list[Aggregate], overlap: dict, plot: Optional[str]) -> str:
    """One dataset × model's time-to-accuracy table (a row per run), its seeds pooled when a
    layout has several, and the plot of validation accuracy against training time."""
    singles = [r for r in runs if r["mode"] == "single"]
    parts = [f"### Time to accuracy: {group_title(group)}", ""]
    if not singles:
        parts += ["No single-process run of this model: no target.", ""]
    parts += [md_table(TTA_HEADER, [tta_row(r, singles, overlap.get(r.run_id)) for r in runs]), ""]
    if any(len(a.runs) > 1 for a in aggs):
        parts += ["Over seeds (each run against its own seed's reference; mean ± sample std of the runs that "
                  "reached it):", "", md_table(TTA_POOLED_HEADER, [tta_pooled_row(a, singles) for a in aggs]), ""]
    if plot:
        parts += [f"![validation accuracy vs training time, {group_title(group)}]({plot})", ""]
    return "\n".join(parts)


def overlap_note(overlap: dict) -> str:
    """One paragraph: which runs' training jobs ran at the same time (or that none did)."""
    unknown = sorted(rid for rid, o in overlap.items() if o is None)
    hit = sorted(rid for rid, o in overlap.items() if o)
    out = []
    if hit:
        out.append(f"**Training overlapped in time for {len(hit)} of {len(overlap)} runs** ("
                   + ", ".join(f"`{rid}`" for rid in hit) + "): their wall-clock figures, here and in every "
                   "epoch-time column, are not comparable with the others'. The workflow's train jobs take "
                   "every core when run on one machine, so this comes from jobs started by hand, "
                   "`--set-threads train=…`, or two workflows at once.")
    elif len(unknown) < len(overlap):
        out.append("No two runs' training jobs overlapped in time (each record's `started_at` … `finished_at`).")
    if unknown:
        out.append(f"{len(unknown)} run(s) have no `started_at` / `finished_at` (trained by an older gnnpipe): "
                   "whether they overlapped is unknown.")
    out.append("Only the runs reported here are compared; other load on the machine is not seen.")
    return " ".join(out)


TTA_INTRO = (
    "Per run, the epochs and the wall-clock training time to reach the single-process reference's "
    "best validation accuracy less 1 point (*target*; the reference is the single run of the same "
    "dataset × model and seed, else the mean of its single runs' best). Validation accuracy is exact "
    "inference at the evaluated epochs (`training.eval_every`), so *epochs to target* is the first "
    "evaluated epoch at or past the target. *Time to target* sums those epochs' wall times (the slowest "
    "rank's): training only, without set-up (loading, the pipeline's warm-start forward) or the "
    "evaluations; *job* is the whole training job (`finished_at − started_at`). *single ÷ run*: the "
    "reference's time to the same target over this run's (> 1: this run gets there sooner).")
