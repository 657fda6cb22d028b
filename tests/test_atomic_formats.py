"""The field's dataset formats (issue #34 items 4-5): fairchem's ASE-LMDB (gnnpipe.atomic.aselmdb) and
OC20's S2EF folders with their download (gnnpipe.atomic.oc20), read into the same systems as extxyz."""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import pickle
import tarfile
import zlib

import numpy as np
import pytest

from gnnpipe import config
from gnnpipe.atomic import aselmdb, data, oc20
from gnnpipe.io import GnnPipeError


def _frames():
    """Four EMT-labelled Cu(111) + O frames of two trajectories, OC20-tagged (0 sub-surface, fixed; 1
    surface; 2 adsorbate), with stress on the calculator and a trajectory / split key."""
    from ase.build import add_adsorbate, fcc111
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.constraints import FixAtoms

    out = []
    for k in range(4):
        slab = fcc111("Cu", size=(2, 2, 3), vacuum=6.0)
        add_adsorbate(slab, "O", height=2.0 + 0.1 * k, position="fcc")
        layer = slab.get_tags()  # ASE: 1 = top layer .. 3 = bottom, 0 = adsorbate
        slab.set_tags(np.where(layer == 0, 2, np.where(layer == 1, 1, 0)))
        slab.set_constraint(FixAtoms(indices=np.flatnonzero(slab.get_tags() == 0)))
        slab.positions[-1] += 0.05 * np.random.default_rng(k).normal(size=3)
        slab.calc = EMT()
        results = {"energy": slab.get_potential_energy(), "forces": slab.get_forces(apply_constraint=False),
                   "stress": slab.get_stress()}
        slab.calc = SinglePointCalculator(slab, **results)
        del slab.info["adsorbate_info"]
        slab.info.update(trajectory=f"t{k // 2}", split=("train", "train", "val", "test")[k])
        out.append(slab)
    return out


def _json_default(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(type(x))


def write_aselmdb(path, frames, ase_encoding: bool = False) -> None:
    """A test-only writer of fairchem's ASE-LMDB format (aselmdb's docstring): the row dict of ASE's
    ``AtomsRow`` (its attributes but the key-value pairs, bookkeeping, constraints as dicts, the cell an
    array, ``key_value_pairs`` and ``data``) as compact JSON (fairchem: orjson, arrays as lists; or ASE's
    ``__ndarray__`` encoding), zlib-compressed, under ASCII ids from 1, and ``nextid``."""
    import lmdb
    from ase.db.row import AtomsRow
    from ase.io.jsonio import encode

    env = lmdb.open(str(path), subdir=False, map_size=1 << 26, meminit=False)
    with env.begin(write=True) as txn:
        for i, atoms in enumerate(frames, start=1):
            row = AtomsRow(atoms)
            row.ctime, row.user = 26.0, "test"
            dct = {k: row[k] for k in row.__dict__ if k[0] != "_" and k not in row._keys and k != "id"}
            dct.update(mtime=26.0, key_value_pairs=dict(atoms.info), data={"note": "kept"},
                       constraints=[c.todict() for c in row.constraints], cell=np.asarray(dct["cell"]))
            text = encode(dct) if ase_encoding else json.dumps(dct, default=_json_default, separators=(",", ":"))
            txn.put(str(i).encode("ascii"), zlib.compress(text.encode()))
        txn.put(b"nextid", zlib.compress(json.dumps(len(frames) + 1).encode()))
    env.close()


def _same_systems(a: dict, b: dict) -> None:
    """Equal systems; floats to extxyz's printed precision (8 decimals)."""
    for k in ("z", "fixed", "pbc", "group", "split", "atom_ptr"):
        assert np.array_equal(a[k], b[k]), k
    for k in ("pos", "forces", "cell", "energy"):
        assert np.allclose(a[k], b[k], rtol=0, atol=1e-7), k


def test_aselmdb_reads_as_the_same_structures_as_extxyz(tmp_path):
    import ase.io
    from ase.db.row import AtomsRow

    frames = _frames()
    ase.io.write(tmp_path / "f.extxyz", frames)
    write_aselmdb(tmp_path / "f.aselmdb", frames)
    got = data.read_structures(tmp_path / "f.aselmdb", seed=1)
    _same_systems(got, data.read_structures(tmp_path / "f.extxyz", seed=1))
    assert got["fixed"].sum() == 4 * 8 and got["group"].tolist() == [0, 0, 1, 1]
    assert got["source"] == "file:f.aselmdb (aselmdb) split=trajectory group_key=trajectory"
    keyed = data.read_structures(tmp_path / "f.aselmdb", split="key")  # key-value pairs work as db columns
    assert keyed["split"].tolist() == [0, 0, 1, 2]
    rows = aselmdb.read_rows(tmp_path / "f.aselmdb")
    for (where, atoms, kv), ref in zip(rows, frames):  # what systems.h5 has no place for: tags, stress, data
        assert np.array_equal(atoms.get_tags(), ref.get_tags()) and kv["note"] == "kept"
        assert np.allclose(atoms.get_stress(), ref.get_stress())
    # cross-check the decoding with ASE's own row class on the same stored dict
    env_rows = _raw_rows(tmp_path / "f.aselmdb")
    theirs = AtomsRow(dict(env_rows[0])).toatoms()
    assert np.array_equal(theirs.positions, rows[0][1].positions) and theirs.constraints[0].todict() == \
        rows[0][1].constraints[0].todict()


def _raw_rows(path):
    import lmdb

    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        out = [json.loads(zlib.decompress(v)) for k, v in txn.cursor() if k.isdigit()]
    env.close()
    return out


def test_a_folder_of_two_shards_reads_in_name_order_either_json_encoding(tmp_path):
    import ase.io

    frames = _frames()
    ase.io.write(tmp_path / "f.extxyz", frames)
    (tmp_path / "ds").mkdir()
    write_aselmdb(tmp_path / "ds" / "b.aselmdb", frames[2:], ase_encoding=True)  # ASE's {"__ndarray__": ...}
    write_aselmdb(tmp_path / "ds" / "a.aselmdb", frames[:2])
    got = data.read_structures(tmp_path / "ds", seed=2)
    _same_systems(got, data.read_structures(tmp_path / "f.extxyz", seed=2))
    assert [w for w, *_ in aselmdb.read_rows(tmp_path / "ds")] == [
        "a.aselmdb row id 1", "a.aselmdb row id 2", "b.aselmdb row id 1", "b.aselmdb row id 2"]


def test_aselmdb_refusals_are_one_line(tmp_path):
    import lmdb

    (tmp_path / "junk.aselmdb").write_bytes(b"not an lmdb at all" * 300)
    env = lmdb.open(str(tmp_path / "empty.aselmdb"), subdir=False, map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"nextid", zlib.compress(b"1"))
    env.close()
    env = lmdb.open(str(tmp_path / "pickled.aselmdb"), subdir=False, map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"1", pickle.dumps({"numbers": [1]}))
    env.close()
    no_energy = _frames()[:1]
    no_energy[0].calc.results.pop("energy")
    write_aselmdb(tmp_path / "noe.aselmdb", no_energy)
    (tmp_path / "none").mkdir()
    cases = {"junk.aselmdb": "not an LMDB file", "empty.aselmdb": "an empty ASE-LMDB database",
             "pickled.aselmdb": "a pickle, not an ASE-LMDB row", "noe.aselmdb": "noe.aselmdb row id 1 has forces but no "
             "energy", "none": "a folder of neither", "missing.aselmdb": "no such structure file"}
    for name, words in cases.items():
        with pytest.raises(GnnPipeError, match=words) as e:
            data.read_structures(tmp_path / name)
        assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- OC20 S2EF
REFS = (-1.5, -1.25, -1.0, -0.75)


def write_s2ef(folder, frames, refs=REFS, sids=(7, 7, 9, 9)) -> None:
    """Two pairs as OC20 distributes them: ``0.extxyz.xz`` + ``0.txt.xz`` and ``1.extxyz.xz`` + ``1.txt``
    (uncompressed, as fairchem's uncompress.py leaves it), lines ``random<sid>,frame<fid>,<ref>``."""
    import ase.io

    folder.mkdir(parents=True, exist_ok=True)
    for k, (lo, hi) in enumerate(((0, 2), (2, 4))):
        text = io.StringIO()
        ase.io.write(text, frames[lo:hi], format="extxyz")
        (folder / f"{k}.extxyz.xz").write_bytes(lzma.compress(text.getvalue().encode()))
        lines = "".join(f"random{sids[i]},frame{i - lo},{refs[i]}\n" for i in range(lo, hi))
        if k == 0:
            (folder / f"{k}.txt.xz").write_bytes(lzma.compress(lines.encode()))
        else:
            (folder / f"{k}.txt").write_text(lines)


def test_s2ef_folder_reads_referenced_energies_grouped_by_system(tmp_path):
    import ase.io

    frames = _frames()
    write_s2ef(tmp_path / "s2ef", frames)
    got = data.read_structures(tmp_path / "s2ef", seed=5)
    total = data.read_structures(tmp_path / "s2ef", seed=5, s2ef_energy="total")
    ase.io.write(tmp_path / "f.extxyz", frames)
    plain = data.read_structures(tmp_path / "f.extxyz", seed=5)
    assert np.allclose(got["energy"], plain["energy"] - np.array(REFS)) and np.allclose(total["energy"], plain["energy"])
    for k in ("z", "pos", "forces", "cell", "pbc", "atom_ptr", "group"):
        assert np.array_equal(got[k], plain[k]), k
    tags = np.concatenate([f.get_tags() for f in frames])
    assert np.array_equal(got["fixed"], tags == 0)  # OC20's rule: forces of tags > 0 are trained and scored
    assert got["group"].tolist() == [0, 0, 1, 1]  # the system ids 7 and 9: a system is in one split
    assert got["source"] == "file:s2ef (s2ef energy=referenced) split=trajectory group=system id"
    rows = oc20.read_rows(tmp_path / "s2ef")
    assert [(a.info["sid"], a.info["fid"]) for _, a, _ in rows] == [(7, 0), (7, 1), (9, 0), (9, 1)]


def test_s2ef_tags_decide_fixed_atoms(tmp_path, capsys):
    frames = _frames()
    frames[0].set_constraint()  # a frame whose move_mask lets its 8 sub-surface atoms move
    write_s2ef(tmp_path / "s2ef", frames)
    got = data.read_structures(tmp_path / "s2ef", split="random")
    assert np.array_equal(got["fixed"], np.concatenate([f.get_tags() == 0 for f in frames]))
    assert "8 atoms' move_mask differs" in capsys.readouterr().err


def test_s2ef_refusals_are_one_line(tmp_path):
    frames = _frames()
    write_s2ef(tmp_path / "short", frames)
    (tmp_path / "short" / "1.txt").write_text("random9,frame0,-1.0\n")  # one line for two frames
    write_s2ef(tmp_path / "bad", frames)
    (tmp_path / "bad" / "1.txt").write_text("random9,frame0,-1.0\nsystem9 frame1\n")
    write_s2ef(tmp_path / "lonely", frames)
    (tmp_path / "lonely" / "1.txt").unlink()
    untagged = _frames()
    untagged[3].set_tags(0)
    write_s2ef(tmp_path / "untagged", untagged)
    cases = {"short": "1 metadata lines for the 2 frames of 1.extxyz.xz", "bad": "line 2 'system9 frame1' is not",
             "lonely": "no 1.txt", "untagged": "1.extxyz.xz frame 1 has no atom with tag > 0"}
    for name, words in cases.items():
        with pytest.raises(GnnPipeError, match=words) as e:
            data.read_structures(tmp_path / name)
        assert "\n" not in str(e.value)
    with pytest.raises(GnnPipeError, match="use referenced .* or total"):
        oc20.read_rows(tmp_path / "bad", energy="adsorption")


def _split_tar(tmp_path, frames) -> tuple[str, str]:
    """A tiny split tar laid out like OC20's (s2ef_x/s2ef_x/*.extxyz.xz, *.txt.xz, a README): file URL, MD5."""
    write_s2ef(tmp_path / "src", frames)
    tar_path = tmp_path / "s2ef_x.tar"
    with tarfile.open(tar_path, "w") as tar:
        for f in sorted((tmp_path / "src").iterdir()):
            tar.add(f, arcname=f"s2ef_x/s2ef_x/{f.name}")
        readme = tmp_path / "README.md"
        readme.write_text("frames\n")
        tar.add(readme, arcname="s2ef_x/README.md")
    return tar_path.as_uri(), hashlib.md5(tar_path.read_bytes(), usedforsecurity=False).hexdigest()


def test_fetch_split_downloads_checks_the_digest_and_reads_offline(tmp_path):
    frames = _frames()
    url, md5 = _split_tar(tmp_path, frames)
    table = {"tiny": oc20.Split(url, md5, 4), "bad": oc20.Split(url, "0" * 32, 4),
             "gone": oc20.Split((tmp_path / "nowhere.tar").as_uri(), md5, 4)}
    folder = oc20.fetch_split("tiny", tmp_path / "data" / "tiny", table)
    assert sorted(f.name for f in folder.iterdir()) == ["0.extxyz.xz", "0.txt.xz", "1.extxyz.xz", "1.txt"]
    got = data.read_structures(folder)
    oc20.check_count("tiny", len(got["energy"]), folder, table)
    with pytest.raises(GnnPipeError, match="3 S2EF frames, but OC20's split tiny has 4"):
        oc20.check_count("tiny", 3, folder, table)
    # offline: a folder holding the files is read without the network (the URL is never opened)
    offline = {"tiny": oc20.Split("http://192.0.2.1/unreachable.tar", md5, 4)}
    assert oc20.fetch_split("tiny", folder, offline) == folder
    with pytest.raises(GnnPipeError, match="has MD5 .* not the published 0{32}"):
        oc20.fetch_split("bad", tmp_path / "data" / "bad", table)
    assert not (tmp_path / "data" / "bad").exists() and not list((tmp_path / "data").glob(".bad.download-*"))
    with pytest.raises(GnnPipeError, match="holds no S2EF files and .*nowhere.tar could not be fetched.*on a machine "
                                           "with internet download") as e:
        oc20.fetch_split("gone", tmp_path / "data" / "gone", table)
    assert "\n" not in str(e.value)
    with pytest.raises(GnnPipeError, match="'3M' is not an OC20 S2EF split"):
        oc20.fetch_split("3M", tmp_path / "x")


def test_s2ef_config_keys():
    assert tuple(oc20.SPLITS) == config.S2EF_SPLITS  # the schema's enum and the URL table name the same splits
    assert all(s.url.startswith("https://dl.fbaipublicfiles.com/opencatalystproject/data/s2ef_") for s in
               oc20.SPLITS.values())
    cfg = config.AtomsConfig(s2ef_split="200k")
    with pytest.raises(config.ConfigError, match="s2ef_split: 200k needs atoms.file"):
        cfg.check("datasets.oc.atoms")
    assert config.AtomsConfig().s2ef_energy == "referenced"


@pytest.mark.slow
@pytest.mark.long  # 37 s wall on the shared 2 cores (12 s of CPU): the readers' equality is also a fast test above
def test_an_aselmdb_dataset_trains_dimenetpp_like_an_ase_db(tmp_path, monkeypatch):
    """A workflow config naming a folder of .aselmdb shards: gnnpipe data's reader gives exactly the systems
    of the same structures in an ASE db, and a tiny DimeNet++ single run trains on them (in process)."""
    import dataclasses

    import ase.db

    from gnnpipe import train

    frames = _frames()
    (tmp_path / "omat").mkdir()
    write_aselmdb(tmp_path / "omat" / "0.aselmdb", frames[:3])
    write_aselmdb(tmp_path / "omat" / "1.aselmdb", frames[3:])
    with ase.db.connect(str(tmp_path / "same.db")) as db:
        for a in frames:
            db.write(a, trajectory=a.info["trajectory"])
    conf = {"results": str(tmp_path / "res"),
            "datasets": {name: {"kind": "atoms", "atoms": {"file": str(tmp_path / f), "cutoff": 4.0, "max_neighbors": 8,
                                                            "split": "random", "train_fraction": 0.5,
                                                            "val_fraction": 0.25}}
                         for name, f in (("lmdb", "omat"), ("db", "same.db"))},
            "models": {"dpp": {"kind": "dimenetpp", "dimenetpp": {"preset": "small", "batch_size": 2}}},
            "training": {"epochs": 2, "eval_every": 2, "checkpoint_every": 0},
            "runs": [{"mode": "single", "dataset": "lmdb", "model": "dpp"}]}
    wf = config.load_workflow_config(conf)
    systems = data.systems_from_config(wf.datasets["lmdb"].atoms, progress=False)
    same = data.systems_from_config(wf.datasets["db"].atoms, progress=False)
    for k in data.SYSTEM_ARRAYS:
        assert np.array_equal(systems[k], same[k]), k
    digest = data.write_systems(tmp_path / "systems.h5", systems)
    data.write_graphs(tmp_path / "graphs.h5", data.build_graphs(systems, 4.0, 8, progress=False), 4.0, 8, digest)
    run, = config.resolve_runs(wf).values()
    run = dataclasses.replace(run, systems_path=str(tmp_path / "systems.h5"), graph_path=str(tmp_path / "graphs.h5"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    rec = train.run(run, progress=False)
    assert len(rec["history"]) == 2 and all(np.isfinite(h["loss"]) for h in rec["history"])
    assert rec["energy_mae"] is not None and rec["force_mae"] is not None and rec["num_systems"] == 4


@pytest.mark.slow
def test_a_named_s2ef_split_not_yet_downloaded_is_planned_by_the_workflow(tmp_path):
    """A dataset naming an S2EF split whose folder does not exist yet: the folder is not a missing input,
    build_systems is planned (it downloads the split, or says in one line what to do)."""
    import yaml

    from helpers import snakemake

    conf = {"datasets": {"oc": {"kind": "atoms", "atoms": {"file": "data/oc20/200k", "s2ef_split": "200k"}}},
            "models": {"dpp": {"kind": "dimenetpp"}}, "runs": [{"mode": "single", "dataset": "oc", "model": "dpp"}]}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(conf))
    res = snakemake(tmp_path, tmp_path / "config.yaml", "-n", "results/data/oc/systems.h5")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "build_systems" in res.stdout
