"""report.py on synthetic run records: the table, the graph ÷ pipeline ratios, the plots."""

import json
import math
import re
from pathlib import Path

import pytest

from gnnpipe.io import GnnPipeError
from gnnpipe.report import build_report, fmt_bytes, fmt_ratio, fmt_s, load_run, plot_curves, ratio

PNG = b"\x89PNG\r\n\x1a\n"


def record(run_id, mode, model="gcnii", layers=32, hidden=64, workers=1, stages=1, ways=1, chunks=1,
           epoch_time=0.1, split=(0.08, 0.02, 0.0), sent=0, predicted=0, peak=10**8, test_acc=0.8,
           epochs=6, dataset="synth"):
    """A run record shaped like DESIGN.md §6, with a history that evaluates every other epoch."""
    history = []
    for e in range(epochs):
        evald = e % 2 == 1
        history.append({"epoch": e, "loss": 2.0 / (e + 1), "epoch_time_s": epoch_time,
                        "compute_s": split[0], "comm_s": split[1], "bubble_s": split[2], "comm_bytes": sent,
                        "train_acc": 0.5 + 0.05 * e if evald else None,
                        "val_acc": 0.4 + 0.05 * e if evald else None,
                        "test_acc": 0.4 + 0.04 * e if evald else None})
    return {"run_id": run_id, "mode": mode, "dataset": dataset, "num_nodes": 10000, "num_edges": 160000,
            "in_features": 128, "model": model, "layers": layers, "hidden": hidden, "world_size": workers,
            "stages": stages, "ways": ways, "chunks": chunks, "epochs": epochs, "dtype_bytes": 4,
            "epoch_time_s": epoch_time,
            "epoch_time_breakdown_s": dict(zip(("compute", "comm", "bubble"), split)),
            "comm_bytes_per_epoch": sent, "comm_bytes_predicted": predicted, "peak_mem_bytes": peak,
            "train_acc": 0.9, "val_acc": 0.85, "test_acc": test_acc, "final_loss": 0.3,
            "mlflow_run_id": "abc", "history": history}


def write_run(root: Path, rec: dict, evaluation: dict | None = None) -> Path:
    d = root / rec["run_id"]
    d.mkdir(parents=True)
    (d / "metrics.json").write_text(json.dumps(rec))
    if evaluation is not None:
        (d / "eval.json").write_text(json.dumps({"run_id": rec["run_id"], **evaluation}))
    return d


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "results" / "runs"
    return [
        write_run(root, record("deep-single", "single", epoch_time=0.3, test_acc=0.80),
                  {"train_acc": 0.91, "val_acc": 0.86, "test_acc": 0.8125, "loss": 0.3}),
        write_run(root, record("deep-graph", "graph", workers=2, ways=2, chunks=2, epoch_time=0.4,
                               split=(0.1, 0.3, 0.0), sent=64_000_000, predicted=64_000_000, peak=6 * 10**7,
                               test_acc=0.79)),
        write_run(root, record("deep-pipe", "pipeline", workers=2, stages=2, chunks=8, epoch_time=0.1,
                               split=(0.06, 0.01, 0.03), sent=4_000_000, predicted=5_000_000, peak=5 * 10**7,
                               test_acc=0.78)),
        write_run(root, record("shallow-single", "single", model="gcn", layers=2, test_acc=0.7)),
        write_run(root, record("shallow-graph", "graph", model="gcn", layers=2, workers=2, ways=2, chunks=2,
                               sent=1_000, predicted=1_000)),
    ]


def section(text: str, title: str) -> str:
    """The markdown between heading ``title`` and the next heading of any level."""
    start = text.index(title)
    nxt = re.search(r"^#+ ", text[start + len(title):], re.M)
    return text[start: start + len(title) + (nxt.start() if nxt else len(text))]


def row_of(text: str, run_id: str) -> list[str]:
    line = next(l for l in text.splitlines() if l.startswith(f"| `{run_id}`"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_report_table_ratios_and_plots(tmp_path, runs):
    out, plots = tmp_path / "results" / "report.md", tmp_path / "results" / "plots"
    build_report(runs, out, plots)
    text = out.read_text()

    all_runs = section(text, "## All runs")
    for d in runs:
        assert f"`{d.name}`" in all_runs
    pipe = row_of(all_runs, "deep-pipe")
    assert pipe[1:8] == ["pipeline", "synth", "gcnii", "32", "2", "2×1", "8"]
    assert pipe[8:12] == ["100 ms", "60 ms", "10 ms", "30 ms"]  # epoch and its split
    assert row_of(all_runs, "deep-single")[11] == "0"  # no bubble without a pipeline
    assert pipe[12:15] == ["4 MB", "5 MB", "0.8×"]  # measured, predicted, measured ÷ predicted
    graph = row_of(all_runs, "deep-graph")
    assert graph[6:8] == ["1×2", "—"]  # S×G; graph parallelism has no chunks
    # exact evaluation (eval.json) wins over the record's last-epoch accuracy
    assert row_of(all_runs, "deep-single")[-1] == "0.8125"
    assert row_of(all_runs, "deep-graph")[-1] == "0.7900"

    deep = section(text, "### synth · gcnii (32 layers, hidden 64)")
    assert "`shallow-single`" not in deep  # grouped by dataset × model
    ratio_row = next(l for l in deep.splitlines() if "graph ÷ pipeline" in l)
    cells = [c.strip() for c in ratio_row.strip("|").split("|")]
    # graph ÷ pipeline: epoch time 0.4/0.1, bytes 64/4 measured and 64/5 predicted, memory 6/5
    assert cells[0] == "2" and cells[4:8] == ["4×", "16×", "12.8×", "1.2×"]
    assert cells[8] == "0.7900 / 0.7800"
    assert row_of(deep, "deep-pipe")[-1] == "-3.25 pt"  # against the single run's exact 0.8125

    shallow = section(text, "### synth · gcn (2 layers, hidden 64)")
    assert "÷ pipeline |" not in shallow and "No graph ÷ pipeline ratio" in shallow

    pngs = sorted(p.name for p in plots.iterdir())
    assert pngs == ["comm_bytes.png", "curves_synth_gcn-L2-H64.png", "curves_synth_gcnii-L32-H64.png",
                    "epoch_time.png"]  # and no temporary files left behind
    for name in pngs:
        data = (plots / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5_000
    links = re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)
    assert len(links) == 4 and all((out.parent / link).is_file() for link in links)


def test_curves_have_a_line_per_run_and_skip_unevaluated_epochs(tmp_path, runs):
    deep = [load_run(d) for d in runs[:3]]
    fig = plot_curves(deep[0].group, deep, tmp_path / "c.png")
    loss, train, val, test = fig.axes[:4]
    assert len(loss.get_lines()) == len(val.get_lines()) == 3
    assert list(loss.get_lines()[0].get_xdata()) == [0, 1, 2, 3, 4, 5]
    assert list(test.get_lines()[0].get_xdata()) == [1, 3, 5]  # null on non-eval epochs
    assert loss.get_yscale() == "linear"  # 2.0 -> 0.33 spans less than a decade


def test_bad_run_records_are_refused_with_the_file_named(tmp_path, runs):
    broken = tmp_path / "broken"
    broken.mkdir()
    rec = record("broken", "graph")
    del rec["comm_bytes_predicted"]
    (broken / "metrics.json").write_text(json.dumps(rec))
    with pytest.raises(GnnPipeError, match=r"broken/metrics.json: not a run record, missing comm_bytes_predicted"):
        build_report([runs[0], broken], tmp_path / "r.md", tmp_path / "p")
    (broken / "metrics.json").write_text("{not json")
    with pytest.raises(GnnPipeError, match=r"broken/metrics.json: not valid JSON"):
        build_report([broken], tmp_path / "r.md", tmp_path / "p")
    with pytest.raises(GnnPipeError, match="no such file"):
        build_report([tmp_path / "nowhere"], tmp_path / "r.md", tmp_path / "p")
    with pytest.raises(GnnPipeError, match="run ids appear twice: deep-single"):
        build_report([runs[0], runs[0]], tmp_path / "r.md", tmp_path / "p")
    assert not (tmp_path / "r.md").exists()


def test_formatting_of_bytes_times_and_ratios():
    assert [fmt_s(x) for x in (None, 0, 4.65e-5, 0.0123, 2.5)] == ["—", "0", "46.5 µs", "12.3 ms", "2.5 s"]
    assert [fmt_bytes(n) for n in (0, 512, 1_500, 2_000_000, 3.2e9)] == ["0", "512 B", "1.5 kB", "2 MB", "3.2 GB"]
    assert ratio(0, 0) is None and ratio(None, 1) is None and math.isinf(ratio(5, 0))
    assert [fmt_ratio(x) for x in (None, math.inf, 2.0, 0.125)] == ["—", "∞", "2×", "0.125×"]


def test_comparisons_pair_graph_with_model_parallel_runs_of_equal_workers():
    from gnnpipe.report import Run, comparisons

    runs = [Run(record(rid, mode, workers=p, stages=s, ways=g)) for rid, mode, p, s, g in [
        ("g2", "graph", 2, 1, 2), ("g4", "graph", 4, 1, 4), ("p2", "pipeline", 2, 2, 1),
        ("p4", "pipeline", 4, 4, 1), ("h4", "hybrid", 4, 2, 2), ("s", "single", 1, 1, 1)]]
    pairs = [(c.graph.run_id, c.other.run_id) for c in comparisons(runs)]
    assert pairs == [("g2", "p2"), ("g4", "p4"), ("g4", "h4")]
