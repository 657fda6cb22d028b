"""``gnnpipe.schedule``: GPipe as data, its tags, and the simulation the cost model prices it with."""

import itertools

import pytest

from gnnpipe import schedule as sc


def test_gpipe_actions_of_each_stage():
    acts = sc.gpipe(3, [2, 0, 1])
    assert [repr(a) for a in acts[0]] == ["0F2", "0SEND_F2", "0F0", "0SEND_F0", "0F1", "0SEND_F1",
                                          "0RECV_B1", "0RECV_B0", "0RECV_B2", "0B1", "0B0", "0B2"]
    assert [repr(a) for a in acts[1]] == ["1RECV_F2", "1RECV_F0", "1RECV_F1", "1F2", "1SEND_F2", "1F0",
                                          "1SEND_F0", "1F1", "1SEND_F1", "1RECV_B1", "1RECV_B0", "1RECV_B2",
                                          "1B1", "1SEND_B1", "1B0", "1SEND_B0", "1B2", "1SEND_B2"]
    assert [repr(a) for a in acts[2]] == ["2RECV_F2", "2RECV_F0", "2RECV_F1", "2F2", "2F0", "2F1",
                                          "2B1", "2SEND_B1", "2B0", "2SEND_B0", "2B2", "2SEND_B2"]
    assert [repr(a) for a in sc.gpipe(1, [0])[0]] == ["0F0", "0B0"]
    with pytest.raises(ValueError, match="permutation"):
        sc.gpipe(2, [0, 0])


def test_every_send_meets_its_receive_with_one_tag():
    acts = sc.gpipe(4, [3, 1, 0, 2])
    sends = {(a.direction, a.stage + (1 if a.kind == sc.SEND_F else -1), a.chunk, a.tag(4))
             for s in acts.values() for a in s if a.kind in (sc.SEND_F, sc.SEND_B)}
    recvs = {(a.direction, a.stage, a.chunk, a.tag(4)) for s in acts.values() for a in s
             if a.kind in (sc.RECV_F, sc.RECV_B)}
    assert sends == recvs and len(sends) == 2 * 3 * 4
    tags = [sc.tag(ch, 5, c) for ch in sc.CHANNELS for c in range(5)]
    assert len(set(tags)) == len(tags)
    assert (sc.tag("forward", 5, 2), sc.tag("backward", 5, 2), sc.tag("exact_pass", 5)) == (2, 7, 10)


def test_gpipe_keeps_every_chunk():
    assert sc.in_flight(sc.gpipe(3, range(5))) == 5
    assert sc.in_flight(sc.gpipe(1, range(1))) == 1


@pytest.mark.parametrize("stages, chunks", [(1, 1), (1, 4), (2, 1), (3, 4), (4, 8)])
def test_simulation_is_the_flow_line_formula(stages, chunks):
    """GPipe's makespan: per phase, Σ steps + (c - 1) max step over the stages and links."""
    fwd = [1.0 + 0.37 * s for s in range(stages)]
    bwd = [2.0 - 0.21 * s for s in range(stages)]
    lf = [0.15 * (s + 1) for s in range(stages - 1)]
    lb = [0.4 - 0.1 * s for s in range(stages - 1)]
    acts = sc.gpipe(stages, range(chunks))
    done = sc.simulate(acts, lambda a: (fwd if a.kind == sc.F else bwd)[a.stage],
                       lambda a: lf[a.stage] if a.kind == sc.SEND_F else lb[a.stage - 1])
    steps_f, steps_b = fwd + lf, bwd + lb
    formula = sum(steps_f) + (chunks - 1) * max(steps_f) + sum(steps_b) + (chunks - 1) * max(steps_b)
    assert max(done.values()) == pytest.approx(formula, rel=1e-12)
    assert done[0] == max(done.values())  # GPipe: stage 0 finishes the epoch's last backward


def test_a_prologue_delays_the_whole_pipeline():
    acts = sc.gpipe(2, range(3))
    base = sc.simulate(acts, lambda a: 1.0, lambda a: 0.0)
    late = sc.simulate(acts, lambda a: 1.0, lambda a: 0.0, start={0: 0.5})
    assert max(late.values()) == pytest.approx(max(base.values()) + 0.5)


def test_a_missing_send_is_a_deadlock():
    acts = sc.gpipe(2, range(2))
    acts[0] = [a for a in acts[0] if a.kind != sc.SEND_F]
    with pytest.raises(ValueError, match="deadlocks"):
        sc.simulate(acts, lambda a: 1.0, lambda a: 0.0)


def test_action_tags_cover_each_direction():
    for kind, chunk in itertools.product(sc.KINDS, range(3)):
        a = sc.Action(1, kind, chunk)
        assert a.tag(3) == (chunk if a.direction == "forward" else 3 + chunk)
