"""NVE molecular dynamics of one large cell with the ASE calculator in the domains layout (#35):
the trajectory at ``workers = 2`` against ``workers = 1`` (the same to float64 rounding?), the
Verlet-skin rebuild count, and the time per MD step.

    python benchmarks/bench_md.py --out results/bench/md.json [--atoms 10000] [--steps 200] [--workers 1,2]
                                  [--temperature 300] [--timestep 1.0] [--skin 1.0] [--dtype float64] [--smoke]

The system: a cube of k³ rattled fcc conventional cells (4 k³ ≈ ``--atoms``; 10,000: k = 14, 10,976
atoms; ``bench_domains.fcc_cell``), a fresh ``small`` DimeNet++ (``--kind``; untrained, a normaliser
fitted on EMT slabs, ``bench_domains.fresh_model``: the equality across workers does not depend
on training) without a neighbour cap, cutoff ``--cutoff`` 3 Å, ``--dtype`` float64. Velocities
Maxwell-Boltzmann at ``--temperature`` (seed 0, no net momentum), ASE's velocity Verlet at
``--timestep`` fs for ``--steps`` steps. Each P of ``--workers`` runs in a fresh process with one
torch thread per worker (P = 1: the calculator computes in that process; P > 1: the domains
layout, its regions kept until an atom moved ``--skin / 2`` since the last decomposition); the
positions and energies of every step are compared with the first P's: the largest |Δ position|,
|Δ potential energy| and |Δ total energy| over the whole trajectory. Time: the first call (the
model's and the first decomposition's cost) apart, then wall seconds per step and the CPU seconds
of the client and its workers (``/proc/<pid>/stat``), with the load average.
``--together``: the P's run at the same time (on a machine shared with others, to get more of
its cores; each one's time then includes the others'). ``--smoke``: 2³ cells (32 atoms), 3 steps:
the figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def _cpu_s(pid) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def trajectory(args) -> dict:
    """One NVE run at ``--workers`` P in this (fresh) process; its positions and energies per step to
    ``--trajectory`` (npz), its figures returned."""
    import numpy as np
    from ase import units
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary
    from ase.md.verlet import VelocityVerlet

    from bench_domains import fcc_cell, fresh_model
    from gnnpipe.ase import GNNPipeCalculator

    mf = fresh_model(args.kind, args.dtype, args.cutoff)
    k = max(1, round((args.atoms / 4) ** (1 / 3)))
    atoms = fcc_cell(mf, (k, k, k))
    MaxwellBoltzmannDistribution(atoms, temperature_K=args.temperature, rng=np.random.default_rng(0))
    Stationary(atoms)
    start = atoms.positions.copy()
    layout = "domains" if args.workers > 1 else "auto"
    with GNNPipeCalculator(mf, workers=args.workers, layout=layout, skin=args.skin, threads=1) as calc:
        atoms.calc = calc
        pids = calc.predictor.pool.pids if calc.predictor.pool is not None else []
        t0 = time.perf_counter()
        epot, ekin, pos = [atoms.get_potential_energy()], [atoms.get_kinetic_energy()], [atoms.positions.copy()]
        first = time.perf_counter() - t0
        cpu0 = [resource.getrusage(resource.RUSAGE_SELF)] + [_cpu_s(p) for p in pids]
        dyn = VelocityVerlet(atoms, timestep=args.timestep * units.fs, logfile=None)
        dyn.attach(lambda: (epot.append(atoms.get_potential_energy()), ekin.append(atoms.get_kinetic_energy()),
                            pos.append(atoms.positions.copy())))
        t0 = time.perf_counter()
        dyn.run(args.steps)
        wall = time.perf_counter() - t0
        me = resource.getrusage(resource.RUSAGE_SELF)
        client_cpu = me.ru_utime + me.ru_stime - cpu0[0].ru_utime - cpu0[0].ru_stime
        workers_cpu = [_cpu_s(p) - c for p, c in zip(pids, cpu0[1:])]
        rebuilds = calc.rebuilds
    np.savez(args.trajectory, positions=np.array(pos), epot=np.array(epot), ekin=np.array(ekin))
    etot = np.array(epot) + np.array(ekin)
    return {"workers": args.workers, "layout": layout if args.workers > 1 else "one process", "atoms": len(atoms),
            "steps": args.steps, "rebuilds": rebuilds, "first_call_s": first, "s_per_step": wall / args.steps,
            "client_cpu_s_per_step": client_cpu / args.steps,
            "workers_cpu_s_per_step": [c / args.steps for c in workers_cpu],
            "max_displacement_A": float(np.linalg.norm(pos[-1] - start, axis=1).max()),
            "energy_drift_eV": float(etot[-1] - etot[0]), "energy_span_eV": float(np.ptp(etot)),
            "loadavg_after": list(os.getloadavg())}


def main(argv=None) -> None:
    import numpy as np

    from gnnpipe.io import write_json
    from machine import machine_record
    from smoke import parse_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/bench/md.json")
    ap.add_argument("--atoms", type=int, default=10000, help="about this many atoms (4 k³: a cube of k³ fcc cells)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--workers", default="1,2", help="the P compared (the first: the reference trajectory)")
    ap.add_argument("--temperature", type=float, default=300.0, help="K, the initial Maxwell-Boltzmann velocities")
    ap.add_argument("--timestep", type=float, default=1.0, help="fs")
    ap.add_argument("--skin", type=float, default=1.0, help="Å, the domains layout's Verlet skin")
    ap.add_argument("--cutoff", type=float, default=3.0)
    ap.add_argument("--kind", default="dimenetpp")
    ap.add_argument("--dtype", default="float64")
    ap.add_argument("--together", action="store_true",
                    help="run the P's at the same time (each one's time then includes the others' load)")
    ap.add_argument("--trajectory", help=argparse.SUPPRESS)  # one P's run (internal): its npz
    args = parse_args(ap, argv, atoms=32, steps=3)
    if args.trajectory:
        args.workers = int(args.workers)
        print(json.dumps(trajectory(args)))
        return
    load0 = os.getloadavg()
    here = os.path.dirname(os.path.abspath(__file__))
    runs, traj = [], []
    with tempfile.TemporaryDirectory() as tmp:
        started = []
        for workers in (int(p) for p in args.workers.split(",")):
            npz = os.path.join(tmp, f"p{workers}.npz")
            cmd = [sys.executable, os.path.join(here, "bench_md.py"), "--trajectory", npz, "--workers", str(workers),
                   "--atoms", str(args.atoms), "--steps", str(args.steps), "--temperature", str(args.temperature),
                   "--timestep", str(args.timestep), "--skin", str(args.skin), "--cutoff", str(args.cutoff),
                   "--kind", args.kind, "--dtype", args.dtype]
            started.append((cmd, npz, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                       cwd=here)))
            if not args.together:
                started[-1][2].wait()
        for cmd, npz, proc in started:
            out, err = proc.communicate()
            if proc.returncode:
                raise SystemExit(f"bench_md: {' '.join(cmd)} failed:\n{err[-2000:]}")
            runs.append(json.loads(out.strip().splitlines()[-1]))
            with np.load(npz) as z:
                traj.append({k: z[k] for k in z.files})
            r = runs[-1]
            print(f"{r['atoms']} atoms, P={r['workers']} {r['layout']}: {r['steps']} steps, "
                  f"{r['s_per_step']:.2f} s a step, "
                  f"{r['rebuilds']} rebuilds, drift {r['energy_drift_eV']:.3g} eV", file=sys.stderr, flush=True)
    ref = traj[0]
    for r, t in zip(runs[1:], traj[1:]):  # against the first P, over every step
        r["max_abs_dpos_A"] = float(np.abs(t["positions"] - ref["positions"]).max())
        r["max_abs_depot_eV"] = float(np.abs(t["epot"] - ref["epot"]).max())
        r["max_abs_detot_eV"] = float(np.abs(t["epot"] + t["ekin"] - ref["epot"] - ref["ekin"]).max())
        print(f"P={r['workers']} vs P={runs[0]['workers']}: max |Δpos| {r['max_abs_dpos_A']:.3g} Å, max |ΔE_pot| "
              f"{r['max_abs_depot_eV']:.3g} eV, max |ΔE_tot| {r['max_abs_detot_eV']:.3g} eV", file=sys.stderr)
    write_json(args.out, {"together": args.together, "kind": args.kind, "dtype": args.dtype, "cutoff": args.cutoff,
                          "skin_A": args.skin, "temperature_K": args.temperature, "timestep_fs": args.timestep,
                          "runs": runs,
                          "machine": machine_record(load0)})


if __name__ == "__main__":
    main()
