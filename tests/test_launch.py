"""``gnnpipe launch`` (gnnpipe.launch): the plan's refusal before launch, the out-of-memory line, the
per-worker memory cgroups; and ``gnnpipe plan-atomic`` on a run."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gnnpipe import launch as gl
from gnnpipe.cli import main
from test_faults import one_error_line, setup_atomic_run


def _cgroup_v1_root() -> bool:
    return os.geteuid() == 0 and gl.own_cgroup() is not None


def test_plan_of_a_run_answers_in_one_line_which_p_fits(tmp_path):
    """RunPlan on a run's own model and largest step batch: the answer at the run's P, and the
    smallest P (of 1, 2, 4, ...) under a cap between the needs at P = 1 and P = 4."""
    from gnnpipe.atomic.atomic_engine import plan_run

    cfg = setup_atomic_run(tmp_path, "single", 1, kind="gemnet_t")
    free = plan_run(cfg, 2**40)
    need = [free.need(p) for p in (1, 2, 4)]
    assert need[0] > need[1] > need[2] and free.fits
    capped = plan_run(cfg, (need[1] + need[2]) // 2)
    assert not capped.fits and capped.smallest() == 4
    line = capped.answer(cfg.run_id, "resources.mem_mb_per_worker = 1")
    assert line.startswith(f"run {cfg.run_id}: gemnet_t (") and "per worker at P = 1" in line
    assert "above the cap of" in line and "the smallest P that fits is 4" in line and "\n" not in line


def test_a_run_that_does_not_fit_is_refused_before_launch_in_one_line(tmp_path, capsys):
    """--mem-mb-per-worker 1: not even the process fits. Exit 2, the plan's one line, no worker
    started (no lock, no record); --force starts it anyway (and it trains: the cap is only a figure)."""
    cfg = setup_atomic_run(tmp_path, "single", 1, epochs=1, kind="gemnet_t")
    run_yaml = str(Path(cfg.out_dir) / "run.yaml")
    assert main(["launch", "--run-config", run_yaml, "--mem-mb-per-worker", "1"]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"gnnpipe: error: refused before launch: run {cfg.run_id}: gemnet_t (") and \
        "above the cap of 0.00 GiB per worker (resources.mem_mb_per_worker = 1)" in line and \
        "no P up to the batch's edges fits" in line, line
    assert not (Path(cfg.out_dir) / ".lock").exists() and not (Path(cfg.out_dir) / "metrics.json").exists()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", gl.FORCE_ENV: "1"}
    done = subprocess.run([sys.executable, "-m", "gnnpipe.cli", "launch", "--run-config", run_yaml,
                           "--mem-mb-per-worker", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and (Path(cfg.out_dir) / "metrics.json").exists(), done.stderr[-3000:]


def test_the_launchers_status_is_its_commands(tmp_path):
    cfg = setup_atomic_run(tmp_path, "single", 1, epochs=1)
    run_yaml = str(Path(cfg.out_dir) / "run.yaml")
    assert gl.launch(run_yaml, [sys.executable, "-c", "raise SystemExit(3)"]) == 3
    assert gl.launch(run_yaml, [sys.executable, "-c", "import os; os.kill(os.getpid(), 15)"]) == 128 + 15


@pytest.mark.skipif(not _cgroup_v1_root(), reason="per-worker memory caps need root and cgroup v1")
def test_a_worker_killed_by_its_memory_cap_is_named_by_the_launcher(tmp_path, capsys):
    """A real OOM kill: a 'worker' (rank 1 of its cgroup) that joins its 100 MiB cap and touches 400 MiB.
    The launcher's one line names the rank, the cap and its cgroup; exit 137."""
    cfg = setup_atomic_run(tmp_path, "single", 1, epochs=1)
    top = gl.cap_workers(100 * 2**20, 2)
    try:
        assert gl.cgroup_limit(top / "rank-1") == 100 * 2**20
        hog = ("import os; os.environ['RANK'] = '1'; from gnnpipe.launch import join_worker_cap; join_worker_cap(); "
               "x = bytearray(400 << 20); print('survived')")
        os.environ[gl.MEMCAP_ENV] = str(top)
        os.environ.pop(gl.MMAP_ENV, None)
        try:
            rc = gl.launch(str(Path(cfg.out_dir) / "run.yaml"), [sys.executable, "-c", hog])
        finally:
            del os.environ[gl.MEMCAP_ENV]
        assert rc == gl.OOM_EXIT
        line = one_error_line(capsys)
        assert line == (f"gnnpipe: error: run {cfg.run_id}: rank 1 was killed by the out-of-memory killer (SIGKILL, "
                        f"exit 137) at its memory cap of 0.10 GiB per worker ({top}/rank-1/memory.limit_in_bytes); "
                        "gnnpipe plan-atomic --run-config says which layout fits (the plan counts what a step holds; "
                        "glibc may keep more resident: MALLOC_MMAP_THRESHOLD_=131072 bounds it, see gnnpipe.launch)"), line
        assert gl.oom_kills(top / "rank-0") == 0 and gl.oom_kills(top / "rank-1") >= 1
    finally:
        gl.uncap_workers(top)
    assert not top.exists()


def test_plan_atomic_sizes_gemnet_xl(tmp_path, capsys):
    """plan-atomic takes the kind from the registry: GemNet-XL's 292,941,056 parameters (fairchem's
    292,939,520 trainable with its 83 embedding rows, + 12 · 128 of ours)."""
    cfg = setup_atomic_run(tmp_path, "single", 1)
    args = ["plan-atomic", "--systems", cfg.systems_path, "--graphs", cfg.graph_path, "--model", "gemnet_t"]
    assert main([*args, "--preset", "xl", "--device-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gemnet_t xl: 292,941,056 parameters") and "smallest P that fits: 1" in out
    assert main([*args, "--preset", "huge"]) == 2
    assert "plan-atomic: gemnet_t has no preset 'huge' (its presets: small, default, xl)" in one_error_line(capsys)


# --------------------------------------------------------------------------- #37 item 3: the job's owners
def _run_yaml(tmp_path) -> str:
    from gnnpipe.config import dump_run_config
    from helpers import run_cfg

    cfg = run_cfg(tmp_path, {"kind": "gcn"}, epochs=1)
    path = Path(cfg.out_dir) / "run.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_run_config(cfg))
    return str(path)


def _wait_gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        st = gl._stat(pid)
        if st is None or st[0] in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_the_launcher_stops_its_run_when_snakemake_is_killed(tmp_path):
    """kill -9 of Snakemake (GNNPIPE_JOB_OWNER, the parent of the rule's shell; the shell lives on):
    the launcher stops its command (a sleeper standing in for torchrun) and says who died."""
    run_yaml, pidfile, log = _run_yaml(tmp_path), tmp_path / "child.pid", tmp_path / "train.log"
    sleeper = f"echo $$ > {shlex.quote(str(pidfile))}; exec sleep 60"
    launch_cmd = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "gnnpipe.cli", "launch", "--run-config",
                                                   run_yaml, "--", "sh", "-c", sleeper])
    inner = f"{launch_cmd} > {shlex.quote(str(log))} 2>&1; echo done"  # two commands: bash forks, as Snakemake's
    outer = f"export {gl.OWNER_ENV}=$$; bash -c {shlex.quote(inner)}; echo done"
    env = {**os.environ, "PYTHONPATH": str(Path(gl.__file__).parents[1])}
    owner = subprocess.Popen(["bash", "-c", outer], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline and owner.poll() is None, log.read_text() if log.exists() else ""
            time.sleep(0.1)
        child = int(pidfile.read_text())
        launcher = gl._stat(child)[1]
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        assert _wait_gone(child, 10) and _wait_gone(launcher, 10), log.read_text()
        lines = [line for line in log.read_text().splitlines() if line.startswith("gnnpipe:")]
        assert len(lines) == 1 and f"the job's bash (pid {owner.pid}) died: stopping the run" in lines[0], lines
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(owner.pid, signal.SIGKILL)


def test_the_launcher_stops_its_command_when_an_owner_dies():
    """The rule's shell (or Snakemake) killed: the command gets SIGTERM within a poll, one line says who."""
    shell = subprocess.Popen(["sleep", "60"])
    command = subprocess.Popen(["sleep", "60"])
    said = []
    try:
        owner = (shell.pid, "bash", gl._stat(shell.pid)[2])
        watch = gl.watch_owners([owner], command, said.append, every=0.05, grace=5)
        time.sleep(0.2)
        assert command.poll() is None and not said  # an owner alive: nothing happens
        shell.kill()  # a zombie until reaped: dead all the same
        watch.join(5)
        assert command.wait(5) == -signal.SIGTERM
        assert len(said) == 1 and said[0].startswith(f"the job's bash (pid {shell.pid}) died: stopping the run")
    finally:
        for p in (shell, command):
            p.kill()
            p.wait()


def test_the_job_owner_is_watched_when_it_is_an_ancestor(monkeypatch):
    shell = subprocess.Popen(["sh", "-c", "sleep 60; :"], start_new_session=True)  # sh forks the sleep
    try:
        deadline = time.monotonic() + 10
        while not (kids := Path(f"/proc/{shell.pid}/task/{shell.pid}/children").read_text().split()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        monkeypatch.setenv(gl.OWNER_ENV, str(os.getpid()))
        assert [pid for pid, _, _ in gl.job_owners(int(kids[0]))] == [shell.pid, os.getpid()]
        monkeypatch.setenv(gl.OWNER_ENV, "1")  # not an ancestor (or init): never watched
        assert [pid for pid, _, _ in gl.job_owners(int(kids[0]))] == [shell.pid]
    finally:
        os.killpg(shell.pid, signal.SIGKILL)  # its own session: the sh and its sleep
        shell.wait()


def test_a_command_killed_by_a_signal_is_named_in_one_line(tmp_path, capsys):
    run_yaml = _run_yaml(tmp_path)
    rc = gl.launch(run_yaml, [sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"])
    assert rc == 128 + 9
    line = one_error_line(capsys)
    assert "was killed by SIGKILL" in line and "rerun to resume" in line, line


# --------------------------------------------------------------------------- #10: torchrun's summary
TORCHRUN_TAIL = """\
E1205 13:56:39.124000 9535 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 2) local_rank: 0
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
gnnpipe.cli FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-05_13:56:39
  host      : n1
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 9866)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-05_13:56:39
  host      : n1
  rank      : 0 (local_rank: 0)
  exitcode  : 2 (pid: 9865) 
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def _relayed(text: str) -> str:
    import io

    out = io.BytesIO()
    r, w = os.pipe()
    os.write(w, text.encode())
    os.close(w)
    with os.fdopen(r, "rb") as stream:
        gl.relay(stream, out)
    return out.getvalue().decode()


def test_torchruns_failure_summary_after_a_workers_one_line_is_dropped():
    worker = "gnnpipe: error: epoch 3, rank 0: val force cosine -0.356 below the floor -0.2\n"
    out = _relayed(worker + TORCHRUN_TAIL)
    assert out == worker + TORCHRUN_TAIL.splitlines(keepends=True)[0], out


def test_torchruns_traceback_when_it_is_stopped_is_one_line_or_none():
    stopped = ("Traceback (most recent call last):\n  File \"torchrun\", line 6, in <module>\n    sys.exit(main())\n"
               "torch.distributed.elastic.multiprocessing.api.SignalException: Process 4461 got signal: 15\n")
    assert _relayed(stopped) == "gnnpipe launch: torchrun: Process 4461 got signal: 15\n"
    worker = "gnnpipe: error: epoch 215, rank 0: the worker group broke: ... (stopped by SIGTERM)\n"
    assert _relayed(worker + stopped) == worker


def test_torchruns_failure_summary_without_a_workers_line_is_one_line_naming_the_root_cause():
    bug = "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\nValueError: a bug\n"
    out = _relayed("progress\r" + bug + TORCHRUN_TAIL + "after\n")
    lines = out.splitlines()
    assert out.startswith("progress\r" + bug) and lines[-1] == "after", out
    assert lines[-2] == ("gnnpipe launch: torchrun: worker rank 0 (local_rank: 0) on n1 failed first with exit code "
                         "2 (pid: 9865) (its lines above say why)"), out
    assert "ChildFailedError" not in out and "=====" not in out


# --------------------------------------------------------------------------- node runs (issue #37, item 4)
def _node_run(tmp_path, model: dict, mode: str = "graph", workers: int = 2, **run):
    """A node run's RunConfig on a 300-node graph written to tmp_path, and its run.yaml."""
    from gnnpipe.config import dump_run_config, load_workflow_config, resolve_runs
    from gnnpipe.graph import write_graph
    from helpers import random_graph

    write_graph(tmp_path / "graph.h5", random_graph(300))
    wf = load_workflow_config({"results": str(tmp_path / "res"), "datasets": {"g": {"kind": "synthetic"}},
                               "models": {"m": model},
                               "runs": [{"mode": mode, "dataset": "g", "model": "m", "workers": workers, **run}]})
    (_, cfg), = resolve_runs(wf).items()
    cfg.graph_path = str(tmp_path / "graph.h5")
    path = tmp_path / "run.yaml"
    path.write_text(dump_run_config(cfg))
    return cfg, str(path)


def test_a_node_run_is_sized_by_the_cost_model_before_launch(tmp_path, capsys):
    """`gnnpipe plan --run-config --check` (what the launcher asks for a node run): a hidden size whose
    weights would take 128 GiB is priced on the meta device, not allocated, and refused in one line with
    the smallest layout that fits; a small model fits."""
    from gnnpipe.planning.fit import fit_run

    cfg, run_yaml = _node_run(tmp_path, {"kind": "gcnii", "layers": 8, "hidden": 65536})
    assert main(["plan", "--run-config", run_yaml, "--mem-mb-per-worker", "1536", "--check"]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"gnnpipe: error: run {cfg.run_id} (graph 1 x 2, 2 chunks (2 workers)) needs at "
                           "least "), line
    assert "above the cap of 1.50 GiB per worker (resources.mem_mb_per_worker = 1536)" in line
    assert "no layout of up to 64 workers was found to fit: use a smaller model" in line

    fit = fit_run(cfg, 4 * 2**20, None, 0.0)  # 4 TiB per worker: the 8 layers' 128 GiB of Adam state...
    assert fit.fits
    split = fit_run(cfg, int(fit.need / 2**20 * 0.6), None, 0.0)  # ... over a pipeline, a share each
    assert not split.fits and split.smallest == "pipeline 2 x 1 (2 workers)", split.line()

    small, _ = _node_run(tmp_path, {"kind": "gcn", "hidden": 16})
    ok = fit_run(small, 1536, None, 0.3 * 2**30)
    assert ok.fits and "within the cap of 1.50 GiB per worker" in ok.line() and 0.3 * 2**30 < ok.need < 0.31 * 2**30


def test_a_pipeline_that_fits_with_recompute_is_told_so(tmp_path):
    """#36 item 3: recompute is the run's choice, not turned on for it; a pipelined run over its cap
    that would fit with pipeline.recompute: true hears that first."""
    import dataclasses

    from gnnpipe.planning.fit import fit_run

    cfg, _ = _node_run(tmp_path, {"kind": "gcnii", "layers": 8, "hidden": 128}, mode="pipeline", stages=2, chunks=4)
    stored = fit_run(cfg, 4096, None, 0.0).need
    again = fit_run(dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, recompute=True)),
                    4096, None, 0.0).need
    assert again < stored
    between = fit_run(cfg, (again + stored) / 2 / 2**20, None, 0.0)
    assert not between.fits and between.recompute_need == pytest.approx(again)
    assert f"with pipeline.recompute: true it needs {again / 2**30:.2f} GiB and fits" in between.line()
    below = fit_run(cfg, again / 2 / 2**20, None, 0.0)
    assert "recompute" not in below.line()


def test_the_machines_memory_is_shared_by_the_workers_on_it(tmp_path):
    """More workers than the machine holds (each a process of ~0.3 GiB): refused, with fewer as the advice;
    workers spread over nodes (--workers-per-node) fit."""
    from gnnpipe.planning.fit import fit_run

    cfg, _ = _node_run(tmp_path, {"kind": "gcn", "hidden": 16}, workers=16)
    fit = fit_run(cfg, 4096, 3 * 2**30, 0.3 * 2**30)  # a 3 GiB cap over 16 workers: 0.19 GiB each
    assert not fit.fits and "3.00 GiB of this machine over 16 workers" in fit.line()
    assert fit.smallest == "single (1 worker)", fit.line()
    assert fit_run(cfg, 4096, 3 * 2**30, 0.3 * 2**30, workers_per_node=4).fits


def test_the_launcher_asks_the_node_plan_and_refuses_in_one_line(tmp_path, monkeypatch, capsys):
    """A node run is checked also without --mem-mb-per-worker (the machine's memory); the plan's line is the
    launcher's, and no worker starts."""
    cfg, run_yaml = _node_run(tmp_path, {"kind": "gcn"})
    asked, started = [], []

    def plan(cmd, **kw):
        asked.append(cmd[3:])
        return subprocess.CompletedProcess(cmd, 2, "", "gnnpipe: error: run x needs at least 9 GiB per worker\n")

    monkeypatch.setattr(gl.subprocess, "run", plan)
    monkeypatch.setattr(gl.subprocess, "Popen", lambda *a, **kw: started.append(a))
    assert main(["launch", "--run-config", run_yaml]) == 2
    assert asked == [["plan", "--run-config", run_yaml, "--check", "--workers-per-node", "2"]] and not started
    assert one_error_line(capsys) == "gnnpipe: error: refused before launch: run x needs at least 9 GiB per worker"


def test_the_oom_line_of_a_node_run_names_gnnpipe_plan(tmp_path, monkeypatch):
    cfg, _ = _node_run(tmp_path, {"kind": "gcn"})
    counts = iter([0, 1])
    monkeypatch.setattr(gl, "kernel_oom_kills", lambda: next(counts))
    monkeypatch.setattr(gl, "own_cgroup", lambda: None)
    monkeypatch.delenv(gl.MEMCAP_ENV, raising=False)
    line = gl.oom_line(cfg, 1536, gl.kernel_oom_kills(), gl.OOM_EXIT)
    assert "gnnpipe plan --run-config says which layout fits" in line and "plan-atomic" not in line
