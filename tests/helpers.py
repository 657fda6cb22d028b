"""Builders the test modules share (graphs, blocks, run configs, the Snakemake runner): plain
functions, imported as ``from helpers import ...``; the shared fixtures are in conftest.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import yaml

from gnnpipe.config import load_workflow_config, resolve_runs
from gnnpipe.graph import Graph, csr_from_edges, write_graph
from gnnpipe.models import Block

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / ".test" / "config.yaml"
F64 = torch.float64
TOL = dict(atol=1e-12, rtol=1e-12)


# --------------------------------------------------------------------------- graphs (gnnpipe.graph.Graph)
def make_graph(src, dst, n, *, features=3, classes=3, seed=0, symmetrize=True) -> Graph:
    """A graph with the edges ``src -> dst`` and random features, labels and masks."""
    indptr, indices = csr_from_edges(np.asarray(src), np.asarray(dst), n, symmetrize=symmetrize)
    rng = np.random.default_rng(seed)
    split = rng.integers(0, 3, n)
    return Graph(indptr, indices, rng.normal(size=(n, features)).astype(np.float32),
                 rng.integers(0, classes, n).astype(np.int64), split == 0, split == 1, split == 2,
                 classes, name="test", symmetric=symmetrize)


def random_graph(n=300, avg_degree=8, seed=0, *, local=0.8, symmetrize=True) -> Graph:
    """Mostly-local random edges (so METIS has structure to find) plus random long ones."""
    rng = np.random.default_rng(seed)
    m = n * avg_degree // 2
    dst = rng.integers(0, n, m)
    near = (dst + rng.integers(1, 6, m)) % n
    src = np.where(rng.random(m) < local, near, rng.integers(0, n, m))
    return make_graph(src, dst, n, seed=seed, symmetrize=symmetrize)


def two_community_graph(n=200, seed=0) -> Graph:
    """Two dense communities, weakly linked; features carry a faint class signal."""
    rng = np.random.default_rng(seed)
    labels = (np.arange(n) >= n // 2).astype(np.int64)
    src = rng.integers(0, n, 6 * n)
    same = rng.random(6 * n) < 0.9
    half = n // 2
    dst = np.where(same, (src // half) * half + rng.integers(0, half, 6 * n), rng.integers(0, n, 6 * n))
    indptr, indices = csr_from_edges(src, dst, n)
    x = (rng.normal(size=(n, 8)) + 0.5 * labels[:, None]).astype(np.float32)
    split = rng.permutation(n)
    masks = [np.isin(np.arange(n), split[a:b]) for a, b in ((0, n // 2), (n // 2, 3 * n // 4), (3 * n // 4, n))]
    return Graph(indptr, indices, x, labels, *masks, num_classes=2, name="two")


# --------------------------------------------------------------------------- atoms: the dense neighbour search
def dense_radius_graph(pos, cell, pbc, cutoff: float, max_neighbors: int):
    """The all-pairs × images search the package had before vesin (the oracle of its tests): edges
    ``j -> i`` with ``0 < |pos_i - pos_j - shift| < cutoff``, sorted by (target, distance, source,
    image); each target keeps its ``max_neighbors`` nearest (a per-target cut: not symmetric)."""
    from gnnpipe.atomic.checks import image_range, periodic_heights

    reps = image_range(periodic_heights(cell, pbc), cutoff)
    images = np.array(np.meshgrid(*[np.arange(-r, r + 1) for r in reps], indexing="ij")).reshape(3, -1).T
    shifts = images @ cell  # (K, 3)
    dist = np.linalg.norm(pos[:, None, None, :] - pos[None, :, None, :] - shifts[None, None, :, :], axis=-1)
    i, j, k = np.nonzero((dist < cutoff) & (dist > 1e-8))
    d = dist[i, j, k]
    order = np.lexsort((k, j, d, i))
    i, j, k = i[order], j[order], k[order]
    keep = np.arange(len(i)) - np.searchsorted(i, i) < max_neighbors  # position among the target's
    return j[keep].astype(np.int64), i[keep].astype(np.int64), shifts[k[keep]].astype(np.float64)


# --------------------------------------------------------------------------- CSR and blocks (layers)
def random_csr(n: int, p: float, seed: int, *, symmetric: bool = False, isolated: int = 0):
    """A random in-edge CSR without self loops; the last ``isolated`` nodes have no in-edges."""
    rng = np.random.default_rng(seed)
    adj = rng.random((n, n)) < p
    if symmetric:
        adj = adj | adj.T
    np.fill_diagonal(adj, False)
    if isolated:
        adj[n - isolated:, :] = False  # rows = destinations
    indptr = np.concatenate([[0], np.cumsum(adj.sum(1))]).astype(np.int64)
    indices = np.nonzero(adj)[1].astype(np.int64)
    return indptr, indices


def chunk_splits(indptr, indices, bounds):
    """GNNPipe: ``(block, dst_ids, src_ids)`` per chunk ``[s, e)``, sources = the whole graph."""
    n = len(indptr) - 1
    deg_in, deg_out = np.diff(indptr), np.bincount(indices, minlength=n)
    out = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        blk = Block.from_numpy(indptr[s:e + 1] - indptr[s], indices[indptr[s]:indptr[e]], n, s,
                               deg_in[s:e], deg_out, F64)
        out.append((blk, np.arange(s, e), np.arange(n)))
    return out


def partition_splits(indptr, indices, assign):
    """Graph parallelism: per part, dst = own rows, src = own rows then the halo (offset 0)."""
    n = len(indptr) - 1
    deg_in, deg_out = np.diff(indptr), np.bincount(indices, minlength=n)
    out = []
    for p in np.unique(assign):
        own = np.nonzero(assign == p)[0]
        srcs = [indices[indptr[v]:indptr[v + 1]] for v in own]
        halo = np.setdiff1d(np.concatenate(srcs), own)
        src_ids = np.concatenate([own, halo])
        local = np.full(n, -1)
        local[src_ids] = np.arange(len(src_ids))
        sub_ptr = np.concatenate([[0], np.cumsum([len(s) for s in srcs])])
        sub_idx = local[np.concatenate(srcs)]
        blk = Block.from_numpy(sub_ptr, sub_idx, len(src_ids), 0, deg_in[own], deg_out[src_ids], F64)
        out.append((blk, own, src_ids))
    return out


# --------------------------------------------------------------------------- trained atomic models (stand-ins)
def tiny_atomic_model(systems: dict, kind: str = "dimenetpp", seed: int = 0, dtype: str = "float64",
                      cutoff: float = 4.5, max_neighbors=12, **over):
    """A ``ModelFile`` of a fresh ``small`` model of ``kind``, its normaliser fitted on ``systems``
    (``modelfile.untrained_payload``): what a trained model file carries, without the training."""
    from gnnpipe.atomic.modelfile import decode, untrained_payload
    return decode(untrained_payload(kind, systems, seed=seed, dtype=dtype, cutoff=cutoff,
                                    max_neighbors=max_neighbors, **over), "tiny model")


# --------------------------------------------------------------------------- runs and the workflow
def run_cfg(tmp_path, model, epochs=30, **training):
    wf = load_workflow_config({
        "results": str(tmp_path / "results"),
        "datasets": {"two": {}}, "models": {"m": model},
        "training": {"epochs": epochs, "eval_every": 5, "checkpoint_every": 10, "lr": 0.02, **training},
        "runs": [{"mode": "single", "dataset": "two", "model": "m"}]})
    cfg = next(iter(resolve_runs(wf).values()))
    write_graph(cfg.graph_path, two_community_graph())
    return cfg


def snakemake_command(workdir: Path, configfile: Path, *args: str) -> tuple[list[str], dict]:
    """The command line and environment of Snakemake on this repository's workflow."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for var in ("MLFLOW_TRACKING_URI", "GNNPIPE_EXPERIMENT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(configfile), *args]
    return cmd, env


def snakemake(workdir: Path, configfile: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd, env = snakemake_command(workdir, configfile, *args)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def write_config(tmp_path: Path, edit) -> Path:
    cfg = yaml.safe_load(TINY.read_text())
    edit(cfg)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# --------------------------------------------------------------------------- faults
class _FullFile:
    """A file whose every write fails as on a full disk."""

    def __init__(self, f):
        self._f = f

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def write(self, data):
        import errno

        raise OSError(errno.ENOSPC, "No space left on device")


def full_disk_open(match: str):
    """An ``open`` whose files with ``match`` in their path cannot be written (ENOSPC): patch it
    over ``gnnpipe.io.open`` (``monkeypatch.setattr(gnnpipe.io, "open", ..., raising=False)``)."""
    import builtins

    def fake_open(path, *args, **kwargs):
        f = builtins.open(path, *args, **kwargs)
        return _FullFile(f) if match in str(path) else f
    return fake_open
