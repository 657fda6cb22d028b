"""IS2RS: relax perturbed structures with the model and with a reference calculator, and score them
as the OC20 paper (Chanussot et al. 2021) and fairchem's evaluator define it.

Relaxation (:func:`relax`): ASE's optimisers unchanged. The default is OC20's IS2RS baseline,
L-BFGS with fairchem's ``relax_opt`` (``maxstep 0.04 Å, memory 50, damping 1.0, alpha 70.0``;
fairchem's configs run ``relaxation_steps: 300`` to ``relaxation_fmax: 0.02`` eV/Å); FIRE is
selectable. Steps are optimiser iterations; a relaxation converges when the largest force on a
free atom is at most ``fmax``.

Metrics (fixed atoms excluded everywhere, as fairchem's ``run_relaxations`` masks them):

* **ADwT** (:func:`adwt`), fairchem's ``average_distance_within_threshold``: per system the mean
  over its free atoms of ``|Δ|``, ``Δ`` the displacement between the ML-relaxed and the
  reference-relaxed positions wrapped as fairchem's ``min_diff`` wraps it (fractional
  coordinates on periodic axes to ``(-0.5, 0.5]``, then back to Å: the minimum image for
  orthogonal cells, fairchem's wrap for skewed ones); then the share of systems whose mean is
  ``<`` each threshold of ``np.arange(0.01, 0.5, 0.001)`` Å, averaged over the thresholds.
  fairchem passes ``pbc = [True, True, True]``; here it is the structure's (axes without
  periodicity are not wrapped; identical for any displacement under half the cell).
* **FbT** (:func:`fbt`): the share of ML-relaxed structures at which the *reference*
  calculator's largest per-atom force norm over free atoms is ``<`` the threshold (0.05 eV/Å);
  **AFbT** (:func:`afbt`): FbT averaged over thresholds ``np.arange(0.01, 0.4, 0.001)`` eV/Å
  (the OC20 paper's 0.01 to 0.4 eV/Å, in ADwT's 0.001 steps).
* **relaxed-energy MAE**: ``|E_ML(ML-relaxed) - E_ref(reference-relaxed)|`` averaged over systems.

:func:`relax_systems` runs the whole evaluation for a list of structures and returns the dict of
``relax.json``; without a reference calculator (a user's data set), the ML relaxations only.
:func:`relax_run` (rule ``relax``) relaxes a seeded sample of a run's test systems spread across
compositions and trajectories (:func:`sample_systems`) against the reference it is given
(:func:`reference_calculator`: ``emt``, ``none`` or an ASE calculator class ``module:Class``), by
default the data's own: EMT for gnnpipe's EMT-generated systems, none for a user's file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from ..io import GnnPipeError, atomic_path, check_destination, check_directory

ADWT_THRESHOLDS = np.arange(0.01, 0.5, 0.001)  # Å, fairchem's average_distance_within_threshold
AFBT_THRESHOLDS = np.arange(0.01, 0.4, 0.001)  # eV/Å
FBT_THRESHOLD = 0.05  # eV/Å
LBFGS_DEFAULTS = {"maxstep": 0.04, "memory": 50, "damping": 1.0, "alpha": 70.0}  # fairchem's relax_opt
OPTIMIZERS = ("lbfgs", "fire")


# --------------------------------------------------------------------------- structures
def free_mask(atoms) -> np.ndarray:
    """(N,) True for atoms no ``FixAtoms`` constraint holds."""
    fixed = np.zeros(len(atoms), dtype=bool)
    for c in atoms.constraints:
        if hasattr(c, "get_indices"):
            fixed[c.get_indices()] = True
    return ~fixed


def systems_to_atoms(systems: dict, ids) -> list:
    """Systems ``ids`` of ``systems.h5`` as ``Atoms`` (fixed atoms as a ``FixAtoms`` constraint)."""
    from ase import Atoms
    from ase.constraints import FixAtoms

    out, ptr = [], systems["atom_ptr"]
    for s in ids:
        a0, a1 = ptr[s], ptr[s + 1]
        atoms = Atoms(numbers=systems["z"][a0:a1], positions=systems["pos"][a0:a1], cell=systems["cell"][s],
                      pbc=systems["pbc"][s])
        fixed = np.nonzero(systems["fixed"][a0:a1])[0]
        if len(fixed):
            atoms.set_constraint(FixAtoms(indices=fixed))
        out.append(atoms)
    return out


def rattle(atoms, seed, stdev: float = 0.05):
    """A copy with every free atom displaced by a seeded Gaussian of ``stdev`` Å per component
    (the rattle ``atomic.data.generate`` gives its structures)."""
    out = atoms.copy()
    free = free_mask(out)
    rng = np.random.default_rng(seed)
    out.positions[free] += rng.normal(scale=stdev, size=(int(free.sum()), 3))
    return out


# --------------------------------------------------------------------------- relaxation
@dataclass
class Relaxation:
    """The end of one relaxation: the final structure (its results attached), steps, convergence."""

    atoms: object  # ase.Atoms with a SinglePointCalculator of the final energy and forces
    energy: float
    steps: int
    converged: bool
    fmax: float  # the largest free-atom force norm at the end, eV/Å


def relax(atoms, calc, optimizer: str = "lbfgs", fmax: float = 0.02, steps: int = 300,
          trajectory: Optional[str | Path] = None, logfile=None, **optimizer_kwargs) -> Relaxation:
    """Relax a copy of ``atoms`` with ``calc`` (constraints kept) by ASE's L-BFGS (OC20's settings,
    see the module docstring) or FIRE; ``optimizer_kwargs`` override the optimiser's."""
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.optimize import FIRE, LBFGS

    if optimizer not in OPTIMIZERS:
        raise GnnPipeError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZERS)}")
    work = atoms.copy()
    work.calc = calc
    kwargs = {**(LBFGS_DEFAULTS if optimizer == "lbfgs" else {}), **optimizer_kwargs}
    cls = LBFGS if optimizer == "lbfgs" else FIRE
    with cls(work, trajectory=None if trajectory is None else str(trajectory), logfile=logfile, **kwargs) as opt:
        converged = bool(opt.run(fmax=fmax, steps=steps))  # the trajectory is complete once closed
    energy = float(work.get_potential_energy())
    forces = work.get_forces()  # constrained: fixed atoms read zero
    final = work.copy()
    final.calc = SinglePointCalculator(final, energy=energy, forces=work.get_forces(apply_constraint=False))
    largest = float(np.linalg.norm(forces, axis=1).max(initial=0.0))
    return Relaxation(final, energy, int(opt.nsteps), converged, largest)


# --------------------------------------------------------------------------- metrics
def wrapped_displacement(pred_pos, ref_pos, cell, pbc) -> np.ndarray:
    """(N, 3) ``pred - ref`` wrapped as fairchem's ``min_diff`` (periodic axes only)."""
    diff = np.asarray(pred_pos, dtype=np.float64) - np.asarray(ref_pos, dtype=np.float64)
    pbc = np.broadcast_to(np.asarray(pbc, dtype=bool), (3,))
    if not pbc.any():
        return diff
    cell = np.asarray(cell, dtype=np.float64).reshape(3, 3)
    frac = np.linalg.solve(cell.T, diff.T).T
    for ax in np.nonzero(pbc)[0]:
        f = frac[:, ax] % 1.0 % 1.0  # twice, as fairchem: -1e-17 % 1.0 == 1.0
        frac[:, ax] = np.where(f > 0.5, f - 1.0, f)
    return frac @ cell


def mean_distances(pred_pos: Sequence, ref_pos: Sequence, cells: Sequence, pbcs: Sequence,
                   free: Optional[Sequence] = None) -> np.ndarray:
    """(S,) per system the mean over its free atoms of the wrapped distance, Å."""
    out = []
    for s, (p, r, c, b) in enumerate(zip(pred_pos, ref_pos, cells, pbcs)):
        d = np.linalg.norm(wrapped_displacement(p, r, c, b), axis=1)
        if free is not None:
            d = d[np.asarray(free[s], dtype=bool)]
        out.append(float(d.mean()) if len(d) else 0.0)
    return np.asarray(out)


def adwt(pred_pos, ref_pos, cells, pbcs, free=None, thresholds=ADWT_THRESHOLDS) -> float:
    """Average distance within threshold (see the module docstring), in [0, 1]."""
    d = mean_distances(pred_pos, ref_pos, cells, pbcs, free)
    return _share_below(d, thresholds)


def max_free_forces(forces: Sequence, free: Optional[Sequence] = None) -> np.ndarray:
    """(S,) per structure the largest per-atom force norm over its free atoms, eV/Å."""
    out = []
    for s, f in enumerate(forces):
        n = np.linalg.norm(np.asarray(f, dtype=np.float64).reshape(-1, 3), axis=1)
        if free is not None:
            n = n[np.asarray(free[s], dtype=bool)]
        out.append(float(n.max(initial=0.0)))
    return np.asarray(out)


def fbt(ref_forces: Sequence, free: Optional[Sequence] = None, threshold: float = FBT_THRESHOLD) -> float:
    """Forces below threshold: share of structures whose reference max free-atom force is ``<`` it."""
    return _share_below(max_free_forces(ref_forces, free), [threshold])


def afbt(ref_forces: Sequence, free: Optional[Sequence] = None, thresholds=AFBT_THRESHOLDS) -> float:
    """FbT averaged over ``thresholds`` (0.01 .. 0.4 eV/Å)."""
    return _share_below(max_free_forces(ref_forces, free), thresholds)


def threshold_curve(values, thresholds) -> np.ndarray:
    """(T,) the share of ``values`` strictly below each threshold: the curve whose mean is ADwT
    (per-system mean distances) or AFbT (reference max forces at the ML-relaxed structures)."""
    if len(values) == 0:
        raise GnnPipeError("IS2RS metrics of no systems")
    t = np.asarray(thresholds, dtype=np.float64)
    return (np.asarray(values, dtype=np.float64)[:, None] < t[None, :]).mean(axis=0)


def _share_below(values: np.ndarray, thresholds) -> float:
    return float(threshold_curve(values, thresholds).mean())


# --------------------------------------------------------------------------- the evaluation
def relax_systems(structures: Sequence, model_calc, reference: Optional[Callable[[], object]] = None, *,
                  optimizer: str = "lbfgs", fmax: float = 0.02, steps: int = 300, rattle_stdev: float = 0.05,
                  seed: int = 0, trajectories: Optional[str | Path] = None, names: Optional[Sequence] = None,
                  progress: bool = False) -> dict:
    """IS2RS over ``structures`` (``Atoms`` with their ``FixAtoms``): each is rattled (seed
    ``[seed, i]``), relaxed with ``model_calc`` and, if ``reference`` (a factory of calculators,
    e.g. ``ase.calculators.emt.EMT``) is given, with a fresh reference calculator too, then the
    reference computes forces and energy at the ML-relaxed structure. Trajectories go to
    ``<trajectories>/<i>-ml.traj`` and ``<i>-ref.traj``. Returns the dict of ``relax.json``."""
    import sys

    from tqdm import tqdm

    if trajectories is not None:
        check_directory(trajectories, "trajectories").mkdir(parents=True, exist_ok=True)
    per, ml_pos, ref_pos, cells, pbcs, frees, ref_f_at_ml = [], [], [], [], [], [], []

    def relaxed(start, calc, i, what) -> Relaxation:  # each trajectory written atomically, as every output
        if trajectories is None:
            return relax(start, calc, optimizer, fmax, steps)
        with atomic_path(Path(trajectories) / f"{i}-{what}.traj", ".traj") as tmp:
            return relax(start, calc, optimizer, fmax, steps, tmp)

    for i, atoms in enumerate(tqdm(structures, desc="relax", unit="system", file=sys.stderr, disable=not progress)):
        start = rattle(atoms, [seed, i], rattle_stdev)
        ml = relaxed(start, model_calc, i, "ml")
        row = {"index": i, "name": names[i] if names is not None else str(i),
               "formula": atoms.get_chemical_formula(), "atoms": len(atoms), "free_atoms": int(free_mask(atoms).sum()),
               "ml_energy": ml.energy, "ml_steps": ml.steps, "ml_converged": ml.converged, "ml_fmax": ml.fmax}
        if reference is not None:
            ref = relaxed(start, reference(), i, "ref")
            at_ml = ml.atoms.copy()
            at_ml.calc = reference()
            f = at_ml.get_forces(apply_constraint=False)
            free = free_mask(atoms)
            ml_pos.append(ml.atoms.positions), ref_pos.append(ref.atoms.positions)
            cells.append(atoms.cell.array), pbcs.append(atoms.pbc), frees.append(free), ref_f_at_ml.append(f)
            row.update({"ref_energy": ref.energy, "ref_steps": ref.steps, "ref_converged": ref.converged,
                        "ref_energy_at_ml": float(at_ml.get_potential_energy()),
                        "ref_fmax_at_ml": float(max_free_forces([f], [free])[0]),
                        "mean_distance": float(mean_distances([ml.atoms.positions], [ref.atoms.positions],
                                                              [atoms.cell.array], [atoms.pbc], [free])[0]),
                        "energy_error": ml.energy - ref.energy})
        per.append(row)
    out = {"optimizer": optimizer, "fmax": fmax, "steps": steps, "rattle": rattle_stdev, "seed": seed,
           "systems": len(per), "reference": reference is not None,
           "ml_steps_mean": float(np.mean([r["ml_steps"] for r in per])) if per else None,
           "ml_converged": float(np.mean([r["ml_converged"] for r in per])) if per else None}
    if reference is not None and per:
        out.update({"adwt": adwt(ml_pos, ref_pos, cells, pbcs, frees), "fbt": fbt(ref_f_at_ml, frees),
                    "afbt": afbt(ref_f_at_ml, frees),
                    "energy_mae": float(np.mean([abs(r["energy_error"]) for r in per])),
                    "ref_steps_mean": float(np.mean([r["ref_steps"] for r in per])),
                    "ref_converged": float(np.mean([r["ref_converged"] for r in per]))})
    out["per_system"] = per
    return out


# --------------------------------------------------------------------------- a trained run (rule relax)
RELAX_FILE = "relax.json"
GENERATED_EMT = "generated:ase-emt"  # systems.h5's source of gnnpipe's EMT-labelled systems (atomic.data)
NO_REFERENCE = ("no reference calculator (relax.reference none: a user's structures unless set): ML relaxations "
                "and their energies only; ADwT, FbT, AFbT and the relaxed-energy MAE need one")


def reference_calculator(reference: Optional[str], source: str = "") -> tuple[Optional[str], Optional[Callable]]:
    """``(name, factory)`` of a relaxation's reference calculator: ``"emt"`` (ASE's EMT), ``"none"``
    (``(None, None)``), an ASE calculator class ``"module:Class"`` (built without arguments), or
    None: the data's own (``source``, systems.h5's: EMT for gnnpipe's generated systems, else none)."""
    import importlib
    import re

    from ..config import REFERENCE_PATTERN

    if reference is None:
        reference = "emt" if source.startswith(GENERATED_EMT) else "none"
    if not re.fullmatch(REFERENCE_PATTERN, reference):
        raise GnnPipeError(f"reference calculator {reference!r}: emt, none or an ASE calculator class as "
                           "module:Class (e.g. ase.calculators.emt:EMT)")
    if reference == "none":
        return None, None
    if reference == "emt":
        from ase.calculators.emt import EMT
        return "EMT", EMT
    module, name = reference.split(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise GnnPipeError(f"reference calculator {reference!r}: cannot be imported ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}); install its package or fix relax.reference")
    if not callable(factory):
        raise GnnPipeError(f"reference calculator {reference!r}: not a class (a {type(factory).__name__})")
    return reference, factory


def sample_systems(ids, systems: dict, k: int, seed: int) -> np.ndarray:
    """Up to ``k`` of ``ids`` (``systems.h5`` ids), a seeded sample spread across compositions and
    trajectories (``group``): in a seeded order, one system of each composition in turn, within a
    composition a trajectory not drawn yet first; returned in id order."""
    ids = np.random.default_rng(seed).permutation(np.asarray(ids, dtype=np.int64))
    ptr, z, group = systems["atom_ptr"], systems["z"], systems["group"]
    by_composition: dict = {}
    for s in ids:
        key = tuple(zip(*np.unique(z[ptr[s]:ptr[s + 1]], return_counts=True)))
        by_composition.setdefault(key, []).append(s)
    queues = []
    for members in by_composition.values():
        drawn: dict = {}
        rank = []
        for s in members:  # 0 for a trajectory's first system in this composition, 1 for its second, ...
            rank.append(drawn.get(group[s], 0))
            drawn[group[s]] = rank[-1] + 1
        queues.append([members[i] for i in np.argsort(rank, kind="stable")])
    picked = [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]
    return np.sort(np.asarray(picked[:k], dtype=np.int64))


def relax_run(cfg, *, systems: int = 4, optimizer: str = "lbfgs", fmax: float = 0.02, steps: int = 300,
              rattle_stdev: float = 0.05, seed: int = 0, reference: Optional[str] = None, out=None,
              trajectories=None, progress: bool = True) -> dict:
    """IS2RS of a trained atomic run (``RunConfig``): ``systems`` systems of its test split
    (:func:`sample_systems`, seed ``seed``), relaxed with its finished model
    (``GNNPipeCalculator.from_run``, one process whatever mode trained it: the model is the same
    function; refused if it is not this run's) and with ``reference`` (:func:`reference_calculator`;
    None: the data's own). Writes ``relax.json`` (default ``<out_dir>/relax.json``) atomically,
    a trajectory per system and calculator under ``trajectories`` (default ``<out_dir>/relax``),
    and logs the metrics to the run's MLflow run; returns the dict."""
    import json

    from ..io import write_json
    from .calculator import GNNPipeCalculator
    from .data import read_systems
    from .atomic_engine import SPLIT_NAMES

    for name, value, low in (("systems", systems, 1), ("steps", steps, 1), ("fmax", fmax, 0), ("rattle", rattle_stdev, 0)):
        if not value >= low or (name == "fmax" and value == 0):
            raise GnnPipeError(f"relax: {name} must be {'>' if name == 'fmax' else '>='} {low}, got {value}")
    run_dir = Path(cfg.out_dir)
    out = Path(out or run_dir / RELAX_FILE)
    check_destination(out, "out")  # before the work: a relaxation takes minutes
    trajectories = check_directory(trajectories or run_dir / "relax", "trajectories")
    data = read_systems(cfg.systems_path)
    reference, factory = reference_calculator(reference, data["source"])
    test = np.nonzero(data["split"] == SPLIT_NAMES.index("test"))[0]
    if not len(test):
        raise GnnPipeError(f"{cfg.systems_path}: no test systems to relax (datasets.{cfg.dataset_name}.atoms: "
                           "train_fraction + val_fraction leave none)")
    calc = GNNPipeCalculator.from_run(run_dir, run=cfg)  # refused if its model.pt is not this run's
    known, ptr = set(calc.model_file.elements), data["atom_ptr"]
    # a test system with an element no training system had: the model cannot compute it (skipped, named)
    seen = np.array([set(data["z"][ptr[s]:ptr[s + 1]].tolist()) <= known for s in test])
    skipped, test = test[~seen], sample_systems(test[seen], data, systems, seed)
    with calc:
        result = relax_systems(systems_to_atoms(data, test), calc, factory, optimizer=optimizer, fmax=fmax,
                               steps=steps, rattle_stdev=rattle_stdev, seed=seed, trajectories=trajectories,
                               names=[str(int(s)) for s in test], progress=progress)
    result = {"run_id": cfg.run_id, "mode": cfg.mode, "dataset": cfg.dataset_name, "model": cfg.model.kind,
              "energy_reference": calc.energy_reference,  # what its energies are (None: unknown)
              "split": "test", "sample": f"{len(test)} test systems drawn across compositions and trajectories "
                                        f"(seed {seed})", **result, "reference": reference,  # its name, or None
              **({} if reference is not None else {"note": NO_REFERENCE}), "trajectories": trajectories.name,
              "skipped_unseen_elements": [int(s) for s in skipped]}
    if not len(test):  # not an error: the run trained and evaluated; its report says why no IS2RS
        none = f"every test system has an element the model never saw in training (it knows Z = {sorted(known)}): none relaxed"
        result["note"] = f"{result['note']}; {none}" if "note" in result else none
    write_json(out, result)
    metrics = run_dir / "metrics.json"
    mlflow_id = json.loads(metrics.read_text()).get("mlflow_run_id") if metrics.exists() else None
    if mlflow_id:
        from ..tracking import log_relaxation
        log_relaxation(cfg, mlflow_id, result, out)
    return result
