"""The report's stages table (gnnpipe.report.stages) from benchmark files in Snakemake's format."""

import pytest

from gnnpipe.io import GnnPipeError
from gnnpipe.report.stages import collect, evaluations_in_training, read_benchmark, stages_section

# Snakemake's header (snakemake.benchmark.BenchmarkRecord.get_header), tab-separated, as it writes it
HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time"


def row(s: float, rss) -> str:
    rss = "NA" if rss is None else f"{rss:.2f}"
    cpu = "NA" if rss == "NA" else f"{s / 2:.2f}"  # CPU seconds: half the wall time, here
    mem = "\t".join([rss, "NA" if rss == "NA" else "1200.00", rss, rss, "0.00", "1.25", "87.50", cpu])
    return f"{s:.4f}\t0:00:{int(s):02d}\t{mem}"


def write(root, rel: str, *rows: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([HEADER, *rows]) + "\n")


def test_header_is_snakemakes():
    from snakemake.benchmark import BenchmarkRecord

    assert HEADER.split("\t") == BenchmarkRecord.get_header()


@pytest.fixture
def bench(tmp_path):
    write(tmp_path, "build_graph/synth.tsv", row(4.0, 300.0))
    write(tmp_path, "partition/synth/metis-2.tsv", row(3.0, 250.5))
    write(tmp_path, "partition/synth/metis-8.tsv", row(5.0, None))  # ended before the first sample
    write(tmp_path, "train/synth-gcn2-single-p1-seed0.tsv", row(20.0, 400.0))
    write(tmp_path, "train/synth-gcn2-graph-p2-seed0.tsv", row(30.0, 900.0))
    write(tmp_path, "train/gone-run.tsv", row(1000.0, 1.0))  # a run no longer in the config
    write(tmp_path, "evaluate/synth-gcn2-single-p1-seed0.tsv", row(6.0, 350.0), row(8.0, 360.0))  # 2 repeats
    write(tmp_path, "relax/slabs-gemnet-single-p1-seed0.tsv", row(50.0, 500.0))
    return tmp_path


RUNS = ["synth-gcn2-single-p1-seed0", "synth-gcn2-graph-p2-seed0", "slabs-gemnet-single-p1-seed0"]


def test_stages_sum_per_rule(bench):
    stages = {s.rule: s for s in collect(bench, RUNS)}
    assert [s for s in stages] == ["build_graph", "partition", "train", "evaluate", "relax"]
    assert (stages["partition"].jobs, stages["partition"].seconds, stages["partition"].max_rss_mb) == (2, 8.0, 250.5)
    assert (stages["train"].jobs, stages["train"].seconds, stages["train"].max_rss_mb) == (2, 50.0, 900.0)
    assert (stages["evaluate"].jobs, stages["evaluate"].seconds, stages["evaluate"].max_rss_mb) == (1, 7.0, 355.0)
    assert (stages["partition"].cpu_s, stages["evaluate"].cpu_s) == (1.5, 3.5)  # NA: no CPU figure
    assert [stages[r].kind for r in ("build_graph", "train", "relax")] == ["set-up", "training", "after training"]
    # without the run list, every file counts
    assert {s.rule: s.seconds for s in collect(bench)}["train"] == 1050.0


def test_section_states_the_ratio_and_the_bound(bench):
    text = stages_section(collect(bench, RUNS), "results/benchmarks")
    # set-up: build_graph 4 + partition 8 + evaluate 7 = 19; training 50; relax neither
    assert "| partition | set-up | 2 | 8.0 | 1.5 | 250 |" in text  # 250.5 MB, rounded half to even
    assert "| build_graph | set-up | 1 | 4.0 | 2.0 | 300 |" in text
    assert "| relax | after training | 1 | 50.0 | 25.0 | 500 |" in text
    assert ("Set-up 19.0 s ÷ training 50.0 s = **0.38×** (within the bound of 0.5×). "
            "In CPU seconds: 7.0 ÷ 25.0 = 0.28×.") in text
    write(bench, "calibrate/synth/gcn2.tsv", row(40.0, 700.0))
    text = stages_section(collect(bench, RUNS), "results/benchmarks")
    assert ("Set-up 59.0 s ÷ training 50.0 s = **1.18×** (**over the bound of 0.5×**; the largest set-up "
            "stages: calibrate 40.0 s, partition 8.0 s, evaluate 7.0 s).") in text
    # single stages: calibrate against a train job (mean 25 s), the report against 10 s
    assert "* calibrate: 40.0 s a job = 1.60× a train job's 25.0 s (bound 0.1×); **over**: a first fit" in text
    assert "report:" not in text
    write(bench, "calibrate/synth/gcn2.tsv", row(2.0, 700.0))
    write(bench, "report/report.tsv", row(12.0, 300.0))
    text = stages_section(collect(bench, RUNS), "results/benchmarks")
    assert "* calibrate: 2.0 s a job = 0.08× a train job's 25.0 s (bound 0.1×), within." in text
    assert "* report: 12.0 s (bound 10.0 s); **over**: it draws the plots" in text
    assert "evaluate:" not in text  # no epoch times: nothing to hold it to


def test_evaluate_against_two_epochs_of_its_run(bench):
    run = "synth-gcn2-single-p1-seed0"  # its evaluate job: 7.0 s (the mean of 2 repeats)
    text = stages_section(collect(bench, RUNS), "results/benchmarks", {run: 2.0, "synth-gcn2-graph-p2-seed0": 1.0})
    assert (f"* evaluate: 1 of 1 jobs over 2 epochs of their run (the most: {run}, 7.0 s = 3.5 epochs); "
            "**over**: each is a process of its own") in text
    text = stages_section(collect(bench, RUNS), "results/benchmarks", {run: 5.0})
    assert f"* evaluate: 0 of 1 jobs over 2 epochs of their run (the most: {run}, 7.0 s = 1.4 epochs), within." in text


def test_the_train_jobs_own_evaluations_are_the_evaluate_stage(tmp_path):
    """Node runs' train jobs evaluate their model (#36): no evaluate job, the run records' evaluate_s
    and evaluate_cpu_s. Those seconds leave train's figures for an "evaluate (in train)" row, set-up
    as before, held to 2 epochs of their run; a run with an evaluate job's file keeps the job's."""
    single, graph = RUNS[0], RUNS[1]
    write(tmp_path, "build_graph/synth.tsv", row(4.0, 300.0))
    write(tmp_path, f"train/{single}.tsv", row(20.0, 400.0))  # CPU: 10.0 each
    write(tmp_path, f"train/{graph}.tsv", row(30.0, 900.0))
    stages = evaluations_in_training(collect(tmp_path, RUNS), {single: (0.5, 0.4), graph: (1.5, 1.0), "gone": (9, 9)})
    by = {s.rule: s for s in stages}
    assert [s.rule for s in stages] == ["build_graph", "train", "evaluate"]
    assert (by["train"].jobs, by["train"].seconds, by["train"].cpu_s) == (2, 48.0, pytest.approx(23.6))
    assert by["train"].job_seconds == {single: 19.5, graph: 28.5}
    assert (by["evaluate"].jobs, by["evaluate"].seconds, by["evaluate"].cpu_s) == (2, 2.0, pytest.approx(1.4))
    assert by["evaluate"].max_rss_mb is None and by["evaluate"].kind == "set-up"
    text = stages_section(stages, "b", {single: 0.5, graph: 1.0})
    assert "| evaluate (in train) | set-up | 2 | 2.0 | 1.4 | — |" in text
    assert "| train | training | 2 | 48.0 | 23.6 | 900 |" in text
    assert "Set-up 6.0 s ÷ training 48.0 s" in text  # build_graph 4 + evaluate 2
    assert (f"* evaluate: 0 of 2 jobs over 2 epochs of their run (the most: {graph}, 1.5 s = 1.5 epochs), "
            "within.") in text
    # an evaluate job's file (an older workflow) wins for its run; nothing to move without train files
    write(tmp_path, f"evaluate/{single}.tsv", row(6.0, 350.0))
    by = {s.rule: s for s in evaluations_in_training(collect(tmp_path, RUNS), {single: (0.5, 0.4), graph: (1.5, 1.0)})}
    assert (by["evaluate"].jobs, by["evaluate"].seconds, by["train"].seconds) == (2, 7.5, 48.5)
    assert evaluations_in_training(collect(tmp_path / "none"), {single: (0.5, 0.4)}) == []


def test_no_files_and_bad_files(tmp_path):
    assert "No benchmark files under `x`" in stages_section(collect(tmp_path), "x")
    (tmp_path / "train").mkdir()
    bad = tmp_path / "train" / "r.tsv"
    bad.write_text("wall\tmem\n1\t2\n")
    with pytest.raises(GnnPipeError, match=r"r\.tsv: not a Snakemake benchmark file .*delete it") as e:
        read_benchmark(bad)
    assert "\n" not in str(e.value)
    bad.write_text(HEADER + "\n" + row(1.0, 2.0).replace("1.0000", "soon") + "\n")
    with pytest.raises(GnnPipeError, match="not a number"):
        collect(tmp_path)


def test_the_report_has_the_stages_section(tmp_path):
    """``build_report(benchmarks_dir=...)`` puts the table after the datasets, over the reported runs'
    files (without the directory, ``gnnpipe report`` outside the workflow, there is no section)."""
    from gnnpipe.report import build_report
    from test_report import record, write_run

    dirs = [write_run(tmp_path / "runs", record("synth-gcn2-single-p1-seed0", "single", model="gcn", layers=2))]
    bench = tmp_path / "benchmarks"
    write(bench, "train/synth-gcn2-single-p1-seed0.tsv", row(20.0, 400.0))
    write(bench, "evaluate/synth-gcn2-single-p1-seed0.tsv", row(6.0, 350.0))
    out = tmp_path / "report.md"
    build_report(dirs, out, tmp_path / "plots", predict=False, benchmarks_dir=bench)
    text = out.read_text()
    stages = text[text.index("## Stages"):text.index("## All runs")]
    assert text.index("## Datasets") < text.index("## Stages")
    assert "| train | training | 1 | 20.0 | 10.0 | 400 |" in stages and "= **0.30×** (within the bound" in stages

    # #36: a node run's train job evaluated its model: no evaluate file, its record's evaluate_s
    rec = {**record("synth-gcn2-single-p1-seed0", "single", model="gcn", layers=2, epoch_time=0.5),
           "evaluate_s": 0.75, "evaluate_cpu_s": 0.5}
    dirs = [write_run(tmp_path / "runs2", rec)]
    (bench / "evaluate" / "synth-gcn2-single-p1-seed0.tsv").unlink()
    build_report(dirs, out, tmp_path / "plots", predict=False, benchmarks_dir=bench)
    stages = out.read_text()[out.read_text().index("## Stages"):]
    assert "| train | training | 1 | 19.2 | 9.5 | 400 |" in stages  # 20 - 0.75 s, 10 - 0.5 CPU s
    assert "| evaluate (in train) | set-up | 1 | 0.8 | 0.5 | — |" in stages
    assert "* evaluate: 0 of 1 jobs over 2 epochs of their run (the most: synth-gcn2-single-p1-seed0, 0.8 s = " \
           "1.5 epochs), within." in stages
