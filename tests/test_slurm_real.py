"""The Slurm profile against a real Slurm: a reduced tiny config through
``snakemake --profile profiles/slurm``: one single run, a two-worker graph-parallel run on
one node (torchrun --standalone in the allocation) and, where the partition has two nodes,
a four-worker run over both (srun + torchrun, c10d rendezvous).

Needs a running cluster with a partition ``$GNNPIPE_SLURM_PARTITION`` (default ``debug``)
that can run 2-CPU, 2 GB jobs: ``make test-slurm`` starts one here (``SLURM_NODES=2
.ci/slurm-up.sh``: root; installs slurm-wlm, two slurmd on this machine) and runs this.
Elsewhere the test is skipped, and under ``GNNPIPE_REQUIRE_SLURM=1`` (set by ``make
test-slurm``) a missing cluster fails it.

The command line is what a site without an accounting database needs: no account
(``slurm_account=''``: the plugin submits without ``-A``) and job states from squeue
(``--slurm-status-command squeue``; with the default, sacct, the plugin never sees a job
finish there and Snakemake waits forever). ``--default-resources`` on the command line
replaces the profile's whole list, so mem_mb and runtime are given again.
"""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import ROOT, snakemake, write_config

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

PARTITION = os.environ.get("GNNPIPE_SLURM_PARTITION", "debug")
REQUIRE = os.environ.get("GNNPIPE_REQUIRE_SLURM") == "1"
SUBMITTED = re.compile(r"Job \d+ has been submitted with SLURM jobid (\d+) \(log: (\S+)\)\.")


def _usable_nodes() -> int:
    res = subprocess.run(["sinfo", "-h", "-N", "-p", PARTITION, "-o", "%t"], capture_output=True, text=True,
                         timeout=30)
    return sum(s.rstrip("*~#") in ("idle", "mix", "alloc") for s in res.stdout.split())


def _cluster_problem() -> str | None:
    """Why no Slurm job can run here, or None when the partition has a usable node."""
    if shutil.which("sinfo") is None:
        return "sinfo not found (no Slurm client on PATH)"
    try:
        res = subprocess.run(["sinfo", "-h", "-p", PARTITION, "-o", "%t"], capture_output=True, text=True,
                             timeout=30)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 30 s"
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or [f"sinfo exited {res.returncode}"])[-1]
        return f"the cluster is not responding ({last})"
    states = res.stdout.split()
    if not any(s.rstrip("*~#") in ("idle", "mix", "alloc") for s in states):
        return f"partition {PARTITION!r} has no usable node (states: {states or 'none'})"
    return None


@pytest.fixture(scope="module")
def slurm_nodes() -> int:
    """The number of usable nodes of the partition; skips (fails, if required) without one."""
    problem = _cluster_problem()
    if problem:
        message = f"no Slurm cluster: {problem}; start one with .ci/slurm-up.sh (root), then make test-slurm"
        if REQUIRE:
            pytest.fail(message + " (GNNPIPE_REQUIRE_SLURM=1)", pytrace=False)
        pytest.skip(message)
    return _usable_nodes()


def _cancel_jobs_under(work: Path) -> None:
    """scancel what this test left queued or running (jobs whose working directory is ``work``)."""
    res = subprocess.run(["squeue", "-h", "-o", "%i %Z"], capture_output=True, text=True, timeout=30)
    ids = [line.split()[0] for line in res.stdout.splitlines()
           if len(line.split()) == 2 and line.split()[1].startswith(str(work))]
    if ids:
        subprocess.run(["scancel", *ids], timeout=30)


def _job(jobid: str) -> dict[str, str]:
    """``scontrol show job``'s Key=Value pairs (the cluster keeps a finished job MinJobAge seconds)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", jobid], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def test_slurm_profile_runs_the_tiny_workflow_on_a_real_cluster(tmp_path, slurm_nodes):
    multi_node = slurm_nodes >= 2
    single, graph, graph4 = "tiny-gcn2-single-p1-seed0", "tiny-gcn2-graph-p2-seed0", "tiny-gcn2-graph-p4-seed0"

    def edit(c):
        c["models"] = {"gcn2": c["models"]["gcn2"]}
        c["training"].update(epochs=3, eval_every=1)
        # two workers a node: the 2-worker run stays on one node, the 4-worker run takes two
        c["resources"] = {"mem_mb_per_worker": 1000, "runtime_min": 10, "workers_per_node": 2}
        c["runs"] = [{"mode": "single", "dataset": "tiny", "model": "gcn2"},
                     {"mode": "graph", "dataset": "tiny", "model": "gcn2", "workers": 2}]
        if multi_node:
            c["runs"].append({"mode": "graph", "dataset": "tiny", "model": "gcn2", "workers": 4})

    config = write_config(tmp_path, edit)
    work = tmp_path / "work"
    try:
        res = snakemake(
            work, config, "--profile", str(ROOT / "profiles" / "slurm"),
            "--default-resources", "slurm_account=''", f"slurm_partition={PARTITION}", "mem_mb=1000", "runtime=10",
            "--slurm-status-command", "squeue", "--slurm-keep-successful-logs",
            # poll every few seconds, not the plugin's 40 s and more: the jobs take seconds
            "--seconds-between-status-checks", "2", "--slurm-init-seconds-before-status-checks", "2",
            timeout=600)
    finally:
        _cancel_jobs_under(work)
    out = res.stdout + res.stderr
    slurm_logs = work / ".snakemake" / "slurm_logs"
    logs = "\n".join(f"== {p}\n{p.read_text()[-2000:]}" for p in sorted(slurm_logs.rglob("*.log"))) \
        if slurm_logs.exists() else ""
    assert res.returncode == 0, out[-6000:] + logs

    # every non-local rule went through sbatch; the local ones did not
    submitted = {}  # (rule, wildcards) -> Slurm job id
    for jobid, log in SUBMITTED.findall(out):
        rule_dir, wildcards = Path(log).parent.parent.name, Path(log).parent.name
        submitted[(rule_dir.removeprefix("rule_"), wildcards)] = jobid
    rules = {rule for rule, _ in submitted}
    assert rules >= {"build_graph", "partition", "materialize", "train"}, out[-4000:]  # train: + eval.json
    assert not rules & {"dataset_spec", "run_config", "report", "all"}

    results = work / "results"
    # (run, nodes, CPUs, how its workers were started inside the allocation)
    expected = [(single, 1, 1, "gnnpipe train --run-config"),
                (graph, 1, 2, "torchrun --nnodes 1 --nproc-per-node 2 --standalone -m gnnpipe.cli train")]
    if multi_node:
        expected.append((graph4, 2, 4, "srun --nodes 2 --ntasks-per-node 1 torchrun --nnodes 2 --nproc-per-node 2 "
                                        "--rdzv-id $SLURM_JOB_ID --rdzv-backend c10d"))
    report = (results / "report.md").read_text()
    for rid, nodes, cpus, launch in expected:
        jobid = submitted[("train", rid)]
        job = _job(jobid)
        assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", job
        assert job["Comment"] == f"rule_train_wildcards_{rid}", job
        assert (job["NumNodes"], job["NumCPUs"], job["Partition"]) == (str(nodes), str(cpus), PARTITION), job
        log = (slurm_logs / "rule_train" / rid / f"{jobid}.log").read_text()
        assert "Finished jobid: 0 (Rule: train)" in log and launch in log, log[-3000:]
        rec = json.loads((results / "runs" / rid / "metrics.json").read_text())
        assert (rec["world_size"], len(rec["history"])) == (cpus, 3)
        if rid != single:  # the halo traffic crossed between the workers, as the closed form says
            assert rec["mode"] == "graph" and rec["comm_bytes_per_epoch"] == rec["comm_bytes_predicted"] > 0
        assert (results / "runs" / rid / "eval.json").is_file() and f"`{rid}`" in report
    assert (results / "mlflow.db").is_file()
