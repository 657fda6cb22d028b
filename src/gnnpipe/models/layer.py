"""``GraphLayer``: a conv and what follows it in a plain stack (GCN, SAGE, GAT), and that stack."""

from __future__ import annotations

from typing import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from ..costmodel.work import LayerSpec
from .block import Block
from .conv_kind import Stack


class GraphLayer(nn.Module):
    """A conv and what follows it in a plain stack: LayerNorm?, ReLU?, dropout.

    ``layer(h_src, block) -> (n_dst, conv.out_dim)``; the post-processing is per row, so
    it acts on the destination rows only (what the layer produces). Dropout on the output,
    not the input, means each row is dropped once, by the worker that owns it.
    """

    def __init__(self, conv: nn.Module, *, norm: bool = False, act: bool = False,
                 dropout: float = 0.0):
        super().__init__()
        self.conv = conv
        self.norm = nn.LayerNorm(conv.out_dim) if norm else None
        self.act = act
        self.dropout = dropout

    @property
    def in_dim(self) -> int:
        return self.conv.in_dim

    @property
    def out_dim(self) -> int:
        return self.conv.out_dim

    @property
    def projected_width(self) -> int:
        return self.conv.projected_width

    def project(self, h: Tensor) -> Tensor:
        """The rows a source contributes after the conv's linear map (``conv.project``)."""
        return self.conv.project(h)

    def reset_parameters(self) -> None:
        self.conv.reset_parameters()
        if self.norm is not None:
            self.norm.reset_parameters()

    def forward(self, h_src: Tensor, block: Block, x0_dst: Tensor | None = None, *,
                z_src: Tensor | None = None) -> Tensor:
        """``z_src``: the source rows already projected (``project``); ``h_src`` is then read
        for the destination rows only (a conv whose kind declares ``narrow_width``)."""
        h = self.conv(h_src, block, x0_dst) if z_src is None else self.conv(h_src, block, x0_dst, z_src=z_src)
        if self.norm is not None:
            h = self.norm(h)
        if self.act:  # in place: the conv's and the norm's backward do not read their output
            h = F.relu_(h)
        return F.dropout(h, self.dropout, self.training)

    def cost(self, num_nodes: int, num_edges: int) -> float:
        extra = num_nodes * self.out_dim * ((8 if self.norm is not None else 0) + self.act)
        return self.conv.cost(num_nodes, num_edges) + float(extra)

    def layer_spec(self, *, raw_input: bool, params: int) -> LayerSpec:
        """The cost model's view: the conv's kind, widths and work, the post-processing here.
        ``raw_input``: the layer reads the raw features (no gradient; GCN/SAGE memoise them)."""
        conv = self.conv
        return LayerSpec(conv.kind, conv.in_dim, conv.out_dim, norm=self.norm is not None, act=self.act,
                         dropout=self.dropout > 0, heads=getattr(conv, "heads", 1),
                         head_dim=getattr(conv, "out_dim_head", 0), input_grad=not raw_input, params=params,
                         static_input=raw_input and bool(getattr(conv, "static_input", False)),
                         work=type(conv).work)

    def extra_repr(self) -> str:
        parts = ["norm=layer" if self.norm is not None else None, "act=relu" if self.act else None,
                 f"dropout={self.dropout}" if self.dropout else None]
        return ", ".join(p for p in parts if p)


def plain_stack(conv: Callable[..., nn.Module]) -> Callable[..., Stack]:
    """The stack of GCN / SAGE / GAT: no encoder; conv 1 ``F -> H``, hidden ``H -> H``, last
    ``H -> C`` (no decoder), each but the last followed by LayerNorm (``cfg.norm == "layer"``),
    ReLU and dropout. ``conv(cfg, d_in, d_out, first, last)`` builds one conv."""
    def stack(cfg, in_features: int, num_classes: int) -> Stack:
        L, H = cfg.layers, cfg.hidden
        dims = [in_features] + [H] * (L - 1) + [num_classes]
        convs = []
        for i in range(L):
            last = i == L - 1
            layer = conv(cfg, dims[i], dims[i + 1], i == 0, last)
            convs.append(GraphLayer(layer, norm=cfg.norm == "layer" and not last, act=not last,
                                    dropout=0.0 if last else cfg.dropout))
        return None, convs, None
    return stack
