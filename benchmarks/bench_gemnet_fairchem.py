"""Our GemNet-T/-dT training step against fairchem's ``gemnet_t``: time and memory kept for backward.

    python benchmarks/bench_gemnet_fairchem.py [--out results/bench/gemnet_fairchem.json] [--quick]
    python benchmarks/bench_gemnet_fairchem.py --fairchem-src /tmp/fc/src   # with fairchem's side, as ratios
    python benchmarks/bench_gemnet_fairchem.py --out /tmp/g.json --smoke    # tiny, one step

One training step — forward, forces (GemNet-T: ``-dE/dpos`` with ``create_graph=True``; GemNet-dT: the
direct head), backward of ``sum(E²) + sum(F²)`` — one thread, float32, on rattled Cu (issue #34,
"Performance"; the goal there: ours ≤ 0.8× fairchem's step time and ≤ 0.9× its saved activations):

* ``small-T`` / ``small-dT``: the ``small`` preset's widths on a 4×4-cell, 4-layer Cu(111) slab (64 atoms);
* ``default-T`` / ``default-dT``: the ``default`` preset (fairchem's gp-gemnet-dT.yml) on 2×2×2 cubic
  fcc Cu (32 atoms);
* ``smoke`` (``--smoke``'s): tiny widths on 4 atoms of Cu.

Edges: cutoff 6 Å, 50 neighbours, fairchem's convention (``atomic.neighbors``, ``convention=fairchem``).

Without ``--fairchem-src`` only our step is measured (its CPU and wall seconds and saved bytes). With
``--fairchem-src DIR`` — a scratch checkout of fairchem-core's ``src`` at commit 05b9595a where
``fairchem.core.models.gemnet`` imports (torch_scatter and torch_sparse installed, or stand-ins on
the same path; fairchem's ``GraphModelMixin.generate_graph`` replaced by one that returns
``data.make_graph(data)``: this benchmark hands it our edges) — fairchem's model is built with the
same sizes, its weights (random, perturbed; scale factors random) imported into ours by
``gnnpipe.atomic.fairchem.import_checkpoint`` (what ``gnnpipe import-model`` runs), and one float64
step of each is checked to give the same energies and forces (to 1e-9 of their largest magnitude)
before either is timed. No fairchem code is in this repository.

Timing alternates the two models in one process (ours first in odd repeats) and takes medians of
each step's CPU time (``time.process_time``: one thread, what the step computes, not how long a shared
machine kept it waiting), wall-clock medians too; the ratio is what to read. Memory kept for
backward: bytes of the distinct storages autograd saves during the step (``saved_tensors_hooks``),
parameters excluded (bench_dimenet_pyg's measure).

The floor under either step (``big_products``): the step's dense products of the dominant shape, edge
rows by the edge width by the edge width (forward and input-gradient ``(E, Ed) @ (Ed, Ed)``, weight
gradient ``(Ed, E) @ (E, Ed)``), counted in one profiled step of each model, each at this core's best
time for that product alone (best of 20, operands warm), by the library that ran it in the step (MKL,
or oneDNN for our float32 Denses' forward and input-gradient products): what those products cost if
nothing else ran and every one ran as fast as it can here. ``floor_over_fairchem`` is ours over fairchem's median step:
no eager step of ours can be a smaller fraction of fairchem's than that, whatever else is made faster.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

from bench_dimenet_pyg import bootstrap_ci, interleaved, saved_bytes
from gnnpipe.atomic import neighbors as nb
from gnnpipe.atomic.fairchem import GEMNET_SIZES, import_checkpoint
from gnnpipe.atomic.gemnet import GemNetT, GemNetTConfig, preset
from gnnpipe.atomic.parallel import single_graph
from gnnpipe.io import write_json
from gnnpipe.models import ops
from machine import machine_record
from smoke import parse_args

CUTOFF, MAX_NEIGHBORS = 6.0, 50
#: name: (model sizes, structure, timed steps per model by default)
SIZES = {
    "small-T": (dict(preset="small"), "slab", 20),
    "small-dT": (dict(preset="small", force_head="direct"), "slab", 20),
    "default-T": (dict(preset="default", force_head="gradient"), "bulk", 12),
    "default-dT": (dict(preset="default"), "bulk", 12),
}
SMOKE = {"smoke": (dict(preset="small", num_spherical=3, num_radial=4, num_blocks=1, emb_size_edge=8,
                        emb_size_atom=8), "tiny", 1)}


def copper(kind: str, seed: int = 0) -> dict:
    """Rattled Cu (σ 0.05 Å) and its symmetric graph as a one-system batch (``single_graph``'s dict)."""
    from ase.build import bulk, fcc111

    if kind == "slab":
        atoms = fcc111("Cu", size=(4, 4, 4), vacuum=6.0, periodic=True)
    else:
        atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((2, 2, 2) if kind == "bulk" else (1, 1, 1))
    atoms.rattle(0.05, seed=seed)
    pos, cell, pbc = atoms.positions, np.asarray(atoms.cell), atoms.pbc
    g = nb.system_graph(pos, cell, pbc, CUTOFF, MAX_NEIGHBORS, convention="fairchem")
    n = len(atoms)
    return {"z": atoms.numbers, "pos": pos, "cell": cell, "system": np.zeros(n, np.int64), "num_systems": 1, **g}


def _config(spec: dict) -> GemNetTConfig:
    spec = {"cutoff": CUTOFF, **spec}
    return preset(spec.pop("preset"), **spec)


# --------------------------------------------------------------------------- our step
def our_step(model: GemNetT, b: dict, dtype):
    """One training step of ours on batch ``b``: a closure returning (energies, forces). Positions do not
    require grad (GemNet-T differentiates a leaf copy; GemNet-dT's training step needs no gradient in them)."""
    g = single_graph(b, dtype)

    def step():
        out = model(g)
        e, f = out["energy"], out["forces"]
        (e.pow(2).sum() + f.pow(2).sum()).backward()
        return e.detach(), f.detach()

    return step


# --------------------------------------------------------------------------- fairchem's side
def fairchem_model(cfg: GemNetTConfig, src: str):
    """fairchem's ``GemNetT`` with ``cfg``'s sizes and perturbed weights, and its fairchem config section."""
    if src not in sys.path:
        sys.path.insert(0, src)
    from fairchem.core.models.gemnet import GemNetT as FairchemGemNetT
    from fairchem.core.modules.scaling import ScaleFactor

    attrs = {k: getattr(cfg, k) for k in GEMNET_SIZES}
    attrs.update(max_neighbors=MAX_NEIGHBORS, otf_graph=True, direct_forces=cfg.force_head == "direct",
                 regress_forces=True, activation="silu", envelope={"name": "polynomial", "exponent": cfg.envelope_exponent})
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # its constants (basis offsets, widths) are made in the default dtype
    try:
        m = FairchemGemNetT(**attrs)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for p in m.parameters():
            if p.requires_grad:
                p.add_(0.02 * torch.randn_like(p))
        for sf in (x for x in m.modules() if isinstance(x, ScaleFactor)):
            sf.scale_factor.fill_(0.5 + torch.rand(()).item())
    return m, {"name": "gemnet_t", **attrs}


def ours_from(ref, attrs: dict) -> GemNetT:
    """Our model holding ``ref``'s weights, imported as ``gnnpipe import-model`` imports a checkpoint."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fairchem.pt"
        torch.save({"state_dict": ref.state_dict(), "config": {"model": attrs}}, path)
        payload, _ = import_checkpoint(path)
    model = GemNetT(GemNetTConfig(**payload["model_config"])).double()
    model.load_state_dict(payload["state_dict"])
    return model


def fairchem_step(ref, b: dict, dtype):
    """One training step of fairchem's model on ``b``'s edges: a closure returning (energies, forces)
    (its GemNet-T sets ``pos.requires_grad``; its GemNet-dT does not)."""
    src, dst = torch.as_tensor(b["edge_src"]), torch.as_tensor(b["edge_dst"])
    shift = torch.as_tensor(b["edge_shift"], dtype=dtype)
    image = torch.as_tensor(np.rint(b["edge_shift"] @ np.linalg.inv(b["cell"])).astype(np.int64))
    pos0, z = torch.as_tensor(b["pos"], dtype=dtype), torch.as_tensor(b["z"])

    def make_graph(data):  # fairchem's vectors: pos[row] - pos[col] + offset
        vec = data.pos[src] - data.pos[dst] + shift
        return types.SimpleNamespace(edge_index=torch.stack([src, dst]), edge_distance=vec.norm(dim=-1),
                                     edge_distance_vec=vec, cell_offsets=image, offset_distances=shift,
                                     neighbors=torch.tensor([len(src)]))

    def step():
        d = types.SimpleNamespace(pos=pos0.clone(), atomic_numbers=z, natoms=torch.tensor([len(z)]),
                                  batch=torch.zeros(len(z), dtype=torch.long), make_graph=make_graph)
        out = ref(d)
        e, f = out["energy"].reshape(-1), out["forces"]
        (e.pow(2).sum() + f.pow(2).sum()).backward()
        return e.detach(), f.detach()

    return step


def check_same(a: tuple, b: tuple, tol: float = 1e-9) -> None:
    for name, x, y in zip(("energy", "forces"), a, b):
        err, scale = float((x - y).abs().max()), float(y.abs().max())
        if err > tol * max(scale, 1.0):
            raise AssertionError(f"ours and fairchem's differ in {name}: {err:.3g} (largest {scale:.3g})")


def measure(spec: dict, structure: str, repeats: int, fairchem_src: str | None, warmup: int = 1,
            dtype=torch.float32) -> dict:
    """One size: our step (and fairchem's, with ``fairchem_src``): medians, saved bytes, ratios."""
    cfg = _config(spec)
    b = copper(structure)
    if fairchem_src:
        ref, attrs = fairchem_model(cfg, fairchem_src)
        ours = ours_from(ref, attrs)
        check_same(our_step(ours, b, torch.float64)(), fairchem_step(ref, b, torch.float64)())
        ours, ref = ours.to(dtype), ref.to(dtype)
        steps = {"ours": (our_step(ours, b, dtype), ours), "fairchem": (fairchem_step(ref, b, dtype), ref)}
    else:
        torch.manual_seed(0)
        ours = GemNetT(cfg).to(dtype)
        steps = {"ours": (our_step(ours, b, dtype), ours)}
    load_before = os.getloadavg()
    mem = {k: saved_bytes(step, model) for k, (step, model) in steps.items()}
    cpu, wall = interleaved(steps, repeats, warmup)
    med = {k: statistics.median(v) for k, v in cpu.items()}
    res = {"structure": structure, "atoms": int(len(b["z"])), "edges": int(len(b["edge_src"])),
           "triplets": int(len(b["idx_kj"])), "model": vars(cfg), "repeats": repeats,
           "parameters": sum(p.numel() for p in ours.parameters()), "saved_bytes": mem, "cpu_median_s": med,
           "wall_median_s": {k: statistics.median(v) for k, v in wall.items()},
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "step_cpu_s": cpu, "step_wall_s": wall}
    res["big_products"] = big_products(steps, res["edges"], cfg.emb_size_edge)
    if fairchem_src:
        res["big_products"]["floor_over_fairchem"] = res["big_products"]["ours"]["floor_s"] / med["fairchem"]
        res["time_ratio"] = med["ours"] / med["fairchem"]
        res["wall_ratio"] = res["wall_median_s"]["ours"] / res["wall_median_s"]["fairchem"]
        paired = [a / f for a, f in zip(cpu["ours"], cpu["fairchem"])]
        res["paired_ratio_median"], res["paired_ratio_ci95"] = statistics.median(paired), bootstrap_ci(paired)
        res["saved_bytes_ratio"] = mem["ours"] / mem["fairchem"]
    return res


def big_products(steps: dict, rows: int, width: int, repeats: int = 20) -> dict:
    """Each model's count of ``(rows, width) @ (width, width)`` and ``(width, rows) @ (rows, width)``
    products in one profiled step (``steps``: name -> (step, model)) and their floor: the count times
    this core's best time for that product alone (the module docstring), by the library that ran it in
    the step (MKL's ``mm``/``addmm``, or oneDNN's ``mkldnn::_linear_pointwise``: our float32 Denses'
    forward and input-gradient products, ``gemnet_layers._mm``)."""
    from torch.profiler import ProfilerActivity, profile

    x, g, w = torch.randn(rows, width), torch.randn(rows, width), torch.randn(width, width)

    def best(f) -> float:
        f()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        return min(times)

    times = {"rows_by_width": min(best(lambda: x @ w.t()), best(lambda: g @ w)),  # forward, input gradient
             "weight_gradient": best(lambda: g.t() @ x)}
    if ops.ONEDNN:
        times["rows_by_width_onednn"] = min(best(lambda: ops.onednn_linear(x, w, None)),
                                            best(lambda: ops.onednn_linear(g, w.t(), None)))
    flops = 2 * rows * width * width
    out = {"shape": [rows, width, width], "best_s": times,
           "best_gflops_per_s": {k: flops / t / 1e9 for k, t in times.items()}}
    for name, (step, model) in steps.items():
        model.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
        n = dict.fromkeys(times, 0)
        for e in prof.events():
            shapes = (e.input_shapes[:2] if e.name in ("aten::mm", "mkldnn::_linear_pointwise")
                      else e.input_shapes[1:3] if e.name == "aten::addmm" else [])
            if e.name == "mkldnn::_linear_pointwise":
                n["rows_by_width_onednn"] += shapes == [[rows, width], [width, width]]
            elif shapes == [[rows, width], [width, width]]:
                n["rows_by_width"] += 1
            elif shapes == [[width, rows], [rows, width]]:
                n["weight_gradient"] += 1
        out[name] = {"count": n, "flops": flops * sum(n.values()), "floor_s": sum(n[k] * times[k] for k in n)}
    return out


def _summary(name: str, r: dict) -> str:
    line = (f"{name}: {r['atoms']} atoms, {r['edges']} edges, {r['triplets']} triplets; ours "
            f"{r['cpu_median_s']['ours'] * 1e3:.1f} ms CPU, saved {r['saved_bytes']['ours'] / 2**20:.1f} MiB")
    if "time_ratio" in r:
        line += (f"; fairchem {r['cpu_median_s']['fairchem'] * 1e3:.1f} ms, {r['saved_bytes']['fairchem'] / 2**20:.1f} "
                 f"MiB; ours/fairchem time {r['time_ratio']:.3f} (paired {r['paired_ratio_median']:.3f}, 95 % "
                 f"{'-'.join(f'{v:.3f}' for v in r['paired_ratio_ci95'])}, wall "
                 f"{r['wall_ratio']:.3f}), saved {r['saved_bytes_ratio']:.3f}")
    bp = r["big_products"]
    line += (f"; {'/'.join(str(sum(bp[k]['count'].values())) for k in r['cpu_median_s'])} products of "
             f"{bp['shape']} at this core's best ({' / '.join(f'{v:.0f}' for v in bp['best_gflops_per_s'].values())} "
             f"GFLOP/s): ours {bp['ours']['floor_s'] * 1e3:.0f} ms")
    if "floor_over_fairchem" in bp:
        line += f" = {bp['floor_over_fairchem']:.3f} of fairchem's step"
    return line + f"; load {r['loadavg_after'][0]:.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench/gemnet_fairchem.json")
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=[*SIZES, *SMOKE])
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per model (default: small 20, default 12)")
    ap.add_argument("--quick", action="store_true", help="the small sizes only, 5 repeats")
    ap.add_argument("--fairchem-src", default=None,
                    help="a scratch checkout of fairchem-core's src (commit 05b9595a): measure its model too")
    a = parse_args(ap, argv, sizes=list(SMOKE))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        load0 = os.getloadavg()
        out = {"command": " ".join(["python", *sys.argv]), "torch": torch.__version__, "threads": 1,
               "dtype": "float32", "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
               "fairchem_src": a.fairchem_src, "loadavg_before": load0, "sizes": {}}
        names = [n for n in a.sizes if n.startswith("small")] if a.quick else a.sizes
        for name in names:
            spec, structure, repeats = {**SIZES, **SMOKE}[name]
            res = out["sizes"][name] = measure(spec, structure, a.repeats or (5 if a.quick else repeats), a.fairchem_src)
            print(_summary(name, res), file=sys.stderr)
        out["loadavg_after"] = os.getloadavg()
        out["machine"] = machine_record(load0)
        write_json(a.out, out)
    finally:
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
