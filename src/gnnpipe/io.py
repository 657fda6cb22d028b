"""Small I/O helpers shared by every stage: atomic writes and content hashes.

Every output of the pipeline is written to a temporary file in the destination
directory and renamed into place, so that an interrupted job never leaves a
half-written file that a later job would trust. Files get the permissions the umask
gives (0644 under the usual 022: colleagues on a shared cluster can read results), and
a write that fails for want of space (or quota, or a file-size limit, or on a read-only
file system) is one line naming the file and the errno, whatever library was writing
(torch, h5py, json).

Every path a user names goes through :func:`check_destination` (the commands call it before
their work, :func:`atomic_path` again at the write): a symlink is followed (its target is
written, atomically, beside the target; the link stays), ``STREAMS`` (``/dev/stdout``,
``/dev/stderr``, ``/dev/null``) are written through without a rename, and anything else
that exists and is not a regular file (a directory, FIFO, socket or device) is refused in
one line, as are an empty path and a directory that cannot be written.
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
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import numpy as np


class GnnPipeError(RuntimeError):
    """An error caused by the user's input (config, files), with a message meant for them."""


class WriteError(GnnPipeError):
    """An output cannot be written: the disk is full, a quota or a file-size limit was hit, the file
    system is read-only, or the path names no file that may be replaced."""


# what the file system answers when it cannot take a write (EFBIG: a file-size limit, ulimit -f)
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)
# what to do about each errno (the others: the disk-full advice for DISK_ERRNOS, else check the path)
ADVICE = {errno.EROFS: "that file system is read-only: write to another one (or remount it read-write) and rerun",
          errno.EACCES: "no permission to write there: write elsewhere (or get write permission) and rerun",
          errno.EPERM: "no permission to write there: write elsewhere (or get write permission) and rerun"}
DISK_ADVICE = "free space on that file system (or raise the limit) and rerun"
# user-named outputs written through (a temporary file copied into them, no rename): file descriptor, or
# None to discard. Any other path that exists and is not a regular file is refused (check_destination).
STREAMS = {"/dev/stdout": 1, "/dev/stderr": 2, "/dev/null": None}
_NOT_FILES = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
              (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


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


def write_error(path, e: BaseException, *, any_errno: bool = False) -> Optional[WriteError]:
    """The one-line error for a failed write of ``path`` (None: not a disk error). ``any_errno``:
    any ``OSError`` of ``e`` counts (creating the destination's directory or temporary file: every
    error there is about the destination)."""
    code = disk_errno(e)
    if code is None and any_errno and isinstance(e, OSError) and e.errno:
        code = e.errno
    return None if code is None else errno_error(path, code)


def errno_error(path, code: int) -> WriteError:
    advice = ADVICE.get(code, DISK_ADVICE if code in DISK_ERRNOS else "check the path and rerun")
    return WriteError(f"{path}: cannot write it: {os.strerror(code)} ({errno.errorcode.get(code, code)}); nothing "
                      f"was replaced: {advice}")


def check_destination(path: str | os.PathLike, option: str = "output") -> Path:
    """The file that writing ``path`` creates or replaces (a symlink's target), or ``path`` itself
    for ``STREAMS``; refuses in one line (``WriteError``) an empty path, anything that exists and
    is not a regular file, and a directory where the file cannot be created (read-only file
    system, no permission, a file where a directory should be). Commands call it before their
    work, so that a wrong ``--out`` does not waste it; ``option`` names the argument."""
    if not os.fspath(path):
        raise WriteError(f"{option}: an empty path names no file; give the file to write")
    if os.path.abspath(path) in STREAMS:
        return Path(path)
    target = Path(os.path.realpath(path))
    try:
        mode = target.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):  # _check_creatable names the file in the way
        mode = None
    except OSError as e:  # a symlink loop, a file where a directory should be, ...
        raise write_error(path, e, any_errno=True) from None
    kind = next((k for test, k in _NOT_FILES if mode is not None and test(mode)), None)
    if kind:
        via = f" (a symlink to {target})" if Path(path).is_symlink() else ""
        fix = ("name a file in it" if kind == "a directory" else
               f"name a regular file (or one of {', '.join(STREAMS)}: written through)")
        raise WriteError(f"{path}: is {kind}{via}, not a regular file, and writing would replace it: {fix}")
    _check_creatable(target.parent, path)
    return target


def check_directory(path: str | os.PathLike, option: str = "output directory") -> Path:
    """``path`` as a directory that files can be created in (made later, as the writers do): refuses in
    one line an empty path (naming ``option``), a file in its place or as one of its parents, a
    read-only file system and a directory without write permission."""
    if not os.fspath(path):
        raise WriteError(f"{option}: an empty path names no directory; give the directory to write into")
    _check_creatable(Path(os.path.realpath(path)), path)
    return Path(path)


def _check_creatable(d: Path, name) -> None:
    """Refuse ``d`` if its nearest existing ancestor (``d`` itself, if it exists) is not a directory
    that files can be created in; ``name``: the user's path, named in the error."""
    while not d.exists() and d != d.parent:
        d = d.parent
    if not d.is_dir():
        raise WriteError(f"{name}: cannot write there: {d} is not a directory; name a directory (or remove "
                         f"that file)")
    if not os.access(d, os.W_OK | os.X_OK):
        raise _unwritable(name, d)


def _unwritable(path, directory: Path) -> WriteError:
    readonly = os.statvfs(directory).f_flag & os.ST_RDONLY
    return errno_error(f"{path}", errno.EROFS if readonly else errno.EACCES)


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
    """Yield a temporary path next to ``path``'s file; rename it to that file on success.

    The destination is checked first (:func:`check_destination`: a symlink's target is the file
    written, ``STREAMS`` get the temporary file's bytes copied into them, anything else that is
    not a regular file is refused). On an exception the temporary file is removed and ``path``
    is left untouched; an error of the file system (``DISK_ERRNOS``; while creating the
    temporary file, any) becomes a ``WriteError`` naming ``path``.
    """
    target = check_destination(path)
    if os.path.abspath(path) in STREAMS:
        with _stream(path, suffix) as tmp:
            yield tmp
        return
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp_path = _temp_file(target, suffix)
    except OSError as e:
        raise write_error(path, e, any_errno=True) from e
    try:
        yield tmp_path
        os.replace(tmp_path, target)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        err = write_error(path, e) if not isinstance(e, GnnPipeError) else None
        if err is None:
            raise
        raise err from e


@contextlib.contextmanager
def _stream(path, suffix: str) -> Iterator[Path]:
    """A temporary file (in the temporary directory) whose bytes go to the stream ``path`` names."""
    fd, tmp = tempfile.mkstemp(suffix=suffix or ".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        out = STREAMS[os.path.abspath(path)]
        if out is not None:
            for f in (sys.stdout, sys.stderr):
                f.flush()
            with open(tmp, "rb") as src, os.fdopen(os.dup(out), "wb") as dst:
                shutil.copyfileobj(src, dst)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def empty_file(path: str | os.PathLike) -> bool:
    """``path`` is a regular file of 0 bytes (a copy or a write cut short): readers refuse it in their
    own words first, as torch's says nothing for one (``EOFError`` with an empty message)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == 0


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


# --------------------------------------------------------------------------- the process's heap
def heap_retained(environ=None) -> bool:
    """Whether a node training process started with ``environ`` (default: this one's) keeps freed
    memory (``engine.retain_freed_memory``): yes, unless a ``MALLOC_*_`` variable tunes glibc. Here,
    in the lowest layer, because the engine (which sets it) and the cost model (which prices it:
    ``Hardware.retained_heap_fraction``) must give the same answer."""
    env = os.environ if environ is None else environ
    return not any(k.startswith("MALLOC_") and k.endswith("_") for k in env)
