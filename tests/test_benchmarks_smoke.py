"""Every benchmark still runs (issue #37 item 21): each ``benchmarks/bench_*.py`` in its ``--smoke``
mode (``benchmarks/smoke.py``: tiny sizes, one epoch, one round), in this process (torch imported
once), with its JSON written. A benchmark is how a headline figure of docs/BENCHMARKS.md is
reproduced; without this, a change to the package breaks one silently until someone re-measures.
A new script in benchmarks/ is either a benchmark (``bench_<name>.py``, with a smoke mode) or a
helper named here."""

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
#: the scripts of benchmarks/ that are not benchmarks: the JSON's machine record, the runner, the
#: docs generator, this smoke mode, and bench_dgl's DGL side (run by bench_dgl's smoke where the
#: DGL environment exists)
HELPERS = {"machine.py", "run.py", "tables.py", "smoke.py", "dgl_epoch.py"}
#: multi-process (spawned ranks, torchrun, Snakemake): seconds each, not a fraction of one
SLOW = {"atom_layout", "atomic", "atomic_training", "calculator", "calibrate", "compare", "convergence", "domains",
        "domains_cap", "domains_train", "locality", "md", "memory_cap", "memory_modes", "modes", "narrow", "netem",
        "scale"}
#: a minute or more of their own (Snakemake chains, a whole-worker memory run): in ``make test-long``, which CI
#: runs too; the code they drive is covered in ``make test`` by test_atomic_workflow, test_domains and
#: test_domains_training
LONG = {"atomic_training", "domains", "domains_train"}
NAMES = sorted(p.stem.removeprefix("bench_") for p in BENCH.glob("bench_*.py"))


def test_every_script_is_a_benchmark_or_a_named_helper():
    assert {p.name for p in BENCH.glob("*.py") if not p.name.startswith("bench_")} == HELPERS
    assert SLOW <= set(NAMES) and LONG <= SLOW


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """One folder for every smoke run: bench_compare and bench_convergence share the smoke workflow
    there (``smoke.workflow``), so the second finds its jobs done."""
    return tmp_path_factory.mktemp("bench")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.long) if n in LONG else
                                  pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in NAMES])
def test_benchmark_runs_in_its_smoke_mode(name, work, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.chdir(work)  # what a benchmark writes under its default paths lands here
    threads = torch.get_num_threads()
    out = work / f"{name}.json"
    try:
        rc = importlib.import_module(f"bench_{name}").main(["--smoke", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc in (None, 0)
    assert json.loads(out.read_text())


def _options(script: Path) -> set:
    """The ``--options`` a benchmark's parser defines (its ``add_argument`` calls, read from its source)."""
    import ast

    return {a.value for node in ast.walk(ast.parse(script.read_text())) if isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "add_argument"
            for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}


def test_quick_passes_each_benchmark_only_options_it_has():
    """``benchmarks/run.py --quick`` once passed ``--quick`` to every benchmark without a size of its
    own, and ten of them stopped at argparse's error: each benchmark is listed, with options it defines."""
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.syspath_prepend(str(BENCH))
    try:
        quick = importlib.import_module("run").QUICK
    finally:
        monkeypatch.undo()
    assert set(quick) == set(NAMES)
    for name, args in quick.items():
        flags = {a for a in args if a.startswith("--")}
        assert flags <= _options(BENCH / f"bench_{name}.py"), name
