r"""A schedule is data: the actions of one epoch, per stage, as ``torch.distributed.pipelining`` has them.

An epoch of a layout ``S x G`` with ``c = C / G`` chunks per way is a list of actions per
stage (:func:`gpipe`); an action is ``(stage, kind, chunk)`` with ``chunk`` the way's local
chunk index ``0 .. c-1`` (every way of a stage runs the same list, in lockstep):

* ``F`` / ``B``: the stage's forward / backward of the chunk (``gnnpipe.parallel.stage``);
* ``RECV_F`` / ``RECV_B``: post the receive of the chunk's rows from the previous stage /
  of their gradients from the next one (waited for by the ``F`` / ``B`` that needs them);
* ``SEND_F`` / ``SEND_B``: send the chunk's output rows on / its input gradients back.

The engine's executor (``gnnpipe.parallel.layout_engine``) runs its stage's list in order, the cost
model (``gnnpipe.costmodel.estimate``) prices the same list with :func:`simulate` and
:func:`in_flight`: the engine and the prediction cannot disagree on the schedule. Message tags
come from the action (:func:`tag`), never from hand-written offsets.

**GPipe** (:func:`gpipe`, the one schedule): every receive of a phase posted up front, the
forwards of all chunks in this epoch's order, then the backwards in the reverse order, one
optimizer step after them (weights are never stale). Its makespan over ``c`` chunks is the
flow line's ``Σ_k t_k + (c - 1) max_k t_k`` over the stages and the links between them, each
phase; :func:`simulate` computes it from the dependencies instead of the formula.

**What another schedule must re-derive.** 1F1B (or any order that runs a chunk's backward
before the forwards of later chunks) keeps GPipe's *forward* values, since the weights are
fixed within an epoch and a halo row is fresh iff its chunk's forward came first. The
*gradients* are another matter: ``pipeline.grad_correction`` (``parallel/stage.py``) rests on
backward running in reverse forward order, so that chunk ``c``'s rows receive, before ``c``
is back-propagated, the gradient of exactly those chunks that read them fresh (the later
ones). Under 1F1B a later chunk's backward may come after ``c``'s: its contribution to ``c``'s
rows then arrives too late for this epoch and waits in the buffer (a stale gradient) even
though the row was read fresh. A new schedule therefore has to derive again (1) which
contributions are delivered in the epoch under it (the set ``grad_correction`` keeps), (2) the
probability of delivery under a random chunk order and hence ``grad_scale`` (2 for GPipe:
one half of the ordered pairs), (3) what the carried gradients mean without correction; and
ship with an exactness test at ``C > 1`` on a graph whose chunks share no edges (every
technique must be exact there, as ``tests/test_pipeline.py`` checks for GPipe) before it is
added as a second generator here.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

F, B = "F", "B"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
KINDS = (F, B, SEND_F, RECV_F, SEND_B, RECV_B)
#: message channels between neighbour stages, in tag order: a chunk's rows, their gradients,
#: the exact passes (warm start, evaluation), the weights gathered for a checkpoint
CHANNELS = ("forward", "backward", "exact_pass", "weights")


class Action(NamedTuple):
    """One step of a stage: ``kind`` (``KINDS``) on the way's local chunk ``chunk``."""

    stage: int
    kind: str
    chunk: int

    @property
    def direction(self) -> str:
        """``forward`` for ``F`` and its messages, ``backward`` for ``B`` and its messages."""
        return "forward" if self.kind in (F, SEND_F, RECV_F) else "backward"

    def tag(self, chunks: int) -> int:
        """The message tag of a send or receive (the same on both ends)."""
        return tag(self.direction, chunks, self.chunk)

    def __repr__(self) -> str:  # torch's notation: 1F3 is stage 1's forward of chunk 3
        return f"{self.stage}{self.kind}{self.chunk}"


def tag(channel: str, chunks: int, chunk: int = 0) -> int:
    """The tag of a message on ``channel`` (``CHANNELS``) about ``chunk`` of ``chunks``: every
    (channel, chunk) pair has its own, so messages between two stages never match the wrong
    receive."""
    if channel not in CHANNELS:
        raise ValueError(f"unknown message channel {channel!r} (known: {', '.join(CHANNELS)})")
    if not 0 <= chunk < max(chunks, 1):
        raise ValueError(f"chunk {chunk} is outside 0..{chunks - 1}")
    return CHANNELS.index(channel) * chunks + chunk


def gpipe(stages: int, order: Sequence[int]) -> dict[int, list[Action]]:
    """GPipe's actions of one epoch for every stage: ``order`` is the forward order of the
    way's chunks (the backward runs it in reverse); receives are posted ahead, per phase."""
    if stages < 1:
        raise ValueError(f"a schedule needs at least one stage, got {stages}")
    order = [int(c) for c in order]
    if sorted(order) != list(range(len(order))):
        raise ValueError(f"the chunk order must be a permutation of 0..{len(order) - 1}, got {order}")
    out = {}
    for s in range(stages):
        first, last = s == 0, s == stages - 1
        acts = [] if first else [Action(s, RECV_F, c) for c in order]
        for c in order:
            acts.append(Action(s, F, c))
            if not last:
                acts.append(Action(s, SEND_F, c))
        if not last:
            acts += [Action(s, RECV_B, c) for c in reversed(order)]
        for c in reversed(order):
            acts.append(Action(s, B, c))
            if not first:
                acts.append(Action(s, SEND_B, c))
        out[s] = acts
    return out


def in_flight(actions: dict[int, list[Action]]) -> int:
    """The most chunks whose forward is done and backward is not, on any stage: how many
    chunks' activations a stage keeps at once (GPipe: all of them)."""
    most = 0
    for acts in actions.values():
        held = 0
        for a in acts:
            held += 1 if a.kind == F else -1 if a.kind == B else 0
            most = max(most, held)
    return most


def simulate(actions: dict[int, list[Action]], compute: Callable[[Action], float],
             link: Callable[[Action], float], start: Optional[dict[int, float]] = None) -> dict[int, float]:
    """When every stage finishes its actions: each stage runs its list in order; an ``F`` / ``B``
    takes ``compute(action)`` seconds once its chunk has arrived (``RECV``), a send costs its
    stage nothing (price it into ``compute``) and puts the message on the link between the two
    stages in its direction, which carries one message at a time for ``link(send)`` seconds.
    ``start``: when each stage may begin (a prologue, e.g. stage 0's encoder). Returns each
    stage's finish time."""
    clock = {s: float((start or {}).get(s, 0.0)) for s in actions}
    pos = {s: 0 for s in actions}
    arrival: dict[tuple[str, int, int], float] = {}  # (direction, receiving stage, chunk) -> time
    link_free: dict[tuple[str, int], float] = {}
    remaining = sum(len(a) for a in actions.values())
    while remaining:
        moved = False
        for s, acts in actions.items():
            while pos[s] < len(acts):
                a = acts[pos[s]]
                if a.kind in (RECV_F, RECV_B):
                    pass  # posting a receive takes no time; its F / B waits for the message
                elif a.kind in (F, B):
                    key = (a.direction, s, a.chunk)
                    needs = (a.kind == F and s > 0) or (a.kind == B and s < len(actions) - 1)
                    if needs and key not in arrival:
                        break  # waits for its chunk
                    clock[s] = max(clock[s], arrival.get(key, 0.0)) + float(compute(a))
                else:  # SEND_F / SEND_B
                    dst = s + 1 if a.kind == SEND_F else s - 1
                    lane = (a.direction, min(s, dst))
                    begin = max(clock[s], link_free.get(lane, 0.0))
                    link_free[lane] = begin + float(link(a))
                    arrival[(a.direction, dst, a.chunk)] = link_free[lane]
                pos[s] += 1
                remaining -= 1
                moved = True
        if not moved:
            raise ValueError("the schedule deadlocks: a stage waits for a chunk no stage sends")
    return clock
