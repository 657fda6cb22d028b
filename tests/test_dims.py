"""``gnnpipe.layout``: the degrees, the rank layout and the one set of layout rules that
the workflow, the engines, the cost model and ``gnnpipe plan`` share."""

import pytest

from gnnpipe.config import ConfigError, load_workflow_config, resolve_runs
from gnnpipe.io import GnnPipeError
from gnnpipe.layout import ParallelDims, check_layout, default_chunks, resolve_layout
from gnnpipe.planning.plan import layouts


def test_ranks_are_replica_then_stage_major():
    d = ParallelDims("hybrid", 12, stages=2, ways=3, data=2)
    assert [d.rank_of(s, g, r) for r in range(2) for s in range(2) for g in range(3)] == list(range(12))
    assert (d.replica_of(10), d.stage_of(10), d.way_of(10)) == (1, 1, 1)
    groups = d.rank_groups(10)
    assert groups.data == [4, 10]
    assert groups.graph == [9, 10, 11]
    assert groups.pipeline == [7, 10]
    # every rank is in exactly one data group, one graph group and one pipeline
    for kind in ("data", "graph", "pipeline"):
        seen = sorted({tuple(getattr(d.rank_groups(r), kind)) for r in range(12)})
        assert sorted(r for g in seen for r in g) == list(range(12)), kind


def test_one_replica_is_the_old_layout():
    d = ParallelDims("hybrid", 6, 2, 3)
    assert d.data == 1
    assert [d.stage_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert d.graph_ranks(1) == [3, 4, 5] and d.pipeline_ranks(2) == [2, 5]
    assert d.rank_groups(4).data == [4]
    g = ParallelDims("graph", 4, 1, 4)
    assert g.rank_groups(2).graph == [0, 1, 2, 3]


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="hybrid", world_size=8, stages=2, ways=2, data=3),
     "data (3) x stages (2) x ways (2) = 12, but the world has 8 processes; launch with torchrun --nproc-per-node 12"),
    (dict(mode="graph", world_size=4, stages=2, ways=2), "mode graph on 4 workers needs stages=1, ways=4"),
    (dict(mode="pipeline", world_size=4, stages=1, ways=2, data=2), "needs stages=2, ways=1; got stages=1, ways=2"),
    (dict(mode="hybrid", world_size=0, stages=1, ways=1, data=0), "must be >= 1"),
    (dict(mode="tensor", world_size=1), "unknown mode 'tensor'"),
])
def test_bad_degrees_are_one_full_message(kwargs, message):
    with pytest.raises(GnnPipeError) as err:
        ParallelDims(**kwargs)
    assert message in str(err.value)


def test_data_replicas_of_the_mode_layouts():
    assert ParallelDims("graph", 8, 1, 4, data=2).rank_groups(5).data == [1, 5]
    assert ParallelDims("pipeline", 6, 3, 1, data=2).rank_groups(4).pipeline == [3, 4, 5]
    with pytest.raises(GnnPipeError, match="outside a world of 4"):
        ParallelDims("graph", 4, 1, 4).rank_groups(4)


def test_default_chunks_round_up_to_the_ways():
    assert default_chunks(2, 1, 4) == 8
    assert default_chunks(2, 2, 4) == 8
    assert default_chunks(2, 3, 4) == 9
    assert default_chunks(3, 2, 4) == 12


def test_layout_rules():
    assert resolve_layout("graph", 3) == (3, 1, 3, 3)
    assert resolve_layout("pipeline", 2) == (2, 2, 1, 8)
    assert resolve_layout("hybrid", 6, stages=2, layers=4) == (6, 2, 3, 9)
    with pytest.raises(GnnPipeError, match=r"chunks \(8\) must be a positive multiple of ways \(3\)"):
        resolve_layout("hybrid", 6, stages=2, chunks=8)
    with pytest.raises(GnnPipeError, match="only 2 graph layers"):
        resolve_layout("pipeline", 3, layers=2)
    with pytest.raises(GnnPipeError, match="single takes workers: 1"):
        resolve_layout("single", 2)
    # one chunk per way: only where the exactness configuration is asked for
    with pytest.raises(GnnPipeError, match=r"chunks \(1\) must be >= stages \(2\)"):
        check_layout("pipeline", 2, 2, 1, 1)
    check_layout("pipeline", 2, 2, 1, 1, exact_ok=True)
    check_layout("hybrid", 6, 3, 2, 2, exact_ok=True)
    with pytest.raises(GnnPipeError, match=r"chunks \(4\) must be >= stages \(6\)"):
        check_layout("hybrid", 12, 6, 2, 4, exact_ok=True)


def test_workflow_and_plan_agree_on_six_workers_two_stages():
    """P = 6, S = 2: the plan proposes 9 chunks (a multiple of the 3 ways); the workflow
    runs the same layout instead of refusing its own default of 8."""
    wf = load_workflow_config({
        "datasets": {"synth": {"kind": "synthetic", "synthetic": {"num_nodes": 500}}},
        "models": {"gcn4": {"kind": "gcn", "layers": 4, "hidden": 16}},
        "runs": [{"mode": "hybrid", "dataset": "synth", "model": "gcn4", "workers": 6, "stages": 2}]})
    (run,) = resolve_runs(wf).values()
    planned = [lay for lay in layouts(6, 4, wf.pipeline.chunks_per_stage) if lay[:2] == ("hybrid", 2)]
    assert planned == [("hybrid", 2, 3, 9)]
    assert (run.mode, run.stages, run.ways, run.chunks) == planned[0]
    assert run.run_id == "synth-gcn4-hybrid-s2g3c9-seed0"
    # an explicit chunk count that is not a multiple of the ways is still refused, by both
    bad = {"mode": "hybrid", "dataset": "synth", "model": "gcn4", "workers": 6, "stages": 2, "chunks": 8}
    with pytest.raises(ConfigError, match=r"run hybrid/synth/gcn4: chunks \(8\) must be a positive multiple"):
        load_workflow_config({"datasets": {"synth": {"kind": "synthetic"}},
                              "models": {"gcn4": {"kind": "gcn", "layers": 4}}, "runs": [bad]})
