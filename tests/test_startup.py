"""What every job of the workflow pays before its work: the ``gnnpipe`` command's start-up (#36).

Jobs that need no tensors (build_graph, partition, locality, plan_stats, and ``gnnpipe launch``,
which stays alive beside the training it started) must not import torch or MLflow for the
command line's parser: ~3 s of CPU and ~200 MB resident each, measured on this machine."""

import ast
import json
import subprocess
import sys

from gnnpipe.cli import main
from gnnpipe.graph import write_graph
from helpers import ROOT, random_graph


def test_the_command_line_parser_imports_no_torch():
    code = ("import sys; from gnnpipe.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'mlflow') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "[]"


def test_plan_refuses_a_kind_without_graph_layers_in_one_line(tmp_path, capsys):
    """--kind takes every kind's name (the parser asks no entry); mlp, without graph layers, is
    refused after parsing, in one line naming the kinds the cost model prices."""
    rc = main(["plan", "--graph", str(tmp_path / "g.h5"), "--hardware", "cpu-2core", "--workers", "2",
               "--kind", "mlp"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "gnnpipe: error: plan: --kind mlp has no graph layers, so no cost model; use one of gcn, sage" in err


def test_materialize_writes_a_store_without_importing_torch(tmp_path):
    """``materialize`` (a set-up job per partition) reads a graph, an assignment and writes HDF5:
    importing torch for it cost each job seconds (``store.py`` builds torch blocks for the
    engines, lazily). The store it writes still opens and builds a block where torch is loaded."""
    graph = random_graph(200)
    write_graph(tmp_path / "g.h5", graph)
    code = ("import sys, numpy as np\n"
            "from gnnpipe.graph import read_graph\n"
            "from gnnpipe.store import materialize\n"
            f"g = read_graph({str(tmp_path / 'g.h5')!r})\n"
            f"materialize(g, np.arange(g.num_nodes) % 2, {str(tmp_path / 's.h5')!r}, "
            "graph_hash=g.content_hash(), method='x-2')\n"
            "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "False"
    import torch

    from gnnpipe.store import ChunkStore

    block = ChunkStore(tmp_path / "s.h5").local_block(0)
    assert block.n_dst == 100 and block.deg_dst.dtype == torch.float32


def test_the_report_imports_no_torch_for_runs_it_cannot_predict(tmp_path):
    """``gnnpipe report`` imports neither torch (through the cost model's stage split) nor scipy (through
    the partitioner) to load: ~3.5 s of a 10-run report (#36). Runs without a ``run.yaml`` are not
    predicted, so a report of them never needs torch; the plots are written all the same."""
    root = tmp_path / "runs" / "r1"
    root.mkdir(parents=True)
    history = [{"epoch": e, "loss": 1.0 / (e + 1), "epoch_time_s": 0.1, "compute_s": 0.1, "comm_s": 0.0,
                "bubble_s": 0.0, "comm_bytes": 0, "train_acc": 0.5, "val_acc": 0.5, "test_acc": 0.5}
               for e in range(3)]
    (root / "metrics.json").write_text(json.dumps(
        {"run_id": "r1", "mode": "single", "dataset": "d", "num_nodes": 10, "num_edges": 20, "in_features": 4,
         "model": "gcn", "layers": 2, "hidden": 8, "world_size": 1, "stages": 1, "ways": 1, "chunks": 1,
         "epochs": 3, "dtype_bytes": 4, "epoch_time_s": 0.1, "comm_bytes_per_epoch": 0,
         "epoch_time_breakdown_s": {"compute": 0.1, "comm": 0.0, "bubble": 0.0}, "comm_bytes_predicted": 0,
         "peak_mem_bytes": 10**6, "train_acc": 0.5, "val_acc": 0.5, "test_acc": 0.5, "final_loss": 1.0,
         "history": history}))
    assert _report_imports(tmp_path, ["--run", "r1"], ("torch", "scipy")) == []
    assert (tmp_path / "report.md").exists() and list((tmp_path / "plots").glob("*.png"))


def _report_imports(tmp_path, args: list, modules: tuple) -> list:
    """``gnnpipe report`` over ``tmp_path/runs`` (``args`` added) in a fresh process: which of ``modules``
    it imported (it must succeed)."""
    code = ("import sys\n"
            "from gnnpipe.cli import main\n"
            f"rc = main(['report', '--runs-dir', {str(tmp_path / 'runs')!r}, '--out', "
            f"{str(tmp_path / 'report.md')!r}, '--plots', {str(tmp_path / 'plots')!r}, *{args!r}])\n"
            f"print(rc, sorted(m for m in {modules!r} if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and done.stdout.startswith("0 "), done.stderr[-2000:]
    return ast.literal_eval(done.stdout.split("\n")[0][2:])


def test_the_report_with_the_workflows_predictions_imports_no_torch(tmp_path):
    """#36: in the workflow the report reads the cost model's predictions (rule cost_predictions) and
    imports no torch, even for runs it could predict (a run.yaml and its graph: the Predictor would
    build their model); it reads the file's predictions. Without the file it predicts, with torch."""
    import numpy as np

    from gnnpipe.graph import Graph, csr_from_edges, write_graph
    from gnnpipe.report.predictions import PREDICTIONS_KIND
    from test_report import _with_run_yaml, record, write_run

    n = 60
    src = np.repeat(np.arange(n), 2)
    indptr, indices = csr_from_edges(src, (src + np.tile([1, 2], n)) % n, n)
    mask = np.arange(n) % 2 == 0
    write_graph(tmp_path / "graph.h5", Graph(indptr, indices, np.ones((n, 8), np.float32), np.arange(n) % 3,
                                             mask, ~mask, ~mask, num_classes=3, name="ring"))
    rec = record("g2", "graph", model="gcn", layers=4, hidden=8, workers=2, ways=2)
    _with_run_yaml(write_run(tmp_path / "runs", rec), rec, tmp_path / "graph.h5")
    (tmp_path / "p.json").write_text(json.dumps(
        {"kind": PREDICTIONS_KIND, "format_version": 1, "hardware": "cpu-2core", "calibrated": [],
         "runs": {"g2": {"bytes": 123456789.0, "epoch_s": 0.5, "compute_s": 0.4, "comm_s": 0.1, "bubble_s": 0.0,
                         "peak_mem_bytes": 1e8, "reason": None}}}))
    for extra, torch in ((["--predictions", str(tmp_path / "p.json")], []), ([], ["torch"])):
        assert _report_imports(tmp_path, extra, ("torch",)) == torch
        assert ("1 of 1 runs predicted" in (tmp_path / "report.md").read_text()) and \
            ("| 123 MB |" in (tmp_path / "report.md").read_text()) == bool(extra)
