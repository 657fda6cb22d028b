"""#34 item 3: fine-tuning a model file in the workflow (``models.<name>.init_from``) and the energies' origin.

A tiny fairchem-style GemNet-dT checkpoint (tests/test_fairchem_import.py's, no fairchem code) imported
with ``gnnpipe import-model`` is the start of an atomic run on 10 EMT slabs whose graphs are fairchem's:
the run's first evaluation is the model file's own prediction, single, graph (edges and atoms layouts)
and 2 × 2 train the same first epoch, and what contradicts the file is refused in one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gnnpipe.atomic import data
from gnnpipe.atomic.inference import Predictor
from gnnpipe.atomic.modelfile import (check_init, data_energy_reference, decode, load_model_file,
                                      payload_from_engine, save_model_file)
from gnnpipe.cli import main
from gnnpipe.config import ConfigError, dump_run_config, load_workflow_config, resolve_runs
from gnnpipe.io import GnnPipeError
from test_fairchem_import import fairchem_model, save_fairchem
from test_faults import HABITS

pytestmark = pytest.mark.usefixtures("one_thread")

#: the imported model's graphs (its checkpoint's cutoff and max_neighbors, fairchem's convention)
GRAPHS = {"cutoff": 5.0, "max_neighbors": 50, "neighbors": "fairchem"}


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    """model.pt of ``gnnpipe import-model --from fairchem`` on a tiny GemNet-dT checkpoint (float64)."""
    root = tmp_path_factory.mktemp("imported")
    _, sd, section = fairchem_model("gemnet_t", direct=True)
    ckpt = save_fairchem(root / "ckpt.pt", sd, section)
    assert main(["import-model", "--from", "fairchem", str(ckpt), "--out", str(root / "model.pt")]) == 0
    return root / "model.pt"


@pytest.fixture(scope="module")
def slabs() -> dict:
    return data.generate(10, size=(2, 2, 2), seed=2, progress=False)


def setup_run(root: Path, init: Path, slabs: dict, mode: str = "single", workers: int = 1, *, spec=None, run=None,
              graphs=None, model=None):
    """An atomic run that starts from ``init`` on ``slabs`` (systems.h5, graphs.h5 at ``graphs``, run.yaml)."""
    graphs = {**GRAPHS, **(graphs or {})}
    wf = load_workflow_config({
        "results": str(root / "results"), "datasets": {"slabs": {"kind": "atoms", "atoms": graphs}},
        "models": {"ft": {"kind": "gemnet_t", "init_from": str(init),
                          "gemnet_t": {"batch_size": 2, "lr": 1e-3, **HABITS, **(spec or {})}, **(model or {})}},
        "training": {"epochs": 1, "eval_every": 1, "checkpoint_every": 1, "weight_decay": 0.0, "dtype": "float64"},
        "runs": [{"mode": mode, "dataset": "slabs", "model": "ft", "workers": workers, **(run or {})}]})
    cfg = next(iter(resolve_runs(wf).values()))
    Path(cfg.graph_path).parent.mkdir(parents=True, exist_ok=True)
    digest = data.write_systems(cfg.systems_path, slabs)
    data.write_graphs(cfg.graph_path, data.build_graphs(slabs, graphs["cutoff"], graphs["max_neighbors"],
                                                        progress=False, neighbors=graphs["neighbors"]),
                      graphs["cutoff"], graphs["max_neighbors"], digest, neighbors=graphs["neighbors"])
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.out_dir) / "run.yaml").write_text(dump_run_config(cfg))
    return cfg


def engine(cfg):
    from gnnpipe.atomic.atomic_engine import AtomicEngine
    return AtomicEngine(cfg, None, None, torch.device("cpu"))


def test_the_first_evaluation_is_the_model_files_own_prediction(tmp_path, imported, slabs, capsys):
    """Before any step the run's model is the file's (weights, normaliser, graphs): the test split's energy
    and force errors equal those of the file's own predictions (the calculator's path), float64; the file's
    adsorption energies against the slabs' EMT totals are warned about in one line."""
    mf = load_model_file(imported)
    eng = engine(setup_run(tmp_path, imported, slabs))
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warned) == 1 and "oc20-adsorption" in warned[0] and "total" in warned[0], warned
    assert eng.model_cfg == mf.config() and eng.norm.mean == mf.mean and eng.norm.scale == mf.scale
    assert all(torch.equal(eng.full_state_dict()[k], v) for k, v in mf.state_dict.items())
    got = eng.evaluate()
    s, pred = slabs, Predictor(mf)
    de, df = [], []
    for i in eng.ids["test"]:
        a0, a1 = s["atom_ptr"][i], s["atom_ptr"][i + 1]
        p = pred.predict(s["z"][a0:a1], s["pos"][a0:a1], s["cell"][i], s["pbc"][i])
        free = ~s["fixed"][a0:a1]
        de.append(abs(p.energy - s["energy"][i]))
        df.append(np.abs(p.forces - s["forces"][a0:a1])[free].ravel())
    assert got["test_energy_mae"] == pytest.approx(np.mean(de), rel=1e-10)
    assert got["test_force_mae"] == pytest.approx(np.concatenate(df).mean(), rel=1e-10)
    # the fine-tuned file keeps the file's graphs, normaliser and elements; its energies are the data's
    payload = payload_from_engine(eng)
    assert (payload["cutoff"], payload["max_neighbors"], payload["neighbors"]) == (5.0, 50, "fairchem")
    assert payload["normalizer"]["mean"] == mf.mean and set(mf.elements) <= set(payload["elements"])
    assert decode(payload).energy_reference == "total"
    # relax says what the finished model's energies are, in its line and relax.json
    cfg = eng.cfg
    save_model_file(Path(cfg.out_dir) / "model.pt", payload)
    capsys.readouterr()
    assert main(["relax", "--run-config", str(Path(cfg.out_dir) / "run.yaml"), "--systems", "1", "--steps", "1",
                 "--reference", "none"]) == 0
    assert capsys.readouterr().err.splitlines()[-1].endswith(" energies=total")
    assert json.loads((Path(cfg.out_dir) / "relax.json").read_text())["energy_reference"] == "total"


def _first_epoch(rank: int, world: int, cfg) -> list:
    from test_atom_layout import _engine_epoch
    return _engine_epoch(rank, world, cfg)["steps"]


@pytest.mark.parametrize("layout,workers,spec,run", [  # multi-process, 30–70 s each: make test-long
    pytest.param("edges", 2, {}, {}, marks=pytest.mark.long),
    pytest.param("atoms", 2, {}, {"atom_layout": "atoms"}, marks=pytest.mark.long),
    pytest.param("2x2", 4, {"batch_size": 1}, {"data_parallel": 2}, marks=pytest.mark.long)])
def test_graph_parallel_fine_tuning_trains_the_first_epoch_as_single(tmp_path, imported, slabs, layout, workers, spec,
                                                                     run):
    """From the imported model, float64, every habit on: the first epoch's step losses of graph P = 2 (edges
    and atoms layouts) and of 2 ways × 2 replicas equal single-process training on the same batches to 1e-10."""
    from gnnpipe.parallel.testing import spawn_multi_process

    single = engine(setup_run(tmp_path / "single", imported, slabs))
    assert single.init is not None
    ref = single.train_epoch(0).step_losses
    assert len(ref) == 4
    cfg = setup_run(tmp_path / layout, imported, slabs, "graph", workers, spec=spec, run=run)
    for steps in spawn_multi_process(_first_epoch, workers, cfg, timeout=180):
        assert steps == pytest.approx(ref, rel=1e-10, abs=0)


def _one_line(fn) -> str:
    with pytest.raises(GnnPipeError) as e:
        fn()
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def test_what_contradicts_the_model_file_is_refused_in_one_line(tmp_path, imported, slabs):
    # the workflow config: the file's architecture is not the section's to set; a missing file; a node model
    line = _one_line(lambda: setup_run(tmp_path / "a", imported, slabs, spec={"emb_size_atom": 8}))
    assert "config.models.ft.gemnet_t.emb_size_atom" in line and "remove the key" in line
    assert "gemnet_t.preset" in _one_line(lambda: setup_run(tmp_path / "a", imported, slabs, spec={"preset": "small"}))
    line = _one_line(lambda: setup_run(tmp_path / "a", tmp_path / "nope.pt", slabs))
    assert "config.models.ft.init_from" in line and "no such file" in line
    with pytest.raises(ConfigError, match=r"config\.models\.m\.init_from: only models of kind"):
        load_workflow_config({"datasets": {"d": {}}, "models": {"m": {"kind": "gcn", "init_from": str(imported)}},
                              "runs": [{"mode": "single", "dataset": "d", "model": "m"}]})
    # the data: the graphs must be the file's (convention, cap; a cutoff below its own)
    for key, value, said, want in (("neighbors", "project", "project", "fairchem"), ("max_neighbors", 12, "12", "50"),
                                   ("cutoff", 4.0, "4 Å", "5")):
        cfg = setup_run(tmp_path / key, imported, slabs, graphs={key: value})
        line = _one_line(lambda: engine(cfg))
        assert f"datasets.slabs.atoms.{key} is {said}" in line and f"set {key}: {want}" in line, line
    # a run.yaml written by hand: another kind, a size that differs
    cfg = setup_run(tmp_path / "b", imported, slabs)
    mf = load_model_file(imported)
    spec = dataclasses.replace(cfg.model.gemnet_t, emb_size_atom=8)
    line = _one_line(lambda: check_init(mf, dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                                              gemnet_t=spec))))
    assert "gemnet_t.emb_size_atom is 8 in the config and 4 in the model file" in line
    line = _one_line(lambda: check_init(mf, dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                                              kind="dimenetpp"))))
    assert "holds a gemnet_t model" in line


def test_an_uncapped_model_file_needs_a_cap_that_never_binds(tmp_path, imported, slabs):
    """A model file without a neighbour cap trains on the capped graphs only where the cap binds nowhere."""
    mf = load_model_file(imported)
    uncapped = save_model_file(tmp_path / "uncapped.pt", {**mf.payload(), "max_neighbors": None})
    line = _one_line(lambda: engine(setup_run(tmp_path / "a", uncapped, slabs, graphs={"max_neighbors": 8})))
    assert "no neighbour cap" in line and "datasets.slabs.atoms.max_neighbors (8)" in line
    assert engine(setup_run(tmp_path / "b", uncapped, slabs)).init.max_neighbors is None  # 50 never binds here


def test_the_energies_origin_is_recorded_and_said(tmp_path, imported, slabs, capsys):
    """The importer records oc20-adsorption (OC20's checkpoints) or total (OC22's); the calculator says it,
    predict prints it in its line and writes it into each frame."""
    import ase.io

    from gnnpipe.atomic.calculator import GNNPipeCalculator
    from gnnpipe.atomic.is2rs import systems_to_atoms

    mf = load_model_file(imported)
    assert mf.energy_reference == "oc20-adsorption"
    calc = GNNPipeCalculator(mf)
    assert calc.energy_reference == "oc20-adsorption" and "energies=oc20-adsorption" in repr(calc)
    _, sd, section = fairchem_model("gemnet_t", direct=True)
    ckpt = save_fairchem(tmp_path / "oc22.pt", sd, section)
    state = torch.load(ckpt, weights_only=False)
    state["config"]["dataset"] = {"train": {"src": "/data/oc22/s2ef_total/train"}}
    torch.save(state, ckpt)
    assert main(["import-model", "--from", "fairchem", str(ckpt), "--out", str(tmp_path / "oc22-model.pt")]) == 0
    assert load_model_file(tmp_path / "oc22-model.pt").energy_reference == "total"
    assert decode({**mf.payload(), "energy_reference": None}).energies == "unknown"
    assert (data_energy_reference("generated:ase-emt seed=0"), data_energy_reference("file:x.extxyz split=random"),
            data_energy_reference("file:s2ef (s2ef energy=referenced) split=key")) == ("total", None,
                                                                                       "oc20-adsorption")
    ase.io.write(tmp_path / "in.extxyz", systems_to_atoms(slabs, [0, 1]))
    capsys.readouterr()
    assert main(["predict", "--run", str(imported), "--structures", str(tmp_path / "in.extxyz"), "--out",
                 str(tmp_path / "out.extxyz")]) == 0
    assert "energies: oc20-adsorption" in capsys.readouterr().err
    assert [a.info["energy_reference"] for a in ase.io.read(tmp_path / "out.extxyz", ":")] == ["oc20-adsorption"] * 2


@pytest.mark.slow
def test_the_model_file_is_an_input_of_the_train_job(tmp_path, imported):
    """Snakemake (a dry run): the file is an input of the run's train job, so a changed file retrains it (a
    missing one is load_workflow_config's refusal, which common.smk calls: the test above)."""
    import yaml

    from helpers import snakemake

    config = {"datasets": {"oc": {"kind": "atoms", "atoms": {**GRAPHS, "num_trajectories": 2}}},
              "models": {"ft": {"kind": "gemnet_t", "init_from": str(imported)}},
              "training": {"epochs": 1}, "runs": [{"mode": "single", "dataset": "oc", "model": "ft"}]}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    res = snakemake(tmp_path, tmp_path / "config.yaml", "-n", "--until", "train_atomic")  # an atomic run's train rule
    assert res.returncode == 0, res.stderr
    train = res.stdout[res.stdout.index("rule train_atomic:"):]
    assert str(imported) in train[:train.index("output:")]


def test_a_replaced_model_file_does_not_resume_a_checkpoint_of_the_old_one(tmp_path, imported, slabs):
    """The config names the file, not its content: a file replaced under the same name (a retrain retried
    after the user swapped checkpoints) must not resume epochs trained from the old one. The fingerprint
    carries the file's SHA-256; a checkpoint manifest of the old file is refused in one line naming it."""
    import shutil

    from gnnpipe.checkpoint import FORMAT, check_manifest, run_fingerprint

    init = tmp_path / "init.pt"
    shutil.copyfile(imported, init)
    cfg = setup_run(tmp_path, init, slabs)
    old = run_fingerprint(cfg)
    assert old["init_hash"] and run_fingerprint(cfg) == old  # a function of the file's bytes
    manifest = {"format": FORMAT, "world_size": 1, "epochs_done": 1, **old}
    check_manifest(manifest, cfg.out_dir, cfg=cfg, fingerprint=old, world_size=1, epochs=2)  # the same file: resumes
    mf = load_model_file(init)
    save_model_file(init, {**mf.payload(), "mean": mf.mean + 1.0})  # another model under the same name
    new = run_fingerprint(cfg)
    assert new["config_hash"] == old["config_hash"] and new["init_hash"] != old["init_hash"]
    with pytest.raises(GnnPipeError) as err:
        check_manifest(manifest, cfg.out_dir, cfg=cfg, fingerprint=new, world_size=1, epochs=2)
    msg = str(err.value)
    assert "another model file to start from" in msg and str(init) in msg and "\n" not in msg, msg
