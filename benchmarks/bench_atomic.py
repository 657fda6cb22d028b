"""Edge/triplet graph parallelism of DimeNet++: throughput and per-worker memory at P = 1, 2, 4.

    python benchmarks/bench_atomic.py --out results/bench/atomic.json [--quick]

One batch of EMT slab systems (gnnpipe.atomic.data) and a DimeNet++ that is large for this
machine (hidden 256, 4 blocks, triplet width 128; energy + gradient-force training steps,
i.e. double backward) on P gloo workers (spawned, one thread each). Per P: systems/s,
each worker's peak RSS, and the activation memory autograd keeps for backward, measured by
``saved_tensors_hooks`` (``engine.saved_bytes_by_rows``) and split by what a tensor's rows are,
beside ``memory_per_worker``'s estimate of each part (with the batch's block counts at P):
local edges (and triplet-block rows), triplet-block columns (the input edges a way's triplets
read: radial basis, per-column messages), triplet-block entries (the angular basis) and atoms.
Edges, entries and atoms divide by P; columns only while each way's edges cover whole systems.
Also the bytes the ledger counted per step against the closed form (``step_bytes``).
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


PARTS = ("edge", "column", "entry", "atom")


def _work(rank: int, world: int, b: dict, cfg_kw: dict, steps: int) -> dict:
    import torch.distributed as dist

    from gnnpipe.atomic.dimenetpp import DimeNetPP, DimeNetPPConfig
    from gnnpipe.atomic.engine import Normalizer, StepCounts, rank_view, saved_bytes_by_rows, step_loss
    from gnnpipe.atomic.parallel import EdgeGroup
    from gnnpipe.parallel.comm import Communicator

    torch.manual_seed(0)
    model = DimeNetPP(DimeNetPPConfig(**cfg_kw))
    comm = Communicator()
    grp = EdgeGroup(comm, None, world, rank) if world > 1 else None
    g = rank_view(b, grp, torch.float32, None)
    norm = Normalizer(np.zeros(95), 1.0)
    counts = StepCounts(b["num_systems"], int((~b["fixed"]).sum()))
    saved = {}

    def run():
        loss, *_ = step_loss(model, g, b, norm, counts, 10.0)
        loss.backward()

    times = []
    for step in range(steps + 1):
        comm.set_epoch(step)
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=False)
        if step == 1:  # measure the saved activations of one step
            saved = saved_bytes_by_rows(model, g, run)
        else:
            run()
        if world > 1:
            comm.all_reduce_coalesced_([p.grad for p in model.parameters()])
        if step:
            times.append(time.perf_counter() - t0)
        if world > 1:
            dist.barrier()
    return {"step_s": float(np.median(times)), "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "saved_bytes": saved, "sent_bytes_step": comm.epoch_bytes(2),
            "local_triplets": g.num_local_triplets, "local_edges": g.num_local_edges}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench/atomic.json")
    ap.add_argument("--quick", action="store_true", help="a small model and batch (seconds)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from gnnpipe.atomic import data
    from gnnpipe.atomic.dimenetpp import DimeNetPPConfig, count_parameters
    from gnnpipe.atomic.engine import block_counts, memory_per_worker, step_bytes
    from gnnpipe.parallel.testing import spawn_multi_process

    n_sys = 2 if a.quick else 8
    cfg_kw = (dict(hidden_channels=40, num_blocks=2, int_emb_size=16, out_emb_channels=40) if a.quick else
              dict(hidden_channels=256, num_blocks=4, int_emb_size=128, basis_emb_size=8, out_emb_channels=256))
    cfg_kw["cutoff"] = 5.0
    systems = data.generate(n_sys, seed=1, progress=False)
    graphs = data.build_graphs(systems, 5.0, 24, progress=False)
    b = data.batch_arrays(systems, graphs, list(range(n_sys)))
    cfg = DimeNetPPConfig(**cfg_kw)
    params = count_parameters(cfg)
    out = {"systems": n_sys, "atoms": int(len(b["z"])), "edges": int(len(b["edge_src"])),
           "triplets": int(len(b["idx_kj"])), "parameters": params, "model": cfg_kw, "runs": []}
    print(f"batch: {n_sys} systems, {out['atoms']} atoms, {out['edges']} edges, {out['triplets']} triplets; "
          f"DimeNet++ {params:,} parameters", file=sys.stderr)
    for p in a.workers:
        res = spawn_multi_process(_work, p, b, cfg_kw, 2 if a.quick else 3, timeout=1800)
        closed = step_bytes(cfg, [out["edges"]], [out["atoms"]], [n_sys], p, 4, params)
        est = memory_per_worker(cfg, out["atoms"], out["edges"], out["triplets"], p, 4, **block_counts(b, p))
        row = {"workers": p, "systems_per_s": n_sys / max(r["step_s"] for r in res),
               "peak_rss_bytes_max": max(r["peak_rss_bytes"] for r in res),
               **{f"saved_{k}_bytes_max": max(r["saved_bytes"][k] for r in res) for k in PARTS},
               **{f"estimated_{k}_bytes": est[k] for k in PARTS},
               "bytes_per_step_measured": sum(r["sent_bytes_step"] for r in res),
               "bytes_per_step_closed_form": closed, "per_rank": res}
        out["runs"].append(row)
        parts = ", ".join(f"{k} {row[f'saved_{k}_bytes_max'] / 2**20:.1f} ({est[k] / 2**20:.1f})" for k in PARTS)
        print(f"P={p}: {row['systems_per_s']:.2f} systems/s, peak RSS {row['peak_rss_bytes_max'] / 2**20:.0f} MiB, "
              f"saved MiB (estimate): {parts}; bytes/step {row['bytes_per_step_measured']:,} "
              f"(closed form {closed:,})", file=sys.stderr)
    base = out["runs"][0]
    for row in out["runs"]:
        row["saved_ratio_to_p1"] = {k: row[f"saved_{k}_bytes_max"] / base[f"saved_{k}_bytes_max"]
                                    if base[f"saved_{k}_bytes_max"] else None for k in PARTS}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
