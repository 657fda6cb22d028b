"""Time to accuracy, and which runs trained at the same time.

Per-epoch time is not what a user needs: a mode can run its epochs faster and still take
longer to learn (the GNNPipe authors' own Reddit logs show the pipeline at 0.37 s vs 0.64 s
per epoch, both near chance at epoch 50). So, per run:

* **target**: the single-process reference's best validation accuracy (exact inference, at
  its evaluated epochs) less :data:`MARGIN`. The reference is the single run of the same
  dataset × model and seed; without one, the mean of the best over its single runs.
* **epochs to target**: the epochs trained when the run's validation accuracy first reached
  the target. Accuracy exists only at evaluated epochs (``training.eval_every``), so this is
  the first evaluated epoch at or past it, an upper bound at that granularity.
* **time to target**: the wall time of those epochs, summed (each epoch's time is the slowest
  rank's, as in the epoch-time columns): training only, without the set-up (loading, the
  pipeline's warm-start forward) or the evaluations. The job's whole wall time is
  ``finished_at − started_at`` of the run record.

Wall clock is only comparable between runs that had the machine to themselves: runs whose
``[started_at, finished_at]`` intervals intersect are reported as overlapping
(:func:`overlaps`).
"""

from __future__ import annotations

import datetime
import statistics
from dataclasses import dataclass
from typing import Optional

from .records import Aggregate, Run, techniques

#: The target is the reference's best validation accuracy less this (1 point).
MARGIN = 0.01
_EPS = 1e-9  # a run reaching exactly its own best is at its target


def best_val(run: Run) -> Optional[float]:
    """The best validation accuracy of the run's evaluated epochs; None without any."""
    vals = [h["val_acc"] for h in run["history"] if h.get("val_acc") is not None]
    return max(vals) if vals else None


def references(run: Run, singles: list[Run]) -> list[Run]:
    """The single-process runs ``run`` is measured against: those of its own seed if any,
    else every single run of its dataset × model (``singles``)."""
    same = [s for s in singles if run.seed is not None and s.seed == run.seed]
    return same or singles


def target_of(refs: list[Run]) -> Optional[float]:
    bests = [b for b in map(best_val, refs) if b is not None]
    return statistics.fmean(bests) - MARGIN if bests else None


@dataclass(frozen=True)
class Reached:
    """When a run first reached a validation accuracy: ``epochs`` trained and ``seconds`` of
    training wall time by then; both None when it never did."""

    epochs: Optional[int]
    seconds: Optional[float]


def time_to(run: Run, target: float) -> Reached:
    """Epochs and summed epoch wall time until ``run``'s validation accuracy first reaches ``target``."""
    elapsed = 0.0
    for h in sorted(run["history"], key=lambda h: h["epoch"]):
        elapsed += h["epoch_time_s"]
        if h.get("val_acc") is not None and h["val_acc"] >= target - _EPS:
            return Reached(h["epoch"] + 1, elapsed)
    return Reached(None, None)


def to_target(run: Run, singles: list[Run]) -> tuple[Optional[float], Reached, Optional[float]]:
    """``run`` against its reference among ``singles`` (the single runs of its dataset × model):
    (target, when ``run`` reached it, the reference's mean time to the same target); the
    target is None without a reference."""
    refs = references(run, singles)
    target = target_of(refs)
    if target is None:
        return None, Reached(None, None), None
    ref_s = [s for s in (time_to(r, target).seconds for r in refs) if s is not None]
    return target, time_to(run, target), (statistics.fmean(ref_s) if ref_s else None)


def curve(runs: list[Run]) -> list[tuple[float, float]]:
    """(training seconds, validation accuracy) at the epochs every run of ``runs`` evaluated,
    both the mean over the runs (seeds): what the time-to-accuracy plot draws."""
    per = []
    for run in runs:
        elapsed, pts = 0.0, {}
        for h in sorted(run["history"], key=lambda h: h["epoch"]):
            elapsed += h["epoch_time_s"]
            if h.get("val_acc") is not None:
                pts[h["epoch"]] = (elapsed, h["val_acc"])
        per.append(pts)
    epochs = sorted(set.intersection(*(set(p) for p in per))) if per else []
    return [(statistics.fmean(p[e][0] for p in per), statistics.fmean(p[e][1] for p in per)) for e in epochs]


# --------------------------------------------------------------------------- overlap
def _when(run: Run) -> Optional[tuple[datetime.datetime, datetime.datetime]]:
    """The training job's start and end (UTC when the record gives no offset); None without them."""
    try:
        start, end = (datetime.datetime.fromisoformat(run.record[k]) for k in ("started_at", "finished_at"))
    except (KeyError, TypeError, ValueError):
        return None
    utc = lambda t: t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)  # noqa: E731
    return utc(start), utc(end)


def job_seconds(run: Run) -> Optional[float]:
    """The training job's wall time (``finished_at − started_at``: set-up and evaluations included)."""
    when = _when(run)
    return (when[1] - when[0]).total_seconds() if when else None


def overlaps(runs: list[Run]) -> dict[str, Optional[list[str]]]:
    """run id -> the ids of the runs whose training job ran at the same time (an empty list:
    none), from the records' ``started_at`` / ``finished_at``; None for a run without them
    (trained by an older gnnpipe): unknown."""
    when = {r.run_id: _when(r) for r in runs}
    out: dict[str, Optional[list[str]]] = {}
    for rid, w in when.items():
        if w is None:
            out[rid] = None
            continue
        out[rid] = [o for o, v in when.items() if o != rid and v is not None and v[0] < w[1] and w[0] < v[1]]
    return out


# --------------------------------------------------------------------------- labels
def techniques_short(run_or_agg) -> str:
    """A pipeline / hybrid run's convergence techniques in a few characters ("shuffle+grad×2+
    snapshot/23", "techniques off"); "" for the other modes and for an unreadable run.yaml."""
    first = run_or_agg.first if isinstance(run_or_agg, Aggregate) else run_or_agg
    t = techniques(first)
    if t is None:
        return ""
    shuffle, scale, snapshot, momentum = t
    on = (["shuffle"] if shuffle else []) + ([f"grad×{scale:g}"] if scale is not None else []) \
        + ([f"snapshot/{snapshot}"] if snapshot else []) + ([f"momentum {momentum:g}"] if momentum else [])
    return "+".join(on) if on else "techniques off"
