"""Calibration from the train jobs' own records (issue #36): a train job times its layers in one
epoch it trains anyway (``gnnpipe.layertimes``), and ``gnnpipe calibrate --records`` fits those
rows, without timing samples and without importing torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gnnpipe.config import dump_run_config
from gnnpipe.costmodel import hardware as ch
from gnnpipe.io import GnnPipeError
from gnnpipe.planning import calibrate as cal
from helpers import run_cfg

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_global_mlflow(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    """A finished single run of a 2-layer GCN (its run.yaml written where the workflow writes it)."""
    from gnnpipe.train import run

    tmp = tmp_path_factory.mktemp("single")
    cfg = run_cfg(tmp, {"kind": "gcn", "layers": 2, "hidden": 16, "dropout": 0.5}, epochs=5)
    record = run(cfg, progress=False)
    out = Path(cfg.out_dir)
    (out / "run.yaml").write_text(dump_run_config(cfg))
    return cfg, record, out / "metrics.json"


def _parallel_copy(record: dict, path: Path, slower: float) -> Path:
    """A parallel run's record of the same dataset and model whose workers' conv forwards took
    ``slower`` times the single run's (the cold rows)."""
    rows = [{**r, "seconds": r["seconds"] * slower} for r in record["layer_times"]["rows"] if r["what"].endswith("fwd")]
    rec = {**record, "run_id": "par", "mode": "graph",
           "layer_times": {**record["layer_times"], "whole_graph": False, "rows": rows}}
    path.write_text(json.dumps(rec))
    return path


def test_nnls_is_exact_on_small_problems():
    """The fit's own non-negative least squares (no scipy import) finds scipy's optimum."""
    from scipy.optimize import nnls as scipy_nnls

    rng = np.random.default_rng(0)
    for _ in range(50):
        A = rng.random((12, 5)) * rng.choice([1e-3, 1.0, 1e3], 5)
        b = A @ rng.normal(size=5) + rng.normal(size=12) * 0.1
        ours, ref = cal.nnls(A, b), scipy_nnls(A, b)[0]
        assert np.linalg.norm(A @ ours - b) == pytest.approx(np.linalg.norm(A @ ref - b), rel=1e-7, abs=1e-12)
        assert (ours >= 0).all()


def test_a_single_train_job_records_each_piece_forward_and_backward_once(single_run):
    from gnnpipe.costmodel.work import layer_cost
    from gnnpipe.layertimes import recorded_epochs
    from gnnpipe.models.model import GNN

    cfg, record, _ = single_run
    lt = record["layer_times"]
    assert lt["epochs"] == list(recorded_epochs(cfg.training.epochs, cfg.training.warmup_epochs)) == [1, 2, 3]
    assert len(lt["epoch_cpu_s_per_epoch"]) == 3 and lt["epoch_cpu_s"] == sorted(lt["epoch_cpu_s_per_epoch"])[1]
    assert (lt["clock"], lt["threads"], lt["whole_graph"]) == ("cpu", 1, True)
    assert json.loads(Path(cfg.out_dir, "metrics.json").read_text())["layer_times"] == lt
    rows = {r["what"].split()[0] + " " + r["what"].split()[-1]: r for r in lt["rows"]}
    assert set(rows) == {"conv0 fwd", "conv0 bwd", "conv1 fwd", "conv1 bwd"}
    # one call an epoch, in three epochs: the median of the three
    assert all(r["calls"] == 1 and len(r["seconds_per_epoch"]) == 3 and r["seconds"] == sorted(r["seconds_per_epoch"])[1]
               for r in rows.values())
    # the work is the cost model's for that conv on the whole graph
    gnn = GNN(cfg.model, record["in_features"], 2)
    spec = gnn.convs[1].layer_spec(raw_input=False, params=0)
    n, nnz = record["num_nodes"], int(rows["conv1 fwd"]["what"].split()[3].split("x")[2])
    lc = layer_cost(spec, n, n, nnz)
    assert rows["conv1 fwd"]["work"] == [lc.fwd.dense, lc.fwd.sparse, lc.fwd.elem, lc.fwd.rng, lc.fwd.calls]
    assert rows["conv1 bwd"]["work"] == [lc.bwd.dense, lc.bwd.sparse, lc.bwd.elem, lc.bwd.rng, lc.bwd.calls]


def test_the_layer_timer_hooks_nothing_outside_its_epoch(single_run):
    from gnnpipe.layertimes import layer_timer

    class Engine:  # an engine whose model cannot be timed (atomic, MLP): no rows, no error
        comm = None

    with layer_timer(Engine(), 0, True) as got:
        pass
    assert got["layer_times"] is None


def test_fit_from_records_recovers_known_rates():
    """Rows made from known seconds per unit of work give those rates back; the cold rows set the
    speed-up to what the workers measured over what the warm rates predict."""
    coef = np.array([1e-10, 4e-9, 1e-9, 5e-9, 2e-5])
    rng = np.random.default_rng(1)
    works = [list(rng.random(5) * [1e9, 1e7, 1e8, 1e7, 3]) for _ in range(8)]
    warm = [{"what": f"w{i}", "work": w, "seconds": float(np.dot(w, coef)), "run": "s"} for i, w in enumerate(works)]
    cold = [{**r, "seconds": r["seconds"] * 1.4, "run": "g"} for r in warm[:3]]
    hw = cal.calibrate_records({"warm": warm, "cold": cold, "runs": {}}, ch.load_hardware("cpu-2core"))
    fit = hw.measured["calibration"]
    assert fit["warm_rates"]["dense_gflops"] == pytest.approx(10.0, rel=1e-6)
    assert fit["warm_rates"]["layer_overhead_us"] == pytest.approx(20.0, rel=1e-6)
    assert hw.single_worker_speedup == pytest.approx(1.4) == fit["single_worker_speedup"]
    assert hw.dense_gflops == pytest.approx(10.0 / 1.4, rel=1e-6)  # the profile's own rates are the cold ones
    assert fit["median_abs_rel_error"] < 1e-9
    assert cal.calibrate_records({"warm": [], "cold": cold, "runs": {}}, ch.load_hardware("cpu-2core")) is None


def test_calibrate_from_records_times_nothing_and_imports_no_torch(single_run, tmp_path):
    """With a single run's rows and a parallel run's, `gnnpipe calibrate --records` fits them in a
    process that never imports torch; the report finds the profile as before."""
    from gnnpipe.costmodel.hardware import load_hardware
    from gnnpipe.graph import read_graph_attrs

    cfg, record, metrics = single_run
    par = _parallel_copy(record, tmp_path / "par.json", 1.3)
    out = tmp_path / "fitted" / "m.yaml"
    code = ("import sys; from gnnpipe.cli import main; "
            f"rc = main(['calibrate', '--run-config', {str(Path(cfg.out_dir) / 'run.yaml')!r}, "
            f"'--hardware', 'cpu-2core', '--records', {str(metrics)!r}, {str(par)!r}, '--cache', "
            f"{str(tmp_path / 'cache')!r}, '--out', {str(out)!r}]); "
            "assert rc == 0; print('torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"
    hw = load_hardware(out)
    fit = hw.measured["calibration"]
    assert fit["source"] == "records" and fit["runs"] == {"single": [cfg.run_id], "graph": ["par"]}
    assert fit["single_worker_speedup"] >= 1.0 and fit["cold_from"].startswith("the parallel runs")
    digest = str(read_graph_attrs(cfg.graph_path)["content_hash"])
    assert cal.find_calibration(out.parent, cfg.model, digest).name == hw.name == f"cpu-2core+{cfg.dataset_name}"
    assert [p.name[0] for p in (tmp_path / "cache").iterdir()] == ["r"]  # keyed by the records


def test_records_are_cached_by_their_rows(single_run, tmp_path, monkeypatch):
    cfg, record, metrics = single_run
    par = _parallel_copy(record, tmp_path / "par.json", 1.3)
    first = cal.calibrate_run(cfg, "cpu-2core", cache=tmp_path, records=[metrics, par])
    assert "cached" not in first.measured["calibration"]
    monkeypatch.setattr(cal, "calibrate_records", lambda *a, **k: pytest.fail("fitted again"))
    again = cal.calibrate_run(cfg, "cpu-2core", cache=tmp_path, records=[metrics, par])
    assert again.measured["calibration"]["cached"] and again.dense_gflops == first.dense_gflops
    other = _parallel_copy(record, tmp_path / "par2.json", 1.5)  # another run's rows: another key
    with pytest.raises(pytest.fail.Exception, match="fitted again"):
        cal.calibrate_run(cfg, "cpu-2core", cache=tmp_path, records=[metrics, other])


def test_without_a_parallel_run_only_the_cold_pass_is_timed(single_run, monkeypatch):
    cfg, record, metrics = single_run
    base = ch.load_hardware("cpu-2core")
    timed = []

    def cold_pass(graph, model, hw, **kw):
        timed.append(kw)
        return cal.replace(hw, dense_gflops=0.5, sparse_gvalues=0.05, elementwise_gvalues=0.5,
                           random_gvalues=0.05, layer_overhead_us=50.0)

    monkeypatch.setattr(cal, "calibrate", cold_pass)
    hw = cal.calibrate_run(cfg, base, records=[metrics])
    fit = hw.measured["calibration"]
    assert len(timed) == 1 and timed[0]["clock"] == "cpu"  # the cold pass, no warm pass
    assert fit["cold_from"] == "a cold pass timed by calibrate" and fit["runs"] == {"single": [cfg.run_id]}
    assert hw.single_worker_speedup == pytest.approx(max(1.0, fit["single_epoch_s"]["cold"] / fit["single_epoch_s"]["warm"]))


def test_records_without_rows_fall_back_to_timing_and_others_are_refused(single_run, tmp_path, monkeypatch):
    cfg, record, metrics = single_run
    old = tmp_path / "old.json"  # a record of a train job before layer_times
    old.write_text(json.dumps({k: v for k, v in record.items() if k != "layer_times"}))
    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("timed")))
    with pytest.raises(RuntimeError, match="timed"):
        cal.calibrate_run(cfg, "cpu-2core", records=[old])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**record, "layers": 3}))
    with pytest.raises(GnnPipeError, match=r"other.json is a run of .* gcn 3x16 .*not of the run config's .* gcn 2x16"):
        cal.calibrate_run(cfg, "cpu-2core", records=[other])


def test_the_cold_rows_sizes_tell_the_per_call_cost_from_the_rates():
    """A single run's rows are all whole-graph calls (one size: a per-call cost cannot be told from a
    per-value one); the parallel runs' calls on parts and chunks of other sizes can, fitted jointly
    with the speed-up."""
    coef = np.array([1e-10, 0.0, 0.0, 0.0, 5e-4])  # 10 GFLOP/s, 500 us a call
    whole = [1e9, 0.0, 0.0, 0.0, 1.0]
    warm = [{"what": "conv fwd", "work": whole, "seconds": float(np.dot(whole, coef)), "run": "s"}]
    cold = [{"what": f"part {k}", "work": [k * 1e8, 0.0, 0.0, 0.0, 1.0], "run": "g",
             "seconds": 1.25 * float(np.dot([k * 1e8, 0, 0, 0, 1], coef))} for k in (1, 2, 5)]
    hw = cal.calibrate_records({"warm": warm, "cold": cold, "runs": {}}, ch.load_hardware("cpu-2core"))
    fit = hw.measured["calibration"]
    assert fit["warm_rates"]["layer_overhead_us"] == pytest.approx(500.0, rel=1e-3)
    assert fit["warm_rates"]["dense_gflops"] == pytest.approx(10.0, rel=1e-3)
    assert hw.single_worker_speedup == pytest.approx(1.25, rel=1e-3)


def test_the_recorded_epochs_follow_the_warm_up_and_fit_in_the_run():
    from gnnpipe.layertimes import recorded_epochs

    assert list(recorded_epochs(10, 1)) == [1, 2, 3] and list(recorded_epochs(10, 0)) == [0, 1, 2]
    assert list(recorded_epochs(3, 2)) == [0, 1, 2] and list(recorded_epochs(2, 5)) == [0, 1]
    assert list(recorded_epochs(1, 0)) == [0]
