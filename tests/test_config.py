"""The config boundary: YAML -> typed dataclasses, with one clear error per mistake."""

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


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c["models"]["gcn2"].update(hiden=3), "config.models.gcn2: unknown key 'hiden'"),
    (lambda c: c["models"]["gcn2"].update(kind="gin"), "config.models.gcn2.kind: 'gin' is not one of"),
    (lambda c: c["models"]["gcn2"].update(layers="two"), "config.models.gcn2.layers: expected an integer"),
    (lambda c: c.update(trainin={}), "config: unknown key 'trainin'"),
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
