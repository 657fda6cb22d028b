"""A model's layers timed by the training job itself, for the cost model's calibration.

A node-model train job times, in epochs it trains anyway (three from the first after its
warm-up, :func:`recorded_epochs`), every call of its model's pieces on this thread's CPU clock,
and counts each call's work with the cost model (``costmodel.work``): the run record keeps them
as ``layer_times`` (:func:`layer_timer`; each row's median over those epochs, :func:`merged`).
``gnnpipe calibrate`` fits the compute rates to those rows
(``planning.calibrate.calibrate_records``) instead of timing samples of its own.

* ``single`` (one process, the whole graph: the warm rates): every conv, the encoder and the
  decoder, forward and backward. A piece's forward is the time inside its module call; its
  backward runs from the moment the gradient of its output is complete (a hook on the output)
  to the later of the gradient of its input and of its last parameter (hooks on those): autograd
  runs a CPU graph on the thread that called ``backward``, one node after another, so the
  interval is that piece's backward and nothing else's.
* the parallel modes (``graph``, ``pipeline``, ``hybrid``: a worker's share between exchanges,
  and what the cold rates are fitted to): rank 0's conv forwards called on a plain block (no
  narrow side), on its chunks and parts. Backward there interleaves with the exchanges' own
  autograd functions, so it is not timed.

Cheap: a clock read and a hook per call in three epochs, nothing else; the rows are each
piece's calls in an epoch summed per distinct (piece, block size), so a 32-layer model records
66 rows in ``single`` (its convs forward and backward, its encoder and decoder).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Optional

import torch
from torch import Tensor, nn

from .costmodel.work import Work, layer_cost, rowwise_work
from .models.model import GNN
from .models.shape import model_shape

#: What times the rows: this thread's CPU time (blind to time descheduled on a shared machine and
#: to time blocked in an exchange; the wall time of one compute thread on an idle core).
CLOCK = "cpu"
_now = time.thread_time


#: Epochs a train job times its layers in (each row's seconds: their median), fewer if it has fewer.
RECORDED_EPOCHS = 3


def recorded_epochs(epochs: int, warmup_epochs: int) -> range:
    """The epochs a train job times its layers in: :data:`RECORDED_EPOCHS` from the first timed
    one (after the warm-up), or as many as it has from the last ones when the warm-up leaves fewer."""
    first = max(0, min(max(int(warmup_epochs), 0), int(epochs) - RECORDED_EPOCHS))
    return range(first, min(first + RECORDED_EPOCHS, int(epochs)))


def merged(before: Optional[dict], now: Optional[dict]) -> Optional[dict]:
    """The record of several recorded epochs (:func:`layer_timer`'s ``layer_times``, ``before``
    None for the first): each row's ``seconds`` and ``epoch_cpu_s`` the median over the epochs
    (their lists kept as ``seconds_per_epoch`` and ``epoch_cpu_s_per_epoch``), its work one epoch's."""
    if now is None or before is None:
        return now or before
    import statistics

    rows = {r["what"]: r for r in before["rows"]}
    for r in now["rows"]:
        old = rows.get(r["what"])
        per = (old["seconds_per_epoch"] if old else []) + [r["seconds"]]
        rows[r["what"]] = {**r, "seconds": float(statistics.median(per)), "seconds_per_epoch": per}
    cpu = before["epoch_cpu_s_per_epoch"] + [now["epoch_cpu_s"]]
    return {**now, "epochs": before["epochs"] + [now["epoch"]], "epoch_cpu_s": float(statistics.median(cpu)),
            "epoch_cpu_s_per_epoch": cpu, "rows": list(rows.values())}


def _work(w: Work) -> list[float]:
    return [w.dense, w.sparse, w.elem, w.rng, w.calls]


class _Rows:
    """Rows ``{what, work, seconds, calls}`` summed per key."""

    def __init__(self):
        self.rows: dict[str, dict] = {}

    def add(self, what: str, work: Work, seconds: float) -> None:
        row = self.rows.setdefault(what, {"what": what, "work": [0.0] * 5, "seconds": 0.0, "calls": 0})
        row["work"] = [a + b for a, b in zip(row["work"], _work(work))]
        row["seconds"] += float(seconds)
        row["calls"] += 1


class _Timer:
    """The hooks of one recorded epoch (:func:`layer_timer`)."""

    def __init__(self, gnn: Optional[GNN], convs: dict[int, nn.Module], raw_first: bool, backward: bool,
                 rows: Optional[int] = None):
        self.out = _Rows()
        self.handles = []
        self.backward = backward
        self.open: dict[str, float] = {}  # a backward under way: piece -> when its output's gradient came
        self.ends: dict[str, float] = {}  # piece -> its backward's latest end so far
        for l, conv in convs.items():
            spec = conv.layer_spec(raw_input=raw_first and l == 0, params=0)
            self._hook_conv(f"conv{l}", conv, spec)
        if gnn is not None and rows is not None:
            shape = model_shape(gnn)
            if gnn.encoder is not None:
                w = rowwise_work(shape.encoder, rows, False, shape.encoder_dropout)
                self._hook_rowwise("encoder", gnn.encoder, w)
            if gnn.decoder is not None:
                self._hook_rowwise("decoder", gnn.decoder, rowwise_work(shape.decoder, rows, True))

    # ---- forward: the time inside the module call
    def _hook_conv(self, name: str, conv: nn.Module, spec) -> None:
        def pre(mod, args, kwargs):
            self.t0 = _now()

        def post(mod, args, kwargs, out):
            dt = _now() - self.t0
            if kwargs or len(args) < 2 or not isinstance(out, Tensor):
                return  # a narrow-side call (its projected halo): not the work layer_cost counts
            block = args[1]
            lc = layer_cost(spec, block.n_dst, block.n_src, block.nnz)
            key = f"{name} {spec.kind} {spec.d_in}->{spec.d_out} {block.n_dst}x{block.n_src}x{block.nnz}"
            self.out.add(f"{key} fwd", lc.fwd, dt)
            if self.backward and out.requires_grad:
                self._time_backward(f"{key} bwd", mod, args[0], out, lc.bwd)

        self.handles += [conv.register_forward_pre_hook(pre, with_kwargs=True),
                         conv.register_forward_hook(post, with_kwargs=True)]

    def _hook_rowwise(self, name: str, mod: nn.Module, work: Work) -> None:
        # the work counts forward and backward together (rowwise_work): one row, the two summed
        def pre(m, args):
            self.t0 = _now()

        def post(m, args, out):
            dt = _now() - self.t0
            if self.backward and out.requires_grad:
                self._time_backward(f"{name} bwd", m, args[0], out, Work(), fwd_s=dt, total=(f"{name}", work))
            else:
                self.out.add(f"{name} fwd+bwd", work, dt)

        self.handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]

    # ---- backward: from the output's gradient to the last of the input's and the parameters'
    def _time_backward(self, key: str, mod: nn.Module, h, out: Tensor, work: Work, *, fwd_s: float = 0.0,
                       total=None) -> None:
        params = [p for p in mod.parameters() if p.requires_grad]
        waiting = {"n": len(params) + (1 if isinstance(h, Tensor) and h.requires_grad else 0)}
        if not waiting["n"]:
            return

        def start(grad):
            self.open[key] = _now()

        def end(*_):
            waiting["n"] -= 1
            if waiting["n"] == 0 and key in self.open:
                dt = _now() - self.open.pop(key)
                if total is not None:
                    self.out.add(f"{total[0]} fwd+bwd", total[1], fwd_s + dt)
                else:
                    self.out.add(key, work, dt)

        out.register_hook(start)
        if isinstance(h, Tensor) and h.requires_grad:
            h.register_hook(end)
        for p in params:
            self.handles.append(p.register_post_accumulate_grad_hook(end))

    def close(self) -> list[dict]:
        for hd in self.handles:
            hd.remove()
        self.handles = []
        return list(self.out.rows.values())


def _pieces(engine):
    """(the whole model or None, its convs by layer, whether conv 0 reads raw features, whether the
    engine is one process on the whole graph) of an engine whose model can be timed, or None."""
    model = getattr(engine, "model", None)
    if isinstance(model, GNN) and len(model.convs) and getattr(engine, "comm", None) is None:
        return model, dict(enumerate(model.convs)), model.encoder is None, True
    stage = getattr(engine, "stage", None)
    convs = getattr(stage, "convs", None)
    if isinstance(convs, dict) and convs:
        return None, dict(convs), not stage.has_encoder, False
    return None


@contextmanager
def layer_timer(engine, epoch: int, on: bool):
    """Time the layers of ``engine`` while its ``epoch`` trains (``on``: this epoch and this rank
    record; else nothing is hooked). Yields a dict whose ``"layer_times"`` is set afterwards to
    ``{"epoch", "clock", "threads", "whole_graph", "epoch_cpu_s", "rows"}`` (``epoch_cpu_s``: the
    whole epoch on the same clock, this rank's; None where the engine's model cannot be timed:
    atomic engines, MLP)."""
    found = _pieces(engine) if on else None
    result: dict = {"layer_times": None}
    if found is None:
        yield result
        return
    gnn, convs, raw_first, whole = found
    rows = int(engine.num_nodes) if whole else None
    timer = _Timer(gnn, convs, raw_first, backward=whole, rows=rows)
    t0 = _now()
    try:
        yield result
    finally:
        epoch_s = _now() - t0
        recorded = timer.close()
    for r in recorded:
        r["seconds_per_epoch"] = [r["seconds"]]
    result["layer_times"] = {"epoch": int(epoch), "epochs": [int(epoch)], "clock": CLOCK,
                             "threads": torch.get_num_threads(), "whole_graph": whole, "epoch_cpu_s": epoch_s,
                             "epoch_cpu_s_per_epoch": [epoch_s], "rows": recorded}
