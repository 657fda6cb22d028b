"""OGB node-property datasets (ogbn-arxiv, ogbn-products, ogbn-papers100M) from OGB's raw files.

The files are read in OGB's own on-disk layout, through ``ogb``'s own code path::

    <root>/<name with '-' -> '_'>/            e.g. data/ogb/ogbn_arxiv/
        raw/edge.csv.gz, num-node-list.csv.gz, num-edge-list.csv.gz,
            node-feat.csv.gz, node-label.csv.gz          (CSV datasets: arxiv, products)
        raw/data.npz, node-label.npz                      (binary datasets: papers100M)
        split/<split type>/train.csv.gz, valid.csv.gz, test.csv.gz

The metadata (split type, number of classes, ``add_inverse_edge``, whether the raw files
are binary, the download URL) comes from ``ogb.nodeproppred``'s ``master.csv``, and the
graph from ``ogb.io.read_graph_raw``'s readers; labels and split indices are read the way
``NodePropPredDataset`` reads them. ``NodePropPredDataset`` itself is not used: it caches
a processed file that it reloads with ``torch.load`` without ``weights_only`` (refused by
torch >= 2.6), and it asks on stdin before re-downloading.

When the directory is missing and ``download`` is on, OGB's ``download_url`` and
``extract_zip`` fetch it into a temporary directory that is moved into place only when
complete. Offline (this is the normal case on a cluster's compute nodes) the error says
which files are missing, the URL to fetch, and the directory to unpack it into.

Unlabelled nodes (papers100M labels only about 1.5 M of its 111 M nodes: the rest are
NaN) get label 0 and are removed from every split.
"""

from __future__ import annotations

import contextlib
import io as _io
import os
import shutil
import socket
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import OgbConfig
from ..graph import Graph
from ..io import GnnPipeError
from . import build_graph

SUPPORTED = ("ogbn-arxiv", "ogbn-products", "ogbn-papers100M")
DOWNLOAD_TIMEOUT_S = 30.0  # per socket operation: a dead network fails fast, a slow one still works


@dataclass(frozen=True)
class OgbMeta:
    """One column of ``ogb/nodeproppred/master.csv``."""

    name: str  # ogbn-arxiv
    dir_name: str  # ogbn_arxiv (the directory under root)
    download_name: str  # arxiv (the directory inside the zip)
    url: str
    num_tasks: int
    num_classes: int
    task_type: str
    split: str  # split type: the directory under split/
    add_inverse_edge: bool
    binary: bool  # raw files are data.npz / node-label.npz instead of CSVs
    is_hetero: bool
    version: int


def ogb_meta(name: str) -> OgbMeta:
    """The metadata OGB itself uses for dataset ``name``."""
    import pandas as pd
    import ogb.nodeproppred

    master_path = Path(ogb.nodeproppred.__file__).parent / "master.csv"
    master = pd.read_csv(master_path, index_col=0, keep_default_na=False)  # as ogb reads it
    if name not in master:
        raise GnnPipeError(f"dataset.ogb.name: {name!r} is not an OGB node-property dataset "
                           f"(known to ogb: {', '.join(master.keys())})")
    m = master[name]
    meta = OgbMeta(
        name=name, dir_name=name.replace("-", "_"), download_name=m["download_name"], url=m["url"],
        num_tasks=int(m["num tasks"]), num_classes=int(m["num classes"]), task_type=m["task type"],
        split=m["split"], add_inverse_edge=m["add_inverse_edge"] == "True",
        binary=m["binary"] == "True", is_hetero=m["is hetero"] == "True", version=int(m["version"]),
    )
    if meta.is_hetero or meta.num_tasks != 1 or "multiclass" not in meta.task_type:
        raise GnnPipeError(f"dataset.ogb.name: {name} is not a homogeneous single-label node "
                           f"classification dataset; gnnpipe reads {', '.join(SUPPORTED)}")
    return meta


def required_files(meta: OgbMeta) -> list[str]:
    """Paths, relative to the dataset directory, that must exist before loading."""
    raw = (["raw/data.npz", "raw/node-label.npz"] if meta.binary else
           ["raw/edge.csv.gz", "raw/num-node-list.csv.gz", "raw/num-edge-list.csv.gz",
            "raw/node-feat.csv.gz", "raw/node-label.csv.gz"])
    return raw + [f"split/{meta.split}/{part}.csv.gz" for part in ("train", "valid", "test")]


def dataset_dir(cfg: OgbConfig) -> Path:
    return Path(cfg.root) / cfg.name.replace("-", "_")


def load_ogb(cfg: OgbConfig, *, symmetrize: bool, self_loops: str, name: str,
             progress: bool = False) -> Graph:
    """Read ``cfg.name`` from ``cfg.root`` (downloading it first if allowed and missing)."""
    meta = ogb_meta(cfg.name)
    ddir = dataset_dir(cfg)
    missing = _missing(ddir, meta)
    if missing and cfg.download and not _has_any(ddir):
        try:
            download(meta, Path(cfg.root), progress=progress)
        except GnnPipeError as e:
            raise _missing_error(ddir, meta, _missing(ddir, meta), why=str(e)) from None
        missing = _missing(ddir, meta)
    if missing:
        why = ("download is off: dataset.ogb.download is false" if not cfg.download else
               "the directory exists but is incomplete; complete it, or delete it to download again")
        raise _missing_error(ddir, meta, missing, why=why)

    quiet = contextlib.nullcontext() if progress else _silenced()
    with quiet:
        edge_index, features, num_nodes, labels_raw = _read_raw(ddir, meta)
        splits = {part: _read_split(ddir, meta, part) for part in ("train", "valid", "test")}

    n = int(num_nodes)
    if features is None or features.shape[0] != n:
        raise _damaged(ddir, f"node features have {None if features is None else features.shape[0]} "
                             f"rows for {n} nodes")
    labels_raw = np.asarray(labels_raw).reshape(-1)  # OGB stores (N, 1)
    if labels_raw.shape[0] != n or labels_raw.dtype.kind not in "iuf":
        raise _damaged(ddir, f"node-label has {labels_raw.shape[0]} {labels_raw.dtype} entries "
                             f"for {n} nodes")
    if edge_index.size and (edge_index.min() < 0 or edge_index.max() >= n):
        raise _damaged(ddir, f"edge ids outside [0, {n})")

    # NaN marks an unlabelled node (papers100M): label 0, and out of every split below
    labelled = np.isfinite(labels_raw) if labels_raw.dtype.kind == "f" else np.ones(n, dtype=bool)
    labels = np.zeros(n, dtype=np.int64)
    labels[labelled] = labels_raw[labelled].astype(np.int64)
    if np.any(labels[labelled] != labels_raw[labelled]) or np.any(labels < 0) \
            or np.any(labels >= meta.num_classes):
        raise _damaged(ddir, f"labels are not integers in [0, {meta.num_classes})")

    masks = {}
    dropped = {}
    for part, idx in splits.items():
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise _damaged(ddir, f"split/{meta.split}/{part}.csv.gz has node ids outside [0, {n})")
        mask = np.zeros(n, dtype=bool)
        mask[idx] = True
        dropped[part] = int(np.count_nonzero(mask & ~labelled))
        masks[part] = mask & labelled

    params = {
        "ogb_name": meta.name, "root": str(cfg.root), "split": meta.split,
        "add_inverse_edge": meta.add_inverse_edge, "raw_edges": int(edge_index.shape[1]),
        "unlabelled_nodes": int(n - labelled.sum()), "unlabelled_dropped_from_splits": dropped,
    }
    return build_graph(edge_index[0], edge_index[1], features=features, labels=labels,
                       train_mask=masks["train"], val_mask=masks["valid"], test_mask=masks["test"],
                       num_classes=meta.num_classes, symmetrize=symmetrize, self_loops=self_loops,
                       name=name, source=f"ogb:{meta.name}", params=params,
                       already_symmetric=meta.add_inverse_edge)


# --------------------------------------------------------------------------- reading
def _read_raw(ddir: Path, meta: OgbMeta):
    """(edge_index (2, E) int64, node_feat (N, F), num_nodes, labels (N,) or (N, 1))."""
    import pandas as pd
    from ogb.io.read_graph_raw import read_binary_graph_raw, read_csv_graph_raw

    raw = ddir / "raw"
    try:
        if meta.binary:
            graph = read_binary_graph_raw(str(raw), add_inverse_edge=meta.add_inverse_edge)[0]
            with np.load(raw / "node-label.npz") as f:
                labels = f["node_label"]
        else:
            # node_year (arxiv, papers100M) is an extra file ogb can read; gnnpipe does not use it
            graph = read_csv_graph_raw(str(raw), add_inverse_edge=meta.add_inverse_edge)[0]
            labels = pd.read_csv(raw / "node-label.csv.gz", compression="gzip", header=None).values
    except (OSError, EOFError, ValueError, KeyError, RuntimeError, zipfile.BadZipFile,
            pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        raise _damaged(ddir, f"{type(e).__name__}: {e}") from None
    edge_index = np.asarray(graph["edge_index"], dtype=np.int64)
    return edge_index, graph["node_feat"], graph["num_nodes"], labels


def _read_split(ddir: Path, meta: OgbMeta, part: str) -> np.ndarray:
    import pandas as pd

    path = ddir / "split" / meta.split / f"{part}.csv.gz"
    try:  # exactly NodePropPredDataset.get_idx_split's read
        values = pd.read_csv(path, compression="gzip", header=None).values.T[0]
    except (OSError, EOFError, ValueError, pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        raise _damaged(ddir, f"{path.name}: {type(e).__name__}: {e}") from None
    if values.dtype.kind not in "iu":
        raise _damaged(ddir, f"split/{meta.split}/{part}.csv.gz holds non-integer node ids")
    return values.astype(np.int64)


@contextlib.contextmanager
def _silenced():
    """Swallow ogb's prints and tqdm bars (they go to the rule's log only with progress)."""
    sink = _io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


def _missing(ddir: Path, meta: OgbMeta) -> list[str]:
    return [rel for rel in required_files(meta) if not (ddir / rel).is_file()]


def _has_any(ddir: Path) -> bool:
    return ddir.is_dir() and any(ddir.iterdir())


def _missing_error(ddir: Path, meta: OgbMeta, missing: list[str], why: str) -> GnnPipeError:
    shown = ", ".join(missing[:8]) + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else "")
    return GnnPipeError(
        f"{ddir}: OGB dataset {meta.name} is not there ({why}); missing: {shown}. "
        f"On a machine with internet, download {meta.url}, unzip it and move its folder "
        f"'{meta.download_name}' to {ddir} (so that {ddir}/{required_files(meta)[0]} exists), "
        f"or set dataset.ogb.root to a directory that holds {meta.dir_name}/.")


def _damaged(ddir: Path, why: str) -> GnnPipeError:
    return GnnPipeError(f"{ddir}: OGB raw files could not be read ({why}); delete the directory "
                        "and download the dataset again")


# --------------------------------------------------------------------------- download
def download(meta: OgbMeta, root: Path, *, progress: bool = False,
             timeout: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """Fetch and unpack ``meta.url`` into ``root/meta.dir_name`` with OGB's own helpers.

    Everything happens in a temporary directory under ``root``; only a complete, unpacked
    dataset is moved into place. On any failure nothing is left behind (not even ``root``
    if this call created it) and ``GnnPipeError`` says why.
    """
    from ogb.utils.url import download_url, extract_zip

    target = root / meta.dir_name
    created = [p for p in [root, *root.parents] if not p.exists()]
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{meta.dir_name}.download-", dir=root))
    old_timeout = socket.getdefaulttimeout()
    quiet = contextlib.nullcontext() if progress else _silenced()
    try:
        # ogb's download_url calls urlopen without a timeout: the socket default applies.
        socket.setdefaulttimeout(timeout)
        with quiet:
            zip_path = download_url(meta.url, str(tmp), log=progress)
            extract_zip(zip_path, str(tmp), log=progress)
        os.unlink(zip_path)
        unpacked = tmp / meta.download_name
        if not unpacked.is_dir():
            raise GnnPipeError(f"{meta.url}: the archive has no folder {meta.download_name!r}")
        if target.is_dir() and not any(target.iterdir()):
            target.rmdir()
        os.replace(unpacked, target)
        return target
    except GnnPipeError:
        raise
    except (OSError, RuntimeError, ValueError, zipfile.BadZipFile) as e:
        raise GnnPipeError(f"download of {meta.url} failed: {type(e).__name__}: {e}") from None
    finally:
        socket.setdefaulttimeout(old_timeout)
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.exists():
            for p in created:  # innermost first: only directories this call made, if empty
                with contextlib.suppress(OSError):
                    p.rmdir()
