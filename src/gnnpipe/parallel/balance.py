"""Stage balancing: which contiguous block of convs each GNNPipe stage owns.

GPipe-style, an epoch of ``C`` chunks through ``S`` stages takes about
``(C + S - 1) * max_s t_s`` where ``t_s`` is stage ``s``'s time per chunk: the slowest
stage sets the pace and every other stage idles (the bubble) for the difference. So
the assignment minimises the **bottleneck** ``max_s t_s`` over all splits of the ``L``
convs into ``S`` non-empty contiguous blocks (the linear-partition problem, solved
exactly by dynamic programming; ``O(S L^2)``, nothing for ``L`` in the hundreds).
Stage 0 also runs the encoder, the last stage the decoder and the loss: their costs
are added to those stages (``first_extra``, ``last_extra``).

Costs come from one of (``PipelineConfig.balance``):

* ``uniform``: equal numbers of convs (the first ``L % S`` stages take one more), the
  baseline the others must beat;
* ``estimate``: the model's FLOP estimates (``GNN.layer_costs`` and
  ``encoder_cost``/``decoder_cost``) for the whole graph;
* ``profile``: each conv timed forward + backward on a sample chunk (median of a few
  repetitions). Every rank times every conv and the times are averaged across ranks
  (op ``control``), so that all ranks hold the same numbers and compute the same split.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..io import GnnPipeError
from ..models.block import Block
from ..layout import check_stages

METHODS = ("uniform", "estimate", "profile")


@dataclass
class StageAssignment:
    """Stage ``s`` owns convs ``range(*bounds[s])``."""

    bounds: list[tuple[int, int]]
    method: str
    layer_costs: list[float]  # per conv, in the unit of ``method`` (FLOPs, seconds, or 1)
    first_extra: float = 0.0  # encoder (stage 0)
    last_extra: float = 0.0  # decoder + loss (last stage)
    stage_costs: list[float] = field(default_factory=list)

    def __post_init__(self):
        if not self.stage_costs:
            self.stage_costs = stage_costs(self.layer_costs, self.bounds, self.first_extra, self.last_extra)

    @property
    def stages(self) -> int:
        return len(self.bounds)

    @property
    def bottleneck(self) -> float:
        return max(self.stage_costs)

    @property
    def imbalance(self) -> float:
        """Bottleneck over the mean stage cost (1.0 is perfect balance)."""
        mean = sum(self.stage_costs) / len(self.stage_costs)
        return self.bottleneck / mean if mean > 0 else 1.0

    def stage_of(self, layer: int) -> int:
        for s, (a, b) in enumerate(self.bounds):
            if a <= layer < b:
                return s
        raise IndexError(f"conv {layer} is outside the assignment {self.bounds}")

    def as_dict(self) -> dict:
        return {"method": self.method, "bounds": [list(b) for b in self.bounds],
                "layers_per_stage": [b - a for a, b in self.bounds],
                "stage_costs": list(self.stage_costs), "bottleneck": self.bottleneck,
                "imbalance": self.imbalance, "layer_costs": list(self.layer_costs),
                "first_extra": self.first_extra, "last_extra": self.last_extra}

    def __str__(self) -> str:
        parts = [f"stage {s}: convs {a}-{b - 1} (cost {c:.3g})"
                 for s, ((a, b), c) in enumerate(zip(self.bounds, self.stage_costs))]
        return f"{self.method} balance, imbalance {self.imbalance:.3f}: " + "; ".join(parts)


def stage_costs(costs: Sequence[float], bounds: Sequence[tuple[int, int]], first_extra: float = 0.0,
                last_extra: float = 0.0) -> list[float]:
    out = [float(sum(costs[a:b])) for a, b in bounds]
    out[0] += first_extra
    out[-1] += last_extra
    return out


def uniform_bounds(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Equal numbers of convs per stage; the first ``num_layers % stages`` take one more."""
    check_stages(stages, num_layers, where="stage balancing")
    q, r = divmod(num_layers, stages)
    bounds, a = [], 0
    for s in range(stages):
        b = a + q + (1 if s < r else 0)
        bounds.append((a, b))
        a = b
    return bounds


def balanced_bounds(costs: Sequence[float], stages: int, first_extra: float = 0.0,
                    last_extra: float = 0.0) -> list[tuple[int, int]]:
    """The contiguous split of ``costs`` into ``stages`` non-empty blocks with the least
    bottleneck (stage 0 also carries ``first_extra``, the last ``last_extra``).

    ``best[s][i]``: least bottleneck of convs ``[0, i)`` on stages ``0..s`` and, among the
    splits that reach it, the least sum of squared stage costs: when one conv dominates
    (an 8415-wide first conv), every split has the same bottleneck, and the others are
    still spread evenly instead of piling onto one stage. Remaining ties go to the split
    found first (the smallest start of the last block), which is deterministic: every rank
    computes the same split from the same costs.
    """
    costs = [float(c) for c in costs]
    L = len(costs)
    check_stages(stages, L, where="stage balancing")
    if any(c < 0 for c in costs):
        raise GnnPipeError(f"layer costs must be >= 0, got {costs}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def block(j: int, i: int, s: int) -> float:  # convs [j, i) on stage s
        cost = prefix[i] - prefix[j]
        if s == 0:
            cost += first_extra
        if s == stages - 1:
            cost += last_extra
        return cost

    inf = float("inf")
    best = [[(inf, inf)] * (L + 1) for _ in range(stages)]  # (bottleneck, sum of squares)
    parent = [[-1] * (L + 1) for _ in range(stages)]
    tol = 1e-9 * (prefix[-1] + first_extra + last_extra)  # bottlenecks this close are equal

    def better(v, cur) -> bool:
        return v[0] < cur[0] - tol or (v[0] <= cur[0] + tol and v[1] < cur[1])

    for i in range(1, L - stages + 2):
        b = block(0, i, 0)
        best[0][i] = (b, b * b)
        parent[0][i] = 0
    for s in range(1, stages):
        for i in range(s + 1, L - (stages - 1 - s) + 1):
            for j in range(s, i):  # stages 0..s-1 take [0, j), stage s takes [j, i)
                b = block(j, i, s)
                v = (max(best[s - 1][j][0], b), best[s - 1][j][1] + b * b)
                if better(v, best[s][i]):
                    best[s][i], parent[s][i] = v, j
    bounds, i = [], L
    for s in range(stages - 1, -1, -1):
        j = parent[s][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def estimate_costs(model, num_nodes: int, num_edges: int) -> tuple[list[float], float, float]:
    """FLOP estimates: per conv, encoder, decoder (``GNN.layer_costs`` & co.)."""
    return (list(model.layer_costs(num_nodes, num_edges)), float(model.encoder_cost(num_nodes)),
            float(model.decoder_cost(num_nodes)))


def _time(fn, reps: int, sync) -> float:
    fn()  # warm-up: kernel selection, caches on the block
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(statistics.median(times))


def profile_costs(model, block: Block, *, reps: int = 3, device=None,
                  dtype=torch.float32) -> tuple[list[float], float, float]:
    """Seconds per conv (forward + backward) on ``block`` (a sample chunk against its
    sources), and for the encoder and decoder on the chunk's rows.

    Inputs are random (the cost does not depend on the values); parameter gradients
    are cleared afterwards and the global RNG state is restored, so profiling leaves
    no trace in training.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    dims = model.exchange_dims()
    n_src, n_dst = block.n_src, block.n_dst
    was_training = model.training
    model.train()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        gen = torch.Generator(device=device).manual_seed(0)
        costs = []
        for l, conv in enumerate(model.convs):
            h = torch.randn(n_src, dims[l], device=device, dtype=dtype, generator=gen).requires_grad_()
            x0 = (torch.randn(n_dst, dims[0], device=device, dtype=dtype, generator=gen).requires_grad_()
                  if model.needs_x0 else None)

            def step(conv=conv, h=h, x0=x0):
                conv(h, block, x0).sum().backward()
            costs.append(_time(step, reps, sync))
        first = last = 0.0
        if model.encoder is not None:
            x = torch.randn(n_dst, model.in_features, device=device, dtype=dtype, generator=gen)
            first = _time(lambda: model.encode(x).sum().backward(), reps, sync)
        if model.decoder is not None:
            h = torch.randn(n_dst, model.convs[-1].out_dim, device=device, dtype=dtype,
                            generator=gen).requires_grad_()
            last = _time(lambda: model.decode(h).sum().backward(), reps, sync)
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return costs, first, last


def assign_stages(model, stages: int, method: str, *, num_nodes: int, num_edges: int,
                  sample_block: Optional[Block] = None, comm=None, reps: int = 3,
                  dtype=torch.float32) -> StageAssignment:
    """The stage assignment of ``model``'s convs by ``method`` (see the module docstring).

    ``profile`` needs ``sample_block`` (a chunk against its sources, on the model's
    device) and, with several ranks, ``comm`` to average the timings (op ``control``).
    """
    L = len(model.convs)
    check_stages(stages, L, where="stage balancing")
    if method == "uniform":
        return StageAssignment(uniform_bounds(L, stages), method, [1.0] * L)
    if method == "estimate":
        costs, first, last = estimate_costs(model, num_nodes, num_edges)
    elif method == "profile":
        if sample_block is None:
            raise GnnPipeError("profile balancing needs a sample chunk to time the convs on")
        costs, first, last = profile_costs(model, sample_block, reps=reps, dtype=dtype)
        if comm is not None and comm.world_size > 1:
            t = torch.tensor(costs + [first, last], dtype=torch.float64, device=comm.device)
            comm.all_reduce_(t, op="control")
            vals = (t / comm.world_size).tolist()
            costs, first, last = vals[:L], vals[L], vals[L + 1]
    else:
        raise GnnPipeError(f"unknown stage balance method {method!r} (known: {', '.join(METHODS)})")
    return StageAssignment(balanced_bounds(costs, stages, first, last), method, costs, first, last)
