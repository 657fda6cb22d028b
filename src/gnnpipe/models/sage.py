"""GraphSAGE layer with mean aggregation (Hamilton et al.), on a bipartite block."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .block import Block
from .gcn import aggregate_first, matmul_spmm_flops
from .ops import mean_aggregate


class SAGEConv(nn.Module):
    r"""GraphSAGE-mean layer.

    .. math::
        h_i' = W_{self}\, x_i + W_{neigh} \frac{1}{d_i} \sum_{j \in N(i)} x_j + b

    with ``d_i = block.deg_dst[i]`` (whole-graph in-degree) and ``x_i`` the destination
    row ``block.dst_rows(h_src)[i]``. A destination without in-edges gets a neighbour
    term of 0. No self loop is added: the self term has its own weight.

    Shapes: ``h_src`` ``(n_src, in_dim)`` -> ``(n_dst, out_dim)``. The neighbour transform
    is applied before or after the aggregation, whichever is cheaper (both exact).
    """

    def __init__(self, in_dim: int, out_dim: int, bias: bool = True):
        super().__init__()
        self.in_dim, self.out_dim = in_dim, out_dim
        self.weight_self = nn.Parameter(torch.empty(out_dim, in_dim))
        self.weight_neigh = nn.Parameter(torch.empty(out_dim, in_dim))
        self.bias = nn.Parameter(torch.empty(out_dim)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.weight_self)
        nn.init.xavier_uniform_(self.weight_neigh)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, h_src: Tensor, block: Block, x0_dst: Tensor | None = None) -> Tensor:
        out = block.dst_rows(h_src) @ self.weight_self.t()  # (n_dst, out)
        if aggregate_first(block.n_src, block.n_dst, block.nnz, self.in_dim, self.out_dim):
            out = out + mean_aggregate(h_src, block) @ self.weight_neigh.t()
        else:
            out = out + mean_aggregate(h_src @ self.weight_neigh.t(), block)
        if self.bias is not None:
            out = out + self.bias
        return out

    def cost(self, num_nodes: int, num_edges: int) -> float:
        """Forward FLOPs on a whole graph of ``num_nodes`` nodes and ``num_edges`` edges."""
        return (matmul_spmm_flops(num_nodes, num_edges, self.in_dim, self.out_dim)
                + 2.0 * num_nodes * self.in_dim * self.out_dim)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.in_dim}, {self.out_dim}, aggr=mean)"
