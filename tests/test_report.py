"""gnnpipe.report on synthetic run records: the table, the graph ÷ pipeline ratios, the plots."""

import json
import math
import re
from pathlib import Path

import pytest

from gnnpipe.io import GnnPipeError
from gnnpipe.report import build_report
from gnnpipe.report.plots import plot_curves
from gnnpipe.report.records import load_run
from gnnpipe.report.tables import fmt_bytes, fmt_ratio, fmt_s, ratio

PNG = b"\x89PNG\r\n\x1a\n"


def record(run_id, mode, model="gcnii", layers=32, hidden=64, workers=1, stages=1, ways=1, chunks=1,
           epoch_time=0.1, split=(0.08, 0.02, 0.0), sent=0, predicted=0, peak=10**8, test_acc=0.8,
           epochs=6, dataset="synth"):
    """A run record shaped like docs/DESIGN.md §6, with a history that evaluates every other epoch."""
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
    assert pipe[8] == "—"  # a record without its partition's balance (tests/test_partition.py has one)
    assert pipe[9:13] == ["100 ms", "60 ms", "10 ms", "30 ms"]  # epoch and its split
    assert row_of(all_runs, "deep-single")[12] == "0"  # no bubble without a pipeline
    assert pipe[13:16] == ["4 MB", "5 MB", "0.8×"]  # measured, predicted, measured ÷ predicted
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
    per_group = ["bytes_vs_p", "curves", "modes", "time_vs_p", "tta"]
    assert pngs == sorted(["comm_bytes.png", "epoch_time.png"] +
                          [f"{k}_synth_{m}.png" for k in per_group for m in ("gcn-L2-H64", "gcnii-L32-H64")])
    for name in pngs:  # and no temporary files left behind
        data = (plots / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5_000
    links = re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)
    assert sorted(Path(l).name for l in links) == pngs and all((out.parent / l).is_file() for l in links)


def test_a_plot_is_drawn_once_and_its_pixels_are_savefigs(tmp_path, runs, monkeypatch):
    """The report writes each figure after one draw (constrained layout inside it), not savefig's two
    (a layout draw, then the render): the same pixels, half the drawing (#36)."""
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.image import imread

    from gnnpipe.report import plots

    deep = [load_run(d) for d in runs[:3]]
    draws = []
    real = Figure.draw
    monkeypatch.setattr(Figure, "draw", lambda fig, renderer: draws.append(fig) or real(fig, renderer))
    plots.plot_curves(deep[0].group, deep, tmp_path / "new.png")
    assert len(draws) == 1
    monkeypatch.setattr(plots, "save", lambda fig, path: fig.savefig(path, format="png", dpi=110))
    plots.plot_curves(deep[0].group, deep, tmp_path / "savefig.png")
    assert np.array_equal(imread(tmp_path / "new.png"), imread(tmp_path / "savefig.png"))


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
    from gnnpipe.report.records import Run
    from gnnpipe.report.tables import comparisons

    runs = [Run(record(rid, mode, workers=p, stages=s, ways=g)) for rid, mode, p, s, g in [
        ("g2", "graph", 2, 1, 2), ("g4", "graph", 4, 1, 4), ("p2", "pipeline", 2, 2, 1),
        ("p4", "pipeline", 4, 4, 1), ("h4", "hybrid", 4, 2, 2), ("s", "single", 1, 1, 1)]]
    pairs = [(c.graph.run_id, c.other.run_id) for c in comparisons(runs)]
    assert pairs == [("g2", "p2"), ("g4", "p4"), ("g4", "h4")]


# --------------------------------------------------------------------------- seeds, ratios, cost model
def _seeded(root, mode, seed, workers=1, stages=1, ways=1, chunks=1, **kw):
    layout_id = {"single": "p1", "graph": f"p{workers}", "pipeline": f"s{stages}c{chunks}",
                 "hybrid": f"s{stages}g{ways}c{chunks}"}[mode]
    return write_run(root, record(f"synth-deep-{mode}-{layout_id}-seed{seed}", mode, workers=workers,
                                  stages=stages, ways=ways, chunks=chunks, **kw))


def test_seeds_are_pooled_into_mean_and_std_and_ratios_of_the_means(tmp_path):
    from gnnpipe.report.records import Run, aggregate
    from gnnpipe.report.tables import comparisons

    root = tmp_path / "runs"
    dirs = []
    for seed, (ga, pa, ha) in enumerate([(0.70, 0.80, 0.60), (0.80, 0.82, 0.62), (0.90, 0.84, 0.64)]):
        dirs += [_seeded(root, "graph", seed, workers=4, ways=4, epoch_time=0.2 + 0.1 * seed,
                         sent=8_000_000, test_acc=ga),
                 _seeded(root, "pipeline", seed, workers=4, stages=4, chunks=16, epoch_time=0.1,
                         sent=1_000_000 * (seed + 1), test_acc=pa),
                 _seeded(root, "hybrid", seed, workers=4, stages=2, ways=2, chunks=8, epoch_time=0.15,
                         sent=4_000_000, test_acc=ha)]
    dirs.append(_seeded(root, "single", 0, test_acc=0.75))
    out = tmp_path / "report.md"
    build_report(dirs, out, tmp_path / "plots", predict=False)
    text = out.read_text()
    pooled = text[text.index("Over seeds"):]
    rows = {c[0] + c[2]: c for c in (
        [x.strip() for x in l.strip("|").split("|")] for l in pooled.splitlines()
        if l.startswith("| graph") or l.startswith("| pipeline") or l.startswith("| hybrid")
        or l.startswith("| single"))}
    # graph test acc 0.7, 0.8, 0.9: mean 0.8, sample std 0.1; the single run: one seed, no std
    assert rows["graph1×4"][4] == "3 (0, 1, 2)" and rows["graph1×4"][7] == "0.8000 ± 0.1000"
    assert rows["pipeline4×1"][7] == "0.8200 ± 0.0200" and rows["hybrid2×2"][7] == "0.6200 ± 0.0200"
    assert rows["single1×1"][4] == "1 (0)" and rows["single1×1"][7] == "0.7500"
    assert rows["graph1×4"][8] == "300 ms ± 100 ms"  # epoch time 0.2, 0.3, 0.4
    ratio_rows = [[c.strip() for c in l.strip("|").split("|")] for l in pooled.splitlines()
                  if l.startswith("| 4 | graph ÷")]
    by = {r[1]: r for r in ratio_rows}
    # epoch: mean 0.3 ÷ 0.1 and ÷ 0.15; bytes: 8 MB ÷ mean(1, 2, 3) MB and ÷ 4 MB; no predictions
    assert by["graph ÷ pipeline"][2:5] == ["1×4 ÷ 4×1", "3 / 3", "3×"]
    assert by["graph ÷ pipeline"][6] == "4×" and by["graph ÷ hybrid"][4] == "2×"
    assert by["graph ÷ hybrid"][6] == "2×" and by["graph ÷ hybrid"][5] == by["graph ÷ hybrid"][7] == "—"
    assert by["graph ÷ pipeline"][8] == "0.8000 ± 0.1000 / 0.8200 ± 0.0200"
    # per-run ratios pair runs of the same seed only: 3 per model-parallel mode, not 9
    runs = [Run(json.loads((d / "metrics.json").read_text()), None, d) for d in dirs]
    assert len(comparisons(runs)) == 6
    assert all(c.graph.seed == c.other.seed for c in comparisons(runs))
    assert [len(a.runs) for a in aggregate(runs, {})] == [1, 3, 3, 3]
    # the unavailable predictions are listed with their reason
    assert text.count("prediction unavailable: predictions switched off") == len(dirs)


def test_mean_std_and_error_formatting():
    from gnnpipe.report.predictions import rel_error
    from gnnpipe.report.records import mean_std
    from gnnpipe.report.tables import fmt_err

    assert mean_std([1.0, None, 3.0]) == (2.0, pytest.approx(math.sqrt(2)), 2)
    assert mean_std([5]) == (5.0, None, 1) and mean_std([None]) == (None, None, 0)
    assert rel_error(110, 100) == pytest.approx(0.1) and rel_error(0, 0) is None
    assert math.isinf(rel_error(5, 0)) and rel_error(None, 3) is None
    assert [fmt_err(x) for x in (None, 0.1, -0.25, math.inf)] == ["—", "+10.0 %", "-25.0 %", "∞"]


@pytest.fixture(scope="module")
def graph_file(tmp_path_factory):
    import numpy as np

    from gnnpipe.graph import Graph, csr_from_edges, write_graph

    n, rng = 240, np.random.default_rng(0)
    src = np.repeat(np.arange(n), 3)
    dst = (src + np.tile(np.arange(1, 4), n)) % n
    indptr, indices = csr_from_edges(src, dst, n)
    train = rng.random(n) < 0.6
    path = tmp_path_factory.mktemp("data") / "graph.h5"
    write_graph(path, Graph(indptr, indices, rng.standard_normal((n, 8)).astype(np.float32),
                            rng.integers(0, 3, n), train, ~train, ~train, num_classes=3, name="ring"))
    return path


def _with_run_yaml(d: Path, rec: dict, graph_path: Path, pipeline=None) -> None:
    """Write ``d/run.yaml`` for ``rec``; ``pipeline``: its PipelineConfig (default: the defaults)."""
    from gnnpipe.config import (GraphParallelConfig, ModelConfig, PartitionConfig, PipelineConfig,
                                RunConfig, TrainingConfig, dump_run_config)

    cfg = RunConfig(run_id=rec["run_id"], mode=rec["mode"], dataset_name="ring", graph_path=str(graph_path),
                    store_path=None, out_dir=str(d), model=ModelConfig(kind="gcn", layers=4, hidden=8),
                    training=TrainingConfig(seed=0), partitioning=PartitionConfig(),
                    pipeline=pipeline if pipeline is not None else PipelineConfig(),
                    graph_parallel=GraphParallelConfig(),
                    workers=rec["world_size"], stages=rec["stages"], ways=rec["ways"], chunks=rec["chunks"])
    (d / "run.yaml").write_text(dump_run_config(cfg))


def test_cost_model_prediction_beside_each_run_and_unavailable_ones(tmp_path, graph_file):
    from gnnpipe.costmodel import hardware as ch
    from gnnpipe.config import ModelConfig, PipelineConfig
    from gnnpipe.planning.plan import predict_layout
    from gnnpipe.planning.shape import build_model, model_shape
    from gnnpipe.planning.stats import cached_graph_stats
    from gnnpipe.report.tables import PREDICTION_HEADER

    hw = ch.load_hardware("cpu-2core")
    gnn = build_model(ModelConfig(kind="gcn", layers=4, hidden=8), 8, 3)
    stats = cached_graph_stats(graph_file, [2, 8])
    est = {mode: predict_layout(stats, gnn, model_shape(gnn), hw, mode, s, g, c, pipeline_cfg=PipelineConfig())
           for mode, s, g, c in [("graph", 1, 2, 2), ("pipeline", 2, 1, 8)]}
    assert est["graph"].bytes["total"] > 0 and est["pipeline"].bytes["total"] > 0

    root = tmp_path / "runs"
    common = dict(model="gcn", layers=4, hidden=8)
    eg, ep = est["graph"], est["pipeline"]
    # graph: no bubble; pipeline: its stage-to-stage transfers are waited for in the bubble
    assert eg.bubble_s == 0 and ep.comm_s == 0 and min(eg.compute_s, eg.comm_s, ep.compute_s, ep.bubble_s) > 0
    g = record("g2", "graph", workers=2, ways=2, chunks=1, sent=int(eg.bytes["total"]),
               epoch_time=2 * eg.epoch_s, split=(eg.compute_s, 2 * eg.comm_s, 0.0),
               peak=int(eg.peak_mem_bytes), **common)  # the record's graph chunks are 1
    p = record("p2", "pipeline", workers=2, stages=2, chunks=8, sent=int(ep.bytes["total"]) // 2,
               epoch_time=ep.epoch_s, split=(2 * ep.compute_s, 1e-3, ep.bubble_s / 2),
               peak=int(ep.peak_mem_bytes) // 2, **common)
    dirs = [write_run(root, g), write_run(root, p)]
    for d, rec in zip(dirs, (g, p)):
        _with_run_yaml(d, rec, graph_file)
    no_yaml = write_run(root, record("lost", "graph", workers=2, ways=2, **common))
    no_graph = write_run(root, r := record("nograph", "pipeline", workers=2, stages=2, chunks=8, **common))
    _with_run_yaml(no_graph, r, tmp_path / "missing" / "graph.h5")

    out = tmp_path / "report.md"
    build_report(dirs + [no_yaml, no_graph], out, tmp_path / "plots", hardware=hw)
    text = out.read_text()
    table = section(text, "## Measured vs cost model")
    assert "`cpu-2core` with the profile's own compute rates: the cost model is uncalibrated" in table
    assert "2 of 4 runs predicted" in table
    rg, rp = row_of(table, "g2"), row_of(table, "p2")
    assert rg[5:7] == [fmt_bytes(est["graph"].bytes["total"]), "+0.0 %"]
    assert rg[7:10] == [fmt_s(2 * est["graph"].epoch_s), fmt_s(est["graph"].epoch_s), "-50.0 %"]
    assert rp[5] == fmt_bytes(est["pipeline"].bytes["total"]) and rp[6].startswith("+100.")
    assert rp[9] == "+0.0 %" and rg[14] == rp[14] == ""
    # the split and peak memory: measured / predicted (error); 0 vs 0 has no error
    assert rg[10:14] == [f"{fmt_s(eg.compute_s)} / {fmt_s(eg.compute_s)} (+0.0 %)",
                         f"{fmt_s(2 * eg.comm_s)} / {fmt_s(eg.comm_s)} (-50.0 %)", "0 / 0",
                         f"{fmt_bytes(eg.peak_mem_bytes)} / {fmt_bytes(eg.peak_mem_bytes)} (+0.0 %)"]
    assert rp[10:14] == [f"{fmt_s(2 * ep.compute_s)} / {fmt_s(ep.compute_s)} (-50.0 %)",
                         f"{fmt_s(1e-3)} / 0 (-100.0 %)",
                         f"{fmt_s(ep.bubble_s / 2)} / {fmt_s(ep.bubble_s)} (+100.0 %)",
                         f"{fmt_bytes(int(ep.peak_mem_bytes) // 2)} / {fmt_bytes(ep.peak_mem_bytes)} (+100.0 %)"]
    lost, nograph = row_of(table, "lost"), row_of(table, "nograph")
    assert lost[5] == lost[6] == lost[8] == "—"
    # an unavailable prediction keeps its measured figures, and the row its cells
    assert lost[10:14] == ["80 ms / —", "20 ms / —", "0 / —", "100 MB / —"]
    assert lost[14].startswith("prediction unavailable:") and "no run.yaml" in lost[14]
    assert "prediction unavailable:" in nograph[14] and "no graph file" in nograph[14]
    lines = [l for l in table.splitlines() if l.startswith("|")]
    assert [c.strip() for c in lines[0].strip("|").split("|")] == PREDICTION_HEADER
    assert len(lines) == 2 + 4 and all(l.count(" | ") == len(PREDICTION_HEADER) - 1 for l in lines[2:])
    assert len(lost) == len(nograph) == len(rg) == len(PREDICTION_HEADER) == 15
    # the pooled ratio uses the available predictions (lost and nograph share g2's and p2's
    # layouts, so they are pooled with them): graph ÷ pipeline predicted bytes
    ratio_row = next(l for l in section(text, "### synth · gcn (4 layers, hidden 8)").splitlines()
                     if l.startswith("| 2 | graph ÷ pipeline | 1×2 ÷ 2×1 | 2 / 2"))
    cells = [c.strip() for c in ratio_row.strip("|").split("|")]
    assert cells[7] == fmt_ratio(est["graph"].bytes["total"] / est["pipeline"].bytes["total"])

    # #36: the same predictions made beforehand (gnnpipe predict-costs) and read: the same report
    from gnnpipe.report.predictions import write_predictions
    from gnnpipe.report.records import load_runs

    file = tmp_path / "predictions.json"
    write_predictions(load_runs(dirs + [no_yaml, no_graph]), file, hw)
    again = tmp_path / "again.md"
    build_report(dirs + [no_yaml, no_graph], again, tmp_path / "plots", hardware="no-such-profile",
                 predictions=file)
    assert again.read_text() == text


def test_a_predictions_file_is_read_and_checked(tmp_path):
    """The report reads the workflow's predictions file (#36) instead of predicting; a run it lacks
    is unavailable with the reason, and a file that is not one is refused in one line."""
    from gnnpipe.report.predictions import PREDICTIONS_KIND, PredictionsFile

    file = tmp_path / "predictions.json"
    file.write_text(json.dumps({"kind": PREDICTIONS_KIND, "format_version": 1, "hardware": "cpu-2core+synth",
                                "calibrated": ["cpu-2core+synth"],
                                "runs": {"g2": {"bytes": 1e6, "epoch_s": 0.5, "compute_s": 0.4, "comm_s": 0.1,
                                                "bubble_s": 0.0, "peak_mem_bytes": 1e8, "reason": None}}}))
    dirs = [write_run(tmp_path / "runs", record(r, "graph", workers=2, ways=2)) for r in ("g2", "p9")]
    out = tmp_path / "report.md"
    build_report(dirs, out, tmp_path / "plots", predictions=file)
    table = section(out.read_text(), "## Measured vs cost model")
    assert "`cpu-2core+synth` with its compute rates fitted" in table and "1 of 2 runs predicted" in table
    assert row_of(table, "g2")[7:9] == [fmt_s(0.1), fmt_s(0.5)]
    assert "no prediction of this run (rerun the cost_predictions rule)" in row_of(table, "p9")[14]
    for text in ("{", json.dumps({"kind": "other"}), json.dumps({"kind": PREDICTIONS_KIND, "format_version": 1})):
        file.write_text(text)
        with pytest.raises(GnnPipeError, match=r"predictions\.json: .*rerun the cost_predictions rule") as e:
            PredictionsFile(file)
        assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- pipeline techniques
def _table(text: str) -> tuple[list[str], list[list[str]]]:
    """Header and body rows of the first markdown table in ``text``, checked to be well formed."""
    lines = [l for l in text.splitlines() if l.startswith("|")]
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", l.strip())[1:-1]] for l in lines]
    assert set(lines[1].replace(" ", "")) == {"|", "-"}
    assert all(len(c) == len(cells[0]) for c in cells)  # as many cells in every row as in the header
    return cells[0], cells[2:]


def test_pipeline_techniques_table_of_an_ablation(tmp_path):
    from gnnpipe.config import PipelineConfig
    from gnnpipe.report.tables import TECHNIQUES_HEADER

    root, graph = tmp_path / "runs", tmp_path / "no-graph.h5"  # predict=False: no graph read
    pipe = dict(workers=2, stages=2, chunks=8)
    singles = [record("abl-single-p1-seed0", "single", test_acc=0.80),
               record("abl-single-p1-seed1", "single", test_acc=0.82)]  # pooled: 0.81 ± 0.0141
    ablation = {  # run -> (test acc, pipeline settings in run.yaml; None: no run.yaml)
        "abl-none": (0.7558, PipelineConfig(shuffle_chunks=False, grad_correction=False, snapshot_every=0,
                                            momentum=0.0)),
        "abl-lost": (0.7700, None),
        "abl-no-shuffle": (0.7900, PipelineConfig(shuffle_chunks=False, grad_scale=1.5, momentum=0.95)),
        "abl-all": (0.8042, PipelineConfig(momentum=0.95, snapshot_every=1)),
    }
    dirs = [write_run(root, r) for r in singles]
    for rid, (acc, pc) in ablation.items():
        rec = record(rid, "pipeline", test_acc=acc, **pipe)
        dirs.append(write_run(root, rec))
        if pc is not None:
            _with_run_yaml(dirs[-1], rec, graph, pipeline=pc)
    # another model in the same report whose pipeline runs share one setting: no table of its own
    for rid, s, c in (("flat-s2", 2, 8), ("flat-s4", 4, 16)):
        rec = record(rid, "pipeline", model="gcn", layers=4, workers=s, stages=s, chunks=c)
        dirs.append(write_run(root, rec))
        _with_run_yaml(dirs[-1], rec, graph)
    out = tmp_path / "report.md"
    build_report(dirs, out, tmp_path / "plots", predict=False)
    text = out.read_text()

    assert re.findall(r"^## .*", text, re.M) == ["## Datasets", "## All runs", "## Time to accuracy",
                                                 "## Measured vs cost model",
                                                 "## By dataset and model", "## Pipeline techniques",
                                                 "## Communication and time"]
    assert "### Pipeline techniques: synth · gcnii (32 layers, hidden 64)" in text
    assert "### Pipeline techniques: synth · gcn (" not in text
    header, rows = _table(section(text, "### Pipeline techniques: synth · gcnii (32 layers, hidden 64)"))
    assert header == TECHNIQUES_HEADER
    ref = (0.80 + 0.82) / 2

    def delta(rid):
        return f"{100 * (ablation[rid][0] - ref):+.2f}"

    # single first (seeds pooled), all on, then by how many techniques are off, no run.yaml last
    assert [r[0] for r in rows] == ["`abl-single-p1-seed0`, `abl-single-p1-seed1` (2 seeds)", "`abl-all`",
                                    "`abl-no-shuffle`", "`abl-none`", "`abl-lost`"]
    assert rows[0] == [rows[0][0], "1×1", "—", "—", "—", "—", "—", "0.8100 ± 0.0141", "—"]
    assert rows[1] == ["`abl-all`", "2×1", "8", "on", "×2", "every epoch", "0.95", "0.8042", delta("abl-all")]
    assert rows[2] == ["`abl-no-shuffle`", "2×1", "8", "off", "×1.5", "every 23 epochs", "0.95", "0.7900",
                       delta("abl-no-shuffle")]
    assert rows[3] == ["`abl-none`", "2×1", "8", "off", "off", "off", "off", "0.7558", delta("abl-none")]
    assert rows[4] == ["`abl-lost`", "2×1", "8", "—", "—", "—", "—", "0.7700", delta("abl-lost")]
    assert [r[-1] for r in rows[1:]] == ["-0.58", "-2.00", "-5.42", "-4.00"]
    # the variants are not pooled as seeds of one layout: one "Over seeds" row each
    from gnnpipe.report.records import aggregate, load_runs

    runs = load_runs(dirs)
    aggs = [a for a in aggregate(runs, {}) if a["mode"] == "pipeline" and a.group[1] == "gcnii"]
    assert sorted(len(a.runs) for a in aggs) == [1, 1, 1, 1]


def test_no_pipeline_techniques_section_when_the_settings_agree(tmp_path):
    from gnnpipe.config import PipelineConfig
    from gnnpipe.report.records import load_run
    from gnnpipe.report.tables import has_technique_ablation

    root, graph = tmp_path / "runs", tmp_path / "no-graph.h5"
    dirs = [write_run(root, record("same-single", "single"))]
    # the same techniques in every run (grad_scale does nothing with grad_correction off);
    # the layouts differ, and a run without run.yaml has no settings to differ in
    for rid, mode, s, g, c, scale in (("same-s2", "pipeline", 2, 1, 8, 2.0), ("same-s4", "pipeline", 4, 1, 16, 3.0),
                                      ("same-h", "hybrid", 2, 2, 8, 2.0)):
        rec = record(rid, mode, workers=s * g, stages=s, ways=g, chunks=c)
        dirs.append(write_run(root, rec))
        _with_run_yaml(dirs[-1], rec, graph, pipeline=PipelineConfig(grad_correction=False, grad_scale=scale))
    dirs.append(write_run(root, record("same-lost", "pipeline", workers=2, stages=2, chunks=8)))
    out = tmp_path / "report.md"
    build_report(dirs, out, tmp_path / "plots", predict=False)
    text = out.read_text()
    assert "Pipeline techniques" not in text
    assert "`same-s4`" in text  # the runs are reported, only not this section
    runs = [load_run(d) for d in dirs]
    assert not has_technique_ablation(runs)
    # one setting changed in one run: now they differ
    _with_run_yaml(dirs[2], runs[2].record, graph, pipeline=PipelineConfig(grad_correction=True))
    assert has_technique_ablation([load_run(d) for d in dirs])


# --------------------------------------------------------------------------- time to accuracy
def _curve(rec: dict, val: list, epoch_time=None, seed=None, started=None, finished=None) -> dict:
    """``rec`` with a history of ``len(val)`` epochs: validation accuracy ``val[e]`` (None: not
    evaluated), epoch wall times ``epoch_time`` (one figure or one per epoch), and the job's times."""
    times = epoch_time if isinstance(epoch_time, list) else [epoch_time or rec["epoch_time_s"]] * len(val)
    rec["history"] = [{**rec["history"][0], "epoch": e, "val_acc": v, "epoch_time_s": t}
                      for e, (v, t) in enumerate(zip(val, times))]
    if seed is not None:
        rec["run_id"] += f"-seed{seed}"
    if started is not None:
        rec.update(started_at=f"2026-12-05T10:{started}+00:00", finished_at=f"2026-12-05T10:{finished}+00:00")
    return rec


def test_time_to_accuracy_against_the_single_run_of_the_same_seed(tmp_path):
    from gnnpipe.report.tables import TTA_HEADER

    root = tmp_path / "runs"
    n = None
    dirs = [  # single seed 0: best 0.80 -> target 0.79; seed 1: best 0.70 -> 0.69
        write_run(root, _curve(record("s", "single"), [0.5, None, 0.79, None, 0.80, None], [1.0] * 6, seed=0)),
        write_run(root, _curve(record("s", "single"), [0.5, 0.6, 0.7, n, n, n], [1.0] * 6, seed=1)),
        # graph seed 0: 0.795 at its 4th epoch (epoch times 0.5 each): 2 s vs single's 3 s -> 1.5×
        write_run(root, _curve(record("g", "graph", workers=2, ways=2), [n, 0.6, n, 0.795, n, 0.8], 0.5, seed=0)),
        # pipeline seed 0 never gets within a point; seed 1 against single seed 1's target 0.69
        write_run(root, _curve(record("p", "pipeline", workers=2, stages=2, chunks=8), [0.5, 0.7, 0.78, n, n, 0.785],
                               [0.2, 0.1, 0.1, 0.1, 0.1, 0.1], seed=0)),
        write_run(root, _curve(record("p", "pipeline", workers=2, stages=2, chunks=8), [0.5, 0.69, n, n, n, n],
                               [0.2, 0.1, 0.1, 0.1, 0.1, 0.1], seed=1)),
        # no single run of seed 2: the target is the mean of the singles' best less a point, 0.74
        write_run(root, _curve(record("p", "pipeline", workers=2, stages=2, chunks=8), [0.5, 0.74, n, n, n, n],
                               [0.2, 0.1, 0.1, 0.1, 0.1, 0.1], seed=2)),
    ]
    out = tmp_path / "report.md"
    build_report(dirs, out, tmp_path / "plots", predict=False)
    text = out.read_text()
    tta = section(text, "### Time to accuracy: synth · gcnii (32 layers, hidden 64)")
    header, _ = _table(tta[:tta.index("Over seeds")])
    assert header == TTA_HEADER
    cols = {h: i for i, h in enumerate(TTA_HEADER)}

    def cells(rid, *names):
        row = row_of(tta, rid)
        return [row[cols[c]] for c in names]

    what = ("target val acc", "best val acc", "epochs to target", "time to target", "single ÷ run")
    assert cells("s-seed0", *what) == ["0.7900", "0.8000", "3", "3 s", "1×"]  # 0.79 at epoch 2: 3 epochs
    assert cells("s-seed1", *what) == ["0.6900", "0.7000", "3", "3 s", "1×"]
    assert cells("g-seed0", *what) == ["0.7900", "0.8000", "4", "2 s", "1.5×"]
    assert cells("p-seed0", *what) == ["0.7900", "0.7850", "not reached", "not reached", "—"]
    assert cells("p-seed1", *what) == ["0.6900", "0.6900", "2", "300 ms", "10×"]  # reaching it exactly counts
    # seed 2 against both singles: target 0.74; their times to 0.74: seed 0 at 3 s, seed 1 never
    assert cells("p-seed2", *what) == ["0.7400", "0.7400", "2", "300 ms", "10×"]
    assert cells("p-seed0", "techniques", "job", "overlapped with") == ["—", "—", "unknown"]
    # the pipeline's three seeds pooled: 2 of 3 reached it, 2 epochs, 300 ms each
    pooled = tta[tta.index("Over seeds"):]
    prow = next([c.strip() for c in l.strip("|").split("|")] for l in pooled.splitlines() if l.startswith("| pipeline"))
    assert prow[4:9] == ["3", "2 of 3", "2 ± 0", "300 ms ± 0", "10×"]
    assert "![validation accuracy vs training time" in tta
    assert "6 run(s) have no `started_at` / `finished_at`" in section(text, "## Time to accuracy")


def test_runs_whose_training_jobs_overlapped_are_named(tmp_path):
    from gnnpipe.report.records import load_run
    from gnnpipe.report.timing import job_seconds, overlaps

    root = tmp_path / "runs"
    val = [0.5, 0.8]
    dirs = [write_run(root, _curve(record("a", "single"), val, started="00:00.000", finished="01:00.000")),
            write_run(root, _curve(record("b", "graph", workers=2, ways=2), val, started="00:59.500",
                                   finished="02:00.000")),
            write_run(root, _curve(record("c", "pipeline", workers=2, stages=2, chunks=8), val,
                                   started="02:00.000", finished="03:30.250")),  # starts as b ends: no overlap
            write_run(root, _curve(record("old", "pipeline", workers=2, stages=2, chunks=8), val))]
    runs = [load_run(d) for d in dirs]
    assert overlaps(runs) == {"a": ["b"], "b": ["a"], "c": [], "old": None}
    naive = load_run(dirs[0])  # a record without an offset is read as UTC
    naive.record.update(started_at="2026-12-05T10:01:59", finished_at="2026-12-05T10:02:30")
    assert overlaps([naive, runs[1]]) == {"a": ["b"], "b": ["a"]}
    assert job_seconds(runs[2]) == 90.25 and job_seconds(runs[3]) is None
    out = tmp_path / "report.md"
    build_report(dirs, out, tmp_path / "plots", predict=False)
    text = out.read_text()
    intro = section(text, "## Time to accuracy")
    assert "**Training overlapped in time for 2 of 4 runs** (`a`, `b`)" in intro
    assert "1 run(s) have no `started_at` / `finished_at`" in intro
    tta = section(text, "### Time to accuracy:")
    assert row_of(tta, "a")[-2:] == ["60 s", "`b`"]
    assert row_of(tta, "c")[-2:] == ["90.2 s", "none"] and row_of(tta, "old")[-1] == "unknown"
    # alone: said so
    build_report(dirs[2:3], out, tmp_path / "plots2", predict=False)
    assert "No two runs' training jobs overlapped" in out.read_text()


def test_time_to_accuracy_plot_has_a_line_per_layout_and_technique_and_the_target(tmp_path):
    from gnnpipe.config import PipelineConfig
    from gnnpipe.report.plots import plot_time_to_accuracy
    from gnnpipe.report.records import aggregate, load_runs
    from gnnpipe.report.timing import target_of

    root, graph, n = tmp_path / "runs", tmp_path / "no-graph.h5", None
    dirs = [write_run(root, _curve(record("s", "single"), [0.5, n, 0.8], 1.0, seed=s)) for s in (0, 1)]
    for name, pc in (("on", PipelineConfig()), ("off", PipelineConfig(shuffle_chunks=False, grad_correction=False,
                                                                        snapshot_every=0))):
        for s in (0, 1):
            rec = _curve(record(f"p-{name}", "pipeline", workers=2, stages=2, chunks=8), [0.4, n, 0.6 + 0.1 * s],
                         [0.5, 0.5, 1.0 + s], seed=s)
            dirs.append(write_run(root, rec))
            _with_run_yaml(dirs[-1], rec, graph, pipeline=pc)
    runs = load_runs(dirs)
    aggs = aggregate(runs, {})
    fig = plot_time_to_accuracy(runs[0].group, aggs, target_of([r for r in runs if r["mode"] == "single"]),
                                tmp_path / "tta.png")
    assert (tmp_path / "tta.png").read_bytes().startswith(PNG)
    ax = fig.axes[0]
    lines = {l.get_label(): l for l in ax.get_lines()}
    assert set(lines) == {"single (n=2)", "pipeline S=2 C=8 (shuffle+grad×2+snapshot/23) (n=2)",
                          "pipeline S=2 C=8 (techniques off) (n=2)", "target: single's best − 1 pt"}
    # the mean over seeds at the epochs every seed evaluated: x = summed epoch times, y = val acc
    on = lines["pipeline S=2 C=8 (shuffle+grad×2+snapshot/23) (n=2)"]
    assert list(on.get_xdata()) == [0.5, 2.5] and list(on.get_ydata()) == pytest.approx([0.4, 0.65])
    assert list(lines["target: single's best − 1 pt"].get_ydata()) == pytest.approx([0.79, 0.79])
    assert ax.get_xlabel().startswith("training wall time")


def test_a_trained_run_records_when_its_job_ran(tmp_path, monkeypatch):
    import datetime

    from gnnpipe.report.timing import job_seconds
    from gnnpipe.train import run
    from helpers import run_cfg

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    before = datetime.datetime.now(datetime.timezone.utc)
    cfg = run_cfg(tmp_path, {"kind": "gcn", "layers": 2, "hidden": 8, "dropout": 0.0}, epochs=3)
    rec = run(cfg, progress=False)
    after = datetime.datetime.now(datetime.timezone.utc)
    start, end = (datetime.datetime.fromisoformat(rec[k]) for k in ("started_at", "finished_at"))
    assert before <= start <= end <= after and start.utcoffset() == datetime.timedelta(0)
    assert job_seconds(load_run(tmp_path / "results" / "runs" / cfg.run_id)) >= sum(
        h["epoch_time_s"] for h in rec["history"])


def test_plots_against_p_keep_technique_variants_of_one_layout_apart(tmp_path):
    """Pipeline runs of one layout with the techniques on and off (compare.yaml): a line each,
    also where the cost model predicts both alike (sorting them used to compare their stds)."""
    from gnnpipe.config import PipelineConfig
    from gnnpipe.report.plots import plot_vs_workers
    from gnnpipe.report.predictions import Prediction
    from gnnpipe.report.records import aggregate, load_runs

    root, graph = tmp_path / "runs", tmp_path / "no-graph.h5"
    dirs = [write_run(root, record("s", "single"))]
    for name, pc, seeds in (("on", PipelineConfig(), (0, 1)), ("off", PipelineConfig(shuffle_chunks=False), (0,))):
        for s in seeds:
            rec = _curve(record(f"p-{name}", "pipeline", workers=2, stages=2, chunks=8), [0.5, 0.8], 0.1, seed=s)
            dirs.append(write_run(root, rec))
            _with_run_yaml(dirs[-1], rec, graph, pipeline=pc)
    runs = load_runs(dirs)
    aggs = aggregate(runs, {r.run_id: Prediction(bytes=1e6, epoch_s=0.1) for r in runs})
    fig = plot_vs_workers(runs[0].group, aggs, "epoch_time_s", tmp_path / "t.png")
    labels = {l.get_label() for l in fig.axes[0].get_lines() if not l.get_label().startswith("_")}
    assert {"pipeline (shuffle+grad×2+snapshot/23) (cost model)", "pipeline (grad×2+snapshot/23) (cost model)",
            "single (cost model)"} <= labels


def atomic_record(run_id, mode, ways=1, dtype_bytes=4, dataset="slabs"):
    """An atomic run record (``extra.atomic``) on ``dataset``: S2EF metrics, histories with val MAEs."""
    rec = record(run_id, mode, model="gemnet_t", layers=3, hidden=64, workers=ways, ways=ways, dataset=dataset)
    for row in rec["history"]:
        row.update(val_energy_mae=0.5, val_force_mae=0.1)
    rec.update(dtype_bytes=dtype_bytes, data_parallel=1, energy_mae=0.8, force_mae=0.1, force_cos=0.9, efwt=0.0,
               extra={"atomic": True, "label": "GemNet-T", "parameters": 10})
    return rec


def test_the_first_line_counts_every_run_and_float32_layouts_are_explained(tmp_path):
    """#37: the first line counts node and atomic runs and their datasets (it said "1 runs over 1 dataset(s)"
    for 3 over 2); #37 item 15: beside an atomic table whose float32 runs differ in layout, a note says
    that their metrics differ by training-amplified rounding and that float64 runs are the exactness check
    (no note for float64 runs); #37 item 20: it names the runs whose eval.json scored a training sample."""
    from gnnpipe.report.atomic import FLOAT32_NOTE

    root = tmp_path / "results" / "runs"
    layouts = (("single", 1), ("graph", 2))
    sample = {"train_systems_scored": 500, "train_systems": 4000}  # #37 item 20: eval.json says, the report too
    atomic = [write_run(root, atomic_record(f"slabs-{m}-p{p}", m, p), sample) for m, p in layouts]
    out = tmp_path / "results" / "report.md"
    node = write_run(root, record("deep-single", "single"))
    build_report([node, *atomic], out, tmp_path / "plots", predict=False)
    text = out.read_text()
    assert text.splitlines()[2].startswith("3 runs (1 node, 2 atomic) over 2 dataset(s). Epoch times are medians")
    table = section(text, "### slabs: GemNet-T")
    assert FLOAT32_NOTE in table and "float64 runs are the exactness check" in text
    assert "seeded sample of the training systems (`slabs-single-p1` 500 of 4,000, `slabs-graph-p2` 500" in table
    exact = [write_run(root, atomic_record(f"f64-{m}-p{p}", m, p, dtype_bytes=8)) for m, p in layouts]
    build_report(exact, out, tmp_path / "plots", predict=False)
    text = out.read_text()
    assert text.splitlines()[2] == "2 runs (all atomic) over 1 dataset(s)." and FLOAT32_NOTE not in text
    assert "seeded sample" not in text  # no eval.json says it scored a sample
