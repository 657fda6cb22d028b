"""An emulated cluster on one machine: P workers, each in its own network namespace,
joined through a bridge by rate-limited links (root, ``ip`` and ``tc`` from iproute2).

    python -m gnnpipe.netem up --workers 4 --rate-gbit 1          # gnp0..gnp3 + gnpbr
    python -m gnnpipe.netem status
    python -m gnnpipe.netem launch --workers 4 -- -m gnnpipe.cli train --run-config run.yaml
    python -m gnnpipe.netem check --workers 4                     # all_to_all rate, JSON
    python -m gnnpipe.netem down

Layout (``prefix`` default ``gnp``; nothing is created in the host's namespace)::

    netns gnp0: lo, gnp0 10.77.0.1/24 ──veth── p0 ┐
    netns gnp1: lo, gnp1 10.77.0.2/24 ──veth── p1 ├─ br0 in netns gnpbr
    ...                                           ┘

Each veth end carries a ``tc`` limit on its egress: the worker's end limits what the
worker sends, the bridge's end what it receives, so a worker has ``rate`` per direction
(a full-duplex NIC of its own; ``costmodel.Hardware``'s per-worker link). A one-way
``delay`` needs the kernel's ``sch_netem``; without it (this CI machine's kernel has
``tbf`` and ``htb`` only) ``up`` with a delay fails with one line and the links add only
the software's own latency (measured by ``check``).

``launch`` starts one ``torchrun --nnodes P --nproc-per-node 1`` agent per namespace
(``ip netns exec``), rendezvous ``c10d`` on worker 0's address, which hosts the store
(``is_host``), ``--local-addr`` the namespace's address and ``GLOO_SOCKET_IFNAME`` its
veth, so that rendezvous and gloo traffic cross the emulated links only. It waits for
every agent; the first failure stops the others. Each agent (and so its worker) is pinned
to its own slice of the CPUs this process may use (``cpu_slices``: a node owns its cores, as
on a cluster); with more workers than CPUs, neighbouring ranks share one, so that pipeline
neighbours, which take turns, do (here physics-like pipeline epochs at P=4 on 2 CPUs:
0.63-1.36 s unpinned, 0.64-0.78 s pinned ``i // 2``, 0.81-1.22 s ``i % 2``).
``pin_cpus=False`` (``--no-pin``), or no ``taskset`` (util-linux), leaves placement to the kernel. Files are shared (only the network is
namespaced); an MLflow server on the host's 127.0.0.1 is not reachable from inside,
a ``sqlite:`` tracking URI is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace

from .io import GnnPipeError

PREFIX = "gnp"
SUBNET = "10.77.0"  # /24; worker i is .i+1
PORT = 29400  # the c10d rendezvous on worker 0


def cpu_slices(workers: int, cpus: list[int]) -> list[list[int]]:
    """The CPUs of each of ``workers`` workers: contiguous, disjoint slices of ``cpus`` as even
    as they come; with more workers than CPUs, worker i gets ``cpus[i * len(cpus) // workers]``
    (consecutive ranks share one)."""
    cpus = sorted(cpus)
    n = len(cpus)
    if not cpus or workers < 1:
        raise GnnPipeError(f"netem: cannot place {workers} workers on CPUs {cpus}")
    if workers >= n:
        return [[cpus[i * n // workers]] for i in range(workers)]
    return [cpus[i * n // workers:(i + 1) * n // workers] for i in range(workers)]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _tc(ns: str, *args: str) -> None:
    r = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True)
    if r.returncode:
        raise GnnPipeError(f"tc {' '.join(args)} in netns {ns}: {r.stderr.strip()}")


def available() -> str | None:
    """None where namespaces can be made here, else why not (for a skip or an error)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` (iproute2) on PATH"
    return None


def netem_supported() -> bool:
    """Whether the kernel has ``sch_netem`` (a qdisc that delays), probed in a scratch netns."""
    ns = f"{PREFIX}probe{os.getpid()}"
    _ip("netns", "add", ns)
    try:
        r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                            "delay", "1us"], capture_output=True, text=True)
        return r.returncode == 0
    finally:
        _ip("netns", "del", ns, check=False)


@dataclass(frozen=True)
class Cluster:
    """``workers`` namespaces ``<prefix>0..``, a bridge namespace ``<prefix>br``, links of
    ``rate_gbit`` Gb/s per direction and ``delay_us`` one-way delay."""

    workers: int
    rate_gbit: float | None = None  # None: no limit (veth speed)
    delay_us: float = 0.0
    prefix: str = PREFIX
    subnet: str = SUBNET
    pin_cpus: bool = True  # launch: each agent on its own slice of the CPUs (cpu_slices)

    def __post_init__(self):
        if not 1 <= self.workers <= 250:
            raise GnnPipeError(f"netem: workers must lie in 1..250, got {self.workers}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,5}", self.prefix):
            raise GnnPipeError(f"netem: prefix must be 1-6 lowercase letters/digits, got {self.prefix!r}")
        if self.rate_gbit is not None and not self.rate_gbit > 0:
            raise GnnPipeError(f"netem: rate_gbit must be > 0, got {self.rate_gbit}")
        if self.delay_us < 0:
            raise GnnPipeError(f"netem: delay_us must be >= 0, got {self.delay_us}")

    def ns(self, i: int) -> str:
        return f"{self.prefix}{i}"

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}br"

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def ifname(self, i: int) -> str:
        return self.ns(i)  # the worker's veth, named like its namespace

    def existing(self) -> list[str]:
        """Namespaces of this prefix that exist now (any count)."""
        names = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
        return sorted(n for n in names if re.fullmatch(rf"{self.prefix}(\d+|br)", n))

    # ------------------------------------------------------------------ up / down
    def up(self) -> None:
        why = available()
        if why:
            raise GnnPipeError(f"netem: {why}")
        if self.existing():
            raise GnnPipeError(f"netem: namespaces {', '.join(self.existing())} exist already; "
                               f"`python -m gnnpipe.netem down --prefix {self.prefix}` first")
        if self.delay_us and not netem_supported():
            raise GnnPipeError("netem: this kernel has no sch_netem (CONFIG_NET_SCH_NETEM), so no delay "
                               "can be emulated; use --delay-us 0 (the links keep their rate limit)")
        try:
            _ip("netns", "add", self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "set", "lo", "up")
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for i in range(self.workers):
                ns, dev, port = self.ns(i), self.ifname(i), f"p{i}"
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                # a cluster's usual tuning: no TCP slow start again after each idle compute phase
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw",
                                "net.ipv4.tcp_slow_start_after_idle=0"], check=True, capture_output=True)
                # both ends are born in their namespaces: no name ever appears in the host's
                _ip("link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.bridge_ns)
                _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0")
                _ip("-n", self.bridge_ns, "link", "set", port, "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                self._limit(ns, dev, delay=True)
                self._limit(self.bridge_ns, port, delay=False)
        except subprocess.CalledProcessError as e:
            self.down()
            raise GnnPipeError(f"netem: `{' '.join(e.cmd)}` failed: {e.stderr.strip()}") from None
        except BaseException:
            self.down()
            raise

    def _limit(self, ns: str, dev: str, delay: bool) -> None:
        """The egress limit of one veth end: ``tbf`` for the rate; ``netem`` (delay and rate)
        on the worker's end when there is a delay."""
        if self.rate_gbit is None and not (delay and self.delay_us):
            return
        if delay and self.delay_us:
            rate = ["rate", f"{self.rate_gbit}gbit"] if self.rate_gbit else []
            _tc(ns, "qdisc", "add", "dev", dev, "root", "netem", "delay", f"{self.delay_us}us", *rate,
                "limit", "100000")
            return
        bps = self.rate_gbit * 1e9 / 8
        # burst: two GSO super-packets (64 KiB each) or a millisecond of traffic; queue: 10 ms
        # (a deeper one holds the reverse flow's ACKs behind its data and halves the
        # all_to_all rate, a shallower one drops; both measured with `check` at 1 Gb/s)
        burst = max(2 * 65536, int(bps * 1e-3))
        _tc(ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.rate_gbit}gbit",
            "burst", str(burst), "latency", "10ms")

    def down(self) -> list[str]:
        """Delete every namespace of this prefix (their veths and bridge go with them)."""
        gone = self.existing()
        for n in gone:
            _ip("netns", "del", n, check=False)
        return gone

    def qdiscs(self) -> dict[str, str]:
        """``tc qdisc show`` of every link end, by ``<netns>/<dev>``."""
        out = {}
        for i in range(self.workers):
            for ns, dev in ((self.ns(i), self.ifname(i)), (self.bridge_ns, f"p{i}")):
                r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                                   capture_output=True, text=True)
                out[f"{ns}/{dev}"] = r.stdout.strip() or r.stderr.strip()
        return out

    # ------------------------------------------------------------------ running
    def agent_argv(self, i: int, args: list[str], rdzv_id: str, port: int = PORT) -> list[str]:
        """The command line of worker ``i``'s torchrun agent, inside its namespace (under
        ``taskset`` on its CPUs when ``pin_cpus``)."""
        pin = []
        if self.pin_cpus and shutil.which("taskset"):
            mine = cpu_slices(self.workers, list(os.sched_getaffinity(0)))[i]
            pin = ["taskset", "-c", ",".join(map(str, mine))]
        return ["ip", "netns", "exec", self.ns(i), "env", f"GLOO_SOCKET_IFNAME={self.ifname(i)}", *pin,
                sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.workers),
                "--nproc-per-node", "1", "--node-rank", str(i), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{self.addr(0)}:{port}", "--rdzv-id", rdzv_id,
                "--rdzv-conf", f"is_host={int(i == 0)}", "--local-addr", self.addr(i), *args]

    def launch(self, args: list[str], *, rdzv_id: str | None = None, timeout: float | None = None,
               env: dict | None = None, log=None) -> int:
        """Run ``torchrun ... <args>`` (e.g. ``-m gnnpipe.cli train --run-config x``) on every
        worker; return 0 or the first non-zero exit status. ``log``: a file for every
        agent's output (default: inherited)."""
        missing = [self.ns(i) for i in range(self.workers) if self.ns(i) not in self.existing()]
        if missing:
            raise GnnPipeError(f"netem: no namespace {', '.join(missing)}; "
                               f"`python -m gnnpipe.netem up --workers {self.workers}` first")
        rdzv_id = rdzv_id or f"gnp{os.getpid()}{int(time.time())}"
        full_env = {**os.environ, **(env or {})}
        procs = [subprocess.Popen(self.agent_argv(i, args, rdzv_id), env=full_env, stdout=log,
                                  stderr=subprocess.STDOUT if log is not None else None)
                 for i in range(self.workers)]
        deadline = None if timeout is None else time.monotonic() + timeout
        rc = 0
        try:
            while any(p.poll() is None for p in procs):
                failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
                if failed or (deadline is not None and time.monotonic() > deadline):
                    rc = failed[0] if failed else 124
                    break
                time.sleep(0.05)
            else:
                rc = next((p.returncode for p in procs if p.returncode), 0)
        finally:
            for p in procs:  # the first failure (or the deadline) stops the others
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        return rc


# ---------------------------------------------------------------------- the rate check
def _check_worker(mib: int, reps: int) -> None:
    """Under ``launch``: time all_to_all of ``mib`` MiB per worker and a tiny ping-pong; rank 0
    prints one JSON line."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = mib * 2**20 // 4 // world * world
    x, y = torch.ones(n), torch.empty(n)
    dist.all_to_all_single(y, x)  # warm up the pairs
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(y, x)
        times.append(time.perf_counter() - t0)
    t = torch.zeros(1)
    lat = []
    for _ in range(50):  # ping-pong 0 <-> 1: half a round trip
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)
        lat.append((time.perf_counter() - t0) / 2)
    sent = n * 4 * (world - 1) / world  # bytes each worker sends (and receives) per all_to_all
    best = sorted(times)[len(times) // 2]
    if rank == 0:
        print(json.dumps({"workers": world, "bytes_per_worker": sent, "all_to_all_s": times,
                          "gbit_per_worker": sent * 8 / best / 1e9,
                          "latency_us": sorted(lat)[len(lat) // 2] * 1e6}), flush=True)
    dist.destroy_process_group()


def check(cluster: Cluster, mib: int = 64, reps: int = 5, timeout: float = 300) -> dict:
    """Measure what the links carry: all_to_all bandwidth per worker (Gb/s, per direction)
    and the gloo ping-pong latency, over the emulated links."""
    import tempfile

    with tempfile.TemporaryFile("w+") as log:
        rc = cluster.launch(["-m", "gnnpipe.netem", "_check_worker", str(mib), str(reps)],
                            timeout=timeout, log=log)
        log.seek(0)
        text = log.read()
    rows = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    if rc or not rows:
        raise GnnPipeError(f"netem check failed (exit {rc}):\n{text[-3000:]}")
    return {**rows[0], "rate_gbit_configured": cluster.rate_gbit, "delay_us_configured": cluster.delay_us}


# ---------------------------------------------------------------------- command line
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_check_worker"]:
        _check_worker(int(argv[1]), int(argv[2]))
        return 0
    ap = argparse.ArgumentParser(prog="python -m gnnpipe.netem", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("up", "down", "status", "launch", "check"):
        p = sub.add_parser(name)
        p.add_argument("--prefix", default=PREFIX)
        p.add_argument("--workers", type=int, default=None, help="namespaces (default: those that exist)")
        if name == "up":
            p.add_argument("--rate-gbit", type=float, default=None, help="per worker, per direction (none: no limit)")
            p.add_argument("--delay-us", type=float, default=0.0, help="one-way delay (needs sch_netem)")
        if name == "launch":
            p.add_argument("--timeout", type=float, default=None)
            p.add_argument("--no-pin", action="store_true",
                           help="leave the agents' CPUs to the kernel (default: each its own slice)")
            p.add_argument("args", nargs=argparse.REMAINDER, help="-- then torchrun's script and arguments")
        if name == "check":
            p.add_argument("--mib", type=int, default=64)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "up":
            c = Cluster(a.workers or 2, a.rate_gbit, a.delay_us, a.prefix)
            c.up()
            print(f"netem: up {', '.join(c.existing())} at {a.rate_gbit or 'unlimited'} Gb/s, "
                  f"{a.delay_us} us")
            return 0
        n = a.workers or sum(1 for x in Cluster(1, prefix=a.prefix).existing() if x[len(a.prefix):].isdigit())
        c = Cluster(max(n, 1), prefix=a.prefix)
        if a.cmd == "down":
            print(f"netem: removed {', '.join(c.down()) or 'nothing'}")
        elif a.cmd == "status":
            print(json.dumps({"namespaces": c.existing(), "qdiscs": c.qdiscs() if n else {}}, indent=1))
        elif a.cmd == "launch":
            args = a.args[1:] if a.args[:1] == ["--"] else a.args
            c = replace(c, pin_cpus=not a.no_pin)
            return c.launch(args, timeout=a.timeout)
        elif a.cmd == "check":
            print(json.dumps(check(c, a.mib), indent=1))
    except GnnPipeError as e:
        print(f"gnnpipe.netem: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
