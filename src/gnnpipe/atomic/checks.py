"""What makes a structure impossible, checked in one place that every reader of atoms calls.

``check_structure`` is called by the EMT generator, the ASE database / extxyz reader and
``build_graphs`` (so a hand-made ``systems.h5`` is checked too) before anything else looks at
the atoms. It refuses, with one line naming the file, the row and the atoms:

* an element outside Z = 1..94 (the model's embedding has rows 0..94);
* a position or cell that is not finite (NaN, inf);
* a periodic cell whose height along a periodic axis (the distance between neighbouring
  lattice planes: the component of that cell vector orthogonal to the other periodic ones) is
  below ``min_distance``: a zero or degenerate cell vector, or a cell so small that an atom
  meets its own image (``pbc=True`` with a zero cell used to be a NaN in the radius graph);
* two atoms, or an atom and a periodic image of another, closer than ``min_distance``.

``min_distance`` (``atoms.min_distance``, default 0.5 Å): the shortest bond there is, H2's, is
0.74 Å; nothing physical comes closer, and two atoms 10^-6 Å apart trained to force errors of
10^19 eV/Å (coincident ones were silently dropped from the radius graph).
"""

from __future__ import annotations

import itertools

import numpy as np

from ..io import GnnPipeError

MIN_DISTANCE = 0.5  # Å, the default of atoms.min_distance
MAX_Z = 94  # the model's element embedding has rows 0..94


def periodic_heights(cell: np.ndarray, pbc: np.ndarray) -> np.ndarray:
    """(3,) the distance between neighbouring lattice planes along each periodic axis (inf along
    the others): no two periodic images of a point along axis ``a`` are closer than ``h[a]``."""
    cell, periodic = np.asarray(cell, dtype=np.float64), np.flatnonzero(pbc)
    heights = np.full(3, np.inf)
    for ax in periodic:
        others = cell[[a for a in periodic if a != ax]].T  # (3, k)
        v = cell[ax]
        if others.size:
            v = v - others @ np.linalg.lstsq(others, v, rcond=None)[0]
        heights[ax] = np.linalg.norm(v)
    return heights


def image_range(heights: np.ndarray, reach: float) -> list[int]:
    """How many images each way along each axis can hold a point within ``reach`` of the cell
    (one more than the planes it spans: positions need not be wrapped into the cell)."""
    return [int(np.ceil(reach / h)) + 1 if np.isfinite(h) else 0 for h in heights]


def _symbol(z: int) -> str:
    from ase.data import chemical_symbols
    return chemical_symbols[z] if 0 < z < len(chemical_symbols) else f"Z={z}"


def closest_pair(pos: np.ndarray, cell: np.ndarray, pbc: np.ndarray, reach: float) -> tuple[float, int, int, tuple]:
    """``(distance, i, j, image)``: the closest pair of atoms if it is within ``reach``, atom ``j``
    in periodic ``image`` of the cell (all zero: the same cell); a farther pair may be missed;
    ``(inf, -1, -1, ())`` for a lone atom without images."""
    from scipy.spatial import cKDTree

    tree, n = cKDTree(pos), len(pos)
    best = (np.inf, -1, -1, ())
    for image in itertools.product(*[range(-r, r + 1) for r in image_range(periodic_heights(cell, pbc), reach)]):
        own = not any(image)
        if own and n < 2:
            continue
        d, j = tree.query(pos - np.asarray(image, dtype=np.float64) @ cell, k=2 if own else 1)
        if own:  # the nearest is the atom itself (or a coincident one): take the other
            j = np.where(j[:, 0] == np.arange(n), j[:, 1], j[:, 0])
            d = d[:, 1]
        i = int(np.argmin(d))
        if d[i] < best[0]:
            best = (float(d[i]), i, int(j[i]), tuple(image))
    return best


def check_structure(numbers, positions, cell, pbc, *, min_distance: float = MIN_DISTANCE,
                    where: str = "structure") -> None:
    """Refuse an impossible structure with one line starting with ``where`` (file and row)."""
    z = np.asarray(numbers)
    pos, cell, pbc = (np.asarray(positions, dtype=np.float64), np.asarray(cell, dtype=np.float64),
                      np.asarray(pbc, dtype=bool))
    if len(z) == 0:
        raise GnnPipeError(f"{where}: holds no atoms")
    if z.min() < 1 or z.max() > MAX_Z:
        raise GnnPipeError(f"{where}: element(s) {sorted(int(v) for v in set(z[(z < 1) | (z > MAX_Z)]))} "
                           f"outside Z = 1..{MAX_Z}")
    if pos.shape != (len(z), 3) or cell.shape != (3, 3) or pbc.shape != (3,):
        raise GnnPipeError(f"{where}: positions {pos.shape}, cell {cell.shape}, pbc {pbc.shape}; expected "
                           f"({len(z)}, 3), (3, 3), (3,)")
    bad = np.flatnonzero(~np.isfinite(pos).all(axis=1))
    if bad.size:
        i = int(bad[0])
        raise GnnPipeError(f"{where}: atom {i} ({_symbol(z[i])}) has a non-finite position {pos[i].tolist()}")
    if not np.isfinite(cell).all():
        raise GnnPipeError(f"{where}: the cell is not finite ({cell.tolist()})")
    for ax, h in enumerate(periodic_heights(cell, pbc)):
        if h < min_distance:
            raise GnnPipeError(f"{where}: periodic along axis {ax} but the cell's height along it is {h:.3g} Å, "
                               f"below atoms.min_distance ({min_distance:g} Å): a zero, degenerate or tiny cell "
                               f"(cell {np.round(cell, 4).tolist()}, pbc {pbc.tolist()})")
    d, i, j, image = closest_pair(pos, cell, pbc, min_distance)
    if d < min_distance:
        i, j = (i, j) if any(image) else (min(i, j), max(i, j))
        other = f"atom {j} ({_symbol(z[j])})" + (f" in the periodic image {image}" if any(image) else "")
        raise GnnPipeError(f"{where}: atom {i} ({_symbol(z[i])}) and {other} are {d:.3g} Å apart, closer than "
                           f"atoms.min_distance ({min_distance:g} Å)")
