"""docs/BENCHMARKS.md's tables, regenerated from the benchmark JSONs committed beside this script.

    python benchmarks/tables.py                       # rewrite the tables between the doc's markers
    python benchmarks/tables.py --check               # exit 1 if the doc is not what the JSONs give
    python benchmarks/tables.py --collect compare plan   # first copy results/bench/<name>.json in

Every headline figure the project claims is one entry of ``benchmarks/figures.yaml``: what it
is, the value claimed and where, and its source: the command that measures it and either a
committed result (``json: <name>`` = ``benchmarks/results/<name>.json``, or ``file:`` any
committed JSON / YAML) from which the figure is read again (``get:`` a path of keys, list
indices and ``{key: value}`` selectors; ``ratio:`` two such paths; ``each:`` several;
``format:`` a Python format) or, where the JSON was not kept, the commit, date, machine and closing note it was
reported in. ``--collect NAME`` copies ``results/bench/NAME.json`` (or ``--from DIR``) to
``benchmarks/results/NAME.json`` with a ``provenance`` block: the commit (and whether the tree
had uncommitted changes), the JSON's modification time (UTC) and this machine. Results are
small files; keep them so.

The doc holds each generated block between ``<!-- tables:begin NAME -->`` and
``<!-- tables:end NAME -->``; the text around them is the doc's own. ``tests/test_benchmarks_doc.py``
checks that the committed doc equals what this script generates from the committed files.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FIGURES = HERE / "figures.yaml"
RESULTS = HERE / "results"
DOC = ROOT / "docs" / "BENCHMARKS.md"
DASH = "—"
MARKER = re.compile(r"(<!-- tables:begin (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- tables:end (?P=name) -->)", re.S)


# --------------------------------------------------------------------------- reading results
def load_result(src: dict, results: Path = RESULTS) -> Optional[dict]:
    """The committed result a source names (``json:`` or ``file:``), None when it has none."""
    if src.get("json"):
        path = results / f"{src['json']}.json"
    elif src.get("file"):
        path = ROOT / src["file"]
    else:
        return None
    if not path.is_file():
        raise SystemExit(f"tables: {path}: no such file (source {src['id']!r} in {FIGURES.name})")
    return json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())


def get(data: Any, path: list) -> Any:
    """``data`` followed along ``path``: dict keys, list indices, and ``{key: value}`` selectors
    (the one element of a list whose items match every pair)."""
    for step in path:
        if isinstance(step, dict):
            hits = [x for x in data if all(x.get(k) == v for k, v in step.items())]
            if len(hits) != 1:
                raise KeyError(f"selector {step} matches {len(hits)} elements, not 1")
            data = hits[0]
        else:
            data = data[step]
    return data


READS = ("get", "ratio", "each")


def value(fig: dict, data: Optional[dict]) -> str:
    """A figure's value read from its source's result (``get``: one path; ``ratio``: two, the
    first ÷ the second; ``each``: several, joined with " / "), formatted; "—" without one."""
    if data is None or not any(k in fig for k in READS):
        return DASH
    fmt = fig.get("format", "{}")

    def show(v) -> str:
        if isinstance(v, list):
            return " – ".join(fmt.format(x) for x in v) if v else "none"
        return DASH if v is None else fmt.format(v)

    try:
        if "ratio" in fig:
            a, b = (get(data, p) for p in fig["ratio"])
            return show(a / b)
        if "each" in fig:
            return " / ".join(show(get(data, p)) for p in fig["each"])
        return show(get(data, fig["get"]))
    except (KeyError, IndexError, TypeError, ZeroDivisionError) as e:
        raise SystemExit(f"tables: figure {fig['figure']!r}: {e!r}") from None


# --------------------------------------------------------------------------- tables
def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows])


def provenance(src: dict, data: Optional[dict], machines: dict) -> str:
    """Command, commit, date, machine and result file of a source, as one paragraph."""
    prov = (data or {}).get("provenance", {}) if src.get("json") else {}
    commit = prov.get("commit") or src.get("commit", DASH)
    if prov.get("dirty"):
        commit += " + uncommitted changes"
    machine = machines.get(src.get("machine"), src.get("machine", DASH))
    load = (data or {}).get("machine", {}) if src.get("json") else {}
    if load.get("loadavg_before") and load.get("loadavg_after"):
        machine += f"; 1-min load {load['loadavg_before'][0]:.1f} before, {load['loadavg_after'][0]:.1f} after"
    if src.get("json"):
        where = f"[`benchmarks/results/{src['json']}.json`](../benchmarks/results/{src['json']}.json)"
    elif src.get("file"):
        where = f"[`{src['file']}`](../{src['file']})"
    else:
        where = f"not kept — {src['kept']}"
    lines = [f"* command: `{src['command']}`", f"* commit: `{commit}`; date: {prov.get('date') or src.get('date', DASH)}",
             f"* machine: {machine}", f"* result: {where}"]
    return "\n".join(lines + ([f"* note: {src['note']}"] if src.get("note") else []))


def headline(manifest: dict, results: Path = RESULTS) -> str:
    """Every source of ``figures.yaml``: its provenance and its figures, claimed beside what its
    committed result says now."""
    parts = []
    for src in manifest["sources"]:
        data = load_result(src, results)
        rows = [[f["figure"], f["claimed"], value(f, data), ", ".join(f["where"])] for f in src["figures"]]
        parts += [f"### {src['title']}", "", provenance(src, data, manifest["machines"]), "",
                  md_table(["figure", "claimed", "from the result", "claimed in"], rows), ""]
    return "\n".join(parts)


def fmt_s(x: Optional[float]) -> str:
    return DASH if x is None else (f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.1f} s")


def fmt_mb(x: Optional[float]) -> str:
    return DASH if x is None else ("0" if x == 0 else f"{x / 1e6:.3g} MB")


def workflow_table(data: dict) -> str:
    """A timed workflow's layouts (``bench_compare.py``): epoch time, bytes, test accuracy and
    time to accuracy, seeds pooled; layouts without an accuracy (atomic models) left out."""
    rows = []
    for lay in data["layouts"]:
        if lay["test_acc_mean"] is None:
            continue
        acc = DASH if lay["test_acc_mean"] is None else f"{lay['test_acc_mean']:.4f}" + (
            f" ± {lay['test_acc_std']:.4f}" if lay["test_acc_std"] is not None else "")
        ref, secs = lay["reference_seconds_to_target_mean"], lay["seconds_to_target_mean"]
        n = len(lay["seeds"])
        rows.append([f"{lay['dataset']} · {lay['model']}", lay["label"], lay["techniques"] or DASH, str(n),
                     fmt_s(lay["epoch_time_s"]),
                     fmt_mb(lay["comm_bytes_per_epoch"]),
                     acc, f"{lay['reached']} of {n}",
                     DASH if lay["epochs_to_target_mean"] is None else f"{lay['epochs_to_target_mean']:.3g}",
                     fmt_s(secs), DASH if not ref or not secs else f"{ref / secs:.2f}×"])
    head = ["dataset · model", "layout", "techniques", "seeds", "epoch", "bytes/epoch", "test acc",
            "reached target", "epochs to target", "time to target", "single ÷ layout"]
    over = data.get("overlapping_runs") or []
    note = (f"Runs whose training overlapped another's: {', '.join(over)}." if over else
            "No run's training overlapped another's.")
    took = f"{data['workflow_s'] / 60:.1f} min" if data.get("workflow_s") else "not timed"
    load = data.get("machine", {})
    if load.get("loadavg_before") and load.get("loadavg_after"):
        took += f" (1-min load {load['loadavg_before'][0]:.1f} before, {load['loadavg_after'][0]:.1f} after)"
    return "\n".join([f"`{data['config']}`, `--cores {data['cores']}`: the whole workflow took {took}. {note}", "",
                      md_table(head, rows), ""])


def blocks(manifest: dict, results: Path = RESULTS) -> dict[str, str]:
    """Every generated block of the doc, by marker name."""
    out = {"headline": headline(manifest, results)}
    for src in manifest["sources"]:
        if src.get("detail") == "workflow":
            out[src["id"]] = workflow_table(load_result(src, results))
    return out


def render(doc: str, generated: dict[str, str]) -> str:
    """``doc`` with every marked block replaced; a block without its markers, or markers without a
    block, is an error (the doc and the manifest must agree)."""
    seen = set()

    def sub(m):
        name = m["name"]
        if name not in generated:
            raise SystemExit(f"tables: {DOC.name}: markers for {name!r}, which nothing generates")
        seen.add(name)
        return m.group(1) + generated[name].rstrip("\n") + "\n" + m.group(4)

    out = MARKER.sub(sub, doc)
    missing = sorted(set(generated) - seen)
    if missing:
        raise SystemExit(f"tables: {DOC.name} lacks the markers of {', '.join(missing)}")
    return out


# --------------------------------------------------------------------------- collecting
def collect(name: str, src_dir: Path, results: Path = RESULTS) -> Path:
    """``src_dir/name.json`` copied into ``results`` with its provenance."""
    src = src_dir / f"{name}.json"
    if not src.is_file():
        raise SystemExit(f"tables: --collect {name}: {src}: no such file (run the benchmark first)")
    data = json.loads(src.read_text())
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    when = datetime.datetime.fromtimestamp(src.stat().st_mtime, datetime.timezone.utc)
    data["provenance"] = {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--",
                                                       "src", "benchmarks", "config", "workflow")),
                          "date": when.strftime("%Y-%m-%d %H:%M UTC"), "host": platform.node(),
                          "cpus": os.cpu_count(), "collected_from": str(src)}
    results.mkdir(parents=True, exist_ok=True)
    out = results / f"{name}.json"
    out.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 when the doc differs")
    ap.add_argument("--collect", nargs="+", default=[], metavar="NAME",
                    help="copy results/bench/NAME.json (or --from DIR) into benchmarks/results first")
    ap.add_argument("--from", dest="src", type=Path, default=ROOT / "results" / "bench")
    ap.add_argument("--collect-only", action="store_true", help="with --collect: leave the doc alone")
    a = ap.parse_args(argv)
    for name in a.collect:
        print(f"tables: {collect(name, a.src)}", file=sys.stderr)
    if a.collect_only:
        return 0
    manifest = yaml.safe_load(FIGURES.read_text())
    doc = DOC.read_text()
    new = render(doc, blocks(manifest))
    if a.check:
        if new != doc:
            print(f"tables: {DOC} is not what benchmarks/tables.py generates from {FIGURES.name} and "
                  f"benchmarks/results/: run python benchmarks/tables.py", file=sys.stderr)
            return 1
        return 0
    if new != doc:
        DOC.write_text(new)
        print(f"tables: rewrote {DOC}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
