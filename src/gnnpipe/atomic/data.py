"""Atomistic datasets: structures with energies and forces, and their radius graphs with triplets.

Two HDF5 files per dataset (h5py; ``format_version``, a ``content_hash`` over every array
*and* the attributes, written atomically; a reader refuses another version or kind, a
missing array, a truncated, bit-flipped or edited file, naming the rule that rebuilds it):

* ``results/data/<ds>/systems.h5`` (rule ``build_systems``): concatenated ``z`` (N,), ``pos``
  (N, 3) Å, ``fixed`` (N,), ``forces`` (N, 3) eV/Å (all NaN: a file of energies alone, which
  trains energy-only, ``has_forces``); per system ``cell`` (S, 3, 3), ``pbc``
  (S, 3), ``energy`` (S,) eV, ``split`` (S,) 0/1/2 = train/val/test, ``group`` (S,) the system's
  trajectory (0, 1, ...: splits by trajectory keep each in one split; format version 2);
  ``atom_ptr`` (S+1,).
* ``results/data/<ds>/graphs.h5`` (rule ``atom_graphs``, format version 2): per system the
  **symmetric** directed edges ``j -> i`` within the cutoff over periodic images
  (``atomic.neighbors.radius_graph``, vesin cell lists: ``edge_src``/``edge_dst`` local atom
  ids, ``edge_shift`` (E, 3) the image offset of j in Å), ordered by (target, distance); each
  atom keeps its ``max_neighbors`` nearest and every edge its reverse, whose local id is
  ``id_swap``; triplets ``k -> j -> i`` as local edge ids ``idx_kj``/``idx_ji`` (all input
  edges of j except the one from i's own image); ``edge_ptr``/``triplet_ptr`` (S+1,); attrs
  ``cutoff``, ``max_neighbors``, ``neighbors`` (the cap's convention, ``atomic.neighbors``:
  ``fairchem``; absent for ``project``, so such a file is what it was before the option),
  ``systems_hash``, ``symmetric_edges`` (true). Version 1 (a per-target cut: asymmetric where the
  cap binds, no ``id_swap``) is refused, naming the rule.

Sources: ``generate`` (the embedded default: ASE fcc(111)/(100) slabs of Cu/Ag/Au/Ni/Pd/Pt/Al
with a small adsorbate, rattled, bottom layer fixed, relaxed by BFGS under ASE's EMT calculator,
frames along each relaxation as systems, like OC20's S2EF; no internet) and ``read_structures``
(a user's ASE database ``.db`` or extended XYZ, its trajectories named by an info key or column, its split
drawn, or fixed by an info key / column naming train, val or test (``named_split``) or by an index file
(``index_split``)). Both, and
``build_graphs``, pass every structure through ``checks.check_structure`` first (elements,
finite positions, a sane periodic cell, no two atoms closer than ``atoms.min_distance``, kept
in ``systems.h5`` as the attribute ``min_distance``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Optional

import h5py
import numpy as np

from ..io import GnnPipeError, atomic_path, hash_arrays
from .checks import MIN_DISTANCE, check_structure
from .neighbors import system_graph, triplets

#: per file kind (others, e.g. predictions.h5: 1); graphs 2: symmetric edges (vesin) with id_swap
#: (1: a per-target cut, no id_swap); systems 2: each system's trajectory (``group``; 1: none)
FORMAT_VERSIONS = {"systems": 2, "atom_graphs": 2}


def format_version(kind: str) -> int:
    return FORMAT_VERSIONS.get(kind, 1)
EMT_ELEMENTS = ("Al", "Cu", "Ag", "Au", "Ni", "Pd", "Pt", "H", "C", "N", "O")  # ASE's EMT parameters
SYSTEM_ARRAYS = ("z", "pos", "fixed", "forces", "cell", "pbc", "energy", "split", "group", "atom_ptr")
GRAPH_ARRAYS = ("edge_ptr", "triplet_ptr", "edge_src", "edge_dst", "edge_shift", "id_swap", "idx_kj", "idx_ji")
# CH4/H2O/NH3/OH/O2 are left out on purpose: EMT gives them unphysical forces (8-70 eV/Å, measured)
ADSORBATES = ("O", "H", "C", "N", "CO", "N2", "NO")
SLAB_METALS = ("Cu", "Ag", "Au", "Ni", "Pd", "Pt", "Al")


# --------------------------------------------------------------------------- structures
def _pack(structures: list, split: np.ndarray, source: str, min_distance: float, group: np.ndarray) -> dict:
    """Concatenate (z, pos, fixed, forces, cell, pbc, energy) tuples into the systems arrays."""
    z, pos, fixed, forces, cell, pbc, energy = zip(*structures)
    sizes = [len(a) for a in z]
    return {"z": np.concatenate(z).astype(np.int64), "pos": np.concatenate(pos).astype(np.float64),
            "fixed": np.concatenate(fixed).astype(bool), "forces": np.concatenate(forces).astype(np.float64),
            "cell": np.stack(cell).astype(np.float64), "pbc": np.stack(pbc).astype(bool),
            "energy": np.asarray(energy, dtype=np.float64), "split": split.astype(np.int8),
            "group": np.asarray(group, dtype=np.int64),
            "atom_ptr": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), "source": source,
            "min_distance": float(min_distance)}


def random_split(n: int, train_fraction: float, val_fraction: float, seed: int) -> np.ndarray:
    """(n,) 0/1/2 = train/val/test, a seeded permutation cut at the fractions (≥ 1 train system)."""
    if not (0 < train_fraction <= 1 and 0 <= val_fraction and train_fraction + val_fraction <= 1):
        raise GnnPipeError(f"split fractions train {train_fraction}, val {val_fraction} must be in (0, 1] "
                           "and sum to at most 1")
    order = np.random.default_rng(seed).permutation(n)
    n_train = max(1, int(round(train_fraction * n)))
    n_val = int(round(val_fraction * n))
    split = np.full(n, 2, dtype=np.int8)
    split[order[:n_train]] = 0
    split[order[n_train:n_train + n_val]] = 1
    return split


def group_split(groups: np.ndarray, train_fraction: float, val_fraction: float, seed: int) -> np.ndarray:
    """(n,) 0/1/2 per system: ``random_split`` of the distinct groups (trajectories), each system in its
    group's split, so that no group lands in two splits."""
    names, inverse = np.unique(groups, return_inverse=True)
    return random_split(len(names), train_fraction, val_fraction, seed)[inverse]


SPLITS = ("train", "val", "test")  # split ids 0, 1, 2
#: an index file's arrays: train/val/test, or schnetpack's split.npz names
INDEX_NAMES = {**{s: s for s in SPLITS}, **{f"{s}_idx": s for s in SPLITS}}


def named_split(names: list, wheres: list[str], path, key: str, what: str) -> np.ndarray:
    """(n,) 0/1/2 from each structure's split name, the value of its ``what`` (info key / column) ``key``:
    a structure without one, or a name other than train, val or test, is one line naming it."""
    out = np.empty(len(names), dtype=np.int8)
    for i, (name, where) in enumerate(zip(names, wheres)):
        if name is None:
            raise GnnPipeError(f"{path}: {where} has no {what} {key!r} naming its split (atoms.split_key, with "
                               f"atoms.split: key): give every structure one of train, val, test, or set "
                               f"atoms.split_key to the {what} that does")
        if not isinstance(name, str) or name not in SPLITS:
            raise GnnPipeError(f"{path}: {where}: {what} {key!r} is {name!r}, not a split name: use train, val "
                               f"or test (atoms.split: key)")
        out[i] = SPLITS.index(name)
    return _has_train(out, f"{path}: {what} {key!r}")


def index_split(split_file, n: int, path) -> np.ndarray:
    """(n,) 0/1/2 from an index file: JSON ``{"train": [...], "val": [...], "test": [...]}`` or NPZ arrays
    ``train``/``val``/``test`` (or ``train_idx``/...: schnetpack's split.npz) of 0-based structure positions in
    the structure file (extxyz frame, db row in id order); a split left out is empty. Every structure is in
    exactly one split: an unknown split name, an index out of range or not an integer, a structure in two
    splits or in none is one line naming the file."""
    split_file = Path(split_file)
    where = f"{split_file} (atoms.split_file)"
    if not split_file.is_file():
        raise GnnPipeError(f"{where}: no such index file (JSON or NPZ of train/val/test structure indices)")
    try:
        if split_file.suffix == ".npz":
            with np.load(split_file, allow_pickle=False) as z:
                lists = {k: z[k] for k in z.files}
        else:
            lists = json.loads(split_file.read_text())
    except Exception as e:  # noqa: BLE001 - numpy and json raise many kinds; the user needs the file named
        raise GnnPipeError(f"{where}: not a JSON or NPZ index file ({type(e).__name__}: {e})") from None
    if not isinstance(lists, dict):
        raise GnnPipeError(f"{where}: holds a {type(lists).__name__}, not an object of train/val/test index lists")
    unknown = sorted(set(lists) - set(INDEX_NAMES))
    named = [INDEX_NAMES[k] for k in lists if k in INDEX_NAMES]
    twice = sorted({s for s in named if named.count(s) > 1})
    if unknown or twice:
        what = f"unknown split {', '.join(map(repr, unknown))}" if unknown else f"split {twice[0]} given twice"
        raise GnnPipeError(f"{where}: {what}; name the index lists train, val and test (or train_idx, val_idx, "
                           f"test_idx)")
    out = np.full(n, -1, dtype=np.int8)
    for key, ids in lists.items():
        s = SPLITS.index(INDEX_NAMES[key])
        ids = np.asarray(ids)
        if ids.ndim != 1 or (ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= n)):
            raise GnnPipeError(f"{where}: {key} must list structure indices 0 .. {n - 1} ({path} holds {n} "
                               f"structures, numbered from 0 in file order)")
        ids = ids.astype(np.int64)
        uniq, counts = np.unique(ids, return_counts=True)
        clash = np.concatenate([uniq[counts > 1], ids[out[ids] != -1]])
        if clash.size:
            i = int(clash[0])
            other = SPLITS[out[i]] if out[i] != -1 else key
            raise GnnPipeError(f"{where}: structure {i} is listed twice ({other} and {key}); each structure "
                               f"belongs to exactly one split")
        out[ids] = s
    missing = np.flatnonzero(out == -1)
    if missing.size:
        raise GnnPipeError(f"{where}: {missing.size} of the {n} structures of {path} are in no split (the first: "
                           f"{', '.join(map(str, missing[:5]))}); list each in train, val or test, or keep only the "
                           f"structures you use in the structure file")
    return _has_train(out, where)


def _has_train(split: np.ndarray, where: str) -> np.ndarray:
    if not (split == 0).any():
        raise GnnPipeError(f"{where}: no structure is in the train split; a model needs training structures")
    return split


#: the embedded relaxations: BFGS until every free atom's force is below RELAX_FMAX eV/Å, at most
#: RELAX_STEPS steps (measured on 16 trajectories: 17-151 frames, 0.7 s each)
RELAX_FMAX, RELAX_STEPS = 0.05, 150


def pick_frames(n: int, k: int) -> np.ndarray:
    """The ids of ``k`` frames spread evenly along a trajectory of ``n`` (the first and the last among
    them; fewer when it has fewer than ``k``)."""
    return np.unique(np.round(np.linspace(0, n - 1, k)).astype(np.int64)) if k > 1 else np.zeros(1, np.int64)


def _relax(slab, frames_per_trajectory: int) -> list[tuple]:
    """(positions, energy, forces) of the frames ``pick_frames`` takes from a BFGS relaxation under
    EMT (deterministic); one frame: the starting structure, not relaxed."""
    if frames_per_trajectory == 1:
        return [(slab.positions.copy(), slab.get_potential_energy(), slab.get_forces(apply_constraint=False))]
    from ase.optimize import BFGS

    path = []
    opt = BFGS(slab, logfile=None)  # the observer runs on the start and after every step
    opt.attach(lambda: path.append((slab.positions.copy(), slab.get_potential_energy(),
                                    slab.get_forces(apply_constraint=False))))
    opt.run(fmax=RELAX_FMAX, steps=RELAX_STEPS)
    return [path[i] for i in pick_frames(len(path), frames_per_trajectory)]


def generate(num_trajectories: int = 64, metals=SLAB_METALS, adsorbates=ADSORBATES, size=(2, 2, 3),
             vacuum: float = 6.0, rattle: float = 0.05, seed: int = 0, train_fraction: float = 0.8,
             val_fraction: float = 0.1, progress: bool = True, min_distance: float = MIN_DISTANCE,
             frames_per_trajectory: int = 1, split: str = "trajectory") -> dict:
    """Slab + adsorbate systems labelled by EMT, fully determined by the arguments: per trajectory a
    rattled starting structure relaxed by BFGS under EMT, of which ``frames_per_trajectory`` frames
    along the way (initial, intermediate, relaxed: like OC20's S2EF frames) are systems tagged with
    their trajectory (``group``); one frame: the starting structure alone (≈15 ms). ``split``
    ``trajectory``: whole trajectories go to train, val or test; ``random``: frame by frame. A frame
    with two atoms within ``min_distance`` is refused, naming its trajectory."""
    from ase.build import add_adsorbate, fcc100, fcc111, molecule
    from ase.calculators.emt import EMT
    from ase.constraints import FixAtoms
    from tqdm import tqdm

    bad = [e for e in (*metals, *adsorbates) if e not in EMT_ELEMENTS and e not in ADSORBATES]
    if bad or any(m not in SLAB_METALS for m in metals):
        raise GnnPipeError(f"atoms.generate: EMT labels only slabs of {', '.join(SLAB_METALS)} with adsorbates "
                           f"{', '.join(ADSORBATES)}; got metals {list(metals)}, adsorbates {list(adsorbates)}")
    if num_trajectories < 1 or frames_per_trajectory < 1:
        raise GnnPipeError(f"atoms.num_trajectories ({num_trajectories}) and atoms.frames_per_trajectory "
                           f"({frames_per_trajectory}) must be >= 1")
    rng = np.random.default_rng(seed)
    out, groups = [], []
    for k in tqdm(range(num_trajectories), desc="EMT relaxations" if frames_per_trajectory > 1 else "EMT structures",
                  unit="trajectory", file=sys.stderr, disable=not progress):
        metal, ads = metals[rng.integers(len(metals))], adsorbates[rng.integers(len(adsorbates))]
        build = fcc111 if rng.random() < 0.5 else fcc100
        slab = build(metal, size=tuple(size), vacuum=vacuum)
        slab.set_constraint(FixAtoms(indices=[a.index for a in slab if a.tag == size[2]]))  # bottom layer
        mol = molecule(ads) if len(ads) > 1 else ads
        low = 0 if isinstance(mol, str) else int(np.argmin(mol.positions[:, 2]))  # its lowest atom binds
        xy = rng.random(2) @ slab.cell.array[:2, :2]
        # heights measured with EMT: an atom 1.5-2.0 Å above a metal atom feels 20-55 eV/Å
        height = rng.uniform(2.0, 2.5) if isinstance(mol, str) else rng.uniform(2.2, 3.0)
        add_adsorbate(slab, mol, height=float(height), position=tuple(xy), mol_index=low)
        free = ~np.isin(np.arange(len(slab)), slab.constraints[0].get_indices())
        slab.positions[free] += rng.normal(scale=rattle, size=(int(free.sum()), 3))  # rattle free atoms
        where = f"atoms.generate: trajectory {k} (seed {seed}, {metal} + {ads}, rattle {rattle:g} Å)"
        check_structure(slab.numbers, slab.positions, slab.cell.array, slab.pbc, min_distance=min_distance,
                        where=where)
        slab.calc = EMT()
        fixed = np.zeros(len(slab), dtype=bool)
        for c in slab.constraints:
            fixed[c.get_indices()] = True
        for i, (pos, energy, forces) in enumerate(_relax(slab, frames_per_trajectory)):
            if i:  # frame 0 is the start, checked above
                check_structure(slab.numbers, pos, slab.cell.array, slab.pbc, min_distance=min_distance,
                                where=f"{where}, frame {i}")
            out.append((slab.numbers.copy(), pos, fixed, forces, slab.cell.array.copy(), slab.pbc.copy(), energy))
            groups.append(k)
    groups = np.asarray(groups, dtype=np.int64)
    cut = (group_split(groups, train_fraction, val_fraction, seed) if split == "trajectory" else
           random_split(len(groups), train_fraction, val_fraction, seed))
    return _pack(out, cut, f"generated:ase-emt seed={seed} frames={frames_per_trajectory} split={split}",
                 min_distance, groups)


def structure_kind(path) -> str:
    """How a structure file or folder is read: ``aselmdb`` (an ``.aselmdb`` file or a folder of them: fairchem's
    ASE-LMDB, ``atomic.aselmdb``), ``s2ef`` (a folder of OC20's ``*.extxyz(.xz)`` + ``*.txt(.xz)``,
    ``atomic.oc20``), ``db`` (an ASE database) or ``extxyz`` (any other file ASE reads); a folder of neither
    is one line."""
    from . import aselmdb, oc20

    path = Path(path)
    if path.is_dir():
        if aselmdb.shards(path):
            return "aselmdb"
        if oc20.is_s2ef_folder(path):
            return "s2ef"
        raise GnnPipeError(f"{path}: a folder of neither *.aselmdb shards (fairchem's ASE-LMDB) nor OC20 S2EF files "
                           f"(*.extxyz.xz / *.extxyz with their *.txt); atoms.file names a structure file or such a folder")
    return {".aselmdb": "aselmdb", ".db": "db"}.get(path.suffix, "extxyz")


def _rows(path: Path, group_key: str, split_key: str, s2ef_energy: str) -> list[tuple]:
    """``(where, atoms, trajectory, split name)`` of every structure of ``path`` (``structure_kind``)."""
    import ase.db
    import ase.io

    from . import aselmdb, oc20

    kind = structure_kind(path)
    if kind == "aselmdb":
        return [(where, a, kv.get(group_key), kv.get(split_key)) for where, a, kv in aselmdb.read_rows(path)]
    if kind == "s2ef":  # trajectories are OC20's system ids, whatever group_key says
        return [(where, a, sid, a.info.get(split_key)) for where, a, sid in oc20.read_rows(path, s2ef_energy)]
    try:
        if kind == "db":
            with ase.db.connect(str(path)) as db:
                return [(f"row id {r.id}", r.toatoms(add_additional_information=False), r.get(group_key),
                         r.get(split_key)) for r in db.select(sort="id")]
        return [(f"frame {i}", a, a.info.get(group_key), a.info.get(split_key))
                for i, a in enumerate(ase.io.read(str(path), index=":"))]
    except Exception as e:  # noqa: BLE001 - ASE raises many kinds; the user needs the file named
        raise GnnPipeError(f"{path}: cannot be read as an ASE database or extxyz ({type(e).__name__}: {e})") from None


def read_structures(path: str | os.PathLike, train_fraction: float = 0.8, val_fraction: float = 0.1,
                    seed: int = 0, min_distance: float = MIN_DISTANCE, split: str = "trajectory",
                    group_key: str = "trajectory", split_key: str = "split", split_file: str = "",
                    s2ef_energy: str = "referenced") -> dict:
    """A user's ASE database (``.db``), extended XYZ, fairchem ASE-LMDB (``.aselmdb`` or a folder of shards) or
    OC20 S2EF folder (``structure_kind``; S2EF energies ``s2ef_energy`` referenced or total, each frame's
    trajectory its system id, fixed atoms those of tag 0) with energies and forces, or energies alone (every
    structure the same: the forces are then NaN, :func:`has_forces`, and training is energy-only),
    checked row by row (``checks.check_structure``, then finite energy and forces). ``split`` ``trajectory``: each
    structure's trajectory is the value of its ``group_key`` (an ``info`` key of extxyz, a column of
    the db: ``key_value_pairs``), and whole trajectories go to train, val or test; ``random``:
    structure by structure; a fixed split: ``key``, each structure's ``split_key`` names its split
    (``named_split``), or ``file``, the index file ``split_file`` lists them (``index_split``); the
    fractions are not used, and the trajectories are the ``group_key``'s where every structure has one
    (else one per structure)."""
    path = Path(path)
    if not path.exists():
        raise GnnPipeError(f"{path}: no such structure file (an ASE .db, .extxyz/.xyz, .aselmdb, or a folder of "
                           f".aselmdb shards or OC20 S2EF files)")
    kind = structure_kind(path)
    rows = _rows(path, group_key, split_key, s2ef_energy)
    if not rows:
        raise GnnPipeError(f"{path}: holds no structures")
    out, with_forces = [], None  # the first structure with forces (every one must have them, or none)
    for i, (where, atoms, *_) in enumerate(rows):
        z = atoms.numbers
        check_structure(z, atoms.positions, atoms.cell.array, atoms.pbc, min_distance=min_distance,
                        where=f"{path}: {where}")
        energy, forces = _stored(atoms, "get_potential_energy"), _stored(atoms, "get_forces")
        if energy is None:
            raise GnnPipeError(f"{path}: {where} has {'forces but ' if forces is not None else ''}no energy; every "
                               f"structure needs its energy (forces are optional: without them training is "
                               f"energy-only)")
        if not np.isfinite(energy):
            raise GnnPipeError(f"{path}: {where}: its energy must be finite, not {energy}")
        if i == 0:
            with_forces = forces is not None
        elif with_forces != (forces is not None):
            has, lacks = (rows[0][0], where) if with_forces else (where, rows[0][0])
            raise GnnPipeError(f"{path}: {lacks} has an energy but no forces while {has} has both; give every "
                               f"structure forces, or none (energy-only training)")
        if forces is None:
            forces = np.full((len(z), 3), np.nan)  # unknown (systems.h5: NaN; has_forces)
        elif np.shape(forces) != (len(z), 3) or not np.all(np.isfinite(forces)):
            raise GnnPipeError(f"{path}: {where}: forces must be finite, one row of 3 per atom")
        fixed = np.zeros(len(z), dtype=bool)
        for c in atoms.constraints:
            if hasattr(c, "get_indices"):
                fixed[c.get_indices()] = True
        out.append((z, atoms.positions, fixed, forces, atoms.cell.array, atoms.pbc, energy))
    what = "info key" if kind == "extxyz" else "column"
    unnamed = next((r[0] for r in rows if r[2] is None or not np.isscalar(r[2])), None)  # a row without a trajectory
    if split == "trajectory" and unnamed is not None:
        raise GnnPipeError(f"{path}: {unnamed} has no {what} {group_key!r} naming its trajectory (atoms.group_key; "
                           f"splits keep each trajectory in one of train/val/test): set atoms.group_key to the "
                           f"{what} that does, or atoms.split: random to split structure by structure")
    groups = np.arange(len(out))  # random, or a trajectory a structure
    if split != "random" and unnamed is None:  # trajectories numbered in the order they first appear
        _, first, inverse = np.unique([str(r[2]) for r in rows], return_index=True, return_inverse=True)
        groups = np.argsort(np.argsort(first))[inverse]
    how = {"trajectory": " group=system id" if kind == "s2ef" else f" group_key={group_key}", "random": "",
           "key": f" split_key={split_key}", "file": f" split_file={Path(split_file).name}"}[split]
    if split == "key":
        cut = named_split([r[3] for r in rows], [r[0] for r in rows], path, split_key, what)
    elif split == "file":
        cut = index_split(split_file, len(rows), path)
    elif split == "trajectory":
        cut = group_split(groups, train_fraction, val_fraction, seed)
    else:
        cut = random_split(len(out), train_fraction, val_fraction, seed)
    # the new kinds say so; S2EF: which energies, referenced (adsorption) or total
    tag = {"aselmdb": " (aselmdb)", "s2ef": f" (s2ef energy={s2ef_energy})"}.get(kind, "")
    return _pack(out, cut, f"file:{path.name}{tag} split={split}{how}", min_distance, groups)


def _stored(atoms, getter: str):
    """The energy or the forces (``getter``) an ASE structure carries, None where it has none."""
    try:
        return getattr(atoms, getter)(**({"apply_constraint": False} if getter == "get_forces" else {}))
    except Exception:  # noqa: BLE001 - no calculator, or one without that property
        return None


def read_forces(path) -> Optional[np.ndarray]:
    """The forces of a systems.h5 alone (``has_forces`` without reading the rest: ``tasks.task_for``), unverified;
    None where the file cannot be read (``read_systems`` then says why)."""
    try:
        with h5py.File(path, "r") as f:
            return f["forces"][()]
    except (OSError, KeyError, ValueError, TypeError):
        return None


def has_forces(systems: dict) -> bool:
    """Whether the systems carry forces: a file of energies alone stores its forces as NaN (unknown)."""
    forces = systems["forces"]
    return not (forces.any_nan() if isinstance(forces, H5Rows) else np.isnan(forces).any())


# --------------------------------------------------------------------------- graphs
def build_graphs(systems: dict, cutoff: float, max_neighbors: int, progress: bool = True,
                 neighbors: str = "project") -> dict:
    """Symmetric radius graphs, reverse edges and triplets of every system (the module docstring;
    ``atomic.neighbors.system_graph``: one neighbour code for every atomic dataset and model), with
    the neighbour convention ``neighbors`` (``project`` or ``fairchem``)."""
    from tqdm import tqdm

    if not cutoff > 0:
        raise GnnPipeError(f"atoms.cutoff must be > 0 Å, got {cutoff}")
    if max_neighbors < 1:
        raise GnnPipeError(f"atoms.max_neighbors must be >= 1, got {max_neighbors}")
    ptr = systems["atom_ptr"]
    parts = {k: [] for k in ("edge_src", "edge_dst", "edge_shift", "id_swap", "idx_kj", "idx_ji")}
    ne, nt = [0], [0]
    for s in tqdm(range(len(ptr) - 1), desc="radius graphs", unit="system", file=sys.stderr, disable=not progress):
        pos = systems["pos"][ptr[s]:ptr[s + 1]]
        check_structure(systems["z"][ptr[s]:ptr[s + 1]], pos, systems["cell"][s], systems["pbc"][s],
                        min_distance=systems.get("min_distance", MIN_DISTANCE),
                        where=f"{systems.get('path', 'systems')}: system {s}")
        g = system_graph(pos, systems["cell"][s], systems["pbc"][s], cutoff, max_neighbors, neighbors)
        if len(g["edge_src"]) == 0:
            raise GnnPipeError(f"system {s} ({len(pos)} atoms) has no pair of atoms within the cutoff "
                               f"{cutoff} Å: raise atoms.cutoff or remove it")
        for k in parts:
            parts[k].append(g[k])
        ne.append(ne[-1] + len(g["edge_src"]))
        nt.append(nt[-1] + len(g["idx_kj"]))
    out = {k: np.concatenate(v) for k, v in parts.items()}
    out["edge_shift"] = out["edge_shift"].reshape(-1, 3)
    out["edge_ptr"], out["triplet_ptr"] = np.array(ne, dtype=np.int64), np.array(nt, dtype=np.int64)
    return out


def graph_stats(graphs: dict, systems: dict) -> dict:
    """Atoms, edges and triplets per system (mean, max) and in all."""
    per = {"atoms": np.diff(systems["atom_ptr"]), "edges": np.diff(graphs["edge_ptr"]),
           "triplets": np.diff(graphs["triplet_ptr"])}
    return {**{f"{k}_mean": float(v.mean()) for k, v in per.items()},
            **{f"{k}_max": int(v.max()) for k, v in per.items()},
            **{f"{k}_total": int(v.sum()) for k, v in per.items()}, "systems": int(len(per["atoms"]))}


def batch_arrays(systems: dict, graphs: Optional[dict], ids) -> dict:
    """One batch of systems ``ids``: arrays with batch-level atom, edge and system ids (``id_swap`` and
    the triplets index the batch's edges), and each system's ``cell`` and ``pbc``. ``graphs`` None: the
    atoms alone, no graph (a layout whose ranks build their own: ``atom_layouts.DomainsTraining``)."""
    ap = systems["atom_ptr"]
    cols = {k: [] for k in ("z", "pos", "fixed", "forces", "system")}
    if graphs is not None:
        cols.update({k: [] for k in ("edge_src", "edge_dst", "edge_shift", "id_swap", "idx_kj", "idx_ji")})
    na = ne = 0
    for b, s in enumerate(ids):
        a0, a1 = ap[s], ap[s + 1]
        for k in ("z", "pos", "fixed", "forces"):
            cols[k].append(systems[k][a0:a1])
        cols["system"].append(np.full(a1 - a0, b, dtype=np.int64))
        if graphs is None:
            continue
        e0, e1, t0, t1 = graphs["edge_ptr"][s], graphs["edge_ptr"][s + 1], graphs["triplet_ptr"][s], \
            graphs["triplet_ptr"][s + 1]
        cols["edge_src"].append(graphs["edge_src"][e0:e1] + na)
        cols["edge_dst"].append(graphs["edge_dst"][e0:e1] + na)
        cols["edge_shift"].append(graphs["edge_shift"][e0:e1])
        cols["id_swap"].append(graphs["id_swap"][e0:e1] + ne)
        cols["idx_kj"].append(graphs["idx_kj"][t0:t1] + ne)
        cols["idx_ji"].append(graphs["idx_ji"][t0:t1] + ne)
        na, ne = na + (a1 - a0), ne + (e1 - e0)
    out = {k: np.concatenate(v) for k, v in cols.items()}
    if graphs is not None:
        out["edge_shift"] = out["edge_shift"].reshape(-1, 3)
    out["energy"] = systems["energy"][list(ids)]
    out["cell"], out["pbc"] = systems["cell"][list(ids)], systems["pbc"][list(ids)]
    out["num_systems"] = len(ids)
    return out


# --------------------------------------------------------------------------- HDF5
def _content_hash(arrays: dict, attrs: dict) -> str:
    h = hashlib.sha256(hash_arrays(arrays).encode())
    h.update(json.dumps(attrs, sort_keys=True, default=str).encode())
    return h.hexdigest()


def write_h5(path: str | os.PathLike, arrays: dict, attrs: dict, kind: str) -> str:
    """Write ``arrays`` + ``attrs`` as a versioned, hashed HDF5 file of ``kind``; returns the hash."""
    attrs = {**attrs, "kind": kind, "format_version": format_version(kind)}
    digest = _content_hash(arrays, attrs)
    with atomic_path(path, ".h5") as tmp:
        with h5py.File(tmp, "w") as f:
            for k, v in arrays.items():
                f.create_dataset(k, data=v)
            for k, v in attrs.items():
                f.attrs[k] = json.dumps(v) if isinstance(v, (dict, list, tuple)) else v
            f.attrs["content_hash"] = digest
    return digest


def read_h5(path: str | os.PathLike, kind: str, names, rule: str, hashed: bool = True) -> tuple[dict, dict]:
    """Read and verify a file of ``write_h5``; any mismatch is a GnnPipeError naming ``rule``.
    ``hashed=False``: read ``names`` only (a part of the file's arrays) and leave the content hash
    unchecked (it covers every array); its kind, version and datasets are still checked."""
    again = f"delete it and rerun the workflow (rule {rule} rebuilds it)"
    try:
        with h5py.File(path, "r") as f:
            attrs = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()}
            if attrs.get("kind") != kind or attrs.get("format_version") != format_version(kind):
                raise GnnPipeError(f"{path}: not a {kind} file of format version {format_version(kind)} "
                                   f"(kind {attrs.get('kind')!r}, version {attrs.get('format_version')!r}); {again}")
            missing = [n for n in names if n not in f]
            if missing:
                raise GnnPipeError(f"{path}: missing dataset(s) {', '.join(missing)}; {again}")
            arrays = {n: f[n][()] for n in names}
    except GnnPipeError:
        raise
    except (OSError, KeyError, ValueError) as e:
        raise GnnPipeError(f"{path}: unreadable or truncated HDF5 ({e}); {again}") from None
    stored = attrs.pop("content_hash", None)
    attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in attrs.items()}
    for k, v in attrs.items():
        if isinstance(v, str) and v[:1] in "[{":
            attrs[k] = json.loads(v)
    if hashed and _content_hash(arrays, attrs) != stored:
        raise GnnPipeError(f"{path}: content hash mismatch (the file was edited or corrupted); {again}")
    return arrays, {**attrs, "content_hash": stored}


def write_systems(path, systems: dict, params: dict | None = None) -> str:
    arrays = {k: systems[k] for k in SYSTEM_ARRAYS}
    return write_h5(path, arrays, {"source": systems.get("source", "unknown"), "params": params or {},
                                   "num_systems": int(len(systems["energy"])),
                                   "num_atoms": int(len(systems["z"])),
                                   "min_distance": float(systems.get("min_distance", MIN_DISTANCE))}, "systems")


#: the per-atom arrays ``read_systems(rows=True)`` leaves in the file, read by rows (48 of 57 bytes an atom)
ROW_ARRAYS = ("pos", "forces")


class H5Rows:
    """One per-atom dataset of an HDF5 file, read by rows on demand (h5py slicing, the file opened per
    read): ``rows[a0:a1]`` reads those rows only; an index array reads each run of consecutive rows it
    holds; ``np.asarray(rows)`` (any other use) reads the whole dataset. ``read`` counts the rows read
    (tests)."""

    def __init__(self, path, name: str):
        self.path, self.name, self.read = str(path), name, 0
        with h5py.File(self.path, "r") as f:
            self.shape, self.dtype = f[name].shape, f[name].dtype
        self.ndim = len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key) -> np.ndarray:
        with h5py.File(self.path, "r") as f:
            ds = f[self.name]
            if isinstance(key, slice) and key.step in (None, 1):
                out = ds[key]
            else:
                idx = np.asarray(key)
                idx = np.flatnonzero(idx) if idx.dtype == bool else idx.astype(np.int64).ravel()
                idx = np.where(idx < 0, idx + self.shape[0], idx)
                u, inv = np.unique(idx, return_inverse=True)
                runs = np.split(u, np.flatnonzero(np.diff(u) != 1) + 1) if len(u) else []
                got = [ds[int(r[0]):int(r[-1]) + 1] for r in runs]
                out = (np.concatenate(got) if got else np.empty((0, *self.shape[1:]), self.dtype))[inv.ravel()]
        self.read += len(out)
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype)

    def any_nan(self, chunk: int = 1 << 18) -> bool:
        """Whether a row holds a NaN, read ``chunk`` rows at a time."""
        return any(np.isnan(self[a:a + chunk]).any() for a in range(0, self.shape[0], chunk))


def read_systems(path, rows: bool = False) -> dict:
    """The systems of ``systems.h5``, checked against its content hash. ``rows``: its ``ROW_ARRAYS`` left
    in the file as :class:`H5Rows` (a training rank in the domains layout reads its batches' rows
    only), the hash then unchecked (it covers the arrays not read), as ``read_graphs(counts_only=True)``."""
    names = [n for n in SYSTEM_ARRAYS if not (rows and n in ROW_ARRAYS)]
    arrays, attrs = read_h5(path, "systems", names, "build_systems", hashed=not rows)
    if rows:
        try:
            arrays.update({n: H5Rows(path, n) for n in ROW_ARRAYS})
        except (OSError, KeyError) as e:
            raise GnnPipeError(f"{path}: unreadable systems.h5 ({e}); delete it and rerun the workflow "
                               "(rule build_systems rebuilds it)") from None
    arrays["fixed"], arrays["pbc"] = arrays["fixed"].astype(bool), arrays["pbc"].astype(bool)
    return {**arrays, "source": attrs["source"], "content_hash": attrs["content_hash"], "path": str(path),
            "min_distance": float(attrs.get("min_distance", MIN_DISTANCE))}


def write_graphs(path, graphs: dict, cutoff: float, max_neighbors: int, systems_hash: str,
                 neighbors: str = "project") -> str:
    # the default convention is not written: a project graphs.h5 stays the file (and hash) it was before the option
    convention = {} if neighbors == "project" else {"neighbors": neighbors}
    return write_h5(path, {k: graphs[k] for k in GRAPH_ARRAYS},
                    {"cutoff": float(cutoff), "max_neighbors": int(max_neighbors), "systems_hash": systems_hash,
                     "symmetric_edges": True, **convention}, "atom_graphs")


#: what ``read_graphs(counts_only=True)`` reads: each system's edge and triplet count (O(systems))
GRAPH_COUNTS = ("edge_ptr", "triplet_ptr")


def read_graphs(path, expect_systems_hash: str | None = None, counts_only: bool = False) -> dict:
    """The graphs of ``graphs.h5``; ``counts_only``: its attributes and ``GRAPH_COUNTS`` alone, not the
    neighbour list nor the triplets (a training run in the domains layout, whose ranks build their own
    regions: ``AtomicEngine``), the content hash then unchecked (it covers the arrays not read)."""
    arrays, attrs = read_h5(path, "atom_graphs", GRAPH_COUNTS if counts_only else GRAPH_ARRAYS, "atom_graphs",
                            hashed=not counts_only)
    if expect_systems_hash is not None and attrs["systems_hash"] != expect_systems_hash:
        raise GnnPipeError(f"{path}: built from other structures than the systems.h5 beside it (stale); "
                           "delete it and rerun the workflow (rule atom_graphs rebuilds it)")
    return {**arrays, "cutoff": attrs["cutoff"], "max_neighbors": attrs["max_neighbors"],
            "neighbors": attrs.get("neighbors", "project"),
            "symmetric_edges": bool(attrs["symmetric_edges"]), "content_hash": attrs["content_hash"]}


# --------------------------------------------------------------------------- entry points
def systems_from_config(cfg, progress: bool = True) -> dict:
    """The systems of a ``datasets.<name>.atoms`` config (``AtomsConfig``): generated or read."""
    if cfg.file:
        from . import oc20

        path = oc20.fetch_split(cfg.s2ef_split, cfg.file) if cfg.s2ef_split else cfg.file
        systems = read_structures(path, cfg.train_fraction, cfg.val_fraction, cfg.seed, cfg.min_distance,
                                  cfg.split, cfg.group_key, cfg.split_key, cfg.split_file, cfg.s2ef_energy)
        if cfg.s2ef_split:
            oc20.check_count(cfg.s2ef_split, len(systems["energy"]), path)
        return systems
    return generate(cfg.num_trajectories, tuple(cfg.metals), tuple(cfg.adsorbates), tuple(cfg.slab_size),
                    rattle=cfg.rattle, seed=cfg.seed, train_fraction=cfg.train_fraction,
                    val_fraction=cfg.val_fraction, progress=progress, min_distance=cfg.min_distance,
                    frames_per_trajectory=cfg.frames_per_trajectory, split=cfg.split)


def systems_summary(systems: dict) -> dict:
    n = np.diff(systems["atom_ptr"])
    return {"systems": int(len(n)), "trajectories": int(len(np.unique(systems["group"]))),
            "atoms": int(n.sum()), "atoms_per_system_mean": float(n.mean()),
            "elements": sorted(int(z) for z in np.unique(systems["z"])),
            "splits": {s: int((systems["split"] == i).sum()) for i, s in enumerate(("train", "val", "test"))},
            "energy_mean": float(systems["energy"].mean()), "forces": has_forces(systems),
            "source": systems.get("source", "")}
