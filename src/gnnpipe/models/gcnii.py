"""GCNII layer (Chen et al., 2020): initial residual and identity mapping, for deep GCNs."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .block import Block
from .ops import gcn_aggregate


class GCNIIConv(nn.Module):
    r"""GCNII layer ``l`` (1-based) of a deep stack, ``channels -> channels``.

    .. math::
        h' = \mathrm{ReLU}\Big( \big((1-\alpha)\, \tilde P h + \alpha\, x_0\big)
             \big((1-\beta_l) I + \beta_l W_l\big) \Big), \qquad
        \beta_l = \log\big(\tfrac{\lambda}{l} + 1\big)

    followed by dropout. ``\tilde P`` is the GCN normalisation with self loops
    (whole-graph degrees, see :class:`~gnnpipe.models.gcn.GCNConv`), ``x_0`` the initial
    residual: the encoder's output on the destination rows, passed as ``x0_dst``.
    No bias (as in the paper).

    Shapes: ``h_src`` ``(n_src, C)``, ``x0_dst`` ``(n_dst, C)`` -> ``(n_dst, C)``.
    """

    def __init__(self, channels: int, *, layer: int, alpha: float = 0.1, lambda_: float = 0.5,
                 dropout: float = 0.0):
        super().__init__()
        if layer < 1:
            raise ValueError(f"GCNIIConv: layer is 1-based, got {layer}")
        self.in_dim = self.out_dim = channels
        self.layer, self.alpha, self.lambda_, self.dropout = layer, alpha, lambda_, dropout
        self.beta = math.log(lambda_ / layer + 1.0)
        self.weight = nn.Parameter(torch.empty(channels, channels))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.weight)

    def forward(self, h_src: Tensor, block: Block, x0_dst: Tensor | None = None) -> Tensor:
        if x0_dst is None:
            raise ValueError("GCNIIConv needs the initial residual x0_dst (the encoder's output "
                             "on the destination rows)")
        support = (1.0 - self.alpha) * gcn_aggregate(h_src, block) + self.alpha * x0_dst
        out = torch.addmm(support, support, self.weight, beta=1.0 - self.beta, alpha=self.beta)
        return F.dropout(F.relu(out), self.dropout, self.training)

    def cost(self, num_nodes: int, num_edges: int) -> float:
        """Forward FLOPs on a whole graph of ``num_nodes`` nodes and ``num_edges`` edges."""
        c = self.in_dim
        return 2.0 * (num_edges + num_nodes) * c + 2.0 * num_nodes * c * c + 5.0 * num_nodes * c

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.in_dim}, layer={self.layer}, alpha={self.alpha}, "
                f"beta={self.beta:.4f})")
