"""fairchem's ASE-LMDB datasets (``*.aselmdb``: OMat24, OMol25, the re-released OC20) read without fairchem.

The on-disk format (fairchem's ``LMDBDatabase``, ``core/datasets/lmdb_database.py``): one LMDB *file*
(``subdir=False``; a ``<name>-lock`` file beside it) whose keys are ASCII strings. A row is stored under
its id (``"1"``, ``"2"``, ...), the value ``zlib.compress(json)`` of ASE's row dict: ``numbers``,
``positions``, ``cell`` (3 x 3), ``pbc``, optional ``tags``, ``constraints`` (``[{"name": "FixAtoms",
"kwargs": {"indices": [...]}}]``), the calculator's results as top-level keys (``energy``, ``forces``,
``stress``, ``free_energy``, ...), ``key_value_pairs`` and ``data`` (dicts), and bookkeeping (``unique_id``,
``ctime``, ``mtime``, ``user``, ``calculator``). fairchem writes the JSON with orjson (numpy arrays as
nested lists); ASE's own JSON encoder writes arrays as ``{"__ndarray__": [shape, dtype, flat]}``: both
decode here. Three reserved keys hold bookkeeping, not rows: ``nextid``, ``deleted_ids`` (rows deleted:
skipped) and ``metadata``; any other non-numeric key is ignored. A dataset is a file or a folder of ``*.aselmdb`` shards, read in name order (fairchem
sorts them too); the rows of a shard in id order.

Nothing is unpickled: a value that is not (zlib-compressed) JSON — fairchem's older pickled ``.lmdb``
files of torch_geometric objects, say — is refused in one line.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np

from ..io import GnnPipeError

SUFFIX = ".aselmdb"


def shards(path) -> list[Path]:
    """The ``*.aselmdb`` files of a dataset: ``path`` itself, or a folder's, sorted by name."""
    path = Path(path)
    return sorted(path.glob(f"*{SUFFIX}")) if path.is_dir() else [path]


def _ndarray(obj: dict):
    """json object hook: ASE's ``{"__ndarray__": [shape, dtype, flat]}`` as a numpy array."""
    if "__ndarray__" in obj:
        shape, dtype, flat = obj["__ndarray__"]
        return np.asarray(flat, dtype=dtype).reshape(shape)
    return obj


def decode(value: bytes, where: str):
    """One stored value (a row dict, ``nextid``, ``deleted_ids``, ``metadata``): zlib-compressed JSON, or
    plain JSON; anything else (a pickle) is one line naming ``where``."""
    try:
        raw = zlib.decompress(value)
    except zlib.error:
        raw = value
    try:
        return json.loads(raw, object_hook=_ndarray)
    except ValueError:
        kind = "a pickle" if raw[:1] == b"\x80" else "not JSON"
        raise GnnPipeError(f"{where}: {kind}, not an ASE-LMDB row as fairchem writes it (zlib-compressed JSON); "
                           f"pickled LMDBs (fairchem's older LmdbDataset) are never unpickled: convert them to "
                           f"ASE-LMDB, an ASE db or extxyz") from None


def row_atoms(row: dict, where: str):
    """An ``ase.Atoms`` of a row dict: cell, pbc, tags, constraints (``FixAtoms`` and any other of
    ``ase.constraints``), the stored results on a single-point calculator (energy, forces, stress, ...) and
    ``info`` = the row's ``data`` then its ``key_value_pairs``."""
    from ase import Atoms
    from ase.calculators.calculator import all_properties
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.constraints import dict2constraint

    try:
        atoms = Atoms(numbers=row["numbers"], positions=row["positions"], cell=row.get("cell"),
                      pbc=row.get("pbc"), tags=row.get("tags"),
                      constraint=[dict2constraint(c) for c in row.get("constraints", [])])
        results = {k: row[k] for k in all_properties if row.get(k) is not None}
    except Exception as e:  # noqa: BLE001 - a malformed row: ASE raises many kinds; the user needs the row named
        raise GnnPipeError(f"{where}: not an ASE row ({type(e).__name__}: {e})") from None
    if results:
        atoms.calc = SinglePointCalculator(atoms, **results)
    atoms.info.update(row.get("data") or {})
    atoms.info.update(row.get("key_value_pairs") or {})
    return atoms


def read_rows(path) -> list[tuple[str, object, dict]]:
    """``(where, atoms, key_value_pairs + data)`` of every row of an ``.aselmdb`` file or folder, shard by
    shard, each in id order; refused in one line: no such file, a folder without shards, a file that is not
    an LMDB, a value that is not JSON (``decode``), a database with no row."""
    import lmdb

    path = Path(path)
    files = shards(path)
    if not path.exists() or not files:
        what = "holds no *.aselmdb shard" if path.is_dir() else "no such file"
        raise GnnPipeError(f"{path}: {what} (atoms.file: an .aselmdb file of fairchem's ASE-LMDB format, or a "
                           f"folder of them)")
    out = []
    for f in files:
        try:
            env = lmdb.open(str(f), subdir=False, readonly=True, lock=False, readahead=False, meminit=False)
        except lmdb.Error as e:
            raise GnnPipeError(f"{f}: not an LMDB file ({type(e).__name__}: {e}); atoms.file must be fairchem's "
                               f"ASE-LMDB (.aselmdb)") from None
        try:
            with env.begin() as txn:
                items = list(txn.cursor())
        finally:
            env.close()
        values = dict(items)
        deleted = set(decode(values[b"deleted_ids"], f"{f}: key deleted_ids")) if b"deleted_ids" in values else set()
        ids = sorted(int(k) for k in values if k.isdigit() and int(k) not in deleted)
        if not ids:
            raise GnnPipeError(f"{f}: an empty ASE-LMDB database (no rows); remove it from the folder or give "
                               f"atoms.file a database with structures")
        for i in ids:
            where = f"{f.name} row id {i}"
            row = decode(values[str(i).encode("ascii")], f"{f}: row id {i}")
            if not isinstance(row, dict) or "numbers" not in row or "positions" not in row:
                raise GnnPipeError(f"{f}: row id {i} has no numbers/positions: not an ASE row")
            atoms = row_atoms(row, f"{f}: row id {i}")
            out.append((where, atoms, {**(row.get("data") or {}), **(row.get("key_value_pairs") or {})}))
    return out
