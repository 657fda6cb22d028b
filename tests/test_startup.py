"""What every job of the workflow pays before its work: the ``gnnpipe`` command's start-up (#36).

Jobs that need no tensors (build_graph, partition, locality, plan_stats, and ``gnnpipe launch``,
which stays alive beside the training it started) must not import torch or MLflow for the
command line's parser: ~3 s of CPU and ~200 MB resident each, measured on this machine."""

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
