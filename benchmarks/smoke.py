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


def parse_args(ap: argparse.ArgumentParser, argv=None, **small) -> argparse.Namespace:
    """``ap.parse_args(argv)`` with a ``--smoke`` flag whose run takes ``small`` as its defaults."""
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, seconds: only that the benchmark still runs (its figures mean nothing)")
    a = ap.parse_args(argv)
    if a.smoke:
        ap.set_defaults(**small)
        a = ap.parse_args(argv)
    return a
