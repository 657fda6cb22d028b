"""The self-describing atomic model file: round trips, the committed format-1 file, and one-line
refusals of everything that is not a finished model of a known kind."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import tiny_atomic_model

from gnnpipe.atomic import data
from gnnpipe.atomic.modelfile import (FORMAT_VERSION, PAYLOAD_KEY, load_model_file,
                                      payload_from_engine, save_model_file, upgrade_run)
from gnnpipe.checkpoint import digest
from gnnpipe.io import GnnPipeError

DATA = Path(__file__).resolve().parent / "fixtures" / "atomic-model"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def slabs():
    return data.generate(6, seed=4, progress=False)


@pytest.fixture(scope="module")
def mf(slabs):
    return tiny_atomic_model(slabs, "gemnet_t")


def _refused(path, match):
    with pytest.raises(GnnPipeError, match=match) as e:
        load_model_file(path)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def test_round_trip_bare_in_a_checkpoint_and_in_a_run_dir(tmp_path, mf):
    payload = {**mf.payload(), "fingerprint": {"config_hash": "abc"}, "run_id": "r1"}
    bare = save_model_file(tmp_path / "m.pt", payload)
    assert set(torch.load(bare, weights_only=True)) >= {"format", "format_version", "kind", "model_config",
                                                         "cutoff", "max_neighbors", "symmetric_edges", "normalizer",
                                                         "elements", "dtype", "fingerprint", "state_dict", "digest"}
    run = tmp_path / "run"
    run.mkdir()
    ckpt = {"model": mf.state_dict, "epoch": 4, "epochs_done": 5, "config": {"training": {"epochs": 5}},
            PAYLOAD_KEY: payload}
    torch.save({**ckpt, "digest": digest(ckpt)}, run / "model.pt")
    for path in (bare, run / "model.pt", run):
        got = load_model_file(path)
        assert (got.kind, got.cutoff, got.max_neighbors, got.symmetric_edges, got.dtype, got.run_id) == \
               ("gemnet_t", 4.5, 12, True, "float64", "r1")
        assert got.fingerprint == {"config_hash": "abc"} and got.elements == mf.elements
        assert np.array_equal(got.e_ref, mf.e_ref) and got.scale == mf.scale
        model = got.build()
        assert not model.training and all(torch.equal(model.state_dict()[k], v) for k, v in mf.state_dict.items())


def test_the_committed_format_1_file_loads_and_predicts_what_it_did():
    """tests/fixtures/atomic-model/model-v1.pt (its make.py wrote it) must keep loading, with its
    energies, as the format moves on (format 1 knew one neighbour convention: project)."""
    from ase.build import add_adsorbate, fcc111
    from ase.constraints import FixAtoms

    from gnnpipe.ase import GNNPipeCalculator

    mf = load_model_file(DATA / "model-v1.pt")
    assert (mf.kind, mf.cutoff, mf.max_neighbors, mf.symmetric_edges, mf.elements, mf.neighbors) == \
           ("dimenetpp", 4.0, 12, False, (6, 8, 29), "project")
    slab = fcc111("Cu", size=(2, 2, 2), vacuum=5.0)  # the fixture's make.py: reference_structure
    add_adsorbate(slab, "O", 1.8, "fcc")
    slab.set_constraint(FixAtoms(indices=[a.index for a in slab if a.tag == 2]))
    slab.calc = GNNPipeCalculator(mf)
    want = json.loads((DATA / "model-v1.json").read_text())
    assert slab.get_potential_energy() == pytest.approx(want["energy"], abs=1e-9)
    np.testing.assert_allclose(slab.get_forces(apply_constraint=False), want["forces"], atol=1e-9)


def test_the_neighbour_convention_round_trips_and_an_unknown_one_is_refused(tmp_path, slabs):
    mf = tiny_atomic_model(slabs, "gemnet_t", neighbors="fairchem")
    path = save_model_file(tmp_path / "m.pt", mf.payload())
    assert torch.load(path, weights_only=True)["format_version"] == FORMAT_VERSION == 2
    assert load_model_file(path).neighbors == "fairchem"
    torch.save({**mf.payload(), "neighbors": "pyg"}, path)
    _refused(path, r"neighbour convention 'pyg' is none of project, fairchem \(written by a newer gnnpipe\?\)")
    torch.save({k: v for k, v in mf.payload().items() if k != "neighbors"}, path)
    _refused(path, r"incomplete model file \(missing neighbors\)")  # format 2 says it


def test_an_older_gnnpipes_model_pt_is_refused_with_what_to_do(tmp_path):
    msg = _refused(DATA / "legacy-model.pt", r"a model.pt of an older gnnpipe \(weights only: no normaliser, "
                                            r"cutoff or elements\); rebuild its model file with "
                                            r"gnnpipe.atomic.modelfile.upgrade_run\(<run dir>\)")
    assert "retrain run slabs-dpp-single-p1-seed0" in msg


@pytest.mark.parametrize("case,match", [
    ("missing", "no such run directory or model file"),
    ("empty_dir", r"no model.pt in this run directory; train the run to the end first"),
    ("unfinished_dir", r"it has an intermediate checkpoint.pt: training has not finished"),
    ("garbage", "not a gnnpipe model file or checkpoint"),
    ("not_a_dict", r"not a gnnpipe model file \(holds a list"),
    ("node_level", r"the checkpoint of a 'gcn' run, not an atomic model \(atomic kinds: dimenetpp, gemnet_t\)"),
    ("partial", r"a partial checkpoint \(after 3 of 10 epochs\), not a finished model"),
    ("newer", rf"format version {FORMAT_VERSION + 1}, this gnnpipe reads up to {FORMAT_VERSION}: upgrade gnnpipe"),
    ("older", rf"format version 0, this gnnpipe reads {FORMAT_VERSION}"),
    ("unknown_kind", r"unknown atomic model kind 'mace'; known: dimenetpp, gemnet_t"),
    ("incomplete", r"incomplete model file \(missing normalizer, state_dict\)"),
    ("foreign", r"not a gnnpipe atomic model \(format 'something-else'"),
    ("flipped", "its digest does not match its contents"),
    ("wrong_weights", r"the weights do not fit a gemnet_t of its model_config"),
])
def test_refusals_are_one_line(tmp_path, mf, case, match):
    payload = mf.payload()
    path = tmp_path / "m.pt"
    if case == "missing":
        path = tmp_path / "nothing-here"
    elif case in ("empty_dir", "unfinished_dir"):
        path = tmp_path / "run"
        path.mkdir()
        if case == "unfinished_dir":
            torch.save({"model": {}}, path / "checkpoint.pt")
    elif case == "garbage":
        path.write_text("not a torch file\n")
    elif case == "not_a_dict":
        torch.save([1, 2], path)
    elif case in ("node_level", "partial"):
        done = 3 if case == "partial" else 10
        kind = "gcn" if case == "node_level" else "dimenetpp"
        torch.save({"model": {}, "epochs_done": done, "config": {"model": {"kind": kind}, "training": {"epochs": 10}}},
                   path)
    elif case == "flipped":
        save_model_file(path, payload)
        body = torch.load(path, weights_only=True)
        body["cutoff"] = 5.0  # one value edited after writing
        torch.save(body, path)
    elif case == "wrong_weights":
        save_model_file(path, {**payload, "state_dict": {k: v for k, v in list(payload["state_dict"].items())[1:]}})
        model = load_model_file(path)
        with pytest.raises(GnnPipeError, match=match):
            model.build()
        return
    else:
        edit = {"newer": {"format_version": FORMAT_VERSION + 1}, "older": {"format_version": 0},
                "unknown_kind": {"kind": "mace"}, "foreign": {"format": "something-else"}}.get(case, {})
        body = {k: v for k, v in {**payload, **edit}.items() if not (case == "incomplete" and
                                                                        k in ("normalizer", "state_dict"))}
        torch.save(body, path)
    _refused(path, match)


@pytest.mark.parametrize("case,why", [("pickle", r"holds more than tensors and plain types, or is damaged "
                                                  r"\(UnpicklingError\)"),
                                       ("empty", r"empty \(0 bytes: a write cut short\?\)"), ("text", "not a torch file")])
def test_every_reader_refuses_an_unsafe_or_empty_file_in_one_line_without_torchs_advice(tmp_path, case, why, capsys):
    """A model.pt whose payload needs pickle (issue #37, messages): evaluate's reader quoted torch's 6 lines
    advising weights_only=False; every reader says what the file is in one line and never advises that."""
    from argparse import Namespace

    from gnnpipe import cli
    from gnnpipe.checkpoint import load_checkpoint, load_shard

    path = tmp_path / "resume" / "epoch-1" / "rank-0.pt"
    path.parent.mkdir(parents=True)
    if case == "pickle":
        torch.save({"model": {}, "extra": Namespace(a=1)}, path)  # an arbitrary object: only pickle loads it
    else:
        path.write_text("" if case == "empty" else "not a torch file\n")
    for read in (load_checkpoint, load_model_file, lambda p: load_shard(tmp_path, {"dir": "epoch-1"}, 0)):
        with pytest.raises(GnnPipeError, match=why) as e:
            read(path)
        assert "\n" not in str(e.value) and "weights_only" not in str(e.value), str(e.value)
    run_yaml = tmp_path / "run.yaml"
    from helpers import run_cfg

    from gnnpipe.config import dump_run_config
    run_yaml.write_text(dump_run_config(run_cfg(tmp_path, {"kind": "gcn"})))
    assert cli.main(["evaluate", "--run-config", str(run_yaml), "--checkpoint", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(why, err) and "weights_only" not in err, err


def test_payload_from_the_engine_and_upgrade_of_an_older_run(tmp_path, monkeypatch):
    """The trainer's engine gives the payload; a run whose model.pt holds weights only is upgraded
    from its run.yaml and data files, and then its run dir loads (model-v1.pt beside model.pt)."""
    import dataclasses

    from gnnpipe.atomic.atomic_engine import AtomicEngine
    from gnnpipe.atomic.inference import Predictor
    from gnnpipe.config import dump_run_config, load_workflow_config, resolve_runs, to_dict
    from gnnpipe.checkpoint import run_fingerprint

    s = data.generate(6, seed=4, progress=False)
    d = tmp_path / "data"
    h = data.write_systems(d / "systems.h5", s)
    data.write_graphs(d / "graphs.h5", data.build_graphs(s, 4.0, 10, progress=False), 4.0, 10, h)
    wf = load_workflow_config({"results": str(tmp_path / "res"), "datasets": {"slabs": {"kind": "atoms"}},
                               "models": {"dpp": {"kind": "dimenetpp", "dimenetpp": {"preset": "small"}}},
                               "training": {"epochs": 1}, "runs": [{"mode": "single", "dataset": "slabs",
                                                                     "model": "dpp"}]})
    cfg, = resolve_runs(wf).values()
    cfg = dataclasses.replace(cfg, systems_path=str(d / "systems.h5"), graph_path=str(d / "graphs.h5"))
    engine = AtomicEngine(cfg, None, None, torch.device("cpu"))
    payload = payload_from_engine(engine, fingerprint={"config_hash": "x"})
    train = np.nonzero(s["split"] == 0)[0]
    assert payload["elements"] == sorted(set(np.concatenate([s["z"][s["atom_ptr"][i]:s["atom_ptr"][i + 1]]
                                                             for i in train]).tolist()))
    assert (payload["kind"], payload["cutoff"], payload["max_neighbors"], payload["symmetric_edges"],
            payload["dtype"]) == ("dimenetpp", 4.0, 10, True, cfg.training.dtype)  # graphs.h5 v2: symmetric
    assert torch.equal(payload["normalizer"]["e_ref"], torch.as_tensor(engine.norm.e_ref))
    assert payload["neighbors"] == "project"  # the graphs' convention goes into the model file
    engine.graphs = {**engine.graphs, "neighbors": "fairchem"}
    assert payload_from_engine(engine)["neighbors"] == "fairchem"
    engine.graphs = {**engine.graphs, "neighbors": "project"}
    run = Path(cfg.out_dir)
    run.mkdir(parents=True)
    (run / "run.yaml").write_text(dump_run_config(cfg))
    legacy = {"model": engine.full_state_dict(), "epoch": 0, "epochs_done": 1, "run_id": cfg.run_id,
              "config": to_dict(cfg), **run_fingerprint(cfg)}
    torch.save({**legacy, "digest": digest(legacy)}, run / "model.pt")
    _refused(run, "a model.pt of an older gnnpipe")
    upgraded = upgrade_run(run)
    got = load_model_file(run)
    assert got.source == str(upgraded) and got.fingerprint["config_hash"] == legacy["config_hash"]
    p = Predictor(got)
    b = data.batch_arrays(engine.systems, engine.graphs, [0])
    e = p.predict(b["z"], b["pos"], s["cell"][0], s["pbc"][0]).energy
    assert np.isfinite(e)
    with pytest.raises(GnnPipeError, match="is gone, and the normaliser cannot be refitted"):
        (d / "graphs.h5").unlink()
        (run / "model-v1.pt").unlink()
        upgrade_run(run)
