"""The vocabulary of work: what a conv declares about itself for the time and memory estimates.

A conv's work is dense FLOPs, sparse work (stored entries × width), elementwise values,
random values drawn (dropout masks) and calls, forward and backward (:class:`Work`,
:class:`LayerCost`). Each conv kind computes its own beside its ``forward``
(``gnnpipe.models.<kind>.work``, reached through the :class:`LayerSpec` the layer gives
``layer.layer_spec(...)``): no kind switch here. What is common to every conv lives here: the
order rule of a linear map and a fixed-weight aggregation (:func:`aggregate_first`), its work
(:func:`linear_aggregate`), the per-row work after a conv (:func:`finish`), assembling a
block's source rows (:func:`gather_work`), per-node Linear stacks and the loss.

Pure: no torch, no files. The layers (``gnnpipe.models``) import it; the estimates
(``gnnpipe.costmodel.estimate``) price what they declare.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ..io import GnnPipeError


@dataclass
class Work:
    """Work of one pass: dense FLOPs, sparse entries × width, elementwise values, random
    values drawn (dropout masks), calls."""

    dense: float = 0.0
    sparse: float = 0.0
    elem: float = 0.0
    calls: float = 0.0
    rng: float = 0.0

    def __add__(self, o: "Work") -> "Work":
        return Work(self.dense + o.dense, self.sparse + o.sparse, self.elem + o.elem,
                    self.calls + o.calls, self.rng + o.rng)

    def scale(self, k: float) -> "Work":
        return Work(self.dense * k, self.sparse * k, self.elem * k, self.calls * k, self.rng * k)

    def seconds(self, hw, efficiency: float = 1.0) -> float:
        """Seconds on ``hw`` (a ``gnnpipe.costmodel.hardware.Hardware``: its rates)."""
        return ((self.dense / hw.dense_flops + self.sparse / hw.sparse_rate
                 + self.elem / hw.elementwise_rate + self.rng / hw.random_rate) / efficiency
                + self.calls * hw.layer_overhead)


@dataclass
class LayerCost:
    """Forward and backward work of one conv on one block, and what it keeps for backward
    beyond its input (values per destination row, per source row, per stored entry)."""

    fwd: Work
    bwd: Work
    saved_dst: float = 0.0
    saved_src: float = 0.0
    saved_entry: float = 0.0
    temp_src: float = 0.0  # largest temporary, values per source row

    def training(self) -> Work:
        return self.fwd + self.bwd


#: ``work(spec, n_dst, n_src, nnz, memoised) -> LayerCost``: a conv kind's declaration
WorkFn = Callable[["LayerSpec", float, float, float, bool], LayerCost]


@dataclass(frozen=True)
class LayerSpec:
    """What the cost model needs to know about one conv: its sizes and its own work function
    (given by the layer, ``layer.layer_spec(...)``, or by its kind, ``CONVS[kind].layer_spec``)."""

    kind: str  # the conv kind's registry name (gnnpipe.models.CONVS)
    d_in: int
    d_out: int
    norm: bool = False  # LayerNorm after the conv (GraphLayer)
    act: bool = False  # ReLU after the conv
    dropout: bool = False  # dropout after the conv
    heads: int = 1  # gat
    head_dim: int = 0  # gat: width of one head (d_out = heads * head_dim when heads are concatenated)
    input_grad: bool = True  # False for a first conv fed raw features (no gradient flows there)
    params: int = 0
    # gcn/sage first conv on raw features: it memoises the aggregation of an input that comes
    # back unchanged (``gnnpipe.models.ops.static_aggregate``), paid once a run, not per epoch
    static_input: bool = False
    work: Optional[WorkFn] = None  # the kind's work (gnnpipe.models.<kind>.work)
    exchange: Optional[int] = None  # values per exchanged input row (the kind's declaration; None: d_in)
    halo: Optional[int] = None  # values per halo row where nothing is buffered (the narrow side; None: exchange)


@dataclass(frozen=True)
class ModelShape:
    """A GNN as the cost model sees it: its convs and its per-node encoder/decoder."""

    layers: tuple[LayerSpec, ...]
    in_features: int
    num_classes: int
    encoder: tuple[tuple[int, int], ...] = ()  # Linear (d_in, d_out) maps, in order
    decoder: tuple[tuple[int, int], ...] = ()
    encoder_params: int = 0
    decoder_params: int = 0
    carries_x0: bool = False  # GCNII: x0 crosses stage boundaries with h
    x0_dim: int = 0
    encoder_dropout: int = 0  # values per row the encoder drops out (GCNII: H)

    @property
    def exchange_dims(self) -> list[int]:
        """Values per exchanged input row of every conv (``GNN.exchange_dims()``)."""
        return [l.d_in if l.exchange is None else l.exchange for l in self.layers]

    @property
    def halo_dims(self) -> list[int]:
        """Values per halo row of every conv where nothing is buffered (``GNN.halo_dims()``:
        the narrow side, docs/DESIGN.md §4)."""
        return [d if l.halo is None else l.halo for l, d in zip(self.layers, self.exchange_dims)]

    @property
    def num_params(self) -> int:
        return sum(l.params for l in self.layers) + self.encoder_params + self.decoder_params

    def params_per_stage(self, bounds: Sequence[tuple[int, int]]) -> list[int]:
        out = [sum(self.layers[l].params for l in range(a, b)) for a, b in bounds]
        out[0] += self.encoder_params
        out[-1] += self.decoder_params
        return out


def layer_cost(spec: LayerSpec, n_dst: float, n_src: float, nnz: float,
               memoised: Optional[bool] = None) -> LayerCost:
    """Work of conv ``spec`` on a block of ``n_dst`` destinations, ``n_src`` sources and
    ``nnz`` stored in-edges (self loops, where the layer adds them, on top): the conv kind's
    own declaration, ``spec.work``.

    ``memoised`` (default ``spec.static_input``): the conv's input is the same tensor every
    call, so its aggregation is memoised and costs nothing per epoch (a first conv on raw
    features, held for the run: single, GNNPipe's stage 0, graph parallelism with the input
    halo cached); False where the input is rebuilt every epoch (its halo forwarded anew)."""
    if spec.work is None:
        raise GnnPipeError(f"cost model: conv {spec.kind!r} declares no work (build its LayerSpec with "
                           f"layer.layer_spec() or gnnpipe.models.CONVS[kind].layer_spec())")
    memo = spec.static_input if memoised is None else bool(memoised and spec.static_input)
    return spec.work(spec, n_dst, n_src, nnz, memo)


def aggregate_first(n_src: float, n_dst: float, nnz: float, d_in: float, d_out: float) -> bool:
    """Whether ``(A x) W`` is cheaper than ``A (x W)`` for a linear map ``d_in -> d_out``.

    Both orders are exact; their multiply-add counts are ``nnz d_in + n_dst d_in d_out``
    and ``n_src d_in d_out + nnz d_out``. On a whole-graph block this is "aggregate the
    narrower side"; on a chunk against the whole graph (``n_dst << n_src``) aggregating
    first avoids transforming every source row once per chunk. The layers follow it
    (``gnnpipe.models.gcn``), the work counts below too.
    """
    return nnz * d_in + n_dst * d_in * d_out <= n_src * d_in * d_out + nnz * d_out


def linear_aggregate(n_dst, n_src, m, d_in, d_out, input_grad) -> LayerCost:
    """A linear map ``d_in -> d_out`` and a fixed-weight aggregation over ``m`` entries,
    in the order the layer picks."""
    g = 2.0 if input_grad else 1.0  # backward: weight gradient, and input gradient if needed
    if aggregate_first(n_src, n_dst, m, d_in, d_out):
        mm = 2.0 * n_dst * d_in * d_out
        return LayerCost(Work(dense=mm, sparse=m * d_in), Work(dense=g * mm, sparse=m * d_in if input_grad else 0.0),
                         saved_dst=d_in, temp_src=0.0)
    mm = 2.0 * n_src * d_in * d_out
    return LayerCost(Work(dense=mm, sparse=m * d_out), Work(dense=g * mm, sparse=m * d_out),
                     temp_src=d_out)  # saves its input x: the block's source rows themselves


def memoised_linear(n_dst, d_in, d_out) -> LayerCost:
    """``(A x) W`` with ``A x`` memoised: the matmul and its weight gradient only."""
    mm = 2.0 * n_dst * d_in * d_out
    return LayerCost(Work(dense=mm), Work(dense=mm), saved_dst=d_in)


def finish(c: LayerCost, spec: LayerSpec, n_dst: float, *, bias: bool, mask: bool) -> LayerCost:
    """The per-row work after a conv on its destination rows: its bias (``bias``), the
    LayerNorm, ReLU and dropout ``spec`` names, the dropout mask drawn here (``mask``: not
    where the conv draws its own), and the call itself, forward and backward."""
    d_out = float(spec.d_out)
    post = n_dst * d_out * ((1.0 if bias else 0.0) + (8.0 if spec.norm else 0.0)
                            + (1.0 if spec.act else 0.0) + (1.0 if spec.dropout else 0.0))
    c.fwd.elem += post
    c.bwd.elem += 1.5 * post
    if spec.dropout and mask:
        c.fwd.rng += n_dst * d_out  # the mask
    c.saved_dst += d_out * ((1.0 if spec.norm else 0.0) + (1.0 if spec.act else 0.0)
                            + (0.25 if spec.dropout else 0.0))
    c.fwd.calls += 1.0
    c.bwd.calls += 1.0
    return c


def gather_work(n_dst: float, n_src: float, d: float, input_grad: bool) -> tuple[Work, Work]:
    """Assembling a block's source rows ``cat(own rows, halo rows)`` and, backward (when the
    input takes a gradient), adding the halo rows' gradients back where they belong
    (index_select / index_add)."""
    halo = max(n_src - n_dst, 0.0)
    return Work(elem=2.0 * n_src * d), Work(elem=(2.0 * halo * d + n_dst * d) if input_grad else 0.0)


def rowwise_work(linears: Sequence[tuple[int, int]], rows: float, input_grad: bool,
                 dropout_per_row: float = 0.0) -> Work:
    """Training work (forward + backward) of a per-node stack of Linear maps (with an
    activation after each) on ``rows`` rows; ``dropout_per_row`` values get a dropout mask."""
    w = Work(rng=rows * dropout_per_row)
    for i, (a, b) in enumerate(linears):
        mm = 2.0 * rows * a * b
        g = 2.0 if (input_grad or i > 0) else 1.0
        w = w + Work(dense=mm * (1.0 + g), elem=6.0 * rows * b)
    if linears:
        w.calls += 2.0
    return w


def loss_work(rows: float, num_classes: int) -> Work:
    """Cross-entropy forward + backward on ``rows`` rows (log-softmax, gather, gradients)."""
    return Work(elem=8.0 * rows * num_classes, calls=1.0)
