"""Peak memory of a worker for one large structure: the distributed build (domains layout, #35)
against one process and the atoms layout (every worker builds the whole graph).

    python benchmarks/bench_domains.py --out results/bench/domains.json [--repeat 17] [--cutoff 3.0]
                                       [--kind dimenetpp] [--dtype float32] [--smoke]
    python benchmarks/bench_domains.py --weak 4000 --out results/bench/domains_weak.json   # weak scaling
    python benchmarks/bench_domains.py --strong 20 --out results/bench/domains_strong.json  # strong: P = 4, 8
    python benchmarks/bench_domains.py --weak 25000 --md-steps 2 ...   # and the seconds per MD step

The structure: a rattled fcc cell (an fcc metal the stand-in model knows, as bench_calculator) of ``--repeat``³ conventional cells (4 atoms each; 17: 19,652
atoms), a fresh ``small`` model of ``--kind`` without a neighbour cap (symmetric graph, as the
distributed build needs), energy + forces once. Each configuration runs in a fresh process: P = 1
(that process computes: its peak RSS), P = 2 in the atoms layout and in the domains layout (each
worker's peak RSS, ``VmHWM`` of ``/proc/<pid>/status``, read after the call; and ``VmRSS`` before it:
the P = 1 process also holds the client's imports, some 60 MB more than a worker at any size). A
domains worker is given only its region's positions (its domain and a shell of 2 cutoffs and the
skin); an atoms-layout worker the whole graph.
Then the graph build alone (no model; Cu, ``--build-cutoff`` 4.5 Å, where triplets dominate): the peak
RSS of building rank 0's view at P = 2 and 4 from the whole graph (the atoms layout's worker) and
from its region (the domains layout's), each in a fresh process above its RSS before the build.
``--smoke``: 2³ cells (32 atoms), the figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _status_mb(pid, key: str = "VmHWM") -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) / 1024


def fresh_model(kind: str, dtype: str, cutoff: float):
    """A fresh ``small`` model of ``kind`` (``modelfile.untrained_payload``, a normaliser fitted on 4 EMT
    slabs) without a neighbour cap, symmetric edges: the graphs the distributed build takes."""
    import dataclasses

    from gnnpipe.atomic import data
    from gnnpipe.atomic.modelfile import decode, untrained_payload

    systems = data.generate(4, seed=0, progress=False)
    mf = decode(untrained_payload(kind, systems, dtype=dtype, cutoff=cutoff, max_neighbors=None), f"untrained {kind}")
    return dataclasses.replace(mf, symmetric_edges=True)


def fcc_cell(mf, shape: tuple):
    """``shape`` conventional fcc cells (4 atoms each) of a metal ``mf`` knows, rattled by 0.05 Å (seed 1)."""
    from ase.build import bulk
    from ase.data import atomic_numbers, reference_states

    from gnnpipe.atomic import data

    metal = next(m for m in data.SLAB_METALS if atomic_numbers[m] in mf.elements)
    atoms = bulk(metal, "fcc", a=reference_states[atomic_numbers[metal]]["a"], cubic=True).repeat(shape)
    atoms.rattle(0.05, seed=1)
    return atoms


def one(args) -> dict:
    """One configuration in this (fresh) process: ``--workers`` and ``--layout``."""
    import numpy as np

    from gnnpipe.atomic.inference import Predictor

    mf = fresh_model(args.kind, args.dtype, args.cutoff)
    atoms = fcc_cell(mf, tuple(int(k) for k in args.shape.split(",")) if args.shape else (args.repeat,) * 3)
    with Predictor(mf, workers=args.workers, layout=args.layout, threads=1, oversubscribe=True) as p:
        pids = p.pool.pids if p.pool is not None else ["self"]
        before = [_status_mb(pid, "VmRSS") for pid in pids]
        t0 = time.perf_counter()
        out = p.predict(atoms.numbers, atoms.positions, atoms.cell.array, atoms.pbc)
        seconds = time.perf_counter() - t0
        peaks = [_status_mb(pid) for pid in pids]
        steps = md_steps(p, atoms, out.forces, args.md_steps)
    return {"workers": args.workers, "layout": args.layout if args.workers > 1 else "one process",
            "atoms": len(atoms), "energy_eV": out.energy, "max_abs_force": float(np.abs(out.forces).max()),
            "peak_rss_mb_per_worker": peaks, "peak_rss_mb_max": max(peaks),
            "rss_mb_before_call": before, "peak_above_before_mb_max": max(p - b for p, b in zip(peaks, before)),
            "s_per_call": seconds, **steps}


def md_steps(p, atoms, forces, steps: int) -> dict:
    """``steps`` velocity Verlet steps of ``atoms`` (1 fs, Maxwell-Boltzmann at 300 K, seed 0) after the
    first call (``forces``), each one call of the predictor ``p``: wall seconds per step (the median;
    the decomposition of the first call kept, as in MD while the skin rule holds), the rebuilds among
    them, and the workers' peak RSS after them."""
    import numpy as np
    from ase import units
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution

    if steps < 1:
        return {}
    MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=np.random.default_rng(0))
    m, v, dt, rebuilds, times = atoms.get_masses()[:, None], atoms.get_velocities(), units.fs, p.rebuilds, []
    pos = atoms.positions.copy()
    for _ in range(steps):
        t0 = time.perf_counter()
        v += 0.5 * dt * forces / m
        pos += dt * v
        forces = p.predict(atoms.numbers, pos, atoms.cell.array, atoms.pbc).forces
        v += 0.5 * dt * forces / m
        times.append(time.perf_counter() - t0)
    pids = p.pool.pids if p.pool is not None else ["self"]
    return {"md_steps": steps, "s_per_md_step": float(np.median(times)), "md_rebuilds": p.rebuilds - rebuilds,
            "peak_rss_mb_max_after_md": max(_status_mb(pid) for pid in pids)}


def build(args) -> dict:
    """The graph build alone of rank 0's atoms-layout view at ``--parts`` P, in this (fresh) process:
    ``--build whole`` (the atoms layout's worker: the whole graph, grouped, sharded) or ``region`` (the
    distributed build: worker 0's domain and region positions, and its collectives' results, every
    rank's boundary and needs, read from the file ``--build prep`` wrote)."""
    import pickle
    import resource

    import numpy as np
    from ase.build import bulk

    from gnnpipe.atomic import domains, halo
    from gnnpipe.atomic import neighbors as nb

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((args.repeat,) * 3)
    atoms.rattle(0.05, seed=1)
    pos, cell, pbc, z, cut = atoms.positions, atoms.cell.array, atoms.pbc, atoms.numbers, args.build_cutoff
    owner = domains.spatial_partition(pos, cell, pbc, args.parts)
    side = f"{args.out}.{args.parts}.needs.pkl"
    if args.build == "prep":  # the client's decomposition and the collectives' results, for rank 0
        dec = domains.decompose(z, pos, cell, pbc, args.parts, cut)
        regions = dec.positions(pos)
        graphs = [domains.domain_graph(d, p) for d, p in zip(dec.domains, regions)]
        bounds = [domains.boundary(g, r, dec.ab) for r, g in enumerate(graphs)]
        needs = [domains.region_needs(g, r, dec.ab, bounds).needs for r, g in enumerate(graphs)]
        with open(side, "wb") as f:
            pickle.dump((dec.domains[0], regions[0], bounds, needs), f)
        return {}
    if args.build == "whole":
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        b = {**nb.system_graph(pos, cell, pbc, cut), "z": z, "pos": pos, "system": np.zeros(len(z), np.int64),
             "num_systems": 1}
        view = halo.shard_atoms(halo.group_by_part(b, owner, args.parts), 0, None)
    else:  # what worker 0 holds and computes: its domain, its region's positions, the gathered surfaces
        del atoms, pos, z
        with open(side, "rb") as f:
            dom, region_pos, bounds, needs = pickle.load(f)
        os.remove(side)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        g = domains.domain_graph(dom, region_pos)
        view = domains.region_view(domains.region_needs(g, 0, dom.ab, bounds), needs, dom.z, region_pos, dom.ids)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"build": args.build, "workers": args.parts, "atoms": len(owner), "cutoff": cut,
            "rank0_edges": len(view.edge_src), "rank0_triplets": len(view.idx_kj), "peak_above_before_mb": peak - before}


def _run(cmd: list, cwd: str) -> dict:
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if done.returncode:
        raise SystemExit(f"bench_domains: {' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def scaling(args, here: str, load0) -> None:
    """Scaling of a worker's memory, each P in a fresh process (P = 1: one process; else the domains
    layout, oversubscribed: P processes time-share the cores, time is not the point). ``--weak``: k × k ×
    (k·P) conventional cells (4 k³ ≈ ``--weak`` atoms per worker, slabs of k³ cells) at each P of
    ``--weak-workers``; ratio of the largest worker's peak RSS to P = 1's (target at P = 4: ≤ 1.15).
    ``--strong K``: one K³-cell cube at each P of ``--strong-workers``; ratio to the first P's (target
    P = 8 over P = 4: ≤ 0.6). ``--md-steps K``: each P then times K velocity Verlet steps (``md_steps``)."""
    from gnnpipe.io import write_json
    from machine import machine_record

    k = max(1, round((args.weak / 4) ** (1 / 3)))
    runs = []
    for workers in (int(p) for p in (args.weak_workers if args.weak else args.strong_workers).split(",")):
        shape = f"{k},{k},{k * workers}" if args.weak else f"{args.strong},{args.strong},{args.strong}"
        cmd = [sys.executable, os.path.join(here, "bench_domains.py"), "--shape", shape,
               "--cutoff", str(args.cutoff), "--kind", args.kind, "--dtype", args.dtype, "--workers", str(workers),
               "--layout", "domains" if workers > 1 else "auto", "--md-steps", str(args.md_steps)]
        runs.append(_run(cmd, here))
        r = runs[-1]
        r["loadavg_after"] = os.getloadavg()
        print(f"{'weak' if args.weak else 'strong'}: {r['atoms']} atoms, P={workers} {r['layout']}: peak RSS per worker "
              f"{[round(m) for m in r['peak_rss_mb_per_worker']]} MB, {r['s_per_call']:.1f} s"
              + (f", {r['s_per_md_step']:.1f} s per MD step" if args.md_steps else ""), file=sys.stderr, flush=True)
    base, grown = runs[0]["peak_rss_mb_max"], runs[0]["peak_above_before_mb_max"]  # the first P
    out = {"kind": args.kind, "dtype": args.dtype, "cutoff": args.cutoff, "runs": runs,
           "peak_ratio": {r["workers"]: r["peak_rss_mb_max"] / base for r in runs},
           "peak_above_before_ratio": {r["workers"]: r["peak_above_before_mb_max"] / grown for r in runs},
           "machine": machine_record(load0)}
    out.update({"scaling": "weak", "atoms_per_worker": 4 * k ** 3} if args.weak else
               {"scaling": "strong", "atoms": 4 * args.strong ** 3})
    write_json(args.out, out)


def main(argv=None) -> None:
    from gnnpipe.io import write_json
    from machine import machine_record
    from smoke import parse_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/bench/domains.json")
    ap.add_argument("--repeat", type=int, default=17, help="conventional fcc cells per axis (4 atoms each)")
    ap.add_argument("--cutoff", type=float, default=3.0)
    ap.add_argument("--kind", default="dimenetpp")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)  # one configuration (internal)
    ap.add_argument("--layout", default="domains", help=argparse.SUPPRESS)
    ap.add_argument("--md-steps", type=int, default=0,
                    help="with --weak / --strong: after the call, this many velocity Verlet steps (1 fs, 300 K), "
                         "timed: seconds per MD step (default %(default)s: none)")
    ap.add_argument("--build-cutoff", type=float, default=4.5, help="the graph-build comparison's cutoff (Å)")
    ap.add_argument("--build", help=argparse.SUPPRESS)  # prep / whole / region (internal)
    ap.add_argument("--parts", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)  # conventional cells along x,y,z (internal)
    ap.add_argument("--weak", type=int, default=0,
                    help="weak scaling instead: about this many atoms per worker at P = 1, 2, 4 (domains layout)")
    ap.add_argument("--weak-workers", default="1,2,4", help="the P of --weak (first: the ratios' base; may exceed the cores)")
    ap.add_argument("--strong", type=int, default=0,
                    help="strong scaling instead: one cube of this many conventional cells per axis at --strong-workers")
    ap.add_argument("--strong-workers", default="4,8", help="the P of --strong (first: the ratios' base)")
    args = parse_args(ap, argv, repeat=2, md_steps=1)
    if args.workers or args.build:
        print(json.dumps(one(args) if args.workers else build(args)))
        return
    load0 = os.getloadavg()
    here = os.path.dirname(os.path.abspath(__file__))
    if args.weak or args.strong:
        return scaling(args, here, load0)
    runs = []
    for workers, layout in ((1, "auto"), (2, "atoms"), (2, "domains")):
        cmd = [sys.executable, os.path.join(here, "bench_domains.py"), "--repeat", str(args.repeat), "--cutoff",
               str(args.cutoff), "--kind", args.kind, "--dtype", args.dtype, "--workers", str(workers),
               "--layout", layout, "--md-steps", str(args.md_steps)]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=here)
        if done.returncode:
            raise SystemExit(f"bench_domains: {' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = runs[-1]
        print(f"{r['atoms']} atoms, P={workers} {r['layout']}: peak RSS per worker {r['peak_rss_mb_per_worker']} MB, "
              f"{r['s_per_call']:.1f} s, E {r['energy_eV']:.6f} eV", file=sys.stderr, flush=True)
    builds = []
    for parts in (2,) if args.smoke else (2, 4):
        for what in ("prep", "whole", "region"):
            cmd = [sys.executable, os.path.join(here, "bench_domains.py"), "--repeat", str(args.repeat),
                   "--build-cutoff", str(args.build_cutoff), "--out", os.path.abspath(args.out), "--build", what,
                   "--parts", str(parts)]
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=here)
            if done.returncode:
                raise SystemExit(f"bench_domains: {' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
            if what != "prep":
                builds.append(json.loads(done.stdout.strip().splitlines()[-1]))
                r = builds[-1]
                print(f"graph build of rank 0 of P={parts}, {r['build']}: {r['rank0_edges']} edges, {r['rank0_triplets']} "
                      f"triplets, peak {r['peak_above_before_mb']:.0f} MB above the process before it", file=sys.stderr)
    base = runs[0]["peak_rss_mb_max"]
    grown = runs[0]["peak_above_before_mb_max"]
    out = {"kind": args.kind, "dtype": args.dtype, "cutoff": args.cutoff, "runs": runs,
           "peak_ratio_P2_over_P1": {r["layout"]: r["peak_rss_mb_max"] / base for r in runs[1:]},
           "peak_above_before_ratio_P2_over_P1": {r["layout"]: r["peak_above_before_mb_max"] / grown for r in runs[1:]},
           "graph_build": builds,
           "machine": machine_record(load0)}
    write_json(args.out, out)


if __name__ == "__main__":
    main()
