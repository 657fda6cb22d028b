"""A user's own graph: an edge list and per-node ``.npy`` arrays, validated on load.

Inputs (``dataset.files`` in the workflow config):

* ``edges``: text (``.csv``, ``.tsv``, ``.txt``, ``.edges``, ``.el``, optionally ``.gz``) with
  two integer columns ``source, destination`` separated by a comma or whitespace, and an
  optional header line; or NumPy, ``.npy`` of shape ``(E, 2)`` or ``(2, E)`` (``(2, 2)`` is
  read as rows) or ``.npz`` holding exactly one such array;
* ``features``: ``.npy`` ``(N, F)``, any real dtype (stored as float32). ``N`` is the
  number of nodes: every node id must lie in ``[0, N)``;
* ``labels``: ``.npy`` ``(N,)`` (or ``(N, 1)``) of class ids ``0..C-1``, integral;
* ``train_mask``, ``val_mask``, ``test_mask``: ``.npy`` ``(N,)`` bool or 0/1, disjoint; all
  three or none. Without them the split is random (``seed``, ``train_fraction``,
  ``val_fraction``; test takes the rest).

Every error names the file and, where there is one, the line (text, 1-based as an editor
shows it) or the row (arrays, 0-based like node ids), and says what to fix. Good files take
the fast path (pandas' C parser); bad ones are re-scanned line by line to find the culprit.
"""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import numpy as np

from ..config import FilesConfig
from ..graph import Graph, index_dtype
from ..io import GnnPipeError
from . import build_graph, random_split

TEXT_SUFFIXES = (".csv", ".tsv", ".txt", ".edges", ".el")
_INT = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?(nan|inf)", re.IGNORECASE)
MASKS = ("train_mask", "val_mask", "test_mask")


def load_files(cfg: FilesConfig, *, symmetrize: bool, self_loops: str, name: str) -> Graph:
    """Read, validate and assemble the graph the ``dataset.files`` config points at."""
    for key in ("edges", "features", "labels"):
        if not getattr(cfg, key):
            raise GnnPipeError(f"dataset {name!r}: dataset.files.{key} is not set (a path to the "
                               f"{key} file)")
    features = read_features(cfg.features)
    n = features.shape[0]
    labels = read_labels(cfg.labels, n, features_path=cfg.features)
    src, dst = read_edges(cfg.edges, n, features_path=cfg.features)
    given = [m for m in MASKS if getattr(cfg, m)]
    if given and len(given) != 3:
        absent = [m for m in MASKS if m not in given]
        raise GnnPipeError(f"dataset {name!r}: dataset.files gives {', '.join(given)} but not "
                           f"{', '.join(absent)}; give all three masks or none (random split)")
    if given:
        train, val, test = read_masks({m: getattr(cfg, m) for m in MASKS}, n)
        split = "files"
    else:
        train, val, test = random_split(n, cfg.train_fraction, cfg.val_fraction, cfg.seed,
                                        where="dataset.files")
        split = f"random(seed={cfg.seed}, train={cfg.train_fraction}, val={cfg.val_fraction})"
    params = {"edges": cfg.edges, "features": cfg.features, "labels": cfg.labels, "split": split,
              "raw_edges": int(src.shape[0])}
    return build_graph(src, dst, features=features, labels=labels, train_mask=train,
                       val_mask=val, test_mask=test, num_classes=int(labels.max()) + 1,
                       symmetrize=symmetrize, self_loops=self_loops, name=name,
                       source=f"files:{cfg.edges}", params=params)


# --------------------------------------------------------------------------- arrays
def load_array(path: str | Path, key: str) -> np.ndarray:
    """One array from ``.npy`` or a single-array ``.npz``; ``key`` names the config entry."""
    path = Path(path)
    if not path.is_file():
        raise GnnPipeError(f"{path}: no such file (dataset.files.{key})")
    if path.suffix not in (".npy", ".npz"):
        raise GnnPipeError(f"{path}: dataset.files.{key} must be a .npy file (or a .npz holding "
                           "one array)")
    try:
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.lib.npyio.NpzFile):
            with loaded:
                keys = list(loaded.keys())
                if len(keys) != 1:
                    raise GnnPipeError(f"{path}: holds {len(keys)} arrays ({', '.join(keys) or 'none'}); "
                                       "give a .npz with exactly one array, or a .npy")
                return loaded[keys[0]]
        return loaded
    except GnnPipeError:
        raise
    except ValueError as e:  # object arrays need pickle, which is refused
        raise GnnPipeError(f"{path}: not a plain numeric array ({e}); save it with np.save from a "
                           "numeric array") from None
    except (OSError, EOFError) as e:
        raise GnnPipeError(f"{path}: not a readable NumPy file ({e})") from None


def read_features(path: str | Path) -> np.ndarray:
    x = load_array(path, "features")
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise GnnPipeError(f"{path}: features must have shape (N, F) with N, F >= 1, got {x.shape}")
    if x.dtype.kind not in "fiu":
        raise GnnPipeError(f"{path}: features must be real numbers, got dtype {x.dtype}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    bad = ~np.isfinite(x).all(axis=1)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise GnnPipeError(f"{path}: row {row}: features must be finite (NaN or inf in "
                           f"{int(bad.sum())} row(s), first row {row})")
    return x


def read_labels(path: str | Path, n: int, *, features_path: str | Path = "features") -> np.ndarray:
    y = load_array(path, "labels")
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise GnnPipeError(f"{path}: labels must have shape (N,), got {y.shape}")
    if y.shape[0] != n:
        raise GnnPipeError(f"{path}: {y.shape[0]} labels but {features_path} has {n} rows "
                           "(one label per node)")
    ids = _integral(y, path, "labels must be integer class ids")
    if ids.min() < 0:
        row = int(np.flatnonzero(ids < 0)[0])
        raise GnnPipeError(f"{path}: row {row}: label {ids[row]} is negative; classes are 0..C-1 "
                           "(give unlabelled nodes any class and leave them out of the masks)")
    return ids


def read_masks(paths: dict[str, str], n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    masks = {}
    for key in MASKS:
        path = paths[key]
        m = load_array(path, key)
        if m.shape != (n,):
            raise GnnPipeError(f"{path}: {key} must have shape ({n},) (one entry per node), "
                               f"got {m.shape}")
        if m.dtype != bool:
            v = _integral(m, path, f"{key} must be bool or 0/1")
            off = (v != 0) & (v != 1)
            if off.any():
                row = int(np.flatnonzero(off)[0])
                raise GnnPipeError(f"{path}: row {row}: {key} must be bool or 0/1, found {v[row]}")
            m = v.astype(bool)
        masks[key] = m
    for a, b in [("train_mask", "val_mask"), ("train_mask", "test_mask"), ("val_mask", "test_mask")]:
        both = masks[a] & masks[b]
        if both.any():
            row = int(np.flatnonzero(both)[0])
            raise GnnPipeError(f"{paths[b]}: row {row}: node {row} is in both {a} ({paths[a]}) and "
                               f"{b}; the masks must be disjoint ({int(both.sum())} node(s) overlap)")
    if not masks["train_mask"].any():
        raise GnnPipeError(f"{paths['train_mask']}: train_mask selects no node")
    return masks["train_mask"], masks["val_mask"], masks["test_mask"]


def _integral(a: np.ndarray, path, what: str) -> np.ndarray:
    """``a`` as int64 if every value is an integer, else an error naming the first bad row."""
    if a.dtype.kind in "iu":
        return a.astype(np.int64)
    if a.dtype.kind != "f":
        raise GnnPipeError(f"{path}: {what}, got dtype {a.dtype}")
    flat = a.reshape(a.shape[0], -1)
    bad = ~(np.isfinite(flat) & (flat == np.round(flat))).all(axis=1)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise GnnPipeError(f"{path}: row {row}: {what}, found {a[row].tolist()}")
    return a.astype(np.int64)


# --------------------------------------------------------------------------- edges
#: Edge rows read, checked and converted per step: the import holds the ids it kept (in
#: ``index_dtype(N)``, 8 bytes per edge at int32) and one chunk, never the file's whole table.
READ_CHUNK = 1 << 22


def read_edges(path: str | Path, n: int, *, features_path: str | Path = "features",
               chunk: int = READ_CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) of ``index_dtype(n)`` from an edge file, every id checked against ``[0, n)``.

    Streamed: text through pandas' C parser ``chunk`` lines at a time, ``.npy`` memory-mapped
    and read ``chunk`` rows at a time (a ``.npz`` is decompressed whole: NumPy cannot map it).
    """
    path = Path(path)
    if not path.is_file():
        raise GnnPipeError(f"{path}: no such file (dataset.files.edges)")
    stem_suffix = Path(path.stem).suffix if path.suffix == ".gz" else path.suffix
    if path.suffix in (".npy", ".npz"):
        chunks, where = _edge_array(path, chunk)
    elif stem_suffix in TEXT_SUFFIXES:
        chunks, where = _edge_text(path, chunk)
    else:
        raise GnnPipeError(f"{path}: unknown edge file type; use text ({', '.join(TEXT_SUFFIXES)}, "
                           "optionally .gz) or NumPy (.npy, .npz)")
    itype = index_dtype(n)
    src, dst, seen = [], [], 0
    for edges in chunks:  # (m, 2) int64
        bad = ((edges < 0) | (edges >= n)).any(axis=1)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            col = 0 if not 0 <= edges[i, 0] < n else 1
            raise GnnPipeError(f"{path}: {where(seen + i)}: node id {edges[i, col]} is outside [0, {n}) "
                               f"({n} = rows of {features_path}; {int(bad.sum())} bad edge(s) in rows "
                               f"{seen}-{seen + edges.shape[0] - 1})")
        src.append(edges[:, 0].astype(itype))
        dst.append(edges[:, 1].astype(itype))
        seen += edges.shape[0]
    if seen == 0:
        raise GnnPipeError(f"{path}: holds no edges")
    return _concat(src), _concat(dst)


def _concat(pieces: list[np.ndarray]) -> np.ndarray:
    """One array from ``pieces``, freeing each as it is copied (peak: the result + one piece)."""
    out = np.empty(sum(p.shape[0] for p in pieces), dtype=pieces[0].dtype)
    at = 0
    while pieces:
        p = pieces.pop(0)
        out[at:at + p.shape[0]] = p
        at += p.shape[0]
    return out


def _edge_array(path: Path, chunk: int):
    if path.suffix == ".npy":
        if not path.is_file():
            raise GnnPipeError(f"{path}: no such file (dataset.files.edges)")
        try:
            a = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise GnnPipeError(f"{path}: not a plain numeric array ({e}); save it with np.save from a "
                               "numeric array") from None
        except (OSError, EOFError) as e:
            raise GnnPipeError(f"{path}: not a readable NumPy file ({e})") from None
    else:
        a = load_array(path, "edges")
    if a.ndim != 2 or 2 not in a.shape:
        raise GnnPipeError(f"{path}: edges must have shape (E, 2) or (2, E), got {a.shape}")
    if a.shape[1] == 2:
        where = lambda i: f"row {i}"  # noqa: E731
    else:
        a = a.T
        where = lambda i: f"column {i} (edge {i} of the (2, E) array)"  # noqa: E731
    if a.dtype.kind not in "iuf":
        raise GnnPipeError(f"{path}: node ids must be integers, got dtype {a.dtype}")

    def chunks():
        for at in range(0, a.shape[0], chunk):
            part = np.asarray(a[at:at + chunk])
            if a.dtype.kind == "f":
                bad = ~(np.isfinite(part) & (part == np.round(part))).all(axis=1)
                if bad.any():
                    i = int(np.flatnonzero(bad)[0])
                    raise GnnPipeError(f"{path}: {where(at + i)}: node ids must be integers, "
                                       f"found {part[i].tolist()}")
            yield part.astype(np.int64)
    return chunks(), where


def _open_text(path: Path):
    return gzip.open(path, "rt") if path.suffix == ".gz" else open(path)


def _fields(line: str, comma: bool) -> list[str]:
    return [f.strip() for f in line.split(",")] if comma else line.split()


def _edge_text(path: Path, chunk: int):
    import pandas as pd

    header_line, comma = None, False  # header_line: 0-based physical line of the header
    try:
        with _open_text(path) as f:
            for i, line in enumerate(f):
                if line.strip():
                    comma = "," in line
                    if not any(_NUMBER.fullmatch(x) for x in _fields(line, comma)):
                        header_line = i
                    break
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise GnnPipeError(f"{path}: not a readable text edge list ({e})") from None

    def where(i: int) -> str:
        return f"line {_line_of(path, header_line, i)}"

    def chunks():
        try:
            reader = pd.read_csv(path, sep="," if comma else r"\s+", header=None, dtype=np.int64,
                                 skiprows=[header_line] if header_line is not None else None,
                                 skipinitialspace=True, skip_blank_lines=True, engine="c",
                                 chunksize=chunk)
            with reader:
                for df in reader:
                    if df.shape[1] != 2:
                        failure = f"found {df.shape[1]} columns"
                        break
                    yield df.to_numpy()
                else:
                    return
        except pd.errors.EmptyDataError:
            return
        except (ValueError, OverflowError, pd.errors.ParserError) as e:
            failure = f"{type(e).__name__}: {e}"
        _scan_text(path, header_line, comma)
        raise GnnPipeError(f"{path}: not an edge list of two integer columns ({failure})")

    return chunks(), where


def _scan_text(path: Path, header_line, comma: bool) -> None:
    """Raise on the first line that is not two integer ids (the slow path, after a failure)."""
    sep = "a comma" if comma else "whitespace"
    with _open_text(path) as f:
        for i, line in enumerate(f):
            if i == header_line or not line.strip():
                continue
            fields = _fields(line, comma)
            shown = line.strip()[:80]
            if len(fields) != 2:
                raise GnnPipeError(f"{path}: line {i + 1}: expected 2 columns (source, destination) "
                                   f"separated by {sep}, found {len(fields)}: {shown!r}")
            for x in fields:
                if not _INT.fullmatch(x):
                    raise GnnPipeError(f"{path}: line {i + 1}: node id {x!r} is not an integer: "
                                       f"{shown!r}")
                if abs(int(x)) >= 2**63:
                    raise GnnPipeError(f"{path}: line {i + 1}: node id {x} is too large (int64)")


def _line_of(path: Path, header_line, index: int) -> int:
    """1-based physical line of data row ``index`` (skipping the header and blank lines)."""
    k = -1
    with _open_text(path) as f:
        for i, line in enumerate(f):
            if i != header_line and line.strip():
                k += 1
                if k == index:
                    return i + 1
    return -1
