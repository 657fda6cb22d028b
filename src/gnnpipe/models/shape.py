"""The model as the cost model sees it (:func:`model_shape`): every conv's kind and widths, the
encoder's and decoder's Linear maps, the parameter counts of a built ``GNN``. Here, below the
trainer, so that a training job can count the work of the layers it times (``gnnpipe.layertimes``);
``gnnpipe.planning.shape`` re-exports it."""

from __future__ import annotations

from dataclasses import replace

from ..costmodel.work import ModelShape
from ..io import GnnPipeError


def model_shape(model) -> ModelShape:
    """The cost model's view of a built ``GNN``: every conv's own ``layer_spec`` (kind, widths,
    work), the encoder's and decoder's Linear maps, the parameter counts."""
    from torch import nn

    if not len(model.convs):
        raise GnnPipeError(f"model kind {model.kind!r} has no graph layers: there is nothing to "
                           "distribute across workers (train it with mode single)")
    raw = model.encoder is None  # the first conv reads raw features: no gradient flows there
    specs = [replace(layer.layer_spec(raw_input=raw and i == 0, params=sum(p.numel() for p in layer.parameters())),
                     exchange=width, halo=halo)  # the kind's declarations (ConvKind.exchange_width, halo_width)
             for i, (layer, width, halo) in enumerate(zip(model.convs, model.exchange_dims(), model.halo_dims()))]

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

    return ModelShape(layers=tuple(specs), in_features=model.in_features,
                      num_classes=model.num_classes, encoder=linears(model.encoder),
                      decoder=linears(model.decoder), encoder_params=count(model.encoder),
                      decoder_params=count(model.decoder), carries_x0=model.needs_x0,
                      x0_dim=model.hidden if model.needs_x0 else 0,
                      encoder_dropout=dropped(model.encoder))
