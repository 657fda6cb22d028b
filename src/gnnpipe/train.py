"""The trainer: one loop for every mode, and the single-process engine.

One process (``single``)::

    gnnpipe train --run-config results/runs/<run_id>/run.yaml

P processes on one node (``graph``, ``pipeline``, ``hybrid``)::

    torchrun --standalone --nproc-per-node P -m gnnpipe.cli train --run-config run.yaml

Several nodes (Slurm or by hand)::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
             --rdzv-endpoint $HEAD:29500 -m gnnpipe.cli train --run-config run.yaml

The run's task (``tasks.task_for``: node classification, S2EF, energy-only) builds its engine
(``engine.Engine``; the task branches once on the mode) and owns what differs between kinds of
run: the epoch's extra fields and check, the record's metrics, the finished model's payload. The
trainer has no branch on the kind of run; it resumes
from the run's last complete checkpoint (``checkpoint.py``; ``--restart`` discards it),
then runs the epochs, reduces the per-rank statistics, checkpoints, and on rank 0 writes
the run record ``<out_dir>/metrics.json`` (docs/DESIGN.md §6) and logs the run to MLflow.
A failure ends every rank promptly with one line (a dead peer named, a non-finite loss or
gradient with its epoch, rank and tensor) and the MLflow run ``FAILED``.

One live job owns a run directory: rank 0 holds ``<out_dir>/.lock`` (``flock``, naming its
host and pid) for the whole attempt, and a second job is refused with one line. A worker
started by torchrun dies with its agent (``PR_SET_PDEATHSIG``): torchrun puts workers in
sessions of their own, so killing the agent or Snakemake's process group used to leave them
training, writing outputs after the job had failed.
"""

from __future__ import annotations

import ctypes
import datetime
import fcntl
import math
import numbers
import os
import resource
import signal
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from .checkpoint import run_fingerprint
from .config import RunConfig, TrainingConfig, bounds, dump_run_config, to_dict
from .engine import DTYPES, NonFiniteError
from .io import GnnPipeError, write_json, write_text, write_torch
from .layertimes import layer_timer, merged, recorded_epochs
from .layout import ParallelDims
from .parallel.groups import ProcessGroups, build_groups
from .tasks import Task, task_for


# --------------------------------------------------------------------------- process set-up
def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def dist_timeout_s(cfg: RunConfig) -> int:
    """``training.dist_timeout_s``, or the environment's ``GNNPIPE_DIST_TIMEOUT`` (same bounds)."""
    text = os.environ.get("GNNPIPE_DIST_TIMEOUT")
    if not text:
        return cfg.training.dist_timeout_s
    bound = bounds(TrainingConfig)["dist_timeout_s"]
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not bound.ok(value):
        raise GnnPipeError(f"GNNPIPE_DIST_TIMEOUT: {text!r} must be whole seconds {bound.text()}")
    return value


def init_distributed(cfg: RunConfig, device: torch.device) -> tuple[int, int]:
    """Join the torchrun world (``single`` needs none); return (rank, world_size)."""
    if cfg.mode == "single":
        return 0, 1
    if "RANK" not in os.environ and not dist.is_initialized():
        raise GnnPipeError(
            f"mode {cfg.mode} runs under torchrun: torchrun --standalone --nproc-per-node "
            f"{cfg.workers} -m gnnpipe.cli train --run-config <run.yaml>")
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=dist_timeout_s(cfg))
        # torchrun --max-restarts keeps one store for every attempt (torch 2.13, --standalone): the
        # keys of a restarted group get a prefix of their own, or its ranks read the dead group's addresses
        store, r, w = next(dist.rendezvous("env://", timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"gnnpipe/attempt-{attempt}", store), rank=r,
                                world_size=w, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != cfg.workers:
        raise GnnPipeError(f"run {cfg.run_id} needs {cfg.workers} workers but torchrun started {world}; "
                           f"use --nproc-per-node {cfg.workers}")
    return rank, world


def build_engine(task: Task, cfg: RunConfig, groups: Optional[ProcessGroups], comm, device):
    """The run's engine, built by its task (tests wrap it)."""
    return task.build_engine(cfg, groups, comm, device)


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: CUDA allocator peak on GPU, max resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class _Reducer:
    """Reduces per-rank scalars across the world (op ``control``: not training traffic)."""

    def __init__(self, comm, world: int):
        self.comm, self.world = comm, world

    def __call__(self, values: list[float], op: str) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        dist.all_reduce(t, op=red)  # tiny: a handful of floats per epoch
        return t.tolist()


# --------------------------------------------------------------------------- failures
class WorkerLost(GnnPipeError):
    """A peer died or the group was stopped: this rank cannot go on (it exits non-zero)."""


class Terminated(BaseException):
    """SIGTERM: torchrun stops the surviving workers of a failed group; Slurm at the time limit."""


def _raise_terminated(signum, frame):
    raise Terminated("SIGTERM")


# What a rank sees when a *peer* died (gloo, NCCL, the c10d store).
BROKEN_GROUP = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout",
                "Timed out", "timed out", "NCCL communicator was aborted", "DistNetworkError",
                "DistBackendError", "Connection refused")


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


@dataclass
class _Attempt:
    """What the failure path of one training attempt needs to know."""

    cfg: RunConfig
    rank: int
    world: int
    epoch: Optional[int] = None  # the epoch being trained (None: set-up or the end)
    peers: list = field(default_factory=list)  # (host, pid) of every rank
    mlflow_run_id: Optional[str] = None
    epoch_log: Optional[object] = None  # rank 0: tracking.EpochLog, whose unlogged rows go with mark_failed
    started_at: str = field(default_factory=_utc_now)  # the run record's: the report's overlap check

    def where(self) -> str:
        at = f"epoch {self.epoch}" if self.epoch is not None else "outside the epochs"
        return f"{at}, rank {self.rank}"

    def dead_peers(self, wait_s: float = 3.0) -> list[str]:
        """The ranks on this host whose process is gone (or a zombie): who broke the group.
        A killed process closes its sockets before it is a zombie: look again for ``wait_s``."""
        host, deadline = socket.gethostname(), time.monotonic() + wait_s
        while True:
            out = [f"rank {r} (pid {pid})" for r, (h, pid) in enumerate(self.peers)
                   if r != self.rank and h == host and not _alive(pid)]
            if out or time.monotonic() > deadline:
                return out
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child stays a zombie until torchrun reaps it
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:600]


def _failure(att: _Attempt, e: BaseException) -> BaseException:
    """The exception a failed attempt ends with (a GnnPipeError: one line, exit 2, where the
    cause is known), after ending its MLflow run FAILED with the reason as a tag."""
    out = e
    if isinstance(e, GnnPipeError):
        line = str(e)
    elif isinstance(e, KeyboardInterrupt):
        line = f"interrupted at {att.where()}"
    elif isinstance(e, Terminated) or (att.world > 1 and any(m in str(e) for m in BROKEN_GROUP)):
        dead = att.dead_peers()
        cause = (f"{', '.join(dead)} died" if dead else
                 "a peer failed or was stopped (see the other ranks' logs and torchrun's failure summary)")
        how = "stopped by SIGTERM" if isinstance(e, Terminated) else _one_line(e)
        line = (f"{att.where()}: the worker group broke: {cause} ({how}); rerun to resume from the last "
                f"complete checkpoint")
        out = WorkerLost(line)
    else:
        line = f"{att.where()}: {_one_line(e)}"
    if att.mlflow_run_id:
        from .tracking import mark_failed
        line = line if line.startswith("rank") else f"rank {att.rank}: {line}"
        log = att.epoch_log
        rows, names = (log.pending, log.metrics) if log is not None else ((), ())
        if not mark_failed(att.cfg, att.mlflow_run_id, line, rows, names, consequence=isinstance(out, WorkerLost)):
            ckpt.note_unrecorded_failure(att.cfg.out_dir, line)
    return out


def _finite_grads(engine, att: _Attempt):
    """An optimizer pre-step hook: a non-finite gradient stops the run before the step."""
    names = {id(p): n for n, p in engine.named_parameters().items()}

    def hook(opt, args, kwargs):
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
            return
        bad = next(p for g in opt.param_groups for p in g["params"]
                   if p.grad is not None and not bool(torch.isfinite(p.grad).all()))
        raise NonFiniteError(f"{att.where()}: non-finite gradient of {names.get(id(bad), '?')} "
                             f"{tuple(bad.shape)}: training diverged (lower training.lr?); stopped before "
                             f"the optimizer step")
    return hook


def _fault_injection(att: _Attempt, epoch: int) -> None:
    """Tests only: ``GNNPIPE_TEST_KILL=<rank>:<epoch>`` makes that rank SIGKILL itself inside the
    epoch's first module forward (a worker dying mid-epoch); not after a torchrun restart."""
    spec = os.environ.get("GNNPIPE_TEST_KILL")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    rank, at = (int(v) for v in spec.split(":"))
    if (rank, at) == (att.rank, epoch):
        torch.nn.modules.module.register_module_forward_pre_hook(
            lambda *a: os.kill(os.getpid(), signal.SIGKILL))


# --------------------------------------------------------------------------- one live job per run
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_launcher(launcher: int) -> None:
    """Under torchrun (Linux): SIGKILL this worker when the agent that started it (pid
    ``launcher``, read when the process started) dies, however it dies. The signal follows the
    thread that forked the worker: torch 2.13's agent starts (and restarts) workers from its main
    thread, whose end is the agent's. An agent already gone (this process adopted) ends it now."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        print(f"gnnpipe: warning: prctl(PR_SET_PDEATHSIG) failed ({os.strerror(ctypes.get_errno())}): this worker "
              f"would outlive its torchrun agent", file=sys.stderr)
    elif os.getppid() != launcher:
        os.kill(os.getpid(), signal.SIGKILL)


LOCK = ".lock"


def own_run_dir(cfg: RunConfig, ranks: ckpt.World):
    """Rank 0 takes ``<out_dir>/.lock`` (``flock``, exclusive) and writes its host and pid in it;
    a lock another live job holds is one line on every rank. The kernel drops the lock when
    its holder dies, so a lock file left by a dead job never blocks (on a shared file system
    across nodes too: NFS supports flock; Lustre wants ``-o flock``). Returns the open lock
    file (held until it is closed) or None."""
    fh, error = None, None
    if ranks.rank == 0:
        path = Path(cfg.out_dir) / LOCK
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = " ".join(fh.read().split())[:200] or "who, it does not say"
            fh.close()
            fh = None
            error = (f"{path}: run {cfg.run_id} is being trained by another job ({holder}); one job at a time "
                     f"writes a run directory: wait for it to end, or stop it")
        else:
            fh.seek(0)
            fh.truncate()
            fh.write(f"host {socket.gethostname()} pid {os.getpid()} since "
                     f"{datetime.datetime.now().isoformat(timespec='seconds')}\n")
            fh.flush()
    ranks.agree(error)
    return fh


# --------------------------------------------------------------------------- the loop
def run(cfg: RunConfig, *, progress: bool = True, restart: bool = False) -> Optional[dict]:
    """Train one run, resuming from its last complete checkpoint (``restart``, or the environment's
    ``GNNPIPE_RESTART=1``: discard it). Returns the run record on rank 0 (None elsewhere)."""
    restart = restart or os.environ.get("GNNPIPE_RESTART", "0") not in ("", "0")
    torch.set_num_threads(max(int(os.environ.get("OMP_NUM_THREADS", 0)) or cfg.training.threads_per_worker, 1))
    task = task_for(cfg)
    task.prepare()
    device = _device()
    rank, world = init_distributed(cfg, device)
    att = _Attempt(cfg, rank, world)
    on_main = threading.current_thread() is threading.main_thread()
    old_handler = signal.signal(signal.SIGTERM, _raise_terminated) if on_main else None
    lock = None
    try:
        att.peers = ckpt.World(rank, world).gather((socket.gethostname(), os.getpid()))
        lock = own_run_dir(cfg, ckpt.World(rank, world))  # held through the failure path below
        groups = comm = None
        if cfg.mode != "single":
            from .parallel.comm import Communicator
            dims = ParallelDims(cfg.mode, world, cfg.stages, cfg.ways, cfg.data_parallel)
            groups = build_groups(dims, rank)
            comm = Communicator(groups, device)
        engine = build_engine(task, cfg, groups, comm, device)
        return _train(cfg, task, engine, comm, att, device, progress, restart)
    except BaseException as e:
        if on_main:  # torchrun's SIGTERM must not cut the failure path short (it SIGKILLs after 30 s)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        failure = _failure(att, e)
        if failure is e:
            raise
        raise failure from e
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, old_handler)
        if cfg.mode != "single" and dist.is_initialized():
            dist.destroy_process_group()
        if lock is not None:
            lock.close()  # releases the flock


#: what every epoch's row of the trainer gives MLflow per epoch, before its task's (``Task.epoch_metrics``)
ROW_METRICS = ("loss", "epoch_time_s", "compute_s", "comm_s", "bubble_s", "comm_bytes")


def row_metrics(task: Task) -> tuple[str, ...]:
    """The per-epoch metrics a run of ``task`` logs: the trainer's and its task's."""
    return (*ROW_METRICS, *task.epoch_metrics)


def _open_mlflow(cfg: RunConfig, task: Task, att: _Attempt, manifest: Optional[dict], fp: dict, superseded,
                 start: int):
    """Rank 0 opens (or reopens) the MLflow run; every rank learns its id (the failure path)."""
    rid = None
    if att.rank == 0:
        from .tracking import start_training
        prior = (manifest or {}).get("mlflow_run_id") or ckpt.read_mlflow_id(cfg.out_dir, fp)
        rid = start_training(cfg, prior, resumed_at=start, superseded=superseded,
                             unrecorded=ckpt.read_unrecorded_failure(cfg.out_dir))
        if rid:
            ckpt.write_mlflow_id(cfg.out_dir, fp, rid)
    att.mlflow_run_id = ckpt.World(att.rank, att.world).gather(rid)[0]
    if rid:
        from .tracking import EpochLog
        att.epoch_log = EpochLog(cfg, rid, row_metrics(task))


def _train(cfg: RunConfig, task: Task, engine, comm, att: _Attempt, device, progress: bool,
           restart: bool) -> Optional[dict]:
    tc = cfg.training
    rank, world = att.rank, att.world
    out_dir = Path(cfg.out_dir)
    reduce = _Reducer(comm, world)
    fp = run_fingerprint(cfg)
    ranks = ckpt.World(rank, world)
    superseded = ckpt.read_mlflow_id(out_dir, None) if restart and rank == 0 else None
    manifest = ckpt.resume(out_dir, ranks, engine, device, cfg=cfg, fingerprint=fp, epochs=tc.epochs,
                           restart=restart)
    start = manifest["epochs_done"] if manifest else 0
    history = list(manifest["history"]) if manifest else []
    if rank == 0 and manifest:
        print(f"gnnpipe: resuming {cfg.run_id} after epoch {start - 1} ({out_dir / ckpt.RESUME_DIR})",
              file=sys.stderr)
    _open_mlflow(cfg, task, att, manifest, fp, superseded, start)
    engine.register_step_pre_hook(_finite_grads(engine, att))
    last_eval: dict[str, float] = {}
    bar = None
    if rank == 0 and progress:
        from tqdm import tqdm
        bar = tqdm(total=tc.epochs, initial=start, desc=f"train {cfg.run_id}", unit="epoch", file=sys.stderr,
                   disable=not sys.stderr.isatty() and not os.environ.get("GNNPIPE_PROGRESS"))
    timed_epochs, layer_times = recorded_epochs(tc.epochs, tc.warmup_epochs), None
    for epoch in range(start, tc.epochs):
        att.epoch = epoch
        _fault_injection(att, epoch)
        if comm is not None:
            comm.set_epoch(epoch)
        if world > 1:
            dist.barrier()  # every rank starts the epoch together: the timing is the epoch's
        t0 = time.perf_counter()
        with layer_timer(engine, epoch, rank == 0 and epoch in timed_epochs) as timed_layers:  # calibration's rows
            stats = engine.train_epoch(epoch)
        wall = time.perf_counter() - t0
        layer_times = merged(layer_times, timed_layers["layer_times"])
        if not math.isfinite(stats.loss):  # the reduced loss: every rank stops here together
            raise NonFiniteError(f"{att.where()}: non-finite training loss ({stats.loss}): training "
                                 f"diverged (lower training.lr?)")
        sent = comm.epoch_bytes(epoch) if comm is not None else 0
        wall_max, = reduce([wall], "max")
        compute, comm_s, bubble, sent_total = reduce(
            [stats.compute_s, stats.comm_s, stats.bubble_s, float(sent)], "sum")
        row = {"epoch": epoch, "loss": stats.loss, "epoch_time_s": wall_max,
               "compute_s": compute / world, "comm_s": comm_s / world, "bubble_s": bubble / world,
               "comm_bytes": int(sent_total), "train_acc": None, "val_acc": None, "test_acc": None}
        if stats.step_losses is not None:  # several optimizer steps an epoch (atomic): each one's loss
            row["step_losses"] = list(stats.step_losses)
        row.update(task.epoch_fields(engine, epoch, rank))
        if (epoch + 1) % max(tc.eval_every, 1) == 0 or epoch == tc.epochs - 1:
            if comm is not None:
                comm.set_epoch(-1)  # evaluation traffic is not an epoch's training traffic
            last_eval = engine.evaluate()
            row.update({k: v for k, v in last_eval.items() if k != "loss"})
        task.check_epoch(engine, epoch, row, att.where())  # before the epoch is recorded or checkpointed
        history.append(row)
        if tc.checkpoint_every and (epoch + 1) % tc.checkpoint_every == 0 and epoch != tc.epochs - 1:
            _checkpoint(task, engine, out_dir / "checkpoint.pt", epoch, cfg, ranks, fp)  # never model.pt: see _checkpoint
            ckpt.save(out_dir, ranks, engine, device, epochs_done=epoch + 1, fingerprint=fp, run_id=cfg.run_id,
                      history=history, mlflow_run_id=att.mlflow_run_id)
        if att.epoch_log is not None:
            att.epoch_log.add(row)
        if bar is not None:  # one line an epoch whatever the terminal (a log has no bar), above the bar
            bar.write(epoch_line(cfg, row), file=sys.stderr)
            sys.stderr.flush()
            val = last_eval.get(task.progress_metric)
            bar.set_postfix(loss=f"{stats.loss:.4f}", val=f"{val if val is not None else float('nan'):.3f}")
            bar.update()
    att.epoch = None
    if bar is not None:
        bar.close()
    final = _checkpoint(task, engine, out_dir / "model.pt", tc.epochs - 1, cfg, ranks, fp, finished=True)
    peak, = reduce([float(peak_memory_bytes(device))], "max")
    if rank != 0:
        return None
    evaluation = evaluate_finished(cfg, task, final, out_dir)  # eval.json (node runs), before the record
    del final
    timed = [r for r in history if r["epoch"] >= tc.warmup_epochs or tc.epochs <= tc.warmup_epochs]
    record = _record(cfg, task, engine, history, [r["epoch_time_s"] for r in timed], timed, last_eval, int(peak))
    record.update(started_at=att.started_at, finished_at=_utc_now())  # this attempt's job, UTC
    if layer_times is not None:  # its layers, timed in the recorded epochs as it trained (gnnpipe.layertimes)
        record["layer_times"] = layer_times
    if evaluation is not None:
        record.update(evaluation["timing"])
    write_text(out_dir / "run.resolved.yaml", dump_run_config(cfg))
    write_json(out_dir / "metrics.json", record)  # kept even if MLflow fails below
    from .tracking import log_training
    # sets record["mlflow_run_id"], rewrites metrics.json; the evaluation's metrics go in the same burst
    log_training(cfg, record, out_dir, att.mlflow_run_id, metrics=row_metrics(task),
                 evaluation=None if evaluation is None else (evaluation["result"], evaluation["path"]))
    ckpt.finish(out_dir)  # complete: a later train of this run starts from epoch 0
    return record


#: what the run record says of the train job's own evaluation (``evaluate_finished``), beside its epochs
EVALUATE_FIELDS = ("evaluate_s", "evaluate_cpu_s")


def evaluate_finished(cfg: RunConfig, task: Task, final: dict, out_dir: Path) -> Optional[dict]:
    """Rank 0, after the finished model is written: where the run's task scores it in training
    (``Task.evaluates_in_training``), the exact pass ``gnnpipe evaluate`` makes (``evaluate.score``:
    one process, the whole graph read once, never a stale embedding), on the weights in memory
    (``final``: what ``model.pt`` holds, so no identity check is needed) into ``eval.json``. Returns
    the result, its file and its timing (wall and this process's CPU seconds: the workflow's
    *evaluate* stage, ``report.stages``), or None where the task leaves it to ``gnnpipe evaluate``."""
    if not task.evaluates_in_training:
        return None
    from .evaluate import score

    path = out_dir / "eval.json"
    t0, c0 = time.perf_counter(), time.process_time()
    result = score(cfg, final, out_dir / "model.pt", path, task=task)
    timing = dict(zip(EVALUATE_FIELDS, (time.perf_counter() - t0, time.process_time() - c0)))
    return {"result": result, "path": path, "timing": timing}


def epoch_line(cfg: RunConfig, row: dict) -> str:
    """The log's line for one epoch (numbered from 0, as the error lines do):
    ``train <run_id>: epoch 3 of 10: loss 0.6931, train_acc 0.9000, val_acc 0.8120, 1.23 s``."""
    vals = [f"{k} {float(v):.4f}" for k, v in row.items() if k.startswith(("train_", "val_"))
            and isinstance(v, numbers.Real)]
    loss = f"loss {row['loss']:.4f}"
    return f"train {cfg.run_id}: epoch {row['epoch']} of {cfg.training.epochs}: {', '.join([loss, *vals])}, " \
           f"{row['epoch_time_s']:.2f} s"


def _median(values):
    return float(statistics.median(values)) if values else 0.0


def _record(cfg, task: Task, engine, history, times, splits, last_eval, peak) -> dict:
    """The run record (docs/DESIGN.md §6); parallel-only fields are 0/1 for ``single``."""
    graph_info = engine.graph_info()
    bytes_timed = [r["comm_bytes"] for r in splits]
    # like with like: the same epochs' closed forms where each epoch has its own (atomic), else the engine's one
    predicted = [r["comm_bytes_predicted"] for r in splits if "comm_bytes_predicted" in r]
    record = {
        "run_id": cfg.run_id, "mode": cfg.mode, "dataset": cfg.dataset_name, **graph_info,
        "model": cfg.model.kind, "layers": cfg.model.layers, "hidden": cfg.model.hidden,
        "world_size": cfg.workers, "stages": cfg.stages, "ways": cfg.ways, "data_parallel": cfg.data_parallel,
        "chunks": cfg.chunks if cfg.mode in ("pipeline", "hybrid") else 1,
        "parts": cfg.chunks if cfg.mode != "single" else 1,
        "epochs": cfg.training.epochs, "dtype_bytes": DTYPES[cfg.training.dtype].itemsize,
        "epoch_time_s": _median(times),
        "epoch_time_breakdown_s": {k: _median([r[f"{k}_s"] for r in splits]) for k in ("compute", "comm", "bubble")},
        "comm_bytes_per_epoch": int(statistics.median(bytes_timed)) if bytes_timed else 0,
        "comm_bytes_predicted": (int(statistics.median(predicted)) if predicted and len(predicted) == len(splits)
                                 else int(engine.predicted_bytes())),
        "peak_mem_bytes": peak,
        "train_acc": last_eval.get("train_acc"), "val_acc": last_eval.get("val_acc"),
        "test_acc": last_eval.get("test_acc"), "final_loss": history[-1]["loss"] if history else None,
        **task.metric_fields(last_eval),  # the task's metrics of the test split (S2EF: docs/DESIGN.md §4)
        "mlflow_run_id": None,
        "extra": engine.extra_info(),
        "history": history,
    }
    record.update(task.record_fields(cfg, engine))
    return record


def _checkpoint(task: Task, engine, path: Path, epoch: int, cfg: RunConfig, ranks: ckpt.World, fp: dict,
                finished: bool = False) -> Optional[dict]:
    """Save the weights after ``epoch`` with what they were trained from (``fp``: the run's
    ``run_fingerprint``, taken once at its start: an ``init_from`` file is hashed whole).

    Intermediate checkpoints go to ``checkpoint.pt``, the finished model alone to ``model.pt``
    (the train rule's output): a run killed half-way never leaves a partial ``model.pt`` that
    ``evaluate`` or Snakemake would take for the result. The finished model also carries what its
    task adds (``Task.final_payload``: an atomic run's inference payload, ``atomic.modelfile``).
    Returns what was written on rank 0 (None elsewhere).
    """
    state = engine.full_state_dict()  # collective in model-parallel modes: every rank calls it
    error, payload = None, None
    if ranks.rank == 0:
        payload = {"model": {k: v.detach().cpu() for k, v in state.items()}, "epoch": epoch,
                   "epochs_done": epoch + 1, "run_id": cfg.run_id, "config": to_dict(cfg), **fp}
        if finished:
            task.final_payload(engine, payload)
        payload["digest"] = ckpt.digest(payload)  # a flipped bit is refused by evaluate.load_checkpoint
        try:
            write_torch(path, payload)
        except GnnPipeError as e:  # a full disk: every rank ends with this line, none waits for rank 0
            error = str(e)
    ranks.agree(error)
    return payload
