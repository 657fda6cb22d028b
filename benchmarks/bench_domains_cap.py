"""One structure too large for one worker's memory, computed across P workers under the same cap
(issue #35's capped-memory demonstration, in the shape of #22's for training).

    sudo .venv/bin/python benchmarks/bench_domains_cap.py --out results/bench/domains_cap.json \
        [--repeat 17] [--cap-mib 1536] [--workers 1,2,4,8]
    .venv/bin/python benchmarks/bench_domains_cap.py --out /tmp/domains_cap.json --smoke   # no root, no cap

The structure: a rattled fcc cube of ``--repeat``³ conventional cells (17: 19,652 atoms), the fresh
``small`` model of ``--kind`` of benchmarks/bench_domains.py (cutoff ``--cutoff``, no neighbour cap),
energy + forces once, in the ``domains`` layout (each worker builds and holds only its region). Each
worker gets a memory of its own, as each GPU has: a cgroup (v1) per worker with
``memory.limit_in_bytes`` = ``--cap-mib`` (``gnnpipe.launch.cap_workers``). The inference workers are
started by the Predictor, so each is moved into its cgroup once it is up (its model built), before the
call: what the cap judges is what the worker touches after joining — its region, graph, activations
and gradients — not the pages of torch's import it shares with the fork server or the model's weights
(tens of MB; this kernel refuses ``memory.move_charge_at_immigrate``, so they stay charged where they
were touched). At P = 1 the benchmark's process computes and joins rank-0's cgroup at the same point.
The client process (the caller of the calculator: it holds the structure,
12 bytes an atom, and splits it) is not capped. For each P of ``--workers``, in a fresh process:

1. the estimate: ``gnnpipe plan-atomic --structure``'s per-worker peak (``DomainsLayout.costs``) less
   the RSS before the call it includes — the part the cap judges;
2. the call under the cap: the energy, or the worker the cap killed (the Predictor's one line);
   per worker ``memory.max_usage_in_bytes`` (what the cap judges) and its peak RSS (``VmHWM``).

The result: the fewest workers that computed under the cap, and that P's energy against the largest
P's (float32: equal to rounding, |ΔE| / |E| below 1e-5). Needs root and cgroup v1 (this machine's);
without them it stops in one line. Takes minutes on 2 busy cores (P up to 8 oversubscribes them: time
is not the point). ``--smoke`` needs no root: 2³ cells, P = 1 and 2, no cgroup (usages empty).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

FLOAT32_RTOL = 1e-5


def _structure(args):
    """The model file and the cube, as bench_domains builds them (the same seeds)."""
    from bench_domains import fcc_cell, fresh_model

    mf = fresh_model(args.kind, args.dtype, args.cutoff)
    return mf, fcc_cell(mf, (args.repeat,) * 3)


def estimate(mf, atoms, workers: int, dtype: str) -> float:
    """``plan-atomic --structure``'s figure less the RSS a worker has before the call
    (``DomainsLayout.WORKER_RSS``): the largest worker's growth during the call at ``workers``, MB —
    what the cap judges here."""
    from gnnpipe.atomic.atom_layouts import DOMAINS
    from gnnpipe.atomic.protocol import ATOMIC_MODELS

    b = {"z": atoms.numbers, "pos": atoms.positions, "cell": atoms.cell.array, "pbc": atoms.pbc, "cutoff": mf.cutoff}
    c = DOMAINS.costs(ATOMIC_MODELS[mf.kind], mf.config(), b, workers, 4 if dtype == "float32" else 8)
    return c["memory"] / 2**20


def one(args) -> dict:
    """One P in this (fresh) process; its workers join ``--cgroup``'s rank-<r> once started."""
    import numpy as np

    from bench_domains import _status_mb
    from gnnpipe.atomic.inference import Predictor
    from gnnpipe.io import GnnPipeError

    mf, atoms = _structure(args)
    out = {"workers": args.workers, "atoms": len(atoms), "estimate_call_mb": estimate(mf, atoms, args.workers, args.dtype)}
    top = Path(args.cgroup) if args.cgroup else None
    with Predictor(mf, workers=args.workers, layout="domains", threads=1, oversubscribe=True) as p:
        pids = p.pool.pids if p.pool is not None else [os.getpid()]  # one worker: this process computes
        if top is not None:  # each worker joins its cgroup once up (its model built), before the call
            for r, pid in enumerate(pids):
                (top / f"rank-{r}" / "cgroup.procs").write_text(str(pid))
        t0 = time.perf_counter()
        try:
            res = p.predict(atoms.numbers, atoms.positions, atoms.cell.array, atoms.pbc)
            out.update(computed=True, energy_eV=res.energy, max_abs_force=float(np.abs(res.forces).max()),
                       peak_rss_mb_per_worker=[_status_mb(pid) for pid in pids])
        except GnnPipeError as e:
            out.update(computed=False, refusal=str(e))
        out["s_per_call"] = time.perf_counter() - t0
    return out


def main(argv=None) -> None:
    from gnnpipe.io import write_json
    from machine import machine_record
    from smoke import parse_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/bench/domains_cap.json")
    ap.add_argument("--repeat", type=int, default=17, help="conventional fcc cells per axis (4 atoms each)")
    ap.add_argument("--cutoff", type=float, default=3.0)
    ap.add_argument("--kind", default="dimenetpp")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cap-mib", type=int, default=1536, help="each worker's memory cap, MiB")
    ap.add_argument("--workers", default="1,2,4,8", help="the P to try, each under the cap (last: the reference)")
    ap.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)  # one P in a fresh process (internal)
    ap.add_argument("--cgroup", help=argparse.SUPPRESS)  # its workers' cgroups (internal)
    args = parse_args(ap, argv, repeat=2, workers="1,2")
    if args.one:
        args.workers = args.one
        print(json.dumps(one(args)))
        return
    from gnnpipe.io import GnnPipeError
    from gnnpipe.launch import cap_workers, uncap_workers

    load0 = os.getloadavg()
    here = os.path.dirname(os.path.abspath(__file__))
    limit = None if args.smoke else args.cap_mib * 2**20
    runs = []
    for workers in (int(p) for p in args.workers.split(",")):
        try:
            top = None if args.smoke else cap_workers(limit, workers)
        except GnnPipeError as e:  # not root, or no cgroup v1
            raise SystemExit(f"bench_domains_cap: {e}") from None
        try:
            cmd = [sys.executable, os.path.join(here, "bench_domains_cap.py"), "--one", str(workers), "--repeat",
                   str(args.repeat), "--cutoff", str(args.cutoff), "--kind", args.kind, "--dtype", args.dtype]
            done = subprocess.run(cmd + (["--cgroup", str(top)] if top else []), capture_output=True, text=True,
                                  cwd=here)
            if top is not None and done.returncode in (-9, 137):  # P = 1: the process that computes, killed
                run = {"workers": workers, "atoms": 4 * args.repeat ** 3, "computed": False,
                       "refusal": f"the worker was killed by the cap (exit {done.returncode})"}
            elif done.returncode:
                raise SystemExit(f"bench_domains_cap: {' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
            else:
                run = json.loads(done.stdout.strip().splitlines()[-1])
            if top is not None:  # what the cap judged: pages each worker touched, its own and moved in
                run["cgroup_max_usage_mb_per_worker"] = [
                    int((top / f"rank-{r}" / "memory.max_usage_in_bytes").read_text()) / 2**20 for r in range(workers)]
            runs.append({**run, "loadavg_after": os.getloadavg()})
        finally:
            if top is not None:
                uncap_workers(top)
        r = runs[-1]
        what = f"E {r['energy_eV']:.4f} eV" if r["computed"] else f"not computed: {r['refusal']}"
        if "estimate_call_mb" not in r:  # killed before it printed: the estimate from here
            mf, atoms = _structure(args)
            r["estimate_call_mb"] = estimate(mf, atoms, workers, args.dtype)
        print(f"{r['atoms']} atoms, P={workers} {'uncapped (smoke)' if args.smoke else f'under {args.cap_mib} MiB a worker'}: estimate (the call) {r['estimate_call_mb']:.0f} MB, "
              f"used {[round(m) for m in r.get('cgroup_max_usage_mb_per_worker', [])]} MB, {what}", file=sys.stderr,
              flush=True)
    done_runs = [r for r in runs if r["computed"]]
    ref = done_runs[-1] if done_runs else None
    fewest = done_runs[0] if done_runs else None
    out = {"kind": args.kind, "dtype": args.dtype, "cutoff": args.cutoff, "atoms": runs[0]["atoms"],
           "cap_mib": None if args.smoke else args.cap_mib, "runs": runs,
           "fewest_workers_computed": fewest["workers"] if fewest else None,
           "reference_workers": ref["workers"] if ref else None,
           "energy_rel_diff_fewest_vs_reference": (abs(fewest["energy_eV"] - ref["energy_eV"]) / abs(ref["energy_eV"])
                                                  if fewest else None),
           "machine": machine_record(load0)}
    if fewest and not args.smoke and out["energy_rel_diff_fewest_vs_reference"] > FLOAT32_RTOL:
        print(f"bench_domains_cap: P={fewest['workers']} and P={ref['workers']} energies differ by more than "
              f"float32 rounding ({out['energy_rel_diff_fewest_vs_reference']:.2e})", file=sys.stderr)
    write_json(args.out, out)


if __name__ == "__main__":
    main()
