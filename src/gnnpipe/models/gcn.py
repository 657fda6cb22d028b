"""Graph convolution (Kipf & Welling) with symmetric normalisation and a self loop."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..costmodel.work import LayerCost, LayerSpec, aggregate_first, finish, linear_aggregate, memoised_linear
from .block import Block
from .conv_kind import ConvKind, narrow_width
from .layer import plain_stack
from .ops import gcn_aggregate, linear, static_aggregate

__all__ = ["GCNConv", "aggregate_first", "matmul_spmm_flops"]


def matmul_spmm_flops(num_nodes: int, nnz: int, d_in: int, d_out: int) -> float:
    """FLOPs of one linear map and one aggregation over ``nnz`` entries, in the cheaper order."""
    if aggregate_first(num_nodes, num_nodes, nnz, d_in, d_out):
        return 2.0 * (nnz * d_in + num_nodes * d_in * d_out)
    return 2.0 * (num_nodes * d_in * d_out + nnz * d_out)


class GCNConv(nn.Module):
    r"""GCN layer on a bipartite block.

    .. math::
        h_i' = W \Big( \sum_{j \in N(i)} \frac{x_j}{\sqrt{(d_i + 1)(d_j + 1)}}
               + \frac{x_i}{\sqrt{(d_i + 1)(d_i^{src} + 1)}} \Big) + b

    with ``d_i = block.deg_dst[i]``, ``d_j = block.deg_src[j]`` (whole-graph degrees,
    without self loops) and ``d_i^{src} = block.deg_src[dst_offset + i]`` (equal to
    ``d_i`` on a symmetric graph, so the self term is ``x_i / (d_i + 1)``). Because the
    degrees are the whole graph's, a destination row's output does not depend on how
    the graph was cut into blocks.

    Shapes: ``h_src`` ``(n_src, in_dim)`` -> ``(n_dst, out_dim)``. The transform is
    applied before or after the aggregation, whichever costs fewer operations
    (:func:`aggregate_first`); both are exact. With ``static_input`` (the first layer of
    a stack, fed raw features), an input without gradient that comes back unchanged is
    aggregated once and the result reused (:func:`~gnnpipe.models.ops.static_aggregate`).
    """

    kind = "gcn"

    def __init__(self, in_dim: int, out_dim: int, bias: bool = True, *, static_input: bool = False):
        super().__init__()
        self.in_dim, self.out_dim = in_dim, out_dim
        self.static_input = static_input
        self.weight = nn.Parameter(torch.empty(out_dim, in_dim))
        self.bias = nn.Parameter(torch.empty(out_dim)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.weight)  # Glorot, as in the GCN paper
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @property
    def projected_width(self) -> int:
        return self.out_dim

    def project(self, h: Tensor) -> Tensor:
        """``h W^T``: what a source row contributes, ``(n, in) -> (n, out)`` (``Â(HW) = (ÂH)W``)."""
        return linear(h, self.weight)

    def forward(self, h_src: Tensor, block: Block, x0_dst: Tensor | None = None,
                z_src: Tensor | None = None) -> Tensor:
        if z_src is not None:  # the sources projected by their owners (the narrow side crossed the wire)
            out = gcn_aggregate(z_src, block)  # (n_dst, out)
            return out if self.bias is None else out.add_(self.bias)
        nnz = block.nnz + block.n_dst  # edges plus self loops
        agg = None
        if self.static_input and not h_src.requires_grad:
            agg = static_aggregate(h_src, block, "gcn", gcn_aggregate)  # (n_dst, in) or None
        if agg is not None or aggregate_first(block.n_src, block.n_dst, nnz, self.in_dim, self.out_dim):
            if agg is None:
                agg = gcn_aggregate(h_src, block)  # (n_dst, in)
            return linear(agg, self.weight, self.bias)  # (n_dst, out)
        out = gcn_aggregate(linear(h_src, self.weight), block)  # (n_dst, out)
        return out if self.bias is None else out.add_(self.bias)

    def cost(self, num_nodes: int, num_edges: int) -> float:
        """Forward FLOPs on a whole graph of ``num_nodes`` nodes and ``num_edges`` edges
        (with ``static_input``, the aggregation is paid once, not per epoch: true when the
        same feature tensor is fed every epoch, as single-process and GNNPipe stage 0 do)."""
        if self.static_input:
            return 2.0 * num_nodes * self.in_dim * self.out_dim
        return matmul_spmm_flops(num_nodes, num_nodes + num_edges, self.in_dim, self.out_dim)

    @staticmethod
    def work(spec: LayerSpec, n_dst: float, n_src: float, nnz: float, memoised: bool) -> LayerCost:
        """Work on a block of ``n_dst`` rows, ``n_src`` sources, ``nnz`` in-edges (plus a self
        loop per row), in the order :meth:`forward` picks; memoised: the matmul alone."""
        d_in, d_out = float(spec.d_in), float(spec.d_out)
        if memoised:  # (A x) W with A x memoised: the matmul and its weight gradient
            c = memoised_linear(n_dst, d_in, d_out)
        else:
            c = linear_aggregate(n_dst, n_src, nnz + n_dst, d_in, d_out, spec.input_grad)
        return finish(c, spec, n_dst, bias=True, mask=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.in_dim}, {self.out_dim})"


#: the kind's registry entry (gnnpipe.kinds.CONVS["gcn"])
KIND = ConvKind(
    name="gcn", description="GCN (Kipf & Welling 2017): symmetric normalisation, self loops",
    stack=plain_stack(lambda cfg, d_in, d_out, first, last: GCNConv(d_in, d_out, static_input=first)),
    work=GCNConv.work, halo_width=narrow_width)
