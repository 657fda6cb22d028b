"""The ASE calculator of a trained gnnpipe atomic model (every kind of ``ATOMIC_MODELS``).

    from gnnpipe.ase import GNNPipeCalculator          # also gnnpipe.atomic.calculator

    calc = GNNPipeCalculator.from_run("results/runs/<run_id>")        # or a model file:
    calc = GNNPipeCalculator.from_file("gemnet-dT.pt")                 # (gnnpipe import-model's --out)
    atoms.calc = calc
    atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()

    with GNNPipeCalculator.from_run(run, workers=4) as calc:         # one system, 4 processes
        ...                                                          # (graph parallelism)

``implemented_properties``: ``energy``, ``free_energy`` (= energy: no electronic entropy),
``forces`` and, for 3-D periodic cells, ``stress`` (``σ = (1/V) ∂E/∂ε``, ASE's Voigt order and
sign; asked of a cell that is not 3-D periodic it raises ``PropertyNotImplementedError``). The
graph is built with the model's own cutoff and neighbour cap, periodic images as in training
(``atomic.inference.structure_graph``). Energy-conserving (gradient-force) models compute the
stress with the forces at no extra cost whenever the cell is 3-D periodic, so a cell filter's
``get_forces`` and ``get_stress`` take one model call; direct-force models compute it only when
asked. Results follow the ASE contract: the forces are the raw ones (constraints are applied
by ``Atoms``), arrays are float64 whatever the model's dtype.

``workers=N`` keeps N local processes alive for the calculator's life (``close()``, a ``with``
block, or interpreter exit end them); they split each structure's edges (Sriram et al.) or, for one
large system when it sends fewer bytes, its atoms (METIS parts, each worker receiving only its halo:
``atomic.halo``; ``layout="auto"``, the default, chooses per structure); the energies, forces and stress equal ``workers=1`` to
rounding (1e-10 in float64; float32: see docs/ARCHITECTURE.md). A dead worker is one
``GnnPipeError`` naming it, raised within a fraction of a second. ``workers`` is at most the CPU
cores this process may use (``oversubscribe=True``: 4 per core, time-shared, for measuring
memory); each worker (``workers=1``: this process, during a call) computes on ``threads`` torch
threads (default ``OMP_NUM_THREADS``, else the cores shared out; the property
``threads`` says how many). A script that starts workers needs ``if __name__ == "__main__":``
(each worker imports it again); without it the calculator says so in one line.

Errors follow ASE's: a structure the model cannot compute — what ``gnnpipe data`` refuses in a
dataset (a non-finite position or cell, a degenerate periodic cell, two atoms closer than
``min_distance``, 0.5 Å), or an element it never saw — raises :class:`StructureRefused` (an
``ase.calculators.calculator.InputError``), anything else that fails :class:`CalculationRefused`
(a ``CalculationFailed``); both are ``GnnPipeError``s of one line naming the structure.
``from_run`` of a run directory refuses a ``model.pt`` that is not that run's (its ``run.yaml``;
``run=`` another ``RunConfig``), naming both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import numpy as np
from ase.calculators.calculator import (CalculationFailed, Calculator, InputError, PropertyNotImplementedError,
                                        all_changes)

from ..io import GnnPipeError
from .inference import DEFAULT_SKIN, Predictor, StructureError
from .modelfile import ModelFile, load_model_file


class StructureRefused(StructureError, InputError):
    """A structure the model cannot compute (ASE's ``InputError``; one line naming it)."""


class CalculationRefused(GnnPipeError, CalculationFailed):
    """A calculation that failed (a dead worker, ...): ASE's ``CalculationFailed``, one line."""


class GNNPipeCalculator(Calculator):
    """An ASE calculator over a trained gnnpipe atomic model (see the module docstring)."""

    implemented_properties = ["energy", "free_energy", "forces", "stress"]
    nolabel = True

    def __init__(self, model: Union[str, Path, ModelFile], *, device: str = "cpu", workers: int = 1,
                 dtype: Optional[str] = None, threads: Optional[int] = None, layout: str = "auto",
                 min_distance: Optional[float] = None, skin: float = DEFAULT_SKIN, oversubscribe: bool = False,
                 mem_mb_per_worker: Optional[int] = None, run=None, **kwargs):
        """``model``: a run directory, a model file (or checkpoint holding one), or a ``ModelFile``.
        ``dtype``: ``"float32"``/``"float64"`` (default: the model's own); ``threads``: torch
        threads per worker (default: ``OMP_NUM_THREADS``, else the cores shared out); ``layout``: how
        the workers split a structure, ``"edges"``, ``"atoms"``, ``"domains"`` (each worker builds its own
        spatial domain's graph from its region's positions: ``atomic.domains``) or ``"auto"`` (per
        structure, the one whose closed-form bytes are fewer: ``atomic.inference.Predictor``); ``skin``: Å,
        the domains layout's Verlet skin (its regions are kept until an atom moved ``skin / 2``;
        ``rebuilds`` counts the decompositions); ``oversubscribe``: allow up to 4 workers per CPU core
        (time-shared: for measuring memory at P above the cores; default: at most the cores);
        ``mem_mb_per_worker``: MiB, with ``layout="domains"``: a structure whose estimated peak per
        worker exceeds it is refused in one line naming the fewest workers that fit; with
        ``layout="auto"``: a structure that does not fit in the edges and atoms layouts (every worker
        holds its whole graph) goes to the domains layout if it fits there
        (``atom_layouts.choose_for_structure``); ``min_distance``: Å, two
        atoms closer are refused (default 0.5, ``atoms.min_distance``'s); ``run``: the ``RunConfig``
        the model must belong to (default: a run directory's ``run.yaml``)."""
        super().__init__(**kwargs)
        self.model_file = model if isinstance(model, ModelFile) else load_model_file(model, run)
        self.predictor = Predictor(self.model_file, device=device, workers=workers, dtype=dtype, threads=threads,
                                   layout=layout, min_distance=min_distance, skin=skin,
                                   oversubscribe=oversubscribe, mem_mb_per_worker=mem_mb_per_worker)

    @property
    def energy_reference(self) -> Optional[str]:
        """What its energies are (``modelfile.ENERGY_REFERENCES``: ``"oc20-adsorption"``, ``"total"``), or
        None: unknown (the model file's ``energy_reference``)."""
        return self.model_file.energy_reference

    @property
    def threads(self) -> int:
        """Torch threads each worker computes on (``workers=1``: this process, during a call)."""
        return self.predictor.threads

    @property
    def rebuilds(self) -> int:
        """How many times the domains layout decomposed a structure (its first call's included; 0 in
        another layout): the Verlet-skin rule's rebuilds."""
        return self.predictor.rebuilds

    @classmethod
    def from_run(cls, path: Union[str, Path], device: str = "cpu", workers: int = 1, **kwargs) -> "GNNPipeCalculator":
        """From a run directory (``results/runs/<id>``: its finished ``model.pt``) or a model file."""
        return cls(path, device=device, workers=workers, **kwargs)

    #: the same, named for a model file that belongs to no run directory (``gnnpipe import-model``'s ``--out``)
    from_file = from_run

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes) -> None:
        super().calculate(atoms, properties, system_changes)
        a = self.atoms
        periodic = bool(np.all(a.pbc)) and a.cell.rank == 3
        if "stress" in properties and not periodic:
            raise PropertyNotImplementedError(f"stress needs a 3-D periodic cell (pbc {a.pbc.tolist()}, "
                                              f"cell rank {a.cell.rank})")
        stress = "stress" in properties or (periodic and self.predictor.gradient_forces)
        where = f"{a.get_chemical_formula()}: "
        try:
            p = self.predictor.predict(a.numbers, a.positions, a.cell.array, a.pbc, stress=stress, where=where)
        except StructureError as e:
            raise StructureRefused(str(e)) from None
        except GnnPipeError as e:
            raise CalculationRefused(str(e) if str(e).startswith(where) else f"{where}{e}") from None
        self.results = {"energy": p.energy, "free_energy": p.energy, "forces": p.forces}
        if p.stress is not None:
            self.results["stress"] = p.stress

    def close(self) -> None:
        """Stop the workers (``workers > 1``); the calculator cannot compute afterwards."""
        self.predictor.close()

    def __enter__(self) -> "GNNPipeCalculator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        mf = self.model_file
        return (f"GNNPipeCalculator({mf.kind}, cutoff={mf.cutoff} Å, max_neighbors={mf.max_neighbors}, "
                f"energies={mf.energies}, "
                f"workers={self.predictor.workers}, threads={self.threads}, dtype={str(self.predictor.dtype).removeprefix('torch.')})")
