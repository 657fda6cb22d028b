"""The emulated cluster (gnnpipe.netem): two namespaces come up joined by rate-limited
links, nothing appears in the host's namespace, a torchrun world forms across them, and
``down`` removes everything. Needs root and iproute2 (skipped otherwise, with the reason);
no timing is asserted (bench_netem measures)."""

import os
import subprocess

import pytest

from gnnpipe import netem
from gnnpipe.io import GnnPipeError

needs_root = pytest.mark.skipif(netem.available() is not None, reason=f"gnnpipe.netem: {netem.available()}")


@pytest.mark.parametrize("workers, cpus, want", [
    (2, [0, 1, 2, 3], [[0, 1], [2, 3]]),
    (3, [0, 1, 2, 3, 4, 5, 6], [[0, 1], [2, 3], [4, 5, 6]]),
    (4, [3, 1], [[1], [1], [3], [3]]),  # pipeline neighbours share a CPU
    (3, [0, 1], [[0], [0], [1]]),
    (1, [5], [[5]]),
])
def test_cpu_slices_are_disjoint_contiguous_and_cover_the_cpus(workers, cpus, want):
    got = netem.cpu_slices(workers, cpus)
    assert got == want
    assert sorted({c for s in got for c in s}) == sorted(cpus)


def test_cpu_slices_refuse_nothing_to_place_on():
    with pytest.raises(GnnPipeError, match="cannot place"):
        netem.cpu_slices(2, [])


def test_agents_are_pinned_unless_asked_not_to():
    c = netem.Cluster(2, prefix="gx")
    argv = c.agent_argv(1, ["-m", "x"], "id")
    if netem.shutil.which("taskset"):
        mine = netem.cpu_slices(2, list(os.sched_getaffinity(0)))[1]
        i = argv.index("taskset")
        assert argv[i + 1:i + 3] == ["-c", ",".join(map(str, mine))] and argv[i + 3] == netem.sys.executable
    assert "taskset" not in netem.Cluster(2, prefix="gx", pin_cpus=False).agent_argv(1, ["-m", "x"], "id")


@pytest.fixture
def cluster():
    c = netem.Cluster(2, rate_gbit=0.5, prefix=f"gt{os.getpid() % 10000}")
    try:
        yield c
    finally:
        c.down()
        assert c.existing() == []


@needs_root
def test_up_limits_every_link_end_and_down_removes_all(cluster):
    cluster.up()
    assert cluster.existing() == sorted([cluster.ns(0), cluster.ns(1), cluster.bridge_ns])
    q = cluster.qdiscs()
    assert sorted(q) == sorted([f"{cluster.ns(0)}/{cluster.ns(0)}", f"{cluster.ns(1)}/{cluster.ns(1)}",
                                f"{cluster.bridge_ns}/p0", f"{cluster.bridge_ns}/p1"])
    assert all("tbf" in v and "rate 500Mbit" in v for v in q.values()), q
    host = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert cluster.prefix not in host  # both veth ends were born in their namespaces
    addr = subprocess.run(["ip", "-n", cluster.ns(1), "-o", "addr", "show", "dev", cluster.ifname(1)],
                          capture_output=True, text=True, check=True).stdout
    assert "10.77.0.2/24" in addr
    with pytest.raises(GnnPipeError, match="exist already"):
        cluster.up()


@needs_root
@pytest.mark.slow
def test_a_torchrun_world_forms_across_the_namespaces(cluster):
    cluster.up()
    out = netem.check(cluster, mib=1, reps=1, timeout=240)
    assert out["workers"] == 2 and out["bytes_per_worker"] > 0 and out["gbit_per_worker"] > 0


@needs_root
def test_launch_refuses_missing_namespaces(cluster):
    with pytest.raises(GnnPipeError, match="no namespace"):
        cluster.launch(["-c", "pass"])


@needs_root
def test_delay_without_sch_netem_is_one_clear_error(cluster):
    if netem.netem_supported():
        pytest.skip("this kernel has sch_netem: a delay is applied")
    c = netem.Cluster(2, rate_gbit=1, delay_us=50, prefix=cluster.prefix)
    with pytest.raises(GnnPipeError, match="no sch_netem"):
        c.up()
    assert c.existing() == []


@pytest.mark.parametrize("kw", [dict(workers=0), dict(workers=2, prefix="Bad-1"), dict(workers=2, rate_gbit=0)])
def test_bad_cluster_arguments(kw):
    with pytest.raises(GnnPipeError):
        netem.Cluster(**kw)
