"""The two classic collective mistakes make the exactness tests fail (mutation tests).

docs/ARCHITECTURE.md and atomic/parallel.py derive why each collective's backward is what it
is; these tests check that the exactness tests would catch the two mistakes the derivation
warns about. Each rank patches ``gnnpipe.atomic.parallel`` in its own process, runs the sharded
step of tests/test_atomic_parallel.py (energy-conserving forces: the double backward passes
through every collective) and the results are compared with the single-process ones:

* a gather whose backward keeps only the local slice of the gradient (fairchem's first
  ``gp_utils``): the other ranks' contributions to a rank's edge rows are lost;
* an all-reduce in ``sum_systems``' backward: the replicated energy loss is counted P times.
"""

from __future__ import annotations

import pytest
import torch

from gnnpipe.parallel.testing import spawn_multi_process
from test_atomic_parallel import _batch, _reference, _sharded


def _gather_keeps_local_slice(parallel) -> None:
    def backward(ctx, g):
        lo = sum(ctx.sizes[:ctx.grp.rank])
        return g[lo:lo + ctx.sizes[ctx.grp.rank]], None, None, None, None
    parallel._GatherRows.backward = staticmethod(backward)


def _allreduce_in_backward(parallel) -> None:
    exact = parallel._SumReplicated

    class AllReduceBoth(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, grp, op):
            ctx.grp, ctx.op = grp, op
            return grp.all_reduce(x, op)

        @staticmethod
        def backward(ctx, g):
            return exact.apply(g, ctx.grp, ctx.op), None, None  # an all-reduce where the identity belongs
    parallel._SumReplicated = AllReduceBoth


MUTATIONS = {"none": lambda parallel: None, "gather_keeps_local_slice": _gather_keeps_local_slice,
             "allreduce_in_sum_systems_backward": _allreduce_in_backward}


def _mutant(rank: int, world: int, b: dict, mutation: str) -> dict:
    from gnnpipe.atomic import parallel
    MUTATIONS[mutation](parallel)
    return _sharded(rank, world, b)


def _max_error(res: list, ref) -> float:
    energy, forces, grads = ref
    err = 0.0
    for r in res:
        diffs = [r["energy"] - energy, r["forces"] - forces[r["lo"]:r["hi"]]]
        diffs += [x - y for x, y in zip(r["grads"], grads)]
        err = max(err, *(float(d.abs().max()) for d in diffs))
    return err


@pytest.mark.slow
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_collective_mistakes_fail_the_exactness_test(mutation):
    b = _batch(2, n_sys=2, quiet_tail=20)
    ref = _reference(b)
    err = _max_error(spawn_multi_process(_mutant, 2, b, mutation, timeout=60), ref)
    if mutation == "none":
        assert err < 1e-10  # the harness itself: unpatched, the sharded step is exact
    else:
        assert err > 1e-6, f"{mutation}: the exactness test would not notice (max error {err:.1e})"
