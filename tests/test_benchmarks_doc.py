"""docs/BENCHMARKS.md is what benchmarks/tables.py generates from benchmarks/figures.yaml and the
committed results; every figure there names its source."""

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tables():
    spec = importlib.util.spec_from_file_location("benchmark_tables", ROOT / "benchmarks" / "tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_committed_doc_is_what_the_committed_results_give(tables, capsys):
    assert tables.main(["--check"]) == 0, capsys.readouterr().err


def test_every_figure_names_its_source(tables):
    manifest = yaml.safe_load(tables.FIGURES.read_text())
    ids = [s["id"] for s in manifest["sources"]]
    assert len(ids) == len(set(ids))
    for src in manifest["sources"]:
        assert src["command"] and src["title"] and src["figures"], src["id"]
        assert src.get("machine") in manifest["machines"] or src.get("machine", "").startswith("the project's"), src["id"]
        if src.get("json"):  # a committed result, with the commit and date it was measured at
            data = tables.load_result(src)
            assert {"commit", "date"} <= set(data["provenance"]), src["id"]
        else:  # a committed file, or a run whose JSON was not kept: said so, with where it was reported
            assert src.get("file") or src.get("kept"), src["id"]
            assert src.get("commit") and src.get("date"), src["id"]
        for fig in src["figures"]:
            assert fig["claimed"] and fig["where"], (src["id"], fig["figure"])
            assert any(k in fig for k in tables.READS) == bool(src.get("json") or src.get("file")), fig["figure"]
    text = tables.DOC.read_text()
    for src in manifest["sources"]:
        assert f"### {src['title']}" in text


def test_figures_are_read_by_key_index_and_selector(tables):
    data = {"plans": {"a on b": {"rows": [{"mode": "graph", "s": 2.0}, {"mode": "pipeline", "s": 0.5}]}},
            "xs": [0.25, 0.5], "none": None}
    assert tables.get(data, ["plans", "a on b", "rows", {"mode": "pipeline"}, "s"]) == 0.5
    assert tables.get(data, ["xs", 1]) == 0.5
    fig = {"figure": "f", "ratio": [["plans", "a on b", "rows", {"mode": "graph"}, "s"], ["xs", 1]], "format": "{:.1f}×"}
    assert tables.value(fig, data) == "4.0×"
    assert tables.value({"figure": "f", "get": ["xs"], "format": "{:.0%}"}, data) == "25% – 50%"
    assert tables.value({"figure": "f", "get": ["none"]}, data) == "—"
    assert tables.value({"figure": "f", "each": [["xs", 0], ["none"]], "format": "{:.2f}"}, data) == "0.25 / —"
    assert tables.value({"figure": "f", "get": ["empty"]}, {"empty": []}) == "none"
    assert tables.value({"figure": "f"}, data) == tables.value({"figure": "f", "get": ["xs"]}, None) == "—"
    with pytest.raises(SystemExit, match="matches 2 elements"):
        tables.value({"figure": "f", "get": ["plans", "a on b", "rows", {}]}, data)
    with pytest.raises(SystemExit, match="figure 'f'"):
        tables.value({"figure": "f", "get": ["nope"]}, data)


def test_only_the_marked_blocks_are_rewritten_and_markers_must_match(tables):
    doc = "intro\n<!-- tables:begin a -->\nold\n<!-- tables:end a -->\nmiddle\n<!-- tables:begin b -->\n<!-- tables:end b -->\n"
    assert tables.render(doc, {"a": "new\n", "b": "B"}) == (
        "intro\n<!-- tables:begin a -->\nnew\n<!-- tables:end a -->\nmiddle\n<!-- tables:begin b -->\nB\n"
        "<!-- tables:end b -->\n")
    with pytest.raises(SystemExit, match="lacks the markers of c"):
        tables.render(doc, {"a": "", "b": "", "c": ""})
    with pytest.raises(SystemExit, match="markers for 'b'"):
        tables.render(doc, {"a": ""})


def test_collect_copies_a_result_in_with_its_provenance(tables, tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "x.json").write_text(json.dumps({"value": 3}))
    out = tables.collect("x", tmp_path / "bench", results=tmp_path / "results")
    data = json.loads(out.read_text())
    assert data["value"] == 3 and out == tmp_path / "results" / "x.json"
    prov = data["provenance"]
    assert len(prov["commit"]) >= 7 and isinstance(prov["dirty"], bool) and prov["date"].endswith("UTC")
    with pytest.raises(SystemExit, match="no such file"):
        tables.collect("missing", tmp_path / "bench", results=tmp_path / "results")
