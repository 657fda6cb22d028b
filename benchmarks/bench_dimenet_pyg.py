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

``--energy-only`` (issue #37, item 16): energy-only training steps — forward and backward of
``sum(E²)``, no forces (ours: ``DimeNetPPModel(g, forces=False)``, what the engine runs when a
dataset has no forces or ``force_weight`` is 0; PyG's: ``DimeNetPlusPlus`` and ``backward``) — on
small molecules: ASE's g2 set (``ase.collections.g2``, its 120 molecules of 3 atoms or more; no
periodic images, so PyG's geometry is ours as it is) labelled with Lennard-Jones energies alone and
read as a user's file of energies would be (``data.read_structures``: no forces), in batches of 32
molecules (3 batches, cutoff 5 Å), each timed step on the next batch, both models on the same batches.
Four sizes: the ``small`` preset and PyG's defaults (``default``) on all 120 (6.6 atoms on average,
most of them 3-5), and PyG's defaults on the 66 of 6 atoms or more (``default-6plus``: 8.8 on average,
2 batches) and on the 41 of 8 or more (``default-8plus``: 10.1 on average, 1 batch), since the ratio
depends on the molecules' size (more triplets an edge as they grow; the molecules of DFT sets such as
QM9 average 18 atoms).
There PyG's ``triplets`` computes the triplets from the edges in every forward, as PyG's own does
(:func:`pyg_triplets`: its algorithm, its torch_sparse row selection in plain torch ops), as ours
builds its triplet blocks from the batch's triplet lists in every forward (both about 0.9 ms a step):


    python benchmarks/bench_dimenet_pyg.py --energy-only [--out results/bench/dimenet_pyg_energy.json]

``--compile`` (with ``--energy-only``) also times both models ``torch.compile``'d in the same interleaved
rounds: ours as the config key ``models.<name>.dimenetpp.compile`` runs it (``DimeNetPPModel`` with
``cfg.compile``), PyG's as ``torch.compile(model, dynamic=True)``; each compiled by one step on every
batch (the wall seconds of those steps, compilation included, are recorded), then checked against the
other (energies and gradients to 1e-4 of the largest, float32):

    python benchmarks/bench_dimenet_pyg.py --energy-only --compile [--out results/bench/dimenet_pyg_energy.json]

It also says where each model's step goes (``products_split``): the profiler's seconds in matrix
products and in the rest, the products' FLOPs (the same for both models: the same layers on the same
rows), and those FLOPs at this machine's best rate for a dense layer of the step's shape
(``gemm_rate``): the floor under either step, whatever else is made faster.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gnnpipe.atomic import data
from gnnpipe.atomic.dimenetpp import DimeNetPP, DimeNetPPConfig, DimeNetPPModel, energy_and_forces, preset
from gnnpipe.atomic.parallel import single_graph, with_pos
from gnnpipe.io import write_json
from machine import machine_record
from smoke import parse_args

SIZES = {  # name: (model, slabs, timed steps per model by default)
    "small": (dict(preset="small"), 4, 40),
    "h256": (dict(hidden_channels=256, num_blocks=4, int_emb_size=128, basis_emb_size=8, out_emb_channels=256), 16, 10),
}
SMOKE = {"smoke": (dict(preset="small", num_spherical=3, num_radial=3), 2, 1)}
CUTOFF, MAX_NEIGHBORS = 5.0, 24
#: energy-only: name -> (model, molecules per batch, timed steps per model by default, the fewest atoms
#: of a molecule taken from g2); "default" is PyG's DimeNetPlusPlus defaults (hidden 128, 4 blocks: the
#: published QM9 model) on all of g2's molecules of 3 atoms or more (6.6 atoms on average: most of them
#: 3-5), "default-6plus" / "-8plus" the same model on its molecules of 6 / 8 atoms or more (8.8 / 10.1 on
#: average; QM9's are 18) (enough rounds that the paired ratio's 95 % interval is about ± 0.01 on a quiet
#: machine)
ENERGY_SIZES = {"small": (dict(preset="small"), 32, 200, 3), "default": (dict(preset="default"), 32, 100, 3),
                "default-6plus": (dict(preset="default"), 32, 100, 6),
                "default-8plus": (dict(preset="default"), 32, 100, 8)}
ENERGY_SMOKE = {"smoke-energy-only": (dict(preset="small", num_spherical=3, num_radial=3), 4, 1, 3)}


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


def molecule_batches(batch_size: int, cutoff: float = CUTOFF, min_atoms: int = 3) -> list[dict]:
    """ASE's g2 molecules of ``min_atoms`` atoms or more (at least 3) with Lennard-Jones energies and no
    forces, written as an extxyz and read back as a user's energy-only file (``data.read_structures``),
    in batches of ``batch_size`` (batch_arrays; the last partial batch dropped)."""
    import ase.io
    from ase.calculators.lj import LennardJones
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.collections import g2

    frames = []
    for mol in g2:
        if len(mol) >= max(min_atoms, 3):
            mol = mol.copy()
            mol.calc = LennardJones(rc=cutoff)
            mol.calc = SinglePointCalculator(mol, energy=mol.get_potential_energy())
            frames.append(mol)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "g2.extxyz"
        ase.io.write(path, frames)
        systems = data.read_structures(path, split="random")
    if data.has_forces(systems):
        raise AssertionError("the molecules were meant to have energies alone")
    graphs = data.build_graphs(systems, cutoff, MAX_NEIGHBORS, progress=False)
    n = len(systems["energy"]) // batch_size * batch_size
    return [data.batch_arrays(systems, graphs, list(range(i, i + batch_size))) for i in range(0, n, batch_size)]


def _models(cfg: DimeNetPPConfig, dtype=torch.float64, cls=DimeNetPP):
    """Ours (``cls``: DimeNetPP, or the protocol's DimeNetPPModel) and PyG's ``DimeNetPlusPlus`` with the
    same (randomly perturbed) weights."""
    from torch_geometric.nn.models.dimenet import DimeNetPlusPlus

    torch.manual_seed(0)
    ours = cls(cfg).to(dtype)
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


#: the batch PyG's patched ``radius_graph`` and ``triplets`` return (set by :func:`pyg_graph`)
_PYG_BATCH: dict = {}


@torch.compiler.disable
def _pyg_radius_graph(pos, r, batch, max_num_neighbors):
    return _PYG_BATCH["edge_index"]


@torch.compiler.disable
def _pyg_triplets(edge_index, num_nodes):
    if "triplets" in _PYG_BATCH:
        return _PYG_BATCH["triplets"]
    return pyg_triplets(edge_index, num_nodes)


def pyg_triplets(edge_index, num_nodes):
    """PyG's ``triplets``, computed from ``edge_index`` as PyG's is inside every forward: its algorithm
    (the edges into each atom as a CSR adjacency sorted by source, each edge ``j -> i`` paired with the
    edges into j, ``k == i`` dropped) with its ``SparseTensor`` row selection written in plain torch
    ops (a sort, CSR offsets, ``repeat_interleave``, gathers; torch_sparse is not installed here).
    For edge sets without duplicates or periodic images (molecules): PyG's ``triplets`` would merge
    the first and drop every ``k == i`` of the second."""
    row, col = edge_index  # j -> i
    order = torch.argsort(col * num_nodes + row)  # SparseTensor(row=col, col=row)'s entries, sorted
    count = torch.bincount(col, minlength=num_nodes)
    start = torch.cumsum(count, 0) - count  # its CSR row pointer
    per_edge = count[row]  # adj_t[row]: the edges into j, for each edge j -> i
    ji = torch.arange(row.numel()).repeat_interleave(per_edge)
    kj = order[start[row][ji] + torch.arange(ji.numel()) - (torch.cumsum(per_edge, 0) - per_edge)[ji]]
    idx_i, idx_j, idx_k = col[ji], row[ji], row[kj]
    mask = idx_i != idx_k  # Remove i == k triplets.
    return col, row, idx_i[mask], idx_j[mask], idx_k[mask], kj[mask], ji[mask]


@contextlib.contextmanager
def pyg_graph(b: dict, compute_triplets: bool = False):
    """PyG's compiled-only ``radius_graph`` and ``triplets`` return ``b``'s edges and triplets meanwhile
    (the same two functions for every batch, so that a ``torch.compile``'d PyG model is not recompiled
    for each: they only read ``_PYG_BATCH``). ``compute_triplets``: ``triplets`` computes them from the
    edges in every forward instead, as PyG's does (:func:`pyg_triplets`; molecules only)."""
    import torch_geometric.nn.models.dimenet as pyg

    src, dst = torch.as_tensor(b["edge_src"]), torch.as_tensor(b["edge_dst"])
    kj, ji = torch.as_tensor(b["idx_kj"]), torch.as_tensor(b["idx_ji"])
    _PYG_BATCH.update(edge_index=torch.stack([src, dst]))
    if not compute_triplets:  # i, j, idx_i, idx_j, idx_k, idx_kj, idx_ji:
        _PYG_BATCH.update(triplets=(dst, src, dst[ji], src[ji], src[kj], kj, ji))
    saved = pyg.radius_graph, pyg.triplets
    pyg.radius_graph, pyg.triplets = _pyg_radius_graph, _pyg_triplets
    try:
        yield
    finally:
        pyg.radius_graph, pyg.triplets = saved
        _PYG_BATCH.clear()


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


def _energy_steps(ours, ref, batches: list, dtype):
    """Two closures, each one energy-only training step (forward, backward of ``sum(E²)``) on the next
    of ``batches`` (the two keep in step: call each once per round), returning (energies,)."""
    graphs = [single_graph(b, dtype) for b in batches]
    turn = {"ours": 0, "pyg": 0}

    def next_batch(name):
        i = turn[name] % len(batches)
        turn[name] += 1
        return i

    def step_ours():
        e = ours(graphs[next_batch("ours")], forces=False)["energy"]
        e.pow(2).sum().backward()
        return (e.detach(),)

    def step_ref():
        i = next_batch("pyg")
        b, g = batches[i], graphs[i]
        with pyg_graph(b, compute_triplets=True):
            e = ref(g.z, g.pos, g.system).squeeze(-1)
        e.pow(2).sum().backward()
        return (e.detach(),)

    return step_ours, step_ref


def check_same_step(step_ours, step_ref, ours, ref, tol: float = 1e-9) -> None:
    """One float64 step of each: energies, forces (where the steps compute them) and every parameter
    gradient agree to ``tol`` of their largest magnitude (random weights make them large: an
    element-wise rtol would be noise)."""
    for m in (ours, ref):
        m.zero_grad(set_to_none=True)
    out0, out1 = step_ours(), step_ref()
    ref_grads = dict(ref.named_parameters())
    pairs = list(zip(("energy", "forces"), out0, out1)) + [
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
        cpu, wall = interleaved({"ours": (step_ours, ours), "pyg": (step_ref, ref)}, repeats, warmup)
    c, w = _ratios(cpu), _ratios(wall)
    return {"systems": num_systems, "atoms": int(len(b["z"])), "edges": int(len(b["edge_src"])),
            "triplets": int(len(b["idx_kj"])), "model": vars(cfg), "repeats": repeats,
            "time_ratio": c["ratio"], "saved_bytes_ratio": mem["ours"] / mem["pyg"], "saved_bytes": mem,
            "cpu": c, "wall": w, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "step_cpu_s": cpu, "step_wall_s": wall}


def energy_ratio(spec: dict, batch_size: int, repeats: int = 20, warmup: int = 2, dtype=torch.float32,
                 compile: bool = False, min_atoms: int = 3) -> dict:
    """Ours/PyG time of energy-only training steps (medians of interleaved steps, each on the next batch
    of :func:`molecule_batches`: molecules of ``min_atoms`` or more) for the model ``spec``, after checking
    energies and every parameter gradient agree (float64). Call it under ``torch.set_num_threads(1)``.
    ``compile``: also both models ``torch.compile``'d (:func:`compiled_steps`), timed in the same
    interleaved rounds."""
    cfg = _config(spec)
    batches = molecule_batches(batch_size, cfg.cutoff, min_atoms)
    ours, ref = _models(cfg, cls=DimeNetPPModel)
    load_before = os.getloadavg()
    check_same_step(*_energy_steps(ours, ref, batches, torch.float64), ours, ref)
    ours, ref = ours.to(dtype), ref.to(dtype)
    steps = _energy_steps(ours, ref, batches, dtype)
    timed = {"ours": (steps[0], ours), "pyg": (steps[1], ref)}
    compiled = compiled_steps(ours, ref, batches, dtype) if compile else {}
    timed.update({name: v["step"] for name, v in compiled.items()})
    cpu, wall = interleaved(timed, repeats, warmup)
    if compile:
        med = {name: statistics.median(t) for name, t in cpu.items()}
        compiled = {"ours_compiled_over_pyg": med["ours_compiled"] / med["pyg"],
                    "ours_compiled_over_pyg_compiled": med["ours_compiled"] / med["pyg_compiled"],
                    "pyg_compiled_over_pyg": med["pyg_compiled"] / med["pyg"],
                    "ours_compiled_over_ours": med["ours_compiled"] / med["ours"],
                    "median_cpu_s": med, "median_wall_s": {name: statistics.median(t) for name, t in wall.items()},
                    "first_steps": {name: v["first_steps"] for name, v in compiled.items()}}
        cpu, wall = ({k: t[k] for k in ("ours", "pyg")} for t in (cpu, wall))
    c, w = _ratios(cpu), _ratios(wall)
    split = products_split({"ours": (steps[0], ours), "pyg": (steps[1], ref)}, min(len(batches), 3))
    rows = statistics.median(len(b["edge_src"]) for b in batches)
    peak = gemm_rate(int(rows), cfg.hidden_channels, dtype)
    size = lambda key: [int(len(b[key])) for b in batches]  # noqa: E731
    return {"molecules": batch_size * len(batches), "min_atoms": min_atoms, "batch_size": batch_size,
            "batches": len(batches),
            "atoms_per_batch": size("z"), "edges_per_batch": size("edge_src"), "triplets_per_batch": size("idx_kj"),
            "model": vars(cfg), "parameters": sum(p.numel() for p in ours.parameters()), "repeats": repeats,
            "time_ratio": c["ratio"], "cpu": c, "wall": w, "products_split": split,
            "gemm_gflops_per_s": peak, "products_floor_s": {k: v["product_flops"] / 1e9 / peak for k, v in split.items()},
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(), "step_cpu_s": cpu, "step_wall_s": wall,
            **({"compiled": compiled} if compile else {})}


def compiled_steps(ours, ref, batches: list, dtype, tol: float = 1e-4) -> dict:
    """Both models ``torch.compile``'d (inductor, dynamic shapes): ours as the ``compile`` key runs it (a
    copy of ``ours`` with ``cfg.compile``), PyG's as ``torch.compile(model, dynamic=True)``. Each is
    compiled by one step on every batch (``first_steps``: the wall and CPU seconds of those steps,
    compilation included; the CPU seconds are this process's), then the two compiled steps are checked
    to agree in energies and every parameter gradient to ``tol`` of the largest (float32 rounding:
    inductor reorders sums). Returns name -> {"step": (step, model), "first_steps": ...}."""
    ours_c = DimeNetPPModel(dataclasses.replace(ours.cfg, compile=True)).to(dtype)
    ours_c.load_state_dict(ours.state_dict())
    step_ours, _ = _energy_steps(ours_c, ref, batches, dtype)
    _, step_ref = _energy_steps(ours, torch.compile(ref, dynamic=True), batches, dtype)
    out = {}
    for name, step, model in (("ours_compiled", step_ours, ours_c), ("pyg_compiled", step_ref, ref)):
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in batches:
            model.zero_grad(set_to_none=True)
            step()
        out[name] = {"step": (step, model), "first_steps": {
            "steps": len(batches), "wall_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0}}
    check_same_step(step_ours, step_ref, ours_c, ref, tol)
    for _ in range(len(batches) - 1):  # back in step with the eager models' batches (one turn each so far)
        step_ours(), step_ref()
    return out


#: the matrix products of a step (dense layers, and our triplet blocks' batched product)
PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm")


def products_split(models: dict, steps: int, rounds: int = 3) -> dict:
    """Where each model's step goes: the profiler's self-CPU seconds a step in matrix products
    (:data:`PRODUCTS`) and in everything else (medians over ``rounds`` rounds of ``steps`` steps, one
    a batch; the models alternate which goes first, as the timing does), and the products'
    floating-point operations (``FlopCounterMode``). ``models``: name -> (step, model).

    Both models run the same products (the same layers on the same rows), so their product seconds
    are the floor under either step: a step can be no faster than its products, whatever the rest.
    """
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    seen = {name: {"products_s": [], "profiled_step_s": []} for name in models}
    for r in range(rounds + 1):  # round 0 pays the profiler's own warm-up and is dropped
        for name in (list(models) if r % 2 else list(models)[::-1]):
            step, model = models[name]
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    model.zero_grad(set_to_none=True)
                    step()
            own = {e.key: e.self_cpu_time_total for e in prof.key_averages()}  # microseconds
            if r:
                seen[name]["products_s"].append(sum(own.get(k, 0.0) for k in PRODUCTS) / 1e6 / steps)
                seen[name]["profiled_step_s"].append(sum(own.values()) / 1e6 / steps)
    out = {}
    for name, (step, model) in models.items():
        counter = FlopCounterMode(display=False)
        with counter:
            model.zero_grad(set_to_none=True)
            step()
        products, total = (statistics.median(seen[name][k]) for k in ("products_s", "profiled_step_s"))
        out[name] = {"products_s": products, "other_s": total - products, "profiled_step_s": total,
                     "product_flops": int(counter.get_total_flops()),
                     "product_gflops_per_s": counter.get_total_flops() / 1e9 / products if products else None}
    return out


def gemm_rate(rows: int, width: int, dtype, repeats: int = 50) -> float:
    """This machine's rate (GFLOP/s, best of ``repeats``) for one dense layer of the step's shape: a
    (rows, width) @ (width, width) product, the shape most of either model's products have (edge rows
    by the hidden width): the steps' product FLOPs at this rate are the floor under a step."""
    a, w = torch.randn(rows, width, dtype=dtype), torch.randn(width, width, dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        a @ w
        best = min(best, time.process_time() - t0)
    return 2 * rows * width * width / 1e9 / max(best, 1e-9)


def interleaved(steps: dict, repeats: int, warmup: int) -> tuple[dict, dict]:
    """CPU and wall seconds of each step (``steps``: name -> (step, model)), the order alternating
    each repeat (the module docstring); the first ``warmup`` repeats are not kept."""
    cpu, wall = ({name: [] for name in steps} for _ in range(2))
    names = list(steps)
    for r in range(warmup + repeats):
        for name in (names if r % 2 else names[::-1]):
            step, model = steps[name]
            model.zero_grad(set_to_none=True)
            c0, w0 = time.process_time(), time.perf_counter()
            step()
            if r >= warmup:
                cpu[name].append(time.process_time() - c0)
                wall[name].append(time.perf_counter() - w0)
    return cpu, wall


def _ratios(t: dict) -> dict:
    med = {k: statistics.median(v) for k, v in t.items()}
    paired = [a / p for a, p in zip(t["ours"], t["pyg"])]
    return {"ratio": med["ours"] / med["pyg"], "median_s": med, "paired_ratio_median": statistics.median(paired),
            "paired_ratio_ci95": bootstrap_ci(paired)}


def bootstrap_ci(x: list, draws: int = 2000, seed: int = 0) -> list:
    """A 95 % interval of the median of ``x`` (percentile bootstrap over the rounds). It says how well
    the rounds pin the ratio down under this run's conditions, not how far a later run may move (the
    machine's load moves both models' times between runs)."""
    rng = np.random.default_rng(seed)
    meds = np.sort(np.median(rng.choice(np.asarray(x), size=(draws, len(x))), axis=1))
    return [float(meds[int(0.025 * draws)]), float(meds[int(0.975 * draws) - 1])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench/dimenet_pyg.json")
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=[*SIZES, *SMOKE])
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed steps per model and size (default: small 40, h256 10; energy-only small 200, "
                         "default 100; --quick 5)")
    ap.add_argument("--quick", action="store_true", help="the small size only, 5 repeats")
    ap.add_argument("--compile", action="store_true",
                    help="with --energy-only: also both models torch.compile'd (ours: the compile key)")
    ap.add_argument("--energy-only", action="store_true",
                    help="energy-only training steps on molecules (sizes: " + ", ".join(ENERGY_SIZES) + ")")
    a = parse_args(ap, argv, sizes=list(SMOKE))
    torch.set_num_threads(1)
    load0 = os.getloadavg()
    out = {"command": " ".join(["python", *sys.argv]), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "dtype": "float32",
           "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "loadavg_before": load0, "sizes": {}}
    import torch_geometric
    out["torch_geometric"] = torch_geometric.__version__
    out["mode"] = "energy-only" if a.energy_only else "forces"
    if a.smoke:  # both modes, tiny
        jobs = [(SMOKE, pyg_ratio, "smoke"), (ENERGY_SMOKE, energy_ratio, "smoke-energy-only")]
    elif a.energy_only:
        jobs = [(ENERGY_SIZES, energy_ratio, n) for n in (["small"] if a.quick else ENERGY_SIZES)]
    else:
        jobs = [(SIZES, pyg_ratio, n) for n in (["small"] if a.quick else a.sizes)]
    for table, ratio, name in jobs:
        spec, n, repeats, *min_atoms = table[name]
        opts = {"min_atoms": min_atoms[0]} if ratio is energy_ratio else {}
        if a.compile and ratio is energy_ratio:
            opts["compile"] = True
        res = out["sizes"][name] = ratio(spec, n, a.repeats or (5 if a.quick else repeats), **opts)
        print(_summary(name, res), file=sys.stderr)
    out["loadavg_after"] = os.getloadavg()
    out["machine"] = machine_record(load0)
    write_json(a.out, out)
    return 0


def _summary(name: str, res: dict) -> str:
    """One line of a size's result (either mode)."""
    times = (f"ours/PyG time {res['time_ratio']:.3f} (CPU, medians {res['cpu']['median_s']['ours'] * 1e3:.1f} / "
             f"{res['cpu']['median_s']['pyg'] * 1e3:.1f} ms; paired {res['cpu']['paired_ratio_median']:.3f}, 95 % "
             f"{res['cpu']['paired_ratio_ci95'][0]:.3f}-{res['cpu']['paired_ratio_ci95'][1]:.3f}; wall "
             f"{res['wall']['ratio']:.3f})")
    if "batches" in res:  # energy-only
        sp = res["products_split"]
        split = "; ".join(f"{k} {v['products_s'] * 1e3:.0f} ms products ({v['product_flops'] / 1e9:.2f} GFLOP) + "
                          f"{v['other_s'] * 1e3:.0f} ms else" for k, v in sp.items())
        return (f"{name} energy-only: {res['batches']} batches of {res['batch_size']} molecules of "
                f"{res['min_atoms']}+ atoms ({statistics.mean(res['atoms_per_batch']):.0f} atoms, {statistics.mean(res['triplets_per_batch']):.0f} "
                f"triplets a batch); {times}; profiled steps: {split}; products at this machine's dense-layer rate "
                f"({res['gemm_gflops_per_s']:.1f} GFLOP/s): {res['products_floor_s']['ours'] * 1e3:.0f} ms; load {res['loadavg_after'][0]:.2f}"
                + _compiled_summary(res.get("compiled")))
    return (f"{name}: {res['atoms']} atoms, {res['edges']} edges, {res['triplets']} triplets; {times}, saved memory "
            f"{res['saved_bytes']['ours'] / 2**20:.1f} / {res['saved_bytes']['pyg'] / 2**20:.1f} MiB = "
            f"{res['saved_bytes_ratio']:.3f}; load {res['loadavg_after'][0]:.2f}")

def _compiled_summary(comp) -> str:
    if not comp:
        return ""
    med, first = comp["median_cpu_s"], comp["first_steps"]
    return (f"; compiled (CPU medians): ours {med['ours_compiled'] * 1e3:.1f} ms, "
            f"PyG {med['pyg_compiled'] * 1e3:.1f} ms; "
            f"ours compiled / PyG eager {comp['ours_compiled_over_pyg']:.3f}, / PyG compiled "
            f"{comp['ours_compiled_over_pyg_compiled']:.3f}; first steps (compiling) "
            f"{first['ours_compiled']['wall_s']:.0f} / {first['pyg_compiled']['wall_s']:.0f} s wall")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
