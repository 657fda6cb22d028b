"""The ASE calculator across workers: a 200-step NVE run at N = 1 and N = 2 (same trajectory? energy
drift?) and the time of one call at N = 1, 2, 4.

    python benchmarks/bench_calculator.py --out results/bench/calculator.json [--run results/runs/<id>]
                                          [--steps 200] [--kind dimenetpp] [--quick | --smoke]

Without ``--run``, a fresh ``small`` model of ``--kind`` with a normaliser fitted on EMT slabs
(``modelfile.untrained_payload``, float64) stands in for a trained one: the equality across
workers and the drift of a velocity Verlet integrator with energy-conserving forces do not
depend on training. The NVE system is a rattled fcc cell of a metal the model knows (3x3x3
conventional cells, 108 atoms; ``--quick``: 2x2x2), 1 fs steps from 300 K; the timing system
is the same cell. ``--smoke``: the quick cell, a normaliser fitted on 4 slabs, 3 steps, one timed
call at N = 1 and 2.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch


def _model(args, fit_systems: int):
    from gnnpipe.atomic import data
    from gnnpipe.atomic.modelfile import decode, load_model_file, untrained_payload
    if args.run:
        return load_model_file(args.run)
    systems = data.generate(fit_systems, seed=0, progress=False)
    return decode(untrained_payload(args.kind, systems), f"untrained {args.kind}")


def _cell(mf, repeat: int):
    from ase.build import bulk
    from ase.data import atomic_numbers, reference_states

    from gnnpipe.atomic.data import SLAB_METALS
    metal = next(m for m in SLAB_METALS if atomic_numbers[m] in mf.elements)
    atoms = bulk(metal, "fcc", a=reference_states[atomic_numbers[metal]]["a"], cubic=True).repeat((repeat,) * 3)
    atoms.rattle(0.05, seed=1)
    return atoms


def nve(mf, repeat: int, steps: int, workers: int) -> dict:
    from ase import units
    from ase.md.velocitydistribution import thermalize_momenta
    from ase.md.verlet import VelocityVerlet

    from gnnpipe.ase import GNNPipeCalculator
    atoms = _cell(mf, repeat)
    thermalize_momenta(atoms, 300, rng=np.random.default_rng(0))
    with GNNPipeCalculator(mf, workers=workers) as calc:
        atoms.calc = calc
        energies, positions = [atoms.get_total_energy()], [atoms.positions.copy()]
        dyn = VelocityVerlet(atoms, timestep=1.0 * units.fs, logfile=None)
        dyn.attach(lambda: (energies.append(atoms.get_total_energy()), positions.append(atoms.positions.copy())))
        t0 = time.perf_counter()
        dyn.run(steps)
        wall = time.perf_counter() - t0
    e = np.array(energies)
    return {"workers": workers, "atoms": len(atoms), "steps": steps, "s_per_step": wall / steps,
            "energy_drift_eV": float(e[-1] - e[0]), "energy_span_eV": float(np.ptp(e)),
            "energy_drift_meV_per_atom": float((e[-1] - e[0]) / len(atoms) * 1e3), "_positions": np.array(positions)}


def call_time(mf, repeat: int, workers: int, calls: int = 5) -> dict:
    from gnnpipe.ase import GNNPipeCalculator
    atoms = _cell(mf, repeat)
    with GNNPipeCalculator(mf, workers=workers) as calc:
        times = []
        for i in range(calls + 1):
            atoms.positions += np.random.default_rng(i).normal(scale=0.005, size=atoms.positions.shape)
            t0 = time.perf_counter()
            calc.get_forces(atoms)
            times.append(time.perf_counter() - t0)
    return {"workers": workers, "atoms": len(atoms), "s_per_call_median": float(np.median(times[1:]))}


def main(argv=None) -> None:
    from gnnpipe.io import write_json
    from smoke import parse_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/bench/calculator.json")
    ap.add_argument("--run", help="a run directory or model file (default: an untrained stand-in)")
    ap.add_argument("--kind", default="dimenetpp")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="2x2x2 cells, 50 steps")
    args = parse_args(ap, argv, quick=True, steps=3)
    torch.set_num_threads(1)
    repeat, steps = (2, min(args.steps, 50)) if args.quick else (3, args.steps)
    mf = _model(args, 4 if args.smoke else 16)
    runs = [nve(mf, repeat, steps, w) for w in (1, 2)]
    diff = float(np.abs(runs[1].pop("_positions") - runs[0].pop("_positions")).max())
    from gnnpipe.atomic.inference import cpu_cores
    workers = (1, 2) if args.smoke else (1, 2, 4)
    timing = [call_time(mf, repeat, w, 1 if args.smoke else 5) for w in workers if w <= cpu_cores()]  # more are refused
    out = {"model": mf.source, "kind": mf.kind, "dtype": mf.dtype, "nve": runs,
           "max_position_difference_N1_N2_A": diff, "call_time": timing}
    for r in runs:
        print(f"NVE {r['atoms']} atoms, {r['steps']} x 1 fs, N={r['workers']}: drift {r['energy_drift_eV']:+.2e} eV "
              f"({r['energy_drift_meV_per_atom']:+.2e} meV/atom), span {r['energy_span_eV']:.2e} eV, "
              f"{r['s_per_step'] * 1e3:.0f} ms/step", file=sys.stderr)
    print(f"trajectories N=1 vs N=2: max |Δpos| {diff:.1e} Å", file=sys.stderr)
    for t in timing:
        print(f"one call, {t['atoms']} atoms, N={t['workers']}: {t['s_per_call_median'] * 1e3:.0f} ms", file=sys.stderr)
    write_json(args.out, out)


if __name__ == "__main__":
    main()
