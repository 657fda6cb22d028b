"""GemNet-T/dT's sizes, in a module without torch (``gnnpipe.kinds.ATOMIC_CONFIGS`` names it).

A field made by ``gnnpipe.kinds.preset_size`` (metadata ``"spec": "preset"``) is a size a workflow
config may override in the kind's section ``models.<name>.gemnet_t`` (null there: the preset's);
``gnnpipe.config`` derives the section's class from these marks (and ``SPEC_DEFAULTS``); the model
is built from this class (``gnnpipe.atomic.gemnet``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..kinds import preset_size


@dataclass
class GemNetTConfig:
    """Sizes of a GemNet-T/dT (defaults: fairchem's ``gp-gemnet-dT.yml``, the ``default`` preset)."""

    #: the kind's defaults of the keys every atomic section has (gnnpipe.config.AtomicSpec):
    #: GemNet's published learning rate on molecules (Gasteiger et al. 2021: MD17, COLL)
    SPEC_DEFAULTS = {"lr": 1e-3}

    num_spherical: int = preset_size(7, "S: Y_l^0, l < S, of the triplet angle")
    num_radial: int = preset_size(128, "R: Gaussians of the distance")
    num_blocks: int = preset_size(3, "K interaction blocks (K + 1 output blocks)")
    emb_size_atom: int = preset_size(512, "A: atom embeddings (all-gathered per block)")
    emb_size_edge: int = preset_size(512, "Ed: edge embeddings (summed into atoms per block)")
    emb_size_trip: int = preset_size(64, "Tr: triplet input messages (all-gathered per block)")
    emb_size_rbf: int = preset_size(16)
    emb_size_cbf: int = preset_size(16)
    emb_size_bil_trip: int = preset_size(64, "Bt: bilinear output (all-gathered per block, for id_swap)")
    num_before_skip: int = preset_size(1)
    num_after_skip: int = preset_size(2)
    num_concat: int = preset_size(1)
    num_atom: int = preset_size(3, "residual layers of the atom MLPs (and of the direct-force MLPs)")
    cutoff: float = 6.0  # Å
    envelope_exponent: int = 5
    num_elements: int = 95  # embedding rows, indexed by z (fairchem: 83, indexed by z - 1)
    force_head: Literal["gradient", "direct"] = "direct"  # gradient: GemNet-T (-dE/dpos); direct: GemNet-dT
    #: the Gaussians' centres linspace(0, 1, R) and width 1/(R-1): float64, or (an imported fairchem model
    #: whose checkpoint holds them in float32) rounded to float32 as fairchem's float64 model still holds
    #: them, the width from their float32 spacing (torch_geometric's GaussianSmearing); set by import-model
    gaussian_centres: Literal["float64", "float32"] = "float64"
