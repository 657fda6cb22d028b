"""The GNN stack: ``encoder -> convs -> decoder``, one plain ``nn.Module`` for every mode.

The model knows nothing about distribution (docs/ARCHITECTURE.md "Models"). An engine
runs the pieces itself: ``encode`` on the rows it owns, each ``conv`` on a block whose
source rows it has exchanged or buffered, ``decode`` on its destination rows. Whole
model on one block (single process, exact inference)::

    model = GNN(cfg, in_features=F, num_classes=C)
    logits = model(x, Block.full(indptr, indices))         # (N, C)

Architectures (``cfg.kind``), ``L = cfg.layers``, ``H = cfg.hidden``:

* ``gcn`` / ``sage`` / ``gat``: no encoder; conv 1 ``F -> H``, hidden ``H -> H``, last
  ``H -> C`` (no decoder). GCN/SAGE conv 1 aggregates the raw features once and reuses
  the result while the same feature tensor comes back (``static_input``). Every layer but the last is followed by LayerNorm (when
  ``cfg.norm == "layer"``), ReLU and dropout (:class:`GraphLayer`). GAT splits ``H``
  over ``cfg.heads`` heads and concatenates them; its last layer averages the heads.
* ``gcnii``: encoder ``Linear F -> H``, ReLU, dropout; ``L`` :class:`GCNIIConv` ``H -> H``
  with the initial residual ``x0`` = the encoder's output; decoder ``Linear H -> C``.
* ``resgcn``: ResGCN+ (DeeperGCN "res+"): encoder ``Linear F -> H``; ``L``
  :class:`ResGCNLayer`; decoder LayerNorm, ReLU, ``Linear H -> C``.
* ``mlp``: the no-graph baseline: ``L`` Linear layers with ReLU and dropout between them,
  all in the encoder; no convs.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from .block import Block
from .gat import GATConv
from .gcn import GCNConv
from .gcnii import GCNIIConv
from .mlp import mlp_encoder
from .resgcn import ResGCNLayer
from .sage import SAGEConv

KINDS = ("gcn", "sage", "gat", "gcnii", "resgcn", "mlp")


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

    def reset_parameters(self) -> None:
        self.conv.reset_parameters()
        if self.norm is not None:
            self.norm.reset_parameters()

    def forward(self, h_src: Tensor, block: Block, x0_dst: Tensor | None = None) -> Tensor:
        h = self.conv(h_src, block, x0_dst)
        if self.norm is not None:
            h = self.norm(h)
        if self.act:  # in place: the conv's and the norm's backward do not read their output
            h = F.relu_(h)
        return F.dropout(h, self.dropout, self.training)

    def cost(self, num_nodes: int, num_edges: int) -> float:
        extra = num_nodes * self.out_dim * ((8 if self.norm is not None else 0) + self.act)
        return self.conv.cost(num_nodes, num_edges) + float(extra)

    def extra_repr(self) -> str:
        parts = ["norm=layer" if self.norm is not None else None, "act=relu" if self.act else None,
                 f"dropout={self.dropout}" if self.dropout else None]
        return ", ".join(p for p in parts if p)


class GNN(nn.Module):
    """``encoder`` (or None) -> ``convs`` (``cfg.layers`` graph layers) -> ``decoder`` (or None).

    Every conv is called ``conv(h_src, block, x0_dst=None) -> h_dst``; ``needs_x0`` says
    whether the convs read the initial residual ``x0_dst`` (the encoder's output on the
    destination rows; GCNII).
    """

    def __init__(self, cfg: ModelConfig, in_features: int, num_classes: int):
        super().__init__()
        if cfg.kind not in KINDS:
            raise ValueError(f"unknown model kind {cfg.kind!r} (known: {', '.join(KINDS)})")
        if cfg.layers < 1:
            raise ValueError(f"model.layers must be >= 1, got {cfg.layers}")
        self.kind = cfg.kind
        self.in_features, self.num_classes, self.hidden = in_features, num_classes, cfg.hidden
        self.needs_x0 = cfg.kind == "gcnii"
        L, H, C, p = cfg.layers, cfg.hidden, num_classes, cfg.dropout
        encoder: nn.Module | None = None
        decoder: nn.Module | None = None
        convs: list[nn.Module] = []
        if cfg.kind in ("gcn", "sage", "gat"):
            dims = [in_features] + [H] * (L - 1) + [C]
            for i in range(L):
                last = i == L - 1
                conv = self._plain_conv(cfg, dims[i], dims[i + 1], i == 0, last)
                convs.append(GraphLayer(conv, norm=cfg.norm == "layer" and not last,
                                        act=not last, dropout=0.0 if last else p))
        elif cfg.kind == "gcnii":
            encoder = nn.Sequential(nn.Linear(in_features, H), nn.ReLU(), nn.Dropout(p))
            convs = [GCNIIConv(H, layer=l, alpha=cfg.alpha, lambda_=cfg.lambda_, dropout=p)
                     for l in range(1, L + 1)]
            decoder = nn.Linear(H, C)
        elif cfg.kind == "resgcn":
            encoder = nn.Linear(in_features, H)
            convs = [ResGCNLayer(H, dropout=p) for _ in range(L)]
            decoder = nn.Sequential(nn.LayerNorm(H), nn.ReLU(), nn.Linear(H, C))
        else:  # mlp
            encoder = mlp_encoder(in_features, H, C, L, p)
        # registered in construction order, so reset_parameters() draws the same numbers
        self.encoder = encoder
        self.convs = nn.ModuleList(convs)
        self.decoder = decoder

    @staticmethod
    def _plain_conv(cfg: ModelConfig, d_in: int, d_out: int, first: bool, last: bool) -> nn.Module:
        if cfg.kind == "gcn":
            return GCNConv(d_in, d_out, static_input=first)
        if cfg.kind == "sage":
            return SAGEConv(d_in, d_out, static_input=first)
        if last:
            return GATConv(d_in, d_out, heads=cfg.heads, concat=False)
        if d_out % cfg.heads:
            raise ValueError(f"gat: hidden ({d_out}) must be a multiple of heads ({cfg.heads})")
        return GATConv(d_in, d_out // cfg.heads, heads=cfg.heads, concat=True)

    # ------------------------------------------------------------------ pieces
    def encode(self, x: Tensor) -> Tensor:
        """Per-node input map ``(n, F) -> (n, exchange_dims()[0])`` (identity without encoder)."""
        return x if self.encoder is None else self.encoder(x)

    def decode(self, h: Tensor) -> Tensor:
        """Per-node output map ``(n, conv_out_dims()[-1]) -> (n, C)`` (identity without decoder)."""
        return h if self.decoder is None else self.decoder(h)

    def forward(self, x: Tensor, block: Block | None = None) -> Tensor:
        """The whole model on one block whose source rows are its destination rows.

        ``x`` ``(n, F)`` -> logits ``(n, C)``. With more than one conv the block must be
        square (``n_src == n_dst``, ``dst_offset == 0``), e.g. ``Block.full``: each layer's
        output rows are the next layer's source rows.
        """
        h = self.encode(x)
        if not len(self.convs):
            return self.decode(h)
        if block is None:
            raise ValueError(f"{self.kind}: forward needs a block")
        if len(self.convs) > 1 and (block.n_src != block.n_dst or block.dst_offset != 0):
            raise ValueError(f"GNN.forward runs {len(self.convs)} layers on one block, which must "
                             f"be square (dst rows = src rows); got {block}")
        x0 = block.dst_rows(h) if self.needs_x0 else None
        for conv in self.convs:
            h = conv(h, block, x0)
        return self.decode(h)

    def reset_parameters(self) -> None:
        """Re-initialise every parameter, in construction order (same seed, same weights)."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters") and any(
                    True for _ in m.parameters(recurse=False)):
                m.reset_parameters()

    # ------------------------------------------------------------------ shapes and costs
    def exchange_dims(self) -> list[int]:
        """Input width of every conv: what one mirror/chunk row costs per layer, in values."""
        return [conv.in_dim for conv in self.convs]

    def conv_out_dims(self) -> list[int]:
        """Output width of every conv."""
        return [conv.out_dim for conv in self.convs]

    def layer_costs(self, num_nodes: int, num_edges: int) -> list[float]:
        """Estimated training FLOPs (forward + backward, ~3x forward) of every conv on a
        graph of ``num_nodes`` nodes and ``num_edges`` edges (the pipeline's stage balance)."""
        return [3.0 * conv.cost(num_nodes, num_edges) for conv in self.convs]

    def encoder_cost(self, num_nodes: int) -> float:
        """Estimated training FLOPs of the encoder on ``num_nodes`` rows (0 without one)."""
        return 3.0 * _linear_flops(self.encoder, num_nodes)

    def decoder_cost(self, num_nodes: int) -> float:
        """Estimated training FLOPs of the decoder on ``num_nodes`` rows (0 without one)."""
        return 3.0 * _linear_flops(self.decoder, num_nodes)


def _linear_flops(module: nn.Module | None, rows: int) -> float:
    if module is None:
        return 0.0
    return float(sum(2 * rows * m.in_features * m.out_features
                     for m in module.modules() if isinstance(m, nn.Linear)))
