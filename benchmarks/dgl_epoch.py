"""DGL 2.1 side of the single-process epoch benchmark (runs in the DGL environment).

    $(DGL_VENV)/bin/python benchmarks/dgl_epoch.py --graph graph.h5 --model gcn --threads 2
    $(DGL_VENV)/bin/python benchmarks/dgl_epoch.py --graph graph.h5 --model sage --serve   # driven by bench_dgl

Builds the same ``--layers``-layer model (hidden width ``--hidden``, ReLU between layers, no
dropout) with ``dgl.nn`` on the same graph.h5 and prints one JSON line with the median epoch
time (forward + backward + Adam step) over timed epochs.
Only numpy, h5py, torch and dgl are imported: gnnpipe is not needed here.
"""

import argparse
import json
import statistics
import sys
import time

import h5py
import numpy as np
import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graph", required=True)
    ap.add_argument("--model", choices=["gcn", "sage"], default="gcn")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--serve", action="store_true",
                    help="print the set-up as one JSON line, then run one epoch per line read from stdin "
                         "and print its time (so that a driver can interleave epochs with another framework's)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import dgl
    import dgl.nn as dglnn

    with h5py.File(a.graph, "r") as f:
        indptr, indices = f["indptr"][()], f["indices"][()].astype(np.int64)  # graph.h5 v2: int32 ids; DGL wants one dtype
        x = torch.from_numpy(f["features"][()])
        y = torch.from_numpy(f["labels"][()])
        train = torch.from_numpy(f["train_mask"][()])
        classes = int(f.attrs["num_classes"])
    n = len(indptr) - 1
    dst = np.repeat(np.arange(n), np.diff(indptr))
    g = dgl.graph((torch.from_numpy(indices), torch.from_numpy(dst)), num_nodes=n)
    dims = [x.shape[1]] + [a.hidden] * (a.layers - 1) + [classes]
    if a.model == "gcn":
        g = dgl.add_self_loop(g)
        layers = [dglnn.GraphConv(i, o, norm="both") for i, o in zip(dims, dims[1:])]
    else:
        layers = [dglnn.SAGEConv(i, o, "mean") for i, o in zip(dims, dims[1:])]
    model = torch.nn.ModuleList(layers)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def epoch() -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        h = x
        for i, layer in enumerate(model):
            h = layer(g, h)
            if i < len(model) - 1:
                h = torch.relu(h)
        loss = torch.nn.functional.cross_entropy(h[train], y[train])
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    info = {"framework": "dgl", "dgl_version": dgl.__version__, "torch_version": torch.__version__,
            "model": a.model, "layers": a.layers, "hidden": a.hidden, "threads": a.threads}
    if a.serve:  # one epoch per line read, its time printed back (benchmarks/bench_dgl.py)
        print(json.dumps(info), flush=True)
        for _ in sys.stdin:
            print(json.dumps({"epoch_time_s": epoch()}), flush=True)
        return
    times = [epoch() for _ in range(a.warmup + a.epochs)][a.warmup:]
    print(json.dumps({**info, "epoch_time_s": statistics.median(times), "epoch_times_s": times}))

if __name__ == "__main__":
    main()
