"""The no-graph baseline (``kind: mlp``): a per-node multi-layer perceptron.

It shows how much the graph adds. In :class:`~gnnpipe.models.model.GNN` it is all
encoder (no convs, no decoder), so single-process training runs it unchanged.
"""

from __future__ import annotations

from torch import nn

from .conv_kind import ConvKind, Stack


def mlp_encoder(in_features: int, hidden: int, num_classes: int, layers: int,
                dropout: float) -> nn.Sequential:
    """``layers`` Linear maps ``F -> H -> ... -> H -> C``, ReLU and dropout between them.

    Shapes: ``(n, F) -> (n, C)``; ``layers == 1`` is logistic regression ``F -> C``.
    """
    dims = [in_features] + [hidden] * (layers - 1) + [num_classes]
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(dims[i], dims[i + 1]))
        if i < layers - 1:
            mods += [nn.ReLU(), nn.Dropout(dropout)]
    return nn.Sequential(*mods)


def _stack(cfg, in_features: int, num_classes: int) -> Stack:
    return mlp_encoder(in_features, cfg.hidden, num_classes, cfg.layers, cfg.dropout), [], None


#: the kind's registry entry (gnnpipe.kinds.CONVS["mlp"])
KIND = ConvKind(
    name="mlp", description="the no-graph baseline: a per-node MLP (all encoder, no conv)", stack=_stack)
