"""Training in the domains layout (#35 item 3): every system of a step's batch cut into P spatial
domains, each rank building its own regions' edges and triplets from the batch's positions
(``domains.batch_view``, ``atom_layouts.DomainsTraining``).

Its views equal ``halo.shard_atoms`` of the whole batch's graph grouped by the same owners (in
process, every field); with real gloo groups the energies, forces and summed parameter gradients of
DimeNet++ and GemNet-T (both force heads) equal one process's on the batch to 1e-10 in float64, at
P = 2 and 3, with a rank that holds no triplets; the ledger equals the atoms layout's closed form
on those owners. The training engine (``gnnpipe train``'s) at P = 2 trains as a single run: every
step's loss and the finished weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase.build import bulk, fcc111

from gnnpipe.atomic import domains, halo
from gnnpipe.atomic import neighbors as nb
from gnnpipe.atomic.atom_layouts import DOMAINS_TRAINING
from gnnpipe.io import GnnPipeError
from gnnpipe.parallel.testing import spawn_multi_process
from test_domains import _views_equal

CUTOFF = 3.0  # test_gemnet's (its tiny GemNet-T and test_atom_layout's DimeNet++ are built for it)


def _system(pos, cell, pbc, z, rng) -> dict:
    n = len(pos)
    g = nb.system_graph(pos, cell, pbc, CUTOFF)
    return dict(z=z, pos=pos, system=np.zeros(n, dtype=np.int64), num_systems=1, **g,
                energy=rng.normal(size=1), forces=rng.normal(size=(n, 3)), fixed=rng.random(n) < 0.2,
                cell=np.asarray(cell, dtype=float).reshape(1, 3, 3), pbc=np.asarray(pbc, dtype=bool).reshape(1, 3))


def _batch(seed: int = 0, lone: bool = True) -> dict:
    """A periodic fcc cell (halo edges cross the cell), a slab with vacuum and (``lone``) a molecule of a
    dimer far from a triangle: cut in two, the dimer's rank holds edges and no triplets of it."""
    from test_atomic_parallel import _concat

    rng = np.random.default_rng(seed)
    cu = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 2))
    cu.rattle(0.05, seed=seed + 1)
    slab = fcc111("Cu", size=(2, 2, 3), vacuum=4.0)
    slab.rattle(0.05, seed=seed + 2)
    systems = [_system(a.positions, a.cell.array, a.pbc, rng.integers(1, 10, len(a)), rng) for a in (cu, slab)]
    if lone:
        pos = np.array([[-9.0, 0, 0], [-9.0, 1.1, 0], [0, 0, 0], [1.3, 0, 0], [0.6, 1.2, 0]])
        systems.append(_system(pos, np.zeros((3, 3)), (False,) * 3, rng.integers(1, 10, 5), rng))
    b = _concat(systems)  # id_swap of the batch's edges (_concat offsets the others)
    return {**b, "id_swap": nb.reverse_edges(b["edge_src"], b["edge_dst"], b["edge_shift"])}


def _no_graph(b: dict) -> dict:
    return {k: v for k, v in b.items() if k not in ("edge_src", "edge_dst", "edge_shift", "id_swap", "idx_kj",
                                                    "idx_ji", "triplet_rank")}


@pytest.mark.parametrize("parts", [2, 3])
def test_batch_region_views_equal_the_atoms_layouts_views_of_the_batch(parts):
    """Each rank's view built from its regions alone (the run's two all-gathers are the lists here) is
    ``halo.shard_atoms`` of the batch's whole graph grouped by the same owners: a domain of every system
    each (the batch's systems split together), and at P = 2 a rank without triplets of the molecule."""
    b = _batch()
    arranged = DOMAINS_TRAINING.arrange(_no_graph(b), parts)
    whole = DOMAINS_TRAINING.arrange(b, parts)  # the same owners, with the graph (the closed forms' input)
    assert np.array_equal(arranged["atom_order"], whole["atom_order"]) and "edge_src" not in arranged
    owner = np.repeat(np.arange(parts), arranged["atom_parts"])[np.argsort(arranged["atom_order"])]
    for s in range(3):  # every system is cut: each rank owns atoms of each
        assert set(owner[b["system"] == s]) == set(range(parts))
    ab = np.concatenate([[0], np.cumsum(arranged["atom_parts"])])
    batch = {**_no_graph(b)}
    built = [domains.batch_region_graph(batch, owner, r, CUTOFF) for r in range(parts)]
    graphs = [g for g, _ in built]
    assert np.array_equal(sum(c for _, c in built), np.bincount(b["system"][b["edge_dst"]], minlength=3))
    bounds = [domains.boundary(g, r, ab) for r, g in enumerate(graphs)]
    regions = [domains.region_needs(g, r, ab, bounds) for r, g in enumerate(graphs)]
    needs = [reg.needs for reg in regions]
    for r, reg in enumerate(regions):
        view = domains.region_view(reg, needs, arranged["z"], arranged["pos"], np.arange(len(b["z"])),
                                   system=arranged["system"], num_systems=3)
        _views_equal(view, halo.shard_atoms(whole, r, None))
    molecule = [int((arranged["system"][g.dst[reg.ji]] == 2).sum()) for g, reg in zip(graphs, regions)]
    assert sum(molecule) == int((b["system"][b["edge_dst"][b["idx_ji"]]] == 2).sum())
    if parts == 2:
        assert 0 in molecule, "a rank must hold no triplets of the molecule"


def test_a_system_smaller_than_the_ways_is_refused_in_one_line():
    b = _no_graph(_batch())
    with pytest.raises(GnnPipeError, match="system 7 has 5 atoms, fewer than the 6 ways") as e:
        DOMAINS_TRAINING.arrange({**b, "ids": np.array([3, 5, 7])}, 6)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- exactness over gloo groups
def _worker(rank: int, world: int, b: dict, states: dict, lone: bool) -> dict:
    from gnnpipe.atomic.parallel import EdgeGroup
    from gnnpipe.parallel.comm import Communicator
    from test_atom_layout import model_steps

    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    comm = Communicator()
    grp = EdgeGroup(comm, None, world, rank)
    arranged, g = DOMAINS_TRAINING.view({**_no_graph(b), "cutoff": CUTOFF}, grp, torch.float64, None)
    molecule = int((g.system[g.edge_dst[g.idx_ji]] == 2).sum()) if lone else None  # the molecule's triplets
    out = {"order": arranged["atom_order"][g.atom_lo:g.atom_hi], "molecule": molecule, "counts": g.counts}
    return {**out, **model_steps(comm, g, arranged, b, states, lambda gs: comm.all_reduce_coalesced_(gs))}


def _exact(parts: int, lone: bool):
    from gnnpipe.atomic.protocol import ATOMIC_MODELS
    from test_atom_layout import HEADS, KINDS, _build, _reference

    b = _batch(lone=lone)
    ref, states = _reference([b])
    res = spawn_multi_process(_worker, parts, b, states, lone, timeout=180)
    if lone and parts == 2:
        assert 0 in [r["molecule"] for r in res], "a rank must hold no triplets of the molecule"
    assert sum(r["counts"]["kj"] for r in res) > 0, "the case must exchange halo rows"
    for kind in KINDS:
        for head in HEADS:
            energy, forces, grads = ref[kind, head]
            for r in res:
                e, f, gr = r[kind, head]
                torch.testing.assert_close(e, energy, rtol=0, atol=1e-10)
                torch.testing.assert_close(f, forces[r["order"]], rtol=0, atol=1e-10)
                bad = [i for i, (x, y) in enumerate(zip(gr, grads)) if not torch.allclose(x, y, rtol=0, atol=1e-10)]
                assert len(gr) == len(grads) and not bad, f"{kind} {head}: gradients differ: {bad}"
            spec, cfg = ATOMIC_MODELS[kind], _build(kind, head).cfg
            want = DOMAINS_TRAINING.step_bytes(spec, cfg, [b], parts, 8, spec.count_parameters(cfg))
            assert sum(r[kind, head, "sent"] for r in res) == want, (kind, head)


@pytest.mark.slow
def test_two_ranks_in_the_domains_layout_equal_one_process():
    """DimeNet++ and GemNet-T, both heads, P = 2, float64, a rank without the molecule's triplets:
    energies, forces, summed gradients (1e-10), and the ledger equals the closed form."""
    _exact(2, lone=True)


@pytest.mark.slow
@pytest.mark.long
def test_three_ranks_in_the_domains_layout_equal_one_process():
    _exact(3, lone=True)


# --------------------------------------------------------------------------- the training engine
def _uncapped_runs(root, kind: str, ways: int, cap: int = 64):
    """A single run and a graph run of ``ways`` ways in the domains layout (float64, one epoch, every
    habit on, one system a step) on the same 10 slabs, their graphs.h5 rebuilt with a neighbour cap of
    ``cap`` (64: it does not bind, so the file holds every neighbour within the cutoff)."""
    from gnnpipe.atomic import data
    from test_faults import setup_atomic_run

    runs = [setup_atomic_run(root / "single", "single", 1, epochs=1, kind=kind, spec={"batch_size": 1},
                             dtype="float64"),
            setup_atomic_run(root / "graph", "graph", ways, epochs=1, kind=kind, spec={"batch_size": 1},
                             run={"atom_layout": "domains"}, dtype="float64")]
    for cfg in runs:
        systems = data.read_systems(cfg.systems_path)
        data.write_graphs(cfg.graph_path, data.build_graphs(systems, 4.0, cap, progress=False), 4.0, cap,
                          systems["content_hash"])
    assert runs[1].atom_layout == "domains" and runs[1].run_id.endswith(f"p{ways}domains-seed0")
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dimenetpp", pytest.param("gemnet_t", marks=pytest.mark.long)])
def test_the_atomic_engine_in_the_domains_layout_trains_as_single(tmp_path, kind):
    """``AtomicEngine`` (what ``gnnpipe train`` builds) at P = 2 in the domains layout, float64, every habit
    on: every step's loss and the finished weights equal the single run's to 1e-10; the epoch's ledger
    equals its prediction (the atoms layout's closed form on the domains' owners), which is not the
    atoms layout's (other owners, other halos)."""
    from gnnpipe.atomic.atom_layouts import ATOMS
    from gnnpipe.atomic.atomic_engine import AtomicEngine
    from test_atom_layout import engine_trains_as_single

    single, graph = _uncapped_runs(tmp_path, kind, 2)
    res = engine_trains_as_single(single, graph, 2, steps=8, timeout=180)
    assert sum(r["sent"] for r in res) == res[0]["predicted"]
    engine = AtomicEngine(graph, None, None, torch.device("cpu"))  # the same batches priced in the atoms layout
    assert "edge_src" not in engine.graphs  # graphs.h5's counts alone: the ranks build their own regions
    spec, cfg, params = engine.kind, engine.model_cfg, engine.num_params
    # the prediction (the halo rows the views counted) equals the closed form on each step batch's graph
    # (built from positions, grouped by the domains' owners)
    assert res[0]["predicted"] == sum(DOMAINS_TRAINING.step_bytes(spec, cfg, [engine._graph_batch(s)], 2, 8, params)
                                      for s in engine._steps(engine.ids["train"], 0))
    b = engine._graph_batch(engine.ids["train"][:1])
    assert DOMAINS_TRAINING.step_bytes(spec, cfg, [b], 2, 8, params) != ATOMS.step_bytes(spec, cfg, [b], 2, 8, params)


def test_a_domains_engine_reads_graph_counts_alone_and_builds_the_graphs_it_fits_on(tmp_path):
    """An engine in the domains layout (P = 2) reads of graphs.h5 its attributes and per-system counts
    alone (no neighbour list, no triplets); what runs on whole batches (GemNet's scale-factor fit, the
    prediction of an epoch it has not trained) gets graphs built from the positions equal to the file's,
    field for field; a smaller model cutoff (the graphs rebuilt at it) reads the whole file."""
    import dataclasses

    from gnnpipe.atomic import data
    from gnnpipe.atomic.atomic_engine import AtomicEngine

    single, graph = _uncapped_runs(tmp_path, "dimenetpp", 2)
    dom = AtomicEngine(graph, None, None, torch.device("cpu"))
    ref = AtomicEngine(single, None, None, torch.device("cpu"))
    assert set(k for k, v in dom.graphs.items() if isinstance(v, np.ndarray)) == set(data.GRAPH_COUNTS)
    assert dom.graph_info() == ref.graph_info()
    ids = dom.ids["train"][[2, 0, 5]]
    built, whole = dom._graph_batch(ids), data.batch_arrays(ref.systems, ref.graphs, ids)
    assert built.keys() == whole.keys()
    for k, v in whole.items():
        np.testing.assert_array_equal(built[k], v, err_msg=k)
    model = dataclasses.replace(graph.model, dimenetpp=dataclasses.replace(graph.model.spec, cutoff=3.5))
    smaller = AtomicEngine(dataclasses.replace(graph, model=model), None, None, torch.device("cpu"))
    assert "edge_src" in smaller.graphs and smaller.graphs["cutoff"] == 3.5
    assert not isinstance(smaller.systems["pos"], data.H5Rows)  # the graphs rebuilt from every position


def test_a_domains_engine_reads_the_positions_and_forces_of_its_batches_rows_alone(tmp_path):
    """An engine in the domains layout (P = 2) leaves systems.h5's positions and forces in the file
    (``data.H5Rows``) and reads a step batch's rows only: the batch (``_batch``, ``_graph_batch``) equals the
    one of the whole read, and no more rows are read than the batch's atoms; every other array equals the
    whole read's; index reads and the whole-array fallback give the same rows."""
    from gnnpipe.atomic import data
    from gnnpipe.atomic.atomic_engine import AtomicEngine

    single, graph = _uncapped_runs(tmp_path, "dimenetpp", 2)
    dom = AtomicEngine(graph, None, None, torch.device("cpu"))
    full = data.read_systems(graph.systems_path)
    assert all(isinstance(dom.systems[k], data.H5Rows) for k in data.ROW_ARRAYS)
    for k in data.SYSTEM_ARRAYS:
        if k not in data.ROW_ARRAYS:
            np.testing.assert_array_equal(dom.systems[k], full[k], err_msg=k)
    assert dom.energy_only == AtomicEngine(single, None, None, torch.device("cpu")).energy_only
    ptr = full["atom_ptr"]
    for ids in (dom.ids["train"][[2, 0, 5]], dom.ids["val"][:1]):
        before = {k: dom.systems[k].read for k in data.ROW_ARRAYS}
        got = dom._batch(ids)
        want = data.batch_arrays(full, None, ids)
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], v, err_msg=k)
        atoms = int(sum(ptr[s + 1] - ptr[s] for s in ids))
        assert all(dom.systems[k].read - before[k] == atoms for k in data.ROW_ARRAYS)
        assert atoms < len(full["z"])
    rows = np.array([7, 3, 4, 5, 40, 7])
    for k in data.ROW_ARRAYS:
        np.testing.assert_array_equal(dom.systems[k][rows], full[k][rows])
        np.testing.assert_array_equal(np.asarray(dom.systems[k]), full[k])


def _capped_step(rank: int, world: int, cfg):
    from gnnpipe.atomic.atomic_engine import AtomicEngine
    from gnnpipe.layout import ParallelDims
    from gnnpipe.parallel.comm import Communicator
    from gnnpipe.parallel.groups import build_groups

    groups = build_groups(ParallelDims("graph", world, ways=world, data=1), rank)
    engine = AtomicEngine(cfg, groups, Communicator(groups, torch.device("cpu")), torch.device("cpu"))
    try:
        engine.train_epoch(0)
    except GnnPipeError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_graphs_whose_neighbour_cap_binds_are_refused_in_one_line(tmp_path):
    """The domains layout builds every neighbour within the cutoff: a graphs.h5 whose cap of 8 drops some
    (fcc slabs have 12 within 2.6 Å) would train on other graphs than the file's; the first step says so."""
    _, graph = _uncapped_runs(tmp_path, "dimenetpp", 2, cap=8)
    errors = spawn_multi_process(_capped_step, 2, graph, timeout=120)
    assert all(e is not None and "\n" not in e and "neighbour cap binds" in e and "max_neighbors" in e
               for e in errors), errors


@pytest.mark.slow
def test_the_plan_prices_a_domains_run_in_its_layout(tmp_path, capsys):
    """``plan_run`` (gnnpipe plan-atomic --run-config, launch's check) sizes a domains run by its layout's
    costs: the atoms layout's memory and bytes closed forms on the domains' owners of the largest batch,
    priced beside the layouts a row chooses between (which stay edges and atoms)."""
    import dataclasses

    from gnnpipe import cli
    from gnnpipe.atomic.atomic_engine import plan_run

    _, graph = _uncapped_runs(tmp_path, "dimenetpp", 2)
    plan = plan_run(graph, 2**40, overhead=100, max_ways=4)
    costs = DOMAINS_TRAINING.costs(plan.kind, plan.model_cfg, plan.arrays, 2, 8)
    assert costs["halo"]["kj"] > 0 and plan.need(2) == costs["memory"] + 100 and plan.fits
    assert plan.rows[1]["layouts"]["domains"] == costs and plan.rows[1]["layout"] in ("edges", "atoms")
    assert "at P = 2 in the domains layout" in plan.answer(graph.run_id, "cap")
    assert plan.smallest() == 1
    squeezed = dataclasses.replace(plan, cap=costs["memory"] + 100)
    assert squeezed.fits and not dataclasses.replace(plan, cap=costs["memory"] + 99).fits
    assert cli.main(["plan-atomic", "--run-config", f"{graph.out_dir}/run.yaml"]) == 0
    out = capsys.readouterr().out
    assert "domai GiB" in out and "at P = 2 in the domains layout" in out
