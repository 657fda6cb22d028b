"""Our DimeNet++ against PyG's ``DimeNetPlusPlus``: time and memory kept for backward, as ratios.

    python benchmarks/bench_dimenet_pyg.py [--out results/bench/dimenet_pyg.json] [--quick]
    python benchmarks/bench_dimenet_pyg.py --out /tmp/pyg.json --smoke   # the smoke size, one step

One training step each — forward, energy-conserving forces (``create_graph=True``), backward of
``sum(E²) + sum(F²)`` — with the same weights (PyG loads our state dict), the same batch, one
thread, float32, at two sizes (issue #22, part 3):

* ``small``: the ``small`` preset on 4 slabs;
* ``h256``: hidden 256, 4 blocks, triplet width 128 (bench_atomic's model) on 16 slabs;
* ``smoke`` (only when named, and ``--smoke``'s): ``small`` with 3 spherical and 3 radial bases on 2
  slabs (PyG builds its bases with sympy: minutes of CPU at the default 7 spherical, seconds at 3).

The slabs are the repository's EMT slabs (``gnnpipe.atomic.data``: cutoff 5 Å, 24 neighbours),
edges over periodic images. PyG knows no periodic images: its compiled-only ``radius_graph`` and
``triplets`` are patched to return our edges and triplets (as tests/test_dimenetpp.py does), and
its distances and angles come from unshifted positions. So both models are given the unshifted
geometry (our shifts are zeroed; self-image edges, of length 0 there, are dropped with their
triplets): the same operations on the same numbers, and the step checks that energies, forces
and every parameter gradient agree before it times anything.

Timing alternates the two models in one process (ours first in odd repeats, PyG's in even ones)
and takes medians of each step's CPU time (``time.process_time``, one thread: what the step
computes, not how long a shared machine kept it waiting); wall-clock medians are recorded too.
The ratio is what to read; absolute times depend on the machine's load.
Memory kept for backward = the bytes of the distinct storages autograd saves during the forward
and the force pass (``saved_tensors_hooks``), parameters excluded, measured the same way for both.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

from gnnpipe.atomic import data
from gnnpipe.atomic.dimenetpp import DimeNetPP, DimeNetPPConfig, energy_and_forces, preset
from gnnpipe.atomic.parallel import single_graph, with_pos
from gnnpipe.io import write_json
from smoke import parse_args

SIZES = {  # name: (model, slabs, timed steps per model by default)
    "small": (dict(preset="small"), 4, 40),
    "h256": (dict(hidden_channels=256, num_blocks=4, int_emb_size=128, basis_emb_size=8, out_emb_channels=256), 16, 10),
}
SMOKE = {"smoke": (dict(preset="small", num_spherical=3, num_radial=3), 2, 1)}
CUTOFF, MAX_NEIGHBORS = 5.0, 24


def slab_batch(num_systems: int, cutoff: float = CUTOFF, seed: int = 1) -> dict:
    """``num_systems`` EMT slabs as one batch (batch_arrays), unshifted, self-image edges dropped."""
    systems = data.generate(num_systems, seed=seed, progress=False)
    graphs = data.build_graphs(systems, cutoff, MAX_NEIGHBORS, progress=False)
    b = data.batch_arrays(systems, graphs, list(range(num_systems)))
    keep = b["edge_src"] != b["edge_dst"]
    new_id = np.cumsum(keep) - 1
    tkeep = keep[b["idx_kj"]] & keep[b["idx_ji"]]
    return {**b, "edge_src": b["edge_src"][keep], "edge_dst": b["edge_dst"][keep],
            "edge_shift": np.zeros((int(keep.sum()), 3)), "idx_kj": new_id[b["idx_kj"][tkeep]],
            "idx_ji": new_id[b["idx_ji"][tkeep]]}


def _config(spec: dict) -> DimeNetPPConfig:
    """``spec``: DimeNetPPConfig fields, or ``preset`` and overrides (cutoff 5 Å unless given)."""
    spec = {"cutoff": CUTOFF, **spec}
    name = spec.pop("preset", None)
    return preset(name, **spec) if name else DimeNetPPConfig(**spec)


def _models(cfg: DimeNetPPConfig, dtype=torch.float64):
    """Ours and PyG's ``DimeNetPlusPlus`` with the same (randomly perturbed) weights."""
    from torch_geometric.nn.models.dimenet import DimeNetPlusPlus

    torch.manual_seed(0)
    ours = DimeNetPP(cfg).to(dtype)
    with torch.no_grad():  # the zero-initialised output layers would make every gradient but theirs 0
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ref = DimeNetPlusPlus(
        hidden_channels=cfg.hidden_channels, out_channels=cfg.out_channels, num_blocks=cfg.num_blocks,
        int_emb_size=cfg.int_emb_size, basis_emb_size=cfg.basis_emb_size, out_emb_channels=cfg.out_emb_channels,
        num_spherical=cfg.num_spherical, num_radial=cfg.num_radial, cutoff=cfg.cutoff,
        envelope_exponent=cfg.envelope_exponent, num_before_skip=cfg.num_before_skip,
        num_after_skip=cfg.num_after_skip, num_output_layers=cfg.num_output_layers).to(dtype)
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ours, ref


@contextlib.contextmanager
def pyg_graph(b: dict):
    """PyG's compiled-only ``radius_graph`` and ``triplets`` return ``b``'s edges and triplets meanwhile."""
    import torch_geometric.nn.models.dimenet as pyg

    src, dst = torch.as_tensor(b["edge_src"]), torch.as_tensor(b["edge_dst"])
    kj, ji = torch.as_tensor(b["idx_kj"]), torch.as_tensor(b["idx_ji"])
    trip = (dst, src, dst[ji], src[ji], src[kj], kj, ji)  # i, j, idx_i, idx_j, idx_k, idx_kj, idx_ji
    saved = pyg.radius_graph, pyg.triplets
    pyg.radius_graph = lambda pos, r, batch, max_num_neighbors: torch.stack([src, dst])
    pyg.triplets = lambda edge_index, num_nodes: trip
    try:
        yield
    finally:
        pyg.radius_graph, pyg.triplets = saved


def _steps(ours, ref, b: dict, dtype):
    """Two closures, each one training step returning (energies, forces)."""
    g = single_graph(b, dtype)
    z, system = torch.as_tensor(b["z"]), torch.as_tensor(b["system"])

    def loss_backward(e, f):
        (e.pow(2).sum() + f.pow(2).sum()).backward()
        return e.detach(), f.detach()

    def step_ours():
        e, f = energy_and_forces(ours, with_pos(g, g.pos.detach().clone().requires_grad_(True)), create_graph=True)
        return loss_backward(e, f)

    def step_ref():
        pos = g.pos.detach().clone().requires_grad_(True)
        e = ref(z, pos, system).squeeze(-1)
        f = -torch.autograd.grad(e.sum(), pos, create_graph=True)[0]
        return loss_backward(e, f)

    return step_ours, step_ref


def check_same_step(step_ours, step_ref, ours, ref, tol: float = 1e-9) -> None:
    """One float64 step of each: energies, forces and every parameter gradient agree to ``tol`` of
    their largest magnitude (random weights make them large: an element-wise rtol would be noise)."""
    for m in (ours, ref):
        m.zero_grad(set_to_none=True)
    (e0, f0), (e1, f1) = step_ours(), step_ref()
    ref_grads = dict(ref.named_parameters())
    pairs = [("energy", e0, e1), ("forces", f0, f1)] + [
        (name, p.grad, ref_grads[name].grad) for name, p in ours.named_parameters()]
    for name, a, b in pairs:
        err, scale = float((a - b).abs().max()), float(b.abs().max())
        if err > tol * max(scale, 1.0):
            raise AssertionError(f"ours and PyG's differ in {name}: {err:.3g} (largest {scale:.3g})")


def saved_bytes(step, model) -> int:
    """Bytes of the distinct storages autograd saves for backward during ``step``, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def pyg_ratio(spec: dict, num_systems: int, repeats: int = 20, warmup: int = 2, dtype=torch.float32) -> dict:
    """Ours/PyG time (medians of interleaved steps) and saved-memory ratios on ``num_systems`` slabs
    for the model ``spec`` (DimeNetPPConfig fields, or ``preset``: see the module docstring).
    Call it under ``torch.set_num_threads(1)`` for the ratios this benchmark reports."""
    cfg = _config(spec)
    b = slab_batch(num_systems, cfg.cutoff)
    ours, ref = _models(cfg)
    load_before = os.getloadavg()
    with pyg_graph(b):
        check_same_step(*_steps(ours, ref, b, torch.float64), ours, ref)
        ours, ref = ours.to(dtype), ref.to(dtype)
        step_ours, step_ref = _steps(ours, ref, b, dtype)
        mem = {"ours": saved_bytes(step_ours, ours), "pyg": saved_bytes(step_ref, ref)}
        cpu = {"ours": [], "pyg": []}
        wall = {"ours": [], "pyg": []}
        for r in range(warmup + repeats):
            order = (("ours", step_ours, ours), ("pyg", step_ref, ref))
            for name, step, model in (order if r % 2 else order[::-1]):
                model.zero_grad(set_to_none=True)
                c0, w0 = time.process_time(), time.perf_counter()
                step()
                if r >= warmup:
                    cpu[name].append(time.process_time() - c0)
                    wall[name].append(time.perf_counter() - w0)

    def ratios(t: dict) -> dict:
        med = {k: statistics.median(v) for k, v in t.items()}
        return {"ratio": med["ours"] / med["pyg"], "median_s": med,
                "paired_ratio_median": statistics.median(a / p for a, p in zip(t["ours"], t["pyg"]))}

    c, w = ratios(cpu), ratios(wall)
    return {"systems": num_systems, "atoms": int(len(b["z"])), "edges": int(len(b["edge_src"])),
            "triplets": int(len(b["idx_kj"])), "model": vars(cfg), "repeats": repeats,
            "time_ratio": c["ratio"], "saved_bytes_ratio": mem["ours"] / mem["pyg"], "saved_bytes": mem,
            "cpu": c, "wall": w, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "step_cpu_s": cpu, "step_wall_s": wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench/dimenet_pyg.json")
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=[*SIZES, *SMOKE])
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed steps per model and size (default: small 40, h256 10; --quick 5)")
    ap.add_argument("--quick", action="store_true", help="the small size only, 5 repeats")
    a = parse_args(ap, argv, sizes=list(SMOKE))
    torch.set_num_threads(1)
    sizes = ["small"] if a.quick else a.sizes
    out = {"command": " ".join(["python", *sys.argv]), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "dtype": "float32",
           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "loadavg_before": os.getloadavg(), "sizes": {}}
    import torch_geometric
    out["torch_geometric"] = torch_geometric.__version__
    for name in sizes:
        spec, n, repeats = {**SIZES, **SMOKE}[name]
        res = out["sizes"][name] = pyg_ratio(spec, n, a.repeats or (5 if a.quick else repeats))
        print(f"{name}: {res['atoms']} atoms, {res['edges']} edges, {res['triplets']} triplets; ours/PyG time "
              f"{res['time_ratio']:.3f} (CPU; paired {res['cpu']['paired_ratio_median']:.3f}; wall "
              f"{res['wall']['ratio']:.3f}), saved memory "
              f"{res['saved_bytes']['ours'] / 2**20:.1f} / {res['saved_bytes']['pyg'] / 2**20:.1f} MiB = "
              f"{res['saved_bytes_ratio']:.3f}; load {res['loadavg_after'][0]:.2f}", file=sys.stderr)
    out["loadavg_after"] = os.getloadavg()
    write_json(a.out, out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
