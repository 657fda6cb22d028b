"""Foundation benchmark: the pipeline's stages at 10^6 nodes / 2*10^7 edges, and our
single-process epoch against DGL 2.1 on the same graph.

    .venv/bin/python benchmarks/bench_foundation.py --out results/bench/foundation.json
    .venv/bin/python benchmarks/bench_foundation.py --nodes 100000 --out /tmp/f.json   # quicker
    .venv/bin/python benchmarks/bench_foundation.py --smoke --out /tmp/f.json   # 2,100 nodes, one epoch

Times (wall clock, this machine): synthetic generation, writing graph.h5, METIS into
``--parts`` parts, materialising the chunk store, and the median single-process epoch
(forward + backward + Adam) of a 2-layer GCN and GraphSAGE with ``--threads`` threads.
When the DGL environment exists (``make dgl-env``; or ``--dgl-python``), the same
2-layer models run through ``dgl.nn`` on the same graph file (benchmarks/dgl_epoch.py)
and the JSON carries the ratio DGL / ours (target: >= 1.5).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gnnpipe.config import ModelConfig, SyntheticConfig, TrainingConfig
from gnnpipe.data.synthetic import generate
from gnnpipe.engine import ce_sum, graph_tensors, make_optimizer, retain_freed_memory
from gnnpipe.graph import read_graph, write_graph
from gnnpipe.io import write_json
from gnnpipe.models.block import Block
from gnnpipe.models.model import GNN
from gnnpipe.partition import node_order, partition_graph, partition_stats
from gnnpipe.store import materialize
from smoke import parse_args

DEFAULT_DGL = Path.home() / ".cache" / "gnnpipe" / "dgl-venv" / "bin" / "python"


def timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0


def our_step(graph_path: Path, kind: str, hidden: int, threads: int, layers: int = 2, order: str = "locality"):
    """A fresh model on the graph file and a function that trains it one epoch
    (forward + backward + Adam) and returns the epoch's wall time. The process is set up as
    ``gnnpipe.train.run`` sets up a training process (threads, ``retain_freed_memory``) and the
    nodes numbered as the single engine numbers them (``order``: ``training.node_order``)."""
    torch.set_num_threads(threads)
    retain_freed_memory()
    graph = read_graph(graph_path, verify=False)
    how = node_order(graph, order)
    if how["parts"]:
        graph = graph.renumbered(how.pop("order"))
    block = Block.full(graph.indptr, graph.indices)
    x, y, masks = graph_tensors(graph, torch.float32, "cpu")
    torch.manual_seed(0)
    model = GNN(ModelConfig(kind=kind, layers=layers, hidden=hidden, dropout=0.0), graph.num_features,
                graph.num_classes)
    opt = make_optimizer(model.parameters(), TrainingConfig(lr=0.01, weight_decay=0.0))
    n_train = int(masks["train"].sum())

    def epoch() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = ce_sum(model(x, block), y, masks["train"]) / n_train
        loss.backward()
        opt.step()
        return time.perf_counter() - t0
    return epoch


def our_epoch(graph_path: Path, kind: str, hidden: int, threads: int, epochs: int, warmup: int,
              layers: int = 2) -> dict:
    epoch = our_step(graph_path, kind, hidden, threads, layers)
    times = [epoch() for _ in range(warmup + epochs)][warmup:]
    return {"framework": "gnnpipe", "torch_version": torch.__version__, "model": kind, "layers": layers,
            "hidden": hidden, "threads": threads, "epoch_time_s": statistics.median(times), "epoch_times_s": times}


def dgl_command(python: Path, graph_path: Path, kind: str, hidden: int, threads: int, layers: int = 2,
                extra: tuple = ()) -> tuple[list[str], dict]:
    """The command line and environment of benchmarks/dgl_epoch.py in the DGL environment."""
    script = Path(__file__).with_name("dgl_epoch.py")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("PYTHONPATH", None)
    return [str(python), str(script), "--graph", str(graph_path), "--model", kind, "--hidden", str(hidden),
            "--layers", str(layers), "--threads", str(threads), *extra], env


def dgl_epoch(python: Path, graph_path: Path, kind: str, hidden: int, threads: int, epochs: int,
              layers: int = 2) -> dict:
    cmd, env = dgl_command(python, graph_path, kind, hidden, threads, layers, ("--epochs", str(epochs)))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        return {"framework": "dgl", "error": out.stderr.strip().splitlines()[-1:] or ["failed"]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench/foundation.json")
    ap.add_argument("--nodes", type=int, default=1_000_000)
    ap.add_argument("--avg-degree", type=float, default=20.0, help="stored CSR entries per node")
    ap.add_argument("--features", type=int, default=128)
    ap.add_argument("--parts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--dgl-python", type=Path, default=DEFAULT_DGL,
                    help="python of the DGL environment (make dgl-env); skipped when absent")
    ap.add_argument("--workdir", type=Path, help="keep the graph and store here (default: a temp dir)")
    a = parse_args(ap, argv, nodes=2100, avg_degree=8.0, features=16, parts=2, hidden=16, epochs=1)

    with tempfile.TemporaryDirectory(prefix="gnnpipe-bench-") as tmp:  # the graph and store: GBs at 10^6 nodes
        work = a.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        res: dict = {"benchmark": "foundation", "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                           "python": sys.version.split()[0], "torch": torch.__version__}}
        cfg = SyntheticConfig(shape="default", num_nodes=a.nodes, avg_degree=a.avg_degree, num_features=a.features)
        graph, t_gen = timed(generate, cfg)
        res["graph"] = {"num_nodes": graph.num_nodes, "num_edges": graph.num_edges, "num_features": graph.num_features}
        graph_path = work / "graph.h5"
        _, t_write = timed(write_graph, graph_path, graph)
        assignment, t_metis = timed(partition_graph, graph, "metis", a.parts)
        stats = partition_stats(graph, assignment)
        _, t_mat = timed(materialize, graph, assignment, work / f"metis-{a.parts}.h5", graph_hash=graph.content_hash())
        res["stages_s"] = {"generate": t_gen, "write_graph": t_write, f"metis_{a.parts}": t_metis, "materialize": t_mat}
        res["partition"] = {k: stats[k] for k in ("edge_cut", "mirrors_total", "mirrors_over_n", "edge_balance")}
        del graph
        res["epoch"] = {}
        for kind in ("gcn", "sage"):
            ours = our_epoch(graph_path, kind, a.hidden, a.threads, a.epochs, warmup=1)
            entry = {"gnnpipe_s": ours["epoch_time_s"]}
            if a.dgl_python.exists():
                theirs = dgl_epoch(a.dgl_python, graph_path, kind, a.hidden, a.threads, a.epochs)
                entry["dgl"] = theirs
                if "epoch_time_s" in theirs:
                    entry["dgl_s"] = theirs["epoch_time_s"]
                    entry["speedup_vs_dgl"] = theirs["epoch_time_s"] / ours["epoch_time_s"]
            else:
                entry["dgl"] = f"skipped: no DGL environment at {a.dgl_python} (make dgl-env)"
            res["epoch"][kind] = entry
            print(kind, json.dumps(entry), file=sys.stderr)
    write_json(a.out, res)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
