"""The model file of a trained atomic model: everything inference needs, and nothing that needs the data.

A finished atomic run's model must be usable without ``systems.h5`` and ``graphs.h5``: the
energy normaliser, the cutoff and neighbour cap the graphs were built with and the elements
seen in training go with the weights. The **payload** is a nested dict of plain types and
tensors (``torch.load(weights_only=True)`` reads it)::

    {"format": "gnnpipe-atomic-model", "format_version": 2,
     "kind": "dimenetpp",                      # ATOMIC_MODELS[kind]
     "model_config": {...},                    # dataclasses.asdict of the kind's config
     "cutoff": 4.5, "max_neighbors": 12,       # the radius graph: Å, nearest per target (None: no cap)
     "symmetric_edges": False,                 # True: atomic.neighbors' symmetric graph + id_swap;
                                               # False: atomic.data's per-target cut (today's graphs.h5)
     "neighbors": "project",                   # the cap's convention (atomic.neighbors): project or
                                               # fairchem (fairchem's graph: its GemNet's, or symmetric_edges
                                               # False, its DimeNet++'s); format 2 (format 1: project)
     "normalizer": {"e_ref": (95,) float64 tensor, "scale": float,    # E = scale·y + mean + Σ e_ref[z]
                    "mean": float, "force_scale": float},              # F = force_scale·f
                                               # (mean, force_scale: optional, default 0 and scale;
                                               # fairchem's per-structure energy mean and force std)
     "elements": [1, 6, 29, ...],              # atomic numbers in the training split
     "dtype": "float32",                       # the dtype it was trained in
     "fingerprint": {...} or None,             # the run's fingerprint (what it was trained from)
     "run_id": "..." or None,
     "state_dict": {name: tensor},
     "origin": {...} or None,                  # an imported model's provenance (atomic.fairchem):
                                               # from, checkpoint, model, weights, energy (what its
                                               # energies are), ignored/unfitted scale factors, ...
     "energy_reference": "total" or ...}       # what its energies are (ENERGY_REFERENCES); optional:
                                               # absent (files before it, data of unknown kind): unknown

It is stored either alone (``save_model_file``: a *bare* model file, with a digest) or under the
key ``"inference"`` of the trainer's checkpoint (``model.pt``). :func:`load_model_file` accepts a
run directory (its ``model.pt``), a checkpoint holding the payload, or a bare model file, and
refuses anything else in one line that says what to do: a missing path, a file that is not a
checkpoint, a checkpoint of a node-level run, a partial (intermediate) checkpoint, a model.pt of
an older gnnpipe (weights only: :func:`upgrade_run` rebuilds its payload from the run's data
files), an unknown kind, a format version this gnnpipe does not read. Format 1 (before
``neighbors``) is read as ``neighbors: project``, the only convention there was.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..io import GnnPipeError, atomic_path, empty_file

FORMAT = "gnnpipe-atomic-model"
FORMAT_VERSION = 2  # 2: neighbors (the neighbour convention)
OLDEST_VERSION = 1  # 1: neighbors absent, read as project
PAYLOAD_KEY = "inference"  # where a checkpoint (model.pt) holds the payload
MODEL_FILE = "model.pt"  # the finished model in a run directory
RUN_FILE = "run.yaml"  # the run's config in a run directory (the workflow writes it)
UPGRADED_FILE = "model-v1.pt"  # upgrade_run's model file beside an older run's model.pt
NUM_ELEMENTS = 95  # rows of e_ref: Z = 0..94 (atomic.data.MAX_Z)
#: what a model file's energies can be (``energy_reference``; None: unknown)
ENERGY_REFERENCES = ("oc20-adsorption", "total")
_REQUIRED = ("kind", "model_config", "cutoff", "max_neighbors", "symmetric_edges", "normalizer", "elements",
             "dtype", "state_dict")


@dataclass
class ModelFile:
    """A decoded payload (see the module docstring); ``build()`` gives the kind's ``nn.Module``."""

    kind: str
    model_config: dict
    cutoff: float
    max_neighbors: Optional[int]
    symmetric_edges: bool
    e_ref: np.ndarray  # (95,) eV per atom of each element
    scale: float
    elements: tuple[int, ...]
    dtype: str
    state_dict: dict
    fingerprint: Optional[dict] = None
    run_id: Optional[str] = None
    source: str = ""  # where it was loaded from (error messages)
    neighbors: str = "project"  # the neighbour cap's convention (atomic.neighbors)
    mean: float = 0.0  # eV per structure added to every energy (fairchem's energy normaliser mean)
    force_scale: Optional[float] = None  # F = force_scale·f (None: scale)
    origin: Optional[dict] = None  # provenance of an imported model (atomic.fairchem), else None
    energy_reference: Optional[str] = None  # ENERGY_REFERENCES, None: unknown

    @property
    def energies(self) -> str:
        """What its energies are, in words for a summary line (``energy_reference``, or unknown)."""
        return energy_words(self.energy_reference)

    def normalizer(self):
        """The ``atomic.atomic_engine.Normalizer`` of this model's outputs (energies and forces in eV, eV/Å)."""
        from .atomic_engine import Normalizer
        return Normalizer(self.e_ref, self.scale, self.mean, self.force_scale)

    @property
    def spec(self):
        """The kind's registry entry (``AtomicModelKind``)."""
        from .protocol import ATOMIC_MODELS
        return ATOMIC_MODELS[self.kind]

    def config(self):
        """The kind's config dataclass, from ``model_config``."""
        known = set(self.spec.config_fields())
        extra = sorted(set(self.model_config) - known)
        if extra:
            raise GnnPipeError(f"{self.source}: model_config has field(s) {', '.join(extra)} that {self.kind} of this "
                               "gnnpipe does not know (written by a newer gnnpipe?); upgrade gnnpipe")
        return self.spec.config(**self.model_config)

    def build(self, device="cpu", dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
        """The model with its weights, in eval mode, on ``device`` in ``dtype`` (default: its own)."""
        from ..engine import DTYPES
        dtype = dtype or DTYPES[self.dtype]
        model = self.spec.build(self.config()).to(dtype=dtype)  # before the weights: float64 ones stay exact
        try:
            model.load_state_dict(self.state_dict)
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GnnPipeError(f"{self.source}: the weights do not fit a {self.kind} of its model_config ({first}); "
                               "the model file is damaged or was edited") from None
        return model.to(device=device).eval()

    def payload(self) -> dict:
        return make_payload(kind=self.kind, model_config=self.model_config, state_dict=self.state_dict,
                            cutoff=self.cutoff, max_neighbors=self.max_neighbors, neighbors=self.neighbors,
                            symmetric_edges=self.symmetric_edges, e_ref=self.e_ref, scale=self.scale,
                            elements=self.elements, dtype=self.dtype, fingerprint=self.fingerprint,
                            run_id=self.run_id, mean=self.mean, force_scale=self.force_scale, origin=self.origin,
                            energy_reference=self.energy_reference)


# --------------------------------------------------------------------------- writing
def make_payload(*, kind: str, model_config, state_dict: dict, cutoff: float, max_neighbors: Optional[int],
                 symmetric_edges: bool, e_ref, scale: float, elements, dtype: str,
                 fingerprint: Optional[dict] = None, run_id: Optional[str] = None, neighbors: str = "project",
                 mean: float = 0.0, force_scale: Optional[float] = None, origin: Optional[dict] = None,
                 energy_reference: Optional[str] = None) -> dict:
    """The payload dict (plain types + CPU tensors). ``model_config``: the kind's config dataclass
    or a dict of its fields. ``mean``, ``force_scale``, ``origin`` and ``energy_reference`` are
    written only when given (not 0, None), so a payload without them is what it was."""
    from ..config import NEIGHBOR_CONVENTIONS
    from .protocol import ATOMIC_MODELS
    ATOMIC_MODELS[kind]  # noqa: B018 - an unknown kind is an error here, not when loading
    if neighbors not in NEIGHBOR_CONVENTIONS:
        raise ValueError(f"neighbors must be one of {', '.join(NEIGHBOR_CONVENTIONS)}, got {neighbors!r}")
    if energy_reference is not None and energy_reference not in ENERGY_REFERENCES:
        raise ValueError(f"energy_reference must be one of {', '.join(ENERGY_REFERENCES)} or None, got "
                         f"{energy_reference!r}")
    if dataclasses.is_dataclass(model_config):
        model_config = dataclasses.asdict(model_config)
    e_ref = torch.as_tensor(np.asarray(e_ref, dtype=np.float64))
    if e_ref.shape != (NUM_ELEMENTS,):
        raise ValueError(f"e_ref must have {NUM_ELEMENTS} rows (Z = 0..94), got shape {tuple(e_ref.shape)}")
    norm = {"e_ref": e_ref, "scale": float(scale)}
    if mean:
        norm["mean"] = float(mean)
    if force_scale is not None:
        norm["force_scale"] = float(force_scale)
    payload = {"format": FORMAT, "format_version": FORMAT_VERSION, "kind": kind, "model_config": dict(model_config),
               "cutoff": float(cutoff), "max_neighbors": None if max_neighbors is None else int(max_neighbors),
               "symmetric_edges": bool(symmetric_edges), "neighbors": neighbors, "normalizer": norm,
               "elements": sorted(int(z) for z in set(np.asarray(elements).ravel().tolist())),
               "dtype": str(dtype), "fingerprint": dict(fingerprint) if fingerprint else None, "run_id": run_id,
               "state_dict": {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()}}
    if origin is not None:
        payload["origin"] = dict(origin)
    if energy_reference is not None:
        payload["energy_reference"] = energy_reference
    return payload


def energy_words(reference: Optional[str]) -> str:
    """``energy_reference`` for a summary line: the name, or ``unknown``."""
    return reference or "unknown"


def data_energy_reference(source: str) -> Optional[str]:
    """What the energies of ``systems.h5`` are, from its ``source`` (``atomic.data``): generated data,
    ASE's EMT totals; an OC20 S2EF folder, as read (``s2ef energy=referenced``: adsorption energies);
    a user's file (extxyz, ASE db, ASE-LMDB): None, unknown."""
    if source.startswith("generated:ase-emt"):
        return "total"
    if "(s2ef energy=referenced)" in source:
        return "oc20-adsorption"
    if "(s2ef energy=total)" in source:
        return "total"
    return None


def kind_of(model_config) -> str:
    """The registered kind whose config class ``model_config`` is an instance of."""
    from .protocol import ATOMIC_MODELS
    for name, spec in ATOMIC_MODELS.items():
        if isinstance(model_config, spec.config):
            return name
    raise ValueError(f"{type(model_config).__name__} is the config of no registered atomic model kind")


def payload_from_engine(engine, fingerprint: Optional[dict] = None, state_dict: Optional[dict] = None) -> dict:
    """The payload of an ``atomic.atomic_engine.AtomicEngine``'s model as trained (the trainer calls it
    on rank 0 after the last epoch and stores it under ``"inference"`` in ``model.pt``, with the
    weights it saves there as ``state_dict``; default: the engine's ``full_state_dict()``)."""
    systems, graphs, init = engine.systems, engine.graphs, engine.init
    ptr, train = systems["atom_ptr"], engine.ids["train"]
    elements = np.unique(np.concatenate([systems["z"][ptr[s]:ptr[s + 1]] for s in train])) if len(train) else []
    if init is not None:  # fine-tuned: the graphs are the model file's (check_init_graphs), its elements stay known
        elements = np.union1d(elements, init.elements)
        graph = {"cutoff": init.cutoff, "max_neighbors": init.max_neighbors, "neighbors": init.neighbors,
                 "symmetric_edges": init.symmetric_edges}
    else:
        graph = {"cutoff": float(graphs["cutoff"]), "max_neighbors": int(graphs["max_neighbors"]),
                 "neighbors": graphs.get("neighbors", "project"),
                 "symmetric_edges": bool(graphs.get("symmetric_edges", False))}
    norm = engine.norm
    return make_payload(kind=kind_of(engine.model_cfg), model_config=engine.model_cfg,
                        state_dict=engine.full_state_dict() if state_dict is None else state_dict, **graph,
                        e_ref=norm.e_ref, scale=norm.scale, elements=elements,
                        dtype=engine.cfg.training.dtype, fingerprint=fingerprint, run_id=engine.cfg.run_id,
                        mean=norm.mean, force_scale=norm.force_scale if norm.force_scale != norm.scale else None,
                        energy_reference=data_energy_reference(str(systems.get("source", ""))))


def untrained_payload(kind: str, systems: dict, *, preset: str = "small", seed: int = 0, dtype: str = "float64",
                      cutoff: float = 4.5, max_neighbors: Optional[int] = 12, neighbors: str = "project",
                      **over) -> dict:
    """The payload of a *fresh* model of ``kind`` with a normaliser fitted on the training split of
    ``systems`` (``atomic.data`` arrays), for tests, benchmarks and demos. Parameters that their
    initialisation leaves at zero (DimeNet++'s output layers) are drawn from N(0, 0.1²), so that
    energies and forces are not trivially the reference energies and zero."""
    from .atomic_engine import Normalizer
    from .protocol import ATOMIC_MODELS

    spec = ATOMIC_MODELS[kind]
    cfg = spec.preset(preset, cutoff=cutoff, **over)
    torch.manual_seed(seed)
    model = spec.build(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.normal_(0.0, 0.1)
    train = np.nonzero(systems["split"] == 0)[0]
    norm = Normalizer.fit(systems["z"], systems["atom_ptr"], systems["energy"], train)
    return make_payload(kind=kind, model_config=cfg, state_dict=model.state_dict(), cutoff=cutoff,
                        max_neighbors=max_neighbors, symmetric_edges=True, e_ref=norm.e_ref,  # as graphs.h5 v2
                        scale=norm.scale, elements=systems["z"], dtype=dtype, neighbors=neighbors)


def save_model_file(path, payload: dict) -> Path:
    """Write a bare model file (the payload and its digest), atomically (temp + rename)."""
    from ..checkpoint import digest
    decode(payload, str(path))  # refuse to write what could not be read back
    body = {**payload, "digest": digest(payload)}
    with atomic_path(path, ".pt") as tmp:
        torch.save(body, tmp)
    return Path(path)


# --------------------------------------------------------------------------- reading
def load_model_file(path, run=None) -> ModelFile:
    """A run directory (its ``model.pt``, or the ``model-v1.pt`` that :func:`upgrade_run` wrote
    beside an older one), a checkpoint holding the payload, or a bare model file.

    ``run``: the run (``RunConfig``) the model is asked for; default, for a run directory, its
    ``run.yaml`` if it has one. A model that is not that run's (another run id or model kind, or
    trained from another config or data: ``checkpoint.check_model_identity``) is refused in one
    line naming both."""
    path = Path(path)
    if path.is_dir():
        if run is None and (path / RUN_FILE).is_file():
            from ..config import load_run_config
            run = load_run_config(path / RUN_FILE)
        file = path / MODEL_FILE
        if not file.is_file():
            partial = " (it has an intermediate checkpoint.pt: training has not finished)" \
                if (path / "checkpoint.pt").is_file() else ""
            raise GnnPipeError(f"{path}: no {MODEL_FILE} in this run directory{partial}; train the run to the end "
                               "first (gnnpipe train writes model.pt after its last epoch)")
        state = _read(file)
        if isinstance(state, dict) and "format" not in state and PAYLOAD_KEY not in state \
                and (path / UPGRADED_FILE).is_file():
            return load_model_file(path / UPGRADED_FILE, run)
        return _decode_file(state, file, run)
    if not path.exists():
        raise GnnPipeError(f"{path}: no such run directory or model file")
    return _decode_file(_read(path), path, run)


def _read(path: Path):
    """``torch.load(weights_only=True)``; its digest (if any) checked; one-line errors."""
    from ..checkpoint import digest, unreadable
    if empty_file(path):
        raise GnnPipeError(f"{path}: empty (0 bytes: a write cut short?), not a gnnpipe model file; write it again "
                           "or retrain")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling errors, truncated zips, not a torch file at all
        raise GnnPipeError(f"{path}: not a gnnpipe model file or checkpoint ({unreadable(path, e)})") from None
    want = state.pop("digest", None) if isinstance(state, dict) else None
    if want is not None and want != digest(state):
        raise GnnPipeError(f"{path}: its digest does not match its contents (damaged or edited); write it again "
                           "or retrain")
    return state


def _decode_file(state, path: Path, run=None) -> ModelFile:
    if not isinstance(state, dict):
        raise GnnPipeError(f"{path}: not a gnnpipe model file (holds a {type(state).__name__}, not a dict)")
    if run is not None:  # whose model it is comes before whether it is finished
        from ..checkpoint import check_model_identity
        bare = "format" in state and PAYLOAD_KEY not in state
        check_model_identity({"run_id": state.get("run_id"), "kind": state.get("kind"),
                              **(state.get("fingerprint") or {})} if bare else state, run, path)
    if "format" in state and PAYLOAD_KEY not in state:
        return decode(state, str(path))
    _refuse_unfinished(state, path)
    if PAYLOAD_KEY in state:
        return decode(state[PAYLOAD_KEY], str(path))
    raise GnnPipeError(_legacy_message(state, path))


def _refuse_unfinished(state: dict, path: Path) -> None:
    epochs = ((state.get("config") or {}).get("training") or {}).get("epochs")
    done = state.get("epochs_done")
    if epochs is not None and done is not None and int(done) != int(epochs):
        raise GnnPipeError(f"{path}: a partial checkpoint (after {done} of {epochs} epochs), not a finished model; "
                           f"use the run's {MODEL_FILE} once training has finished")


def _legacy_message(state: dict, path: Path) -> str:
    from .protocol import ATOMIC_MODELS
    kind = ((state.get("config") or {}).get("model") or {}).get("kind")
    if "model" not in state or "config" not in state:
        return f"{path}: not a gnnpipe model file or checkpoint (no '{PAYLOAD_KEY}' payload, no weights)"
    if kind not in ATOMIC_MODELS:
        return (f"{path}: the checkpoint of a {kind!r} run, not an atomic model (atomic kinds: "
                f"{', '.join(ATOMIC_MODELS.names())})")
    return (f"{path}: a model.pt of an older gnnpipe (weights only: no normaliser, cutoff or elements); rebuild "
            "its model file with gnnpipe.atomic.modelfile.upgrade_run(<run dir>) while the run's systems.h5 and "
            f"graphs.h5 exist, or retrain run {state.get('run_id', '?')}")


def decode(payload: Any, where: str = "payload") -> ModelFile:
    """Check a payload and decode it (one-line errors naming ``where``)."""
    from ..config import NEIGHBOR_CONVENTIONS
    from ..registry import UnknownKind
    from .protocol import ATOMIC_MODELS
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        got = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise GnnPipeError(f"{where}: not a gnnpipe atomic model (format {got!r}, expected {FORMAT!r})")
    version = payload.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise GnnPipeError(f"{where}: model file format version {version!r}, this gnnpipe reads up to "
                           f"{FORMAT_VERSION}: upgrade gnnpipe to use it")
    if version < OLDEST_VERSION:
        raise GnnPipeError(f"{where}: model file format version {version}, this gnnpipe reads {FORMAT_VERSION} "
                           f"(and back to {OLDEST_VERSION}): re-export it with the gnnpipe that wrote it, or retrain")
    missing = [k for k in _REQUIRED + (("neighbors",) if version >= 2 else ()) if k not in payload]
    if missing:
        raise GnnPipeError(f"{where}: incomplete model file (missing {', '.join(missing)}); it was cut short or "
                           "edited: write it again")
    try:
        ATOMIC_MODELS[payload["kind"]]
    except UnknownKind as e:
        raise GnnPipeError(f"{where}: {e} (written by a newer gnnpipe, or a plugin not imported here)") from None
    neighbors = payload.get("neighbors", "project")  # format 1: the only convention there was
    if neighbors not in NEIGHBOR_CONVENTIONS:
        raise GnnPipeError(f"{where}: neighbour convention {neighbors!r} is none of {', '.join(NEIGHBOR_CONVENTIONS)} "
                           "(written by a newer gnnpipe?); upgrade gnnpipe")
    norm = payload["normalizer"]
    e_ref = np.asarray(torch.as_tensor(norm["e_ref"], dtype=torch.float64))
    if e_ref.shape != (NUM_ELEMENTS,):
        raise GnnPipeError(f"{where}: normalizer e_ref has shape {e_ref.shape}, expected ({NUM_ELEMENTS},)")
    return ModelFile(kind=payload["kind"], model_config=dict(payload["model_config"]),
                     cutoff=float(payload["cutoff"]),
                     max_neighbors=None if payload["max_neighbors"] is None else int(payload["max_neighbors"]),
                     symmetric_edges=bool(payload["symmetric_edges"]), e_ref=e_ref, scale=float(norm["scale"]),
                     elements=tuple(int(z) for z in payload["elements"]), dtype=str(payload["dtype"]),
                     state_dict=dict(payload["state_dict"]), fingerprint=payload.get("fingerprint"),
                     run_id=payload.get("run_id"), source=where, neighbors=neighbors,
                     mean=float(norm.get("mean", 0.0)),
                     force_scale=None if norm.get("force_scale") is None else float(norm["force_scale"]),
                     origin=payload.get("origin"), energy_reference=_energy_reference(payload, where))


def _energy_reference(payload: dict, where: str) -> Optional[str]:
    reference = payload.get("energy_reference")
    if reference is not None and reference not in ENERGY_REFERENCES:
        raise GnnPipeError(f"{where}: energy_reference {reference!r} is none of {', '.join(ENERGY_REFERENCES)} "
                           "(written by a newer gnnpipe?); upgrade gnnpipe")
    return reference


# --------------------------------------------------------------------------- fine-tuning (models.<name>.init_from)
def load_init(cfg) -> Optional[ModelFile]:
    """The model file an atomic run starts from (``models.<name>.init_from``), checked against the run
    (:func:`check_init`), or None. The file is authoritative for what it fixes: the kind, every size,
    the force head, the cutoff, the neighbour cap and convention, the normaliser; the run's config
    sets how it trains (lr, epochs, batch size, force weight, the habits, the dtype)."""
    path = getattr(cfg.model, "init_from", "")
    if not path:
        return None
    mf = load_model_file(path)
    check_init(mf, cfg)
    return mf


def check_init(mf: ModelFile, cfg) -> None:
    """Refuse, in one line naming the key and both values, a run whose model section contradicts the
    model file it starts from (a run.yaml written by hand: the workflow config refuses the keys at all)."""
    kind, spec = cfg.model.kind, cfg.model.spec
    where = f"run {cfg.run_id}: init_from {mf.source}"
    if kind != mf.kind:
        raise GnnPipeError(f"{where} holds a {mf.kind} model, the run's kind is {kind}; set kind: {mf.kind}")
    own = mf.config()
    for name in mf.spec.config_fields():
        given = getattr(spec, name, None)
        if name != "force_head" and given is not None and given != getattr(own, name):
            raise GnnPipeError(f"{where}: {kind}.{name} is {given!r} in the config and {getattr(own, name)!r} in the "
                               "model file, which fixes the architecture; remove the key")


def check_init_graphs(mf: ModelFile, graphs: dict, cfg) -> None:
    """The run's graphs (``graphs.h5``) must be the ones the model file computes on: its neighbour
    convention and cap, a cutoff at least its own (``atomic_engine.model_graphs`` cuts them to it). One
    line naming the dataset's key and both values."""
    key, where = f"datasets.{cfg.dataset_name}.atoms", f"init_from {mf.source}"
    if graphs["neighbors"] != mf.neighbors:
        raise GnnPipeError(f"{key}.neighbors is {graphs['neighbors']} and {where} was trained on {mf.neighbors} "
                           f"graphs; set neighbors: {mf.neighbors}")
    if mf.max_neighbors is not None and int(graphs["max_neighbors"]) != mf.max_neighbors:
        raise GnnPipeError(f"{key}.max_neighbors is {int(graphs['max_neighbors'])} and {where} was trained with "
                           f"{mf.max_neighbors}; set max_neighbors: {mf.max_neighbors}")
    if float(graphs["cutoff"]) < mf.cutoff:
        raise GnnPipeError(f"{key}.cutoff is {float(graphs['cutoff']):g} Å and {where} has {mf.cutoff:g} Å: the "
                           f"graphs lack the neighbours between; set cutoff: {mf.cutoff:g}")


def check_init_cap(mf: ModelFile, graphs: dict, systems: dict, cfg) -> None:
    """An uncapped or per-target-cut model file (fairchem's DimeNet++) trains on the run's symmetric
    capped graphs (at its cutoff) only where the cap never binds: then they are its own graphs."""
    key, where = f"datasets.{cfg.dataset_name}.atoms", f"init_from {mf.source}"
    if mf.max_neighbors is None or not mf.symmetric_edges:
        cap = int(graphs["max_neighbors"])
        ends = graphs["edge_dst"] + np.repeat(systems["atom_ptr"][:-1], np.diff(graphs["edge_ptr"]))
        most = int(np.bincount(ends).max(initial=0))
        if most >= cap:
            what = "no neighbour cap" if mf.max_neighbors is None else \
                f"a per-target cut of {mf.max_neighbors} (not the workflow's symmetric graphs)"
            raise GnnPipeError(f"{where} was trained with {what}, which the run's graphs equal only where "
                               f"{key}.max_neighbors ({cap}) never binds, and an atom has {most} neighbours; "
                               + ("raise max_neighbors above it" if mf.max_neighbors is None else
                                  "fine-tune it on structures with fewer neighbours within the cutoff"))


# --------------------------------------------------------------------------- older runs
def upgrade_run(run_dir, out=None) -> Path:
    """Rebuild the model file of a run whose ``model.pt`` holds weights only (gnnpipe before
    format version 1), from its ``run.yaml`` and data files, as ``evaluate`` refits them; writes
    a bare model file (default ``<run_dir>/model-v1.pt``, which ``load_model_file(run_dir)`` then
    reads) and returns its path."""
    from ..checkpoint import check_checkpoint
    from ..config import load_run_config
    from .atomic_engine import AtomicEngine

    run_dir = Path(run_dir)
    if not (run_dir / RUN_FILE).is_file() or not (run_dir / MODEL_FILE).is_file():
        raise GnnPipeError(f"{run_dir}: not a finished run directory (needs {RUN_FILE} and {MODEL_FILE})")
    cfg = load_run_config(run_dir / RUN_FILE)
    state = _read(run_dir / MODEL_FILE)
    if PAYLOAD_KEY in state:
        raise GnnPipeError(f"{run_dir / MODEL_FILE}: already describes itself; nothing to upgrade")
    for need in (cfg.systems_path, cfg.graph_path):
        if not need or not Path(need).is_file():
            raise GnnPipeError(f"{run_dir}: its data file {need} is gone, and the normaliser cannot be refitted "
                               "without it; rebuild the data (the same config gives the same file) or retrain")
    check_checkpoint(state, cfg, run_dir / MODEL_FILE)  # the data must be what it was trained from
    one = dataclasses.replace(cfg, mode="single", workers=1, ways=1, data_parallel=1)
    engine = AtomicEngine(one, None, None, torch.device("cpu"))
    engine.model.load_state_dict(state["model"])
    fingerprint = {k: state.get(k) for k in ("config_hash", "graph_hash", "store_hash")}
    return save_model_file(out or run_dir / UPGRADED_FILE, payload_from_engine(engine, fingerprint))
