"""Atomic runs through the config, the trainer and Snakemake: errors up front, learning, the chain."""

from __future__ import annotations

import dataclasses
import json
import typing
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from gnnpipe.config import ConfigError, load_workflow_config, resolve_runs

ROOT = Path(__file__).resolve().parents[1]
ATOMS = ROOT / ".test" / "atoms.yaml"


def _wf(models=None, **run):
    return {"datasets": {"a": {"kind": "atoms", "atoms": {"cutoff": 4.5}}, "g": {"kind": "synthetic"}},
            "models": {"d": {"kind": "dimenetpp"}, "gem": {"kind": "gemnet_t"}, "gcn": {"kind": "gcn"}, **(models or {})},
            "runs": [{"dataset": "a", "model": "d", "mode": "graph", "workers": 2, **run}]}


@pytest.mark.parametrize("edit,message", [
    ({"model": "gcn"}, "config.runs[0]: dataset 'a' (atoms) and model 'gcn' (gcn) do not fit: atoms datasets train "
                       "atomic models (dimenetpp, gemnet_t), node datasets the others"),
    ({"dataset": "g"}, "do not fit"),
    # a GemNet run on a node dataset
    ({"dataset": "g", "model": "gem"}, "config.runs[0]: dataset 'g' (synthetic) and model 'gem' (gemnet_t) do not "
                                       "fit: atoms datasets train atomic models (dimenetpp, gemnet_t)"),
    ({"mode": "pipeline"}, "mode single or graph"),
    ({"workers": 3, "data_parallel": 2}, "multiple of data_parallel"),
    ({"data_parallel": 0}, "config.runs[0].data_parallel: 0 must be in [1, 4096]"),
    ({"mode": "single", "workers": 1, "atom_layout": "atoms"},
     "config.runs[0].atom_layout: an atomic single run has no atomic graph layout"),
    ({"atom_layout": "halo"}, "config.runs[0].atom_layout: 'halo' is not one of"),
    # an unknown preset, an unknown size key, a section of another kind
    ({"model": "gem", "models": {"gem": {"kind": "gemnet_t", "gemnet_t": {"preset": "large"}}}},
     "config.models.gem.gemnet_t.preset: 'large' is not one of 'small', 'default', 'xl'"),
    ({"model": "gem", "models": {"gem": {"kind": "gemnet_t", "gemnet_t": {"hidden_channels": 8}}}},
     "config.models.gem.gemnet_t: unknown key 'hidden_channels' (known: batch_size, clip_grad_norm, cutoff, ema_decay,"),
    ({"model": "gem", "models": {"gem": {"kind": "gemnet_t", "dimenetpp": {"num_blocks": 2}}}},
     "config.models.gem.dimenetpp: only models of kind dimenetpp read this key, a gemnet_t model would ignore it; "
     "remove it (or set kind: dimenetpp)"),
    ({"models": {"d": {"kind": "dimenet"}}}, "config.models.d.kind: 'dimenet' is not one of 'gcn', 'sage', 'gat', "
                                             "'gcnii', 'resgcn', 'mlp', 'dimenetpp', 'gemnet_t'"),
    # a cutoff larger than the graphs'
    ({"model": "gem", "models": {"gem": {"kind": "gemnet_t", "gemnet_t": {"cutoff": 6.0}}}},
     "config.runs[0]: model 'gem' has cutoff 6 Å, larger than the graphs of dataset 'a' (atoms.cutoff 4.5 Å): they "
     "lack the neighbours between; raise datasets.a.atoms.cutoff or lower models.gem.gemnet_t.cutoff"),
], ids=["node-model", "node-data", "gemnet-on-node-data", "pipeline", "data-parallel", "data-parallel-0",
         "atom-layout-single", "atom-layout-name",
        "preset", "size-key", "other-section", "kind", "cutoff"])
def test_atomic_config_errors_are_one_line(edit, message):
    with pytest.raises(ConfigError) as err:
        load_workflow_config(_wf(**edit))
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_every_atomic_kind_has_a_section_whose_sizes_are_its_configs():
    """models.<name>.<kind> for every registered kind: its keys are the kind's config fields (sizes,
    force head, cutoff) and the training keys every section shares."""
    import dataclasses as dc

    from gnnpipe.atomic.protocol import ATOMIC_MODELS
    from gnnpipe.config import ATOMIC_SPECS, AtomicSpec, ModelConfig
    from gnnpipe.kinds import ATOMIC_CONFIGS

    shared = {f.name for f in dc.fields(AtomicSpec)}
    assert tuple(ATOMIC_SPECS) == ATOMIC_MODELS.names()
    for kind, spec in ATOMIC_SPECS.items():
        entry = ATOMIC_MODELS[kind]
        assert ATOMIC_CONFIGS[kind] is entry.config  # the section is derived from the class the model is built from
        assert entry.name == kind and issubclass(spec, AtomicSpec) and kind in {f.name for f in dc.fields(ModelConfig)}
        sizes = {f.name for f in dc.fields(spec)} - shared
        assert sizes <= set(entry.config_fields()), (kind, sizes - set(entry.config_fields()))
        assert {"force_head", "cutoff"} <= set(entry.config_fields())
        assert typing.get_args(typing.get_type_hints(spec)["preset"]) == tuple(entry.presets)  # the config's choices


def test_a_hand_written_run_yaml_of_an_atomic_model_on_node_data_is_refused(tmp_path):
    from gnnpipe.config import dump_run_config, load_run_config
    r, = resolve_runs(load_workflow_config(_wf(model="gem"))).values()
    path = tmp_path / "run.yaml"
    path.write_text(dump_run_config(r).replace("systems_path: results/data/a/systems.h5", "systems_path: null"))
    with pytest.raises(ConfigError, match=r"model kind gemnet_t on a node dataset \(a\): atoms datasets train"):
        load_run_config(path)


def test_atomic_run_layout_and_paths():
    runs = resolve_runs(load_workflow_config(_wf(workers=4, data_parallel=2)))
    (rid, r), = runs.items()
    assert rid == "a-d-graph-p4d2-seed0" and (r.ways, r.data_parallel, r.store_path) == (2, 2, None)
    assert r.graph_path.endswith("a/graphs.h5") and r.systems_path.endswith("a/systems.h5")
    (rid, r), = resolve_runs(load_workflow_config(_wf(workers=2, atom_layout="atoms"))).items()
    assert rid == "a-d-graph-p2atoms-seed0" and r.atom_layout == "atoms"
    assert all(r.atom_layout == "edges" for r in resolve_runs(load_workflow_config(_wf(workers=2))).values())
    with pytest.raises(ConfigError, match=r"datasets.a.atoms.cutoff: 0.0 must be > 0"):
        load_workflow_config({**_wf(), "datasets": {"a": {"kind": "atoms", "atoms": {"cutoff": 0}}}})
    with pytest.raises(ConfigError, match=r"models.d.dimenetpp.batch_size: 0 must be >= 1"):
        load_workflow_config({**_wf(), "models": {"d": {"kind": "dimenetpp", "dimenetpp": {"batch_size": 0}}}})


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    from gnnpipe.atomic import data
    d = tmp_path_factory.mktemp("atoms")
    s = data.generate(64, progress=False)
    digest = data.write_systems(d / "systems.h5", s)
    data.write_graphs(d / "graphs.h5", data.build_graphs(s, 4.5, 12, progress=False), 4.5, 12, digest)
    return d


def _run_config(d: Path, epochs: int, kind: str = "dimenetpp", **spec):
    cfg = {"results": str(d / "res"), "datasets": {"slabs": {"kind": "atoms"}},
           "models": {"dpp": {"kind": kind, kind: {"preset": "small", "lr": 0.001, **spec}}},
           "training": {"epochs": epochs, "eval_every": epochs, "checkpoint_every": 0, "weight_decay": 0.0},
           "runs": [{"mode": "single", "dataset": "slabs", "model": "dpp"}]}
    r, = resolve_runs(load_workflow_config(cfg)).values()
    return dataclasses.replace(r, systems_path=str(d / "systems.h5"), graph_path=str(d / "graphs.h5"))


@pytest.mark.parametrize("kind", ["dimenetpp", "gemnet_t"])
def test_more_ways_than_a_systems_edges_is_refused(small_data, kind):
    from gnnpipe.atomic.atomic_engine import AtomicEngine
    from gnnpipe.io import GnnPipeError
    cfg = dataclasses.replace(_run_config(small_data, 1, kind), mode="graph", workers=10_000, ways=10_000)
    with pytest.raises(GnnPipeError, match="graph parallelism over 10000 ways: system .* has only"):
        AtomicEngine(cfg, None, None, "cpu")


def test_a_model_cutoff_above_the_graphs_is_refused_and_below_rebuilds_them(small_data):
    """The graphs.h5 of 4.5 Å: a GemNet of 5 Å is refused naming the file (a hand-made run.yaml; the
    workflow refuses it at config time); one of 3.5 Å trains on the graphs a rebuild at 3.5 Å gives."""
    from gnnpipe.atomic import data
    from gnnpipe.atomic.atomic_engine import AtomicEngine
    from gnnpipe.io import GnnPipeError
    with pytest.raises(GnnPipeError, match=r"the model's cutoff 5 Å is larger than the cutoff 4.5 Å of the graphs it "
                                           r"trains on \(.*graphs.h5\): they lack the neighbours between"):
        AtomicEngine(_run_config(small_data, 1, "gemnet_t", cutoff=5.0), None, None, "cpu")
    eng = AtomicEngine(_run_config(small_data, 1, "gemnet_t", cutoff=3.5), None, None, "cpu")
    want = data.build_graphs(eng.systems, 3.5, 12, progress=False)
    assert eng.graphs["cutoff"] == eng.model_cfg.cutoff == 3.5 and eng.graphs["max_neighbors"] == 12
    for k in data.GRAPH_ARRAYS:
        assert np.array_equal(eng.graphs[k], want[k]), k
    assert len(eng.graphs["edge_src"]) < len(data.read_graphs(small_data / "graphs.h5")["edge_src"])


@pytest.fixture(scope="module")
def frames_data(tmp_path_factory):
    """The embedded dataset of config/config.yaml: frames along EMT relaxations, split by trajectory."""
    from gnnpipe.atomic import data
    from gnnpipe.config import load_workflow_config
    atoms = load_workflow_config(yaml.safe_load((ROOT / "config" / "config.yaml").read_text())).datasets["slabs"].atoms
    d = tmp_path_factory.mktemp("frames")
    s = data.systems_from_config(atoms, progress=False)
    digest = data.write_systems(d / "systems.h5", s)
    data.write_graphs(d / "graphs.h5", data.build_graphs(s, atoms.cutoff, atoms.max_neighbors, progress=False),
                      atoms.cutoff, atoms.max_neighbors, digest)
    return d


@pytest.mark.slow
@pytest.mark.parametrize("kind,lr,epochs", [("dimenetpp", 0.001, 40),
                                             pytest.param("gemnet_t", 0.003, 30, marks=pytest.mark.long)])
def test_atomic_models_learn_the_embedded_dataset(frames_data, monkeypatch, kind, lr, epochs):
    """The embedded relaxation frames with the default habits, as `make run` trains them: both models
    beat both baselines on the test trajectories (measured: DimeNet++ small energy MAE 0.43 eV against
    the per-element baseline's 0.68, force MAE 0.071 eV/Å against the zero-force baseline's 0.19;
    GemNet-T small 0.38 and 0.063)."""
    from gnnpipe import train
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{frames_data / 'mlflow.db'}")
    cfg = _run_config(frames_data, epochs, kind, lr=lr, batch_size=4)
    cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, weight_decay=0.0005, eval_every=5))
    rec = train.run(cfg, progress=False)
    base = rec["extra"]
    assert rec["energy_mae"] < 0.8 * base["baseline_energy_mae"], (rec["energy_mae"], base)
    assert rec["force_mae"] < 0.5 * base["baseline_force_mae"] and rec["force_cos"] > 0.5, (rec["force_mae"], base)


@pytest.mark.slow
def test_atomic_chain_through_snakemake(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(tmp_path),
           "--configfile", str(ATOMS), "--replace-workflow-config", "--cores", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)  # ~240 s alone; twice that beside another pytest worker
    assert done.returncode == 0, done.stderr[-3000:]
    results = tmp_path / "results"
    wf = load_workflow_config(yaml.safe_load(ATOMS.read_text()))
    runs = resolve_runs(wf)
    assert {r.mode for r in runs.values()} == {"single", "graph"}
    assert {r.model.kind for r in runs.values()} == {"dimenetpp", "gemnet_t"}
    recs = {rid: json.loads((results / "runs" / rid / "metrics.json").read_text()) for rid in runs}
    for rec in recs.values():
        evaluation = json.loads((results / "runs" / rec["run_id"] / "eval.json").read_text())
        assert {"energy_mae", "force_mae", "force_cos", "efwt", "test_energy_mae", "baseline_energy_mae",
                "baseline_force_mae"} <= set(evaluation)
        assert evaluation["baseline_force_mae"] == rec["extra"]["baseline_force_mae"] > 0
        assert rec["energy_mae"] == pytest.approx(evaluation["energy_mae"], rel=1e-5)
    report = (results / "report.md").read_text()
    assert "## Atomic models (DimeNet++, GemNet-T; edge/triplet graph parallelism)" in report
    for kind, label in (("dimenetpp", "DimeNet++"), ("gemnet_t", "GemNet-T")):
        single = next(r for r in recs.values() if r["mode"] == "single" and r["model"] == kind)
        graph = next(r for r in recs.values() if r["mode"] == "graph" and r["model"] == kind)
        # graph parallelism trains the same model: the same losses (float32 summation order aside)
        for hs, hg in zip(single["history"], graph["history"]):
            assert hg["loss"] == pytest.approx(hs["loss"], rel=1e-4)
        assert graph["comm_bytes_per_epoch"] == graph["comm_bytes_predicted"] > 0
        assert f"### slabs: {label}" in report and f"`{graph['run_id']}`" in report
        assert (results / "plots" / f"atomic_curves_slabs_{kind}.png").is_file()
    _check_trained_runs_are_usable(results, runs, "EMT")  # generated data: EMT labelled it
    assert "### IS2RS: relaxations of test systems" in report and "#### slabs" in report
    assert (results / "plots" / "is2rs_slabs.png").is_file()
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{results / 'mlflow.db'}")
    found = mlflow.search_runs(experiment_names=["gnnpipe"])
    assert sorted(found["run_id"]) == sorted(r["mlflow_run_id"] for r in recs.values())
    assert set(found["status"]) == {"FINISHED"} and "metrics.final/force_cos" in found.columns
    assert {"metrics.final/baseline_force_mae", "metrics.eval/baseline_force_mae"} <= set(found.columns)
    assert "zero-force baseline" in report and "vs baselines" in report
    assert found["metrics.relax/adwt"].notna().all() and found["metrics.relax/afbt"].notna().all()


def _check_trained_runs_are_usable(results: Path, runs: dict, reference) -> None:
    """Every run the workflow trained, single or graph, loads as a calculator as it is; the
    calculator equals evaluate's predictions.h5 (float32: to rounding); relax.json is there,
    relaxed against ``reference`` (None: ML relaxations only)."""
    from gnnpipe.ase import GNNPipeCalculator
    from gnnpipe.atomic.is2rs import systems_to_atoms
    from gnnpipe.atomic.predict import read_predictions

    for rid, run in runs.items():
        preds = read_predictions(results / "runs" / rid / "predictions.h5")
        structures = systems_to_atoms({k: preds[k] for k in ("z", "pos", "cell", "pbc", "fixed", "atom_ptr")},
                                      range(len(preds["system"])))
        with GNNPipeCalculator.from_run(results / "runs" / rid) as calc:
            assert calc.model_file.dtype == run.training.dtype
            for k, atoms in enumerate(structures):
                atoms.calc = calc
                f = preds["forces"][preds["atom_ptr"][k]:preds["atom_ptr"][k + 1]]
                assert atoms.get_potential_energy() == pytest.approx(preds["energy"][k], rel=1e-5)
                np.testing.assert_allclose(atoms.get_forces(apply_constraint=False), f, rtol=0,
                                           atol=1e-4 * max(np.abs(f).max(), 1e-3))
        relax = json.loads((results / "runs" / rid / "relax.json").read_text())
        assert relax["run_id"] == rid and relax["systems"] >= 1 and relax["reference"] == reference
        if reference is not None:
            assert 0 <= relax["adwt"] <= 1 and 0 <= relax["afbt"] <= 1 and relax["energy_mae"] >= 0
        assert (results / "runs" / rid / "relax" / "0-ml.traj").is_file()


def _write_structures(systems: dict, xyz: Path, db: Path) -> None:
    """The systems as a user's files: extended XYZ and an ASE database, energies and forces stored."""
    import ase.db
    import ase.io
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.constraints import FixAtoms

    frames, ptr = [], systems["atom_ptr"]
    for s in range(len(ptr) - 1):
        a, b = ptr[s], ptr[s + 1]
        atoms = Atoms(numbers=systems["z"][a:b], positions=systems["pos"][a:b], cell=systems["cell"][s],
                      pbc=systems["pbc"][s])
        atoms.set_constraint(FixAtoms(mask=systems["fixed"][a:b]))
        atoms.calc = SinglePointCalculator(atoms, energy=float(systems["energy"][s]), forces=systems["forces"][a:b])
        atoms.info["trajectory"] = int(systems["group"][s])  # the default atoms.group_key
        frames.append(atoms)
    ase.io.write(xyz, frames, format="extxyz")
    with ase.db.connect(str(db)) as c:
        for atoms in frames:
            c.write(atoms, trajectory=atoms.info["trajectory"])


@pytest.mark.slow
def test_a_users_extxyz_and_ase_db_train_gemnet_through_snakemake(tmp_path):
    """The user's own structures, as extxyz and as an ASE db, train GemNet-T through the workflow as
    they are: single on the extxyz, graph P = 2 on the db (the same systems; extxyz rounds positions
    to 1e-8 Å, which can move a pair at the neighbour cap: a few edges apart). Each file names its
    structures' trajectories (info key / column ``trajectory``, the default group_key): the splits keep
    each trajectory whole."""
    from gnnpipe.atomic import data

    # 4 relaxations x 2 frames, split 3 / 0 / 1 by trajectory; the test one's elements all in training
    _write_structures(data.generate(4, size=(2, 2, 2), seed=6, frames_per_trajectory=2, metals=("Cu", "Pt"),
                                    adsorbates=("O", "CO"), progress=False),
                      tmp_path / "mine.extxyz", tmp_path / "mine.db")
    conf = {"datasets": {name: {"kind": "atoms", "atoms": {"file": str(tmp_path / f"mine.{ext}"), "cutoff": 4.0,
                                                             "max_neighbors": 8}}
                         for name, ext in (("xyz", "extxyz"), ("db", "db"))},
            "models": {"gem": {"kind": "gemnet_t", "gemnet_t": {"preset": "small", "num_blocks": 1, "batch_size": 2}}},
            "training": {"epochs": 2, "eval_every": 1, "checkpoint_every": 0},
            "cost_model": {"calibrate": False}, "relax": {"systems": 1, "fmax": 0.1, "steps": 10},
            "runs": [{"mode": "single", "dataset": "xyz", "model": "gem"},
                     {"mode": "graph", "dataset": "db", "model": "gem", "workers": 2}]}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(conf))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(tmp_path / "work"),
           "--configfile", str(tmp_path / "config.yaml"), "--replace-workflow-config", "--cores", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = tmp_path / "work" / "results"
    single, graph = (json.loads((results / "runs" / rid / "metrics.json").read_text())
                     for rid in ("xyz-gem-single-p1-seed0", "db-gem-graph-p2-seed0"))
    assert single["model"] == graph["model"] == "gemnet_t" and single["extra"]["label"] == "GemNet-T"
    assert single["num_systems"] == graph["num_systems"] == 8 and abs(single["num_edges"] - graph["num_edges"]) < 10
    for rec in (single, graph):
        assert len(rec["history"]) == 2 and all(np.isfinite(h["loss"]) for h in rec["history"])
        assert rec["energy_mae"] is not None and rec["force_cos"] is not None
    assert graph["comm_bytes_per_epoch"] == graph["comm_bytes_predicted"] > 0
    assert (results / "runs" / "db-gem-graph-p2-seed0" / "eval.json").is_file()
    for name in ("xyz", "db"):
        systems = data.read_systems(results / "data" / name / "systems.h5")
        assert list(systems["group"]) == [0, 0, 1, 1, 2, 2, 3, 3]
        assert all(len(set(systems["split"][systems["group"] == g])) == 1 for g in range(4))
    report = (results / "report.md").read_text()
    assert "### xyz: GemNet-T" in report
    # a user's file names no reference calculator: ML relaxations and energies only, and the report says so
    _check_trained_runs_are_usable(results, resolve_runs(load_workflow_config(conf)), None)
    relax = json.loads((results / "runs" / "xyz-gem-single-p1-seed0" / "relax.json").read_text())
    assert relax["reference"] is None and "adwt" not in relax and "no reference calculator" in relax["note"]
    assert "*no reference calculator (relax.reference none" in report and (results / "plots" / "is2rs_db.png").is_file()


def test_plan_atomic_sizes_xl_and_finds_the_smallest_p(small_data, capsys):
    from gnnpipe.atomic.atomic_engine import plan_ways
    from gnnpipe.atomic.protocol import ATOMIC_MODELS
    from gnnpipe.cli import main
    kind = ATOMIC_MODELS["dimenetpp"]
    rows = plan_ways(kind, kind.preset("xl"), atoms=2000, edges=60_000, triplets=1_500_000,
                     device_bytes=16 * 2**30)
    for part in ("edge", "column", "entry"):  # default block counts: per local edge or triplet, 1/P
        m = [r["memory"][part] for r in rows]
        assert all(abs(m[0] / x - r["ways"]) < 0.01 * r["ways"] for x, r in zip(m, rows)), part
    assert rows[0]["bytes_per_step"] == 0 < rows[1]["bytes_per_step"]
    fits = [r["ways"] for r in rows if r["fits"]]
    assert fits and fits[0] > 1 and not rows[0]["fits"]  # XL on a big system needs several ways
    assert main(["plan-atomic", "--systems", str(small_data / "systems.h5"), "--graphs",
                 str(small_data / "graphs.h5"), "--preset", "xl", "--device-gib", "4"]) == 0
    out = capsys.readouterr().out
    assert "219,342,342 parameters" in out and "smallest P that fits" in out


@pytest.mark.slow
@pytest.mark.long
def test_a_users_extxyz_of_a_large_cell_trains_on_the_atoms_layout_through_snakemake(tmp_path):
    """A user's extxyz of 256-atom Cu cells (EMT-labelled here) trains DimeNet++ through the workflow
    with ``atom_layout: atoms`` on 2 workers: each way holds a METIS part of every cell and receives
    only its halo; the measured bytes equal the halo closed form."""
    import ase.io
    from ase.build import bulk
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator

    frames = []
    for t in range(4):
        atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((4, 4, 4))
        atoms.rattle(0.05, seed=t)
        atoms.calc = EMT()
        atoms.calc = SinglePointCalculator(atoms, energy=atoms.get_potential_energy(), forces=atoms.get_forces())
        atoms.info["trajectory"] = t
        frames.append(atoms)
    ase.io.write(tmp_path / "cells.extxyz", frames, format="extxyz")
    conf = {"datasets": {"cells": {"kind": "atoms", "atoms": {"file": str(tmp_path / "cells.extxyz"), "cutoff": 4.0,
                                                               "max_neighbors": 12}}},
            "models": {"d": {"kind": "dimenetpp", "dimenetpp": {"preset": "small", "num_blocks": 1, "batch_size": 1}}},
            "training": {"epochs": 1, "eval_every": 1, "checkpoint_every": 0},
            "cost_model": {"calibrate": False}, "relax": {"systems": 1, "fmax": 0.5, "steps": 2},
            "runs": [{"mode": "graph", "dataset": "cells", "model": "d", "workers": 2, "atom_layout": "atoms"}]}
    from helpers import snakemake

    (tmp_path / "config.yaml").write_text(yaml.safe_dump(conf))
    done = snakemake(tmp_path / "work", tmp_path / "config.yaml", "--replace-workflow-config", "--cores", "2",
                     timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rec = json.loads((tmp_path / "work" / "results" / "runs" / "cells-d-graph-p2atoms-seed0" / "metrics.json").read_text())
    assert rec["num_systems"] == 4 and rec["world_size"] == 2 and rec["num_nodes"] == 4 * 256
    assert len(rec["history"]) == 1 and np.isfinite(rec["history"][0]["loss"]) and rec["force_cos"] is not None
    assert rec["comm_bytes_per_epoch"] == rec["comm_bytes_predicted"] > 0
