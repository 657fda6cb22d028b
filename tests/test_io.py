"""Shared I/O helpers: JSON that every tool can read."""

import json
import math

import numpy as np
import pytest

from gnnpipe.io import write_json


def test_write_json_turns_nan_and_infinities_into_null(tmp_path):
    path = tmp_path / "metrics.json"
    write_json(path, {"loss": float("nan"), "acc": np.float32("nan"), "t": [1.5, float("inf")],
                      "arr": np.array([np.nan, 2.0]), "nested": {"x": -math.inf, "ok": 3}})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    # strict parsing: Python's json accepts NaN unless told not to
    def refuse(c):
        raise ValueError(f"non-standard constant {c}")
    back = json.loads(text, parse_constant=refuse)
    assert back == {"loss": None, "acc": None, "t": [1.5, None], "arr": [None, 2.0],
                    "nested": {"x": None, "ok": 3}}


def test_write_json_leaves_the_old_file_on_an_unserialisable_object(tmp_path):
    path = tmp_path / "eval.json"
    write_json(path, {"a": 1})
    with pytest.raises(TypeError):
        write_json(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}


# --------------------------------------------------------------------------- permissions, full disks (issue 21)
def _writers():
    """Every way gnnpipe writes an output: JSON, text, torch, HDF5 (graph.h5)."""
    import torch

    from gnnpipe import io as gio
    from gnnpipe.graph import write_graph
    from helpers import random_graph

    def bare(p):  # any other output: the temp file and the rename alone (e.g. plots)
        with gio.atomic_path(p) as tmp:
            tmp.write_bytes(b"\0" * 200000)

    return {"metrics.json": lambda p: write_json(p, {"a": list(range(20000))}),
            "run.yaml": lambda p: gio.write_text(p, "x" * 200000),
            "model.pt": lambda p: gio.write_torch(p, {"w": torch.zeros(50000)}),
            "graph.h5": lambda p: write_graph(p, random_graph(n=2000, avg_degree=20)),
            "plot.png": bare}


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_outputs_honour_the_umask(tmp_path, umask):
    """mkstemp made every output 0600 while run.yaml (a shell redirect) was 0644: colleagues on a
    shared cluster could not read the results."""
    import os
    import stat

    old = os.umask(umask)
    try:
        for name, write in _writers().items():
            write(tmp_path / name)
            assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name
    finally:
        os.umask(old)


_FSIZE_SCRIPT = """
import resource, sys
sys.path.insert(0, {tests!r})
import test_io
from gnnpipe.io import GnnPipeError
writers = test_io._writers()
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.RLIM_INFINITY))
for name, write in writers.items():
    try:
        write({root!r} + "/" + name)
        print("WROTE", name)
    except GnnPipeError as e:
        print("ERROR", e)
"""


def test_a_write_past_a_file_size_limit_is_one_line_naming_the_file(tmp_path):
    """A file-size limit (ulimit -f, EFBIG) stands in for a full disk without root: whatever library
    writes (json, torch, h5py), the error names the file and the errno, and the old file stays."""
    import subprocess
    import sys
    from pathlib import Path

    for name in _writers():
        (tmp_path / name).write_text("old")
    script = _FSIZE_SCRIPT.format(tests=str(Path(__file__).parent), root=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == len(_writers()), proc.stdout
    for name, line in zip(_writers(), lines):
        assert line == (f"ERROR {tmp_path / name}: cannot write it: File too large (EFBIG); nothing was replaced: "
                        "free space on that file system (or raise the limit) and rerun"), line
        assert (tmp_path / name).read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(_writers())  # no temp file left


def test_torch_writes_report_enospc_not_torchs_stream_error(tmp_path, monkeypatch):
    """torch.save to a path on a full disk says "[enforce fail at inline_container.cc] unexpected pos";
    gnnpipe writes through a file object whose write says ENOSPC (here: a patched write)."""
    import torch

    from gnnpipe import io as gio
    from helpers import full_disk_open

    monkeypatch.setattr(gio, "open", full_disk_open(""), raising=False)
    path = tmp_path / "checkpoint.pt"
    with pytest.raises(gio.WriteError) as err:
        gio.write_torch(path, {"w": torch.zeros(10)})
    assert str(err.value).startswith(f"{path}: cannot write it: No space left on device (ENOSPC)")
    assert list(tmp_path.iterdir()) == []
