"""The domains layout's memory priced (#35 item 4): per-worker counts from the spatial decomposition,
the inference estimate against the measured peaks, ``gnnpipe plan-atomic --structure``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from ase.build import bulk, fcc111

from gnnpipe.atomic import domains, halo
from gnnpipe.atomic import neighbors as nb
from gnnpipe.atomic.atom_layouts import DOMAINS
from gnnpipe.atomic.protocol import ATOMIC_MODELS
from gnnpipe.io import GnnPipeError

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _cu(shape, seed=1):
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(shape)
    atoms.rattle(0.05, seed=seed)
    return atoms


def _structure(atoms, cutoff):
    return {"z": atoms.numbers, "pos": atoms.positions, "cell": atoms.cell.array, "pbc": atoms.pbc, "cutoff": cutoff}


def _slab():
    slab = fcc111("Cu", size=(3, 3, 4), vacuum=6.0)
    slab.rattle(0.05, seed=2)
    return slab


@pytest.mark.parametrize("name", ["bulk", "slab", "small cell", "tiny cell"])
@pytest.mark.parametrize("parts", [2, 3, 4])
def test_rank_sizes_count_the_atoms_layouts_views_of_the_same_owners(name, parts):
    atoms, cutoff = {"bulk": (_cu((3, 3, 3)), 4.0), "slab": (_slab(), 4.0), "small cell": (_cu((1, 1, 1)), 4.0),
                     "tiny cell": (_cu((1, 1, 1)), 6.0)}[name]  # every atom its own neighbour through many images
    b = _structure(atoms, cutoff)
    owner = domains.spatial_partition(b["pos"], b["cell"], b["pbc"], parts)
    whole = {**nb.system_graph(b["pos"], b["cell"], b["pbc"], cutoff), "z": b["z"], "pos": b["pos"],
             "system": np.zeros(len(b["z"]), np.int64), "num_systems": 1}
    want = halo.rank_sizes(halo.group_by_part(whole, owner, parts))
    got = DOMAINS.rank_sizes(b, parts)
    for g, w in zip(got, want):
        assert (g["atoms_own"], g["edges_own"], g["triplets_own"]) == (w["atoms_own"], w["edges_own"], w["triplets_own"])
        assert g["ring"] == w["atoms"]  # the ring's embeddings are the atoms halo
        assert w["kj"] <= g["halo_edges"]  # every input edge of a ring atom, the ones no own triplet reads too
        assert {k: g[k] for k in halo.HALO_KEYS} == {k: w[k] for k in halo.HALO_KEYS}  # the halo rows, exactly


def _measured():
    """(own atoms, edges, triplets, halo edges) of the largest worker of each measured run (DOMAINS.rank_sizes
    of bench_domains' cells, Cu fcc, cutoff 3 Å, skin 1 Å) and its peak above the RSS before the call (MB):
    DimeNet++ small, float32, --weak 16384 and --weak 27436 at P = 1, 2, 4."""
    weak = json.loads((RESULTS / "domains_weak_md.json").read_text())["runs"]
    large = json.loads((RESULTS / "domains_weak_large.json").read_text())["runs"]
    sizes = {(16384, 1): (16384, 196608, 2162688, 0), (32768, 2): (16384, 196608, 2162688, 17556),
             (65536, 4): (16384, 196608, 2162688, 17688), (27436, 1): (27436, 329232, 3621552, 0),
             (54872, 2): (27436, 329232, 3621552, 24816), (109744, 4): (27436, 329232, 3621552, 24864)}
    return [(sizes[r["atoms"], r["workers"]], r["peak_above_before_mb_max"]) for r in weak + large]


def _measured_gemnet():
    """As :func:`_measured`, GemNet-T small (float32, cutoff 3 Å): bench_domains --kind gemnet_t --weak 6912
    (6,912 own atoms at P = 1, 2, 4) and one process on 2,048 atoms (--shape 8,8,8 --workers 1)."""
    weak = json.loads((RESULTS / "domains_weak_gemnet_t.json").read_text())["runs"]
    sizes = {(6912, 1): (6912, 82944, 912384, 0), (13824, 2): (6912, 82944, 912384, 9936),
             (27648, 4): (6912, 82944, 912384, 9972)}
    return [(sizes[r["atoms"], r["workers"]], r["peak_above_before_mb_max"]) for r in weak] + \
        [((2048, 24576, 270336, 0), GEMNET_2048_MB)]


#: the peak above the RSS before the call of GemNet-T small, one process, 2,048 Cu atoms (8³ cells), MB
GEMNET_2048_MB = 331.4


@pytest.mark.parametrize("name", ["dimenetpp", "gemnet_t"])
def test_the_inference_estimate_is_within_ten_percent_of_the_measured_peaks(name):
    kind = ATOMIC_MODELS[name]
    cfg = kind.preset("small", cutoff=3.0)
    points = _measured() if name == "dimenetpp" else _measured_gemnet()
    assert len(points) == (6 if name == "dimenetpp" else 4)
    for (n, e, t, h), mb in points:
        est = kind.inference_memory(cfg, n, e, t, h, 4)["total"] / 2**20
        assert 0.9 < est / mb < 1.1, (n, h, est, mb)


def test_the_sizes_of_a_measured_cell_are_the_ones_the_estimate_was_fitted_on():
    got = DOMAINS.rank_sizes(_structure(_cu((8, 8, 16)), 3.0), 2)  # an eighth of the weak P = 2 cell's worker
    assert max(r["edges_own"] for r in got) == 196608 // 8 and max(r["triplets_own"] for r in got) == 2162688 // 8


def test_the_estimate_per_worker_falls_with_the_workers():
    kind = ATOMIC_MODELS["dimenetpp"]
    cfg = kind.preset("small", cutoff=3.0)
    b = _structure(_cu((6, 6, 6)), 3.0)
    mem = [DOMAINS.costs(kind, cfg, b, p, 4)["memory"] for p in (1, 2, 4, 8)]
    assert all(a > c for a, c in zip(mem, mem[1:])), mem
    assert mem[-1] < 0.25 * mem[0]  # the shell costs something, not P-fold


def test_the_domains_layout_refuses_a_kind_without_an_inference_estimate_in_one_line():
    import dataclasses

    kind = dataclasses.replace(ATOMIC_MODELS["gemnet_t"], inference_memory=None)
    with pytest.raises(GnnPipeError, match="no memory estimate for gemnet_t") as e:
        DOMAINS.costs(kind, kind.preset("small"), _structure(_cu((2, 2, 2)), 3.0), 2, 4)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["dimenetpp", "gemnet_t"])
def test_plan_atomic_prices_a_structure_in_the_domains_layout(tmp_path, capsys, name):
    from gnnpipe.cli import main

    atoms = _cu((4, 4, 4))
    path = tmp_path / "cu.xyz"
    atoms.write(str(path))
    kind = ATOMIC_MODELS[name]
    cfg = kind.preset("small", cutoff=3.0)
    b = _structure(atoms, 3.0)
    peak = [(DOMAINS.WORKER_RSS + DOMAINS.costs(kind, cfg, b, p, 4)["memory"]) / 2**20 for p in (1, 2)]
    cap = int((peak[0] + peak[1]) / 2)
    assert main(["plan-atomic", "--structure", str(path), "--model", name, "--workers", "4", "--preset", "small",
                 "--cutoff", "3", "--mem-mb-per-worker", str(cap)]) in (0, None)
    out = capsys.readouterr().out.splitlines()
    assert "256 atoms" in out[0] and "domains layout" in out[0]
    rows = {int(line.split()[0]): line for line in out[2:-2]}
    assert sorted(rows) == [1, 2, 4] and rows[4].endswith("<- --workers")
    assert float(rows[1].split()[5].replace(",", "")) == pytest.approx(peak[0], abs=1)
    want = 1 if peak[0] <= cap else 2  # DimeNet++: 2; GemNet-T: 1 (its halo edges cost more than P = 2 saves here)
    assert out[-2] == f"smallest P that fits --mem-mb-per-worker {cap}: {want}"
    # the layout at --workers: the domains layout only where a worker's whole graph does not fit
    from gnnpipe.atomic.atom_layouts import choose_for_structure
    chosen = choose_for_structure(kind, cfg, b, 4, 4, cap * 2**20)
    assert out[-1].startswith("layout at P = 4: " + ("edges or atoms" if chosen is None else chosen.name)), out[-1]


@pytest.fixture(scope="module")
def uncapped_model():
    import dataclasses

    from helpers import tiny_atomic_model

    from gnnpipe.atomic import data

    return dataclasses.replace(tiny_atomic_model(data.generate(4, seed=2, progress=False), "dimenetpp",
                                                 max_neighbors=None), symmetric_edges=True)


def _metal_cell(mf, shape):
    atoms = _cu(shape)
    atoms.set_atomic_numbers([next(z for z in mf.elements if z > 10)] * len(atoms))
    return atoms


def test_a_bound_per_worker_refuses_too_few_workers_in_one_line_with_the_fewest_that_fit(uncapped_model):
    from gnnpipe.atomic.inference import check_memory, structure_only

    mf = uncapped_model
    atoms = _metal_cell(mf, (4, 4, 4))
    b = structure_only(atoms.numbers, atoms.positions, atoms.cell.array, atoms.pbc, mf)
    peak = [DOMAINS.WORKER_RSS + DOMAINS.costs(mf.spec, mf.config(), b, p, 8)["memory"] for p in (2, 3)]
    cap = int((peak[0] + peak[1]) / 2 / 2**20)
    check_memory(mf, b, 3, 8, cap)  # fits: no answer
    with pytest.raises(GnnPipeError, match=rf"256 atoms at workers=2 .* over mem_mb_per_worker={cap} .* use workers=3$") as e:
        check_memory(mf, b, 2, 8, cap, "structure 0: ")
    assert "\n" not in str(e.value) and str(e.value).startswith("structure 0: ")
    with pytest.raises(GnnPipeError, match="no workers up to 256 fit"):
        check_memory(mf, b, 2, 8, 10)


def test_the_predictor_takes_a_bound_per_worker_in_the_auto_and_domains_layouts_only(uncapped_model):
    from gnnpipe.atomic.inference import Predictor

    for kw in ({"workers": 1}, {"workers": 2, "layout": "atoms"}):
        with pytest.raises(GnnPipeError, match="priced across workers in the auto and domains layouts only") as e:
            Predictor(uncapped_model, mem_mb_per_worker=1000, **kw)
        assert "\n" not in str(e.value)


def _bounds(mf, b, ways):
    """(the whole-structure layouts' estimate, the domains layout's) of a worker's peak, bytes."""
    from gnnpipe.atomic.atom_layouts import whole_graph_counts, whole_memory

    graph = nb.radius_graph(b["pos"], b["cell"], b["pbc"], b["cutoff"])
    view = DOMAINS.costs(mf.spec, mf.config(), b, ways, 8)["memory"]
    return DOMAINS.WORKER_RSS + whole_memory(*whole_graph_counts(graph, len(b["z"])), view), DOMAINS.WORKER_RSS + view


def test_under_a_bound_auto_takes_the_domains_layout_only_where_the_whole_structure_does_not_fit(uncapped_model):
    """``choose_for_structure``: a bound between the domains layout's estimate and the whole-structure
    layouts' lower bound takes the domains layout; a bound above both leaves edges / atoms (None: chosen by
    bytes); below both, one line naming the fewest workers that fit; a model that cannot use the domains
    layout is refused in one line."""
    from gnnpipe.atomic.atom_layouts import choose_for_structure
    from gnnpipe.atomic.inference import structure_only

    mf = uncapped_model
    atoms = _metal_cell(mf, (4, 4, 4))
    b = structure_only(atoms.numbers, atoms.positions, atoms.cell.array, atoms.pbc, mf)
    whole, dom = _bounds(mf, b, 2)
    assert dom < whole
    # the whole graph's counts without triplet arrays equal the built graph's
    from gnnpipe.atomic.atom_layouts import whole_graph_counts
    g = nb.system_graph(b["pos"], b["cell"], b["pbc"], b["cutoff"])
    assert whole_graph_counts((g["edge_src"], g["edge_dst"]), len(b["z"])) == (len(b["z"]), len(g["edge_src"]),
                                                                               len(g["idx_kj"]))
    kind, cfg = mf.spec, mf.config()
    assert choose_for_structure(kind, cfg, b, 2, 8, (whole + dom) // 2) is DOMAINS
    assert choose_for_structure(kind, cfg, b, 2, 8, whole) is None
    with pytest.raises(GnnPipeError, match=r"no layout fits .* use workers=\d+ in the domains layout") as e:
        choose_for_structure(kind, cfg, b, 2, 8, (DOMAINS.WORKER_RSS + dom) // 2)
    assert "\n" not in str(e.value)
    with pytest.raises(GnnPipeError, match="cannot use the domains layout") as e:
        choose_for_structure(kind, cfg, b, 2, 8, (whole + dom) // 2, domains=False)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_the_predictor_under_a_bound_takes_the_domains_layout_for_a_large_cell_and_not_for_a_small_one(
        uncapped_model, one_thread):
    """``Predictor(layout="auto", mem_mb_per_worker=...)`` at 2 workers: the 256-atom cell, over the bound in
    the whole-structure layouts, goes to the domains layout (energy and forces equal one process, 1e-10; the
    build kept on the next call without pricing again); a 32-atom cell that fits goes to edges / atoms."""
    from gnnpipe.atomic.inference import Predictor, structure_only

    mf = uncapped_model
    large, small = _metal_cell(mf, (4, 4, 4)), _metal_cell(mf, (2, 2, 2))
    b = structure_only(large.numbers, large.positions, large.cell.array, large.pbc, mf)
    whole, dom = _bounds(mf, b, 2)
    bs = structure_only(small.numbers, small.positions, small.cell.array, small.pbc, mf)
    assert _bounds(mf, bs, 2)[0] < (whole + dom) // 2  # the small cell fits the bound in every layout
    assert len(bs["z"]) == 32
    one = Predictor(mf)
    with Predictor(mf, workers=2, mem_mb_per_worker=int((whole + dom) / 2 / 2**20)) as two:
        for atoms, want_layout in ((large, "domains"), (large, "domains"), (small, None)):
            args = (atoms.numbers, atoms.positions, atoms.cell.array, atoms.pbc)
            want, got = one.predict(*args), two.predict(*args)
            assert (two.last_layout.name == "domains") == (want_layout == "domains"), two.last_layout.name
            assert got.energy == pytest.approx(want.energy, abs=1e-10 * max(1.0, abs(want.energy)))
            np.testing.assert_allclose(got.forces, want.forces, atol=1e-10 * max(1.0, np.abs(want.forces).max()))
        assert two.rebuilds == 1

