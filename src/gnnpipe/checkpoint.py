"""Resumable training state: a rank-sharded checkpoint that counts only once every rank wrote it.

Layout under ``<out_dir>/resume/``::

    epoch-000008/rank-0.pt     each rank's own state (engine.state_dict(): weights, optimizer,
    epoch-000008/rank-1.pt     pipeline buffers ...; its RNG states), written by that rank
    manifest.json              written last, by rank 0, after every shard is on disk
    mlflow.json                the MLflow run this training logs to (kept across resumes)

A checkpoint round: every rank writes its shard atomically (temp + rename) into the
round's directory, the ranks gather the shards' digests (a collective: it is also the
barrier), then rank 0 renames the new manifest over the old one and deletes the older
rounds. A crash at any point leaves the previous manifest, which names only complete
rounds; a rank's shard is never overwritten in place. The manifest carries the run's
fingerprint (``run_fingerprint``, below), the world size, the epochs done, the run's
history so far and the MLflow run id; every shard and the manifest carry a SHA-256 over
their contents, so a flipped bit is refused, not trained on. The fingerprint keeps the config
key by key (version 2), so a refusal names the keys that differ; a manifest of version 1 (its
hash only) resumes while the hash still matches and is refused, saying so, otherwise. The
out_dir must be one file system for all ranks (a shared one across nodes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil
import typing
import zipfile
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from .config import RunConfig, flatten, to_dict
from .graph import read_graph_attrs
from .io import GnnPipeError, empty_file, write_json, write_torch

FORMAT = 1
RESUME_DIR = "resume"
MANIFEST = "manifest.json"
MLFLOW_FILE = "mlflow.json"
FINGERPRINT_KEYS = ("config_hash", "graph_hash", "store_hash", "init_hash")  # in shards and mlflow.json
MANIFEST_FINGERPRINT = ("fingerprint_version", "fingerprint_config", *FINGERPRINT_KEYS)


def resume_dir(out_dir) -> Path:
    return Path(out_dir) / RESUME_DIR


# --------------------------------------------------------------------------- digests, RNG
def digest(obj: Any) -> str:
    """SHA-256 over a nested structure of dicts, lists, tensors and scalars (keys in order)."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def _feed(h, o) -> None:
    if isinstance(o, torch.Tensor):
        t = o.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    elif isinstance(o, dict):
        h.update(b"{")
        for k in sorted(o, key=str):
            h.update(f"{k!r}=".encode())
            _feed(h, o[k])
        h.update(b"}")
    elif isinstance(o, (list, tuple)):
        h.update(b"[")
        for v in o:
            _feed(h, v)
        h.update(b"]")
    else:
        h.update(f"{type(o).__name__}:{o!r};".encode())


def to_cpu(o: Any) -> Any:
    """A copy of ``o`` with every tensor cloned to the CPU (what a shard holds)."""
    if isinstance(o, torch.Tensor):
        return o.detach().to("cpu", copy=True)
    if isinstance(o, dict):
        return {k: to_cpu(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return type(o)(to_cpu(v) for v in o)
    return o


def rng_state(device: torch.device) -> dict:
    """This process's random states: torch CPU (and CUDA), NumPy's and Python's global ones."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    py = random.getstate()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "numpy": [kind, torch.as_tensor(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
            "python": [py[0], list(py[1]), py[2]]}


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))


# --------------------------------------------------------------------------- the world's view
class World:
    """The collectives a checkpoint round needs: gather a small object from every rank."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def gather(self, obj) -> list:
        if self.size == 1:
            return [obj]
        import torch.distributed as dist
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def agree(self, error: Optional[str]) -> None:
        """Raise on every rank if any rank failed (so that no rank waits for a peer that gave up)."""
        errors = [(r, e) for r, e in enumerate(self.gather(error)) if e]
        if errors:
            r, e = errors[0]
            raise GnnPipeError(e if r == self.rank or self.size == 1 else f"rank {r}: {e}")


# --------------------------------------------------------------------------- save
def save(out_dir, world: World, engine, device, *, epochs_done: int, fingerprint: dict, run_id: str,
         history: list, mlflow_run_id: Optional[str]) -> None:
    """One checkpoint round (every rank calls it): shards, the digests' gather, the manifest."""
    root = resume_dir(out_dir)
    name = f"epoch-{epochs_done:06d}"
    shard = {"format": FORMAT, "rank": world.rank, "world_size": world.size, "epochs_done": epochs_done,
             **{k: fingerprint.get(k) for k in FINGERPRINT_KEYS},
             "state": to_cpu(engine.state_dict()), "rng": rng_state(device)}
    shard["digest"] = digest(shard)
    # every rank stops, with the line of the rank that failed, if a shard cannot be written (a
    # full disk): none waits for a peer that gave up; the previous round stays the one to resume
    world.agree(_written(lambda: write_torch(root / name / f"rank-{world.rank}.pt", shard)))
    digests = world.gather(shard["digest"])  # every shard is on disk once this returns
    manifest = {"format": FORMAT, "run_id": run_id, "epochs_done": epochs_done, "world_size": world.size,
                "dir": name, "shards": digests, **{k: fingerprint.get(k) for k in MANIFEST_FINGERPRINT},
                "mlflow_run_id": mlflow_run_id, "history": history}
    manifest["digest"] = digest(manifest)
    world.agree(_written(lambda: write_json(root / MANIFEST, manifest)) if world.rank == 0 else None)
    if world.rank != 0:
        return
    for old in root.glob("epoch-*"):  # rounds no manifest names any more
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)


def _written(write) -> Optional[str]:
    """Run ``write``; the one-line reason it could not write (None: written)."""
    try:
        write()
    except GnnPipeError as e:
        return str(e)
    return None


# --------------------------------------------------------------------------- load
def unreadable(path, e: Exception) -> str:
    """Why ``torch.load(weights_only=True)`` refused ``path``, in a few words: never torch's own
    message, which is many lines and advises loading the file unsafely (``weights_only=False``). An empty
    file is refused before it is loaded (``io.empty_file``)."""
    if not zipfile.is_zipfile(path):
        return "not a torch file"
    return f"holds more than tensors and plain types, or is damaged ({type(e).__name__})"


def _refusal(path: Path, why: str) -> str:
    return (f"{path}: {why}; to discard it and train from epoch 0, rerun with `gnnpipe train --restart` "
            f"(or GNNPIPE_RESTART=1, e.g. under Snakemake)")


def read_manifest(out_dir) -> Optional[dict]:
    """The last complete checkpoint's manifest, None when there is none; damage is an error."""
    path = resume_dir(out_dir) / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
        ok = isinstance(manifest, dict) and manifest.pop("digest", None) == digest(manifest)
    except (ValueError, UnicodeDecodeError) as e:
        raise GnnPipeError(_refusal(path, f"not readable ({e})")) from None
    if not ok:
        raise GnnPipeError(_refusal(path, "its digest does not match its contents (damaged or edited)"))
    return manifest


def check_manifest(manifest: dict, out_dir, *, cfg, fingerprint: dict, world_size: int, epochs: int) -> None:
    """Refuse a checkpoint of another run: other config (the keys named), graph, chunk store or
    world size."""
    path = resume_dir(out_dir) / MANIFEST
    if manifest.get("format") != FORMAT:
        raise GnnPipeError(_refusal(path, f"checkpoint format {manifest.get('format')}, this gnnpipe "
                                          f"reads {FORMAT}"))
    why = fingerprint_mismatch(manifest, cfg, fingerprint)
    if why:
        raise GnnPipeError(_refusal(path, f"a checkpoint of {why}"))
    if manifest["world_size"] != world_size:
        raise GnnPipeError(_refusal(path, f"written by {manifest['world_size']} workers, this run has "
                                          f"{world_size}"))
    if not 0 < manifest["epochs_done"] < epochs:
        raise GnnPipeError(_refusal(path, f"after {manifest['epochs_done']} epochs, the run has {epochs}"))


def load_shard(out_dir, manifest: dict, rank: int) -> dict:
    """This rank's shard of the manifest's round, its digest checked against both records."""
    path = resume_dir(out_dir) / manifest["dir"] / f"rank-{rank}.pt"
    if empty_file(path):
        raise GnnPipeError(_refusal(path, "empty (0 bytes: a write cut short?), not a checkpoint"))
    try:
        shard = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise GnnPipeError(_refusal(path, "missing (is the out_dir on a file system every node "
                                          "shares?)")) from None
    except Exception as e:  # unpickling errors, a truncated or flipped zip
        raise GnnPipeError(_refusal(path, f"not a readable checkpoint ({unreadable(path, e)})")) from None
    want = shard.pop("digest", None) if isinstance(shard, dict) else None
    if want is None or want != digest(shard) or want != manifest["shards"][rank]:
        raise GnnPipeError(_refusal(path, "its digest does not match its contents or the manifest "
                                          "(damaged, edited, or from another round)"))
    return shard


def resume(out_dir, world: World, engine, device, *, cfg, fingerprint: dict, epochs: int,
           restart: bool) -> Optional[dict]:
    """Every rank: restore the last complete checkpoint into ``engine`` and the RNGs; return
    its manifest (None: train from epoch 0). ``restart`` discards whatever is there.
    Every rank raises if any rank cannot resume (with that rank's reason)."""
    root = resume_dir(out_dir)
    if restart:
        if world.rank == 0 and root.exists():
            shutil.rmtree(root)
        world.gather(None)  # nobody reads while rank 0 deletes
        return None
    manifest, error = None, None
    try:
        manifest = read_manifest(out_dir)
        if manifest is not None:
            check_manifest(manifest, out_dir, cfg=cfg, fingerprint=fingerprint, world_size=world.size, epochs=epochs)
            shard = load_shard(out_dir, manifest, world.rank)
            try:
                engine.load_state_dict(shard["state"])
            except (RuntimeError, KeyError, ValueError) as e:
                raise GnnPipeError(_refusal(root / manifest["dir"], f"rank {world.rank}'s shard does not "
                                            f"fit the engine: {' '.join(str(e).split())[:300]}")) from None
            set_rng_state(shard["rng"], device)
    except GnnPipeError as e:
        error = str(e)
    world.agree(error)
    return manifest


# --------------------------------------------------------------------------- the MLflow run id
def read_mlflow_id(out_dir, fingerprint: Optional[dict]) -> Optional[str]:
    """The MLflow run an earlier attempt of this run (same fingerprint; None: any) logged to."""
    path = resume_dir(out_dir) / MLFLOW_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if fingerprint is not None and any(data.get(k) != fingerprint.get(k) for k in FINGERPRINT_KEYS):
        return None
    return data.get("run_id")


def write_mlflow_id(out_dir, fingerprint: dict, run_id: str) -> None:
    write_json(resume_dir(out_dir) / MLFLOW_FILE,
               {"run_id": run_id, **{k: fingerprint.get(k) for k in FINGERPRINT_KEYS}})


def note_unrecorded_failure(out_dir, error: str) -> None:
    """Keep the reason a failed attempt could not write into its MLflow run (the store was
    unreachable or on the full disk) for the next attempt to record; best effort."""
    path = resume_dir(out_dir) / MLFLOW_FILE
    try:
        data = json.loads(path.read_text())
        write_json(path, {**data, "unrecorded_error": error})
    except (OSError, ValueError, GnnPipeError):
        pass


def read_unrecorded_failure(out_dir) -> Optional[str]:
    try:
        return json.loads((resume_dir(out_dir) / MLFLOW_FILE).read_text()).get("unrecorded_error")
    except (OSError, ValueError, AttributeError):
        return None


def finish(out_dir) -> None:
    """The run is complete (model.pt and metrics.json written): its resume state is dropped."""
    shutil.rmtree(resume_dir(out_dir), ignore_errors=True)


# --------------------------------------------------------------------------- the run's fingerprint
def load_checkpoint(path: str | Path) -> dict:
    """A checkpoint written by the trainer, loaded safely (``weights_only=True``)."""
    if empty_file(path):
        raise GnnPipeError(f"{path}: empty (0 bytes: a write cut short?), not a checkpoint; delete it and re-run "
                           "'train'")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise GnnPipeError(f"{path}: no checkpoint; run the 'train' rule for this run first") from None
    except Exception as e:  # unpickling errors, truncated zip
        raise GnnPipeError(f"{path}: not a readable checkpoint ({unreadable(path, e)}); delete it and re-run "
                           "'train'") from None
    want = state.pop("digest", None) if isinstance(state, dict) else None
    if want is not None and want != digest(state):
        raise GnnPipeError(f"{path}: its digest does not match its contents (damaged or edited); delete it "
                           f"and re-run 'train'")
    return state


_PATHS = ("graph_path", "store_path", "out_dir", "systems_path", "locality_path")  # where the run lies, not what it is
# How a run is kept alive and how often its state is saved, not what it computes: left out of
# the fingerprint, so changing them never refuses a checkpoint. Version 1 (gnnpipe before the
# fingerprint named keys) left out only the first two; a version is never changed, only added.
_OPERATIONAL = {1: ("dist_timeout_s", "max_restarts"), 2: ("dist_timeout_s", "max_restarts", "checkpoint_every")}
FINGERPRINT_VERSION = 2


def _fingerprinted(conf: dict, version: int) -> dict:
    """A run config as plain data (``to_dict``), less what fingerprint ``version`` leaves out."""
    conf = {k: v for k, v in conf.items() if k not in _PATHS}
    conf["training"] = {k: v for k, v in conf.get("training", {}).items() if k not in _OPERATIONAL[version]}
    return conf


def _hash(conf: dict) -> str:
    return hashlib.sha256(json.dumps(conf, sort_keys=True).encode()).hexdigest()


def _defaults() -> dict:
    """The flattened defaults of a run config's keys (a key newer than a checkpoint matches it at
    its default: adding a key to the config does not throw users' checkpoints away)."""
    hints, out = typing.get_type_hints(RunConfig), {}
    for f in dataclasses.fields(RunConfig):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(flatten(to_dict(hints[f.name]()), f"{f.name}."))
        elif f.default is not dataclasses.MISSING:
            out[f.name] = f.default
    return out


def _content_hash(path, rule: str) -> str:
    """The ``content_hash`` attribute of an HDF5 file (cheap); an unreadable file is one line
    naming it and the rule that rebuilds it."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            return str(f.attrs.get("content_hash", ""))
    except OSError as e:  # missing, truncated, not HDF5
        raise GnnPipeError(f"{path}: not a readable HDF5 file ({' '.join(str(e).split())[:200]}); delete it "
                           f"and rerun the workflow (rule {rule} rebuilds it)") from None


def _graph_hash(cfg: RunConfig):
    """The content hash of the run's graph file: graph.h5, or an atomic run's graphs.h5 (which
    records the hash of its systems.h5 in turn)."""
    if not cfg.graph_path:
        return None
    if cfg.atomic:
        return _content_hash(cfg.graph_path, "atom_graphs")
    return str(read_graph_attrs(cfg.graph_path)["content_hash"])


def _init_hash(cfg: RunConfig) -> Optional[str]:
    """The SHA-256 of the model file an atomic run starts from (``models.<name>.init_from``), None
    without one (or when it is gone: a finished model is used without it). The config names the file,
    not its content: a file replaced under the same name must not resume a checkpoint of the old one."""
    init = getattr(cfg.model, "init_from", None)
    if not init or not Path(init).is_file():
        return None
    h = hashlib.sha256()
    with open(init, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def run_fingerprint(cfg: RunConfig, *, init: bool = True) -> dict:
    """What a checkpoint must have been trained from: the config less its paths and operational
    keys (key by key, and hashed), the content hashes of the graph and (parallel modes) the chunk
    store, read from their attributes (cheap), and of the model file the run starts from
    (``init_from``, hashed whole; ``init=False``: not read, None — a model file does not record it).
    Every checkpoint carries it; ``fingerprint_mismatch`` compares."""
    conf = _fingerprinted(to_dict(cfg), FINGERPRINT_VERSION)
    fp = {"fingerprint_version": FINGERPRINT_VERSION, "fingerprint_config": conf, "config_hash": _hash(conf),
          "graph_hash": _graph_hash(cfg), "store_hash": None, "init_hash": _init_hash(cfg) if init else None}
    if cfg.store_path and Path(cfg.store_path).exists():
        fp["store_hash"] = _content_hash(cfg.store_path, "materialize")
    return fp


def config_differences(stored: dict, cfg: RunConfig) -> list[str]:
    """The keys of a stored run config (``to_dict`` form, as a checkpoint keeps it) that differ from
    ``cfg`` now, as ``key old -> new``; paths and operational keys do not count, nor a key newer
    than the checkpoint that has its default."""
    old = flatten(_fingerprinted(stored, FINGERPRINT_VERSION))
    now = flatten(_fingerprinted(to_dict(cfg), FINGERPRINT_VERSION))
    defaults = _defaults()
    out = []
    for key in sorted(set(old) | set(now)):
        if key not in old:
            if key not in defaults or now[key] != defaults[key]:
                out.append(f"{key} (new) {now[key]!r}")
        elif key not in now:
            out.append(f"{key} {old[key]!r} -> (no such key now)")
        elif old[key] != now[key]:
            out.append(f"{key} {old[key]!r} -> {now[key]!r}")
    return out


def fingerprint_mismatch(stored: dict, cfg: RunConfig, now: dict | None = None) -> str | None:
    """Why a checkpoint (its fingerprint fields, ``stored``) is not of run ``cfg`` as it is now:
    ``"another config: training.lr 0.02 -> 0.05"``, another graph or chunk store; None: it is.
    A checkpoint of gnnpipe before fingerprint v2 carries its config whole (``model.pt``:
    compared key by key) or only its v1 hash (a resume manifest: equal, or a refusal that says so);
    an atomic model file carries only its hash, of either version."""
    now = now or run_fingerprint(cfg)
    conf = stored.get("fingerprint_config", stored.get("config"))
    if isinstance(conf, dict):
        diff = config_differences(conf, cfg)
        if diff:
            return f"another config: {'; '.join(diff[:4])}{f' and {len(diff) - 4} more' if len(diff) > 4 else ''}"
    elif stored.get("config_hash") not in {_hash(_fingerprinted(to_dict(cfg), v)) for v in _OPERATIONAL}:
        return (f"another config, or one of gnnpipe before fingerprint v2, which cannot name the keys that "
                f"differ (config_hash {str(stored.get('config_hash'))[:12]})")
    for key, what in (("graph_hash", "graph"), ("store_hash", "chunk store"),
                      ("init_hash", f"model file to start from ({cfg.model.init_from}, models.<name>.init_from)")):
        if stored.get(key) and now.get(key) and stored[key] != now[key]:
            return f"another {what} ({key} {stored[key][:12]}, the run's is now {now[key][:12]})"
    return None


def check_checkpoint(state: dict, cfg: RunConfig, path: Path, *, final: bool = True) -> None:
    """Refuse a checkpoint that is not this run's (``check_model_identity``) or not its finished
    model (``final``)."""
    redo = f"re-run 'train' for {cfg.run_id} (delete {path}, or snakemake --forcerun train)"
    if "config_hash" not in state:
        raise GnnPipeError(f"{path}: the checkpoint does not say which config and data it was trained "
                           f"from (an older gnnpipe wrote it); {redo}")
    check_model_identity(state, cfg, path, without_data=False)
    done = int(state.get("epochs_done", -1))
    if final and done != cfg.training.epochs:
        raise GnnPipeError(f"{path}: checkpoint after {done} of {cfg.training.epochs} epochs, not the "
                           f"finished run (training was cut short?); {redo}")


def _data_fingerprint(cfg: RunConfig) -> dict:
    """``run_fingerprint`` with the hash of a data file that is gone left out (None): a finished
    model is used without its data (inference), and is checked against what is still there."""
    present = {k: getattr(cfg, k) if getattr(cfg, k) and Path(getattr(cfg, k)).is_file() else None
               for k in ("graph_path", "store_path")}
    return run_fingerprint(dataclasses.replace(cfg, **present), init=False)


def check_model_identity(state: dict, cfg: RunConfig, path, *, without_data: bool = True) -> None:
    """Refuse a model (a checkpoint's fields, or an atomic model file's ``run_id`` and
    ``fingerprint``) that is not run ``cfg``'s: another run's (run id and model kind named), or
    this run's trained from another config, graph or chunk store than ``cfg`` names now. One line
    naming both. ``without_data``: the data are compared where the run's files still exist (a
    finished model is used without them); else a missing data file is refused."""
    theirs = state.get("run_id")
    kind = ((state.get("config") or state.get("fingerprint_config") or {}).get("model") or {}).get("kind") \
        or state.get("kind")
    if theirs is not None and theirs != cfg.run_id:
        raise GnnPipeError(f"{path}: the model of run {theirs}{f' ({kind})' if kind else ''}, not of run "
                           f"{cfg.run_id} ({cfg.model.kind}) that it was asked for; put run {cfg.run_id}'s own "
                           f"model there, or re-run 'train' for {cfg.run_id}")
    if kind and kind != cfg.model.kind:
        raise GnnPipeError(f"{path}: a {kind} model, but run {cfg.run_id} is a {cfg.model.kind} run; put run "
                           f"{cfg.run_id}'s own model there, or re-run 'train' for {cfg.run_id}")
    if state.get("config_hash") is None and not isinstance(state.get("config"), dict):
        return  # a model file that does not say what it was trained from: its run id and kind are all
    why = fingerprint_mismatch(state, cfg, _data_fingerprint(cfg) if without_data else None)
    if why:
        raise GnnPipeError(f"{path}: trained from {why} (run {cfg.run_id} as it is now); re-run 'train' for "
                           f"{cfg.run_id} (delete {path}, or snakemake --forcerun train)")
