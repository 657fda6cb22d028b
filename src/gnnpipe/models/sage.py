"""GraphSAGE layer with mean aggregation (Hamilton et al.), on a bipartite block."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..costmodel.work import LayerCost, LayerSpec, aggregate_first, finish, linear_aggregate, memoised_linear
from .block import Block
from .gcn import matmul_spmm_flops
from .conv_kind import ConvKind, narrow_width
from .layer import plain_stack
from .ops import linear, mean_aggregate, static_aggregate


class SAGEConv(nn.Module):
    r"""GraphSAGE-mean layer.

    .. math::
        h_i' = W_{self}\, x_i + W_{neigh} \frac{1}{d_i} \sum_{j \in N(i)} x_j + b

    with ``d_i = block.deg_dst[i]`` (whole-graph in-degree) and ``x_i`` the destination
    row ``block.dst_rows(h_src)[i]``. A destination without in-edges gets a neighbour
    term of 0. No self loop is added: the self term has its own weight.

    Shapes: ``h_src`` ``(n_src, in_dim)`` -> ``(n_dst, out_dim)``. The neighbour transform
    is applied before or after the aggregation, whichever is cheaper (both exact).
    ``static_input``: see :class:`~gnnpipe.models.gcn.GCNConv` (the neighbour mean of
    raw features is computed once, kept beside the destination rows as ``[x_dst | mean]``, and
    both maps run as one product over it).
    """

    kind = "sage"

    def __init__(self, in_dim: int, out_dim: int, bias: bool = True, *, static_input: bool = False):
        super().__init__()
        self.in_dim, self.out_dim = in_dim, out_dim
        self.static_input = static_input
        self.weight_self = nn.Parameter(torch.empty(out_dim, in_dim))
        self.weight_neigh = nn.Parameter(torch.empty(out_dim, in_dim))
        self.bias = nn.Parameter(torch.empty(out_dim)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.weight_self)
        nn.init.xavier_uniform_(self.weight_neigh)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @property
    def projected_width(self) -> int:
        return self.out_dim

    def project(self, h: Tensor) -> Tensor:
        """``h W_neigh^T``: what a source row contributes to a neighbour mean, ``(n, in) -> (n, out)``."""
        return linear(h, self.weight_neigh)

    def forward(self, h_src: Tensor, block: Block, x0_dst: Tensor | None = None,
                z_src: Tensor | None = None) -> Tensor:
        static = z_src is None and self.static_input and not h_src.requires_grad
        if static:
            # raw features: [x_dst | mean of x] memoised (n_dst, 2 in), then both maps and the bias in
            # one product, ops.linear (one forward and one weight gradient backward, not two of each)
            xa = static_aggregate(h_src, block, "self|mean", _self_and_mean)
            if xa is not None:
                return linear(xa, torch.cat([self.weight_self, self.weight_neigh], dim=1), self.bias)
        x_dst = block.dst_rows(h_src)
        if z_src is None and not static and x_dst is h_src and \
                not aggregate_first(block.n_src, block.n_dst, block.nnz, self.in_dim, self.out_dim):
            # a whole-graph block, projecting first: both maps in one product over h (n, 2 out), and
            # in backward one product back (no second (n, in) gradient to add to the first)
            w = torch.cat([self.weight_self, self.weight_neigh])  # (2 out, in)
            y_self, y_neigh = linear(h_src, w).split(self.out_dim, dim=1)  # (n, out) each
            agg = mean_aggregate(y_neigh, block)
            return agg.add_(y_self) if self.bias is None else agg.add_(y_self).add_(self.bias)
        out = linear(x_dst, self.weight_self, self.bias)  # (n_dst, out)
        if z_src is not None:  # the sources projected by their owners (the narrow side crossed the wire)
            return out.add_(mean_aggregate(z_src, block))
        if aggregate_first(block.n_src, block.n_dst, block.nnz, self.in_dim, self.out_dim):
            return out.addmm_(mean_aggregate(h_src, block), self.weight_neigh.t())
        return out.add_(mean_aggregate(h_src @ self.weight_neigh.t(), block))

    def cost(self, num_nodes: int, num_edges: int) -> float:
        """Forward FLOPs on a whole graph of ``num_nodes`` nodes and ``num_edges`` edges."""
        mm = 2.0 * num_nodes * self.in_dim * self.out_dim
        if self.static_input:
            return 2.0 * mm
        return matmul_spmm_flops(num_nodes, num_edges, self.in_dim, self.out_dim) + mm

    @staticmethod
    def work(spec: LayerSpec, n_dst: float, n_src: float, nnz: float, memoised: bool) -> LayerCost:
        """The neighbour term as :meth:`forward` orders it (memoised: its matmul alone), plus
        the self term's matmul (and its input gradient)."""
        d_in, d_out = float(spec.d_in), float(spec.d_out)
        if memoised:
            c = memoised_linear(n_dst, d_in, d_out)
            mm = 2.0 * n_dst * d_in * d_out
            c.fwd.dense += mm  # the self term, and its weight gradient
            c.bwd.dense += mm
            c.saved_dst += d_in
        else:
            c = linear_aggregate(n_dst, n_src, nnz, d_in, d_out, spec.input_grad)
            self_mm = 2.0 * n_dst * d_in * d_out
            c.fwd.dense += self_mm
            c.bwd.dense += self_mm * (2.0 if spec.input_grad else 1.0)
            c.saved_dst += d_in
        return finish(c, spec, n_dst, bias=True, mask=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.in_dim}, {self.out_dim}, aggr=mean)"


def _self_and_mean(x: Tensor, block: Block) -> Tensor:
    """``[x_dst | mean over in-neighbours of x]``: ``(n_src, d) -> (n_dst, 2 d)``."""
    return torch.cat([block.dst_rows(x), mean_aggregate(x, block)], dim=1)


#: the kind's registry entry (gnnpipe.kinds.CONVS["sage"])
KIND = ConvKind(
    name="sage", description="GraphSAGE-mean (Hamilton et al. 2017): a self weight and a neighbour mean",
    stack=plain_stack(lambda cfg, d_in, d_out, first, last: SAGEConv(d_in, d_out, static_input=first)),
    work=SAGEConv.work, halo_width=narrow_width)
