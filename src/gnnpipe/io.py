"""Small I/O helpers shared by every stage: atomic writes and content hashes.

Every output of the pipeline is written to a temporary file in the destination
directory and renamed into place, so that an interrupted job never leaves a
half-written file that a later job would trust.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np


class GnnPipeError(RuntimeError):
    """An error caused by the user's input (config, files), with a message meant for them."""


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it to ``path`` on success.

    On an exception the temporary file is removed and ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix or ".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


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


def hash_arrays(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of ``arrays`` (in key order)."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()
