"""DimeNet++'s sizes, in a module without torch (``gnnpipe.kinds.ATOMIC_CONFIGS`` names it).

A field made by ``gnnpipe.kinds.preset_size`` (metadata ``"spec": "preset"``) is a size a workflow
config may override in the kind's section ``models.<name>.dimenetpp`` (null there: the preset's);
``"spec": "own"`` puts the field in the section with this type and default. ``gnnpipe.config``
derives the section's class from these marks (and ``SPEC_DEFAULTS``, the kind's own defaults of the
training keys every section has); the model is built from this class (``gnnpipe.atomic.dimenetpp``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..kinds import preset_size


@dataclass
class DimeNetPPConfig:
    """Sizes of a DimeNet++ (defaults: PyG's ``DimeNetPlusPlus``)."""

    #: the kind's defaults of the keys every atomic section has (gnnpipe.config.AtomicSpec):
    #: DimeNet++'s published learning rate (Gasteiger et al. 2020; PyG's QM9 example)
    SPEC_DEFAULTS = {"lr": 1e-3}

    hidden_channels: int = preset_size(128)
    out_channels: int = 1
    num_blocks: int = preset_size(4)
    int_emb_size: int = preset_size(64, "width of the triplet messages (what is all-gathered per block)")
    basis_emb_size: int = preset_size(8)
    out_emb_channels: int = preset_size(256)
    num_spherical: int = preset_size(7)
    num_radial: int = preset_size(6)
    cutoff: float = 5.0
    envelope_exponent: int = 5
    num_before_skip: int = 1
    num_after_skip: int = 2
    num_output_layers: int = 3
    #: fairchem's ``dimenetplusplus`` (atomic.fairchem imports it): a bias in each output block's
    #: ``lin_up`` (PyG's has none), and the triplet angles computed from detached positions (its forces
    #: flow through the distances only); PyG's DimeNet++ and the project's training: False, True
    output_up_bias: bool = False
    angle_gradient: bool = True
    force_head: Literal["gradient", "direct"] = field(default="gradient", metadata={
        "spec": "own", "doc": "gradient: F = -dE/dpos (energy-conserving); direct: an edge head"})
    compile: bool = field(default=False, metadata={
        "spec": "own", "doc": ("energy-only training (no forces to fit): run the forward with torch.compile "
                               "(inductor, dynamic shapes; the same function to float rounding; the first "
                               "steps pay minutes of compilation); steps with forces, and graph ways' "
                               "views, stay eager")})
