"""Small I/O helpers shared by every stage: atomic writes and content hashes.

Every output of the pipeline is written to a temporary file in the destination
directory and renamed into place, so that an interrupted job never leaves a
half-written file that a later job would trust. Files get the permissions the umask
gives (0644 under the usual 022: colleagues on a shared cluster can read results), and
a write that fails for want of space (or quota, or a file-size limit) is one line naming
the file and the errno, whatever library was writing (torch, h5py, json).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import secrets
from pathlib import Path
from typing import Iterator, Optional

import numpy as np


class GnnPipeError(RuntimeError):
    """An error caused by the user's input (config, files), with a message meant for them."""


class WriteError(GnnPipeError):
    """An output could not be written: the disk is full, a quota or a file-size limit was hit."""


# what the file system answers when it cannot take a write (EFBIG: a file-size limit, ulimit -f)
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def disk_errno(e: Optional[BaseException]) -> Optional[int]:
    """The errno of ``DISK_ERRNOS`` behind ``e``: its own, one in its cause/context chain (torch
    and h5py wrap the OSError of the write they were doing), or HDF5's ``errno = N`` text."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            return e.errno
        m = re.search(r"errno = (\d+)", str(e))
        if m and int(m[1]) in DISK_ERRNOS:
            return int(m[1])
        e = e.__cause__ or e.__context__
    return None


def write_error(path, e: BaseException) -> Optional[WriteError]:
    """The one-line error for a failed write of ``path`` (None: not a disk error)."""
    code = disk_errno(e)
    if code is None:
        return None
    return WriteError(f"{path}: cannot write it: {os.strerror(code)} ({errno.errorcode[code]}); nothing was "
                      f"replaced: free space on that file system (or raise the limit) and rerun")


def _temp_file(path: Path, suffix: str) -> Path:
    """A new empty file next to ``path``, created with the umask's permissions (unlike mkstemp's
    0600: results on a shared cluster are for colleagues to read)."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}{suffix or '.tmp'}"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(path))


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it to ``path`` on success.

    On an exception the temporary file is removed and ``path`` is left untouched; a disk
    error (``DISK_ERRNOS``) becomes a ``WriteError`` naming ``path``.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp_path = _temp_file(path, suffix)
    except OSError as e:
        err = write_error(path, e)
        if err is None:
            raise
        raise err from e
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        err = write_error(path, e) if not isinstance(e, GnnPipeError) else None
        if err is None:
            raise
        raise err from e


def write_torch(path: str | os.PathLike, obj) -> None:
    """``torch.save(obj)`` to ``path``, atomically. Through a Python file object: torch's own
    writer reports a full disk as "unexpected pos 128 vs 0", the file object's OSError says ENOSPC."""
    import torch

    with atomic_path(path, ".pt") as tmp, open(tmp, "wb") as f:
        torch.save(obj, f)


def write_json(path: str | os.PathLike, obj) -> None:
    """Write ``obj`` as indented JSON, atomically; NaN and infinities become ``null``.

    Bare ``NaN`` / ``Infinity`` are not JSON (other tools refuse the file), so non-finite
    floats are written as ``null`` and ``allow_nan=False`` guards the rule.
    """
    text = json.dumps(_finite(obj), indent=2, sort_keys=False, default=_json_default, allow_nan=False)
    with atomic_path(path, ".json") as tmp:
        tmp.write_text(text + "\n")


def _finite(o):
    """``o`` with every non-finite float (Python or NumPy, in arrays too) replaced by None."""
    if isinstance(o, (float, np.floating)):
        return float(o) if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    if isinstance(o, np.ndarray) and o.dtype.kind == "f":
        return _finite(o.tolist())
    return o


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def _json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


HASH_SLAB = 1 << 26  # bytes of a dataset read at a time when hashing it from its file


def hash_arrays(arrays: dict, as_dtype: dict | None = None) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of ``arrays`` (in key order). A value may
    be an h5py dataset instead of an array: it is read in slabs of ``HASH_SLAB`` bytes, never
    whole, and gives the digest its array would. ``as_dtype`` (name -> dtype) hashes an array as
    if it had that dtype (converted slab by slab): a digest that does not depend on how an array
    is stored (graph.h5's node ids, int32 or int64)."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        if not isinstance(getattr(a, "dtype", None), np.dtype) or not getattr(a, "shape", ()):
            a = np.ascontiguousarray(a)
        dtype = np.dtype((as_dtype or {}).get(name, a.dtype))
        h.update(f"{name}:{dtype.str}:{tuple(a.shape)}".encode())
        if not a.shape:
            h.update(memoryview(np.ascontiguousarray(a, dtype=dtype)).cast("B"))
            continue
        if isinstance(a, np.ndarray) and a.dtype == dtype:
            h.update(memoryview(np.ascontiguousarray(a)).cast("B"))  # = the slabs' digest, no copy
            continue
        step = max(1, HASH_SLAB // max(1, int(np.prod(a.shape[1:])) * max(a.dtype.itemsize, dtype.itemsize)))
        for i in range(0, a.shape[0], step):
            h.update(memoryview(np.ascontiguousarray(a[i:i + step], dtype=dtype)).cast("B"))
    return h.hexdigest()
