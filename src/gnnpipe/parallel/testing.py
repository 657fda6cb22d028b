"""Run a function on several real processes (gloo on CPU) and get every rank's result back.

For tests and small benchmarks::

    def work(rank, world_size, n):          # module level: it is pickled into the workers
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)
        return t.tolist()

    results = spawn_multi_process(work, 3, 4)   # [[3.0]*4, [3.0]*4, [3.0]*4]

Each worker joins a fresh process group (gloo, the given timeout for every collective;
the rendezvous store is held by the caller on a localhost port the OS picks, so
concurrent test runs cannot race for a port), runs ``fn(rank, world_size, *args)`` with
one compute thread, and sends back its return value (it must pickle; tensors are
copied). If a rank raises, the parent stops the others at once and raises
``SpawnError`` carrying that rank's traceback (the root cause, not a peer's "connection
reset"); a rank that dies without a word, or a world that does not finish within
``timeout``, is an error too. Nothing hangs for longer than ``timeout``. Workers are
forked from a fork server that has imported torch once, so a world starts in well
under a second after the first.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import sys
import time
import traceback
from typing import Any, Callable


class SpawnError(RuntimeError):
    """A rank of ``spawn_multi_process`` failed (the message holds its traceback)."""


def _worker(fn, rank: int, world_size: int, port: int, args: tuple, results, timeout: float,
            threads: int, backend: str, env: dict) -> None:
    os.environ.update(env)
    joined = False
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        span = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=span)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=span)
        joined = True
        out = fn(rank, world_size, *args)
        # plain pickle, not the queue's ForkingPickler: torch would pass tensors as shared
        # memory handles that die with this process
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        # report first: tearing the group down makes the peers fail with secondary errors
        results.put((rank, False, traceback.format_exc()))
    finally:
        if joined:
            import torch.distributed as dist
            dist.destroy_process_group()  # no barrier: a failed peer must not keep anyone waiting


# What a rank sees when a *peer* failed: reported only if no rank has a root cause.
_SECONDARY = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "Socket Timeout", "Timed out waiting", "NCCL communicator was aborted")


def _first_cause(errors: list[tuple[int, str]]) -> tuple[int, str]:
    for rank, tb in errors:
        if not any(s in tb for s in _SECONDARY):
            return rank, tb
    return errors[0]


def _context():
    """A fork server that has imported torch once (later worlds start in milliseconds, and
    it is as safe as spawn: the server forks before any thread, CUDA or OpenMP state
    exists); plain spawn where there is no fork server."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # heavy third-party modules and our own leaf module; an ImportError is ignored
        ctx.set_forkserver_preload(["torch", "torch.distributed", "numpy", "h5py", "scipy.sparse",
                                    "gnnpipe.parallel.comm"])
        return ctx
    return mp.get_context("spawn")


def spawn_multi_process(fn: Callable[..., Any], world_size: int, *args, timeout: float = 60.0,
                        threads: int = 1, backend: str = "gloo", env: dict | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the results by rank.

    ``fn`` must be importable by name (a module-level function). ``timeout`` bounds both
    each collective and the whole run (seconds). ``env`` is added to each worker's
    environment.
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    import torch.distributed as dist

    ctx = _context()
    results = ctx.Queue()
    # the rendezvous store lives in this process, on a port the OS picks: no race for a port
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    port = store.port
    procs = [ctx.Process(target=_worker, name=f"rank{r}", daemon=True,
                         args=(fn, r, world_size, port, args, results, timeout, threads, backend,
                               dict(env or {})))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.1)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in out and not p.is_alive() and p.exitcode not in (None, 0)]
                if dead:
                    errors = _drain_errors(results, grace=0.5)  # a traceback may have raced the exit
                    if errors:
                        first, tb = _first_cause(errors)
                        raise SpawnError(f"rank {first} of {world_size} raised:\n{tb}")
                    raise SpawnError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                                     "before returning a result")
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise SpawnError(f"spawn_multi_process timed out after {timeout:.0f}s; "
                                     f"rank(s) {missing} did not finish")
                continue
            if not ok:
                errors = [(rank, value)] + _drain_errors(results, grace=1.0)
                first, tb = _first_cause(errors)
                others = sorted({r for r, _ in errors} - {first})
                also = f" (rank(s) {others} failed after it)" if others else ""
                raise SpawnError(f"rank {first} of {world_size} raised{also}:\n{tb}")
            out[rank] = pickle.loads(value)
    finally:
        _stop(procs)
        del store
    return [out[r] for r in range(world_size)]


def _drain_errors(results, grace: float) -> list[tuple[int, str]]:
    """The failures that arrive within ``grace`` seconds (to find the root cause)."""
    errors, end = [], time.monotonic() + grace
    while time.monotonic() < end:
        try:
            rank, ok, value = results.get(timeout=max(end - time.monotonic(), 0.01))
        except queue_mod.Empty:
            break
        if not ok:
            errors.append((rank, value))
    return errors


def _stop(procs) -> None:
    for p in procs:
        p.join(timeout=0.5 if p.is_alive() else 0)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2)
        if p.is_alive():
            p.kill()
            p.join()
