"""gnnpipe import-model --from fairchem: synthetic fairchem 1.x checkpoints (the project's own weights
under fairchem's names, saved as fairchem's trainer saves them) round-trip exactly; EMA, prefixes,
scale files, normalisers; one-line refusals. (No fairchem code here: the parity against fairchem's
own models was measured in a scratch folder, docs/ARCHITECTURE.md.)"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from gnnpipe.atomic.fairchem import GEMNET_OFFSETS, gemnet_key, import_checkpoint, trainable_keys
from gnnpipe.atomic.gemnet import count_parameters as gemnet_parameters
from gnnpipe.atomic.gemnet import preset as gemnet_preset
from gnnpipe.atomic.gemnet_layers import RadialBasis
from gnnpipe.atomic.inference import Predictor
from gnnpipe.atomic.modelfile import decode, load_model_file, save_model_file
from gnnpipe.atomic.protocol import ATOMIC_MODELS
from gnnpipe.cli import main
from gnnpipe.io import GnnPipeError

pytestmark = pytest.mark.usefixtures("one_thread")

GEMNET_SIZES = dict(num_spherical=3, num_radial=4, num_blocks=2, emb_size_atom=4, emb_size_edge=6, emb_size_trip=3,
                    emb_size_rbf=2, emb_size_cbf=2, emb_size_bil_trip=3, num_before_skip=1, num_after_skip=1,
                    num_concat=1, num_atom=1, cutoff=5.0)
DPP_SIZES = dict(hidden_channels=6, num_blocks=2, int_emb_size=3, basis_emb_size=2, out_emb_channels=5,
                 num_spherical=3, num_radial=3, cutoff=5.0, envelope_exponent=5, num_before_skip=1,
                 num_after_skip=1, num_output_layers=1)
#: the project's GemNet names -> fairchem's (the importer's renames, inverted)
INVERSE = [(r"^atom_emb\.weight$", "atom_emb.embeddings.weight"), (r"\.trip\.down\.", ".trip.down_projection."),
           (r"\.trip\.up_(ca|ac)\.", r".trip.up_projection_\1."), (r"\.trip\.bilinear\.", ".trip.mlp_cbf."),
           (r"\.trip\.", ".trip_interaction."), (r"\.concat\.", ".concat_layer."),
           (r"\.mlp_forces\.0\.linear\.", ".seq_forces.0.linear."),
           (r"\.mlp_forces\.(\d+)\.mlp\.", r".seq_forces.\1.dense_mlp."),
           (r"\.mlp\.0\.linear\.", ".layers.0.linear."), (r"\.mlp\.(\d+)\.mlp\.", r".layers.\1.dense_mlp."),
           (r"\.(layers_before_skip|layers_after_skip|residual_m)\.(\d+)\.mlp\.", r".\1.\2.dense_mlp."),
           (r"\.scale_rbf_forces\.", ".scale_rbf_F."), (r"\.dense_rbf_forces\.", ".dense_rbf_F.")]


def fairchem_model(kind: str, direct: bool = True, seed: int = 0):
    """(project model, fairchem state dict, fairchem model section) of the same weights, scale factors fitted."""
    torch.manual_seed(seed)
    if kind == "dimenetpp":
        cfg = ATOMIC_MODELS[kind].config(**DPP_SIZES, output_up_bias=True, angle_gradient=False)
        model = ATOMIC_MODELS[kind].build(cfg).double()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.3)
        return model, dict(model.state_dict()), {"name": "dimenetplusplus", **DPP_SIZES, "use_pbc": True}
    cfg = gemnet_preset("default", **GEMNET_SIZES, num_elements=84, force_head="direct" if direct else "gradient")
    model = ATOMIC_MODELS[kind].build(cfg).double()
    sd = {}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("scale_factor"):
                t.fill_(1.0 + 0.1 * len(sd) % 7)
            if name == "atom_emb.weight":
                t[0] = 0  # no element 0 in fairchem's table
            key = name
            for pattern, repl in INVERSE:
                key = re.sub(pattern, repl, key)
            sd[key] = t[1:] if name == "atom_emb.weight" else t
            if ".layers." in key and key.startswith("out_blocks"):  # OutputBlock.seq_energy is layers
                sd[key.replace(".layers.", ".seq_energy.")] = t
    for key in GEMNET_OFFSETS:
        sd[key] = torch.linspace(0, 1, cfg.num_radial)
    return model, sd, {"name": "gemnet_t", **GEMNET_SIZES, "direct_forces": direct, "max_neighbors": 50,
                       "otf_graph": True, "rbf": {"name": "gaussian"}, "cbf": {"name": "spherical_harmonics"},
                       "envelope": {"name": "polynomial", "exponent": 5}, "scale_file": "s.json"}


def save_fairchem(path, sd, model, prefix="module.module.", ema=None, **extra):
    """As fairchem's trainer saves: DDP-prefixed state_dict, config, normalizers (old names), ema."""
    state = {"state_dict": {prefix + k: v for k, v in sd.items()},
             "config": {"model": model, "dataset": {"train": {"src": "x"}}, "cmd": {"seed": 0}},
             "normalizers": {"target": {"mean": torch.tensor(-0.7), "std": torch.tensor(2.5)},
                             "grad_target": {"mean": torch.tensor(0.0), "std": torch.tensor(2.5)}},
             "ema": ema, "amp": None, "epoch": 3.5, "step": 10, "val_metrics": {"energy_mae": np.float64(0.3)},
             **extra}
    torch.save(state, path)
    return path


def one_structure(n=5, seed=1):
    rng = np.random.default_rng(seed)
    return np.array([8, 29, 6, 1, 29][:n]), rng.uniform(0, 3.2, (n, 3)), np.eye(3) * 3.4, np.array([True] * 3)


@pytest.mark.parametrize("kind,direct", [("gemnet_t", True), ("gemnet_t", False), ("dimenetpp", False)])
def test_a_fairchem_checkpoint_round_trips_to_the_same_model(tmp_path, kind, direct):
    model, sd, section = fairchem_model(kind, direct)
    ckpt = save_fairchem(tmp_path / "ckpt.pt", sd, section)
    assert main(["import-model", "--from", "fairchem", str(ckpt), "--out", str(tmp_path / "m.pt")]) == 0
    mf = load_model_file(tmp_path / "m.pt")
    assert mf.kind == kind and mf.dtype == "float64" and mf.origin["weights"] == "state_dict"
    assert (mf.scale, mf.mean, mf.force_scale) == (2.5, pytest.approx(-0.7), 2.5)
    assert mf.origin["from"] == "fairchem" and "adsorption" in mf.origin["energy"]
    assert torch.load(tmp_path / "m.pt", weights_only=True)["neighbors"] == "fairchem"
    built = mf.build(dtype=torch.float64)
    want = model.state_dict()
    assert set(built.state_dict()) == set(want)
    assert all(torch.equal(built.state_dict()[k], v) for k, v in want.items())
    # every consumer applies the normaliser: E = 2.5·y - 0.7, F = 2.5·f
    z, pos, cell, pbc = one_structure()
    got = Predictor(mf).predict(z, pos, cell, pbc)
    plain = Predictor(decode({**mf.payload(), "normalizer": {"e_ref": mf.e_ref, "scale": 1.0}}))
    ref = plain.predict(z, pos, cell, pbc)
    assert got.energy == pytest.approx(2.5 * ref.energy + mf.mean, rel=1e-12)
    np.testing.assert_allclose(got.forces, 2.5 * ref.forces, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("offsets, centres", [(torch.float32, "float32"), (torch.float64, "float64")])
def test_the_gaussians_keep_the_checkpoints_float32_centres_as_fairchems_float64_model_does(tmp_path, offsets,
                                                                                          centres):
    """fairchem's Gaussians (torch_geometric's GaussianSmearing) keep the checkpoint's float32 centres, and
    a width from their float32 spacing, when the model is cast to float64: at R = 128 that moves energies
    by up to 1e-5 relative, over the 1e-6 a float64 parity allows. The import keeps the centres' precision."""
    from torch_geometric.nn.models.schnet import GaussianSmearing

    model, sd, section = fairchem_model("gemnet_t")
    for key in GEMNET_OFFSETS:
        sd[key] = torch.linspace(0, 1, GEMNET_SIZES["num_radial"], dtype=offsets)
    ckpt = save_fairchem(tmp_path / "ckpt.pt", sd, section)
    assert main(["import-model", "--from", "fairchem", str(ckpt), "--out", str(tmp_path / "m.pt")]) == 0
    mf = load_model_file(tmp_path / "m.pt")
    assert mf.config().gaussian_centres == centres

    # the basis at R = 128 against fairchem's: built in the checkpoint's dtype (the default dtype as it
    # trained), its centres loaded, cast to float64
    default = torch.get_default_dtype()
    torch.set_default_dtype(offsets)
    try:
        theirs = GaussianSmearing(0.0, 1.0, 128)
    finally:
        torch.set_default_dtype(default)
    theirs.load_state_dict({"offset": torch.linspace(0, 1, 128, dtype=offsets)})
    theirs = theirs.double()
    cutoff = 6.0
    d = torch.linspace(0.5, 5.9, 1001, dtype=torch.float64)
    kept = RadialBasis(128, cutoff, 5, centres).double()
    want = kept.envelope(d / cutoff)[:, None] * theirs(d / cutoff)
    torch.testing.assert_close(kept(d), want, rtol=1e-14, atol=1e-15)
    if centres == "float32":  # float64's centres are not fairchem's
        assert (RadialBasis(128, cutoff, 5, "float64").double()(d) - want).abs().max() > 1e-8


def test_older_and_newer_config_and_normalizer_layouts(tmp_path):
    """``model: name`` + ``model_attributes`` (older fairchem) and the newer normalizers (energy/forces,
    mean/rmsd) with element references: E = rmsd·y + mean + Σ ref[z], F = rmsd_F·f."""
    model, sd, section = fairchem_model("gemnet_t")
    refs = torch.arange(84, dtype=torch.float64) * 0.01
    ckpt = tmp_path / "new.pt"
    torch.save({"state_dict": sd, "config": {"model": "gemnet_t", "model_attributes": {
        k: v for k, v in section.items() if k != "name"}},
        "normalizers": {"energy": {"mean": torch.tensor(1.5), "rmsd": torch.tensor(3.0)},
                        "forces": {"mean": torch.tensor(0.0), "rmsd": torch.tensor(2.0)}},
        "elementrefs": {"energy": {"element_references": refs}}}, ckpt)
    mf = decode(import_checkpoint(ckpt)[0])
    assert (mf.scale, mf.mean, mf.force_scale) == (3.0, 1.5, 2.0)
    assert np.array_equal(mf.e_ref[:84], refs.numpy()) and not mf.e_ref[84:].any()
    norm = mf.normalizer()
    assert norm.baseline(np.array([1, 29]), np.array([0, 0]), 1)[0] == pytest.approx(1.5 + 0.01 + 0.29)


def test_ema_shadow_weights_are_preferred_and_prefixes_are_any(tmp_path):
    model, sd, section = fairchem_model("gemnet_t")
    names = trainable_keys("gemnet_t", sd)
    shadow = [sd[k] + 0.5 for k in names]
    for prefix in ("", "module.", "module.module."):
        ckpt = save_fairchem(tmp_path / f"c{len(prefix)}.pt", sd, section, prefix=prefix,
                             ema={"decay": 0.999, "num_updates": None, "shadow_params": shadow, "collected_params": []})
        payload, summary = import_checkpoint(ckpt)
        assert summary["weights"] == "ema" and payload["origin"]["weights"] == "ema"
        w = payload["state_dict"]
        assert torch.equal(w["int_blocks.0.trip.bilinear.weight"],
                           sd["int_blocks.0.trip_interaction.mlp_cbf.weight"] + 0.5)
        assert torch.equal(w["atom_emb.weight"][1:], sd["atom_emb.embeddings.weight"] + 0.5)
        assert torch.equal(w["out_blocks.1.scale_sum.scale_factor"], sd["out_blocks.1.scale_sum.scale_factor"])
    ckpt = save_fairchem(tmp_path / "short.pt", sd, section, ema={"decay": 0.9, "shadow_params": shadow[:-1]})
    with pytest.raises(GnnPipeError, match=f"{len(names) - 1} shadow weights for the model's {len(names)}"):
        import_checkpoint(ckpt)


@pytest.mark.parametrize("kind", ["gemnet_t", "dimenetpp"])
def test_an_unknown_or_missing_key_is_named_when_the_checkpoint_has_an_ema(tmp_path, kind):
    """With EMA weights (checkpoint.pt), a key too many or too few is named, as without: the EMA's count
    check ran first and refused "88 shadow weights for the model's 89", naming no key."""
    model, sd, section = fairchem_model(kind)
    extra = "int_blocks.0.extra.weight" if kind == "gemnet_t" else "lin_extra.weight"
    gone = next(k for k in trainable_keys(kind, sd) if k.endswith("weight"))
    for name, edited, message in ((
            "u", {**sd, extra: torch.zeros(2)}, rf"1 state_dict key\(s\) match no parameter of the project's .*{extra}"), (
            "m", {k: v for k, v in sd.items() if k != gone}, r"1 parameter\(s\) of the project's .* have no weights")):
        shadow = [sd[k] for k in trainable_keys(kind, sd)]  # the EMA of the model's own parameters
        ckpt = save_fairchem(tmp_path / f"{name}.pt", edited, section, ema={"decay": 0.9, "shadow_params": shadow})
        _refused(lambda: import_checkpoint(ckpt), message)


def test_scale_factors_from_a_scale_file_its_extras_reported_and_unfitted_ones_the_identity(tmp_path, capsys):
    model, sd, section = fairchem_model("gemnet_t")
    fitted = {k: float(v) for k, v in sd.items() if k.endswith("scale_factor")}
    for k in fitted:
        sd[k] = torch.tensor(0.0)  # fairchem's "not fitted": the scale file fits them
    names = {"int_blocks.0.trip_interaction.scale_rbf.scale_factor": "TripInteraction_1_had_rbf",
             "int_blocks.1.trip_interaction.scale_cbf_sum.scale_factor": "TripInteraction_2_sum_cbf",
             "out_blocks.2.scale_rbf_F.scale_factor": "OutBlock_2_had"}
    scales = {"comment": "gemnet-xl", **{names[k]: fitted[k] for k in names}, "IntBlock_1_sum": 1.3,
              "IntBlock_2_sum": 1.1}
    (tmp_path / "s.json").write_text(json.dumps(scales))
    ckpt = save_fairchem(tmp_path / "c.pt", sd, section)
    main(["import-model", "--from", "fairchem", str(ckpt), "--scale-file", str(tmp_path / "s.json"),
          "--out", str(tmp_path / "m.pt")])
    line = capsys.readouterr().err
    assert "ignored (not in the model): IntBlock_1_sum, IntBlock_2_sum" in line and line.count("\n") == 1
    mf = load_model_file(tmp_path / "m.pt")
    assert mf.origin["ignored_scale_factors"] == ["IntBlock_1_sum", "IntBlock_2_sum"]
    assert float(mf.state_dict["int_blocks.1.trip.scale_cbf_sum.scale_factor"]) == \
        fitted["int_blocks.1.trip_interaction.scale_cbf_sum.scale_factor"]
    assert float(mf.state_dict["out_blocks.0.scale_sum.scale_factor"]) == 1.0  # in no source: the identity
    assert "out_blocks.0.scale_sum.scale_factor" in mf.origin["unfitted_scale_factors"]
    sd["int_blocks.0.trip_interaction.scale_rbf.scale_factor"] = torch.tensor(3.0)  # fitted, contradicted
    with pytest.raises(GnnPipeError, match="TripInteraction_1_had_rbf is 3.0 in the checkpoint"):
        import_checkpoint(save_fairchem(tmp_path / "d.pt", sd, section), scale_file=tmp_path / "s.json")
    for k in fitted:
        sd[k] = torch.tensor(0.0)
    with pytest.raises(GnnPipeError, match="no scale factors in the checkpoint; give its scale file with "
                                           "--scale-file s.json"):
        import_checkpoint(save_fairchem(tmp_path / "e.pt", sd, section))


def test_the_xl_mapping_without_allocating_it(tmp_path):
    """gp-gemnet-xl's config maps to the project's xl preset: 292,939,520 trainable parameters at
    fairchem's 83 embedding rows (the project's model has one more row, Z = 0, all zeros)."""
    from gnnpipe.atomic.fairchem import project_config
    xl = {"num_spherical": 7, "num_radial": 128, "num_blocks": 6, "emb_size_atom": 128, "emb_size_edge": 1536,
          "emb_size_trip": 384, "emb_size_rbf": 16, "emb_size_cbf": 16, "emb_size_bil_trip": 192,
          "num_before_skip": 1, "num_after_skip": 2, "num_concat": 1, "num_atom": 3, "cutoff": 6.0,
          "rbf": {"name": "gaussian"}, "envelope": {"name": "polynomial", "exponent": 5},
          "cbf": {"name": "spherical_harmonics"}, "max_neighbors": 50, "direct_forces": True}
    kind, cfg, _ = project_config("gp_gemnet_t", xl, "xl")
    assert cfg == gemnet_preset("xl", num_elements=84)
    assert gemnet_parameters(cfg) - cfg.emb_size_atom == 292_939_520
    with torch.device("meta"):
        names = list(ATOMIC_MODELS[kind].build(cfg).state_dict())
    fairchem_names = set()
    for name in names:  # every name of the XL model comes back from its fairchem name, none shared
        key = name
        for pattern, repl in INVERSE:
            key = re.sub(pattern, repl, key)
        assert gemnet_key(key) == name
        fairchem_names.add(key)
    assert len(fairchem_names) == len(names) == 308


def _refused(fn, match):
    with pytest.raises(GnnPipeError, match=match) as e:
        fn()
    assert "\n" not in str(e.value), str(e.value)


def test_refusals_are_one_line(tmp_path):
    model, sd, section = fairchem_model("gemnet_t")
    unknown = {**sd, "int_blocks.0.extra.weight": torch.zeros(2)}
    _refused(lambda: import_checkpoint(save_fairchem(tmp_path / "a.pt", unknown, section)),
             r"1 state_dict key\(s\) match no parameter of the project's GemNet: int_blocks.0.extra.weight")
    missing = {k: v for k, v in sd.items() if k != "out_blocks.1.out_energy.linear.weight"}
    _refused(lambda: import_checkpoint(save_fairchem(tmp_path / "b.pt", missing, section)),
             r"1 parameter\(s\) of the project's gemnet_t have no weights in the checkpoint: "
             r"out_blocks.1.out_energy.linear.weight")
    _refused(lambda: import_checkpoint(save_fairchem(tmp_path / "c.pt", sd, {**section, "emb_size_edge": 7})),
             r"shape mismatch \(checkpoint vs model config\)")
    alias = {**sd, "out_blocks.0.seq_energy.0.linear.weight": sd["out_blocks.0.layers.0.linear.weight"] + 1}
    _refused(lambda: import_checkpoint(save_fairchem(tmp_path / "d.pt", alias, section)), "are one tensor")

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))
    torch.save({"state_dict": sd, "config": {"model": section}, "x": Evil()}, tmp_path / "evil.pt")
    _refused(lambda: import_checkpoint(tmp_path / "evil.pt"),
             r"needs (builtins\.)?print, which is not on the allow-list")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    _refused(lambda: import_checkpoint(tmp_path / "junk.pt"), r"not a torch checkpoint \(not a torch file\)")
    (tmp_path / "empty.pt").write_bytes(b"")
    _refused(lambda: import_checkpoint(tmp_path / "empty.pt"), r"empty \(0 bytes")
    torch.save({"model": 1}, tmp_path / "other.pt")
    _refused(lambda: import_checkpoint(tmp_path / "other.pt"), r"not a fairchem checkpoint \(no 'state_dict'")
    _refused(lambda: import_checkpoint(save_fairchem(tmp_path / "e.pt", sd, {**section, "name": "painn"})),
             "fairchem model 'painn' is not importable")
    _refused(lambda: import_checkpoint(tmp_path / "absent.pt"), "no such checkpoint file")
    # through the command: one line, status 2
    assert main(["import-model", "--from", "fairchem", str(tmp_path / "junk.pt"), "--out", str(tmp_path / "m.pt")]) == 2


def test_a_bare_state_dict_takes_its_config_from_a_yaml(tmp_path):
    model, sd, section = fairchem_model("dimenetpp")
    torch.save(sd, tmp_path / "bare.pt")
    _refused(lambda: import_checkpoint(tmp_path / "bare.pt"), "no model name in its config")
    (tmp_path / "dpp.yml").write_text(json.dumps({"model": section}))
    payload, summary = import_checkpoint(tmp_path / "bare.pt", config=tmp_path / "dpp.yml")
    assert summary["kind"] == "dimenetpp" and payload["normalizer"]["scale"] == 1.0
    assert "mean" not in payload["normalizer"]
    assert save_model_file(tmp_path / "m.pt", payload)


def test_an_old_model_file_still_loads_with_the_identity_mean_and_force_scale(tmp_path):
    payload = {"format": "gnnpipe-atomic-model", "format_version": 1, "kind": "dimenetpp",
               "model_config": {}, "cutoff": 5.0, "max_neighbors": 12, "symmetric_edges": False,
               "normalizer": {"e_ref": torch.zeros(95, dtype=torch.float64), "scale": 2.0}, "elements": [1],
               "dtype": "float64", "state_dict": {}}
    mf = decode(payload)
    norm = mf.normalizer()
    assert (mf.mean, norm.mean, norm.force_scale, mf.origin) == (0.0, 0.0, 2.0, None)


def test_fairchems_dimenetpp_detaches_the_angles_and_biases_lin_up():
    """angle_gradient false: the same energy, forces through the distances only (fairchem's); output_up_bias:
    one bias per output block."""
    model, sd, _ = fairchem_model("dimenetpp")
    assert sum(k.endswith("lin_up.bias") for k in sd) == DPP_SIZES["num_blocks"] + 1
    cfg = dict(model.cfg.__dict__)
    free = ATOMIC_MODELS["dimenetpp"].build(ATOMIC_MODELS["dimenetpp"].config(**{**cfg, "angle_gradient": True}))
    free = free.double()
    free.load_state_dict(sd)
    payload = {"format": "gnnpipe-atomic-model", "format_version": 1, "kind": "dimenetpp", "cutoff": 5.0,
               "max_neighbors": None, "symmetric_edges": False, "elements": [1, 6, 8, 29], "dtype": "float64",
               "normalizer": {"e_ref": torch.zeros(95, dtype=torch.float64), "scale": 1.0}}
    z, pos, cell, pbc = one_structure()
    out = {}
    for flag, m in ((False, model), (True, free)):
        mf = decode({**payload, "model_config": {**cfg, "angle_gradient": flag}, "state_dict": m.state_dict()})
        out[flag] = Predictor(mf).predict(z, pos, cell, pbc)
    assert out[False].energy == pytest.approx(out[True].energy, rel=1e-13)
    assert np.abs(out[False].forces - out[True].forces).max() > 1e-6 * np.abs(out[True].forces).max()
