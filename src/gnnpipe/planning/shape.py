"""The model as the cost model sees it: every conv's kind and widths, the encoder's and
decoder's Linear maps, the parameter counts (:func:`model_shape`) of a built ``GNN``."""

from __future__ import annotations

from .. import costmodel as cm
from ..config import ModelConfig
from ..io import GnnPipeError

DTYPE_BYTES = {"float32": 4, "float64": 8}


def model_shape(model) -> cm.ModelShape:
    """The cost model's view of a built ``GNN``: every conv's kind and widths, the
    encoder's and decoder's Linear maps, the parameter counts."""
    from torch import nn

    from ..models.gat import GATConv
    from ..models.gcn import GCNConv
    from ..models.gcnii import GCNIIConv
    from ..models.model import GraphLayer
    from ..models.resgcn import ResGCNLayer
    from ..models.sage import SAGEConv

    if not len(model.convs):
        raise GnnPipeError(f"model kind {model.kind!r} has no graph layers: there is nothing to "
                           "distribute across workers (train it with mode single)")
    specs = []
    for i, layer in enumerate(model.convs):
        params = sum(p.numel() for p in layer.parameters())
        first_raw = i == 0 and model.encoder is None  # raw features need no gradient
        if isinstance(layer, GraphLayer):
            conv = layer.conv
            kind = {GCNConv: "gcn", SAGEConv: "sage", GATConv: "gat"}.get(type(conv))
            if kind is None:
                raise GnnPipeError(f"cost model: unknown conv {type(conv).__name__}")
            specs.append(cm.LayerSpec(kind, conv.in_dim, conv.out_dim, norm=layer.norm is not None,
                                      act=layer.act, dropout=layer.dropout > 0,
                                      heads=getattr(conv, "heads", 1),
                                      head_dim=getattr(conv, "out_dim_head", 0),
                                      input_grad=not first_raw, params=params,
                                      static_input=first_raw and bool(getattr(conv, "static_input", False))))
        elif isinstance(layer, GCNIIConv):
            specs.append(cm.LayerSpec("gcnii", layer.in_dim, layer.out_dim, act=True,
                                      dropout=layer.dropout > 0, params=params))
        elif isinstance(layer, ResGCNLayer):
            specs.append(cm.LayerSpec("resgcn", layer.in_dim, layer.out_dim,
                                      dropout=layer.dropout > 0, params=params))
        else:
            raise GnnPipeError(f"cost model: unknown layer {type(layer).__name__}")

    def linears(module):
        if module is None:
            return ()
        return tuple((m.in_features, m.out_features) for m in module.modules() if isinstance(m, nn.Linear))

    def count(module):
        return 0 if module is None else sum(p.numel() for p in module.parameters())

    def dropped(module):  # values per row behind a Dropout (after the Linear before it)
        if module is None:
            return 0
        width, out = model.in_features, 0
        for m in module.modules():
            if isinstance(m, nn.Linear):
                width = m.out_features
            elif isinstance(m, nn.Dropout) and m.p > 0:
                out += width
        return out

    return cm.ModelShape(layers=tuple(specs), in_features=model.in_features,
                         num_classes=model.num_classes, encoder=linears(model.encoder),
                         decoder=linears(model.decoder), encoder_params=count(model.encoder),
                         decoder_params=count(model.decoder), carries_x0=model.needs_x0,
                         x0_dim=model.hidden if model.needs_x0 else 0,
                         encoder_dropout=dropped(model.encoder))


def build_model(model_cfg: ModelConfig, in_features: int, num_classes: int):
    from ..models.model import GNN

    try:
        return GNN(model_cfg, in_features, num_classes)
    except ValueError as e:
        raise GnnPipeError(f"model: {e}") from None
