"""GCNII layer (Chen et al., 2020): initial residual and identity mapping, for deep GCNs."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..costmodel.work import LayerCost, LayerSpec, Work, finish
from .block import Block
from .conv_kind import ConvKind, Stack
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

    kind = "gcnii"

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

    @staticmethod
    def work(spec: LayerSpec, n_dst: float, n_src: float, nnz: float, memoised: bool) -> LayerCost:
        """The aggregation (with self loops), the identity-mapped matmul, the residual mix,
        ReLU and its own dropout (mask included)."""
        d_in = float(spec.d_in)
        m = nnz + n_dst
        mm = 2.0 * n_dst * d_in * d_in
        c = LayerCost(Work(dense=mm, sparse=m * d_in, elem=6.0 * n_dst * d_in,
                           rng=n_dst * d_in if spec.dropout else 0.0),
                      Work(dense=2.0 * mm, sparse=m * d_in if spec.input_grad else 0.0, elem=8.0 * n_dst * d_in),
                      saved_dst=2.25 * d_in, temp_src=0.0)
        return finish(c, spec, n_dst, bias=False, mask=False)

    def layer_spec(self, *, raw_input: bool, params: int) -> LayerSpec:
        """The cost model's view (its input is always the encoder's: it takes a gradient)."""
        return LayerSpec("gcnii", self.in_dim, self.out_dim, act=True, dropout=self.dropout > 0, params=params,
                         work=GCNIIConv.work)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.in_dim}, layer={self.layer}, alpha={self.alpha}, "
                f"beta={self.beta:.4f})")


def _stack(cfg, in_features: int, num_classes: int) -> Stack:
    """Encoder ``Linear F -> H``, ReLU, dropout; ``L`` layers ``H -> H`` reading ``x0`` = the
    encoder's output; decoder ``Linear H -> C``."""
    H, p = cfg.hidden, cfg.dropout
    encoder = nn.Sequential(nn.Linear(in_features, H), nn.ReLU(), nn.Dropout(p))
    convs = [GCNIIConv(H, layer=l, alpha=cfg.alpha, lambda_=cfg.lambda_, dropout=p) for l in range(1, cfg.layers + 1)]
    return encoder, convs, nn.Linear(H, num_classes)


#: the kind's registry entry (gnnpipe.kinds.CONVS["gcnii"])
KIND = ConvKind(
    name="gcnii", description="GCNII (Chen et al. 2020): initial residual and identity mapping, for deep stacks",
    stack=_stack, work=GCNIIConv.work, needs_x0=True)
