"""Edge/triplet graph parallelism of the atomic models: throughput and per-worker memory at P = 1, 2, 4.

    python benchmarks/bench_atomic.py --out results/bench/atomic.json [--quick] [--models dimenetpp gemnet_t]
    python benchmarks/bench_atomic.py --out /tmp/atomic.json --smoke   # --quick at P = 2 only, no PyG

One batch of EMT slab systems (gnnpipe.atomic.data: symmetric radius graphs, cutoff 5 Å, 24
neighbours) and, per registered kind, a model that is large for this machine — DimeNet++ hidden
256, 4 blocks, triplet width 128; GemNet-T edge width 256, atom width 128, triplet and bilinear
widths 64, 3 blocks — trained with energy + gradient-force steps (double backward) on P gloo
workers (spawned, one thread each), through the protocol (``ATOMIC_MODELS[kind].build``,
``engine.step_loss``). Per model and P: systems/s, each worker's peak RSS, and the activation
memory autograd keeps for backward, measured by ``saved_tensors_hooks`` (distinct storages) and
split by what a tensor's rows are — DimeNet++: local edges (and triplet-block rows), block
columns (the input edges a way's triplets read), block entries, atoms
(``dimenetpp_costs.saved_bytes_by_rows``); GemNet-T: triplets, edges (E_loc or E rows, the
padded per-edge triplet slots included), atoms — beside the kind's ``memory_per_worker``
estimate of each part (with the batch's own counts at P where the kind has them). Also
the bytes the ledger counted per step against the kind's closed form (``step_bytes``), and, for
DimeNet++, the time ratio to PyG's DimeNetPlusPlus (``bench_dimenet_pyg.pyg_ratio``, where that
benchmark is present). GemNet's scale factors stay 1 here: they change no shape, byte or time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

MODELS = {  # kind: (large for this machine, --quick)
    "dimenetpp": (dict(hidden_channels=256, num_blocks=4, int_emb_size=128, basis_emb_size=8, out_emb_channels=256),
                  dict(hidden_channels=40, num_blocks=2, int_emb_size=16, out_emb_channels=40)),
    "gemnet_t": (dict(num_blocks=3, emb_size_atom=128, emb_size_edge=256, emb_size_trip=64, emb_size_bil_trip=64,
                      num_radial=32, force_head="gradient"),
                 dict(num_blocks=1, emb_size_atom=16, emb_size_edge=32, emb_size_trip=8, emb_size_bil_trip=8,
                      num_radial=8, force_head="gradient")),
}
CUTOFF, MAX_NEIGHBORS = 5.0, 24


def model_config(kind: str, kw: dict):
    from gnnpipe.atomic.protocol import ATOMIC_MODELS
    return ATOMIC_MODELS[kind].preset("default", **kw, cutoff=CUTOFF)


def _work(rank: int, world: int, b: dict, kind: str, cfg_kw: dict, steps: int) -> dict:
    import torch.distributed as dist

    from gnnpipe.atomic.atom_layouts import EDGES
    from gnnpipe.atomic.atomic_engine import Normalizer, StepCounts, step_loss
    from gnnpipe.atomic.parallel import EdgeGroup
    from gnnpipe.atomic.protocol import ATOMIC_MODELS
    from gnnpipe.parallel.comm import Communicator

    torch.manual_seed(0)
    model = ATOMIC_MODELS[kind].build(model_config(kind, cfg_kw))
    comm = Communicator()
    grp = EdgeGroup(comm, None, world, rank) if world > 1 else None
    _, g = EDGES.view(b, grp, torch.float32, None)
    norm = Normalizer(np.zeros(95), 1.0)
    counts = StepCounts(b["num_systems"], int((~b["fixed"]).sum()))
    saved: dict = {}

    def run():
        loss, *_ = step_loss(model, g, b, norm, counts, 10.0)
        loss.backward()

    times = []
    model.train()
    for step in range(steps + 1):
        comm.set_epoch(step)
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=False)
        if step == 1:  # measure the saved activations of one step
            saved = saved_by_rows(kind, model, g, run)
        else:
            run()
        if world > 1:
            comm.all_reduce_coalesced_([p.grad if p.grad is not None else torch.zeros_like(p)
                                        for p in model.parameters()])
        if step:
            times.append(time.perf_counter() - t0)
        if world > 1:
            dist.barrier()
    return {"step_s": float(np.median(times)), "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "saved_bytes": saved, "sent_bytes_step": comm.epoch_bytes(2),
            "local_triplets": g.num_local_triplets, "local_edges": g.num_local_edges}


def saved_by_rows(kind: str, model, g, step) -> dict:
    """Bytes kept for backward while ``step()`` runs, by row kind (distinct storages, parameters not)."""
    if kind == "dimenetpp":  # its triplet blocks have rows of their own
        from gnnpipe.atomic.dimenetpp_costs import saved_bytes_by_rows
        saved = saved_bytes_by_rows(model, g, step)
        if "edge" in saved:  # one part at P = 1 on symmetric graphs (rows = columns): comparable at every P
            saved["edge+column"] = saved["edge"] + saved["column"]
        return saved
    saved = {"triplet": 0, "edge": 0, "atom": 0, "other": 0}
    rows = {g.num_local_triplets: "triplet", g.num_local_edges: "edge", g.num_edges: "edge", g.num_atoms: "atom",
            g.atom_hi - g.atom_lo: "atom"}
    kmax = int(g.triplet_rank.max()) + 1 if g.triplet_rank is not None and g.triplet_rank.numel() else 0
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.numel() and t.is_floating_point() and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            dims = [d for d in t.shape if d != 1] or [1]
            padded = t.dim() == 3 and dims[0] == g.num_local_edges and kmax in dims[1:]  # (E_loc, K, w) triplet slots
            saved["triplet" if padded else rows.get(int(dims[0]), "other")] += t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return saved


def bench_model(kind: str, cfg_kw: dict, b: dict, workers: list[int], steps: int) -> dict:
    from gnnpipe.atomic.protocol import ATOMIC_MODELS
    from gnnpipe.parallel.testing import spawn_multi_process

    entry, cfg = ATOMIC_MODELS[kind], model_config(kind, cfg_kw)
    params = entry.count_parameters(cfg)
    n_sys, atoms, edges, triplets = b["num_systems"], len(b["z"]), len(b["edge_src"]), len(b["idx_kj"])
    out = {"kind": kind, "model": cfg_kw, "parameters": params, "runs": []}
    print(f"{entry.labels[cfg.force_head]}: {params:,} parameters", file=sys.stderr)
    for p in workers:
        res = spawn_multi_process(_work, p, b, kind, cfg_kw, steps, timeout=3600)
        closed = entry.step_bytes(cfg, [edges], [atoms], [n_sys], p, 4, params)
        est = entry.memory_per_worker(cfg, atoms, edges, triplets, p, 4,
                                      **(entry.batch_counts(b, p) if entry.batch_counts else {}))
        if "column" in est:
            est["edge+column"] = est["edge"] + est["column"]
        parts = list(res[0]["saved_bytes"])
        row = {"workers": p, "systems_per_s": n_sys / max(r["step_s"] for r in res),
               "peak_rss_bytes_max": max(r["peak_rss_bytes"] for r in res),
               **{f"saved_{k}_bytes_max": max(r["saved_bytes"][k] for r in res) for k in parts},
               "estimate_bytes": est,
               "bytes_per_step_measured": sum(r["sent_bytes_step"] for r in res),
               "bytes_per_step_closed_form": closed, "per_rank": res}
        out["runs"].append(row)
        mib = 2**20
        shown = ", ".join(f"{k} {row[f'saved_{k}_bytes_max'] / mib:.1f}" + (f" ({est[k] / mib:.1f})" if k in est else "")
                          for k in parts if k != "other")
        print(f"  P={p}: {row['systems_per_s']:.2f} systems/s, peak RSS {row['peak_rss_bytes_max'] / mib:.0f} MiB; "
              f"saved for backward, MiB (estimate): {shown}; bytes/step {row['bytes_per_step_measured']:,} "
              f"(closed form {closed:,})", file=sys.stderr)
    base = out["runs"][0]
    for row in out["runs"]:
        row["saved_ratio_to_p1"] = {k[6:-10]: row[k] / base[k] if base[k] else None for k in row
                                    if k.startswith("saved_") and k.endswith("_bytes_max") and k in base
                                    and k != "saved_other_bytes_max"}
    return out


def pyg(cfg_kw: dict, quick: bool) -> dict:
    """bench_dimenet_pyg.pyg_ratio on this model (one thread), where that benchmark exists."""
    try:
        from bench_dimenet_pyg import pyg_ratio
    except ImportError as e:
        return {"time_ratio": None, "note": f"benchmarks/bench_dimenet_pyg.py not available ({e})"}
    torch.set_num_threads(1)
    return pyg_ratio(cfg_kw, 4 if quick else 16, repeats=4 if quick else 10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench/atomic.json")
    ap.add_argument("--quick", action="store_true", help="small models and batch (seconds)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--no-pyg", dest="pyg", action="store_false", help="skip the PyG ratio")
    here = Path(__file__).resolve()
    sys.path[:0] = [str(here.parents[1] / "src"), str(here.parent)]
    from gnnpipe.atomic import data
    from gnnpipe.io import write_json
    from smoke import parse_args

    a = parse_args(ap, argv, quick=True, workers=[2], pyg=False)  # PyG: bench_dimenet_pyg's smoke

    n_sys = 2 if a.quick else 8
    systems = data.generate(n_sys, seed=1, progress=False)
    graphs = data.build_graphs(systems, CUTOFF, MAX_NEIGHBORS, progress=False)
    b = data.batch_arrays(systems, graphs, list(range(n_sys)))
    out = {"systems": n_sys, "atoms": int(len(b["z"])), "edges": int(len(b["edge_src"])),
           "triplets": int(len(b["idx_kj"])), "cutoff": CUTOFF, "max_neighbors": MAX_NEIGHBORS, "models": {}}
    print(f"batch: {n_sys} systems, {out['atoms']} atoms, {out['edges']} edges, {out['triplets']} triplets",
          file=sys.stderr)
    for kind in a.models:
        cfg_kw = MODELS[kind][1 if a.quick else 0]
        out["models"][kind] = bench_model(kind, cfg_kw, b, a.workers, 2 if a.quick else 3)
        if kind == "dimenetpp" and a.pyg:
            out["models"][kind]["pyg"] = ratio = pyg(cfg_kw, a.quick)
            if ratio.get("time_ratio") is not None:
                print(f"  DimeNet++ / PyG per step: time {ratio['time_ratio']:.2f}, saved memory "
                      f"{ratio['saved_bytes_ratio']:.2f} ({ratio['systems']} slabs)", file=sys.stderr)
    write_json(a.out, out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
