"""Shared I/O helpers: JSON that every tool can read."""

import json
import math
import os
import stat

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


# --------------------------------------------------------------------------- what an output path names (issue 37, item 1)
def _not_files(root):
    """Paths of things that are not regular files: each would be replaced by a rename over it."""
    import os
    import socket

    (root / "dir").mkdir()
    os.mkfifo(root / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(root / "sock"))
    sock.close()
    paths = {"a directory": root / "dir", "a FIFO": root / "fifo", "a socket": root / "sock"}
    try:  # a character device (/dev/null's numbers), as `mknod c 1 3` made one: root only
        os.mknod(root / "chr", 0o600 | __import__("stat").S_IFCHR, os.makedev(1, 3))
        paths["a character device"] = root / "chr"
    except PermissionError:
        pass
    return paths


def test_an_output_that_is_not_a_regular_file_is_refused_in_one_line_and_kept(tmp_path):
    """A rename over --out replaced /dev/full (and a mknod'ed device) with a regular file: every writer
    refuses whatever exists and is not a regular file, names it, and leaves it as it was."""
    import stat

    from gnnpipe import io as gio

    for kind, path in _not_files(tmp_path).items():
        mode = stat.S_IFMT(path.lstat().st_mode)
        for name, write in _writers().items():
            with pytest.raises(gio.WriteError) as err:
                write(path)
            assert str(err.value).startswith(f"{path}: is {kind}, not a regular file, and writing would replace "
                                              "it: name a "), (name, str(err.value))
            assert "\n" not in str(err.value) and stat.S_IFMT(path.lstat().st_mode) == mode, (name, kind)
    assert not [p for p in tmp_path.rglob(".*")], "a temporary file was left"


def test_a_symlinked_output_writes_its_target_atomically_and_keeps_the_link(tmp_path):
    from gnnpipe import io as gio

    (tmp_path / "store").mkdir()
    target = tmp_path / "store" / "metrics.json"
    target.write_text("old")
    link = tmp_path / "metrics.json"
    link.symlink_to(target)
    write_json(link, {"a": 1})
    assert link.is_symlink() and json.loads(target.read_text()) == {"a": 1}
    dangling = tmp_path / "new.txt"  # a link to a file still to be written: the target is created
    dangling.symlink_to(tmp_path / "store" / "new.txt")
    gio.write_text(dangling, "x")
    assert dangling.is_symlink() and (tmp_path / "store" / "new.txt").read_text() == "x"
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["metrics.json", "new.txt"]
    to_dir = tmp_path / "to-dir"
    to_dir.symlink_to(tmp_path / "store")
    with pytest.raises(gio.WriteError, match=rf"^{to_dir}: is a directory \(a symlink to {tmp_path / 'store'}\)"):
        gio.write_text(to_dir, "x")


def test_streams_are_written_through_without_a_rename(capfd):
    from gnnpipe import io as gio

    write_json("/dev/stdout", {"a": 1})
    gio.write_text("/dev/stderr", "to stderr\n")
    gio.write_text("/dev/null", "discarded")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)  # written through, still the device (a rename would replace it)
    out, err = capfd.readouterr()
    assert json.loads(out) == {"a": 1} and err == "to stderr\n"
    assert gio.check_destination("/dev/stdout") == gio.Path("/dev/stdout")


def test_an_empty_path_and_an_unwritable_place_are_refused_in_one_line(tmp_path):
    from gnnpipe import io as gio

    with pytest.raises(gio.WriteError, match="^--out: an empty path names no file; give the file to write$"):
        gio.check_destination("", "--out")
    with pytest.raises(gio.WriteError, match="^output: an empty path"):
        gio.write_text("", "x")
    with pytest.raises(gio.WriteError, match="^--plots: an empty path names no directory"):
        gio.check_directory("", "--plots")
    (tmp_path / "file").write_text("")
    for path in (tmp_path / "file" / "x.json", tmp_path / "file" / "a" / "x.json"):
        with pytest.raises(gio.WriteError, match=rf"^{path}: cannot write there: {tmp_path / 'file'} is not a "
                                                 "directory; name a directory"):
            write_json(path, {})
    with pytest.raises(gio.WriteError, match=rf"^{tmp_path / 'file'}: cannot write there: .* is not a directory"):
        gio.check_directory(tmp_path / "file", "--trajectories")


@pytest.fixture
def read_only_dir(tmp_path, monkeypatch):
    """A directory on a read-only file system: a read-only tmpfs where this process may mount one
    (root), else the answers of one (``os.access`` says no, ``statvfs`` says ST_RDONLY)."""
    import os
    import subprocess

    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                             capture_output=True).returncode == 0 if os.geteuid() == 0 else False
    if not mounted:
        access, statvfs = os.access, os.statvfs
        monkeypatch.setattr(os, "access", lambda p, m, **k: False if str(p).startswith(str(ro)) else access(p, m, **k))
        monkeypatch.setattr(os, "statvfs", lambda p: type("V", (), {"f_flag": os.ST_RDONLY})()
                            if str(p).startswith(str(ro)) else statvfs(p))
    yield ro
    if mounted:
        subprocess.run(["umount", str(ro)], check=True)


def test_a_read_only_file_system_is_refused_with_its_own_advice(read_only_dir):
    """EROFS was reported with the disk-full advice ("free space on that file system")."""
    import errno

    from gnnpipe import io as gio

    advice = ("cannot write it: Read-only file system (EROFS); nothing was replaced: that file system is "
              "read-only: write to another one (or remount it read-write) and rerun")
    for path in (read_only_dir / "report.md", read_only_dir / "sub" / "report.md"):
        with pytest.raises(gio.WriteError) as err:
            gio.write_text(path, "x")
        assert str(err.value) == f"{path}: {advice}"
    with pytest.raises(gio.WriteError, match="Read-only file system"):
        gio.check_directory(read_only_dir / "relax", "--trajectories")
    # a file system remounted read-only while a file is written: the same advice, not the disk-full one
    assert str(gio.write_error("x.pt", OSError(errno.EROFS, "Read-only file system"))) == f"x.pt: {advice}"


def test_empty_files_are_refused_by_name_not_with_an_empty_reason(tmp_path):
    from gnnpipe import io as gio
    from gnnpipe.atomic.modelfile import load_model_file
    from gnnpipe.checkpoint import load_checkpoint

    (tmp_path / "model.pt").write_bytes(b"")
    for load, fix in ((load_checkpoint, "delete it and re-run 'train'"), (load_model_file, "write it again")):
        with pytest.raises(gio.GnnPipeError) as err:
            load(tmp_path / "model.pt")
        assert str(err.value).startswith(f"{tmp_path / 'model.pt'}: empty (0 bytes: a write cut short?), not a ")
        assert fix in str(err.value) and "()" not in str(err.value)
    from gnnpipe.checkpoint import load_shard, resume_dir

    shard = resume_dir(tmp_path) / "epoch-000001" / "rank-0.pt"  # a resume round's shard likewise
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"")
    with pytest.raises(gio.GnnPipeError, match=rf"^{shard}: empty \(0 bytes: a write cut short\?\), not a checkpoint;"):
        load_shard(tmp_path, {"dir": "epoch-000001"}, 0)


def _subcommands():
    import argparse

    from gnnpipe.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


OUTPUT_DESTS = {"out", "stats", "predictions", "trajectories", "plots"}  # what a command writes where the user says
NOT_OUTPUTS = {("plan", "stats"), ("report", "predictions")}  # files they read: plan --stats a statistics JSON,
# report --predictions the cost model's predictions (rule cost_predictions)


def _outputs(command, parser) -> set:
    return {a.dest for a in parser._actions if a.dest in OUTPUT_DESTS and (command, a.dest) not in NOT_OUTPUTS}


@pytest.mark.parametrize("command", sorted(n for n, p in _subcommands().items() if _outputs(n, p)))
def test_every_command_refuses_an_unwritable_output_before_its_work(tmp_path, capsys, command):
    """predict --out <a directory> (or '') failed with a traceback after computing everything, relax
    --trajectories onto a file likewise: every command's outputs are declared and checked first (its
    inputs here do not exist: the refusal names the output, so no input was read)."""
    from gnnpipe.cli import main

    parser = _subcommands()[command]
    declared = parser.get_default("outputs") or (), parser.get_default("output_dirs") or ()
    dests = _outputs(command, parser)
    assert dests == set(declared[0]) | set(declared[1]), f"{command}: declare its outputs in set_defaults"
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "a-file").write_text("")
    required = {a.dest: "1" if a.type in (int, float) else str(tmp_path / f"ok-{a.dest}") if a.dest in dests
                else "/no/such/input" for a in parser._actions if a.required and a.option_strings}
    positional = ["/no/such/input" for a in parser._actions if not a.option_strings]  # import-model's CKPT
    for dest in sorted(dests):
        bad = tmp_path / ("a-file" if dest in declared[1] else "a-dir")
        for value, message in ((str(bad), f"gnnpipe: error: {bad}: "), ("", f"gnnpipe: error: --{dest}: an empty path")):
            argv = [x for k, v in {**required, dest: value}.items() for x in (f"--{k.replace('_', '-')}", v)]
            assert main([command, *positional, *argv]) == 2, (command, dest, value)
            err = capsys.readouterr().err
            assert err.startswith(message) and err.count("\n") == 1, (command, dest, err)
