"""Graph attention layer (Velickovic et al., 2018), multi-head, on a bipartite block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..costmodel.work import LayerCost, LayerSpec, Work, finish
from .block import Block
from .conv_kind import ConvKind, narrow_width
from .layer import plain_stack
from .ops import edge_softmax, edge_spmm, linear, self_loop_csr


def _aggregate_first(n_src: int, n_dst: int, nnz: int, d_in: int, heads: int, d_head: int) -> bool:
    """Whether aggregating ``x`` per head then transforming beats transforming first.

    Multiply-adds: ``heads (nnz d_in + n_dst d_in d_head)`` against
    ``n_src d_in heads d_head + heads nnz d_head``.
    """
    return nnz * d_in + n_dst * d_in * d_head <= n_src * d_in * d_head + nnz * d_head


class GATConv(nn.Module):
    r"""GAT layer with ``heads`` attention heads of width ``out_dim_head`` each.

    .. math::
        e_{ij}^h = \mathrm{LeakyReLU}_{0.2}\big(a_{src}^h \cdot W^h x_j + a_{dst}^h \cdot W^h x_i\big),
        \quad \alpha_{ij}^h = \mathrm{softmax}_{j \in N(i) \cup \{i\}}(e_{ij}^h),
        \quad h_i'^h = \sum_{j \in N(i) \cup \{i\}} \alpha_{ij}^h W^h x_j

    then the heads are concatenated (``concat=True``: out width ``heads * out_dim_head``)
    or averaged (``concat=False``, a last layer: width ``out_dim_head``), plus a bias.

    The softmax runs over each destination's in-edges **and a self edge** ``i -> i``
    (``x_i`` = the destination row ``block.dst_rows(h_src)[i]``), as DGL's GATConv on a
    graph with self loops added (the DGL parity tests add them on the DGL side). Every
    row therefore has at least one entry: a destination without in-edges attends to
    itself only. A softmax over complete in-neighbourhoods needs no degree, so blocks
    (each holding all in-edges of its destinations) give the same result however the
    graph is cut. ``attn_dropout`` drops attention coefficients after the softmax.

    Shapes: ``h_src`` ``(n_src, in_dim)`` -> ``(n_dst, out_dim)``. The scores use
    ``a^h \cdot W^h x = x \cdot (W^{h\top} a^h)``; the aggregation runs on ``W x``
    (transform first) or on ``x`` then transforms (aggregate first), whichever is cheaper
    (both exact).
    """

    kind = "gat"

    def __init__(self, in_dim: int, out_dim_head: int, heads: int = 1, *, concat: bool = True,
                 negative_slope: float = 0.2, attn_dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.in_dim, self.out_dim_head, self.heads, self.concat = in_dim, out_dim_head, heads, concat
        self.out_dim = heads * out_dim_head if concat else out_dim_head
        self.negative_slope, self.attn_dropout = negative_slope, attn_dropout
        self.weight = nn.Parameter(torch.empty(heads * out_dim_head, in_dim))
        self.att_src = nn.Parameter(torch.empty(heads, out_dim_head))
        self.att_dst = nn.Parameter(torch.empty(heads, out_dim_head))
        self.bias = nn.Parameter(torch.empty(self.out_dim)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        gain = nn.init.calculate_gain("relu")
        nn.init.xavier_normal_(self.weight, gain=gain)  # DGL's GATConv initialisation
        nn.init.xavier_normal_(self.att_src.view(1, -1), gain=gain)
        nn.init.xavier_normal_(self.att_dst.view(1, -1), gain=gain)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @property
    def projected_width(self) -> int:
        return self.heads * self.out_dim_head

    def project(self, h: Tensor) -> Tensor:
        """``h W^T``: every head's projection of a source row, ``(n, in) -> (n, heads * out_dim_head)``
        (a source's score ``a_src^h . W^h x_j`` and its message ``W^h x_j`` are read from it)."""
        return linear(h, self.weight)

    def forward(self, h_src: Tensor, block: Block, x0_dst: Tensor | None = None,
                z_src: Tensor | None = None) -> Tensor:
        H, D = self.heads, self.out_dim_head
        w = self.weight.view(H, D, self.in_dim)
        csr = self_loop_csr(block)
        # attention scores: x . (W^h^T a^h), (n, H)
        if z_src is not None:  # the sources projected by their owners: h_src is read for dst rows only
            zs = z_src.view(-1, H, D)
            el = torch.einsum("nhd,hd->nh", zs, self.att_src)  # (n_src, H)
        else:
            el = h_src @ torch.einsum("hdi,hd->ih", w, self.att_src)  # (n_src, H)
        er = block.dst_rows(h_src) @ torch.einsum("hdi,hd->ih", w, self.att_dst)  # (n_dst, H)
        scores = F.leaky_relu(el.index_select(0, csr.indices) + er.index_select(0, csr.row),
                              self.negative_slope)  # (nnz + n_dst, H)
        alpha = edge_softmax(scores, csr)
        alpha = F.dropout(alpha, self.attn_dropout, self.training)
        if z_src is not None:
            out = edge_spmm(alpha, z_src.view(-1, H, D), csr)  # (n_dst, H, D)
        elif _aggregate_first(block.n_src, block.n_dst, csr.nnz, self.in_dim, H, D):
            agg = edge_spmm(alpha, h_src[:, None, :], csr)  # (n_dst, H, in)
            out = torch.einsum("nhi,hdi->nhd", agg, w)  # (n_dst, H, D)
        else:
            z = linear(h_src, self.weight).view(-1, H, D)  # (n_src, H, D)
            out = edge_spmm(alpha, z, csr)  # (n_dst, H, D)
        out = out.reshape(-1, H * D) if self.concat else out.mean(dim=1)
        if self.bias is not None:
            out = out + self.bias
        return out

    def cost(self, num_nodes: int, num_edges: int) -> float:
        """Forward FLOPs on a whole graph of ``num_nodes`` nodes and ``num_edges`` edges."""
        n, nnz, H, D, F_ = num_nodes, num_edges + num_nodes, self.heads, self.out_dim_head, self.in_dim
        scores = 4.0 * n * F_ * H + 10.0 * nnz * H
        if _aggregate_first(n, n, nnz, F_, H, D):
            agg = 2.0 * (nnz * H * F_ + n * H * F_ * D)
        else:
            agg = 2.0 * (n * F_ * H * D + nnz * H * D)
        return scores + agg

    @staticmethod
    def work(spec: LayerSpec, n_dst: float, n_src: float, nnz: float, memoised: bool) -> LayerCost:
        """Scores, softmax and attention dropout per (entry with self edges, head), the
        aggregation in the order :meth:`forward` picks; backward adds the SDDMM."""
        d_in = float(spec.d_in)
        H, D = float(spec.heads), float(spec.head_dim or spec.d_out)
        m = nnz + n_dst  # with self edges
        score = 2.0 * (n_src + n_dst) * d_in * H  # x . (W^T a) for sources and destinations
        g = 2.0 if spec.input_grad else 1.0
        if _aggregate_first(n_src, n_dst, m, d_in, H, D):
            mm, width, saved_dst, saved_src = 2.0 * n_dst * H * d_in * D, d_in, H * d_in, 0.0
        else:
            mm, width, saved_dst, saved_src = 2.0 * n_src * d_in * H * D, D, 0.0, H * D
        fwd = Work(dense=score + mm, sparse=H * m * width, elem=9.0 * m * H)
        bwd = Work(dense=g * (score + mm), sparse=2.0 * H * m * width, elem=12.0 * m * H)
        c = LayerCost(fwd, bwd, saved_dst=saved_dst, saved_src=saved_src, saved_entry=2.0 * H, temp_src=H * D)
        return finish(c, spec, n_dst, bias=True, mask=True)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.in_dim}, {self.out_dim_head}, heads={self.heads}"
                f"{'' if self.concat else ', concat=False'})")


def _gat_conv(cfg, d_in: int, d_out: int, first: bool, last: bool) -> GATConv:
    """Hidden layers split ``hidden`` over ``cfg.heads`` concatenated heads; the last averages them."""
    if last:
        return GATConv(d_in, d_out, heads=cfg.heads, concat=False)
    if d_out % cfg.heads:
        raise ValueError(f"gat: hidden ({d_out}) must be a multiple of heads ({cfg.heads})")
    return GATConv(d_in, d_out // cfg.heads, heads=cfg.heads, concat=True)


#: the kind's registry entry (gnnpipe.kinds.CONVS["gat"])
KIND = ConvKind(
    name="gat", description="GAT (Velickovic et al. 2018): multi-head attention over in-edges and a self edge",
    stack=plain_stack(_gat_conv), work=GATConv.work, halo_width=narrow_width)
