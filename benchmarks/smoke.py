"""``--smoke``: a benchmark's tiny run, that it still runs (tests/test_benchmarks_smoke.py, ``make test``).

    from smoke import parse_args
    a = parse_args(ap, argv, nodes=300, epochs=1)   # instead of ap.parse_args(argv)

A benchmark is how a headline figure of docs/BENCHMARKS.md is reproduced, and a change to the
package can break one long after its figure was measured (issue #37: a config key renamed). With
``--smoke`` the keyword arguments replace the parser's defaults (arguments given on the command
line still win): tiny sizes, one epoch, one round, seconds; no root and no DGL environment where
they are not the point (the benchmark's docstring says what its smoke run leaves out). Its
figures mean nothing; it proves that the configs load, the calls match and the JSON is written.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from gnnpipe.io import write_text

ROOT = Path(__file__).resolve().parent.parent


def parse_args(ap: argparse.ArgumentParser, argv=None, **small) -> argparse.Namespace:
    """``ap.parse_args(argv)`` with a ``--smoke`` flag whose run takes ``small`` as its defaults."""
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, seconds: only that the benchmark still runs (its figures mean nothing)")
    a = ap.parse_args(argv)
    if a.smoke:
        ap.set_defaults(**small)
        a = ap.parse_args(argv)
    return a


def workflow(out: str) -> tuple[Path, Path]:
    """The smoke run's workflow config and Snakemake directory (``.test/bench.yaml``, its results
    beside ``out`` in ``smoke-workflow/``): the benchmarks that run the workflow share it, so the
    second finds its jobs done."""
    work = Path(out).resolve().parent / "smoke-workflow"
    conf = yaml.safe_load((ROOT / ".test" / "bench.yaml").read_text())
    conf["results"] = str(work / "results")
    work.mkdir(parents=True, exist_ok=True)
    write_text(work / "config.yaml", yaml.safe_dump(conf, sort_keys=False))
    return work / "config.yaml", work


def snakemake(directory: Path, config: Path, cores: str) -> list[str]:
    """The command line of this repository's workflow on ``config`` in ``directory``."""
    return [str(Path(sys.executable).with_name("snakemake")), "-s", str(ROOT / "Snakefile"), "--directory",
            str(directory), "--cores", cores, "--configfile", str(config), "--replace-workflow-config"]


def venv_env() -> dict:
    """This environment with the interpreter's bin first on PATH (the rules' ``gnnpipe``)."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
