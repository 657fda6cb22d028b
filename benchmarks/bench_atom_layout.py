"""One large system over P workers: the atoms layout (halo all_to_all) beside the edges layout (issue #26).

    .venv/bin/python benchmarks/bench_atom_layout.py --out results/bench/atom_layout.json
    .venv/bin/python benchmarks/bench_atom_layout.py --out /tmp/al.json --atoms-per-worker 256 --steps 1   # quick
    .venv/bin/python benchmarks/bench_atom_layout.py --out /tmp/al.json --smoke   # 32 atoms a worker, P = 2 only

**Measured (weak scaling).** One rattled fcc Cu cell of ``--atoms-per-worker`` × P atoms (1,000 by
default: 4·5·5·10 at P = 1, 4·5·10·10 at P = 2, 4·10³ at P = 4), EMT-labelled, symmetric radius graph
at ``--cutoff`` Å (vesin), DimeNet++ ``small`` trained on energies and gradient forces (double
backward), float32, one step = forward, forces, loss, backward, gradient all-reduce; ``--steps``
timed steps after one warm-up, on P real processes (gloo, one thread each). Per layout and P: the
median time per step (P = 1 and 2 only: this machine has 2 cores, so P = 4 would time
oversubscription), the bytes per step all ranks sent (the ledger) beside the closed form
(``kind.step_bytes``; ``halo.step_bytes`` on the partition's halo counts), each rank's peak
resident memory (``ru_maxrss``, whole process: torch itself is ~0.3 GB of it) and the estimate of
``atom_layouts.layout_costs``. Weak-scaling efficiency = t(P = 1) / t(P).

**Extrapolated (the cost model's closed forms, not measured).** One system of 10^4, 10^5, 10^6 atoms
at P = 8 … 256, bytes per training step of both layouts for DimeNet++ and GemNet-T (``small`` and
``xl``). The edges layout's closed form needs only N and E (E = N × the cell's mean degree); the atoms
layout's needs the halo rows of each part, which depend on the part's size n = N/P and shape: per
part and exchange, ``count = α · shell(n)`` with ``shell`` the atoms (or edges: × degree) within
``d`` of a cube of n atoms (``d`` = cutoff for the sources of own edges, 2·cutoff for every ghost
atom), ``α`` fitted on METIS partitions measured here (P = 8 of cells of 8·n atoms, n = 250 … 2,000),
capped at the whole system; α is the largest ratio measured (it grows with n: the conservative side
for the atoms layout). Labelled ``extrapolation`` in the JSON.

**Graph building.** The seconds ``neighbors.system_graph``'s steps take on a ~10^5-atom cell
(``--neighbor-atoms``): vesin's cell lists, the reverse edges, the triplets.

**Anchor, not a comparison.** fairchem reports 64.6 % weak-scaling efficiency at 256 H200 GPUs
(4k atoms per GPU) for UMA's all-to-all graph parallelism (37.8 % with its earlier all-gather): a
published measurement on other hardware, another model and another network, stated as the field's
reference point; this machine measures P ≤ 2 on CPU cores.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import numpy as np

from gnnpipe.io import write_json
from machine import machine_record
from smoke import parse_args

FAIRCHEM_ANCHOR = {"efficiency": 0.646, "all_gather_efficiency": 0.378, "gpus": 256, "device": "H200",
                   "atoms_per_gpu": 4000, "what": "fairchem (UMA) graph parallelism, all-to-all of boundary rows; "
                                                  "published weak-scaling efficiency, not measured here"}
A_CU = 3.61


def cu_cell(reps, cutoff: float, seed: int = 0) -> dict:
    """A rattled fcc Cu cell (4·∏reps atoms), EMT-labelled, as one batch (``graphs.batch_arrays``' keys)."""
    from ase.build import bulk
    from ase.calculators.emt import EMT

    from gnnpipe.atomic import neighbors as nb

    atoms = bulk("Cu", "fcc", a=A_CU, cubic=True).repeat(tuple(reps))
    atoms.rattle(0.05, seed=seed)
    atoms.calc = EMT()
    g = nb.system_graph(atoms.positions, atoms.cell.array, atoms.pbc, cutoff)
    n = len(atoms)
    return dict(z=atoms.numbers.astype(np.int64), pos=atoms.positions, system=np.zeros(n, dtype=np.int64),
                num_systems=1, energy=np.array([atoms.get_potential_energy()]), forces=atoms.get_forces(),
                fixed=np.zeros(n, dtype=bool), **{k: g[k] for k in ("edge_src", "edge_dst", "edge_shift", "idx_kj",
                                                                    "idx_ji", "id_swap")})


def _train(rank: int, world: int, b: dict, layout: str, cutoff: float, steps: int) -> dict:
    """``steps + 1`` training steps of DimeNet++ small on this rank's view; times, bytes, peak memory."""
    import torch
    import torch.distributed as dist

    from gnnpipe.atomic.atom_layouts import ATOM_LAYOUTS
    from gnnpipe.atomic.parallel import EdgeGroup
    from gnnpipe.atomic.protocol import ATOMIC_MODELS
    from gnnpipe.parallel.comm import Communicator

    comm = Communicator()
    grp = EdgeGroup(comm, None, world, rank)
    torch.manual_seed(0)
    model = ATOMIC_MODELS["dimenetpp"].build(ATOMIC_MODELS["dimenetpp"].preset("small", cutoff=cutoff)).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    t0 = time.perf_counter()
    b, g = ATOM_LAYOUTS[layout].view(b, grp, torch.float32, None)
    setup = time.perf_counter() - t0
    e_ref = torch.as_tensor(b["energy"], dtype=torch.float32) / len(b["z"])
    f_ref = torch.as_tensor(b["forces"][g.atom_lo:g.atom_hi], dtype=torch.float32)
    times, sent = [], []
    for step in range(steps + 1):
        comm.set_epoch(step)
        dist.barrier()
        t = time.perf_counter()
        out = model(g)
        loss = ((out["energy"] / len(b["z"]) - e_ref) ** 2).sum() / world \
            + ((out["forces"] - f_ref) ** 2).sum() / (3 * len(b["z"]))
        opt.zero_grad(set_to_none=False)
        loss.backward()
        comm.all_reduce_coalesced_([p.grad for p in model.parameters()])
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t)
        sent.append(sum(v["sent"] for v in comm.ledger_dict().get(step, {}).values()))
    return {"times": times[1:], "sent": sent[1:], "setup_s": setup, "atoms_local": g.num_atoms,
            "edges_local": g.num_local_edges, "triplets_local": g.num_local_triplets,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def weak_scaling(a) -> list[dict]:
    from gnnpipe.atomic.atom_layouts import layout_costs
    from gnnpipe.atomic.protocol import ATOMIC_MODELS
    from gnnpipe.parallel.testing import spawn_multi_process

    kind = ATOMIC_MODELS["dimenetpp"]
    cfg = kind.preset("small", cutoff=a.cutoff)
    params = kind.count_parameters(cfg)
    rows = []
    for p in a.workers:
        reps = _reps(a.atoms_per_worker * p)
        b = cu_cell(reps, a.cutoff)
        costs = layout_costs(kind, cfg, b, p, 4)
        for layout in (("edges",) if p == 1 else ("edges", "atoms")):
            timed = p <= 2
            t0 = time.perf_counter()
            res = spawn_multi_process(_train, p, b, layout, a.cutoff, a.steps if timed else 1, timeout=3600)
            sent = [sum(r["sent"][i] for r in res) for i in range(len(res[0]["sent"]))]
            closed = costs[layout]["bytes"] if p > 1 else 0
            row = {"P": p, "layout": layout, "atoms": len(b["z"]), "edges": len(b["edge_src"]),
                   "triplets": len(b["idx_kj"]), "reps": list(reps), "timed": timed,
                   "time_per_step_s": statistics.median(max(r["times"][i] for r in res) for i in range(len(sent)))
                   if timed else None,
                   "bytes_per_step": sent[0], "bytes_per_step_closed_form": closed,
                   "ledger_equals_closed_form": all(s == closed for s in sent),
                   "peak_rss_per_worker": max(r["peak_rss"] for r in res),
                   "memory_estimate_per_worker": costs[layout]["memory"],
                   "local": [{k: r[k] for k in ("atoms_local", "edges_local", "triplets_local")} for r in res],
                   "halo": costs["halo"] if layout == "atoms" else None, "wall_s": time.perf_counter() - t0}
            rows.append(row)
            print(f"[bench_atom_layout] P={p} {layout:<5} {row['atoms']} atoms: "
                  + (f"{row['time_per_step_s']:.2f} s/step, " if timed else "")
                  + f"{sent[0] / 1e6:.2f} MB/step (closed form {closed / 1e6:.2f}), peak RSS "
                  f"{row['peak_rss_per_worker'] / 2**30:.2f} GiB/worker", flush=True)
    t1 = next((r["time_per_step_s"] for r in rows if r["P"] == 1), None)
    for r in rows:
        r["params"] = params
        r["weak_scaling_efficiency"] = t1 / r["time_per_step_s"] if r["timed"] and t1 else None
    return rows


def _reps(n_atoms: int) -> tuple[int, int, int]:
    """Repeats of the 4-atom cubic cell giving ``n_atoms`` atoms, as near a cube as the factors allow."""
    cells = n_atoms // 4
    best = None
    for x in range(1, cells + 1):
        for y in range(x, cells // x + 1):
            if cells % (x * y) == 0:
                z = cells // (x * y)
                if z >= y and (best is None or z - x < best[2] - best[0]):
                    best = (x, y, z)
    return best


def neighbour_list(n_atoms: int, cutoff: float) -> dict:
    """Seconds to build one cell's graph as every atomic dataset does (``neighbors.system_graph``: vesin
    cell lists, reverse edges, triplets), on a rattled fcc Cu cell of about ``n_atoms`` atoms."""
    from ase.build import bulk

    from gnnpipe.atomic import neighbors as nb

    atoms = bulk("Cu", "fcc", a=A_CU, cubic=True).repeat(_reps(n_atoms))
    atoms.rattle(0.05, seed=2)
    out = {"atoms": len(atoms), "cutoff": cutoff}
    t = time.perf_counter()
    src, dst, shift = nb.radius_graph(atoms.positions, atoms.cell.array, atoms.pbc, cutoff)
    out["radius_graph_s"] = time.perf_counter() - t
    t = time.perf_counter()
    nb.reverse_edges(src, dst, shift)
    out["reverse_edges_s"] = time.perf_counter() - t
    t = time.perf_counter()
    kj, _ = nb.triplets(src, dst, shift)
    out["triplets_s"] = time.perf_counter() - t
    out.update(edges=len(src), triplets=len(kj), total_s=out["radius_graph_s"] + out["reverse_edges_s"] + out["triplets_s"])
    print(f"[bench_atom_layout] graph of {out['atoms']} atoms at {cutoff} Å: {out['edges']} edges, {out['triplets']} "
          f"triplets in {out['total_s']:.1f} s (vesin {out['radius_graph_s']:.2f} s)", flush=True)
    return out


# --------------------------------------------------------------------------- extrapolation
def _shell(n: float, depth: float, rho: float) -> float:
    """Atoms within ``depth`` of a cube holding n atoms at density rho (outside it)."""
    side = (n / rho) ** (1 / 3)
    return rho * ((side + 2 * depth) ** 3 - side ** 3)


def fit_halo(a) -> dict:
    """α per halo count: measured per-part halo rows of METIS P = 8 partitions ÷ the cube-shell law."""
    from gnnpipe.atomic import halo

    rho = 4 / A_CU ** 3
    samples = []
    for n in a.fit_sizes:
        b = cu_cell(_reps(8 * n), a.cutoff, seed=1)
        deg = len(b["edge_src"]) / len(b["z"])
        sizes = halo.rank_sizes(halo.order_by_part(b, 8))
        shells = {"atoms": _shell(n, a.cutoff, rho), "ghosts": _shell(n, 2 * a.cutoff, rho)}
        law = {"atoms": shells["atoms"], "ghosts": shells["ghosts"], "kj": deg * shells["atoms"],
               "swap": deg * shells["atoms"]}
        measured = {k: statistics.mean(r[k] for r in sizes) for k in law}
        samples.append({"atoms_per_part": n, "degree": deg, "measured": measured, "law": law})
        print(f"[bench_atom_layout] fit n={n}: " + ", ".join(f"{k} {measured[k]:.0f}/{law[k]:.0f}" for k in law),
              flush=True)
    # the largest ratio measured (it grows with n towards the surface law's regime): the conservative side
    alpha = {k: max(s["measured"][k] / s["law"][k] for s in samples) for k in samples[0]["law"]}
    return {"alpha": alpha, "degree": statistics.mean(s["degree"] for s in samples), "density": rho,
            "samples": samples}


def extrapolate(fit: dict, cutoff: float) -> list[dict]:
    from gnnpipe.atomic import halo
    from gnnpipe.atomic.protocol import ATOMIC_MODELS

    rows = []
    deg, rho, alpha = fit["degree"], fit["density"], fit["alpha"]
    for kind_name, preset in (("dimenetpp", "small"), ("dimenetpp", "xl"), ("gemnet_t", "small"), ("gemnet_t", "xl")):
        kind = ATOMIC_MODELS[kind_name]
        cfg = kind.preset(preset, cutoff=cutoff, force_head="gradient")
        params = kind.count_parameters(cfg)
        for n_atoms in (10 ** 4, 10 ** 5, 10 ** 6):
            edges = round(n_atoms * deg)
            for p in (8, 16, 32, 64, 128, 256):
                n = n_atoms / p
                law = {"atoms": _shell(n, cutoff, rho), "ghosts": _shell(n, 2 * cutoff, rho)}
                law.update(kj=deg * law["atoms"], swap=deg * law["atoms"])
                cap = {"atoms": n_atoms - n, "ghosts": n_atoms - n, "kj": edges * (1 - 1 / p),
                       "swap": edges * (1 - 1 / p)}
                counts = {k: round(p * min(alpha[k] * law[k], cap[k])) for k in law}
                e_bytes = kind.step_bytes(cfg, [edges], [n_atoms], [1], p, 4, params)
                a_bytes = halo.step_bytes(kind, cfg, [counts], [1], p, 4, params)
                rows.append({"kind": kind_name, "preset": preset, "atoms": n_atoms, "edges": edges, "P": p,
                             "halo": counts, "edges_bytes_per_step": e_bytes, "atoms_bytes_per_step": a_bytes,
                             "edges_bytes_per_worker": e_bytes / p, "atoms_bytes_per_worker": a_bytes / p,
                             "ratio": a_bytes / e_bytes, "extrapolation": True})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench/atom_layout.json")
    ap.add_argument("--atoms-per-worker", type=int, default=1000, help="weak scaling: atoms per worker")
    ap.add_argument("--cutoff", type=float, default=4.0, help="Å (fcc Cu: 18 neighbours at 4 Å)")
    ap.add_argument("--steps", type=int, default=3, help="timed training steps per run (after one warm-up)")
    ap.add_argument("--neighbor-atoms", type=int, default=108_000, help="the graph-building timing's cell size")
    ap.add_argument("--fit-sizes", type=int, nargs="+", default=[250, 500, 1000, 2000],
                    help="atoms per part of the METIS partitions the halo law is fitted on (P = 8)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="the weak-scaling runs' P")
    a = parse_args(ap, argv, atoms_per_worker=32, steps=1, neighbor_atoms=500, fit_sizes=[32], workers=[2])
    load0, t0 = os.getloadavg(), time.perf_counter()
    neighbours = neighbour_list(a.neighbor_atoms, a.cutoff)
    weak = weak_scaling(a)
    fit = fit_halo(a)
    extra = extrapolate(fit, a.cutoff)
    for r in extra:
        if r["preset"] == "small" and r["P"] in (8, 64, 256):
            print(f"[bench_atom_layout] extrapolation {r['kind']} {r['atoms']:.0e} atoms P={r['P']}: edges "
                  f"{r['edges_bytes_per_step'] / 1e9:.3f} GB, atoms {r['atoms_bytes_per_step'] / 1e9:.3f} GB "
                  f"({r['ratio']:.3f}×)")
    out = {"weak_scaling": weak, "neighbour_list": neighbours, "halo_fit": fit, "extrapolation": extra, "anchor": FAIRCHEM_ANCHOR,
           "settings": {"atoms_per_worker": a.atoms_per_worker, "cutoff": a.cutoff, "steps": a.steps,
                        "model": "dimenetpp small, gradient forces, float32", "threads_per_worker": 1},
           "machine": machine_record(load0),
           "wall_s": time.perf_counter() - t0}
    write_json(a.out, out)
    return 0 if all(r["ledger_equals_closed_form"] for r in weak) else 1


if __name__ == "__main__":
    sys.exit(main())
