"""The Snakemake workflow: lint, the DAG of the default config, config errors, Slurm
resources, the schema against the config dataclasses, and (slow) the tiny config end to end.

Snakemake always runs in a temporary working directory (``--directory``), never in the
repository's results/.
"""

import dataclasses
import json
import re
import subprocess
import types
import typing
from types import SimpleNamespace

import pytest
import yaml

from gnnpipe.config import WorkflowConfig, bounds, load_workflow_config, resolve_runs, run_id
from helpers import ROOT, TINY, snakemake, write_config

DEFAULT = ROOT / "config" / "config.yaml"
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"


def job_counts(output: str) -> dict[str, int]:
    table = output[output.index("Job stats:"):]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m[1] != "total"}


# ----------------------------------------------------------------------------- static checks
def test_lint_is_clean(tmp_path):
    res = snakemake(tmp_path, DEFAULT, "--lint")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Lints for" not in res.stdout + res.stderr


def test_dry_run_of_the_default_config_lists_every_stage(tmp_path):
    runs = resolve_runs(load_workflow_config(yaml.safe_load(DEFAULT.read_text())))
    stores = {r.store_path for r in runs.values() if r.store_path}
    assert {r.mode for r in runs.values()} >= {"single", "graph", "pipeline"}
    res = snakemake(tmp_path, DEFAULT, "-n", "-p")
    assert res.returncode == 0, res.stderr
    out = res.stdout + res.stderr
    # the cost model: partition statistics per dataset, a calibrated profile per (dataset, model
    # with graph layers); mlp has no cost model
    wf = load_workflow_config(yaml.safe_load(DEFAULT.read_text()))
    fitted = {(s.dataset, s.model) for s in wf.runs
              if wf.models[s.model].kind != "mlp" and not runs[run_id(wf, s)].atomic}
    node = {r.dataset_name for r in runs.values() if not r.atomic}
    atoms = {r.dataset_name for r in runs.values() if r.atomic}
    assert atoms, "the default config trains an atomic model too"
    assert job_counts(out) == {
        "all": 1, "dataset_spec": len(node) + len(atoms), "build_graph": len(node), "partition": len(stores),
        "materialize": len(stores), "build_systems": len(atoms), "atom_graphs": len(atoms),
        "run_config": len(runs), "report": 1, "plan_stats": len(node), "calibrate": len(fitted),
        "cost_predictions": 1,  # the report's cost-model column, made with torch so that the report is not (#36)
        # the single engine's node order, once per graph (#36)
        "locality": len({r.dataset_name for r in runs.values() if r.locality_path}),
        # node runs: the train job writes eval.json itself (#36); atomic runs: eval.json and predictions.h5
        # in an evaluate job, then IS2RS (config relax:)
        "train": sum(not r.atomic for r in runs.values()), "train_atomic": sum(r.atomic for r in runs.values()),
        "evaluate_atomic": sum(r.atomic for r in runs.values()),
        "relax": sum(r.atomic for r in runs.values()) if wf.relax.systems else 0}
    for rid in (rid for rid, r in runs.items() if r.atomic):
        assert f"results/runs/{rid}/predictions.h5" in out and f"results/runs/{rid}/relax.json" in out
    for d, m in fitted:
        assert f"results/cost_model/{d}/{m}.yaml" in out
        # calibration fits the layers the train jobs of that dataset and model timed (#36)
        cmd = next(l for l in out.splitlines() if l.startswith("Shell command:") and "gnnpipe calibrate" in l
                   and f"cost_model/{d}/{m}.yaml" in l)
        records = cmd[cmd.index("--records"):cmd.index("--out")].split()[1:]
        assert sorted(records) == sorted(f"results/runs/{run_id(wf, s)}/metrics.json" for s in wf.runs
                                         if (s.dataset, s.model) == (d, m)), cmd
    for store in stores:  # exactly the stores the runs read, at k = P (graph) or C (pipeline)
        assert f"output: {store}" in out
    for d in node:  # plan_stats reads the partitions the stores are made of, partitions only the others
        cmd = next(l for l in out.splitlines() if l.startswith("Shell command:") and "gnnpipe plan-stats" in l
                   and f"/data/{d}/graph.h5" in l)
        counts = {r.chunks for r in runs.values() if r.dataset_name == d and r.store_path}
        assert counts and all(f"--assignment {k}=results/partitions/{d}/metis-{k}.npy" in cmd for k in counts), cmd
    for rid, run in runs.items():
        cmd = next(l for l in out.splitlines() if l.startswith("Shell command:") and f"runs/{rid}/run.yaml >" in l
                   and " train " in l)
        if run.mode == "single":
            assert "gnnpipe train --run-config" in cmd and "torchrun" not in cmd
        else:
            assert f"torchrun --nnodes 1 --nproc-per-node {run.workers} --standalone -m gnnpipe.cli train" in cmd
        assert f"OMP_NUM_THREADS={run.training.threads_per_worker}" in cmd
    assert not (tmp_path / "results").exists()


def _calibrate_threads(out: str) -> dict:
    """{model: threads} of the calibrate jobs in a dry run's listing (Snakemake prints threads above 1)."""
    jobs = {}
    for block in re.split(r"^(?=\[|rule |localrule )", out, flags=re.M):  # a job: its rule line to the next
        if block.startswith("rule calibrate:"):
            model = re.search(r"model=(\w+)", block)[1]
            found = re.search(r"^\s+threads: (\d+)$", block, re.M)
            jobs[model] = int(found[1]) if found else 1
    return jobs


def test_calibration_fitting_the_train_jobs_records_takes_one_thread_timing_takes_the_machine(tmp_path):
    """Calibration from the train jobs' records times nothing: one thread, beside other jobs. Where
    it times samples itself (no parallel run of the model recorded its workers), it runs alone."""
    cfg = write_config(tmp_path, lambda c: c.update(runs=[
        {"mode": "single", "dataset": "tiny", "model": "gcnii4"},
        {"mode": "graph", "dataset": "tiny", "model": "gcnii4", "workers": 2},
        {"mode": "single", "dataset": "tiny", "model": "gcn2"}]))
    res = snakemake(tmp_path, cfg, "-n", "--cores", "2")
    assert res.returncode == 0, res.stderr
    assert _calibrate_threads(res.stdout + res.stderr) == {"gcnii4": 1, "gcn2": 2}


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["training"].update(epochz=3),
     "config.training: unknown key 'epochz' (known: checkpoint_every, clip_grad_norm, dist_timeout_s, dtype,"),
    (lambda c: c["runs"][0].update(mode="sharded"),
     "config.runs[0].mode: 'sharded' is not one of 'single', 'graph', 'pipeline', 'hybrid'"),
    (lambda c: c["models"]["gcn2"].update(layers=0), "config.models.gcn2.layers: 0 must be in [1, 4096]"),
    (lambda c: c["runs"][1].update(dataset="nope"), "config.runs[1].dataset: 'nope' is not in datasets (tiny)"),
    (lambda c: (c.update(resources={"workers_per_node": 3}),
                c.update(runs=[{"mode": "graph", "dataset": "tiny", "model": "gcn2", "workers": 4}])),
     "config.resources.workers_per_node: run tiny-gcn2-graph-p4-seed0 has 4 workers, not a multiple of 3"),
    (lambda c: (c["models"].update(gem={"kind": "gemnet_t"}),
                c.update(runs=[{"mode": "graph", "dataset": "tiny", "model": "gem", "workers": 2}])),
     "config.runs[0]: dataset 'tiny' (synthetic) and model 'gem' (gemnet_t) do not fit: atoms datasets train atomic"),
    (lambda c: c["models"].update(gem={"kind": "gemnet"}),
     "config.models.gem.kind: 'gemnet' is not one of 'gcn', 'sage', 'gat', 'gcnii', 'resgcn', 'mlp', 'dimenetpp', "
     "'gemnet_t'"),
    # issue #37, item 17: a null section, which `gnnpipe runs` accepted and the schema refused
    (lambda c: c.update(graph_parallel=None),
     "config.graph_parallel: expected a mapping, got null; remove the key to keep its defaults"),
], ids=["unknown-key", "bad-enum", "bad-number", "unknown-dataset", "workers-per-node", "gemnet-on-node-data",
        "model-kind", "null"])
def test_config_errors_are_one_line(tmp_path, edit, message):
    """The one judge of a workflow config (``load_workflow_config``, which common.smk calls) says each
    in one line; the next test shows Snakemake printing that line before any job."""
    from gnnpipe.config import ConfigError

    with pytest.raises(ConfigError) as err:
        load_workflow_config(yaml.safe_load(write_config(tmp_path, edit).read_text()))
    assert message in str(err.value) and str(err.value).startswith("config.") and "\n" not in str(err.value)


def test_a_config_error_is_one_line_before_any_job(tmp_path):
    work = tmp_path / "work"
    res = snakemake(work, write_config(tmp_path, lambda c: c["training"].update(epochz=3)), "--cores", "1",
                    timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode != 0
    line = next((l for l in out.splitlines() if "config.training: unknown key 'epochz'" in l), None)
    assert line is not None and line.startswith("invalid config: config."), out
    assert "Traceback" not in out and "Failed validating" not in out
    assert not (work / "results").exists() and not (work / "logs").exists()


def test_slurm_profile_places_a_multi_node_gpu_run(tmp_path):
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    def edit(c):
        c["resources"] = {"gpus_per_worker": 1, "workers_per_node": 2, "mem_mb_per_worker": 3000, "runtime_min": 45}
        c["runs"] = [{"mode": "graph", "dataset": "tiny", "model": "gcn2", "workers": 4},
                     {"mode": "pipeline", "dataset": "tiny", "model": "gcnii4", "workers": 2}]
        c.setdefault("training", {})["max_restarts"] = 2  # a crashed group is restarted, and resumes

    res = snakemake(tmp_path, write_config(tmp_path, edit), "-n", "-p", "--profile", str(ROOT / "profiles" / "slurm"))
    assert res.returncode == 0, res.stderr
    jobs = {}
    for block in res.stdout.split("\nrule ")[1:]:
        if block.startswith("train:"):
            rid = re.search(r"wildcards: run_id=(\S+)", block)[1]
            resources = dict(kv.split("=", 1) for kv in re.search(r"resources: (.*)", block)[1].split(", "))
            jobs[rid] = (resources, re.search(r"Shell command: (.*)", block)[1])
    res4, cmd4 = jobs["tiny-gcn2-graph-p4-seed0"]
    assert {k: res4[k] for k in ("nodes", "tasks", "cpus_per_task", "gres", "mpi", "mem_mb", "runtime",
                                 "slurm_account")} == {
        "nodes": "2", "tasks": "2", "cpus_per_task": "2", "gres": "gpu:2", "mpi": "srun", "mem_mb": "6000",
        "runtime": "45", "slurm_account": "<your_account>"}
    assert cmd4.startswith("export OMP_NUM_THREADS=1; ")
    assert ("srun --nodes 2 --ntasks-per-node 1 torchrun --nnodes 2 --nproc-per-node 2 --max-restarts 2 --rdzv-id $SLURM_JOB_ID "
            "--rdzv-backend c10d --rdzv-endpoint") in cmd4
    res2, cmd2 = jobs["tiny-gcnii4-pipeline-s2c8-seed0"]
    assert res2["nodes"] == "1" and res2["gres"] == "gpu:2" and "mpi" not in res2
    assert "torchrun --nnodes 1 --nproc-per-node 2 --max-restarts 2 --standalone" in cmd2 and "srun" not in cmd2

    # what the Slurm plugin makes of these resources
    class Resources(dict):
        __getattr__ = dict.__getitem__

    def sbatch(resources):
        typed = Resources({k: int(v) if v.isdigit() else v for k, v in resources.items()})
        job = SimpleNamespace(resources=typed, threads=typed["cpus_per_task"])
        params = {"run_uuid": "u", "slurm_logfile": "l", "comment_str": "c", "account": "-A a",
                  "partition": "-p p", "workdir": "w"}
        return get_submit_command(job, params) + set_gres_string(job)

    line4 = sbatch(res4)
    assert "--nodes=2" in line4 and "--ntasks=2" in line4 and "--cpus-per-task=2" in line4
    assert "--gres=gpu:2" in line4 and "--mem 6000" in line4 and "ntasks-per-gpu" not in line4
    line2 = sbatch(res2)
    assert "--nodes=1" in line2 and "--gres=gpu:2" in line2 and "--ntasks" not in line2


# ----------------------------------------------------------------------------- shell quoting
# Interpolations a rule's shell may leave unquoted: command lines built in common.smk from
# constants and numbers (the launcher expands $SLURM_JOB_ID and $(hostname) in the job's shell), and
# plan_stats's repeated ``--assignment K=FILE`` options, each quoted by shlex in common.smk.
SHELL_FRAGMENTS = {"params.launch", "params.assignments", "params.predictions"}


def rule_shells() -> dict[str, str]:
    """``{rule: shell command template}`` of every rule in workflow/rules/*.smk."""
    import ast

    shells = {}
    for smk in sorted((ROOT / "workflow" / "rules").glob("*.smk")):
        lines = smk.read_text().splitlines()
        rule = None
        for i, line in enumerate(lines):
            if m := re.match(r"rule (\w+):", line):
                rule = m[1]
            if re.fullmatch(r"\s+shell:\s*", line):
                indent = len(line) - len(line.lstrip())
                body = []
                for nxt in lines[i + 1:]:
                    if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                        break
                    body.append(nxt)
                shells[rule] = ast.literal_eval("(" + "\n".join(body) + ")")  # adjacent literals: one string
    return shells


def unquoted_fields(template: str) -> list[str]:
    """The fields of a shell template that are neither ``:q`` nor a known command fragment."""
    import string

    return [name for _, name, spec, _ in string.Formatter().parse(template)
            if name is not None and spec != "q" and name not in SHELL_FRAGMENTS]


def test_every_interpolation_in_a_rule_shell_is_quoted():
    """Issue 21 (items 1, 8): `results: "r;touch X;"` ran `touch X`; a path with a space wrote a stray
    file. A new rule that interpolates a path without `:q` fails here."""
    assert unquoted_fields("gnnpipe x --out {output.a} --log {log:q} {params.launch}") == ["output.a"]
    assert unquoted_fields("export X=\"${{HOME}}\"; cat {input:q}") == []  # {{ }}: the shell's own braces
    shells = rule_shells()
    rules = set(re.findall(r"^rule (\w+):", "".join(p.read_text() for p in (ROOT / "workflow" / "rules").glob("*.smk")),
                           re.M))
    assert set(shells) == rules  # every rule has a shell this test read
    bad = {rule: unquoted_fields(cmd) for rule, cmd in shells.items() if unquoted_fields(cmd)}
    assert not bad, f"interpolations without :q in rule shells: {bad}"


@pytest.mark.slow
def test_results_with_spaces_and_shell_characters_work(tmp_path):
    """The whole DAG of a single run (data, run config, train, evaluate, cost-model statistics,
    report) under a results directory with a space and a semicolon: it works and runs nothing else."""
    results = "my r;touch X;"
    def edit(c):
        c.update(results=results, runs=[{"mode": "single", "dataset": "tiny", "model": "mlp", "epochs": 2}])
        c["cost_model"] = {"calibrate": False}

    work = tmp_path / "work"
    res = snakemake(work, write_config(tmp_path, edit), "--cores", "2", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (work / "X").exists() and not (work / "my").exists() and not (work / "r").exists()
    assert sorted(p.name for p in work.iterdir()) == sorted([".snakemake", results])  # logs too: results/logs
    out = work / results
    assert (out / "report.md").is_file() and json.loads(next(out.glob("runs/*/eval.json")).read_text())["test_acc"]


# ----------------------------------------------------------------------------- schema == dataclasses
def _resolve(schema: dict, node: dict) -> dict:
    while "$ref" in node:
        target = schema
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def _types(node: dict) -> set:
    t = node.get("type", [])
    return set([t] if isinstance(t, str) else t)


_BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _check(schema: dict, node: dict, tp, where: str) -> None:
    node = _resolve(schema, node)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is typing.Any:  # checked by the code that uses it (e.g. config.run_pipeline)
        return
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = {("lambda" if f.name == "lambda_" else f.name): f for f in dataclasses.fields(tp)}
        assert node["additionalProperties"] is False, where
        assert set(node["properties"]) == set(fields), where
        required = {k for k, f in fields.items()
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        assert set(node.get("required", [])) >= required, where
        for key, f in fields.items():
            sub = _resolve(schema, node["properties"][key])
            if f.default is dataclasses.MISSING or f.default is None:  # required, a section, or null
                assert "default" not in sub, f"{where}.{key}: a schema default the dataclass lacks"
            else:
                assert sub.get("default") == f.default and isinstance(sub["default"], bool) == \
                    isinstance(f.default, bool), f"{where}.{key}: default {sub.get('default')!r} != {f.default!r}"
            bound = bounds(tp).get(f.name)  # the bounds gnnpipe checks without Snakemake too
            assert {k: v for k, v in sub.items() if k in _BOUND_KEYS} == (bound.schema() if bound else {}), \
                f"{where}.{key}: schema bounds differ from the field's metadata bound"
            _check(schema, sub, hints[f.name], f"{where}.{key}")
    elif origin is typing.Literal:
        assert node.get("enum") == list(args), where
    elif origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        assert "null" in _types(node), where
        less = {**node, "type": sorted(_types(node) - {"null"})}
        if "enum" in node:  # an optional enum lists null too
            less["enum"] = [v for v in node["enum"] if v is not None]
        _check(schema, less, inner[0], where)
    elif origin is dict:
        assert _types(node) == {"object"}, where
        _check(schema, node.get("additionalProperties", {}), args[1], f"{where}.<name>")
    elif origin is list:
        assert _types(node) == {"array"}, where
        _check(schema, node["items"], args[0], f"{where}[]")
    else:
        expected = {bool: {"boolean"}, int: {"integer"}, float: {"number"}, str: {"string"}}[tp]
        assert _types(node) == expected, where


def test_schema_mirrors_the_config_dataclasses():
    """The schema gnnpipe and common.smk validate with (generated from the dataclasses) against the
    dataclasses: every key, type, default and bound; model.kind's enum is every node kind and every
    atomic kind registered."""
    from gnnpipe.kinds import ATOMIC_MODELS, CONVS
    from gnnpipe.config import MODEL_KINDS, NODE_KINDS, json_schema

    schema = json_schema()
    _check(schema, schema, WorkflowConfig, "config")
    assert schema["$defs"]["ModelConfig"]["properties"]["kind"]["enum"] == list(MODEL_KINDS) == \
        [*NODE_KINDS, *ATOMIC_MODELS.names()] == [*CONVS.names(), *ATOMIC_MODELS.names()]
    assert schema["required"] == ["datasets", "models", "runs"]
    names = schema["properties"]["models"]["propertyNames"]["pattern"]
    assert names == schema["properties"]["datasets"]["propertyNames"]["pattern"] == \
        schema["$defs"]["RunSpec"]["properties"]["name"]["pattern"]


def test_committed_schema_is_the_generated_one():
    """workflow/schemas/config.schema.yaml is generated; editing a dataclass without regenerating fails here."""
    from gnnpipe.config import schema_text

    assert SCHEMA.read_text() == schema_text(), \
        "workflow/schemas/config.schema.yaml differs from the dataclasses: run  python -m gnnpipe.config --write-schema"


def test_the_schema_check_reads_no_file(monkeypatch):
    """check_schema validates against the schema generated in memory: an installed package, which has no
    workflow/ directory, judges a config as a checkout does."""
    import builtins

    import gnnpipe.config as config

    opened = builtins.open

    def no_schema_file(path, *args, **kwargs):
        assert not str(path).endswith(".schema.yaml"), f"{path} was read"
        return opened(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_schema_file)
    monkeypatch.setattr(config, "SCHEMA_FILE", config.Path("/nonexistent/config.schema.yaml"))
    cfg = yaml.safe_load(TINY.read_text())
    assert resolve_runs(load_workflow_config(cfg))
    with pytest.raises(config.ConfigError, match=r"config.datasets.tiny.atoms.adsorbates\[0\]: 'Xe' is not one of"):
        load_workflow_config({**cfg, "datasets": {"tiny": {**cfg["datasets"]["tiny"], "atoms": {"adsorbates": ["Xe"]}}}})


def test_shipped_configs_are_valid():
    for path in (DEFAULT, TINY):
        wf = load_workflow_config(yaml.safe_load(path.read_text()))
        assert resolve_runs(wf)


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_tiny_config_end_to_end(tmp_path):
    wf = load_workflow_config(yaml.safe_load(TINY.read_text()))
    runs = resolve_runs(wf)
    res = snakemake(tmp_path, TINY, "--cores", "2", timeout=900)
    logs = "\n".join(f"== {p}\n{p.read_text()[-3000:]}" for p in sorted((tmp_path / "results" / "logs").rglob("*.log")))
    assert res.returncode == 0, res.stderr[-5000:] + logs

    results = tmp_path / "results"
    report = (results / "report.md").read_text()
    groups = {(r.dataset_name, r.model.kind, r.model.layers, r.model.hidden) for r in runs.values()}
    parallel = {(r.dataset_name, r.model.kind, r.model.layers, r.model.hidden) for r in runs.values()
                if r.mode != "single"}
    pngs = sorted(p.name for p in (results / "plots").glob("*.png"))
    # per group: training curves, per-mode curves and time to accuracy; per group with a parallel
    # run: bytes and time against P; overall: bytes and time split
    assert len(pngs) == 3 * len(groups) + 2 * len(parallel) + 2, pngs
    assert {"comm_bytes.png", "epoch_time.png"} <= set(pngs)
    # train jobs take the machine one at a time: no two runs' training overlapped
    assert "## Time to accuracy" in report and "No two runs' training jobs overlapped" in report
    for link in re.findall(r"!\[[^]]*\]\(([^)]+)\)", report):
        assert (results / link).is_file()

    records = {}
    for rid, run in runs.items():
        assert f"`{rid}`" in report
        rec = json.loads((results / "runs" / rid / "metrics.json").read_text())
        ev = json.loads((results / "runs" / rid / "eval.json").read_text())
        assert (rec["run_id"], rec["mode"], rec["world_size"], rec["stages"], rec["ways"]) == \
            (rid, run.mode, run.workers, run.stages, run.ways)
        assert len(rec["history"]) == run.training.epochs and rec["mlflow_run_id"]
        if run.mode == "single":
            assert rec["comm_bytes_per_epoch"] == 0 and ev["test_acc"] == pytest.approx(rec["test_acc"])
        else:  # halo / chunk traffic crossed the wire, and the ledger agrees with the closed form
            assert rec["comm_bytes_per_epoch"] == rec["comm_bytes_predicted"] > 0
            assert ev["test_acc"] == pytest.approx(rec["test_acc"], abs=0.02)
        assert (tmp_path / "results" / "logs" / "train" / f"{rid}.log").is_file()
        records[rid] = rec
    # the cost model: a profile fitted per (dataset, model with graph layers), named in the
    # report; the partition statistics are the rule's output, not a cache beside graph.h5
    from gnnpipe.costmodel.hardware import load_hardware
    from gnnpipe.graph import read_graph_attrs
    from gnnpipe.planning.stats import stats_cache_path

    fitted = {(r.dataset_name, s.model, tmp_path / r.graph_path) for s in wf.runs
              for r in [runs[run_id(wf, s)]] if r.model.kind != "mlp"}
    assert fitted
    for dataset, model, graph_path in fitted:
        hw = load_hardware(results / "cost_model" / dataset / f"{model}.yaml")
        fit = hw.measured["calibration"]
        assert hw.name == f"cpu-2core+{dataset}" and f"`{hw.name}`" in report
        # fitted to the layers its train jobs timed (#36): the single run's rows, the parallel runs' ratio
        assert fit["source"] == "records" and "single" in fit["runs"] and set(fit["runs"]) - {"single"}, fit["runs"]
        assert fit["graph_hash"] == str(read_graph_attrs(graph_path)["content_hash"])
        assert fit["model"]["kind"] == wf.models[model].kind
        assert (results / "cost_model" / dataset / "plan-stats.json").is_file()
        assert not stats_cache_path(graph_path).exists()
    # ... and its bytes are exact for every mode: the report's cells say +0.0 %
    assert {r.mode for r in runs.values()} >= {"graph", "pipeline", "hybrid"}
    for rid, run in runs.items():
        if run.mode == "single" or run.model.kind == "mlp":
            continue
        row = next(l for l in report.splitlines() if l.startswith(f"| `{rid}` | {run.mode} |")
                   and "cost model" not in l and l.count("|") > 8 and "+0.0 %" in l)
        assert row, rid
    graph = next(rid for rid, r in runs.items() if r.mode == "graph")
    pipe = next(rid for rid, r in runs.items() if r.mode == "pipeline" and r.model == runs[graph].model)
    ratio_row = next(l for l in report.splitlines() if f"| `{graph}` | `{pipe}` | graph ÷ pipeline |" in l)
    bytes_ratio = records[graph]["comm_bytes_per_epoch"] / records[pipe]["comm_bytes_per_epoch"]
    assert f"| {bytes_ratio:.3g}× |" in ratio_row

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{results / 'mlflow.db'}")
    found = mlflow.search_runs(experiment_names=["gnnpipe"])
    assert sorted(found["run_id"]) == sorted(r["mlflow_run_id"] for r in records.values())

    # every job's benchmark file (Snakemake's TSV), summed per rule in the report's stages table
    bench = results / "benchmarks"
    for rid in runs:
        for rule in ("run_config", "train"):
            assert (bench / rule / f"{rid}.tsv").is_file(), (rule, rid)
    assert {p.name for p in bench.iterdir()} >= {"dataset_spec", "build_graph", "partition", "materialize",
                                                   "plan_stats", "calibrate", "run_config", "train"}
    assert not (bench / "evaluate").exists()  # node runs: no evaluate job, the train job evaluated (#36)
    assert (bench / "report" / "report.tsv").is_file()
    stages = report[report.index("## Stages"):report.index("## All runs")]
    assert f"| train | training | {len(runs)} |" in stages and "| build_graph | set-up | 1 |" in stages
    assert f"| evaluate (in train) | set-up | {len(runs)} |" in stages
    assert all(records[rid]["evaluate_s"] > 0 for rid in runs)
    assert re.search(r"Set-up [\d.]+ s ÷ training [\d.]+ s = \*\*[\d.]+×\*\*", stages), stages

    again = snakemake(tmp_path, TINY, "-n")
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr


def test_make_run_reruns_incomplete_jobs_and_shows_failed_logs():
    """After a Ctrl-C, `make run` must redo the cut-short jobs, not stop on IncompleteFilesException;
    a failed job's one-line reason is on the terminal, not only in logs/ (#37 item 11)."""
    res = subprocess.run(["make", "-n", "-s", "run"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    line = next(l for l in res.stdout.splitlines() if "snakemake" in l and "--configfile" in l)
    assert {"--rerun-incomplete", "--show-failed-logs"} <= set(line.split())
    for profile in ("local", "slurm"):
        assert yaml.safe_load((ROOT / "profiles" / profile / "config.yaml").read_text())["show-failed-logs"] is True
