"""ResGCN+ layer: DeeperGCN's "res+" pre-activation residual block (Li et al., 2020)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .block import Block
from .gcn import GCNConv
from .ops import compact


class ResGCNLayer(nn.Module):
    r"""One res+ block, ``channels -> channels``.

    .. math::
        h_i' = h_i + \mathrm{GCNConv}\big(\mathrm{dropout}(\mathrm{ReLU}(\mathrm{LayerNorm}(h)))\big)_i

    The pre-activation (LayerNorm, ReLU, dropout) acts on the *source* rows, before the
    aggregation; the residual adds the destination rows ``block.dst_rows(h_src)``.
    LayerNorm is per row, so the result is the same however the graph is cut; it runs on
    the source rows the block reads only (:func:`~gnnpipe.models.ops.compact`), not on
    all ``N`` rows of a chunk's whole-graph buffer.

    Shapes: ``h_src`` ``(n_src, C)`` -> ``(n_dst, C)``.
    """

    def __init__(self, channels: int, *, dropout: float = 0.0):
        super().__init__()
        self.in_dim = self.out_dim = channels
        self.dropout = dropout
        self.norm = nn.LayerNorm(channels)
        self.conv = GCNConv(channels, channels)

    def reset_parameters(self) -> None:
        self.norm.reset_parameters()
        self.conv.reset_parameters()

    def forward(self, h_src: Tensor, block: Block, x0_dst: Tensor | None = None) -> Tensor:
        sub, used = compact(block)
        h_used = h_src if used is None else h_src[used]  # (n_used, C)
        z = F.dropout(F.relu(self.norm(h_used)), self.dropout, self.training)
        return block.dst_rows(h_src) + self.conv(z, sub)

    def cost(self, num_nodes: int, num_edges: int) -> float:
        """Forward FLOPs on a whole graph of ``num_nodes`` nodes and ``num_edges`` edges."""
        return self.conv.cost(num_nodes, num_edges) + 10.0 * num_nodes * self.in_dim

    def extra_repr(self) -> str:
        return f"dropout={self.dropout}" if self.dropout else ""
