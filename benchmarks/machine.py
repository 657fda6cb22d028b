"""The ``machine`` entry of a benchmark's JSON: what ran it, and the load before and after.

    from machine import machine_record
    load0 = os.getloadavg()            # when the benchmark starts
    ...
    out["machine"] = machine_record(load0)

``benchmarks/tables.py`` reads ``loadavg_before`` / ``loadavg_after`` into the provenance line.
"""

from __future__ import annotations

import os
import platform
import sys


def machine_record(loadavg_before) -> dict:
    """Platform, Python, CPU count, torch version and the 1/5/15-minute load averages before (as
    given) and now."""
    import torch

    return {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count(),
            "torch": torch.__version__, "loadavg_before": list(loadavg_before), "loadavg_after": list(os.getloadavg())}
