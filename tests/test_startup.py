"""What every job of the workflow pays before its work: the ``gnnpipe`` command's start-up (#36).

Jobs that need no tensors (build_graph, partition, locality, plan_stats, and ``gnnpipe launch``,
which stays alive beside the training it started) must not import torch or MLflow for the
command line's parser: ~3 s of CPU and ~200 MB resident each, measured on this machine."""

import subprocess
import sys

from gnnpipe.cli import main
from helpers import ROOT


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
