"""The communicator, its ledger and the halo-exchange autograd pair, on real gloo processes.

Each multi-process test spawns one world and checks several things inside it (a spawn
costs ~1-2 s of interpreter start-up); the ranks return what they saw and the test
asserts in the parent.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from gnnpipe.parallel.comm import Communicator, bucket_tensors, ring_allreduce_bytes
from gnnpipe.parallel.halo import HaloPlan, finish_halo, halo_exchange, start_halo
from gnnpipe.parallel.testing import SpawnError, spawn_multi_process


# --------------------------------------------------------------------------- pure functions
@pytest.mark.parametrize("numel,n", [(10, 3), (7, 4), (1, 2), (100, 1), (0, 3), (5, 8)])
def test_ring_allreduce_bytes_sums_to_ring_rule(numel, n):
    per_rank = [ring_allreduce_bytes(numel, 4, n, r) for r in range(n)]
    assert sum(per_rank) == 2 * (n - 1) * numel * 4
    assert max(per_rank) - min(per_rank) <= 2 * 4  # chunks differ by at most one element


def test_bucket_tensors_respects_cap_order_and_dtype():
    ts = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(3, dtype=torch.float64), torch.zeros(5)]
    b = bucket_tensors(ts, bucket_bytes=80)
    assert [[t.numel() for t in bk] for bk in b] == [[10, 10], [30], [3], [5]]
    assert all(len({t.dtype for t in bk}) == 1 for bk in b)


def test_world_of_one_without_process_group():
    comm = Communicator(None, "cpu")
    assert (comm.rank, comm.world_size) == (0, 1)
    x = torch.randn(4, 3)
    out = comm.all_to_all([x], [4])
    assert torch.equal(out[0], x)
    t = torch.ones(3)
    comm.all_reduce_(t)
    comm.all_reduce_coalesced_([t, torch.ones(2)])
    assert torch.equal(t, torch.ones(3))
    plan = HaloPlan.from_lists([[]], [0], n_own=4)
    h = torch.randn(4, 2, requires_grad=True)
    full = halo_exchange(h, plan, comm)
    full.sum().backward()
    assert full.shape == (4, 2) and torch.equal(h.grad, torch.ones(4, 2))
    assert comm.epoch_bytes(-1) == 0 and comm.epoch_comm_s(-1) == 0.0


# --------------------------------------------------------------------------- collectives
def _collectives(rank, world):
    comm = Communicator(None, "cpu")
    comm.set_epoch(0)
    seen = {}
    # uneven all-to-all, zero rows included: rank r sends (r + q) % 3 rows to q, value 100r + q
    rows = lambda src, dst: (src + dst) % 3  # noqa: E731
    send = [torch.full((rows(rank, q), 2), 100.0 * rank + q) for q in range(world)]
    recv = comm.all_to_all(send, [rows(q, rank) for q in range(world)], op="halo")
    seen["a2a_ok"] = all(torch.equal(recv[q], torch.full((rows(q, rank), 2), 100.0 * q + rank))
                         for q in range(world))
    # the same, async on a flat buffer
    flat = torch.cat(send)
    w = comm.all_to_all_rows(flat, [rows(rank, q) for q in range(world)],
                             [rows(q, rank) for q in range(world)], op="halo", async_op=True)
    seen["a2a_async_ok"] = torch.equal(comm.wait(w), torch.cat(recv))
    # bucketed all-reduce over several buckets and two dtypes
    ts = [torch.full((n,), float(rank + 1)) for n in (3, 50, 7, 1)] + [torch.full((4,), 1.0, dtype=torch.float64)]
    comm.all_reduce_coalesced_(ts, op="grad_allreduce", bucket_bytes=64)
    tot = world * (world + 1) / 2
    seen["allreduce_ok"] = all(torch.equal(t, torch.full_like(t, tot)) for t in ts[:4]) and \
        torch.equal(ts[4], torch.full((4,), float(world), dtype=torch.float64))
    # p2p ring
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    buf = torch.empty(5)
    works = [comm.isend(torch.full((5,), float(rank)), nxt), comm.irecv(buf, prv)]
    comm.wait_all(works)
    seen["p2p_ok"] = torch.equal(buf, torch.full((5,), float(prv)))
    # broadcast, control: not training traffic
    comm.set_epoch(1)
    b = torch.full((6,), float(rank))
    comm.broadcast_(b, src=world - 1)
    seen["bcast_ok"] = torch.equal(b, torch.full((6,), float(world - 1)))
    seen["ledger"] = comm.ledger_dict()
    seen["bytes0"] = comm.epoch_bytes(0)
    seen["bytes1"] = comm.epoch_bytes(1)
    seen["bytes1_all"] = comm.epoch_bytes(1, exclude=())
    seen["comm_s0"] = comm.epoch_comm_s(0)
    seen["halo"] = {overlap: _halo_worker(rank, world, overlap) for overlap in (False, True)}
    return seen


@pytest.fixture(scope="module", ids=lambda w: f"P{w}",
                params=[2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def world_results(request):
    """One spawned world per size; every test below reads what its ranks saw."""
    return request.param, spawn_multi_process(_collectives, request.param, timeout=90)


def test_collectives_and_ledger(world_results):
    world, res = world_results
    for r, s in enumerate(res):
        assert s["a2a_ok"] and s["a2a_async_ok"] and s["allreduce_ok"] and s["p2p_ok"] and s["bcast_ok"], r
        assert s["comm_s0"] > 0
    rows = lambda src, dst: (src + dst) % 3  # noqa: E731
    for r, s in enumerate(res):
        halo = s["ledger"][0]["halo"]
        # two all-to-alls of float32 rows of width 2, self-sends not counted
        sent = sum(rows(r, q) for q in range(world) if q != r) * 2 * 4 * 2
        got = sum(rows(q, r) for q in range(world) if q != r) * 2 * 4 * 2
        assert (halo["sent"], halo["recv"], halo["calls"]) == (sent, got, 2)
        assert s["ledger"][0]["p2p"] == {"sent": 20, "recv": 20, "calls": 2}
        assert s["bytes1"] == 0  # broadcast is control traffic
        assert s["bytes1_all"] == (4 * 6 * (world - 1) if r == world - 1 else 0)
    # all-reduce: the ring rule per bucket, summed over ranks: 2 (n-1) x bytes
    grad_bytes = (3 + 50 + 7 + 1) * 4 + 4 * 8
    assert sum(s["ledger"][0]["grad_allreduce"]["sent"] for s in res) == 2 * (world - 1) * grad_bytes
    assert all(s["ledger"][0]["grad_allreduce"]["calls"] == len(bucket_tensors(
        [torch.zeros(n) for n in (3, 50, 7, 1)] + [torch.zeros(4, dtype=torch.float64)], 64)) for s in res)
    # halo totals are symmetric: what all ranks sent, all ranks received
    assert sum(s["ledger"][0]["halo"]["sent"] for s in res) == sum(s["ledger"][0]["halo"]["recv"] for s in res)


# --------------------------------------------------------------------------- halo autograd
def _halo_problem(world, n=23, d=3, seed=0):
    """A global (n, d) matrix cut into uneven contiguous parts, and random halos."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(n - 1, generator=g)[:world - 1].add(1).tolist())
    offsets = [0] + cuts + [n]
    halos = []
    for p in range(world):
        others = [i for i in range(n) if not offsets[p] <= i < offsets[p + 1]]
        keep = torch.rand(len(others), generator=g) < 0.4
        halos.append([i for i, k in zip(others, keep.tolist()) if k])  # sorted: grouped by owner
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(n, d, generator=g, dtype=torch.float64)  # per-row weights of a smooth loss
    return offsets, halos, h, w


def _plan(p, world, offsets, halos):
    owner = lambda i: max(q for q in range(world) if offsets[q] <= i)  # noqa: E731
    send = [[i - offsets[p] for i in halos[q] if owner(i) == p] if q != p else [] for q in range(world)]
    recv = [sum(1 for i in halos[p] if owner(i) == q) for q in range(world)]
    return HaloPlan.from_lists(send, recv, offsets[p + 1] - offsets[p])


def _local_loss(own, halo, p, offsets, halos, w):
    src = torch.cat([own, halo])  # (n_own + n_halo, d)
    ids = list(range(offsets[p], offsets[p + 1])) + halos[p]
    return (torch.tanh(src) * w[ids]).sum() + (src[: own.shape[0]] ** 2).sum()


def _halo_worker(rank, world, overlap):
    comm = Communicator(None, "cpu")
    offsets, halos, h, w = _halo_problem(world)
    plan = _plan(rank, world, offsets, halos)
    own = h[offsets[rank]:offsets[rank + 1]].clone().requires_grad_(True)
    loss_total = 0.0
    for _ in range(2):  # twice: state must not leak between exchanges
        if overlap:
            pending = start_halo(own * 1.0, plan, comm)
            halo = finish_halo(pending)
            own_used = pending.own
        else:
            full = halo_exchange(own * 1.0, plan, comm)
            own_used, halo = full[: plan.n_own], full[plan.n_own:]
        ok = torch.equal(halo.detach(), h[halos[rank]])
        loss = _local_loss(own_used, halo, rank, offsets, halos, w)
        loss.backward()
        loss_total += float(loss.detach())
    return ok, own.grad, loss_total, comm.ledger_dict()


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_halo_exchange_gradient_matches_single_process(world_results, overlap):
    world, seen = world_results
    offsets, halos, h, w = _halo_problem(world)
    hr = h.clone().requires_grad_(True)
    total = sum(_local_loss(hr[offsets[p]:offsets[p + 1]], hr[halos[p]], p, offsets, halos, w) for p in range(world))
    total.backward()
    res = [s["halo"][overlap] for s in seen]
    for p, (ok, grad, _, ledger) in enumerate(res):
        assert ok, f"rank {p} got the wrong halo rows"
        # two identical steps: the gradient accumulated twice
        torch.testing.assert_close(grad, 2 * hr.grad[offsets[p]:offsets[p + 1]], rtol=0, atol=1e-12)
    # two exchanges forward + two backward, each moving sum(M_p) float64 rows of width 3
    m = sum(len(x) for x in halos)
    assert sum(led[-1]["halo"]["sent"] for *_, led in res) == 4 * m * 3 * 8
    assert abs(sum(r[2] for r in res) - 2 * float(total.detach())) < 1e-9


# --------------------------------------------------------------------------- the spawn helper
def _fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("rank one is broken on purpose")
    dist.barrier()  # rank 0 would wait for ever without the helper's clean-up
    return rank


def test_spawn_reraises_failing_rank_promptly():
    t0 = time.monotonic()
    with pytest.raises(SpawnError, match=r"(?s)rank 1 of 2 raised.*ValueError: rank one is broken on purpose"):
        spawn_multi_process(_fail_on_one, 2, timeout=60)
    assert time.monotonic() - t0 < 30


def _hang(rank, world):
    time.sleep(60 if rank == 0 else 0)
    return rank


def test_spawn_times_out_instead_of_hanging():
    t0 = time.monotonic()
    with pytest.raises(SpawnError, match=r"timed out.*\[0\]"):
        spawn_multi_process(_hang, 2, timeout=4)
    assert time.monotonic() - t0 < 15


def _rank_and_size(rank, world):
    return rank, world, dist.get_rank(), dist.get_world_size(), torch.get_num_threads()


def test_spawn_returns_results_by_rank():
    assert spawn_multi_process(_rank_and_size, 3) == [(r, 3, r, 3, 1) for r in range(3)]
