"""Import a fairchem 1.x checkpoint (GemNet-T / -dT / -XL, DimeNet++) as the project's model file.

    gnnpipe import-model --from fairchem CKPT [--config fairchem.yml] [--scale-file scales.json] --out model.pt

**What a fairchem checkpoint holds** (``trainers/base_trainer.py``, ``save``)::

    {"state_dict": {name: tensor},          # "module." once (DataParallel) or twice (DDP) in front
     "config": {"model": {"name": "gemnet_t", sizes..., "cutoff", "max_neighbors", "otf_graph",
                          "use_pbc", "regress_forces", "direct_forces", "scale_file"}, ...}
               # older checkpoints: "model": "gemnet_t" and the sizes under "model_attributes"
     "normalizers": {"energy"|"target": {"mean", "rmsd"|"std"}, "forces"|"grad_target": {...}},
     "elementrefs": {"energy": {"element_references": (Z_max + 1,)}},   # fairchem >= 1.2, optional
     "ema": {"decay", "num_updates", "shadow_params": [tensor], ...} or None,   # checkpoint.pt only
     "scale_dict": {name: value},            # optional; overrides the model's factors
     "optimizer", "scheduler", "amp", "epoch", "step", "val_metrics", ...}

**Safe loading**: ``torch.load(weights_only=True)`` with an explicit allow-list (:data:`SAFE_GLOBALS`:
numpy scalars, dtypes and arrays, which metrics and configs may hold), scoped to the one load; a
checkpoint that needs any other global is refused in one line naming it. Never ``weights_only=False``.

**Weights**: the EMA shadow weights when the checkpoint has them (fairchem evaluates with them;
``shadow_params`` is the list of ``model.parameters()`` with ``requires_grad``, in order), else
``state_dict``. Names are mapped role by role (:data:`GEMNET_RENAMES`; DimeNet++'s are PyG's, the
project's too). Every fairchem key maps to exactly one parameter and every parameter is filled,
or the import is refused in one line naming the keys. Specials:

* GemNet's element embedding: fairchem's row ``z - 1`` is the project's row ``z`` (row 0: zeros,
  no element has Z = 0); the project's model gets ``num_elements + 1`` rows;
* GemNet's scale factors: from the state dict, then ``scale_dict``, then ``--scale-file`` (JSON
  or a torch file of name -> value, fairchem's names ``TripInteraction_1_had_rbf``, ...). A fitted
  value that a later source contradicts is refused (fairchem's consistency check); a factor that no
  source fits (0 in fairchem: *not fitted*, skipped) is the identity here (1.0). Names the model
  does not have (``gemnet-xl.json``'s six ``IntBlock_k_sum``) are reported as ignored, as fairchem
  logs them;
* the Gaussian centres (``...rbf.offset``, buffers) are checked against ``linspace(0, 1, R)``; the
  model keeps their precision (``GemNetTConfig.gaussian_centres``: a float32 checkpoint's centres are
  float32 numbers, and fairchem's model reads them so even in float64, its width their float32 spacing);
* ``OutputBlock.seq_energy`` is an alias of ``layers`` (two keys, one tensor): both must agree.

**Normaliser** (fairchem's ``Normalizer.denorm``): ``E = rmsd_E · y + mean_E (+ Σ elementref[z])``,
``F = rmsd_F · f`` — the model file's ``{"scale", "mean", "force_scale", "e_ref"}``. A non-zero
force mean is refused (no published model has one).

**Provenance**: the payload's ``origin`` names the checkpoint, the fairchem model, which weights
were taken, the factors ignored, and what the energies are (``ENERGY_MEANING``: OC20 S2EF models
predict adsorption energies, referenced, as they were trained); ``neighbors: "fairchem"`` says the
graphs must be built the way fairchem builds them (``radius_graph_pbc`` + ``reorder_symmetric_edges``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..io import GnnPipeError, empty_file
from . import modelfile

#: fairchem's registered model names -> the project's kind
MODELS = {"gemnet_t": "gemnet_t", "gp_gemnet_t": "gemnet_t", "dimenetplusplus": "dimenetpp",
          "dimenet_plus_plus": "dimenetpp"}
#: what an imported model's energies are (the model file records it; the calculator's user reads it)
ENERGY_MEANING = ("as the checkpoint was trained (OC20 S2EF checkpoints: adsorption energies, referenced to "
                  "the clean slab and gas-phase references, eV)")


def energy_reference(config: dict) -> str:
    """What a fairchem checkpoint's energies are (``modelfile.ENERGY_REFERENCES``), from its config:
    ``total`` where it names OC22 (whose S2EF targets are total energies) or sets a ``*total_energies``
    key true (fairchem's ``train_on_oc20_total_energies``), else ``oc20-adsorption`` (what fairchem 1.x's
    GemNet-T/-dT/-XL and DimeNet++ checkpoints of OC20 S2EF predict)."""
    def total(node) -> bool:
        if isinstance(node, dict):
            return any((str(k).endswith("total_energies") and v is True) or total(v) for k, v in node.items())
        if isinstance(node, (list, tuple)):
            return any(total(v) for v in node)
        return isinstance(node, str) and "oc22" in node.lower()
    return "total" if total(config) else "oc20-adsorption"


#: GemNet: fairchem key (prefixes stripped) -> the project's, rule by rule (first match)
GEMNET_RENAMES = [
    (r"^atom_emb\.embeddings\.weight$", "atom_emb.weight"),
    (r"\.trip_interaction\.", ".trip."),
    (r"\.trip\.down_projection\.", ".trip.down."),
    (r"\.trip\.up_projection_(ca|ac)\.", r".trip.up_\1."),
    (r"\.trip\.mlp_cbf\.weight$", ".trip.bilinear.weight"),
    (r"\.concat_layer\.", ".concat."),
    (r"\.(layers|seq_energy)\.(\d+)\.dense_mlp\.", r".mlp.\2.mlp."),
    (r"\.(layers|seq_energy)\.0\.linear\.", ".mlp.0.linear."),
    (r"\.seq_forces\.(\d+)\.dense_mlp\.", r".mlp_forces.\1.mlp."),
    (r"\.seq_forces\.0\.linear\.", ".mlp_forces.0.linear."),
    (r"\.scale_rbf_F\.", ".scale_rbf_forces."),
    (r"\.dense_rbf_F\.", ".dense_rbf_forces."),
    (r"\.(layers_before_skip|layers_after_skip|residual_m)\.(\d+)\.dense_mlp\.", r".\1.\2.mlp."),
]
#: GemNet: the Gaussian centres (buffers of PyG's GaussianSmearing): derived, checked, not weights
GEMNET_OFFSETS = ("radial_basis.rbf.offset", "cbf_basis3.radial_basis.rbf.offset")
#: fairchem's scale-factor names -> the project's state-dict key ({i}: the block)
SCALE_NAMES = [
    (r"^TripInteraction_(\d+)_had_rbf$", "int_blocks.{i1}.trip.scale_rbf.scale_factor"),
    (r"^TripInteraction_(\d+)_sum_cbf$", "int_blocks.{i1}.trip.scale_cbf_sum.scale_factor"),
    (r"^AtomUpdate_(\d+)_sum$", "int_blocks.{i1}.atom_update.scale_sum.scale_factor"),
    (r"^OutBlock_(\d+)_sum$", "out_blocks.{i}.scale_sum.scale_factor"),
    (r"^OutBlock_(\d+)_had$", "out_blocks.{i}.scale_rbf_forces.scale_factor"),
]
#: the sizes fairchem's config holds that the project's config has under the same name
GEMNET_SIZES = ("num_spherical", "num_radial", "num_blocks", "emb_size_atom", "emb_size_edge", "emb_size_trip",
                "emb_size_rbf", "emb_size_cbf", "emb_size_bil_trip", "num_before_skip", "num_after_skip",
                "num_concat", "num_atom", "cutoff")
DIMENETPP_SIZES = ("hidden_channels", "num_blocks", "int_emb_size", "basis_emb_size", "out_emb_channels",
                   "num_spherical", "num_radial", "cutoff", "envelope_exponent", "num_before_skip",
                   "num_after_skip", "num_output_layers")
#: fairchem's defaults where its config may omit a key (GemNetT / DimeNetPlusPlusWrap signatures)
DEFAULTS = {"gemnet_t": {"max_neighbors": 50, "cutoff": 6.0, "num_elements": 83, "direct_forces": False,
                         "regress_forces": True, "extensive": True, "otf_graph": False, "use_pbc": True},
            "dimenetpp": {"max_neighbors": 50, "cutoff": 10.0, "regress_forces": True, "otf_graph": False,
                          "use_pbc": True, "hidden_channels": 128, "num_blocks": 4, "int_emb_size": 64,
                          "basis_emb_size": 8, "out_emb_channels": 256, "num_spherical": 7, "num_radial": 6,
                          "envelope_exponent": 5, "num_before_skip": 1, "num_after_skip": 2,
                          "num_output_layers": 3}}


def _safe_globals() -> list:
    """numpy scalars, dtypes and arrays (metrics, configs), under numpy 1's and 2's module names."""
    from numpy import dtypes
    scalar = np._core.multiarray.scalar if hasattr(np, "_core") else np.core.multiarray.scalar
    rebuild = np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct
    out = [np.dtype, np.ndarray, scalar, rebuild, (scalar, "numpy.core.multiarray.scalar"),
           (rebuild, "numpy.core.multiarray._reconstruct")]
    out += [getattr(dtypes, n) for n in ("Float64DType", "Float32DType", "Int64DType", "Int32DType", "BoolDType")]
    return out


def safe_load(path, what: str = "checkpoint"):
    """``torch.load(weights_only=True)`` with the allow-list, scoped to this load (one-line refusals)."""
    from ..checkpoint import unreadable
    path = Path(path)
    if not path.is_file():
        raise GnnPipeError(f"{path}: no such {what} file")
    if empty_file(path):
        raise GnnPipeError(f"{path}: empty (0 bytes: a download or copy cut short?), not a torch {what}")
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling errors, truncated zips, not a torch file at all
        text = str(e)
        glob = re.search(r"GLOBAL ([\w.]+)", text)
        if glob:
            raise GnnPipeError(f"{path}: the {what} needs {glob.group(1)}, which is not on the allow-list of "
                               "safe types (tensors, plain Python, numpy scalars and arrays); it is not loaded "
                               "(loading it could run code): save its state_dict and config as plain "
                               "types") from None
        raise GnnPipeError(f"{path}: not a torch {what} ({unreadable(path, e)})") from None


def read_checkpoint(path) -> dict:
    """The checkpoint's dict (a bare state dict becomes ``{"state_dict": ...}``), loaded safely."""
    state = safe_load(path)
    if isinstance(state, dict) and state and all(isinstance(v, torch.Tensor) for v in state.values()):
        state = {"state_dict": state}  # a bare state dict: the config comes from --config
    if not isinstance(state, dict) or not isinstance(state.get("state_dict"), dict):
        got = f"a dict with keys {', '.join(map(str, list(state)[:6]))}" if isinstance(state, dict) \
            else f"a {type(state).__name__}"
        raise GnnPipeError(f"{path}: not a fairchem checkpoint (no 'state_dict'; it holds {got})")
    return state


def model_section(config: Optional[dict], where: str) -> tuple[str, dict]:
    """(fairchem model name, its attributes) from a fairchem config: ``model: {name: ..., ...}``
    (fairchem >= 1.0) or ``model: name`` with ``model_attributes`` (older)."""
    model = (config or {}).get("model")
    if isinstance(model, dict):
        name, attrs = model.get("name"), {k: v for k, v in model.items() if k != "name"}
    else:
        name, attrs = model, dict((config or {}).get("model_attributes") or {})
    if not isinstance(name, str):
        raise GnnPipeError(f"{where}: no model name in its config (model.name or model); give the training "
                           "config with --config fairchem.yml")
    if name.lower() not in MODELS:
        raise GnnPipeError(f"{where}: fairchem model {name!r} is not importable (importable: "
                           f"{', '.join(sorted(MODELS))})")
    return name.lower(), attrs


def project_config(name: str, attrs: dict, where: str):
    """The project's config dataclass of fairchem model ``name`` with ``attrs`` (refuses what the
    project's model does not compute: another basis, envelope, activation, intensive energies)."""
    from .protocol import ATOMIC_MODELS
    kind = MODELS[name]
    a = {**DEFAULTS[kind], **attrs}
    if kind == "gemnet_t":
        checks = {"rbf": ("name", "gaussian"), "envelope": ("name", "polynomial"),
                  "cbf": ("name", "spherical_harmonics")}
        for key, (field, want) in checks.items():
            got = (a.get(key) or {field: want}).get(field, want)
            if str(got).lower() != want:
                raise GnnPipeError(f"{where}: model.{key}.name {got!r}: the project's GemNet computes {want} only")
        if str(a.get("activation", "silu")).lower() not in ("silu", "swish"):
            raise GnnPipeError(f"{where}: model.activation {a['activation']!r}: the project's GemNet uses silu")
        if not a.get("extensive", True):
            raise GnnPipeError(f"{where}: model.extensive false (mean energies): the project's energies are sums")
        missing = [k for k in GEMNET_SIZES if k not in a]
        if missing:
            raise GnnPipeError(f"{where}: model config lacks {', '.join(missing)}; give the training config "
                               "with --config fairchem.yml")
        cfg = ATOMIC_MODELS[kind].config(
            **{k: a[k] for k in GEMNET_SIZES}, envelope_exponent=int((a.get("envelope") or {}).get("exponent", 5)),
            num_elements=int(a["num_elements"]) + 1, force_head="direct" if a.get("direct_forces") else "gradient")
    else:
        a["max_neighbors"] = 50  # DimeNetPlusPlusWrap fixes it, whatever its config says
        cfg = ATOMIC_MODELS[kind].config(**{k: a[k] for k in DIMENETPP_SIZES}, force_head="gradient",
                                         output_up_bias=True, angle_gradient=False)
    cfg.cutoff = float(cfg.cutoff)
    return kind, cfg, a


# --------------------------------------------------------------------------- weights
def strip_prefix(state_dict: dict) -> dict:
    """Keys without the one or two ``module.`` prefixes of (Distributed)DataParallel."""
    out = {}
    for k, v in state_dict.items():
        while k.startswith("module."):
            k = k[len("module."):]
        out[k] = v
    return out


def gemnet_key(key: str) -> str:
    for pattern, repl in GEMNET_RENAMES:
        key = re.sub(pattern, repl, key)
    return key


def trainable_keys(kind: str, keys) -> list[str]:
    """The fairchem keys of ``model.parameters()`` with ``requires_grad``, in order (the EMA's
    ``shadow_params`` order): not the scale factors (frozen), the Gaussian centres (buffers) or an
    alias (``seq_energy``)."""
    if kind == "dimenetpp":
        return list(keys)
    return [k for k in keys if not k.endswith("scale_factor") and k not in GEMNET_OFFSETS
            and ".seq_energy." not in k]


def missing_keys(missing: list, kind: str, where: str) -> GnnPipeError:
    return GnnPipeError(f"{where}: {len(missing)} parameter(s) of the project's {kind} have no weights in the "
                        f"checkpoint: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")


def check_names(sd: dict, target: dict, kind: str, where: str) -> None:
    """Refuse unknown and missing names before the EMA is read: its count check would otherwise speak
    for them (one key too many was refused as "the EMA has 88 shadow weights for the model's 89
    trainable parameters", naming no key). Scale factors may come from other sources (``fill_scales``)."""
    names = {k: gemnet_key(k) for k in sd if k not in GEMNET_OFFSETS} if kind == "gemnet_t" else {k: k for k in sd}
    unknown = [k for k, name in names.items() if name not in target]
    if unknown:
        model = "GemNet" if kind == "gemnet_t" else "DimeNet++"
        raise GnnPipeError(f"{where}: {len(unknown)} state_dict key(s) match no parameter of the project's {model}: "
                           f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}")
    have = set(names.values())
    missing = [k for k in target if k not in have and not k.endswith("scale_factor")]
    if missing:
        raise missing_keys(missing, kind, where)


def apply_ema(ema, sd: dict, kind: str, where: str) -> bool:
    """Replace the trainable tensors of ``sd`` (fairchem names) by the EMA's shadow weights, in
    place; False when the checkpoint has none."""
    if not isinstance(ema, dict) or not ema.get("shadow_params"):
        return False
    shadow = list(ema["shadow_params"])
    names = trainable_keys(kind, sd)
    if len(shadow) != len(names):
        raise GnnPipeError(f"{where}: the EMA has {len(shadow)} shadow weights for the model's {len(names)} "
                           "trainable parameters; the checkpoint is not of this model")
    for name, t in zip(names, shadow):
        if tuple(t.shape) != tuple(sd[name].shape):
            raise GnnPipeError(f"{where}: the EMA's weight for {name} has shape {tuple(t.shape)}, the state_dict's "
                               f"{tuple(sd[name].shape)}; the checkpoint is damaged")
        sd[name] = t
        if kind == "gemnet_t" and ".layers." in name and name.replace(".layers.", ".seq_energy.") in sd:
            sd[name.replace(".layers.", ".seq_energy.")] = t  # the alias follows its tensor
    return True


def scale_file_factors(path) -> dict:
    """{name: value} of a fairchem scale file (JSON, its ``comment`` dropped; or a torch file, safely)."""
    path = Path(path)
    if path.suffix != ".json":
        data = safe_load(path, "scale file")
    elif not path.is_file():
        raise GnnPipeError(f"{path}: no such scale file")
    else:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise GnnPipeError(f"{path}: not a fairchem scale file ({str(e)[:160]})") from None
    if not isinstance(data, dict):
        raise GnnPipeError(f"{path}: a scale file maps factor names to values, this holds a {type(data).__name__}")
    data.pop("comment", None)
    try:
        return {str(k): float(v) for k, v in data.items()}
    except (TypeError, ValueError):
        raise GnnPipeError(f"{path}: a scale factor that is not a number") from None


def scale_key(name: str) -> Optional[str]:
    for pattern, template in SCALE_NAMES:
        m = re.match(pattern, name)
        if m:
            i = int(m.group(1))
            return template.format(i=i, i1=i - 1)
    return None


def gaussian_centres(t: torch.Tensor) -> str:
    """``GemNetTConfig.gaussian_centres`` of a checkpoint's centres ``t`` (already checked to be
    linspace(0, 1, R)): ``float32`` where they are float32 numbers (a float32 checkpoint, or a float32
    model cast to float64 before saving), ``float64`` where they are float64's linspace."""
    rounded = torch.linspace(0, 1, t.numel(), dtype=torch.float32)
    return "float32" if t.dtype != torch.float64 or torch.equal(t, rounded.to(t.dtype)) else "float64"


def map_gemnet(sd: dict, num_radial: int, where: str) -> tuple[dict, set, str]:
    """fairchem GemNet tensors (every name one of the model's: :func:`check_names`) -> the project's state
    dict; the scale-factor keys it filled; the precision of its Gaussians' centres (:func:`gaussian_centres`)."""
    out, origin, centres = {}, {}, set()
    for key, t in sd.items():
        if key in GEMNET_OFFSETS:
            want = torch.linspace(0, 1, num_radial, dtype=torch.float64)
            if t.shape != want.shape or not torch.allclose(t.to(torch.float64), want, atol=1e-6):
                raise GnnPipeError(f"{where}: {key} is not linspace(0, 1, {num_radial}); only Gaussians with "
                                   "fairchem's default centres are importable")
            centres.add(gaussian_centres(t))
            continue
        name = gemnet_key(key)
        if name == "atom_emb.weight":  # fairchem's row z - 1 is our row z
            t = torch.cat([t.new_zeros(1, t.shape[1]), t])
        elif name.endswith("scale_factor") and float(t) == 0.0:
            continue  # fairchem's "not fitted" (skipped in forward): a later source may fit it
        if name in out:
            if not torch.equal(out[name], t):
                raise GnnPipeError(f"{where}: {origin[name]} and {key} are one tensor in fairchem's model but "
                                   "differ here; the checkpoint was edited")
            continue
        out[name], origin[name] = t, key
    if len(centres) > 1:
        raise GnnPipeError(f"{where}: {' and '.join(GEMNET_OFFSETS)} hold the Gaussians' centres in float32 and "
                           "float64; the checkpoint was edited")
    # none in the state dict: fairchem builds them in the default dtype, float32
    return out, {k for k in out if k.endswith("scale_factor")}, centres.pop() if centres else "float32"


def fill_scales(out: dict, target: dict, sources: list[tuple[str, dict]], where: str) -> tuple[list, list]:
    """Scale factors from ``sources`` (label, {fairchem name: value}), in order; (ignored names,
    factors no source fitted: 1.0)."""
    ignored = []
    for label, factors in sources:
        for name, value in factors.items():
            key = scale_key(name)
            if key is None or key not in target:
                ignored.append(name)
                continue
            if value == 0.0:
                continue
            old = out.get(key)
            if old is not None and not math.isclose(float(old), value, rel_tol=1e-6):
                raise GnnPipeError(f"{where}: scale factor {name} is {float(old)!r} in the checkpoint but {value!r} in "
                                   f"{label}; fairchem refuses the contradiction too: drop one")
            out[key] = torch.tensor(float(value), dtype=torch.float64)
    unfitted = sorted(k for k in target if k.endswith("scale_factor") and k not in out)
    for k in unfitted:
        out[k] = torch.tensor(1.0)
    return sorted(set(ignored)), unfitted


def check_complete(out: dict, target: dict, kind: str, where: str) -> dict:
    missing = [k for k in target if k not in out]
    if missing:
        raise missing_keys(missing, kind, where)
    bad = [f"{k} {tuple(out[k].shape)} vs {tuple(v.shape)}" for k, v in target.items()
           if tuple(out[k].shape) != tuple(v.shape)]
    if bad:
        raise GnnPipeError(f"{where}: shape mismatch (checkpoint vs model config) of {len(bad)} tensor(s): "
                           f"{'; '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}")
    floating = [v.dtype for v in out.values() if v.is_floating_point() and v.dim()]
    wdtype = floating[0] if floating else torch.float32  # the checkpoint's own precision
    return {k: out[k].detach().to(wdtype if out[k].is_floating_point() else out[k].dtype).clone() for k in target}


# --------------------------------------------------------------------------- normaliser
def _value(x) -> float:
    return float(torch.as_tensor(x, dtype=torch.float64).reshape(-1)[0])


def normalizer(state: dict, attrs_config: dict, where: str) -> dict:
    """{"scale", "mean", "force_scale", "e_ref"} as fairchem denormalises: checkpoint
    ``normalizers`` (new keys energy/forces with mean/rmsd, old target/grad_target with
    mean/std), else the config's ``dataset.normalize_labels`` values, else the identity."""
    norms = state.get("normalizers") or {}
    alias = {"target": "energy", "grad_target": "forces"}
    norms = {alias.get(k, k): v for k, v in norms.items()}
    ds = (attrs_config or {}).get("dataset") or {}
    ds = ds[0] if isinstance(ds, list) and ds else ds
    ds = ds.get("train", ds) if isinstance(ds, dict) else {}

    def pair(key, mean_key, std_key):
        n = norms.get(key)
        if isinstance(n, dict) and n:
            std = n.get("rmsd", n.get("std"))
            if std is None or "mean" not in n:
                raise GnnPipeError(f"{where}: normalizers.{key} has keys {', '.join(n)}; expected mean and "
                                   "rmsd (or std)")
            return _value(n["mean"]), _value(std)
        if isinstance(ds, dict) and ds.get("normalize_labels"):
            return float(ds.get(mean_key, 0.0)), float(ds.get(std_key, 1.0))
        return 0.0, 1.0

    e_mean, e_std = pair("energy", "target_mean", "target_std")
    f_mean, f_std = pair("forces", "grad_target_mean", "grad_target_std")
    if f_mean != 0.0:
        raise GnnPipeError(f"{where}: a force normaliser with mean {f_mean} (not 0): forces would not be a "
                           "gradient; not importable")
    e_ref = np.zeros(modelfile.NUM_ELEMENTS)
    refs = (state.get("elementrefs") or {}).get("energy")
    if isinstance(refs, dict) and "element_references" in refs:
        r = np.asarray(torch.as_tensor(refs["element_references"], dtype=torch.float64))
        n = min(len(r), modelfile.NUM_ELEMENTS)
        if np.any(r[n:]):
            raise GnnPipeError(f"{where}: element references beyond Z = {modelfile.NUM_ELEMENTS - 1}")
        e_ref[:n] = r[:n]
    return {"scale": e_std, "mean": e_mean, "force_scale": f_std, "e_ref": e_ref}


# --------------------------------------------------------------------------- the import
def import_checkpoint(path, config: Optional[str] = None, scale_file: Optional[str] = None) -> tuple[dict, dict]:
    """(the model file's payload, a summary for the command's line) of fairchem checkpoint ``path``
    (``config``: a fairchem YAML whose ``model`` section replaces the checkpoint's)."""
    from .protocol import ATOMIC_MODELS

    where = str(path)
    state = read_checkpoint(path)
    full = state.get("config") if isinstance(state.get("config"), dict) else {}
    if config is not None:
        import yaml
        try:
            given = yaml.safe_load(Path(config).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise GnnPipeError(f"{config}: not a readable fairchem config ({str(e).splitlines()[0]})") from None
        if not isinstance(given, dict):
            raise GnnPipeError(f"{config}: a fairchem config is a mapping with a 'model' section")
        full = {**full, **given}
        name, attrs = model_section(given, str(config))
    else:
        name, attrs = model_section(full, where)
    kind, cfg, attrs = project_config(name, attrs, where)
    spec = ATOMIC_MODELS[kind]
    with torch.device("meta"):
        target = spec.build(cfg).state_dict()  # names and shapes, nothing allocated
    sd = strip_prefix(state["state_dict"])
    check_names(sd, target, kind, where)
    used_ema = apply_ema(state.get("ema"), sd, kind, where)
    ignored, unfitted = [], []
    if kind == "gemnet_t":
        out, in_sd, centres = map_gemnet(sd, cfg.num_radial, where)
        cfg = dataclasses.replace(cfg, gaussian_centres=centres)
        given = state.get("scale_dict") or {}
        sources = [("the checkpoint's scale_dict", {str(k): _value(v) for k, v in given.items()})]
        if scale_file is not None:
            sources.append((str(scale_file), scale_file_factors(scale_file)))
        if not in_sd and not any(s for _, s in sources):
            sf = attrs.get("scale_file")
            raise GnnPipeError(f"{where}: no scale factors in the checkpoint; give its scale file with --scale-file "
                               f"{sf or 'scales.json'}")
        ignored, unfitted = fill_scales(out, target, sources, where)
    else:
        out = dict(sd)  # its names are the project's (check_names)
    weights = check_complete(out, target, kind, where)
    norm = normalizer(state, full, where)
    num_elements = int(attrs.get("num_elements", 83)) if kind == "gemnet_t" else modelfile.NUM_ELEMENTS - 1
    origin = {"from": "fairchem", "checkpoint": Path(path).name, "model": name,
              "weights": "ema" if used_ema else "state_dict", "energy": ENERGY_MEANING,
              "otf_graph": bool(attrs.get("otf_graph")), "use_pbc": bool(attrs.get("use_pbc", True)),
              "regress_forces": bool(attrs.get("regress_forces", True)),
              "ignored_scale_factors": ignored, "unfitted_scale_factors": unfitted}
    payload = modelfile.make_payload(
        kind=kind, model_config=cfg, state_dict=weights, cutoff=cfg.cutoff,
        max_neighbors=int(attrs["max_neighbors"]) if attrs.get("max_neighbors") is not None else None,
        symmetric_edges=spec.symmetric_edges, e_ref=norm["e_ref"], scale=norm["scale"], mean=norm["mean"],
        force_scale=norm["force_scale"], elements=list(range(1, num_elements + 1)),
        dtype="float64" if next(iter(weights.values())).dtype == torch.float64 else "float32", origin=origin,
        neighbors="fairchem", energy_reference=energy_reference(full))  # the graphs fairchem builds (atomic.neighbors)
    summary = {"kind": kind, "model": name, "weights": origin["weights"],
               "parameters": sum(v.numel() for k, v in weights.items() if not k.endswith("scale_factor")),
               "ignored": ignored, "unfitted": unfitted, "scale": norm["scale"], "mean": norm["mean"],
               "energy_reference": payload["energy_reference"]}
    return payload, summary


def summary_line(summary: dict, out) -> str:
    """The command's one line: what was written, from which weights, and what was left out."""
    line = (f"{out}: {summary['kind']} from fairchem {summary['model']} ({summary['parameters']:,} parameters, "
            f"{'EMA shadow weights' if summary['weights'] == 'ema' else 'state_dict weights (no EMA)'}; energy = "
            f"{summary['scale']:g}·y {summary['mean']:+g} eV; energies: {summary['energy_reference']}, "
            f"{ENERGY_MEANING})")
    if summary["ignored"]:
        line += f"; scale factors ignored (not in the model): {', '.join(summary['ignored'])}"
    if summary["unfitted"]:
        line += f"; unfitted scale factors (identity, as fairchem): {len(summary['unfitted'])}"
    return line
