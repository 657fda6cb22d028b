# The config (judged by gnnpipe.config.load_workflow_config), the resolved runs, input functions
# and wildcard constraints.
# What the rules need to know about a run comes from gnnpipe.config (RunConfig);
# nothing about layouts, store paths or run ids is re-derived here.
import os
import sys
import re
import shlex

import yaml
from snakemake.exceptions import WorkflowError

from gnnpipe.atomic.data import FORMAT_VERSIONS
from gnnpipe.costmodel.hardware import hardware_path
from gnnpipe.io import GnnPipeError
from gnnpipe.config import (
    ConfigError,
    dump_run_config,
    load_workflow_config,
    locality_path,
    resolve_runs,
    run_id,
    store_path,
    to_dict,
)


# ----------------------------------------------------------------------------- config
# One judge: load_workflow_config checks the dataclasses, the cross-checks and the JSON schema
# (generated from the dataclasses in memory; workflow/schemas/config.schema.yaml is the same, for
# readers), as `gnnpipe runs --config` does; no snakemake.utils.validate
# here, which would also write the schema's defaults into `config`.
try:
    WF = load_workflow_config(config)
    RUNS = resolve_runs(WF)  # {run_id: RunConfig}
except ConfigError as e:
    raise WorkflowError(f"invalid config: {e}") from None

RESULTS = WF.results
GRAPHS_FORMAT = FORMAT_VERSIONS["atom_graphs"]
# conda users: envs/gnnpipe.yaml installs this checkout (pip `-e ${GNNPIPE_ROOT}`).
os.environ.setdefault("GNNPIPE_ROOT", workflow.basedir)
# Jobs call `gnnpipe` and `torchrun`: find the ones installed beside the Python running
# Snakemake (the project's .venv), also when that environment is not activated. A conda
# job environment (--sdm conda) is put in front of this by Snakemake and still wins.
os.environ.update(PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.setdefault("PATH", os.defpath)]))
# A job's launcher stops its run when this process (Snakemake, which runs the jobs' shells) dies:
# `kill -9` of Snakemake must not leave a train job writing outputs nobody waits for (gnnpipe.launch).
os.environ.update(GNNPIPE_JOB_OWNER=str(os.getpid()))


def _train_layout(run) -> dict:
    """Slurm shape of one train job: nodes, workers per node, CPUs, memory, GPUs."""
    res = WF.resources
    per_node = min(run.workers, res.workers_per_node or run.workers)  # a divisor (load_workflow_config)
    nodes = run.workers // per_node
    gpus = per_node * res.gpus_per_worker
    return {
        "nodes": nodes,
        "per_node": per_node,
        "resources": {
            "nodes": nodes,
            "tasks": nodes,  # one torchrun per node; torchrun starts the workers
            "cpus_per_task": per_node * run.training.threads_per_worker,
            "mem_mb": per_node * res.mem_mb_per_worker,
            "runtime": res.runtime_min,
            "gres": f"gpu:{gpus}" if gpus else None,  # per node
            "tasks_per_gpu": 0 if gpus else None,  # not --ntasks-per-gpu: torchrun places them
            "mpi": "srun" if nodes > 1 else None,  # the rule calls srun itself
        },
    }


LAYOUT = {rid: _train_layout(run) for rid, run in RUNS.items()}


wildcard_constraints:
    dataset="|".join(re.escape(d) for d in WF.datasets),
    run_id="|".join(re.escape(r) for r in RUNS),
    model="|".join(re.escape(m) for m in WF.models),
    method="metis|random|contiguous",
    parts=r"[1-9][0-9]*",


def run_id_pattern(ids) -> str:
    """A wildcard constraint matching exactly ``ids`` (none: a pattern that matches nothing)."""
    return "|".join(re.escape(r) for r in ids) or "(?!)"


# evaluate (node runs) and evaluate_atomic (also predictions.h5) share eval.json: each its own runs
ATOMIC_RUNS = [rid for rid, r in RUNS.items() if r.atomic]
NODE_RUNS = [rid for rid, r in RUNS.items() if not r.atomic]
RELAX_RUNS = ATOMIC_RUNS if WF.relax.systems > 0 else []  # IS2RS after evaluate (config relax:)


def relax_reference(wildcards) -> str:
    """The reference calculator of the run's relaxations: config relax.reference, else the data's
    own as gnnpipe relax takes it (gnnpipe.atomic.is2rs.reference_calculator): EMT for generated
    systems, none for a user's file (atoms.file), whose labels may be another method's."""
    if WF.relax.reference is not None:
        return WF.relax.reference
    return "none" if WF.datasets[RUNS[wildcards.run_id].dataset_name].atoms.file else "emt"


# ----------------------------------------------------------------------------- targets
BENCHMARKS = f"{RESULTS}/benchmarks"
# Each job's log, beside the outputs of its config: two configs (`results:`) run in one checkout
# never write each other's logs (they did under one top-level logs/).
LOGS = f"{RESULTS}/logs"


def bench(rule: str, job: str) -> str:
    """A rule's Snakemake benchmark file (wall time, peak RSS, ... of each job): what the report's
    stages table sums per rule (gnnpipe.report.stages)."""
    return f"{BENCHMARKS}/{rule}/{job}.tsv"


def final_outputs():
    return ([f"{RESULTS}/report.md"] + [f"{RESULTS}/runs/{rid}/eval.json" for rid in RUNS]
            + [f"{RESULTS}/runs/{rid}/relax.json" for rid in RELAX_RUNS])


def run_records(wildcards):
    return {
        "metrics": [f"{RESULTS}/runs/{rid}/metrics.json" for rid in RUNS],
        "evals": [f"{RESULTS}/runs/{rid}/eval.json" for rid in RUNS],
        "relax": [f"{RESULTS}/runs/{rid}/relax.json" for rid in RELAX_RUNS],
    }


def report_run_args(wildcards) -> list[str]:
    return [arg for rid in RUNS for arg in ("--run", rid)]


# ----------------------------------------------------------------------------- cost model
COST_DIR = f"{RESULTS}/cost_model"
# (dataset, model) -> the first run that trains it: its run.yaml is what `gnnpipe calibrate` fits
# to. Models without graph layers (mlp) have no cost model, so nothing to calibrate.
CALIBRATION_RUNS = {}
for _spec in WF.runs:
    if WF.models[_spec.model].kind != "mlp" and not RUNS[run_id(WF, _spec)].atomic:  # atomic: no node cost model
        CALIBRATION_RUNS.setdefault((_spec.dataset, _spec.model), run_id(WF, _spec))


# the profile's file: an input of the rules that read it, so that a re-measured profile re-runs them
try:
    HARDWARE_FILE = str(hardware_path(WF.cost_model.hardware))
except GnnPipeError as e:
    raise WorkflowError(f"invalid config: config.cost_model.hardware: {e}") from None


def cost_model_inputs(wildcards) -> dict:
    """The report's partition statistics per dataset and calibrated profiles per (dataset, model)."""
    out = {"plan_stats": sorted({f"{COST_DIR}/{r.dataset_name}/plan-stats.json" for r in RUNS.values()
                                 if not r.atomic}),
           "hardware": HARDWARE_FILE}
    if WF.cost_model.calibrate:
        out["profiles"] = [f"{COST_DIR}/{d}/{m}.yaml" for d, m in CALIBRATION_RUNS]
    return out


PREDICTIONS = f"{COST_DIR}/predictions.json"  # written by cost_predictions, read by the report (#36)


def report_predictions(wildcards) -> dict:
    """The predictions file the report reads: none when the config has no node run to predict."""
    return {"predictions": PREDICTIONS} if NODE_RUNS else {}


def report_predictions_arg(wildcards, input) -> str:
    """The report's ``--predictions FILE`` (quoted here), or nothing without node runs."""
    return f"--predictions {shlex.quote(input.predictions)}" if NODE_RUNS else ""


def whole_machine() -> int:
    """``--cores`` when jobs run on this machine (a job that takes them all runs alone);
    1 under a cluster executor, on the submitting side and inside the job alike (each job
    has an allocation of its own there, and both sides must agree on the job's size)."""
    if not (workflow.is_main_process and workflow.local_exec):
        return 1
    try:
        return workflow.cores
    except WorkflowError:  # a dry run without --cores
        return 1


def plan_parts(wildcards) -> list[int]:
    """The partitions the cost model needs for a dataset's runs: ways and chunk counts > 1."""
    return sorted({k for r in RUNS.values() if r.dataset_name == wildcards.dataset
                   for k in (r.ways, r.chunks) if k > 1})


def plan_assignments(wildcards) -> dict:
    """The partitions (the partition rule) the dataset's runs already need, by part count: plan_stats
    reads them instead of running METIS again (same method, seed and balance: WF.partitioning)."""
    method = WF.partitioning.method
    return {f"part_{k}": f"{RESULTS}/partitions/{wildcards.dataset}/{method}-{k}.npy"
            for k in sorted({r.chunks for r in RUNS.values()  # a chunk store's partition: chunks parts
                             if r.dataset_name == wildcards.dataset and r.store_path and r.chunks > 1})}


def plan_assignment_args(wildcards, input) -> str:
    """plan_stats's --assignment K=FILE arguments for its inputs from plan_assignments."""
    quoted = (shlex.quote(f"{k.removeprefix('part_')}={v}") for k, v in input.items() if k.startswith("part_"))
    return " ".join(f"--assignment {q}" for q in quoted)


def calibration_records(wildcards) -> tuple:
    """(the run calibration fits to, {run id: run} of every run of that dataset and model with its
    dtype and one thread a worker: their train jobs timed their layers, the records calibration fits)."""
    run = RUNS[CALIBRATION_RUNS[(wildcards.dataset, wildcards.model)]]
    return run, {rid: r for rid, r in RUNS.items() if (r.dataset_name, r.model) == (run.dataset_name, run.model)
                 and r.training.dtype == run.training.dtype and r.training.threads_per_worker == 1}


def calibration_inputs(wildcards) -> dict:
    """The run.yaml calibration fits to, the run records of :func:`calibration_records` (calibration
    fits those instead of timing its own samples), and, when it numbers nodes for locality, the order
    (rule locality)."""
    run, records = calibration_records(wildcards)
    inputs = {"run_config": f"{RESULTS}/runs/{run.run_id}/run.yaml",
              "records": [f"{RESULTS}/runs/{rid}/metrics.json" for rid in records]}
    if run.locality_path:
        inputs["locality"] = run.locality_path
    return inputs


def calibration_threads(wildcards) -> int:
    """1 where calibration fits the train jobs' own timings and times nothing (a one-process run
    and a parallel run among :func:`calibration_records`, on the CPU clock:
    planning.calibrate.calibrate_run); the whole machine where it times samples itself (a job
    beside it would share the caches and memory bandwidth it is timing)."""
    run, records = calibration_records(wildcards)
    from_records = (run.training.threads_per_worker == 1 and run.model.kind != "mlp"
                    and any(r.mode == "single" for r in records.values())
                    and any(r.workers > 1 for r in records.values()))
    return 1 if from_records else whole_machine()


# ----------------------------------------------------------------------------- data
def dataset_spec_text(wildcards) -> str:
    """The dataset's config as YAML: what dataset.yaml holds (and its rerun trigger). Only its
    own kind's section: a new key of another kind (say atoms.min_distance) must not rebuild it."""
    ds = WF.datasets[wildcards.dataset]
    own = {k: v for k, v in to_dict(ds).items() if not isinstance(v, dict) or k == ds.kind}  # sections: dicts
    return yaml.safe_dump(own, sort_keys=False)


def dataset_inputs(wildcards) -> dict:
    """dataset.yaml, and the user's files (``files`` datasets; an atoms dataset's structures and split
    index file), so edits rebuild the graph or the systems. A named OC20 S2EF split's folder is an input
    once it exists (before, build_systems downloads it)."""
    ds = WF.datasets[wildcards.dataset]
    inputs = {"spec": f"{RESULTS}/data/{wildcards.dataset}/dataset.yaml"}
    if ds.kind == "atoms" and ds.atoms.file and (not ds.atoms.s2ef_split or os.path.exists(ds.atoms.file)):
        inputs["structures"] = ds.atoms.file
    if ds.kind == "atoms" and ds.atoms.split_file:
        inputs["split_file"] = ds.atoms.split_file
    if ds.kind == "files":
        f = ds.files
        named = {"edges": f.edges, "features": f.features, "labels": f.labels,
                 "train_mask": f.train_mask, "val_mask": f.val_mask, "test_mask": f.test_mask}
        inputs.update({k: v for k, v in named.items() if v})
    return inputs


# ----------------------------------------------------------------------------- runs
def run_config_text(wildcards) -> str:
    return dump_run_config(RUNS[wildcards.run_id])


def run_inputs(wildcards) -> dict:
    """run.yaml, the graph and (parallel modes) the chunk store of a run."""
    run = RUNS[wildcards.run_id]
    inputs = {"run_config": f"{RESULTS}/runs/{run.run_id}/run.yaml", "graph": run.graph_path}
    if run.systems_path:  # atomic runs: the structures beside their graphs
        inputs["systems"] = run.systems_path
    if run.store_path:
        inputs["store"] = run.store_path
    if run.locality_path and run.mode == "single":  # the single engine's node order (rule locality)
        inputs["locality"] = run.locality_path
    return inputs


def init_from_input(wildcards) -> list:
    """The model file an atomic run starts from (models.<name>.init_from): an input of its train job, so
    that a changed file retrains it (load_workflow_config refuses a missing one)."""
    path = RUNS[wildcards.run_id].model.init_from
    return [path] if path else []


def train_threads(wildcards) -> int:
    return LAYOUT[wildcards.run_id]["resources"]["cpus_per_task"]


def timed_threads(wildcards) -> int:
    """A timed job (train) runs alone when jobs run on this machine: it takes every core, so
    no other job (train, evaluate, calibrate, data) shares the CPUs its wall clock measures;
    on a cluster its allocation is its own (``whole_machine()`` is 1 there)."""
    return max(train_threads(wildcards), whole_machine())


def train_resource(name):
    return lambda wildcards: LAYOUT[wildcards.run_id]["resources"][name]


def train_launcher(wildcards) -> str:
    """How ``gnnpipe train`` is started: one process, torchrun on a node, srun + torchrun, or
    (``GNNPIPE_NETEM`` set) one torchrun per namespace of an emulated cluster."""
    run, layout = RUNS[wildcards.run_id], LAYOUT[wildcards.run_id]
    if run.mode == "single":
        return "gnnpipe"
    netem = os.environ.get("GNNPIPE_NETEM")  # an emulated cluster's prefix (python -m gnnpipe.netem up)
    if netem:
        if not re.fullmatch(r"[a-z][a-z0-9]{0,5}", netem):
            raise WorkflowError(f"GNNPIPE_NETEM: a namespace prefix (1-6 lowercase letters/digits), got {netem!r}")
        # one torchrun agent per namespace <prefix>0..P-1, over the emulated links
        return f"python -m gnnpipe.netem launch --prefix {netem} --workers {run.workers} -- -m gnnpipe.cli"
    torchrun = f"torchrun --nnodes {layout['nodes']} --nproc-per-node {layout['per_node']}"
    if run.training.max_restarts:  # a restarted worker group resumes from the last complete checkpoint
        torchrun += f" --max-restarts {run.training.max_restarts}"
    if layout["nodes"] == 1:
        return f"{torchrun} --standalone -m gnnpipe.cli"
    # The rendezvous is on the node the batch script runs on (the allocation's first node),
    # whose torchrun agent hosts the c10d store. Not read from $SLURM_JOB_NODELIST: the
    # plugin's job step strips it from the rule's environment. The port is the job's own,
    # so that two runs sharing a node do not meet.
    return (f"srun --nodes {layout['nodes']} --ntasks-per-node 1 {torchrun} "
            f"--rdzv-id $SLURM_JOB_ID --rdzv-backend c10d --rdzv-endpoint $(hostname):$((29500 + SLURM_JOB_ID % 1000))"
            " -m gnnpipe.cli")
