"""DGL 2.1 side of the single-process epoch benchmark (runs in the DGL environment).

    $(DGL_VENV)/bin/python benchmarks/dgl_epoch.py --graph graph.h5 --model gcn --threads 2

Builds the same 2-layer model with ``dgl.nn`` on the same graph.h5 and prints one JSON
line with the median epoch time (forward + backward + Adam step) over timed epochs.
Only numpy, h5py, torch and dgl are imported: gnnpipe is not needed here.
"""

import argparse
import json
import statistics
import time

import h5py
import numpy as np
import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graph", required=True)
    ap.add_argument("--model", choices=["gcn", "sage"], default="gcn")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import dgl
    import dgl.nn as dglnn

    with h5py.File(a.graph, "r") as f:
        indptr, indices = f["indptr"][()], f["indices"][()]
        x = torch.from_numpy(f["features"][()])
        y = torch.from_numpy(f["labels"][()])
        train = torch.from_numpy(f["train_mask"][()])
        classes = int(f.attrs["num_classes"])
    n = len(indptr) - 1
    dst = np.repeat(np.arange(n), np.diff(indptr))
    g = dgl.graph((torch.from_numpy(indices), torch.from_numpy(dst)), num_nodes=n)
    if a.model == "gcn":
        g = dgl.add_self_loop(g)
        layers = [dglnn.GraphConv(x.shape[1], a.hidden, norm="both"), dglnn.GraphConv(a.hidden, classes, norm="both")]
    else:
        layers = [dglnn.SAGEConv(x.shape[1], a.hidden, "mean"), dglnn.SAGEConv(a.hidden, classes, "mean")]
    model = torch.nn.ModuleList(layers)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    times = []
    for epoch in range(a.warmup + a.epochs):
        t0 = time.perf_counter()
        opt.zero_grad()
        h = torch.relu(model[0](g, x))
        out = model[1](g, h)
        loss = torch.nn.functional.cross_entropy(out[train], y[train])
        loss.backward()
        opt.step()
        if epoch >= a.warmup:
            times.append(time.perf_counter() - t0)
    print(json.dumps({"framework": "dgl", "dgl_version": dgl.__version__, "torch_version": torch.__version__,
                      "model": a.model, "threads": a.threads, "epoch_time_s": statistics.median(times),
                      "epoch_times_s": times}))


if __name__ == "__main__":
    main()
