"""ResGCN+ layer: DeeperGCN's "res+" pre-activation residual block (Li et al., 2020)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..costmodel.work import LayerCost, LayerSpec, finish, linear_aggregate
from .block import Block
from .gcn import GCNConv
from .conv_kind import ConvKind, Stack
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

    kind = "resgcn"

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

    @staticmethod
    def work(spec: LayerSpec, n_dst: float, n_src: float, nnz: float, memoised: bool) -> LayerCost:
        """The pre-activation (LayerNorm, ReLU, dropout) on every *source* row, then a GCN conv
        and the residual."""
        d_in, d_out = float(spec.d_in), float(spec.d_out)
        c = linear_aggregate(n_dst, n_src, nnz + n_dst, d_in, d_out, True)
        c.fwd.elem += 10.0 * n_src * d_in + n_dst * d_out
        c.fwd.rng += n_src * d_in if spec.dropout else 0.0
        c.bwd.elem += 13.0 * n_src * d_in + n_dst * d_out
        c.saved_src += 2.25 * d_in
        c.temp_src = max(c.temp_src, d_in)
        return finish(c, spec, n_dst, bias=False, mask=False)

    def layer_spec(self, *, raw_input: bool, params: int) -> LayerSpec:
        """The cost model's view (its input is always the encoder's)."""
        return LayerSpec("resgcn", self.in_dim, self.out_dim, dropout=self.dropout > 0, params=params,
                         work=ResGCNLayer.work)

    def extra_repr(self) -> str:
        return f"dropout={self.dropout}" if self.dropout else ""


def _stack(cfg, in_features: int, num_classes: int) -> Stack:
    """Encoder ``Linear F -> H``; ``L`` res+ blocks; decoder LayerNorm, ReLU, ``Linear H -> C``."""
    H = cfg.hidden
    encoder = nn.Linear(in_features, H)
    convs = [ResGCNLayer(H, dropout=cfg.dropout) for _ in range(cfg.layers)]
    return encoder, convs, nn.Sequential(nn.LayerNorm(H), nn.ReLU(), nn.Linear(H, num_classes))


#: the kind's registry entry (gnnpipe.kinds.CONVS["resgcn"])
KIND = ConvKind(
    name="resgcn", description="ResGCN+ (DeeperGCN res+, Li et al. 2020): pre-activation residual GCN blocks",
    stack=_stack, work=ResGCNLayer.work)
