"""ASE integration, where ASE users look for it (``from gnnpipe.ase import GNNPipeCalculator``).

The calculator lives in :mod:`gnnpipe.atomic.calculator`; this module only re-exports it, as
``nequip.ase`` and ``mace.calculators`` do for theirs.
"""

from .atomic.calculator import CalculationRefused, GNNPipeCalculator, StructureRefused

__all__ = ["CalculationRefused", "GNNPipeCalculator", "StructureRefused"]
