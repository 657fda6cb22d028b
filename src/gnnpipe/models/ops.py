"""Aggregation primitives over CSR blocks: constant-weight SpMM, edge softmax, SDDMM.

Every layer aggregates a bipartite :class:`~gnnpipe.models.block.Block`. Two kinds of
aggregation exist:

* **fixed edge weights** (GCN, GCNII, SAGE): ``out = A @ x`` with ``A`` the block's
  ``(n_dst, n_src)`` in-edge CSR carrying weights computed from whole-graph degrees.
  :class:`SpMM` runs it as a custom autograd Function whose backward is
  ``grad_x = A^T @ grad_out``, with ``A^T`` a transposed CSR (and the weights in its
  order) built once and cached on the block (``block.cached``, :class:`FixedOp`). The
  weights are constants: no gradient flows to them.
* **learned edge weights** (GAT): per-edge, per-head scores, an edge softmax over each
  destination's in-edges (:class:`EdgeSoftmax`) and a weighted aggregation
  (:class:`EdgeSpMM`) differentiable in both the features and the edge weights; the
  weight gradient ``<grad_out[i], x[j]>`` on every edge is a sampled dense-dense product
  (SDDMM, ``torch.sparse.sampled_addmm``).

The kernel (:meth:`CSR.mm`): on CPU, ``F.embedding_bag(mode="sum",
per_sample_weights=w)`` over the CSR, which is exactly a weighted CSR SpMM and runs
FBGEMM's vectorised kernel; ``benchmarks/bench_layers.py`` times it against MKL's sparse
CSR product, torch's own CSR/COO autograd, ``spmm_reduce``, and gather + ``index_add_``
/ ``segment_reduce``, forward and backward: it is the fastest (about 2-3x MKL's CSR
product, 5-25x the gather variants, which also materialise an ``(nnz, d)`` message
tensor). On CUDA the sparse CSR tensor product (cuSPARSE). Index tensors are int32 when
every dimension fits (half the memory, and faster with FBGEMM), int64 otherwise.

Self loops: :func:`self_loop_csr` appends one entry per destination row ``i`` pointing
at its own source row ``dst_offset + i`` (GCN's self term and GAT's self edge). The
graph data itself is stored without self loops (docs/ARCHITECTURE.md); a self loop
that *is* in the data is an ordinary edge and is counted on top.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .block import Block


_INT32_MAX = 2**31 - 1
_SMALL = 1 << 15  # nnz * width below which CPU products gather + index_add_ (see CSR.mm)
#: The CPU kernel of large products: "embedding_bag" (FBGEMM, the fastest) or "sparse"
#: (the sparse CSR tensor product, MKL; what CUDA runs, kept selectable for tests/benchmarks).
CPU_KERNEL = "embedding_bag"


# --------------------------------------------------------------------------- structures
@dataclass(eq=False)
class CSR:
    """A CSR sparsity pattern with its transpose.

    ``indptr``/``indices`` describe ``(n_rows, n_cols)``; ``t_indptr``/``t_indices`` the
    transpose ``(n_cols, n_rows)``, whose ``k``-th entry is entry ``perm[k]`` of the
    original (so values ``v`` of the original become ``v[perm]`` in the transpose).
    ``row`` is the row of every entry. Index tensors already have the kernel's width.
    """

    indptr: Tensor
    indices: Tensor
    row: Tensor  # (nnz,)
    t_indptr: Tensor
    t_indices: Tensor
    perm: Tensor  # (nnz,)
    n_rows: int
    n_cols: int

    @property
    def nnz(self) -> int:
        return int(self.indices.shape[0])

    def matrix(self, values: Tensor) -> Tensor:
        """The sparse ``(n_rows, n_cols)`` matrix with these entry values."""
        return torch.sparse_csr_tensor(self.indptr, self.indices, values, (self.n_rows, self.n_cols),
                                       check_invariants=False)

    def matrix_t(self, values: Tensor, values_t: Tensor | None = None) -> Tensor:
        """The transposed ``(n_cols, n_rows)`` matrix (``values`` in the original order, or
        ``values_t = values[perm]`` already in the transposed order)."""
        if values_t is None:
            values_t = values.index_select(0, self.perm)
        return torch.sparse_csr_tensor(self.t_indptr, self.t_indices, values_t,
                                       (self.n_cols, self.n_rows), check_invariants=False)

    def mm(self, values: Tensor, x: Tensor, *, transpose: bool = False,
           values_t: Tensor | None = None) -> Tensor:
        """``A @ x`` (or ``A^T @ x``) for ``x`` ``(n_cols, d)`` (``(n_rows, d)``), dense out.

        The kernel, by device and size (all exact; only the summation order differs):

        * CPU: ``embedding_bag(mode="sum", per_sample_weights=values)`` over the CSR, which
          *is* a weighted CSR SpMM; its FBGEMM kernel is ~2.5x faster than MKL's sparse
          ``A @ x`` here (``benchmarks/bench_layers.py``);
        * CPU, small products (``nnz * d <= _SMALL``): gather + ``index_add_``. Both kernels
          above fork an OpenMP team on every call, which costs milliseconds when the cores
          are oversubscribed (several workers per core, as in tests), while torch's
          elementwise kernels stay serial below their grain size;
        * CUDA and other devices: the sparse CSR tensor product (cuSPARSE).
        """
        x = x.contiguous()
        if x.device.type == "cpu":
            if self.nnz * x.shape[1] <= _SMALL:
                src, dst = (self.row, self.indices) if transpose else (self.indices, self.row)
                out = x.new_zeros(self.n_cols if transpose else self.n_rows, x.shape[1])
                return out.index_add_(0, dst, x.index_select(0, src) * values[:, None])
            if CPU_KERNEL == "embedding_bag":
                if transpose:
                    values = values.index_select(0, self.perm) if values_t is None else values_t
                    return F.embedding_bag(self.t_indices, x, self.t_indptr, mode="sum",
                                           per_sample_weights=values, include_last_offset=True)
                return F.embedding_bag(self.indices, x, self.indptr, mode="sum",
                                       per_sample_weights=values, include_last_offset=True)
        return (self.matrix_t(values, values_t) if transpose else self.matrix(values)) @ x

    def sddmm(self, a: Tensor, b: Tensor) -> Tensor:
        """``<a[i], b[j]>`` for every entry ``(i, j)``: ``a`` ``(n_rows, d)``, ``b`` ``(n_cols, d)``
        -> ``(nnz,)`` (small products gather, as in :meth:`mm`)."""
        if a.device.type == "cpu" and self.nnz * a.shape[1] <= _SMALL:
            return (a.index_select(0, self.row) * b.index_select(0, self.indices)).sum(-1)
        pattern = self.matrix(a.new_zeros(self.nnz))
        return torch.sparse.sampled_addmm(pattern, a.contiguous(), b.t(), beta=0.0).values()


def _silence_beta_warning() -> None:
    """torch warns once per process that sparse CSR is "beta"; spend that warning here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.sparse_csr_tensor(torch.zeros(2, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                torch.zeros(0), (1, 1), check_invariants=False)


_silence_beta_warning()


def _index_dtype(*sizes: int) -> torch.dtype:
    return torch.int32 if max(sizes, default=0) <= _INT32_MAX else torch.int64


def make_csr(indptr: Tensor, indices: Tensor, n_cols: int) -> CSR:
    """Build a :class:`CSR` (and its transpose) from an int64 row pointer and column ids.

    Pure tensor ops (stable sort, bincount, cumsum): runs on the device of ``indptr``.
    """
    n_rows = int(indptr.shape[0] - 1)
    nnz = int(indices.shape[0])
    counts = indptr[1:] - indptr[:-1]
    row = torch.repeat_interleave(torch.arange(n_rows, device=indptr.device), counts,
                                  output_size=nnz)
    perm = torch.sort(indices, stable=True).indices  # edges grouped by column, rows ascending
    t_indptr = torch.zeros(n_cols + 1, dtype=torch.int64, device=indptr.device)
    if nnz:
        torch.cumsum(torch.bincount(indices, minlength=n_cols), 0, out=t_indptr[1:])
    itype = _index_dtype(n_rows, n_cols, nnz)
    return CSR(indptr.to(itype), indices.to(itype), row.to(itype), t_indptr.to(itype),
               row[perm].to(itype), perm.to(itype), n_rows, n_cols)


def block_csr(block: Block) -> CSR:
    """The block's in-edges as a :class:`CSR` ``(n_dst, n_src)`` (cached on the block)."""
    return block.cached(("csr", block.indptr.device),
                        lambda: make_csr(block.indptr, block.indices, block.n_src))


def self_loop_csr(block: Block) -> CSR:
    """The block's in-edges plus one self entry per destination (cached on the block).

    Destination ``i`` gets the extra entry ``dst_offset + i`` appended after its edges;
    the entry of edge ``e`` (row ``r``) moves to position ``e + r``.
    """
    def make() -> CSR:
        device = block.indptr.device
        n_dst, nnz = block.n_dst, block.nnz
        indptr = block.indptr + torch.arange(n_dst + 1, device=device)
        indices = torch.empty(nnz + n_dst, dtype=torch.int64, device=device)
        row = torch.repeat_interleave(torch.arange(n_dst, device=device), block.indptr[1:] - block.indptr[:-1],
                                      output_size=nnz)  # not block.dst_of_edge(): its cache would stay
        indices[torch.arange(nnz, device=device) + row] = block.indices
        del row
        indices[indptr[1:] - 1] = torch.arange(block.dst_offset, block.dst_offset + n_dst,
                                               device=device)
        return make_csr(indptr, indices, block.n_src)
    return block.cached(("csr_self", block.indptr.device), make)


@dataclass(eq=False)
class FixedOp:
    """A sparse operator with constant entry values, in both orders.

    ``values`` follow ``csr``'s entries, ``values_t = values[csr.perm]`` its transpose's,
    so that a backward pass does not permute them again.
    """

    csr: CSR
    values: Tensor
    values_t: Tensor

    @classmethod
    def make(cls, csr: CSR, values: Tensor) -> "FixedOp":
        values = values.contiguous()
        return cls(csr, values, values.index_select(0, csr.perm))

    def mm(self, x: Tensor) -> Tensor:
        return self.csr.mm(self.values, x)

    def mm_t(self, g: Tensor) -> Tensor:
        return self.csr.mm(self.values, g, transpose=True, values_t=self.values_t)


def compact(block: Block) -> tuple[Block, Tensor | None]:
    """The block restricted to the source rows it reads: ``(sub_block, used)``.

    ``used`` (sorted int64) are the source rows that are an edge's source or a
    destination row; ``sub_block`` indexes ``h_src[used]`` and keeps their whole-graph
    degrees, so any conv gives the same result on ``(h_src[used], sub_block)`` as on
    ``(h_src, block)``. ``used`` is ``None`` when every source row is read (the whole
    graph, a partition with its halo). Worth it for a chunk against the whole graph,
    where per-source-row work (a pre-activation) would otherwise run on all ``N`` rows
    once per chunk. Cached on the block.
    """
    def make():
        device = block.indptr.device
        dst = torch.arange(block.dst_offset, block.dst_offset + block.n_dst, device=device)
        used = torch.unique(torch.cat([block.indices, dst]))  # sorted
        if used.shape[0] == block.n_src:
            return block, None
        sub = Block(block.indptr, torch.searchsorted(used, block.indices), int(used.shape[0]),
                    int(torch.searchsorted(used, used.new_tensor(block.dst_offset))),
                    block.deg_dst, block.deg_src[used])
        return sub, used
    return block.cached(("compact", block.indptr.device), make)


def cached_op(block: Block, key: str, dtype: torch.dtype, csr: CSR,
              make: Callable[[], Tensor]) -> FixedOp:
    """A :class:`FixedOp` on ``csr`` with values ``make()`` (float64, cast to ``dtype``),
    memoised on the block per ``key`` and dtype."""
    return block.cached((key, dtype, block.indptr.device),
                        lambda: FixedOp.make(csr, make().to(dtype)))


# --------------------------------------------------------------------------- dense maps
def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight.T + bias`` by oneDNN (float32 CPU; needs :data:`ONEDNN`); not differentiable."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _has_onednn_linear() -> bool:
    try:
        y = onednn_linear(torch.ones(3, 2), torch.ones(4, 2), torch.zeros(4))
    except (RuntimeError, AttributeError, NotImplementedError, TypeError):
        return False
    return bool(torch.equal(y, torch.full((3, 4), 2.0)))


#: Whether :func:`linear` may run float32 CPU products on oneDNN (``torch.ops.mkldnn``, present in
#: x86 builds of torch); tests and benchmarks may turn it off.
ONEDNN = _has_onednn_linear()


def by_onednn(x: Tensor, weight: Tensor) -> bool:
    """Whether ``x``'s product with ``weight`` may run on oneDNN: :data:`ONEDNN`, float32 rows on CPU."""
    return ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and weight.dtype == x.dtype


class _OneDNNLinear(torch.autograd.Function):
    """``x @ weight.T + bias`` with the products that read the ``(n, d)`` rows on oneDNN: forward
    and the input gradient. The weight gradient ``grad.T @ x`` (a reduction over the rows) stays
    on torch's ``mm`` (MKL), which is as fast there."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return onednn_linear(x, weight.detach(), None if bias is None else bias.detach())

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        gx = onednn_linear(grad, weight.t().contiguous(), None) if ctx.needs_input_grad[0] else None
        gw = grad.t() @ x if ctx.needs_input_grad[1] else None
        gb = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias``: ``(n, in) -> (n, out)`` (``F.linear``'s maths).

    float32 on CPU runs on oneDNN's matmul when torch has it (:data:`ONEDNN`): on the tall,
    narrow products of a full-graph layer (10^5 rows, 32-128 columns) it is 1.1-2.3x faster
    than MKL's sgemm behind ``torch.mm`` (``(10^5, 32) @ (32, 128)``: 7 vs 16 ms, 2 threads).
    Exact float32 products either way (only the order of the sums differs); float64, CUDA and
    other devices take ``F.linear``.
    """
    if by_onednn(x, weight):
        return _OneDNNLinear.apply(x.contiguous(), weight, bias)
    return F.linear(x, weight, bias)


# --------------------------------------------------------------------------- fixed weights
class SpMM(torch.autograd.Function):
    """``out = A @ x`` for a sparse ``A`` with constant values; ``grad_x = A^T @ grad_out``.

    Shapes: ``x`` ``(n_cols, d)`` -> ``out`` ``(n_rows, d)``.
    """

    @staticmethod
    def forward(ctx, x: Tensor, op: FixedOp) -> Tensor:
        ctx.op = op
        return op.mm(x.detach())  # detached: embedding_bag then skips its backward bookkeeping

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_x = ctx.op.mm_t(grad_out) if ctx.needs_input_grad[0] else None
        return grad_x, None


def apply_op(x: Tensor, op: FixedOp) -> Tensor:
    """``A @ x`` for a :class:`FixedOp`; differentiable in ``x`` only.

    ``x`` ``(n_cols, d)`` or ``(n_cols,)`` -> ``(n_rows, d)`` / ``(n_rows,)``.
    """
    if op.values.dtype != x.dtype:
        raise TypeError(f"spmm: edge values are {op.values.dtype} but features are {x.dtype}")
    if x.dim() == 1:
        return SpMM.apply(x[:, None], op)[:, 0]
    return SpMM.apply(x, op)


def spmm(x: Tensor, csr: CSR, values: Tensor) -> Tensor:
    """``A @ x`` with ``A = csr`` carrying constant ``values``; differentiable in ``x`` only."""
    return apply_op(x, FixedOp.make(csr, values))


def gcn_op(block: Block, dtype: torch.dtype) -> FixedOp:
    """``P~``: :func:`self_loop_csr` with GCN weights ``1 / sqrt((d_i + 1)(d_j + 1))``.

    ``d_i = deg_dst[i]``, ``d_j = deg_src[j]`` (whole-graph degrees); the self entry of
    ``i`` uses ``deg_src[dst_offset + i]``. Cached on the block per dtype.
    """
    csr = self_loop_csr(block)

    def make() -> Tensor:
        deg_dst = block.deg_dst.to(torch.float64)
        deg_src = block.deg_src.to(torch.float64)
        return torch.rsqrt((deg_dst.index_select(0, csr.row) + 1.0)
                           * (deg_src.index_select(0, csr.indices) + 1.0))
    return cached_op(block, "gcn", dtype, csr, make)


def mean_op(block: Block, dtype: torch.dtype) -> FixedOp:
    """Mean over in-neighbours: :func:`block_csr` with weights ``1 / deg_dst[i]``."""
    csr = block_csr(block)

    def make() -> Tensor:
        return (1.0 / block.deg_dst.to(torch.float64).clamp(min=1.0)).index_select(0, csr.row)
    return cached_op(block, "mean", dtype, csr, make)


def gcn_aggregate(x: Tensor, block: Block) -> Tensor:
    """``P~ x``: the symmetric-normalised aggregation with self loops, ``(n_src, d) -> (n_dst, d)``."""
    return apply_op(x, gcn_op(block, x.dtype))


def mean_aggregate(x: Tensor, block: Block) -> Tensor:
    """Mean over in-neighbours (0 for a row without in-edges), ``(n_src, d) -> (n_dst, d)``."""
    return apply_op(x, mean_op(block, x.dtype))


def static_aggregate(x: Tensor, block: Block, key: str, aggregate: Callable[[Tensor, Block], Tensor]
                     ) -> Tensor | None:
    """``aggregate(x, block)`` memoised for an input that comes back unchanged, else ``None``.

    For the first layer on raw input features (no gradient, the same tensor every epoch),
    ``A @ x`` is a constant: computing it once removes the layer's sparse product from
    every later forward and backward pass (exact: the very same numbers). The memo is
    keyed on the tensor's identity (a weak reference) and its version counter. The first
    time a tensor is seen this returns ``None`` (the caller aggregates as usual, in its
    cheaper order); from the second time on, the aggregation is computed once and reused.
    So an input rebuilt every epoch (a freshly exchanged halo) costs nothing extra, and
    a new or modified-in-place tensor is never served a stale result. Holds one
    ``(n_dst, d)`` result per block and ``key``.
    """
    slot = block.cached(("static", key), dict)
    ref = slot.get("ref")
    if ref is None or ref() is not x or slot["version"] != x._version:
        slot.clear()
        slot.update(ref=weakref.ref(x), version=x._version)
        return None
    if "out" not in slot:
        with torch.no_grad():
            slot["out"] = aggregate(x, block)
    return slot["out"]


# --------------------------------------------------------------------------- learned weights
def segment_sum(values: Tensor, csr: CSR) -> Tensor:
    """Sum of entry values over each row: ``(nnz, ...) -> (n_rows, ...)`` (0 for an empty row)."""
    return torch.segment_reduce(values, "sum", offsets=csr.indptr, axis=0)


class EdgeSoftmax(torch.autograd.Function):
    """Softmax of entry scores over each row's entries (each destination's in-edges).

    ``scores`` ``(nnz, H)`` -> ``alpha`` ``(nnz, H)`` with ``sum_{e in row i} alpha[e] = 1``.
    Backward: ``grad_s = alpha * (grad_alpha - sum_row(alpha * grad_alpha))``. A row
    without entries contributes nothing (GAT rows always hold their self entry).
    """

    @staticmethod
    def forward(ctx, scores: Tensor, csr: CSR) -> Tensor:
        row_max = torch.segment_reduce(scores, "max", offsets=csr.indptr, axis=0)  # (n_rows, H)
        ex = torch.exp(scores - row_max.index_select(0, csr.row))
        alpha = ex / segment_sum(ex, csr).index_select(0, csr.row)
        ctx.csr = csr
        ctx.save_for_backward(alpha)
        return alpha

    @staticmethod
    def backward(ctx, grad_alpha: Tensor):
        (alpha,) = ctx.saved_tensors
        csr = ctx.csr
        weighted = alpha * grad_alpha
        return weighted - alpha * segment_sum(weighted, csr).index_select(0, csr.row), None


def edge_softmax(scores: Tensor, csr: CSR) -> Tensor:
    return EdgeSoftmax.apply(scores, csr)


class EdgeSpMM(torch.autograd.Function):
    """Per-head aggregation with learned entry weights.

    ``out[i, h] = sum_{e=(i, j)} alpha[e, h] * x[j, h]``; ``alpha`` ``(nnz, H)``,
    ``x`` ``(n_cols, H, D)`` or ``(n_cols, 1, D)`` (one feature row shared by every head)
    -> ``out`` ``(n_rows, H, D)``.
    Backward: ``grad_x[:, h] = A_h^T @ grad_out[:, h]`` (summed over heads for shared
    features) and ``grad_alpha[e, h] = <grad_out[i, h], x[j, h]>`` (SDDMM on the pattern).
    """

    @staticmethod
    def forward(ctx, alpha: Tensor, x: Tensor, csr: CSR) -> Tensor:
        heads = alpha.shape[1]
        if x.shape[1] not in (1, heads):
            raise ValueError(f"edge_spmm: x has {x.shape[1]} heads, alpha {heads}")
        xh = x.transpose(0, 1).contiguous()  # (H or 1, n_cols, D)
        ah = alpha.t().contiguous()  # (H, nnz)
        out = torch.stack([csr.mm(ah[h], xh[h % xh.shape[0]]) for h in range(heads)], dim=1)
        ctx.csr = csr
        ctx.save_for_backward(ah, xh)
        return out  # (n_rows, H, D)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        ah, xh = ctx.saved_tensors
        csr = ctx.csr
        heads, shared = ah.shape[0], xh.shape[0] == 1
        gh = grad_out.transpose(0, 1).contiguous()  # (H, n_rows, D)
        grad_alpha = grad_x = None
        if ctx.needs_input_grad[0]:
            grad_alpha = torch.stack([csr.sddmm(gh[h], xh[h % xh.shape[0]]) for h in range(heads)],
                                     dim=1)  # (nnz, H)
        if ctx.needs_input_grad[1]:
            at = ah.index_select(1, csr.perm)  # (H, nnz) in the transpose's order

            def mm_t(h: int) -> Tensor:
                return csr.mm(ah[h], gh[h], transpose=True, values_t=at[h])  # (n_cols, D)
            if shared:  # one feature row feeds every head: sum the heads' gradients
                grad_x = mm_t(0)
                for h in range(1, heads):
                    grad_x += mm_t(h)
                grad_x = grad_x[:, None]  # (n_cols, 1, D)
            else:
                grad_x = torch.stack([mm_t(h) for h in range(heads)], dim=1)  # (n_cols, H, D)
        return grad_alpha, grad_x, None


def edge_spmm(alpha: Tensor, x: Tensor, csr: CSR) -> Tensor:
    """See :class:`EdgeSpMM`."""
    return EdgeSpMM.apply(alpha, x, csr)
