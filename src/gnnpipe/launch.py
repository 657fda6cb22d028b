"""``gnnpipe launch``: start one run's training, refusing before launch a run that will not fit a
worker's memory, and naming the memory cap when the kernel kills a worker for exceeding it.

    gnnpipe launch --run-config run.yaml --mem-mb-per-worker 1536            # builds the command
    gnnpipe launch --run-config run.yaml --mem-mb-per-worker 1536 -- torchrun ... -m gnnpipe.cli train ...

The train rule starts every run this way (its launcher after ``--``: ``gnnpipe``, torchrun, srun
+ torchrun, the emulated network's). The launcher

1. asks, in a process of its own (so that this one stays small), whether the run fits a worker's
   memory at its layout: ``gnnpipe plan-atomic --check`` for an atomic run (against
   ``--mem-mb-per-worker``), ``gnnpipe plan --run-config --check`` for a node run (the cost
   model's estimate, ``gnnpipe.planning.fit``, against ``--mem-mb-per-worker`` and this machine's
   memory over the workers on it, also without ``--mem-mb-per-worker``); refuses with the plan's
   one line (exit 2) if not, before any worker starts; ``--force`` (or ``GNNPIPE_FORCE_LAUNCH=1``)
   starts it anyway;
2. runs the command (it dies with the launcher: ``PR_SET_PDEATHSIG``; SIGTERM is passed on), and
   stops it when the job's owner dies (``watch_owners``): its parent (the rule's shell), and the
   process named by ``GNNPIPE_JOB_OWNER`` (Snakemake sets its own pid) when that is an ancestor.
   A ``kill -9`` of either used to leave the launcher, torchrun and the workers training, writing
   ``model.pt`` after Snakemake had called the job failed (a rerun then adopted it, or trained it
   again from epoch 0 into a second MLflow run). The command gets SIGTERM (torchrun passes it on;
   the workers end their MLflow run FAILED and a rerun resumes from the last checkpoint), then
   SIGKILL after ``STOP_GRACE_S``, and the log gets one line naming who died;
3. relays the command's stderr, but for the torchrun agent's own tracebacks (its failure summary,
   ~40 lines after a worker's one-line error; its SignalException when stopped): nothing when a
   worker already said ``gnnpipe: error:``, else one line naming the rank that failed first or
   the signal (``Relay``);
4. when the command fails and the kernel's out-of-memory killer killed a worker meanwhile,
   says so in one line naming the cap (exit 137, the status of a SIGKILLed process): the
   per-worker cgroup's limit when the workers ran in one (below), else the job's; when the
   command was killed by a signal (``kill -9`` of the torchrun agent), one line naming it.

The plan estimates what a training step holds. glibc's allocator may keep more resident: with
its sliding mmap threshold (up to 32 MiB) the heap keeps what tensors free, and a GemNet-T step
whose live peak is 2.4 GiB reached 4.9 GiB resident, its shard at P = 2 more than the whole at
P = 1 (measured here). ``MALLOC_MMAP_THRESHOLD_=131072`` (blocks from 128 KiB mmapped, returned
when freed) makes the resident set follow the plan (within 15 %), at a cost: a step at P = 1 took
up to twice as long here (more page faults); at P = 2 and 4 the difference was within the
machine's noise. The launcher leaves the choice to the environment (the memory-cap benchmark sets
it, as a device's memory has no such heap) and names it when a worker is killed without it.

**Per-worker memory caps** (cgroup v1, root): ``cap_workers(limit, workers)`` makes one memory
cgroup per rank under the caller's own, ``<own>/gnnpipe-cap-<pid>/rank-<r>``, each limited to
``limit`` bytes; with ``GNNPIPE_MEMCAP_CGROUP`` set to that directory, ``gnnpipe train`` moves
itself into ``rank-<RANK>`` first thing (before importing torch: what the interpreter took
before stays charged where it was, a few MB; kernels 6.x refuse ``move_charge_at_immigrate``), so
each worker has a memory of its own, as each GPU has: what ``benchmarks/bench_memory_cap.py`` uses to show a model too large
for one worker trained across P. (cgroup v2 and ``RLIMIT_AS`` are not used: v1 is what this
machine has, and an address-space limit fails allocations with an exception long before the
resident set reaches it, instead of the OOM kill a real cap gives.)
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from .io import GnnPipeError

MEMCAP_ENV = "GNNPIPE_MEMCAP_CGROUP"
FORCE_ENV = "GNNPIPE_FORCE_LAUNCH"
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
OOM_EXIT = 137  # 128 + SIGKILL: what a shell reports for a process the OOM killer ended
UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a page-rounded 2^63 - 1
MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc: blocks from this size are mmapped, returned when freed
OWNER_ENV = "GNNPIPE_JOB_OWNER"  # the pid of the process whose job this is (the workflow sets Snakemake's)
WATCH_S = 0.5  # how often the launcher looks at its owners
STOP_GRACE_S = 45.0  # SIGTERM to SIGKILL when an owner died: torchrun gives its workers 30 s


# --------------------------------------------------------------------------- memory cgroups (v1)
def own_cgroup(pid: int | str = "self") -> Optional[Path]:
    """The memory cgroup directory of a process (cgroup v1), or None where there is none."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            d = CGROUP_ROOT / path.lstrip("/")
            return d if d.is_dir() else None
    return None


def cgroup_limit(d: Path) -> Optional[int]:
    """``memory.limit_in_bytes`` of cgroup ``d`` (None: unlimited or unreadable)."""
    try:
        v = int((d / "memory.limit_in_bytes").read_text())
    except (OSError, ValueError):
        return None
    return v if v < UNLIMITED else None


def oom_kills(d: Path) -> int:
    """How many processes the OOM killer ended in cgroup ``d`` (``memory.oom_control``)."""
    try:
        for line in (d / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def kernel_oom_kills() -> int:
    """The machine's count of OOM kills (``/proc/vmstat``), for jobs without per-worker cgroups."""
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def cap_workers(limit: Optional[int], workers: int, parent: Optional[Path] = None) -> Path:
    """One memory cgroup per rank, ``<parent>/gnnpipe-cap-<pid>/rank-<r>``, each limited to ``limit``
    bytes (swap too, where the kernel accounts it; None: not limited, only measured:
    ``memory.max_usage_in_bytes``); ``parent`` defaults to the caller's own cgroup. Root and
    cgroup v1; remove them with ``uncap_workers``."""
    parent = parent or own_cgroup()
    if parent is None:
        raise GnnPipeError(f"no memory cgroup (v1) at {CGROUP_ROOT}: per-worker caps need cgroup v1 and root")
    top = parent / f"gnnpipe-cap-{os.getpid()}"
    try:
        top.mkdir(exist_ok=True)
        for r in range(workers):
            d = top / f"rank-{r}"
            d.mkdir(exist_ok=True)
            if limit is None:
                continue
            (d / "memory.limit_in_bytes").write_text(str(limit))
            if (d / "memory.memsw.limit_in_bytes").exists():  # no escape into swap
                (d / "memory.memsw.limit_in_bytes").write_text(str(limit))
    except OSError as e:
        for d in [*top.glob("rank-*"), top]:  # what was made: empty cgroups
            d.rmdir() if d.is_dir() else None
        raise GnnPipeError(f"{top}: cannot make per-worker memory cgroups ({e.strerror}); root and cgroup v1 "
                           "are needed") from None
    return top


def uncap_workers(top: Path) -> None:
    """Remove the cgroups of ``cap_workers`` (their processes must have ended)."""
    for d in sorted(top.glob("rank-*")):
        d.rmdir()
    top.rmdir()


def join_worker_cap() -> None:
    """In a worker: move this process into ``$GNNPIPE_MEMCAP_CGROUP/rank-<RANK>`` (no-op without it)."""
    top = os.environ.get(MEMCAP_ENV)
    if not top:
        return
    d = Path(top) / f"rank-{os.environ.get('RANK', '0')}"
    try:
        (d / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        raise GnnPipeError(f"{MEMCAP_ENV}={top}: cannot join {d} ({e.strerror})") from None


# --------------------------------------------------------------------------- the launcher
def default_command(cfg, run_config: str) -> list[str]:
    """One process for ``single``, torchrun on this node for the parallel modes."""
    train = ["-m", "gnnpipe.cli", "train", "--run-config", run_config]
    if cfg.mode == "single":
        return [sys.executable, *train]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(cfg.workers), *train]


def machine_memory() -> Optional[int]:
    """Bytes the workers on this machine share: the job's memory cgroup's limit, else ``MemTotal``."""
    job = own_cgroup()
    limit = cgroup_limit(job) if job else None
    if limit:
        return limit
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def preflight(cfg, run_config: str, mem_mb: Optional[int], workers_per_node: Optional[int] = None) -> None:
    """The run fits a worker's memory at its layout, or its one line: ``gnnpipe plan-atomic --check``
    (atomic runs) or ``gnnpipe plan --run-config --check`` (node runs; also without ``mem_mb``:
    this machine's memory over its workers)."""
    if cfg.atomic:
        ask = ["plan-atomic", "--run-config", run_config, "--mem-mb-per-worker", str(mem_mb), "--check"]
    else:
        ask = (["plan", "--run-config", run_config, "--check"]
               + (["--mem-mb-per-worker", str(mem_mb)] if mem_mb else [])
               + (["--workers-per-node", str(workers_per_node)] if workers_per_node else []))
    done = subprocess.run([sys.executable, "-m", "gnnpipe.cli", *ask], capture_output=True, text=True)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    if done.returncode:
        why = next((line for line in lines if line.startswith("gnnpipe: error: ")), lines[-1] if lines else "")
        raise GnnPipeError(f"refused before launch: {why.removeprefix('gnnpipe: error: ')}")
    print(f"gnnpipe launch: {lines[-1] if lines else 'the plan fits'}", file=sys.stderr, flush=True)


def _die_with_me() -> None:  # in the child, before exec
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _allocator_hint() -> str:
    return "" if os.environ.get(MMAP_ENV) else (f" (the plan counts what a step holds; glibc may keep more resident: "
                                                f"{MMAP_ENV}=131072 bounds it, see gnnpipe.launch)")


def _planner(cfg) -> str:
    return "gnnpipe plan-atomic" if cfg.atomic else "gnnpipe plan"


def oom_line(cfg, mem_mb: Optional[int], before: int, rc: int) -> Optional[str]:
    """The one line for a command that failed because the OOM killer ended a worker, else None."""
    top = os.environ.get(MEMCAP_ENV)
    if top:
        killed = [(d, oom_kills(d)) for d in sorted(Path(top).glob("rank-*"))]
        killed = [(d, n) for d, n in killed if n]
        if killed:
            d = killed[0][0]
            limit = cgroup_limit(d)
            return (f"run {cfg.run_id}: {d.name.replace('-', ' ')} was killed by the out-of-memory killer (SIGKILL, "
                    f"exit {OOM_EXIT}) at its memory cap of {limit / 2**30:.2f} GiB per worker "
                    f"({d}/memory.limit_in_bytes); {_planner(cfg)} --run-config says which layout fits"
                    f"{_allocator_hint()}")
        return None
    if kernel_oom_kills() > before and rc in (OOM_EXIT, -signal.SIGKILL, 1):  # 1: torchrun, a worker failed
        job = own_cgroup()
        limit = cgroup_limit(job) if job else None
        caps = [f"resources.mem_mb_per_worker = {mem_mb} MiB"] if mem_mb else []
        caps += [f"the job's memory cgroup {job}: {limit / 2**30:.2f} GiB"] if limit else []
        return (f"run {cfg.run_id}: a worker was killed by the out-of-memory killer (SIGKILL, exit {OOM_EXIT}) "
                f"under the memory cap ({'; '.join(caps) or 'the machine'}); {_planner(cfg)} --run-config "
                f"says which layout fits{_allocator_hint()}")
    return None


# --------------------------------------------------------------------------- the job's owners
def _stat(pid: int) -> Optional[tuple[str, int, str]]:
    """(state, parent pid, start time) of a process from ``/proc/<pid>/stat``; None: it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), fields[19]


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def job_owners(pid: Optional[int] = None) -> list[tuple[int, str, str]]:
    """``(pid, name, start time)`` of the processes this job lives by: the parent of ``pid`` (this
    process), and ``$GNNPIPE_JOB_OWNER`` when it is an ancestor (a stale value is ignored)."""
    me = _stat(pid or os.getpid())
    if me is None or me[1] <= 1:
        return []
    chain, at = [], me[1]
    while at > 1 and len(chain) < 64:
        st = _stat(at)
        if st is None:
            break
        chain.append((at, _name(at), st[2]))
        at = st[1]
    owner = os.environ.get(OWNER_ENV, "")
    return chain[:1] + [c for c in chain[1:] if str(c[0]) == owner]


def _gone(pid: int, start: str) -> bool:
    st = _stat(pid)
    return st is None or st[0] in ("Z", "X") or st[2] != start  # a zombie, or the pid reused


def watch_owners(owners: list[tuple[int, str, str]], child: subprocess.Popen, say, every: float = WATCH_S,
                 grace: float = STOP_GRACE_S) -> threading.Thread:
    """A daemon thread: when an owner dies while ``child`` runs, ``say`` one line, SIGTERM the
    child, and SIGKILL it ``grace`` seconds later if it has not ended (module docstring, 2)."""
    def watch():
        while child.poll() is None:
            dead = next(((pid, name) for pid, name, start in owners if _gone(pid, start)), None)
            if dead is None:
                time.sleep(every)
                continue
            say(f"the job's {dead[1]} (pid {dead[0]}) died: stopping the run (pid {child.pid}; SIGTERM, SIGKILL "
                f"after {grace:g} s); rerun to resume from the last complete checkpoint")
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(grace)
            except subprocess.TimeoutExpired:
                child.kill()
            return
    thread = threading.Thread(target=watch, name="gnnpipe-owners", daemon=True)
    thread.start()
    return thread


# --------------------------------------------------------------------------- the command's stderr
TORCHRUN_ERRORS = "torch.distributed.elastic."  # the agent's own exceptions (its workers' are not)
TORCHRUN_FAILED = "ChildFailedError:"  # a box follows its traceback
ERROR_PREFIX = "gnnpipe: error: "


class Relay:
    """Copies the command's stderr to ``out`` (bytes, line by line, ``\\r`` ends a line too), but
    for the torchrun agent's own tracebacks: ChildFailedError (a worker failed; the box after it
    names the first) and SignalException (the agent was stopped). Those are dropped when a worker
    has said ``gnnpipe: error: ...`` (its one line is the reason), else replaced by one line: the
    rank that failed first, or the signal. Other tracebacks pass unchanged."""

    def __init__(self, out):
        self.out, self.held, self.box, self.error_seen = out, [], None, False

    def feed(self, line: bytes) -> None:
        text = line.decode(errors="replace")
        if self.box is not None:  # inside the summary: up to its second rule of '='
            self.box.append(text)
            if sum(t.startswith("=====") for t in self.box) == 2:
                self._summary()
            return
        if self.held:  # inside a traceback: held until its exception line says whose it is
            if text[:1].isspace():
                self.held.append(line)
                return
            if text.startswith(TORCHRUN_ERRORS):
                self.held = []
                if TORCHRUN_FAILED in text.split()[0]:
                    self.box = []
                elif not self.error_seen:  # SignalException: Process 4461 got signal: 15
                    self._write(f"gnnpipe launch: torchrun: {text.split(':', 1)[-1].strip()}\n".encode())
                return
            self._write(*self.held)
            self.held = []
        if text.startswith("Traceback (most recent call last):"):
            self.held = [line]
            return
        self.error_seen = self.error_seen or text.startswith(ERROR_PREFIX)
        self._write(line)

    def close(self) -> None:
        """The end of the stream: what is held is written as it came."""
        self._write(*self.held, *(t.encode() for t in self.box or []))
        self.held, self.box = [], None

    def _summary(self) -> None:
        root = "".join(self.box).split("Root Cause", 1)[-1]
        self.box = None
        if self.error_seen:
            return
        got = {k: re.search(rf"^\s*{k}\s*:\s*(.*?)\s*$", root, re.M) for k in ("host", "rank", "exitcode")}
        rank, code, host = ((got[k].group(1) if got[k] else "?") for k in ("rank", "exitcode", "host"))
        self._write(f"gnnpipe launch: torchrun: worker rank {rank} on {host} failed first with exit code {code} "
                    f"(its lines above say why)\n".encode())

    def _write(self, *lines: bytes) -> None:
        for line in lines:
            self.out.write(line)
        self.out.flush()


def relay(stream, out) -> None:
    """Read ``stream`` (a pipe) to its end through a ``Relay`` into ``out``."""
    r, rest = Relay(out), b""
    while chunk := stream.read1(65536):
        *lines, rest = re.split(rb"(?<=[\r\n])", rest + chunk)
        for line in lines:
            r.feed(line)
    if rest:
        r.feed(rest)
    r.close()


def killed_line(cfg, command: list[str], pid: int, rc: int) -> Optional[str]:
    """The one line for a command ended by a signal (``kill -9`` of the torchrun agent), else None."""
    if rc >= 0:
        return None
    name = next((a for a in command if "torch.distributed.run" in a or a.endswith(("torchrun", "srun"))),
                Path(command[0]).name)
    try:
        sig = signal.Signals(-rc).name
    except ValueError:
        sig = f"signal {-rc}"
    return (f"run {cfg.run_id}: the launched {name} (pid {pid}) was killed by {sig}; the workers it started die "
            f"with it; rerun to resume from the last complete checkpoint")


def workers_here(cfg) -> int:
    """The run's workers on this machine: all of them, or a node's share of a Slurm job's."""
    try:
        nodes = max(1, int(os.environ.get("SLURM_JOB_NUM_NODES", "1")))
    except ValueError:
        nodes = 1
    return -(-cfg.workers // nodes)


def launch(run_config: str, command: list[str], mem_mb: Optional[int] = None, force: bool = False) -> int:
    """Check, start, watch, wait, report (module docstring); returns the exit status for the shell."""
    from .config import load_run_config

    cfg = load_run_config(run_config)
    force = force or os.environ.get(FORCE_ENV, "0") not in ("", "0")
    if (mem_mb or not cfg.atomic) and not force:
        preflight(cfg, run_config, mem_mb, workers_here(cfg))
    command = command or default_command(cfg, run_config)
    owners = job_owners()
    env = None
    if sys.stderr.isatty() and not os.environ.get("GNNPIPE_PROGRESS"):  # the bar, through the relay's pipe
        env = {**os.environ, "GNNPIPE_PROGRESS": "1"}
    before = kernel_oom_kills()
    child = subprocess.Popen(command, preexec_fn=_die_with_me, stderr=subprocess.PIPE, env=env)
    reader = threading.Thread(target=relay, args=(child.stderr, sys.stderr.buffer), daemon=True)
    reader.start()
    stopped = []
    watch_owners(owners, child, lambda line: (stopped.append(line), _say(f"run {cfg.run_id}: {line}")))
    old = signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
    try:
        while True:
            try:
                rc = child.wait()
                break
            except KeyboardInterrupt:  # the terminal's Ctrl-C reaches the child too: wait for it
                continue
    finally:
        signal.signal(signal.SIGTERM, old)
        reader.join(5.0)  # the workers' last lines (they may outlive the agent by a moment)
    if rc == 0:
        return 0
    line = oom_line(cfg, mem_mb, before, rc)
    if line:
        _say(line)
        return OOM_EXIT
    line = None if stopped else killed_line(cfg, command, child.pid, rc)
    if line:
        _say(line)
    return 128 - rc if rc < 0 else rc


def _say(line: str) -> None:
    print(f"gnnpipe: error: {line}", file=sys.stderr, flush=True)
