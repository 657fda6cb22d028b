"""What a node model kind is (:class:`ConvKind`): the entries of ``gnnpipe.kinds.CONVS``, one
:class:`~gnnpipe.registry.Registry` (the mechanism the atomic models use too) whose names are
listed there without torch and whose entries are defined beside each layer's ``forward``
(``gnnpipe.models.<kind>.KIND``).

A :class:`ConvKind` says everything the rest of the package asks about a kind: how its stack
is built (encoder, convs, decoder, in that order: the seed draws the same weights), what its
convs cost (``work``, the layer's own declaration, priced by ``gnnpipe.costmodel``), whether
its convs read the initial residual ``x0``, and how wide a row of a conv's input is on the
wire (``exchange_width``: the rows crossing a stage boundary, and the halo rows unless the kind
declares ``halo_width = narrow_width``: then a conv whose projected rows are narrower than its
input exchanges those, docs/DESIGN.md §4 "Narrow side"). Schema enums
and CLI choices are ``CONVS.names()``; ``GNN`` asks ``CONVS[cfg.kind]`` and never switches on
the name.

    CONVS["gcn"].stack(cfg, in_features, num_classes)   # (encoder, convs, decoder)
    CONVS["gcnii"].needs_x0                              # True
    CONVS["sage"].layer_spec(64, 16)                     # the cost model's view of one conv

``mlp`` is the kind without a conv (the no-graph baseline): all encoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from torch import nn

from ..costmodel.work import LayerSpec, WorkFn

#: (encoder or None, convs, decoder or None), built in that order
Stack = tuple[Optional[nn.Module], list[nn.Module], Optional[nn.Module]]


def input_width(layer: nn.Module) -> int:
    """A conv's input rows cross the wire (stage boundaries, buffers; the halo of a kind that
    declares nothing narrower)."""
    return layer.in_dim


def narrow_width(layer: nn.Module) -> int:
    """The halo width of a conv whose aggregation commutes with its linear map (GCN, SAGE's
    neighbour branch, GAT's projected heads): its input or its projected rows
    (``layer.projected_width``, what ``layer.project(h)`` returns), whichever is narrower.
    The engine sends the projected rows (and takes their gradient back) when they are."""
    return min(layer.in_dim, layer.projected_width)


@dataclass(frozen=True)
class ConvKind:
    """What the package knows about one node model kind (see the module docstring)."""

    name: str
    description: str
    stack: Callable[..., Stack]  # (model cfg, in_features, num_classes) -> Stack
    work: Optional[WorkFn] = None  # the conv's work (None: no conv)
    needs_x0: bool = False  # the convs read the initial residual x0_dst
    exchange_width: Callable[[nn.Module], int] = input_width  # values per exchanged row of a conv's input
    halo_width: Callable[[nn.Module], int] = input_width  # values per halo row (narrow_width: projected when narrower)

    def layer_spec(self, d_in: int, d_out: int, **fields) -> LayerSpec:
        """The cost model's view of one conv of this kind (sizes given, not a built layer)."""
        return LayerSpec(self.name, d_in, d_out, work=self.work, **fields)

