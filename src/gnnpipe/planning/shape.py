"""The model as the cost model sees it: every conv's kind and widths, the encoder's and
decoder's Linear maps, the parameter counts (:func:`model_shape`) of a built ``GNN``."""

from __future__ import annotations

from ..config import ModelConfig
from ..io import GnnPipeError

DTYPE_BYTES = {"float32": 4, "float64": 8}


def model_shape(model):
    """:func:`gnnpipe.models.shape.model_shape` (imported when called: ``gnnpipe.models`` imports
    torch, which a command that only reads DTYPE_BYTES must not pay)."""
    from ..models.shape import model_shape as shape

    return shape(model)


def build_model(model_cfg: ModelConfig, in_features: int, num_classes: int):
    from ..models.model import GNN

    try:
        return GNN(model_cfg, in_features, num_classes)
    except ValueError as e:
        raise GnnPipeError(f"model: {e}") from None
