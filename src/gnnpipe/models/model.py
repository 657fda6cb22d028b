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

from torch import Tensor, nn

from ..config import ModelConfig
from ..kinds import CONVS
from .block import Block
from .layer import GraphLayer  # noqa: F401  (the plain stacks' layer, imported from here too)

KINDS = CONVS.names()  # ("gcn", "sage", "gat", "gcnii", "resgcn", "mlp"): the registry's order


class GNN(nn.Module):
    """``encoder`` (or None) -> ``convs`` (``cfg.layers`` graph layers) -> ``decoder`` (or None).

    Every conv is called ``conv(h_src, block, x0_dst=None) -> h_dst``; ``needs_x0`` says
    whether the convs read the initial residual ``x0_dst`` (the encoder's output on the
    destination rows; GCNII). The kind's registry entry (``CONVS[cfg.kind]``, ``self.spec``)
    builds the stack and declares its convs' exchange width.
    """

    def __init__(self, cfg: ModelConfig, in_features: int, num_classes: int):
        super().__init__()
        if cfg.kind not in CONVS:
            raise ValueError(f"unknown model kind {cfg.kind!r} (known: {', '.join(CONVS.names())})")
        if cfg.layers < 1:
            raise ValueError(f"model.layers must be >= 1, got {cfg.layers}")
        self.kind = cfg.kind
        self.spec = CONVS[cfg.kind]
        self.in_features, self.num_classes, self.hidden = in_features, num_classes, cfg.hidden
        self.needs_x0 = self.spec.needs_x0
        encoder, convs, decoder = self.spec.stack(cfg, in_features, num_classes)
        # registered in construction order, so reset_parameters() draws the same numbers
        self.encoder = encoder
        self.convs = nn.ModuleList(convs)
        self.decoder = decoder

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
        """What one mirror/chunk row of every conv's input costs on the wire, in values: each
        conv kind's own declaration (``ConvKind.exchange_width``; its input width today)."""
        return [self.spec.exchange_width(conv) for conv in self.convs]

    def halo_dims(self) -> list[int]:
        """What one halo row of every conv costs on the wire where nothing is buffered (docs/DESIGN.md
        §4 "Narrow side"): the kind's ``halo_width`` (the projected rows of a GCN / SAGE / GAT conv
        when narrower than its input), except conv 0, whose input halo stays the input (cached)."""
        dims = self.exchange_dims()
        return dims[:1] + [self.spec.halo_width(conv) for conv in self.convs[1:]]

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
