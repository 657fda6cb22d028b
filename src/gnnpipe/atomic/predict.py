"""Predictions of a trained atomic model: on a user's structures (``gnnpipe predict``), and per
system of a split of the training data (what ``evaluate`` writes, to check any consumer against).

* :func:`predict` reads an extended XYZ or an ASE database, computes every structure (energy,
  forces, and stress for 3-D periodic cells) in one process or across ``workers``, and writes
  an extended XYZ whose frames carry the results as ASE writes a calculator's
  (``SinglePointCalculator``: ``ase.io.read(out, ":")[i].get_forces()`` gives them back),
  each with ``info["energy_reference"]``, what its energy is (the model file's: ``oc20-adsorption``,
  ``total`` or ``unknown``), atomically. Every row is checked before any is computed (``inference.check_input``: what
  ``gnnpipe data`` refuses, and elements the model never saw); errors name the file and the row
  (``frame 3``, ``row id 7``). Across workers, ``layout`` chooses how they split a structure
  (``inference.Predictor``'s layouts); each frame records the layout that computed it and the
  domains layout's rebuild count so far (``info["layout"]``, ``info["rebuilds"]``), and
  :class:`Predicted` sums them up with the calls' bytes by op (``gnnpipe predict --stats``).
* :func:`split_predictions` computes systems of ``systems.h5`` in batches over their
  ``graphs.h5`` rows (the engine's path, not the calculator's: an independent check), and
  :func:`write_predictions` / :func:`read_predictions` keep them in ``predictions.h5``
  (versioned and hashed like the data files): per system its id, atoms, cell, pbc, fixed
  atoms, predicted and reference energy and forces.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import numpy as np

from ..io import GnnPipeError, atomic_path, check_destination
from .inference import DEFAULT_SKIN, Predictor, check_input
from .modelfile import ModelFile, energy_words, load_model_file

PREDICTIONS_FILE = "predictions.h5"
PREDICTION_ARRAYS = ("system", "atom_ptr", "z", "pos", "cell", "pbc", "fixed", "energy", "forces", "energy_ref",
                     "forces_ref")


# --------------------------------------------------------------------------- a user's structures
def read_rows(path: Union[str, os.PathLike]) -> list:
    """``[(where, Atoms)]`` of an ASE database (``.db``: ``row id N``) or an extended XYZ (``frame N``)."""
    path = Path(path)
    if not path.is_file():
        raise GnnPipeError(f"{path}: no such structure file (an ASE .db or .extxyz/.xyz)")
    if path.stat().st_size == 0:
        raise GnnPipeError(f"{path}: empty file, holds no structures")
    try:
        rows = list(_db_rows(path) if path.suffix == ".db" else _frames(path))
    except Exception as e:  # noqa: BLE001 - ASE raises many kinds; the user needs the file named
        first = (str(e).strip().splitlines() or [""])[0]
        raise GnnPipeError(f"{path}: cannot be read as an ASE database or extxyz ({type(e).__name__}: {first})") \
            from None
    if not rows:
        raise GnnPipeError(f"{path}: holds no structures")
    return rows


def _db_rows(path: Path):
    import ase.db
    with ase.db.connect(str(path)) as db:
        yield from ((f"row id {row.id}", row.toatoms()) for row in db.select())


def _frames(path: Path):
    import ase.io
    yield from ((f"frame {i}", atoms) for i, atoms in enumerate(ase.io.iread(str(path), index=":")))


@dataclass
class Predicted:
    """What :func:`predict` did: ``count`` structures, how many each layout computed (``layouts``:
    ``"one process"`` at one worker, else the workers' layout's name), and the distributed build's
    decompositions (``rebuilds``: the domains layout's Verlet-skin rule, the first included), and the
    bytes its calls across workers moved, by op (``Predictor.bytes``; empty at one worker)."""

    count: int
    workers: int
    threads: int
    layouts: dict = field(default_factory=dict)
    rebuilds: int = 0
    bytes: dict = field(default_factory=dict)


def predict(model: Union[str, os.PathLike, ModelFile, Predictor], structures, out, *, workers: int = 1,
            device: str = "cpu", dtype=None, threads=None, layout: str = "auto", skin: Optional[float] = None,
            progress: bool = True) -> Predicted:
    """Predict every structure of ``structures`` into the extended XYZ ``out``; returns what it did.

    ``model``: a run directory (its model checked against its ``run.yaml``), a model file, a
    ``ModelFile`` or a ``Predictor`` (then ``workers``/``device``/``dtype``/``threads``/``layout``/``skin``
    are its own). ``threads``: torch threads per worker (``inference.threads_per_worker``);
    ``layout``: how the workers split a structure (``Predictor``'s: ``auto``, ``edges``, ``atoms``,
    ``domains``); ``skin``: Å, the domains layout's Verlet skin (default ``inference.DEFAULT_SKIN``):
    consecutive frames of one system (a trajectory) keep its decomposition while no atom moved half
    of it. Stress is computed for 3-D periodic cells. Each frame's ``info`` records ``layout``
    (what computed it) and ``rebuilds`` (the decompositions so far).
    """
    import ase.io
    from ase.calculators.singlepoint import SinglePointCalculator
    from tqdm import tqdm

    check_destination(out, "out")  # before the work, which may take long
    rows = read_rows(structures)
    own = not isinstance(model, Predictor)
    if own:
        mf = model if isinstance(model, ModelFile) else load_model_file(model)
        for where, atoms in rows:  # every row checked before any worker starts
            check_input(mf, atoms.numbers, atoms.positions, atoms.cell.array, atoms.pbc, f"{structures}: {where}: ")
        predictor = Predictor(mf, device=device, workers=workers, dtype=dtype, threads=threads, layout=layout,
                              skin=DEFAULT_SKIN if skin is None else skin)
    else:
        predictor = model
    frames, layouts = [], {}
    try:
        for where, atoms in tqdm(rows, desc="predict", unit="structure", file=sys.stderr, disable=not progress):
            periodic = bool(np.all(atoms.pbc)) and atoms.cell.rank == 3
            p = predictor.predict(atoms.numbers, atoms.positions, atoms.cell.array, atoms.pbc, stress=periodic,
                                  where=f"{structures}: {where}: ")
            results = {"energy": p.energy, "free_energy": p.energy, "forces": p.forces}
            if p.stress is not None:
                results["stress"] = p.stress
            atoms = atoms.copy()
            atoms.info["energy_reference"] = energy_words(predictor.model_file.energy_reference)
            name = predictor.last_layout.name if predictor.pool is not None else "one process"
            layouts[name] = layouts.get(name, 0) + 1
            atoms.info.update(layout=name, rebuilds=predictor.rebuilds)
            atoms.calc = SinglePointCalculator(atoms, **results)
            frames.append(atoms)
    finally:
        if own:
            predictor.close()
    with atomic_path(out, ".extxyz") as tmp:
        ase.io.write(tmp, frames, format="extxyz")
    return Predicted(len(frames), predictor.workers, predictor.threads, layouts, predictor.rebuilds,
                     {k: int(v) for k, v in predictor.bytes.items()})


# --------------------------------------------------------------------------- a split of the data
def split_predictions(predictor: Predictor, systems: dict, graphs: dict, ids, batch_size: int = 8) -> dict:
    """Predicted energies and forces of systems ``ids`` of ``systems.h5`` on their ``graphs.h5``
    rows, in batches (one process): the arrays of :func:`write_predictions`."""
    import torch

    from .data import batch_arrays
    from .inference import view_outputs
    from .neighbors import reverse_edges
    from .parallel import single_graph

    if predictor.model is None:
        raise ValueError("split_predictions computes in one process: a Predictor with workers=1")
    ids = np.asarray(ids, dtype=np.int64)
    ptr = systems["atom_ptr"]
    atoms = np.concatenate([np.arange(ptr[s], ptr[s + 1]) for s in ids]) if len(ids) else np.zeros(0, np.int64)
    energy, forces = [], []
    for i in range(0, len(ids), batch_size):
        b = batch_arrays(systems, graphs, ids[i:i + batch_size])
        if predictor.model_file.symmetric_edges:
            b["id_swap"] = reverse_edges(b["edge_src"], b["edge_dst"], b["edge_shift"])
        y, f, _ = view_outputs(predictor.model, single_graph(b, predictor.dtype, predictor.device), False)
        s = predictor.norm.scale
        energy.append(s * y.to(torch.float64).cpu().numpy() + predictor.norm.baseline(b["z"], b["system"],
                                                                                      b["num_systems"]))
        forces.append(predictor.norm.force_scale * f.to(torch.float64).cpu().numpy())
    sizes = ptr[ids + 1] - ptr[ids]
    return {"system": ids, "atom_ptr": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
            "z": systems["z"][atoms], "pos": systems["pos"][atoms], "cell": systems["cell"][ids],
            "pbc": systems["pbc"][ids], "fixed": systems["fixed"][atoms],
            "energy": np.concatenate(energy) if energy else np.zeros(0),
            "forces": np.concatenate(forces).reshape(-1, 3) if forces else np.zeros((0, 3)),
            "energy_ref": systems["energy"][ids], "forces_ref": systems["forces"][atoms]}


def write_predictions(path, preds: dict, **attrs) -> str:
    """``predictions.h5`` (``atomic.data.write_h5``: versioned, hashed, atomic); returns its hash."""
    from .data import write_h5
    return write_h5(path, {k: preds[k] for k in PREDICTION_ARRAYS}, attrs, "atomic_predictions")


def read_predictions(path) -> dict:
    from .data import read_h5
    arrays, attrs = read_h5(path, "atomic_predictions", PREDICTION_ARRAYS, "evaluate")
    arrays["pbc"], arrays["fixed"] = arrays["pbc"].astype(bool), arrays["fixed"].astype(bool)
    return {**arrays, **attrs}
