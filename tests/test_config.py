"""The config boundary: YAML -> typed dataclasses, with one clear error per mistake."""

import dataclasses
from pathlib import Path

import pytest

from gnnpipe.config import (ConfigError, PipelineConfig, RunConfig, TrainingConfig, dump_run_config,
                            from_dict, load_run_config, load_workflow_config, resolve_runs)


def _wf(**over):
    cfg = {
        "datasets": {"synth": {"kind": "synthetic", "synthetic": {"num_nodes": 500}}},
        "models": {"gcn2": {"kind": "gcn", "layers": 2, "hidden": 16},
                   "gcnii8": {"kind": "gcnii", "layers": 8, "hidden": 16, "lambda": 0.4}},
        "runs": [{"mode": "single", "dataset": "synth", "model": "gcn2"},
                 {"mode": "graph", "dataset": "synth", "model": "gcn2", "workers": 3},
                 {"mode": "pipeline", "dataset": "synth", "model": "gcnii8", "workers": 2},
                 {"mode": "hybrid", "dataset": "synth", "model": "gcnii8", "workers": 4, "stages": 2}],
    }
    cfg.update(over)
    return cfg


def test_resolves_layouts_and_paths():
    runs = resolve_runs(load_workflow_config(_wf()))
    by_mode = {r.mode: r for r in runs.values()}
    assert (by_mode["single"].workers, by_mode["single"].store_path) == (1, None)
    g = by_mode["graph"]
    assert (g.workers, g.stages, g.ways, g.chunks) == (3, 1, 3, 3)
    assert g.store_path == "results/chunks/synth/metis-3.h5"
    p = by_mode["pipeline"]
    assert (p.stages, p.ways, p.chunks) == (2, 1, 8)  # C = 4 S by default
    h = by_mode["hybrid"]
    assert (h.stages, h.ways, h.chunks) == (2, 2, 8)
    assert h.model.lambda_ == 0.4
    assert set(runs) == {r.run_id for r in runs.values()}
    assert p.run_id == "synth-gcnii8-pipeline-s2c8-seed0"


def test_run_config_round_trips_through_yaml(tmp_path):
    cfg = next(iter(resolve_runs(load_workflow_config(_wf())).values()))
    path = tmp_path / "run.yaml"
    path.write_text(dump_run_config(cfg))
    assert "lambda:" in path.read_text() and "lambda_" not in path.read_text()
    again = load_run_config(path)
    assert isinstance(again, RunConfig) and again == cfg


def test_a_run_directory_read_from_elsewhere_names_its_own_data(tmp_path, monkeypatch):
    """run.yaml's paths are relative to the workflow's directory: a run directory opened from another
    directory (a calculator, ``gnnpipe predict --run``) must read its own graph, not the current
    directory's results/ (another workflow's: its model would be refused as trained from another graph)."""
    cfg = next(r for r in resolve_runs(load_workflow_config(_wf())).values() if r.store_path)
    run_dir = tmp_path / "flow" / cfg.out_dir
    run_dir.mkdir(parents=True)
    (run_dir / "run.yaml").write_text(dump_run_config(cfg))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    there = load_run_config(run_dir / "run.yaml")
    assert there.graph_path == str(tmp_path / "flow" / cfg.graph_path)
    assert there.out_dir == str(run_dir) and there.store_path == str(tmp_path / "flow" / cfg.store_path)
    assert dataclasses.replace(there, graph_path=cfg.graph_path, out_dir=cfg.out_dir, store_path=cfg.store_path,
                               locality_path=cfg.locality_path, systems_path=cfg.systems_path) == cfg
    monkeypatch.chdir(tmp_path / "flow")  # where Snakemake runs: the paths as written
    assert load_run_config(Path(cfg.out_dir) / "run.yaml") == cfg
    copied = tmp_path / "copy.yaml"  # not inside its run directory: nothing to anchor to
    copied.write_text(dump_run_config(cfg))
    assert load_run_config(copied) == cfg


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c["models"]["gcn2"].update(hiden=3), "config.models.gcn2: unknown key 'hiden'"),
    (lambda c: c["models"]["gcn2"].update(kind="gin"), "config.models.gcn2.kind: 'gin' is not one of"),
    (lambda c: c["models"]["gcn2"].update(layers="two"), "config.models.gcn2.layers: expected an integer"),
    (lambda c: c.update(trainin={}), "config: unknown key 'trainin'"),
    (lambda c: c.update(relax={"fmax": 0.05, "stepz": 10}), "config.relax: unknown key 'stepz'"),
    (lambda c: c.update(relax={"optimizer": "bfgs"}), "config.relax.optimizer: 'bfgs' is not one of 'lbfgs', 'fire'"),
    (lambda c: c.update(relax={"fmax": 0}), "config.relax.fmax: 0.0 must be > 0"),
    (lambda c: c.update(relax={"reference": "dft"}), "config.relax.reference: 'dft' is not emt, none or an ASE "
                                                    "calculator class as module:Class"),
    (lambda c: c["runs"].append({"mode": "single", "dataset": "nope", "model": "gcn2"}),
     "config.runs[4].dataset: 'nope' is not in datasets"),
    (lambda c: c["runs"].append({"mode": "pipeline", "dataset": "synth", "model": "gcn2", "workers": 3}),
     "3 stages but the model has only 2 graph layers"),
    (lambda c: c["runs"].append({"mode": "pipeline", "dataset": "synth", "model": "gcnii8", "workers": 4,
                                 "chunks": 2}), "chunks (2) must be >= stages (4)"),
    (lambda c: c["runs"].append({"mode": "hybrid", "dataset": "synth", "model": "gcnii8", "workers": 3,
                                 "stages": 2}), "workers (3) must be a multiple of stages (2)"),
    (lambda c: c["runs"].append({"mode": "single", "dataset": "synth", "model": "gcn2"}),
     "run ids are not unique"),
    (lambda c: c["runs"][0].update(mode="model"), "config.runs[0].mode: 'model' is not one of"),
    # keys the run's mode would ignore (issue 21, item 6): data_parallel also entered the run id
    (lambda c: c["runs"][3].update(data_parallel=2),
     "config.runs[3].data_parallel: a hybrid run has no data-parallel replicas (only atomic runs in mode graph"),
    (lambda c: c["runs"][1].update(data_parallel=1), "config.runs[1].data_parallel: a graph run has no"),
    (lambda c: c["runs"][1].update(stages=3), "config.runs[1].stages: a graph run has no pipeline stages or chunks"),
    (lambda c: c["runs"][1].update(chunks=6), "config.runs[1].chunks: a graph run has no pipeline stages"),
    (lambda c: c["runs"][0].update(chunks=2), "config.runs[0].chunks: a single run has no pipeline stages"),
    (lambda c: c["runs"][1].update(pipeline={"momentum": 0.5}), "config.runs[1].pipeline: a graph run has no"),
    (lambda c: c["runs"][2].update(stages=1),
     "config.runs[2].stages: a pipeline run has one stage per worker (2), not 1; remove the key, or use mode hybrid"),
])
def test_bad_config_is_one_clear_error(mutate, message):
    cfg = _wf()
    mutate(cfg)
    with pytest.raises(ConfigError) as err:
        load_workflow_config(cfg)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_run_config_refuses_unknown_keys(tmp_path):
    cfg = next(iter(resolve_runs(load_workflow_config(_wf())).values()))
    path = tmp_path / "run.yaml"
    path.write_text(dump_run_config(cfg) + "surprise: 1\n")
    with pytest.raises(ConfigError, match="unknown key 'surprise'"):
        load_run_config(path)


def test_bools_and_numbers_are_not_confused():
    with pytest.raises(ConfigError, match="expected an integer"):
        from_dict(TrainingConfig, {"epochs": True})
    with pytest.raises(ConfigError, match="expected true or false"):
        from_dict(PipelineConfig, {"shuffle_chunks": "yes"})
    assert from_dict(TrainingConfig, {"lr": 1}).lr == 1.0


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c.update(training={"epochs": -5}), "config.training.epochs: -5 must be >= 1"),
    (lambda c: c["models"]["gcn2"].update(hidden=0), "config.models.gcn2.hidden: 0 must be in [1, 65536]"),
    (lambda c: c["models"]["gcn2"].update(dropout=1.0), "config.models.gcn2.dropout: 1.0 must be in [0, 1)"),
    (lambda c: c["models"]["gcn2"].update({"lambda": 0}), "config.models.gcn2.lambda: 0.0 must be > 0"),
    (lambda c: c.update(training={"lr": float("nan")}), "config.training.lr: expected a finite number, got nan"),
    (lambda c: c.update(training={"weight_decay": float("inf")}), "expected a finite number, got inf"),
    (lambda c: c.update(training={"dist_timeout_s": 0}), "config.training.dist_timeout_s: 0 must be in [1, 604800]"),
    (lambda c: c.update(training={"node_order": "metis"}),
     "config.training.node_order: 'metis' is not one of 'locality', 'given'"),
    (lambda c: c["runs"][0].update(epochs=0), "config.runs[0].epochs: 0 must be >= 1"),
    (lambda c: c["runs"][0].update(name="../../escape"), "config.runs[0].name: '../../escape' is not a valid name"),
    (lambda c: c["models"].update({"a/b": {}}), "config.models.a/b: 'a/b' is not a valid name"),
    (lambda c: c.update(results="/etc/gnnpipe"), "config.results: '/etc/gnnpipe' lies in the system directory /etc"),
    (lambda c: c.update(results="/usr"), "lies in the system directory /usr"),
    (lambda c: c.update(results="/"), "lies in the system directory"),
    (lambda c: c.update(results=""), "config.results: must not be empty"),
    (lambda c: c["datasets"]["synth"]["synthetic"].update(label_noise=1.5), "label_noise: 1.5 must be in [0, 1]"),
    (lambda c: c.update(pipeline={"momentum": 1.0}), "config.pipeline.momentum: 1.0 must be in [0, 1)"),
    # numbers that passed validation, then overflowed at train time (issue 21, item 5)
    (lambda c: c.update(training={"seed": 2**70}),
     "config.training.seed: 1180591620717411303424 does not fit in 64 bits"),
    (lambda c: c.update(training={"seed": 2**40}), "config.training.seed: 1099511627776 must be in [0, 2147483647]"),
    (lambda c: c["runs"][0].update(seed=2**31), "config.runs[0].seed: 2147483648 must be in [0, 2147483647]"),
    (lambda c: c.update(partitioning={"seed": 2**32}),
     "config.partitioning.seed: 4294967296 must be in [0, 2147483647]"),
    (lambda c: c.update(training={"dist_timeout_s": 10**20}),
     "config.training.dist_timeout_s: 100000000000000000000 does not"),
    (lambda c: c.update(training={"dist_timeout_s": 10**9}),
     "config.training.dist_timeout_s: 1000000000 must be in [1, 604800]"),
    # paths (issue 21, item 1): anything but control characters, and no Snakemake wildcards
    (lambda c: c.update(results="res\nults"), "config.results: 'res\\nults' contains the control character '\\n'"),
    (lambda c: c.update(results="r{x}"), "config.results: 'r{x}' contains { or }, which Snakemake reads as a wildcard"),
    (lambda c: c["datasets"]["synth"].update(kind="files", files={"edges": "e\t.csv"}),
     "config.datasets.synth.files.edges: 'e\\t.csv' contains the control character '\\t'"),
    (lambda c: c["datasets"]["synth"].update(atoms={"file": "s\x7f.db"}), "config.datasets.synth.atoms.file:"),
])
def test_bad_values_are_refused_outside_snakemake_too(mutate, message):
    cfg = _wf()
    mutate(cfg)
    with pytest.raises(ConfigError) as err:
        load_workflow_config(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_results_may_be_any_directory_of_the_users(tmp_path):
    for results in ("results", "../elsewhere/results", str(tmp_path / "scratch"), "/tmp/gnnpipe-results",
                    "my results", "r;touch X;", "it's $HOME `x`"):  # the rules quote every path
        assert load_workflow_config(_wf(results=results)).results == results


def test_results_naming_a_file_is_refused_in_one_line(tmp_path, monkeypatch):
    """results: naming an existing file passed the check; Snakemake then died with a 44-line
    NotADirectoryError (issue 37, item 6). The same check guards a run's out_dir."""
    import yaml

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("")
    for results, there in (("notes.txt", "is the file"), ("notes.txt/results", "is under the file")):
        with pytest.raises(ConfigError) as err:
            load_workflow_config(_wf(results=results))
        assert str(err.value) == (f"config.results: {results!r} {there} {tmp_path / 'notes.txt'}, not a directory; "
                                  "name a directory for the outputs (or move that file)")
    run = yaml.safe_load(dump_run_config(next(iter(resolve_runs(load_workflow_config(_wf())).values()))))
    with pytest.raises(ConfigError, match=r"^config.out_dir: 'notes.txt/runs/x' is under the file"):
        from_dict(RunConfig, {**run, "out_dir": "notes.txt/runs/x"})


def test_an_empty_workflow_config_is_refused_not_a_config_of_no_runs(tmp_path, capsys):
    """`gnnpipe runs --config <empty file>` exited 0 and printed nothing."""
    from gnnpipe.cli import main

    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    assert main(["runs", "--config", str(tmp_path / "empty.yaml")]) == 2
    assert capsys.readouterr().err == (f"gnnpipe: error: {tmp_path / 'empty.yaml'}: empty; a workflow config names "
                                       "its datasets, models and runs (config/config.yaml is an example)\n")
    (tmp_path / "none.yaml").write_text("datasets: {}\nmodels: {}\nruns: []\n")  # no runs: the schema's refusal too
    assert main(["runs", "--config", str(tmp_path / "none.yaml")]) == 2
    assert capsys.readouterr().err == "gnnpipe: error: config.runs: [] should be non-empty\n"


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["training"].update(epochs=-5), "training.epochs: -5 must be >= 1"),
    (lambda d: d["model"].update(hidden=0), "model.hidden: 0 must be in [1, 65536]"),
    (lambda d: d["model"].update(dropout=1.0), "model.dropout: 1.0 must be in [0, 1)"),
    (lambda d: d["training"].update(lr=float("nan")), "training.lr: expected a finite number"),
    (lambda d: d.update(run_id="../../escape"), "run_id: '../../escape' is not a valid name"),
    (lambda d: d.update(out_dir="/etc/runs/x"), "out_dir: '/etc/runs/x' lies in the system directory /etc"),
    (lambda d: d.update(workers=0), "workers: 0 must be in [1, 4096]"),
    (lambda d: d["training"].update(seed=2**70), "training.seed: 1180591620717411303424 does not fit in 64 bits"),
    (lambda d: d["training"].update(dist_timeout_s=10**20), "training.dist_timeout_s: 100000000000000000000 does"),
    (lambda d: d["training"].update(seed=2**40), "training.seed: 1099511627776 must be in [0, 2147483647]"),
])
def test_train_refuses_a_bad_run_config(tmp_path, capsys, edit, message):
    """`gnnpipe train --run-config` applies the same checks as the workflow config, before any work."""
    import yaml

    from gnnpipe.cli import main

    cfg = next(iter(resolve_runs(load_workflow_config(_wf(results=str(tmp_path / "results")))).values()))
    data = yaml.safe_load(dump_run_config(cfg))
    edit(data)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["train", "--run-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gnnpipe: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "results").exists()


def test_runs_command_validates(tmp_path, capsys):
    import yaml

    from gnnpipe.cli import main

    cfg = _wf()
    cfg["models"]["gcn2"]["hidden"] = 0
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["runs", "--config", str(path)]) == 2
    assert "config.models.gcn2.hidden: 0 must be in [1, 65536]" in capsys.readouterr().err
    path.write_text(yaml.safe_dump(_wf()).replace("gcn2:\n", "gcn2:\n    dropout: .nan\n", 1))
    assert main(["runs", "--config", str(path)]) == 2
    assert "config.models.gcn2.dropout: expected a finite number, got nan" in capsys.readouterr().err


def test_dist_timeout_is_a_training_key_the_environment_overrides(tmp_path, monkeypatch):
    import datetime

    import torch.distributed as dist

    from gnnpipe import train

    cfg = next(iter(resolve_runs(load_workflow_config(_wf(training={"dist_timeout_s": 42}))).values()))
    cfg.mode = "graph"
    seen = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    prefixes = []
    monkeypatch.setattr(dist, "rendezvous", lambda url, timeout: iter([("store", 0, cfg.workers)]))
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: prefixes.append(prefix))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout, **kw: seen.append(timeout))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a torchrun restart: keys of its own
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: cfg.workers)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("GNNPIPE_DIST_TIMEOUT", raising=False)
    train.init_distributed(cfg, train.torch.device("cpu"))
    monkeypatch.setenv("GNNPIPE_DIST_TIMEOUT", "7")
    train.init_distributed(cfg, train.torch.device("cpu"))
    assert seen == [datetime.timedelta(seconds=42), datetime.timedelta(seconds=7)]
    assert prefixes == ["gnnpipe/attempt-1"] * 2


@pytest.mark.parametrize("value", ["soon", "0", str(10**20)])
def test_a_bad_dist_timeout_in_the_environment_is_one_line(monkeypatch, value):
    from gnnpipe import train
    from gnnpipe.io import GnnPipeError

    cfg = next(iter(resolve_runs(load_workflow_config(_wf())).values()))
    monkeypatch.setenv("GNNPIPE_DIST_TIMEOUT", value)
    with pytest.raises(GnnPipeError, match=r"GNNPIPE_DIST_TIMEOUT: '.*' must be whole seconds in \[1, 604800\]"):
        train.dist_timeout_s(cfg)


# --------------------------------------------------------------------------- issue #37
@pytest.mark.parametrize("model, message", [
    ({"kind": "gcn", "heads": 4}, "config.models.m.heads: only models of kind gat read this key, a gcn model would "
                                  "ignore it; remove it (or set kind: gat)"),
    ({"kind": "mlp", "alpha": 0.2}, "config.models.m.alpha: only models of kind gcnii read this key"),
    ({"kind": "gcn", "lambda": 0.5}, "config.models.m.lambda: only models of kind gcnii read this key"),
    ({"kind": "gcnii", "norm": "layer"}, "config.models.m.norm: only models of kind gcn / sage / gat read this key"),
    ({"kind": "gcn", "gemnet_t": {"preset": "small"}},  # the default value: ignored all the same
     "config.models.m.gemnet_t: only models of kind gemnet_t read this key, a gcn model would ignore it"),
    ({"kind": "gcn", "gemnet_t": {"lr": 0.5}}, "config.models.m.gemnet_t: only models of kind gemnet_t read this key"),
    ({"kind": "dimenetpp", "hidden": 64}, "config.models.m.hidden: only models of kind gcn / sage / gat / gcnii / "
                                          "resgcn / mlp read this key, a dimenetpp model would ignore it"),
])
def test_keys_of_another_model_kind_are_refused(model, message):
    """Messages item of #37: every key only another kind reads is refused, as a section of another kind was."""
    cfg = _wf()
    cfg["models"]["m"] = model
    with pytest.raises(ConfigError) as err:
        load_workflow_config(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert load_workflow_config(_wf(models={"g": {"kind": "gat", "heads": 2, "norm": "layer"},
                                           "c": {"kind": "gcnii", "alpha": 0.2, "lambda": 1.0}},
                                    runs=[{"mode": "single", "dataset": "synth", "model": "g"}]))


def test_a_run_config_refuses_another_kinds_key_that_differs_from_its_default(tmp_path):
    """A run.yaml holds every key: one of another kind is refused when it differs from its default."""
    import yaml

    cfg = next(iter(resolve_runs(load_workflow_config(_wf())).values()))  # a gcn model
    data = yaml.safe_load(dump_run_config(cfg))
    data["model"]["heads"] = 8
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="model.heads: only models of kind gat read this key"):
        load_run_config(path)


@pytest.mark.parametrize("mutate, message", [
    # item 17: a null section, which gnnpipe runs took for its defaults while Snakemake refused it
    (lambda c: c["models"].update(gem={"kind": "gemnet_t", "gemnet_t": {"guard": None}}),
     "config.models.gem.gemnet_t.guard: expected a mapping, got null; remove the key to keep its defaults"),
    (lambda c: c.update(training=None), "config.training: expected a mapping, got null"),
    # what only the schema says (the dataclasses do not): the schema is the other half of the one judge
    (lambda c: c["datasets"].update(a={"kind": "atoms", "atoms": {"metals": []}}),
     "config.datasets.a.atoms.metals: [] should be non-empty"),
    (lambda c: c.update(runs=[]), "config.runs: [] should be non-empty"),
    (lambda c: c["datasets"].update(a={"kind": "atoms", "atoms": {"neighbors": "pyg"}}),
     "config.datasets.a.atoms.neighbors: 'pyg' is not one of 'project', 'fairchem'"),
])
def test_one_judge_for_the_workflow_config(tmp_path, capsys, mutate, message):
    """`gnnpipe runs --config` refuses what Snakemake refuses (common.smk calls the same
    load_workflow_config and nothing else), in one line."""
    import yaml

    from gnnpipe.cli import main

    cfg = _wf()
    mutate(cfg)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["runs", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c["models"]["gcn2"].update(hidden=1_000_000_000), "config.models.gcn2.hidden: 1000000000 must be in "
                                                                  "[1, 65536]"),
    (lambda c: c["models"]["gcn2"].update(layers=1_000_000), "config.models.gcn2.layers: 1000000 must be in [1, 4096]"),
    (lambda c: c["datasets"]["synth"]["synthetic"].update(num_nodes=10**12),
     "config.datasets.synth.synthetic.num_nodes: 1000000000000 must be in [2, 2147483647]"),
    (lambda c: c["models"].update(d={"kind": "dimenetpp", "dimenetpp": {"hidden_channels": 10**9}}),
     "config.models.d.dimenetpp.hidden_channels: 1000000000 must be in [1, 65536]"),
    (lambda c: c["runs"].append({"mode": "graph", "dataset": "synth", "model": "gcn2", "workers": 501}),
     "config.runs[4]: 501 parts (workers or chunks) of the 500-node graph 'synth' "
     "(datasets.synth.synthetic.num_nodes) leave some empty; use at most 500"),
    (lambda c: c["runs"].append({"mode": "pipeline", "dataset": "synth", "model": "gcnii8", "workers": 2,
                                 "chunks": 600}), "config.runs[4]: 600 parts (workers or chunks) of the 500-node"),
    (lambda c: c["runs"].append({"mode": "graph", "dataset": "synth", "model": "gcn2", "workers": 10**5}),
     "config.runs[4].workers: 100000 must be in [1, 4096]"),
    (lambda c: c["runs"].append({"mode": "graph", "dataset": "synth", "model": "gcn2", "workers": 64}),
     "config.runs[4].workers: 64 workers on one node, more than the 16 (8 per CPU, 2 CPUs here) gnnpipe starts on "
     "one machine; use fewer, or spread them over nodes with resources.workers_per_node"),
])
def test_absurd_sizes_are_refused_by_the_config_check(monkeypatch, mutate, message):
    """Item 4 of #37: sizes whose allocation would be absurd, more workers than nodes or than the machine
    starts: refused by the config check, before any job."""
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    cfg = _wf()
    mutate(cfg)
    with pytest.raises(ConfigError) as err:
        load_workflow_config(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)
    cfg["resources"] = {"workers_per_node": 8}  # spread over nodes: 64 workers are fine
    if "64 workers" in message:
        assert load_workflow_config(cfg)


def test_atomic_sections_derived_from_the_kinds_configs_keep_their_keys_order_and_defaults():
    """Each atomic kind's section is derived from its config class (gnnpipe.config.atomic_spec); a run.yaml
    (and every run's record) holds its keys in this order with these defaults, as when the sections were
    written by hand: a change here changes every atomic run.yaml."""
    import typing

    from gnnpipe.config import ATOMIC_SPECS, ModelConfig, bounds, to_dict

    shared = {"preset": "small", "force_head": None, "force_weight": 10.0, "batch_size": 4, "lr": 0.001,
              "cutoff": None, "schedule": {"warmup_epochs": 2.0, "decay": "cosine", "min_lr_factor": 0.02},
              "clip_grad_norm": 10.0, "ema_decay": 0.99,
              "guard": {"loss_factor": 3.0, "patience": 3, "min_force_cos": -0.2}, "eval_train_systems": 500}
    sizes = {"dimenetpp": ["hidden_channels", "num_blocks", "int_emb_size", "basis_emb_size", "out_emb_channels",
                           "num_spherical", "num_radial"],
             "gemnet_t": ["num_spherical", "num_radial", "num_blocks", "emb_size_atom", "emb_size_edge",
                          "emb_size_trip", "emb_size_rbf", "emb_size_cbf", "emb_size_bil_trip", "num_before_skip",
                          "num_after_skip", "num_concat", "num_atom"]}
    import pickle

    d = to_dict(ModelConfig())
    for kind in ATOMIC_SPECS:  # spawned workers receive configs by pickle: the derived classes are found by name
        assert pickle.loads(pickle.dumps(ModelConfig(kind=kind))) == ModelConfig(kind=kind)
    assert list(d) == ["kind", "layers", "hidden", "dropout", "heads", "alpha", "lambda", "norm", "init_from",
                       *ATOMIC_SPECS]
    for kind, names in sizes.items():
        want = {**shared, **({"force_head": "gradient"} if kind == "dimenetpp" else {}), **dict.fromkeys(names),
                **({"compile": False} if kind == "dimenetpp" else {})}  # #37 item 16's opt-in torch.compile
        assert list(d[kind].items()) == list(want.items()), kind
        spec = ATOMIC_SPECS[kind]
        hints = typing.get_type_hints(spec)
        for name in names:
            assert hints[name] == typing.Optional[int]
            assert bounds(spec)[name].hi == (4096 if name.startswith("num_") else 2**16)
    # DimeNet++'s force head is its own (no preset sets it); GemNet's preset chooses T or dT
    assert typing.get_type_hints(ATOMIC_SPECS["dimenetpp"])["force_head"] == typing.Literal["gradient", "direct"]
    assert typing.get_type_hints(ATOMIC_SPECS["gemnet_t"])["force_head"] == \
        typing.Optional[typing.Literal["gradient", "direct"]]
