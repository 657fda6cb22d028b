"""Typed configuration: nested dataclasses, built from YAML at exactly one boundary.

Two shapes of config exist:

* the **workflow config** (``config/config.yaml``): named datasets and models, shared
  training settings and a list of runs. ``load_workflow_config`` is its one judge, for
  Snakemake (``common.smk`` calls it) and the CLI alike: the dataclasses, the cross-checks,
  then the JSON schema (``check_schema``), which ``json_schema`` generates from the dataclasses.
* the **run config** (``results/runs/<run_id>/run.yaml``): one run, fully resolved
  (``resolve_run``), which is what ``gnnpipe train`` and ``gnnpipe evaluate`` read.

Any unknown key, wrong type or bad value raises ``ConfigError`` with the dotted path
of the offending key. Both shapes go through the same checks (``from_dict``): types, the
bounds in each field's metadata (``key(..., bound=...)``, ``bounds``; the schema says the same ones),
finite numbers and integers that fit in 64 bits only, names that are safe in paths, file
paths without control characters (``PATHS``; spaces are fine, the rules quote every path),
and no output directory inside a system directory or a file (``check_output_dir``). A run key its
mode would ignore (``stages`` on a graph run, ``data_parallel`` on a node run) is refused, and so
is a model key only another kind reads (``refuse_other_kinds``); a section may be left out, not
null. Sizes whose allocation would be absurd are over a bound (``MAX_WIDTH``, ``MAX_DEPTH``, ...).

**One source.** A key is written once, as a dataclass field: its type, default, bound, doc and any
schema keyword the types do not say live in the field (``key``). The JSON schema is generated from
the dataclasses (``json_schema``; ``workflow/schemas/config.schema.yaml`` is its output, rewritten by
``python -m gnnpipe.config --write-schema``, and a test fails while the two differ). An atomic
kind's section (``ATOMIC_SPECS``, ``atomic_spec``) is derived from the kind's config class, which
``gnnpipe.kinds.ATOMIC_CONFIGS`` names, and ``ModelConfig`` has one section per registered kind:
adding an atomic kind writes nothing here.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from .io import GnnPipeError
from .kinds import ATOMIC_CONFIGS, ATOMIC_MODELS, CONVS
from .layout import resolve_layout


class ConfigError(GnnPipeError):
    """A config key or value is wrong."""


# --------------------------------------------------------------------------- keys: bounds and docs
def _number(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


@dataclass(frozen=True)
class Bound:
    """An interval a number must lie in (``None``: unbounded on that side)."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False

    def ok(self, v) -> bool:
        return ((self.lo is None or (v > self.lo if self.lo_open else v >= self.lo))
                and (self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)))

    def text(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {_number(self.lo)}"
        return (f"in {'(' if self.lo_open else '['}{_number(self.lo)}, {_number(self.hi)}"
                f"{')' if self.hi_open else ']'}")

    def schema(self) -> dict:
        """The same bound as JSON-schema keywords."""
        out = {}
        if self.lo is not None:
            out["exclusiveMinimum" if self.lo_open else "minimum"] = self.lo
        if self.hi is not None:
            out["exclusiveMaximum" if self.hi_open else "maximum"] = self.hi
        return out


_GE0, _GE1, _GE2, _GT0 = Bound(0), Bound(1), Bound(2), Bound(0, lo_open=True)
# Sizes whose allocation would be absurd are refused here, before any job runs (issue #37, item 4);
# what fits a worker's memory is the launcher's question (gnnpipe.launch, the cost model's estimate).
MAX_NODES = 2**31 - 1  # graph.h5 holds int32 node ids
MAX_WIDTH = 2**16  # hidden widths, features, classes, heads: a 2^16 x 2^16 weight is already 16 GiB
MAX_DEPTH = 4096  # layers, blocks, basis sizes (the deepest published GNNs have ~1,000 layers)
MAX_WORKERS = 4096  # workers (world size) of one run
WORKERS_PER_CPU = 8  # a node's workers at most per CPU of the machine that checks the config
_WIDTH, _DEPTH, _WORKERS = Bound(1, MAX_WIDTH), Bound(1, MAX_DEPTH), Bound(1, MAX_WORKERS)
_FRACTION, _BELOW1 = Bound(0, 1), Bound(0, 1, hi_open=True)
# Seeds reach C ints (METIS) as well as torch and NumPy: 2^31 - 1 fits every consumer.
_SEED = Bound(0, 2**31 - 1)
# A worker's wait for its peers: a week at the most (torch turns it into milliseconds, and a
# larger value is a typo, not a plan).
_TIMEOUT = Bound(1, 7 * 24 * 3600)
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"  # dataset, model and run names: safe in paths
REFERENCE_PATTERN = r"emt|none|[A-Za-z_][\w.]*:[A-Za-z_]\w*"  # relax.reference, gnnpipe relax --reference


def key(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, bound: Optional[Bound] = None,
        doc: str = "", kinds: tuple[str, ...] = (), schema: Optional[dict] = None, required: bool = False):
    """A config field with what the checks and the JSON schema read from its metadata: ``bound`` (the
    interval a number lies in; ``from_dict`` checks it, the schema says it), ``doc`` (the schema's
    description), ``kinds`` (the model kinds that read a ModelConfig key: ``_kinds``), ``schema``
    (JSON-schema keywords the types do not say: a name pattern, an enum of list items, a length;
    ``items`` is merged into the items' schema) and ``required`` (the workflow config must give the
    key although the dataclass has a default)."""
    meta: dict[str, Any] = {}
    if bound is not None:
        meta["bound"] = bound
    if doc:
        meta["doc"] = doc
    if kinds:
        meta.update(_kinds(*kinds))
    if schema:
        meta["schema"] = schema
    if required:
        meta["required"] = True
    return field(default=default, default_factory=factory, metadata=meta)


def _kinds(*kinds: str) -> dict:
    """A ModelConfig field's metadata: the model kinds that read it (others refuse it: ModelConfig.check)."""
    return {"kinds": kinds}


def bounds(cls: type) -> dict[str, Bound]:
    """The bounds of a config dataclass's numeric fields (their ``metadata["bound"]``), by field name."""
    return {f.name: f.metadata["bound"] for f in dataclasses.fields(cls) if "bound" in f.metadata}


_NAME = {"type": "string", "pattern": NAME_PATTERN}


# --------------------------------------------------------------------------- datasets
@dataclass
class RmatConfig:
    """R-MAT's recursion (gnnpipe.data.synthetic): each edge picks one quadrant of the adjacency matrix
    per level, top-left / top-right / bottom-left / bottom-right with probabilities a, b, c, d."""

    a: float = key(0.57, bound=_FRACTION, doc="probability of the top-left quadrant (hubs: a > d)")
    b: float = key(0.19, bound=_FRACTION)
    c: float = key(0.19, bound=_FRACTION)
    d: float = key(0.05, bound=_FRACTION, doc="a + b + c + d must be 1")
    scale: int = key(14, bound=Bound(2, 30), doc="the graph has 2**scale nodes")
    edge_factor: float = key(16.0, bound=_GT0, doc="edges drawn per node (before repeats and loops are merged)")


@dataclass
class SyntheticConfig:
    """Degree-corrected SBM with power-law degrees and a locality knob, or R-MAT with planted communities
    (see gnnpipe.data.synthetic).

    Fields left ``None`` take the value of the named ``shape``.
    """

    generator: Literal["dcsbm", "rmat"] = key("dcsbm", doc="dcsbm: degree-corrected SBM; rmat: R-MAT "
                                              "power law (hubs, isolated nodes) over planted communities")
    shape: Literal["default", "reddit-like", "physics-like"] = "default"
    rmat: RmatConfig = key(factory=RmatConfig, doc="generator rmat only; its nodes are 2**rmat.scale")
    num_nodes: Optional[int] = key(None, bound=Bound(2, MAX_NODES), doc="dcsbm only")
    avg_degree: Optional[float] = key(None, bound=_GT0, doc="dcsbm only")
    num_features: Optional[int] = key(None, bound=_WIDTH)
    num_classes: Optional[int] = key(None, bound=Bound(2, MAX_WIDTH))
    num_communities: Optional[int] = key(None, bound=Bound(2, MAX_NODES), doc="rmat: a power of two")
    intra_fraction: Optional[float] = key(None, bound=_FRACTION, doc="share of edges inside a community")
    locality: Optional[float] = key(None, bound=_FRACTION,
                                    doc="dcsbm only: share of intra edges kept near in a 1-D embedding")
    degree_exponent: Optional[float] = key(None, bound=_GT0, doc="dcsbm only: power-law exponent of expected degrees")
    feature_signal: Optional[float] = key(None, bound=_GE0, doc="class signal in features relative to noise")
    label_noise: Optional[float] = key(None, bound=_FRACTION,
                                       doc="share of nodes whose label is not their community's")
    train_fraction: float = key(0.6, bound=_FRACTION)
    val_fraction: float = key(0.2, bound=_FRACTION)
    seed: int = key(0, bound=_SEED)


@dataclass
class OgbConfig:
    """An OGB node-property dataset read from OGB's raw on-disk files under ``root``."""

    name: Literal["ogbn-arxiv", "ogbn-products", "ogbn-papers100M"] = "ogbn-arxiv"
    root: str = key("data/ogb", doc="where <name with _>/ lies or is downloaded to")
    download: bool = key(True, doc="try to download when missing (needs the internet)")


@dataclass
class FilesConfig:
    """A user's own graph: an edge list and per-node arrays."""

    edges: str = key("", doc=".csv (two int columns, optional header) or .npy/.npz (E, 2)")
    features: str = key("", doc=".npy (N, F)")
    labels: str = key("", doc=".npy (N,) integral")
    train_mask: Optional[str] = key(None, doc=".npy bool (N,); all three or none")
    val_mask: Optional[str] = None
    test_mask: Optional[str] = None
    train_fraction: float = key(0.6, bound=_FRACTION, doc="random split when no masks are given")
    val_fraction: float = key(0.2, bound=_FRACTION)
    seed: int = key(0, bound=_SEED)


_METALS = ["Cu", "Ag", "Au", "Ni", "Pd", "Pt", "Al"]
_ADSORBATES = ["O", "H", "C", "N", "CO", "N2", "NO"]
#: OC20's S2EF splits by name (their URLs and digests: gnnpipe.atomic.oc20.SPLITS, a test keeps the two equal)
S2EF_SPLITS = ("200k", "2M", "20M", "all", "val_id", "val_ood_ads", "val_ood_cat", "val_ood_both", "rattled", "md")
#: how a neighbour cap makes the radius graph symmetric (gnnpipe.atomic.neighbors' module docstring)
NEIGHBOR_CONVENTIONS = ("project", "fairchem")


@dataclass
class AtomsConfig:
    """Atomistic systems with energies and forces (gnnpipe.atomic.data) and their radius graphs.

    ``file`` empty: generate slab + adsorbate relaxations under ASE's EMT calculator, frames along
    each as systems (no internet); else read the user's ASE database (``.db``), extended XYZ file,
    fairchem ASE-LMDB (``.aselmdb``, or a folder of ``*.aselmdb`` shards) or OC20 S2EF folder
    (``*.extxyz.xz`` with their ``*.txt``; ``s2ef_split`` names a split to download into it when
    missing, ``s2ef_energy`` picks its energies), the kind chosen by the name (``atomic.data.structure_kind``).
    ``split``: ``trajectory`` keeps each trajectory (generated: a relaxation; a file: the structures
    with one value of ``group_key``) in one of train/val/test; ``random``: structure by structure;
    a file's fixed split (the fractions unused): ``key``, each structure's ``split_key`` (info key /
    db column) names its split, train, val or test; ``file``, the index file ``split_file`` (JSON or
    NPZ: train/val/test lists of 0-based structure positions) lists them.
    """

    file: str = ""
    s2ef_split: str = key("", doc=(
        "an OC20 S2EF split (200k, 2M, 20M, all, val_id, val_ood_ads, val_ood_cat, val_ood_both, rattled, md): "
        "read from the folder atoms.file, downloaded into it (MD5 checked) when it holds no S2EF files"),
        schema={"enum": ["", *S2EF_SPLITS]})
    s2ef_energy: Literal["referenced", "total"] = key("referenced", doc=(
        "an OC20 S2EF folder's energies: referenced (total minus each frame's reference energy: OC20's S2EF "
        "target, an adsorption energy) or total (the DFT energy)"))
    num_trajectories: int = key(21, bound=_GE1, doc="generated relaxations")
    frames_per_trajectory: int = key(3, bound=_GE1,
                                     doc="systems taken along each (initial, ..., relaxed); 1: the start only")
    split: Literal["trajectory", "random", "key", "file"] = "trajectory"
    group_key: str = key("trajectory",
                         doc="a file's info key (extxyz) / column (ASE db) naming each structure's trajectory")
    split_key: str = key("split", doc="split: key: the info key / column whose value is train, val or test")
    split_file: str = key("", doc="split: file: JSON or NPZ of train/val/test structure indices (0-based, "
                                  "file order)")
    metals: list[str] = key(factory=lambda: list(_METALS), schema={"minItems": 1, "items": {"enum": _METALS}})
    adsorbates: list[str] = key(factory=lambda: list(_ADSORBATES),
                                schema={"minItems": 1, "items": {"enum": _ADSORBATES}})
    slab_size: list[int] = key(factory=lambda: [2, 2, 3], doc="fcc(111)/(100) repeats, layers last",
                               schema={"minItems": 3, "maxItems": 3, "items": _GE1.schema()})
    rattle: float = key(0.05, bound=_GE0, doc="Å")
    min_distance: float = key(0.5, bound=_GT0, doc=(
        "Å: two atoms (or an atom and a periodic image) closer than this are refused when the systems are "
        "read or generated (gnnpipe.atomic.checks); the shortest real bond, H2, is 0.74 Å"))
    cutoff: float = key(5.0, bound=_GT0, doc="Å, radius graph and the model's basis cutoff")
    max_neighbors: int = key(32, bound=_GE1, doc="nearest neighbours kept per atom")
    neighbors: Literal[NEIGHBOR_CONVENTIONS] = key("project", doc=(  # type: ignore[valid-type]
        "how the cap max_neighbors makes the graph symmetric (gnnpipe.atomic.neighbors): project, a pair if "
        "either atom nominated the other; fairchem, fairchem's GemNet graph (radius_graph_pbc + "
        "reorder_symmetric_edges: a pair {a < b} if b nominated a), for fairchem's models"))
    train_fraction: float = key(0.8, bound=_FRACTION)
    val_fraction: float = key(0.1, bound=_FRACTION)
    seed: int = key(0, bound=_SEED)

    def check(self, path: str) -> None:  # numbers: their bounds
        if len(self.slab_size) != 3 or min(self.slab_size) < 1:
            raise ConfigError(f"{path}.slab_size: three positive repeats, got {self.slab_size}")
        if self.split in ("key", "file") and not self.file:
            raise ConfigError(f"{path}.split: {self.split} fixes a split of a user's structures (atoms.file); "
                              f"generated data is split by trajectory or random")
        if self.s2ef_split and not self.file:
            raise ConfigError(f"{path}.s2ef_split: {self.s2ef_split} needs atoms.file, the folder it lies in or is "
                              f"downloaded to")
        if (self.split == "file") != bool(self.split_file):
            raise ConfigError(f"{path}.split_file: " + ("split: file needs the index file here" if self.split == "file"
                              else f"an index file is read with split: file only (split is {self.split})"))


@dataclass
class DatasetConfig:
    """One named dataset: its kind, the graph's symmetry and self-loops, and the kind's section."""

    kind: Literal["synthetic", "ogb", "files", "atoms"] = "synthetic"
    symmetrize: bool = key(True, doc="add the reverse of every edge")
    self_loops: Literal["remove", "add", "keep"] = key("remove", doc="layers add their own self term")
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    ogb: OgbConfig = field(default_factory=OgbConfig)
    files: FilesConfig = field(default_factory=FilesConfig)
    atoms: AtomsConfig = field(default_factory=AtomsConfig)


# --------------------------------------------------------------------------- model & training
#: Node-level model kinds (graph layers, gnnpipe.models): the conv registry's names (no torch).
NODE_KINDS = CONVS.names()

#: Every model kind: the schema's enum and the CLI's choices are this tuple.
MODEL_KINDS = NODE_KINDS + ATOMIC_MODELS.names()


def _derived(name: str, base: type, fields: list, doc: str) -> type:
    """``base`` with ``fields`` ((name, type, field) triples) added or redefined (a redefined field keeps
    its place), a dataclass of this module."""
    cls = dataclasses.make_dataclass(name, fields, bases=(base,))
    cls.__module__, cls.__qualname__, cls.__doc__ = __name__, name, doc
    return cls


@dataclass
class ScheduleConfig:
    """The learning rate per optimizer step (gnnpipe.habits.lr_at): a linear warmup to the run's lr over
    ``warmup_epochs``, then a cosine decay to ``min_lr_factor`` x lr at the last step (``decay: none``:
    lr after the warmup). An atomic model's (its section's ``schedule``; on by default)."""

    warmup_epochs: float = key(2.0, bound=_GE0, doc="epochs of linear warmup (fractions allowed: steps are counted)")
    decay: Literal["cosine", "none"] = "cosine"
    min_lr_factor: float = key(0.02, bound=_FRACTION, doc="the last step's lr, as a fraction of lr")


#: A node run's schedule (``training.schedule``): the same keys, off by default (no warmup, no decay).
#: A node model steps once an epoch, so its warmup and decay count epochs.
NodeScheduleConfig = _derived("NodeScheduleConfig", ScheduleConfig, [
    ("warmup_epochs", float, key(0.0, bound=_GE0, doc=(
        "epochs of linear warmup of the lr (a node model steps once an epoch; not training.warmup_epochs, "
        "the epochs left out of the timing median)"))),
    ("decay", Literal["cosine", "none"], "none")],
    "The learning rate of a node model per epoch (gnnpipe.habits.lr_at), as an atomic section's schedule; "
    "off by default.")


@dataclass
class LossGuardConfig:
    """The divergence guard of a node run (gnnpipe.habits.Guard) on its loss: a non-finite loss or the
    loss above ``loss_factor`` x its best for ``patience`` epochs in a row stops the run: one line,
    MLflow FAILED, exit non-zero, no model written. Off by default (``loss_factor: null``)."""

    loss_factor: Optional[float] = key(None, bound=Bound(1, lo_open=True))
    patience: int = key(3, bound=_GE1)


#: An atomic run's guard: the loss guard on by default, and a floor on the force cosine.
GuardConfig = _derived("GuardConfig", LossGuardConfig, [
    ("loss_factor", Optional[float], key(3.0, bound=Bound(1, lo_open=True))),
    ("min_force_cos", Optional[float], key(-0.2, bound=Bound(-1, 1)))],
    "The divergence guard of an atomic run (gnnpipe.habits.Guard): a non-finite loss, the loss above "
    "``loss_factor`` x its best for ``patience`` epochs in a row, or a force cosine (val, else train) below "
    "``min_force_cos`` at an evaluation after the warmup where the loss no longer falls (no new best) stops the "
    "run: one line, MLflow FAILED, exit non-zero, no model written. ``null`` switches a test off.")


@dataclass
class AtomicSpec:
    """What every atomic model's section holds beside its sizes: a preset, the force head, how it
    trains (lr, its schedule, clipping, the weights' moving average, the divergence guard), and its
    basis cutoff. Sizes left ``None`` keep the preset's. Each kind's section is this class with the
    sizes of the kind's config class (``atomic_spec``)."""

    preset: Literal["small", "default", "xl"] = "small"
    force_head: Optional[Literal["gradient", "direct"]] = key(
        None, doc="gradient: F = -dE/dpos; direct: a force head; null: the preset's")
    force_weight: float = key(10.0, bound=_GE0, doc=(
        "weight of the force term in the loss; 0 (or data without forces): energy-only training, no force pass"))
    batch_size: int = key(4, bound=_GE1, doc="systems per step and data-parallel replica")
    lr: Optional[float] = key(1e-3, bound=_GT0, doc=(
        "Adam's learning rate, the schedule's peak (training.lr is the node models'); each kind sets its own "
        "(its config class's SPEC_DEFAULTS). null (run.yaml files written before #37 item 13, whose atomic "
        "sections say lr: null): training.lr, the rate such a run trained at"))
    cutoff: Optional[float] = key(None, bound=_GT0, doc=(
        "Å, the model's basis cutoff: null = the graphs' (datasets.<name>.atoms.cutoff); a smaller one drops "
        "the longer edges at set-up, a larger one is refused (the graphs lack those neighbours)"))
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    clip_grad_norm: Optional[float] = key(10.0, bound=_GT0,
                                          doc="the gradients' global 2-norm is clipped to this (null: off)")
    ema_decay: Optional[float] = key(0.99, bound=_BELOW1, doc=(
        "the weights evaluated and written as the model: their exponential moving average (null: the last)"))
    guard: GuardConfig = field(default_factory=GuardConfig)
    eval_train_systems: Optional[int] = key(500, bound=_GE1, doc=(
        "every evaluation (training's, gnnpipe evaluate's) scores val and test whole and, of the training "
        "split, a seeded sample of at most this many systems, the same each time (null: all of them)"))


def _size_bound(name: str) -> Bound:
    """A size of an atomic model: a count (``num_*``: blocks, basis functions, layers) or a width."""
    return _DEPTH if name.startswith("num_") else _WIDTH


def atomic_spec(kind: str) -> type:
    """The class of an atomic kind's section ``models.<name>.<kind>``, derived from the kind's config
    class (``ATOMIC_CONFIGS[kind]``): ``AtomicSpec`` plus, in the config's order, every field marked
    ``"spec": "preset"`` as ``Optional[...] = None`` (the preset's value), bounded as a count
    (``num_*``) or a width; a field marked ``"spec": "own"`` with the config's own type and default;
    and the config's ``SPEC_DEFAULTS`` as the kind's defaults of AtomicSpec's keys."""
    config = ATOMIC_CONFIGS[kind]
    hints, base_hints = typing.get_type_hints(config), typing.get_type_hints(AtomicSpec)
    base = {f.name: f for f in dataclasses.fields(AtomicSpec)}
    own = []
    for f in dataclasses.fields(config):
        doc, role = f.metadata.get("doc", ""), f.metadata.get("spec")
        if role == "preset":
            own.append((f.name, Optional[hints[f.name]], key(None, bound=_size_bound(f.name), doc=doc)))
        elif role == "own":
            own.append((f.name, hints[f.name], key(f.default, doc=doc or base[f.name].metadata.get("doc", ""))))
        elif role is not None:
            raise TypeError(f"{config.__name__}.{f.name}: metadata spec is 'preset' or 'own', not {role!r}")
    for name, value in getattr(config, "SPEC_DEFAULTS", {}).items():
        own.append((name, base_hints[name], field(default=value, metadata=base[name].metadata)))
    doc = (f"{config.__doc__.strip()} The section ``models.<name>.{kind}``: {AtomicSpec.__doc__.split('.')[0]}; "
           f"null sizes keep the preset's.")
    return _derived(f"{config.__name__.removesuffix('Config')}Spec", AtomicSpec, own, doc)


#: The config section of each atomic kind: ``models.<name>.<kind>`` (a field of ModelConfig), derived
#: from the kind's config class: its size fields are the kind's, the rest how it trains.
ATOMIC_SPECS = {kind: atomic_spec(kind) for kind in ATOMIC_MODELS.names()}
# module attributes (DimeNetPPSpec, GemNetTSpec, ...), so that pickle (spawned workers) finds them by name
globals().update({spec.__name__: spec for spec in ATOMIC_SPECS.values()})


@dataclass
class _ModelConfig:
    """A stack of ``layers`` graph layers (``mlp``: no graph, the baseline), or an atomic model
    (a kind of ``gnnpipe.atomic.protocol.ATOMIC_MODELS``) sized by its own section."""

    kind: Literal[MODEL_KINDS] = key("gcn", doc="a model kind: gnnpipe.kinds' registries' names")  # type: ignore[valid-type]
    layers: int = key(2, bound=_DEPTH, kinds=NODE_KINDS)
    hidden: int = key(64, bound=_WIDTH, kinds=NODE_KINDS)
    dropout: float = key(0.5, bound=_BELOW1, kinds=NODE_KINDS)
    heads: int = key(4, bound=_WIDTH, kinds=("gat",), doc="gat: attention heads (hidden is split across them)")
    alpha: float = key(0.1, bound=_FRACTION, kinds=("gcnii",), doc="initial-residual weight")
    lambda_: float = key(0.5, bound=_GT0, kinds=("gcnii",), doc="identity-mapping strength (YAML key: lambda)")
    norm: Literal["none", "layer"] = key("none", kinds=("gcn", "sage", "gat"), doc=(
        "normalisation after each hidden layer of the plain stacks (resgcn: always layer)"))
    init_from: str = key("", kinds=tuple(ATOMIC_SPECS), doc=(
        "atomic models: start from this model file's weights (gnnpipe import-model's, or a finished run's "
        "model.pt; relative to the workflow's directory): it fixes the kind's sizes, force head, cutoff, "
        "neighbour cap and convention and normaliser (the section sets how it trains; the dataset's graphs "
        "must be the file's)"))

    @property
    def atomic(self) -> bool:
        return self.kind in ATOMIC_SPECS

    @property
    def spec(self) -> Optional[AtomicSpec]:
        """The section of an atomic kind (None for node models)."""
        return getattr(self, self.kind) if self.atomic else None

    def check(self, path: str) -> None:
        """A key of another kind that differs from its default would be ignored: refuse it rather than
        drop it silently (a run.yaml holds every key; the workflow config's are refused when given at
        all: ``refuse_other_kinds``)."""
        default = ModelConfig()
        refuse_other_kinds(self.kind, [f.name for f in dataclasses.fields(self)
                                       if not _same(getattr(self, f.name), getattr(default, f.name))], path)


#: The model config: the node models' keys, then one section per atomic kind (``ATOMIC_SPECS``).
ModelConfig = _derived("ModelConfig", _ModelConfig, [
    (kind, spec, key(factory=spec, kinds=(kind,))) for kind, spec in ATOMIC_SPECS.items()], _ModelConfig.__doc__)


def _same(value, default) -> bool:
    """A key at its default; an atomic section's ``lr: null`` counts as its default (what a run.yaml of
    gnnpipe before #37 item 13 says in every atomic section, of a node model's run too)."""
    if isinstance(value, AtomicSpec) and value.lr is None:
        value = dataclasses.replace(value, lr=default.lr)
    return value == default


def refuse_other_kinds(kind: str, keys, path: str) -> None:
    """Refuse the first of ``keys`` (ModelConfig fields) that only models of other kinds read
    (``metadata["kinds"]``): it would be ignored silently."""
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    for key in keys:
        kinds = fields[_RENAMES.get(key, key)].metadata.get("kinds")
        if kinds and kind not in kinds:
            name = "lambda" if key == "lambda_" else key
            raise ConfigError(f"{path}.{name}: only models of kind {' / '.join(kinds)} read this key, a {kind} "
                              f"model would ignore it; remove it (or set kind: {kinds[0]})")

@dataclass
class TrainingConfig:
    """Training settings every run shares (a run may override ``epochs`` and ``seed``); ``lr`` and the
    habits (``schedule``, ``clip_grad_norm``, ``ema_decay``, ``guard``) are the node models' (an atomic
    model's section has its own)."""

    epochs: int = key(100, bound=_GE1)
    lr: float = key(0.01, bound=_GT0)
    weight_decay: float = key(5e-4, bound=_GE0)
    seed: int = key(0, bound=_SEED)
    dtype: Literal["float32", "float64"] = "float32"
    eval_every: int = key(10, bound=_GE1, doc="exact inference for val/test accuracy every N epochs (and the last)")
    checkpoint_every: int = key(50, bound=_GE0, doc="0: only the final model")
    warmup_epochs: int = key(1, bound=_GE0, doc="epochs excluded from the timing median")
    threads_per_worker: int = key(1, bound=_GE1)
    node_order: Literal["locality", "given"] = key("locality", doc=(
        "single-process runs: locality renumbers the nodes by METIS parts before training (the aggregations' "
        "gathers then hit the caches; same results up to float rounding), given keeps the dataset's ids "
        "(gnnpipe.partition.locality_order)"))
    dist_timeout_s: int = key(600, bound=_TIMEOUT, doc=(
        "how long a worker waits for the others in a collective before the run fails, seconds "
        "(torch.distributed's timeout; the environment variable GNNPIPE_DIST_TIMEOUT overrides it)"))
    max_restarts: int = key(0, bound=_GE0, doc=(
        "parallel runs of the workflow: torchrun --max-restarts (a crashed worker group is restarted and "
        "resumes from the last complete checkpoint); 0: a failure ends the job"))
    # the training habits of node models (gnnpipe.habits), an atomic section's keys with the same meaning,
    # all off by default; an atomic model reads its own section's (models.<name>.<kind>), as it does lr
    schedule: NodeScheduleConfig = field(default_factory=NodeScheduleConfig)  # type: ignore[valid-type]
    clip_grad_norm: Optional[float] = key(None, bound=_GT0, doc=(
        "node models: the gradients' global 2-norm (over every stage's in a pipeline) is clipped to this "
        "(null: off)"))
    ema_decay: Optional[float] = key(None, bound=_BELOW1, doc=(
        "node models: the weights evaluated and written as the model are their exponential moving average "
        "with this decay (null: the last weights)"))
    guard: LossGuardConfig = field(default_factory=LossGuardConfig)


@dataclass
class PipelineConfig:
    """GNNPipe chunk pipeline and its convergence techniques (docs/DESIGN.md §4)."""

    chunks_per_stage: int = key(4, bound=_GE1, doc="C = chunks_per_stage * S unless a run sets chunks")
    shuffle_chunks: bool = key(True, doc="technique 1")
    grad_correction: bool = key(True, doc="technique 2: zero not-yet-backpropagated rows, scale fresh ones")
    grad_scale: float = key(2.0, bound=_GT0)
    snapshot_every: int = key(23, bound=_GE0, doc="technique 3: 0 disables")
    momentum: float = key(0.0, bound=_BELOW1, doc="PipeGCN-style smoothing of stale rows; 0 disables (reference 0.95)")
    recompute: bool = key(False, doc="recompute activations in backward instead of storing them")
    balance: Literal["uniform", "estimate", "profile"] = "estimate"


#: A run's overrides of ``PipelineConfig`` (``runs[i].pipeline``): every field Optional, None keeps the
#: workflow's; the bounds and docs are PipelineConfig's.
PipelineOverride = _derived("PipelineOverride", object, [
    (f.name, Optional[hint], field(default=None, metadata=f.metadata))
    for f, hint in ((f, typing.get_type_hints(PipelineConfig)[f.name]) for f in dataclasses.fields(PipelineConfig))],
    "A run's overrides of ``PipelineConfig`` (``runs[i].pipeline``); None keeps the workflow's.")


@dataclass
class GraphParallelConfig:
    """Graph parallelism's options."""

    overlap: bool = key(True, doc="aggregate inner rows while halo rows are in flight")
    cache_input_halo: bool = key(True, doc=(
        "input features never change: fetch the halo's features once at set-up and compute the first layer's "
        "sources locally (no layer-0 exchange per epoch); false: exchange them every epoch (the docs/DESIGN.md "
        "§4 count, less the input gradients nobody needs)"))


@dataclass
class PartitionConfig:
    """How the graph is split into parts and chunks."""

    method: Literal["metis", "random", "contiguous"] = "metis"
    balance_edges: bool = key(True, doc=(
        "parts hold about as many in-edges each (aggregation work): METIS vertex weights = in-degree + 1"))
    balance_nodes: bool = key(True, doc=(
        "parts hold about as many nodes each too (rows, activations, memory): with balance_edges, METIS "
        "with two balance constraints; false: edges alone (gnnpipe before #36). Without balance_edges, node "
        "counts are balanced either way"))
    seed: int = key(0, bound=_SEED)


@dataclass
class ResourcesConfig:
    """Cluster resources of the train and evaluate jobs (Snakemake ``resources:``; the
    Slurm profile turns them into ``sbatch`` flags). Local runs only use ``threads``."""

    mem_mb_per_worker: int = key(4096, bound=_GE1, doc="a job asks for workers_on_a_node * this")
    runtime_min: int = key(120, bound=_GE1, doc="wall-clock limit of one train job, minutes")
    gpus_per_worker: int = key(0, bound=_GE0, doc="0: CPU workers (gloo); 1: one GPU per worker (NCCL)")
    workers_per_node: Optional[int] = key(None, bound=_GE1, doc="null: all of a run's workers on one node")


@dataclass
class CostModelConfig:
    """The cost model the report sets beside every measured run (gnnpipe.planning)."""

    hardware: str = key("cpu-2core", doc="profile name under config/hardware, or a YAML file",
                        schema={"minLength": 1})
    calibrate: bool = key(True, doc=(
        "fit the profile's compute rates to each (dataset, model) on this machine first (rule calibrate, a few "
        "seconds each); false: the profile's rates as they are"))


@dataclass
class RelaxConfig:
    """IS2RS after ``evaluate`` for every atomic run (rule ``relax``, ``gnnpipe.atomic.is2rs``):
    ``systems`` systems of the test split (a seeded sample across compositions and trajectories),
    rattled, relaxed with the model and with the ``reference`` calculator. Defaults as OC20's IS2RS
    baseline: ASE L-BFGS (maxstep 0.04 Å, memory 50), fairchem's 300 steps and fmax 0.02 eV/Å."""

    systems: int = key(4, bound=_GE0, doc="test systems relaxed per run; 0: no relax rule")
    optimizer: Literal["lbfgs", "fire"] = "lbfgs"
    fmax: float = key(0.02, bound=_GT0, doc="eV/Å: converged when the largest free-atom force is at most this")
    steps: int = key(300, bound=_GE1, doc="optimiser steps at most, per relaxation")
    rattle: float = key(0.05, bound=_GE0, doc=(
        "Å: Gaussian displacement of every free atom before relaxing (the initial structure)"))
    seed: int = key(0, bound=_SEED, doc="of the rattle and of the sample of test systems")
    reference: Optional[str] = key(None, schema={"pattern": f"^({REFERENCE_PATTERN})$"}, doc=(
        "the calculator that labelled the data: emt, none (ML relaxations only), or an ASE calculator class "
        "module:Class (built without arguments); null: by the data, emt for gnnpipe's EMT-generated systems, "
        "none for a user's file (atoms.file)"))

    def check(self, path: str) -> None:
        if self.reference is not None and not re.fullmatch(REFERENCE_PATTERN, self.reference):
            raise ConfigError(f"{path}.reference: {self.reference!r} is not emt, none or an ASE calculator class "
                              "as module:Class (e.g. ase.calculators.emt:EMT)")


# --------------------------------------------------------------------------- runs
MODES = ("single", "graph", "pipeline", "hybrid")


@dataclass
class RunSpec:
    """One entry of the workflow config's ``runs`` list; its id is
    ``<dataset>-<model>-<mode>-<layout>-seed<seed>`` unless ``name`` is set."""

    mode: Literal["single", "graph", "pipeline", "hybrid"]
    dataset: str
    model: str
    workers: int = key(1, bound=_WORKERS)
    stages: Optional[int] = key(None, bound=_DEPTH, doc="hybrid: S (ways = workers / S); pipeline: = workers")
    chunks: Optional[int] = key(None, bound=Bound(1, MAX_NODES), doc="pipeline/hybrid: default chunks_per_stage * S")
    seed: Optional[int] = key(None, bound=_SEED, doc="overrides training.seed")
    epochs: Optional[int] = key(None, bound=_GE1, doc="overrides training.epochs")
    name: Optional[str] = key(None, doc="overrides the generated run id", schema={"pattern": NAME_PATTERN})
    pipeline: Optional[PipelineOverride] = key(None, doc="this run's own pipeline settings (ablations)")
    data_parallel: Optional[int] = key(None, bound=_WORKERS,
                                       doc="atomic graph mode: D replicas of P = workers / D ways")
    atom_layout: Optional[Literal["edges", "atoms", "domains"]] = key(None, doc=(
        "atomic graph mode: how the P ways split a batch (gnnpipe.atomic.halo): edges (contiguous edge blocks, "
        "all-gathers: Sriram et al.), atoms (METIS atom parts, halo all_to_all) or domains (every system cut "
        "into P spatial domains, each way building its own regions' edges and triplets from the positions; "
        "halo all_to_all; graphs whose neighbour cap does not bind); null: edges"))


@dataclass
class WorkflowConfig:
    """The workflow config (config/config.yaml): named datasets and models, shared settings, the runs."""

    results: str = key("results", schema={"minLength": 1}, doc=(
        "the directory every output goes to (any path without control characters, { or }; spaces are fine)"))
    datasets: dict[str, DatasetConfig] = key(factory=dict, required=True,
                                             schema={"minProperties": 1, "propertyNames": _NAME})
    models: dict[str, ModelConfig] = key(factory=dict, required=True,
                                         schema={"minProperties": 1, "propertyNames": _NAME})
    training: TrainingConfig = field(default_factory=TrainingConfig)
    partitioning: PartitionConfig = field(default_factory=PartitionConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    graph_parallel: GraphParallelConfig = field(default_factory=GraphParallelConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    cost_model: CostModelConfig = field(default_factory=CostModelConfig)
    relax: RelaxConfig = field(default_factory=RelaxConfig)
    runs: list[RunSpec] = key(factory=list, required=True, schema={"minItems": 1})


@dataclass
class RunConfig:
    """Everything one training run needs; written to ``results/runs/<run_id>/run.yaml``."""

    run_id: str
    mode: Literal["single", "graph", "pipeline", "hybrid"]
    dataset_name: str
    graph_path: str  # results/data/<dataset>/graph.h5
    store_path: Optional[str]  # results/chunks/<dataset>/<method>-<k>.h5 (None for single)
    out_dir: str  # results/runs/<run_id>
    model: ModelConfig
    training: TrainingConfig
    partitioning: PartitionConfig
    pipeline: PipelineConfig
    graph_parallel: GraphParallelConfig
    workers: int = key(1, bound=_WORKERS)
    stages: int = key(1, bound=_DEPTH)
    ways: int = key(1, bound=_WORKERS)
    chunks: int = key(1, bound=Bound(1, MAX_NODES), doc="parts in the chunk store: P for graph, C for pipeline/hybrid")
    data_parallel: int = key(1, bound=_WORKERS, doc="atomic models: replicas (workers = data_parallel * ways)")
    atom_layout: Literal["edges", "atoms", "domains"] = key("edges",
                                                            doc="atomic graph mode: how the ways split a batch")
    systems_path: Optional[str] = key(None, doc="atomic models: results/data/<dataset>/systems.h5")
    locality_path: Optional[str] = key(None, doc=(
        "node runs with training.node_order locality: the order computed once per graph, "
        "results/partitions/<dataset>/locality.npz (rule locality); without the file it is computed"))

    @property
    def atomic(self) -> bool:
        """The run's dataset is of kind ``atoms`` (``resolve_run`` gives such runs their systems.h5)."""
        return self.systems_path is not None

    def check(self, path: str) -> None:
        if self.atomic != self.model.atomic:  # a run.yaml written by hand
            raise ConfigError(f"{path}: model kind {self.model.kind} on "
                              f"{'an atoms' if self.atomic else 'a node'} dataset ({self.dataset_name}): "
                              f"atoms datasets train {', '.join(ATOMIC_SPECS)}, node datasets the others")


# --------------------------------------------------------------------------- value checks
# File and directory paths of each section. Any character but a control character (a newline
# in a path breaks logs and shells; spaces and quotes are fine, the rules quote every path);
# in the workflow config, not { or } either: Snakemake reads them as wildcards in the rules' paths.
PATHS: dict[type, tuple[str, ...]] = {
    WorkflowConfig: ("results",),
    OgbConfig: ("root",),
    FilesConfig: ("edges", "features", "labels", "train_mask", "val_mask", "test_mask"),
    AtomsConfig: ("file", "split_file"),
    ModelConfig: ("init_from",),
    CostModelConfig: ("hardware",),
    RunConfig: ("graph_path", "store_path", "out_dir", "systems_path", "locality_path"),
}
# Outputs never go here (a typo or a `..` too many in `results:` must not write into the
# system). Anything else, relative or absolute, is the user's choice (cluster scratch).
SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc",
               "/run", "/sbin", "/sys", "/usr")


def check_name(value: str, where: str) -> None:
    if not re.fullmatch(NAME_PATTERN, value):
        raise ConfigError(f"{where}: {value!r} is not a valid name (letters, digits, '.', '_', '-', "
                          f"starting with a letter or digit; it is used in paths)")


def check_path(value: str, where: str, *, snakemake: bool) -> None:
    """Refuse a path with a control character (and, for Snakemake's paths, a brace)."""
    bad = next((c for c in value if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise ConfigError(f"{where}: {value!r} contains the control character {bad!r}; a path may "
                          f"hold spaces and punctuation, not control characters")
    if snakemake and ("{" in value or "}" in value):
        raise ConfigError(f"{where}: {value!r} contains {{ or }}, which Snakemake reads as a wildcard "
                          f"in the rules' paths; rename it")


def check_output_dir(value: str, where: str) -> None:
    """Refuse an empty output directory, one that lies in (or is) a system directory, and one that
    is (or lies under) a file."""
    if not value:
        raise ConfigError(f"{where}: must not be empty")
    resolved = Path(value).resolve()
    there = next((p for p in (resolved, *resolved.parents) if p.exists()), None)
    if there is not None and not there.is_dir():
        raise ConfigError(f"{where}: {value!r} is {'' if there == resolved else 'under '}the file {there}, not a "
                          f"directory; name a directory for the outputs (or move that file)")
    for d in SYSTEM_DIRS:
        system = Path(d).resolve()
        if resolved == Path("/") or resolved == system or system in resolved.parents:
            raise ConfigError(f"{where}: {value!r} lies in the system directory {d} (resolves to "
                              f"{resolved}); write outputs under a directory of your own")


def _check_values(obj, path: str) -> None:
    """The bounds of ``obj``'s numeric fields (``None``: the default of the shape / mode)."""
    for name, bound in bounds(type(obj)).items():
        v = getattr(obj, name)
        if v is not None and not bound.ok(v):
            key = "lambda" if name == "lambda_" else name
            raise ConfigError(f"{path}.{key}: {v!r} must be {bound.text()}")
    for name in PATHS.get(type(obj), ()):
        v = getattr(obj, name)
        if v:
            check_path(v, f"{path}.{name}", snakemake=not isinstance(obj, RunConfig))
    if isinstance(obj, RunSpec) and obj.name is not None:
        check_name(obj.name, f"{path}.name")
    if isinstance(obj, RunConfig):
        check_name(obj.run_id, f"{path}.run_id")
        check_output_dir(obj.out_dir, f"{path}.out_dir")
    if isinstance(obj, WorkflowConfig):
        check_output_dir(obj.results, f"{path}.results")
        for section in ("datasets", "models"):
            for key in getattr(obj, section):
                check_name(key, f"{path}.{section}.{key}")
    if isinstance(obj, CostModelConfig) and not obj.hardware:
        raise ConfigError(f"{path}.hardware: must not be empty")


# --------------------------------------------------------------------------- building
_RENAMES = {"lambda": "lambda_"}  # YAML keys that are Python keywords


def from_dict(cls, data: Any, path: str = "config"):
    """Build dataclass ``cls`` from plain data, raising ``ConfigError`` on any mismatch."""
    return _convert(cls, data, path)


def _convert(tp, value, path):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        kwargs = {}
        for key, v in value.items():
            attr = _RENAMES.get(key, key)
            if attr not in names:
                known = ", ".join(sorted(k if k != "lambda_" else "lambda" for k in names))
                raise ConfigError(f"{path}: unknown key {key!r} (known: {known})")
            if v is None and dataclasses.is_dataclass(hints[attr]):  # a section that may not be null
                raise ConfigError(f"{path}.{key}: expected a mapping, got null; remove the key to keep its "
                                  "defaults")
            kwargs[attr] = _convert(hints[attr], v, f"{path}.{key}")
        missing = [f.name for f in dataclasses.fields(tp)
                   if f.name not in kwargs and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"{path}: missing required key(s) {', '.join(missing)}")
        obj = tp(**kwargs)
        _check_values(obj, path)
        check = getattr(obj, "check", None)
        if check:
            check(path)
        return obj
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, path)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return {str(k): _convert(args[1], v, f"{path}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        return [_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        if not -2**63 <= value < 2**63:  # every consumer (torch, NumPy, C) holds at most 64 bits
            raise ConfigError(f"{path}: {value} does not fit in 64 bits")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp} at {path}")


def to_dict(obj) -> dict:
    """Plain data for YAML/MLflow, with YAML key names (``lambda``)."""
    def rename(d):
        if isinstance(d, dict):
            return {("lambda" if k == "lambda_" else k): rename(v) for k, v in d.items()}
        if isinstance(d, list):
            return [rename(v) for v in d]
        return d
    return rename(dataclasses.asdict(obj))


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (for MLflow params)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def load_yaml(path: str | Path) -> Any:
    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None


# --------------------------------------------------------------------------- the JSON schema
#: Where the generated schema is committed (a source checkout; an installed package has no workflow/).
SCHEMA_FILE = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "config.schema.yaml"
SCHEMA_HEADER = """\
# GENERATED from the config dataclasses (gnnpipe.config.json_schema, src/gnnpipe/config.py): do not edit.
# Regenerate after changing a config key: python -m gnnpipe.config --write-schema
# (tests/test_workflow.py fails while this file differs from what the dataclasses generate).
# gnnpipe.config.load_workflow_config, the one judge of a config (gnnpipe runs and common.smk alike),
# checks the dataclasses and then this schema, generated in memory; this file is for readers and tools.
"""
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def _doc(obj) -> str:
    """A docstring as one line (none for the signature ``dataclass`` writes when there is none)."""
    doc = obj.__doc__ or ""
    return "" if doc.startswith(f"{obj.__name__}(") else " ".join(doc.split())


def _type_schema(tp, defs: dict) -> dict:
    """The JSON schema of a field type; nested dataclasses go to ``defs`` by class name."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if tp.__name__ not in defs:
            defs[tp.__name__] = {}  # taken before recursing
            defs[tp.__name__] = _object_schema(tp, defs)
        return {"$ref": f"#/$defs/{tp.__name__}", "type": "object"}  # the type here: it may be made nullable
    if origin is Literal:
        return {"type": "string", "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        inner, = [a for a in args if a is not type(None)]
        out = _type_schema(inner, defs)
        out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
        return out
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(args[1], defs)}
    if origin is list:
        return {"type": "array", "items": _type_schema(args[0], defs)}
    return {"type": _JSON_TYPES[tp]}


def _object_schema(cls, defs: dict) -> dict:
    """A config dataclass as a closed JSON object: each field's type, bound, default (leaves only: an
    absent section takes the dataclass defaults), extra keywords and doc; its required keys."""
    hints, props, required = typing.get_type_hints(cls), {}, []
    for f in dataclasses.fields(cls):
        name = "lambda" if f.name == "lambda_" else f.name
        prop = _type_schema(hints[f.name], defs)
        if "bound" in f.metadata:
            prop.update(f.metadata["bound"].schema())
        for k, v in f.metadata.get("schema", {}).items():
            prop[k] = {**prop[k], **v} if k == "items" else v
        if f.default is not dataclasses.MISSING and f.default is not None:
            prop["default"] = f.default
        if f.metadata.get("doc"):
            prop["description"] = f.metadata["doc"]
        props[name] = prop
        if f.metadata.get("required") or (f.default is dataclasses.MISSING
                                          and f.default_factory is dataclasses.MISSING):
            required.append(name)
    out = {"description": _doc(cls)} if _doc(cls) else {}
    out.update(additionalProperties=False, properties=props)
    if required:
        out["required"] = required
    return out


def json_schema() -> dict:
    """The workflow config's JSON schema (draft 2020-12), generated from the dataclasses: types
    (Optional: null allowed; Literal: an enum, model kinds from the registries), defaults, bounds,
    the extra keywords and docs of each field's metadata (``key``); every section is closed."""
    defs: dict = {}
    root = _object_schema(WorkflowConfig, defs)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "GNNPipe workflow config",
            "type": "object", **root, "$defs": dict(sorted(defs.items()))}


def schema_text() -> str:
    """``json_schema()`` as the committed file's text (``workflow/schemas/config.schema.yaml``)."""
    return SCHEMA_HEADER + yaml.dump(json_schema(), Dumper=_PlainDumper, sort_keys=False, allow_unicode=True,
                                     width=110, default_flow_style=None)


class _PlainDumper(yaml.SafeDumper):
    """YAML without anchors and aliases (a keyword object used twice is written twice)."""

    def ignore_aliases(self, data) -> bool:
        return True


def write_schema(path: str | Path = SCHEMA_FILE) -> Path:
    """Write ``schema_text()`` to ``path`` (default: this checkout's workflow/schemas/config.schema.yaml)."""
    Path(path).write_text(schema_text())
    return Path(path)


def schema_error_line(err) -> str:
    """One line naming the offending key, from a ``jsonschema.ValidationError``."""
    where = "config" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        known = sorted(err.schema.get("properties", {}))
        extra = sorted(set(err.instance) - set(known))
        return (f"{where}.{extra[0]}: unknown key (known: {', '.join(known)})"
                if extra else f"{where}: {err.message}")
    if err.validator == "required":
        return f"{where}: missing required key ({err.message})"
    if err.validator == "type" and err.instance is None:
        return f"{where}: expected {err.validator_value}, got null; remove the key to keep its default"
    return f"{where}: {err.message}"


def check_schema(data: Any) -> None:
    """The workflow config against its JSON schema: the second half of the one judge
    (``load_workflow_config``), so that ``gnnpipe runs`` and Snakemake refuse the same configs."""
    import jsonschema

    schema = json_schema()
    err = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schema)(schema).iter_errors(data))
    if err is not None:
        raise ConfigError(schema_error_line(err))


def load_workflow_config(data: dict | str | Path) -> WorkflowConfig:
    """The workflow config, checked by the dataclasses (``from_dict``), the cross-checks below and
    the JSON schema (``check_schema``): the one judge of a workflow config; Snakemake's
    ``common.smk`` calls it and validates nothing of its own."""
    if not isinstance(data, dict):
        path, data = data, load_yaml(data)
        if data is None:  # an empty file (or only comments): not a config of no runs
            raise ConfigError(f"{path}: empty; a workflow config names its datasets, models and runs "
                              "(config/config.yaml is an example)")
    wf = from_dict(WorkflowConfig, data)
    for name, model in wf.models.items():  # a key of another kind, given at all (the default too)
        refuse_other_kinds(model.kind, data["models"][name] or {}, f"config.models.{name}")
        _check_init_from(model, data["models"][name] or {}, f"config.models.{name}")
    for i, run in enumerate(wf.runs):
        where = f"config.runs[{i}]"
        if run.dataset not in wf.datasets:
            raise ConfigError(f"{where}.dataset: {run.dataset!r} is not in datasets "
                              f"({', '.join(wf.datasets) or 'none defined'})")
        if run.model not in wf.models:
            raise ConfigError(f"{where}.model: {run.model!r} is not in models "
                              f"({', '.join(wf.models) or 'none defined'})")
        atoms_data = wf.datasets[run.dataset].kind == "atoms"
        if atoms_data != wf.models[run.model].atomic:
            raise ConfigError(f"{where}: dataset {run.dataset!r} ({wf.datasets[run.dataset].kind}) and model "
                              f"{run.model!r} ({wf.models[run.model].kind}) do not fit: atoms datasets train "
                              f"atomic models ({', '.join(ATOMIC_SPECS)}), node datasets the others")
        if atoms_data:
            _check_cutoff(wf, run, where)
        if atoms_data and run.mode not in ("single", "graph"):
            raise ConfigError(f"{where}.mode: atomic models train in mode single or graph (edge/triplet "
                              f"graph parallelism), not {run.mode}")
        _refuse_ignored_keys(run, atoms_data, where)
        _check_workers(wf, run, where)
    ids = [run_id(wf, r) for r in wf.runs]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise ConfigError(f"config.runs: run ids are not unique: {', '.join(sorted(dup))} "
                          "(give the runs distinct seeds or names)")
    check_schema(data)
    return wf


def _check_init_from(model: ModelConfig, raw: dict, where: str) -> None:
    """``init_from``: the model file exists, and the section leaves what the file fixes unset (its
    preset, sizes, force head, cutoff: the file's are taken, gnnpipe.atomic.modelfile.load_init)."""
    if not model.init_from:
        return
    section = raw.get(model.kind) or {}
    fixed = ["preset", *(f.name for f in dataclasses.fields(ATOMIC_CONFIGS[model.kind]))]
    given = next((k for k in section if k in fixed), None)
    if given is not None:
        raise ConfigError(f"{where}.{model.kind}.{given}: init_from takes the architecture (preset, sizes, force "
                          f"head, cutoff) from the model file {model.init_from}; remove the key")
    if not Path(model.init_from).is_file():
        raise ConfigError(f"{where}.init_from: {model.init_from}: no such file; name a model file (gnnpipe "
                          "import-model's, or a finished run's model.pt)")


def _check_workers(wf: WorkflowConfig, run: RunSpec, where: str) -> None:
    """More parts (workers, chunks) than a synthetic graph has nodes, or more workers on one node than
    ``WORKERS_PER_CPU`` per CPU of this machine: refused before any job starts."""
    ds = wf.datasets[run.dataset]
    nodes, size_key = (ds.synthetic.num_nodes if ds.kind == "synthetic" else None), "num_nodes"
    if ds.kind == "synthetic" and ds.synthetic.generator == "rmat":
        nodes, size_key = 2 ** ds.synthetic.rmat.scale, "rmat.scale"
    if nodes is not None:
        _, _, ways, chunks = run_layout(wf, run)
        if max(ways, chunks) > nodes:
            raise ConfigError(f"{where}: {max(ways, chunks)} parts (workers or chunks) of the {nodes}-node graph "
                              f"{run.dataset!r} (datasets.{run.dataset}.synthetic.{size_key}) leave some empty; use "
                              f"at most {nodes}")
    per_node = min(run.workers, wf.resources.workers_per_node or run.workers)
    if run.workers % per_node:
        raise ConfigError(f"config.resources.workers_per_node: run {run_id(wf, run)} has {run.workers} workers, "
                          f"not a multiple of {per_node}")
    cpus = os.cpu_count() or 1
    if per_node > WORKERS_PER_CPU * cpus:
        raise ConfigError(f"{where}.workers: {per_node} workers on one node, more than the {WORKERS_PER_CPU * cpus} "
                          f"({WORKERS_PER_CPU} per CPU, {cpus} CPUs here) gnnpipe starts on one machine; use fewer, "
                          "or spread them over nodes with resources.workers_per_node")


def _check_cutoff(wf: WorkflowConfig, run: RunSpec, where: str) -> None:
    """An atomic model's basis cutoff may not exceed its dataset's graphs' (the neighbours beyond
    are not in graphs.h5); the engine checks again against the file."""
    model, atoms = wf.models[run.model], wf.datasets[run.dataset].atoms
    cutoff = model.spec.cutoff
    if cutoff is not None and cutoff > atoms.cutoff:
        raise ConfigError(f"{where}: model {run.model!r} has cutoff {cutoff:g} Å, larger than the graphs of dataset "
                          f"{run.dataset!r} (atoms.cutoff {atoms.cutoff:g} Å): they lack the neighbours between; "
                          f"raise datasets.{run.dataset}.atoms.cutoff or lower models.{run.model}.{model.kind}.cutoff")


def _refuse_ignored_keys(run: RunSpec, atomic: bool, where: str) -> None:
    """A key the run's mode would ignore is a mistake the user should hear about (it would
    also enter the run id or run.yaml without changing what trains)."""
    kind = f"{'an atomic' if atomic else 'a'} {run.mode} run"
    staged = run.mode in ("pipeline", "hybrid") and not atomic
    if run.data_parallel is not None and not (atomic and run.mode == "graph"):
        raise ConfigError(f"{where}.data_parallel: {kind} has no data-parallel replicas (only atomic "
                          f"runs in mode graph do); remove the key")
    if run.atom_layout is not None and not (atomic and run.mode == "graph"):
        raise ConfigError(f"{where}.atom_layout: {kind} has no atomic graph layout (only atomic runs in "
                          f"mode graph do); remove the key")
    for key in ("stages", "chunks", "pipeline"):
        if getattr(run, key) is not None and not staged:
            raise ConfigError(f"{where}.{key}: {kind} has no pipeline stages or chunks (only pipeline and "
                              f"hybrid runs of node models do); remove the key")
    if run.mode == "pipeline" and run.stages is not None and run.stages != run.workers:
        raise ConfigError(f"{where}.stages: a pipeline run has one stage per worker ({run.workers}), not "
                          f"{run.stages}; remove the key, or use mode hybrid for stages x ways")


def run_pipeline(wf: WorkflowConfig, spec: RunSpec) -> PipelineConfig:
    """The workflow's pipeline settings with the run's own overrides merged over them."""
    if not spec.pipeline:
        return wf.pipeline
    own = {k: v for k, v in dataclasses.asdict(spec.pipeline).items() if v is not None}
    return dataclasses.replace(wf.pipeline, **own)


def run_layout(wf: WorkflowConfig, spec: RunSpec) -> tuple[int, int, int, int]:
    """(workers, stages, ways, chunks) of a run, with the mode's defaults, validated
    (``gnnpipe.layout.resolve_layout``: the rules every engine and the plan share)."""
    if spec.mode == "graph" and wf.datasets[spec.dataset].kind == "atoms":  # ways x replicas, no chunks
        p, d = spec.workers, spec.data_parallel or 1
        if p < 1 or d < 1 or p % d:
            raise ConfigError(f"run graph/{spec.dataset}/{spec.model}: workers ({p}) must be a multiple of "
                              f"data_parallel ({d})")
        return p, 1, p // d, 1
    try:
        return resolve_layout(spec.mode, spec.workers, stages=spec.stages, chunks=spec.chunks,
                              chunks_per_stage=run_pipeline(wf, spec).chunks_per_stage,
                              layers=wf.models[spec.model].layers,
                              where=f"run {spec.mode}/{spec.dataset}/{spec.model}")
    except ConfigError:
        raise
    except GnnPipeError as e:
        raise ConfigError(str(e)) from None


def run_id(wf: WorkflowConfig, spec: RunSpec) -> str:
    if spec.name:
        return spec.name
    p, s, g, c = run_layout(wf, spec)
    seed = spec.seed if spec.seed is not None else wf.training.seed
    layout = {"single": "p1", "graph": f"p{p}", "pipeline": f"s{s}c{c}",
              "hybrid": f"s{s}g{g}c{c}"}[spec.mode]
    if (spec.data_parallel or 1) > 1:
        layout += f"d{spec.data_parallel}"
    if spec.atom_layout in ("atoms", "domains"):
        layout += spec.atom_layout
    return f"{spec.dataset}-{spec.model}-{spec.mode}-{layout}-seed{seed}"


def store_path(results: str, dataset: str, method: str, parts: int) -> str:
    return f"{results}/chunks/{dataset}/{method}-{parts}.h5"


def locality_path(results: str, dataset: str) -> str:
    return f"{results}/partitions/{dataset}/locality.npz"


def resolve_run(wf: WorkflowConfig, spec: RunSpec) -> RunConfig:
    p, s, g, c = run_layout(wf, spec)
    rid = run_id(wf, spec)
    training = dataclasses.replace(
        wf.training,
        seed=spec.seed if spec.seed is not None else wf.training.seed,
        epochs=spec.epochs if spec.epochs is not None else wf.training.epochs,
    )
    atomic = wf.datasets[spec.dataset].kind == "atoms"
    store = None if spec.mode == "single" or atomic else store_path(wf.results, spec.dataset,
                                                                     wf.partitioning.method, c)
    data = f"{wf.results}/data/{spec.dataset}"
    return RunConfig(
        run_id=rid, mode=spec.mode, dataset_name=spec.dataset,
        graph_path=f"{data}/graphs.h5" if atomic else f"{data}/graph.h5", store_path=store,
        systems_path=f"{data}/systems.h5" if atomic else None,
        data_parallel=(spec.data_parallel or 1) if atomic else 1,
        atom_layout=spec.atom_layout or "edges",
        locality_path=None if atomic or training.node_order != "locality" else locality_path(wf.results, spec.dataset),
        out_dir=f"{wf.results}/runs/{rid}", model=wf.models[spec.model], training=training,
        partitioning=wf.partitioning, pipeline=run_pipeline(wf, spec), graph_parallel=wf.graph_parallel,
        workers=p, stages=s, ways=g, chunks=c,
    )


def resolve_runs(wf: WorkflowConfig) -> dict[str, RunConfig]:
    return {run_id(wf, r): resolve_run(wf, r) for r in wf.runs}


def load_run_config(path: str | Path) -> RunConfig:
    """A run's ``run.yaml``. Its data and output paths are relative to the workflow's directory (where
    Snakemake ran): read from inside its own run directory (``<root>/<out_dir>/run.yaml``) from elsewhere
    (a calculator or ``gnnpipe predict --run`` started in another directory), they are taken relative to
    that ``<root>``, never to the current directory, which may hold another workflow's files."""
    cfg = from_dict(RunConfig, load_yaml(path), path=str(path))
    return _rooted(cfg, Path(path).parent)


def _rooted(cfg: RunConfig, run_dir: Path) -> RunConfig:
    out = Path(cfg.out_dir)
    if out.is_absolute() or not out.parts:
        return cfg
    here = run_dir.absolute()
    if here.parts[-len(out.parts):] != out.parts:
        return cfg  # not inside its own run directory (a copied run.yaml): paths as written
    root = Path(*here.parts[:-len(out.parts)])
    if root == Path.cwd():
        return cfg
    return dataclasses.replace(cfg, **{k: str(root / v) for k in PATHS[RunConfig]
                                       if (v := getattr(cfg, k)) and not Path(v).is_absolute()})


def dump_run_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


if __name__ == "__main__":  # python -m gnnpipe.config --write-schema [PATH]
    import argparse

    from gnnpipe.config import SCHEMA_FILE as _FILE, write_schema as _write  # the package's classes, not __main__'s

    parser = argparse.ArgumentParser(prog="python -m gnnpipe.config",
                                     description="Write the workflow config's JSON schema, generated from the dataclasses.")
    parser.add_argument("--write-schema", nargs="?", const=str(_FILE), metavar="PATH", required=True,
                        help=f"the file to write (default: {_FILE})")
    print(f"wrote {_write(parser.parse_args().write_schema)}")
