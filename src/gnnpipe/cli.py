"""``gnnpipe``: the command line of every pipeline stage (the Snakemake rules call it).

    gnnpipe data        --spec dataset.yaml --name synth --out results/data/synth/graph.h5
    gnnpipe atom-graphs --systems systems.h5 --cutoff 5 --max-neighbors 32 --out graphs.h5
    gnnpipe plan-atomic --systems systems.h5 --graphs graphs.h5 --preset xl --device-gib 32
    gnnpipe partition   --graph graph.h5 --method metis --parts 4 --out metis-4.npy
    gnnpipe materialize --graph graph.h5 --assignment metis-4.npy --out metis-4.h5
    gnnpipe locality    --graph graph.h5 --seed 0 --out locality.npz   (the single engine's node order, once)
    gnnpipe train       --run-config results/runs/<run_id>/run.yaml   (torchrun for P > 1)
    gnnpipe launch      --run-config run.yaml --mem-mb-per-worker 4096 [-- torchrun ...]
                                                      (the train rule: check the plan, start, report OOM)
    gnnpipe evaluate    --run-config results/runs/<run_id>/run.yaml
    gnnpipe relax       --run-config results/runs/<run_id>/run.yaml [--reference emt|none|module:Class]  (IS2RS)
    gnnpipe predict     --run results/runs/<run_id> --structures in.extxyz --out out.extxyz [--workers N]
                        [--layout auto|edges|atoms|domains] [--stats predict.json]
    gnnpipe import-model --from fairchem gemnet_t.pt [--config gemnet.yml] [--scale-file s.json] --out model.pt
    gnnpipe report      --runs-dir results/runs --out results/report.md [--predictions predictions.json]
    gnnpipe predict-costs --runs-dir results/runs --cost-model-dir results/cost_model --out predictions.json
                                                      (the cost model's predictions the report reads)
    gnnpipe runs        --config config/config.yaml   (list / resolve the configured runs)
    gnnpipe plan        --graph graph.h5 --hardware 8xgpu-pcie --workers 8 --layers 32
                                                      (predict and recommend a layout)
    gnnpipe calibrate   --run-config run.yaml --hardware cpu-2core --out fitted.yaml
    gnnpipe plan-stats  --graph graph.h5 --parts 2 4 8 --out plan-stats.json

Every sub-command has its own ``--help``. Errors in the user's input print one line,
``gnnpipe: error: ...``, and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .io import GnnPipeError

LAUNCHER_PID = os.getppid()  # who started this process (torchrun's agent, for a worker), read first thing


def _data(a):
    from .config import DatasetConfig, from_dict, load_yaml
    from .data import dataset_summary, load_dataset
    from .graph import write_graph
    from .io import write_json

    cfg = from_dict(DatasetConfig, load_yaml(a.spec), path=f"{a.spec}")
    if cfg.kind == "atoms":  # structures with energies and forces: systems.h5 (graphs: atom-graphs)
        from .atomic.data import systems_from_config, systems_summary, write_systems
        systems = systems_from_config(cfg.atoms)
        digest = write_systems(a.out, systems, params={"name": a.name})
        if a.stats:
            write_json(a.stats, {**systems_summary(systems), "content_hash": digest})
        print(f"wrote {a.out}: {len(systems['energy'])} systems, {len(systems['z'])} atoms", file=sys.stderr)
        return
    graph = load_dataset(cfg, a.name, progress=True)
    digest = write_graph(a.out, graph)
    if a.stats:
        write_json(a.stats, {**dataset_summary(graph), "content_hash": digest, "params": graph.params})
    print(f"wrote {a.out}: {graph.num_nodes} nodes, {graph.num_edges} edges, "
          f"{graph.num_features} features, {graph.num_classes} classes", file=sys.stderr)


def _atom_graphs(a):
    from .atomic.data import build_graphs, graph_stats, read_systems, write_graphs
    from .io import write_json

    systems = read_systems(a.systems)
    graphs = build_graphs(systems, a.cutoff, a.max_neighbors, neighbors=a.neighbors)
    digest = write_graphs(a.out, graphs, a.cutoff, a.max_neighbors, systems["content_hash"], a.neighbors)
    stats = graph_stats(graphs, systems)
    if a.stats:
        write_json(a.stats, {**stats, "cutoff": a.cutoff, "max_neighbors": a.max_neighbors, "neighbors": a.neighbors,
                             "content_hash": digest})
    print(f"wrote {a.out}: {stats['edges_total']} edges, {stats['triplets_total']} triplets "
          f"({stats['edges_mean']:.0f} / {stats['triplets_mean']:.0f} per system)", file=sys.stderr)


def _plan_domains(a):
    """plan-atomic --structure: one structure's inference call in the domains layout, per worker."""
    import os

    from .atomic.atom_layouts import DOMAINS
    from .atomic.neighbors import radius_graph
    from .atomic.predict import read_rows
    from .atomic.protocol import ATOMIC_MODELS

    kind = ATOMIC_MODELS[a.model]
    if a.preset not in kind.presets:
        raise GnnPipeError(f"plan-atomic: {a.model} has no preset {a.preset!r} (its presets: {', '.join(kind.presets)})")
    if a.workers < 1:
        raise GnnPipeError(f"plan-atomic: --workers must be >= 1, got {a.workers}")
    mcfg = kind.preset(a.preset, force_head=a.force_head, cutoff=a.cutoff)
    where, atoms = max(read_rows(a.structure), key=lambda row: len(row[1]))  # the largest structure
    b = {"z": atoms.numbers, "pos": atoms.positions, "cell": atoms.cell.array, "pbc": atoms.pbc, "cutoff": mcfg.cutoff}
    graph, nbytes = radius_graph(b["pos"], b["cell"], b["pbc"], mcfg.cutoff), 4 if a.dtype == "float32" else 8
    if a.mem_mb_per_worker:
        cap, bound, shared = a.mem_mb_per_worker * 2**20, f"--mem-mb-per-worker {a.mem_mb_per_worker}", False
    else:  # this machine's memory, shared by its P workers
        cap = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        cap, bound, shared = cap, f"this machine's {cap / 2**30:.1f} GiB shared by the P workers", True
    need = DOMAINS.smallest_fit(kind, mcfg, b, cap, nbytes, graph=graph, shared=shared)
    ways = sorted({1 << k for k in range(a.workers.bit_length()) if 1 << k < a.workers} | {a.workers}
                  | ({need} if need else set()))
    print(f"{kind.labels[mcfg.force_head]} {a.preset} (cutoff {mcfg.cutoff:g} Å, {a.dtype}), one inference call on "
          f"{a.structure} {where}: {len(b['z']):,} atoms, {len(graph[0]):,} edges; per worker in the domains layout "
          f"(the largest worker; MB/worker: its peak RSS, {DOMAINS.WORKER_RSS / 2**20:.0f} MB before the call included)")
    print(f"{'P':>4} {'atoms':>10} {'edges':>11} {'triplets':>13} {'halo edges':>11} {'MB/worker':>10}")
    for p in ways:
        c = DOMAINS.costs(kind, mcfg, b, p, nbytes, graph)
        r = max(c["sizes"], key=lambda s: s["edges_own"])
        print(f"{p:>4} {r['atoms_own']:>10,} {r['edges_own']:>11,} {r['triplets_own']:>13,} {r['halo_edges']:>11,} "
              f"{(DOMAINS.WORKER_RSS + c['memory']) / 2**20:>10,.0f}" + ("  <- --workers" if p == a.workers else ""))
    print(f"smallest P that fits {bound}: {need}" if need else f"no P up to 256 fits {bound}")
    print(_structure_layout(kind, mcfg, b, a.workers, nbytes, cap // a.workers if shared else cap, graph))


def _structure_layout(kind, mcfg, b, workers: int, nbytes: int, cap: int, graph) -> str:
    """The plan's layout at ``workers`` for one structure under ``cap`` bytes a worker
    (``atom_layouts.choose_for_structure``): one line."""
    from .atomic.atom_layouts import choose_for_structure

    if workers == 1:
        return "layout at P = 1: one process (no layout)"
    try:
        chosen = choose_for_structure(kind, mcfg, b, workers, nbytes, cap, graph)
    except GnnPipeError as e:
        return f"layout at P = {workers}: none fits ({e})"
    if chosen is None:
        return (f"layout at P = {workers}: edges or atoms (each worker's whole graph fits {cap / 2**20:,.0f} MB; "
                "the predictor's auto takes the one of fewer bytes)")
    return (f"layout at P = {workers}: {chosen.name} (the edges and atoms layouts' whole graph a worker does not fit "
            f"{cap / 2**20:,.0f} MB, its regions do)")


def _plan_atomic(a):
    import resource

    if a.structure:
        return _plan_domains(a)

    from .atomic.atomic_engine import batch_plan, largest_batch, plan_run
    from .atomic.protocol import ATOMIC_MODELS

    if a.run_config:  # one run's model and batch, against the workers' memory
        from .config import load_run_config

        cfg = load_run_config(a.run_config)
        if not cfg.atomic:
            raise GnnPipeError(f"{a.run_config}: run {cfg.run_id} trains a node model ({cfg.model.kind}); "
                               "plan-atomic plans atomic runs (gnnpipe plan plans the others)")
        if a.mem_mb_per_worker:  # host memory: a worker's process counts, as this one measures it after its imports
            cap, cap_name = a.mem_mb_per_worker * 2**20, f"resources.mem_mb_per_worker = {a.mem_mb_per_worker}"
            overhead = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        else:
            cap, cap_name, overhead = int(a.device_gib * 2**30), f"--device-gib {a.device_gib:g}", 0
        plan = plan_run(cfg, cap, overhead)
        line = plan.answer(cfg.run_id, cap_name)
        if a.check:
            if not plan.fits:
                raise GnnPipeError(line)
            print(line, file=sys.stderr)
            return
        kind, mcfg, (n, e, t), rows = plan.kind, plan.model_cfg, plan.batch, plan.rows
        title = f"{kind.name} of run {cfg.run_id}"
        shown = plan.layout.name if plan.layout.distributed_build else "atoms"  # the domains run: its own columns
    else:
        if not (a.systems and a.graphs):
            raise GnnPipeError("plan-atomic: give --run-config, or --systems and --graphs")
        from .atomic.data import batch_arrays, read_graphs, read_systems
        kind = ATOMIC_MODELS[a.model]
        if a.preset not in kind.presets:
            raise GnnPipeError(f"plan-atomic: {a.model} has no preset {a.preset!r} (its presets: "
                               f"{', '.join(kind.presets)})")
        systems = read_systems(a.systems)
        graphs = read_graphs(a.graphs, systems["content_hash"])
        b = batch_arrays(systems, graphs, largest_batch(systems, graphs, a.batch_size))
        n, e, t = len(b["z"]), len(b["edge_src"]), len(b["idx_kj"])
        mcfg = kind.preset(a.preset, force_head=a.force_head, cutoff=float(graphs["cutoff"]))
        rows = batch_plan(kind, mcfg, b, int(a.device_gib * 2**30), 4 if a.dtype == "float32" else 8)
        title, line, shown = f"{kind.name} {a.preset}", None, "atoms"
    print(f"{title}: {kind.count_parameters(mcfg):,} parameters; largest step batch: {n} atoms, {e} edges, "
          f"{t} triplets")
    parts = [k for k in rows[0]["memory"] if k != "total"]  # the kind's own parts (GiB per worker)
    print(f"{'P':>4} {'GiB/worker':>11} " + " ".join(f"{k[:14]:>14}" for k in parts) + f" {'MB/step':>10}  fits"
          f" {shown[:5] + ' GiB':>10} {shown[:5] + ' MB':>10}  layout")
    for r in rows:
        m, atoms = r["memory"], (r.get("layouts") or {}).get(shown)
        print(f"{r['ways']:>4} {r['memory_per_worker'] / 2**30:>11.2f} "
              + " ".join(f"{m[k] / 2**30:>14.3f}" for k in parts)
              + f" {r['bytes_per_step'] / 1e6:>10.1f}  {'yes' if r['fits'] else 'no ':<3}"
              + (f" {atoms['memory'] / 2**30:>10.2f} {atoms['bytes'] / 1e6:>10.1f}" if atoms else f" {'-':>10} {'-':>10}")
              + f"  {r.get('layout', 'edges')}")
    need = next((r["ways"] for r in rows if r["fits"]), None)
    print(f"smallest P that fits: {need}" if need else "no P up to the edge count fits: use a smaller model")
    if line:
        print(line)


def _partition(a):
    from .graph import read_graph
    from .io import write_json
    from .partition import balance_name, partition_graph, partition_stats, write_partition

    graph = read_graph(a.graph, features=False)  # METIS needs the structure only
    assignment = partition_graph(graph, a.method, a.parts, seed=a.seed, balance_edges=a.balance_edges,
                                 balance_nodes=a.balance_nodes)
    write_partition(a.out, assignment)
    stats = partition_stats(graph, assignment)
    if a.stats:
        write_json(a.stats, {"method": a.method, "balance": balance_name(a.method, a.balance_nodes, a.balance_edges),
                             "balance_edges": a.balance_edges, "balance_nodes": a.balance_nodes, "seed": a.seed,
                             **stats})
    print(f"gnnpipe: {a.method} partition of {graph.num_nodes:,} nodes into {a.parts} parts: node balance "
          f"{stats['node_balance']:.3f}, edge balance {stats['edge_balance']:.3f} (max part / mean), edge cut "
          f"{stats['edge_cut_fraction']:.3f}", file=sys.stderr)


def _materialize(a):
    from .graph import read_graph
    from .partition import read_partition
    from .store import materialize

    graph = read_graph(a.graph)
    assignment = read_partition(a.assignment, graph.num_nodes)
    materialize(graph, assignment, a.out, graph_hash=graph.content_hash(),
                method=Path(a.assignment).stem, progress=True)


def _locality(a):
    from .graph import read_graph, read_graph_attrs
    from .partition import write_locality

    graph = read_graph(a.graph, features=False)  # METIS needs the structure only
    done = write_locality(a.out, graph, seed=a.seed, graph_hash=str(read_graph_attrs(a.graph)["content_hash"]))
    print(f"gnnpipe: locality order of {done['nodes']:,} nodes: "
          + (f"{done['parts']} METIS parts in {done['seconds']:.2f} s" if done["parts"] else
             f"the given ids kept ({done['skipped'] or 'fewer than two parts of nodes'})"), file=sys.stderr)


def _train(a):
    from .launch import join_worker_cap

    join_worker_cap()  # a per-worker memory cap (GNNPIPE_MEMCAP_CGROUP), before torch takes any memory
    from .config import load_run_config
    from .train import die_with_launcher, run

    die_with_launcher(LAUNCHER_PID)
    run(load_run_config(a.run_config), restart=a.restart)


def _launch(a):
    from .launch import launch

    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    return launch(a.run_config, command, a.mem_mb_per_worker, a.force)  # the exit status


def _train_systems(text: str):
    """``--train-systems``: a positive count or ``all``."""
    if text == "all":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a positive number of systems or 'all', not {text!r}")
    return int(text)


def _import_model(a):
    from .atomic.fairchem import import_checkpoint, summary_line
    from .atomic.modelfile import save_model_file

    payload, summary = import_checkpoint(a.checkpoint, config=a.config, scale_file=a.scale_file)
    save_model_file(a.out, payload)
    print(summary_line(summary, a.out), file=sys.stderr)


def _evaluate(a):
    from .config import load_run_config
    from .evaluate import evaluate_run

    res = evaluate_run(load_run_config(a.run_config), checkpoint=a.checkpoint, out=a.out,
                       allow_partial=a.allow_partial, predictions=a.predictions, train_systems=a.train_systems)
    if res.get("train_systems_scored", 0) < res.get("train_systems", 0):
        print(f"train_* scored on a seeded sample of {res['train_systems_scored']} of the {res['train_systems']} "
              "training systems (--train-systems all: every one)", file=sys.stderr)
    print(" ".join(f"{k}={v:.4f}" for k, v in res.items() if isinstance(v, float)), file=sys.stderr)


def _relax(a):
    from .atomic.is2rs import relax_run
    from .atomic.modelfile import energy_words
    from .config import load_run_config

    res = relax_run(load_run_config(a.run_config), systems=a.systems, optimizer=a.optimizer, fmax=a.fmax,
                    steps=a.steps, rattle_stdev=a.rattle, seed=a.seed,
                    reference=a.reference, out=a.out,
                    trajectories=a.trajectories, progress=True)
    print(" ".join(f"{k}={v:.4f}" for k, v in res.items() if isinstance(v, float))
          + f" energies={energy_words(res['energy_reference'])}", file=sys.stderr)


def _predict(a):
    import time

    from .atomic.modelfile import load_model_file
    from .atomic.predict import predict

    from .io import write_json

    start = time.perf_counter()
    mf = load_model_file(a.run)
    done = predict(mf, a.structures, a.out, workers=a.workers, device=a.device, dtype=a.dtype, threads=a.threads,
                   layout=a.layout, skin=a.skin, progress=True)
    seconds = time.perf_counter() - start
    layouts = ", ".join(f"{name} {k}" for name, k in done.layouts.items())
    print(f"gnnpipe: {done.count} structures predicted into {a.out} ({done.workers} worker(s) x "
          f"{done.threads} torch thread(s), {done.count / seconds:.2f} structures/s; layout: {layouts}; "
          f"rebuilds: {done.rebuilds}; energies: {mf.energies})", file=sys.stderr)
    if a.stats:
        write_json(a.stats, {"structures": done.count, "out": str(a.out), "workers": done.workers,
                             "threads": done.threads, "layout_asked": a.layout, "layouts": done.layouts,
                             "rebuilds": done.rebuilds, "bytes": done.bytes, "seconds": seconds,
                             "energies": mf.energies})


#: ``gnnpipe predict --layout``'s values, without importing torch to list them: auto and
#: ``atomic.atom_layouts.PREDICT_LAYOUTS`` (tests/test_predict.py keeps the two equal; the Predictor refuses others)
PREDICT_LAYOUT_CHOICES = "auto, edges, atoms, domains"


def _run_dirs(a) -> list[Path]:
    """The run directories ``--runs-dir`` / ``--run`` name (report, predict-costs)."""
    runs = sorted(p.parent for p in Path(a.runs_dir).glob("*/metrics.json"))
    if a.run:
        runs = [Path(a.runs_dir) / r for r in a.run]
    if not runs:
        raise GnnPipeError(f"{a.runs_dir}: no run records (*/metrics.json); train some runs first")
    return runs


def _report(a):
    from .report import build_report

    build_report(_run_dirs(a), Path(a.out), Path(a.plots), hardware=a.hardware, cost_model_dir=a.cost_model_dir,
                 benchmarks_dir=a.benchmarks, predictions=a.predictions)


def _predict_costs(a):
    from .report.atomic import is_atomic
    from .report.predictions import write_predictions
    from .report.records import load_runs

    runs = [r for r in load_runs(_run_dirs(a)) if not is_atomic(r)]
    doc = write_predictions(runs, Path(a.out), a.hardware, a.cost_model_dir)
    done = sum(p["reason"] is None for p in doc["runs"].values())
    print(f"{a.out}: {done} of {len(runs)} node runs predicted on {doc['hardware']}")


def _runs(a):
    from .config import dump_run_config, load_workflow_config, resolve_runs

    runs = resolve_runs(load_workflow_config(a.config))
    if a.resolve:
        if a.resolve not in runs:
            raise GnnPipeError(f"no run {a.resolve!r} in {a.config} (runs: {', '.join(runs)})")
        print(dump_run_config(runs[a.resolve]), end="")
        return
    for rid, r in runs.items():
        print(f"{rid}\t{r.mode}\tworkers={r.workers} stages={r.stages} ways={r.ways} chunks={r.chunks}")


def _plan(a):
    from .config import load_yaml
    from .kinds import CONVS
    from .planning.plan import run_plan

    if a.run_config:  # one node run against its workers' memory (the launcher's check)
        return _fit_run(a)
    if not (a.hardware and a.workers):
        raise GnnPipeError("plan: give --hardware and --workers (or --run-config)")
    if a.kind is not None and CONVS[a.kind].work is None:
        raise GnnPipeError(f"plan: --kind {a.kind} has no graph layers, so no cost model; use one of "
                           + ", ".join(k for k, kind in CONVS.items() if kind.work is not None))
    data = {}
    if a.model:
        data = load_yaml(a.model) or {}
        if not isinstance(data, dict):
            raise GnnPipeError(f"{a.model}: a model config is a mapping")
    for key in ("kind", "layers", "hidden"):
        if getattr(a, key) is not None:
            data[key] = getattr(a, key)
    run_plan(a.graph, data, a.hardware, a.workers, a.out, stats_path=a.stats, at_nodes=a.at_nodes,
             at_edges=a.at_edges, chunks_per_stage=a.chunks_per_stage, dtype=a.dtype, method=a.method,
             seed=a.seed, overlap=a.overlap, balance=a.balance, calibrate_rates=a.calibrate,
             threads=a.threads, mirror_ratio=a.mirror_ratio, first_input=a.first_input, clock=a.clock)


def _fit_run(a):
    import resource

    from .config import load_run_config
    from .launch import machine_memory
    from .planning.fit import fit_run

    cfg = load_run_config(a.run_config)
    overhead = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # a worker's process, after its imports
    fit = fit_run(cfg, a.mem_mb_per_worker, machine_memory(), overhead, a.workers_per_node)
    if a.check and not fit.fits:
        raise GnnPipeError(fit.line())
    print(fit.line(), file=sys.stderr if a.check else sys.stdout)


def _calibrate(a):
    from .planning.calibrate import calibrate_run, write_hardware

    write_hardware(calibrate_run(a.run_config, a.hardware, clock=a.clock, cache=a.cache, records=a.records), a.out)


def _plan_stats(a):
    from .planning.stats import cached_graph_stats

    cached_graph_stats(a.graph, a.parts, method=a.method, seed=a.seed, balance_edges=a.balance_edges,
                       balance_nodes=a.balance_nodes, progress=True, cache_file=a.out, assignments=dict(a.assignment))


def _part_file(text: str) -> tuple[int, str]:
    k, sep, path = text.partition("=")
    if not (sep and k.isdigit() and path):
        raise argparse.ArgumentTypeError(f"expected PARTS=FILE such as 4=results/partitions/d/metis-4.npy, got {text!r}")
    return int(k), path


def _ratio(text: str) -> tuple[int, float]:
    try:
        g, r = text.split(":")
        return int(g), float(r)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PARTS:RATIO such as 8:2.1, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gnnpipe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("data", help="build the canonical graph.h5 of a dataset",
                       description="Generate (synthetic) or load (ogb, files) a dataset and write "
                                   "its canonical graph file (HDF5, in-edge CSR + arrays).")
    d.add_argument("--spec", required=True, help="YAML of the dataset's config (the datasets.<name> entry)")
    d.add_argument("--name", required=True, help="dataset name, as in the config's datasets")
    d.add_argument("--out", required=True, help="graph file to write (results/data/<name>/graph.h5)")
    d.add_argument("--stats", help="also write a JSON summary (sizes, degrees, splits)")
    d.set_defaults(func=_data, outputs=("out", "stats"))

    from .config import NEIGHBOR_CONVENTIONS

    g = sub.add_parser("atom-graphs", help="radius graphs and triplets of atomistic systems",
                       description="For every system of a systems.h5 (`gnnpipe data` on an atoms dataset): "
                                   "the directed edges within the cutoff over periodic images (at most "
                                   "max-neighbors nearest per atom) and the triplets k->j->i; writes graphs.h5.")
    g.add_argument("--systems", required=True, help="results/data/<name>/systems.h5")
    g.add_argument("--cutoff", type=float, required=True, help="radius in Å (also the model's basis cutoff)")
    g.add_argument("--max-neighbors", type=int, required=True, help="nearest neighbours kept per atom")
    g.add_argument("--neighbors", choices=NEIGHBOR_CONVENTIONS, default="project",
                   help="how the cap makes the graph symmetric: project (a pair if either atom nominated the "
                        "other) or fairchem (fairchem's GemNet graph); default project")
    g.add_argument("--out", required=True, help="results/data/<name>/graphs.h5")
    g.add_argument("--stats", help="also write a JSON summary (edges, triplets per system)")
    g.set_defaults(func=_atom_graphs, outputs=("out", "stats"))

    from .kinds import ATOMIC_MODELS

    pa = sub.add_parser("plan-atomic", help="memory per worker and bytes of an atomic model at P = 1, 2, 4, ...",
                        description="Size an atomic model (a kind and preset, e.g. gemnet_t xl, which may not fit "
                                    "here; or a run's own model and batch) on an atoms dataset's largest "
                                    "systems: estimated memory per graph-parallel worker, the closed-form bytes "
                                    "per step, and the smallest P that fits a device (--device-gib) or a "
                                    "worker's memory (--mem-mb-per-worker, with the process's own). For P > 1 "
                                    "also the atoms layout (runs[].atom_layout: METIS atom parts, each worker "
                                    "receives only its halo): its memory and bytes per step, and the layout to "
                                    "use (fewer bytes among those that fit).")
    pa.add_argument("--structure", help="one structure (ASE .db or extxyz; the largest of the file): an inference "
                                        "call's peak memory per worker in the distributed build (--layout domains) "
                                        "at P = 1, 2, 4, ... --workers, and the smallest P that fits")
    pa.add_argument("--workers", type=int, default=1, help="with --structure: the P to price")
    pa.add_argument("--layout", choices=["domains"], default="domains",
                    help="with --structure: the workers' layout (the distributed build)")
    pa.add_argument("--cutoff", type=float, help="with --structure: the model's cutoff, Å (default: the preset's)")
    pa.add_argument("--run-config", help="a run's run.yaml: its model, batch size, dtype, data and P")
    pa.add_argument("--systems", help="systems.h5 (without --run-config)")
    pa.add_argument("--graphs", help="graphs.h5 (without --run-config)")
    pa.add_argument("--model", default="dimenetpp", choices=ATOMIC_MODELS.names(), help="the atomic model kind")
    pa.add_argument("--preset", default="xl", help="a preset of the kind (small, default, xl)")
    pa.add_argument("--force-head", choices=["gradient", "direct"], help="default: the preset's")
    pa.add_argument("--batch-size", type=int, default=1, help="systems per step and replica (the largest ones)")
    pa.add_argument("--device-gib", type=float, default=32.0, help="memory of one device, GiB")
    pa.add_argument("--mem-mb-per-worker", type=int,
                    help="with --run-config or --structure: the memory of one worker process, MiB "
                         "(resources.mem_mb_per_worker; --structure without it: this machine's memory, shared)")
    pa.add_argument("--check", action="store_true",
                    help="with --run-config: one line; exit 2 if the run's P does not fit (gnnpipe launch's check)")
    pa.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    pa.set_defaults(func=_plan_atomic)

    q = sub.add_parser("partition", help="partition a graph (METIS, random, contiguous)",
                       description="Partition the nodes into k parts and write the assignment (.npy) "
                                   "and its statistics (edge cut, balance, mirrors per part).")
    q.add_argument("--graph", required=True, help="graph.h5")
    q.add_argument("--method", default="metis", choices=["metis", "random", "contiguous"])
    q.add_argument("--parts", type=int, required=True, help="number of parts k")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--no-balance-edges", dest="balance_edges", action="store_false",
                   help="METIS without degree vertex weights (balances nodes, not edges)")
    q.add_argument("--no-balance-nodes", dest="balance_nodes", action="store_false",
                   help="balance the edges alone (one METIS constraint), not nodes and edges")
    q.add_argument("--out", required=True, help="assignment file (.npy, one part id per node)")
    q.add_argument("--stats", help="statistics JSON")
    q.set_defaults(func=_partition, outputs=("out", "stats"))

    m = sub.add_parser("materialize", help="write the chunk store (HDF5) of a partition",
                       description="Renumber nodes so each part is a contiguous id range and write, per "
                                   "part, its in-edge CSR, features, labels, masks, halo and send lists.")
    m.add_argument("--graph", required=True, help="graph.h5")
    m.add_argument("--assignment", required=True, help="assignment .npy from `gnnpipe partition`")
    m.add_argument("--out", required=True, help="chunk store to write (results/chunks/<d>/<method>-<k>.h5)")
    m.set_defaults(func=_materialize, outputs=("out",))

    lo = sub.add_parser("locality", help="the single engine's locality node order of a graph, once",
                        description="METIS into parts of ~1,024 nodes, the nodes numbered by part "
                                    "(training.node_order locality): what every single-process run and "
                                    "calibration on the graph read instead of running METIS each.")
    lo.add_argument("--graph", required=True, help="graph.h5")
    lo.add_argument("--seed", type=int, default=0, help="METIS's seed (partitioning.seed)")
    lo.add_argument("--out", required=True, help="order file to write (results/partitions/<d>/locality.npz)")
    lo.set_defaults(func=_locality, outputs=("out",))

    t = sub.add_parser("train", help="train one run (under torchrun for parallel modes)",
                       description="Train one run from its resolved config, resuming from its last "
                                   "complete checkpoint if it has one. Modes graph, pipeline and "
                                   "hybrid run under torchrun: torchrun --standalone --nproc-per-node P "
                                   "-m gnnpipe.cli train --run-config run.yaml")
    t.add_argument("--run-config", required=True, help="results/runs/<run_id>/run.yaml")
    t.add_argument("--restart", action="store_true",
                   help="discard the run's checkpoint (<out_dir>/resume) and train from epoch 0; without it "
                        "a rerun resumes from the last complete checkpoint, and one of another config or "
                        "data is refused (environment: GNNPIPE_RESTART=1)")
    t.set_defaults(func=_train)

    la = sub.add_parser("launch", help="start a run's training: refuse what will not fit, name a memory cap",
                        description="Start one run's training (the command after --, default: one process "
                                    "for single, torchrun on this node otherwise). A run that will not fit "
                                    "--mem-mb-per-worker and this machine's share per worker at its layout "
                                    "(gnnpipe plan-atomic for atomic runs, gnnpipe plan --run-config for node runs) is "
                                    "refused first with the plan's one line (exit 2); a worker the kernel's "
                                    "out-of-memory killer ends is reported in one line naming the cap (exit 137).")
    la.add_argument("--run-config", required=True, help="results/runs/<run_id>/run.yaml")
    la.add_argument("--mem-mb-per-worker", type=int,
                    help="memory of one worker, MiB (resources.mem_mb_per_worker); none: node runs are checked against "
                         "this machine's memory only, atomic runs not at all")
    la.add_argument("--force", action="store_true",
                    help="start a run the plan refuses (environment: GNNPIPE_FORCE_LAUNCH=1)")
    la.add_argument("command", nargs="*", help="-- then the launch command (default: built from the run)")
    la.set_defaults(func=_launch)

    e = sub.add_parser("evaluate", help="exact full-graph inference of a trained run",
                       description="Load the run's checkpoint and compute train/val/test accuracy with "
                                   "exact (non-stale) full-graph inference in one process. Atomic runs: "
                                   "the OC20 S2EF metrics per split, and the test split's predicted energy "
                                   "and forces per system (predictions.h5, docs/DESIGN.md).")
    e.add_argument("--run-config", required=True, help="results/runs/<run_id>/run.yaml")
    e.add_argument("--checkpoint", help="default: <out_dir>/model.pt")
    e.add_argument("--out", help="default: <out_dir>/eval.json")
    e.add_argument("--predictions", help="atomic runs: default <out_dir>/predictions.h5")
    e.add_argument("--train-systems", type=_train_systems, metavar="N|all",
                   help="atomic runs: score this many training systems (a seeded sample), or all; default the "
                        "model's eval_train_systems (500)")
    e.add_argument("--allow-partial", action="store_true",
                   help="accept a checkpoint of an unfinished run (e.g. <out_dir>/checkpoint.pt); "
                        "its config and data are still checked")
    e.set_defaults(func=_evaluate, outputs=("out", "predictions"))

    from .config import RelaxConfig
    rd = RelaxConfig()
    rx = sub.add_parser("relax", help="IS2RS of a trained atomic run: relax test systems, ADwT / FbT / AFbT",
                        description="Rattle --systems systems of an atomic run's test split (a seeded sample across "
                                    "compositions and trajectories) and relax "
                                    "them with the run's finished model (one process, whatever mode trained it) "
                                    "and with the reference calculator; write relax.json (ADwT, FbT, AFbT, "
                                    "relaxed-energy MAE, steps; docs/DESIGN.md), one ASE trajectory per system "
                                    "and calculator, and log the metrics to the run's MLflow run. Defaults: "
                                    "OC20's IS2RS baseline (ASE L-BFGS, maxstep 0.04 Å, memory 50).")
    rx.add_argument("--run-config", required=True, help="results/runs/<run_id>/run.yaml (its model.pt finished)")
    rx.add_argument("--systems", type=int, default=rd.systems,
                    help="test systems to relax, drawn across compositions and trajectories (default %(default)s)")
    rx.add_argument("--optimizer", choices=("lbfgs", "fire"), default=rd.optimizer, help="ASE optimiser (default %(default)s)")
    rx.add_argument("--fmax", type=float, default=rd.fmax, help="eV/Å: converged at this largest free-atom force (default %(default)s)")
    rx.add_argument("--steps", type=int, default=rd.steps, help="optimiser steps at most per relaxation (default %(default)s)")
    rx.add_argument("--rattle", type=float, default=rd.rattle,
                    help="Å: Gaussian displacement of free atoms giving the initial structures (default %(default)s)")
    rx.add_argument("--seed", type=int, default=rd.seed, help="seed of the rattle and the sample (default %(default)s)")
    rx.add_argument("--reference",
                    help="the calculator the data was labelled with: emt, none (ML relaxations and energies only) "
                         "or an ASE calculator class module:Class (default: emt for gnnpipe's EMT-generated "
                         "systems, none for a user's file)")
    rx.add_argument("--out", help="default: <out_dir>/relax.json")
    rx.add_argument("--trajectories", help="directory of <i>-ml.traj / <i>-ref.traj (default: <out_dir>/relax)")
    rx.set_defaults(func=_relax, outputs=("out",), output_dirs=("trajectories",))

    pr = sub.add_parser("predict", help="energies, forces (and stress) of structures with a trained atomic model",
                        description="Compute every structure of an extended XYZ or ASE database with a trained "
                                    "atomic model: energy, forces and, for 3-D periodic cells, stress, written to "
                                    "an extended XYZ as ASE writes a calculator's results (ase.io.read(out, ':') "
                                    "gives them back). --workers N splits each structure's graph over N local "
                                    "processes (the same numbers to rounding). Every structure's elements are "
                                    "checked against the model's before any is computed; errors name the row.")
    pr.add_argument("--run", required=True,
                    help="a finished run directory (results/runs/<run_id>) or a model file")
    pr.add_argument("--structures", required=True, help="structures to compute: .extxyz / .xyz, or an ASE .db")
    pr.add_argument("--out", required=True, help="extended XYZ to write (atomically)")
    pr.add_argument("--workers", type=int, default=1,
                    help="local processes per structure (graph parallelism; at most the CPU cores; default %(default)s)")
    pr.add_argument("--threads", type=int,
                    help="torch threads per worker (default: OMP_NUM_THREADS, else the CPU cores / --workers)")
    pr.add_argument("--device", default="cpu", help="torch device (default %(default)s)")
    pr.add_argument("--dtype", choices=("float32", "float64"), help="default: the model's own")
    pr.add_argument("--layout", default="auto",
                    help=f"how the workers split a structure: {PREDICT_LAYOUT_CHOICES} (domains: each worker "
                         "builds its own spatial domain's graph, for one large structure; auto: per structure, the "
                         "fewer closed-form bytes; default %(default)s)")
    pr.add_argument("--skin", type=float,
                    help="Å, the domains layout's Verlet skin: consecutive frames of one system keep their "
                         "decomposition while no atom moved half of it (default 1.0)")
    pr.add_argument("--stats", help="also write a JSON summary (structures, workers, layouts used, rebuilds, seconds)")
    pr.set_defaults(func=_predict, outputs=("out", "stats"))

    im = sub.add_parser("import-model", help="a fairchem 1.x checkpoint (GemNet-T/-dT/-XL, DimeNet++) as a model file",
                        description="Write the project's model file (what predict, the calculator and relax read) "
                                    "from a fairchem 1.x checkpoint: its EMA weights when it has them, else its "
                                    "state_dict (one or two 'module.' prefixes), its normalisers, its scale "
                                    "factors. Loaded with torch.load(weights_only=True) and a fixed allow-list; "
                                    "a key that maps to no parameter, a parameter with no weights, a shape "
                                    "mismatch or a disallowed type refuses the import in one line. Energies are "
                                    "what the checkpoint was trained on (OC20 S2EF: adsorption energies).")
    im.add_argument("--from", dest="source", default="fairchem", choices=("fairchem",),
                    help="the checkpoint's trainer (default %(default)s, the only one)")
    im.add_argument("checkpoint", help="the fairchem checkpoint (.pt)")
    im.add_argument("--config", help="fairchem training YAML whose model section replaces the checkpoint's config")
    im.add_argument("--scale-file", help="fairchem scale-factor file (.json or .pt) for GemNet, if the checkpoint "
                                         "lacks them")
    im.add_argument("--out", required=True, help="model file to write (atomically)")
    im.set_defaults(func=_import_model, outputs=("out",))

    r = sub.add_parser("report", help="table and plots over runs",
                       description="Write a Markdown table over all run records and PNG plots.")
    r.add_argument("--runs-dir", default="results/runs")
    r.add_argument("--run", action="append", help="only these run ids (repeatable)")
    r.add_argument("--out", default="results/report.md")
    r.add_argument("--plots", default="results/plots")
    r.add_argument("--hardware", default="cpu-2core",
                   help="hardware profile the cost model predicts each run on (a name under "
                        "config/hardware or a YAML file)")
    r.add_argument("--cost-model-dir", metavar="DIR",
                   help="per dataset, DIR/<dataset>/plan-stats.json (`gnnpipe plan-stats`) and "
                        "DIR/<dataset>/*.yaml profiles calibrated to a model (`gnnpipe calibrate`): "
                        "a run uses the one fitted to its model, else --hardware (default: "
                        "statistics cached next to each graph.h5, no calibration)")
    r.add_argument("--benchmarks", metavar="DIR",
                   help="the workflow's Snakemake benchmark files, DIR/<rule>/<job>.tsv: a table of each "
                        "stage's wall time and peak memory, set-up against training (default: none)")
    r.add_argument("--predictions", metavar="FILE",
                   help="the cost model's predictions of the runs, made beforehand (`gnnpipe predict-costs`): "
                        "read instead of predicting (--hardware and --cost-model-dir are the file's; no torch)")
    r.set_defaults(func=_report, outputs=("out",), output_dirs=("plots",))

    pc = sub.add_parser("predict-costs", help="the cost model's prediction of every run, for the report",
                        description="Predict each node run's bytes, epoch time and its split and peak memory "
                                    "with the cost model (as `gnnpipe report` does) into a JSON file that "
                                    "`gnnpipe report --predictions` reads: the models are built here (torch), "
                                    "not in the report.")
    pc.add_argument("--runs-dir", default="results/runs")
    pc.add_argument("--run", action="append", help="only these run ids (repeatable)")
    pc.add_argument("--hardware", default="cpu-2core", help="as report's --hardware")
    pc.add_argument("--cost-model-dir", metavar="DIR", help="as report's --cost-model-dir")
    pc.add_argument("--out", required=True, help="the predictions file (JSON)")
    pc.set_defaults(func=_predict_costs, outputs=("out",))

    s = sub.add_parser("runs", help="list the runs a workflow config defines",
                       description="Validate a workflow config and list its runs, or print one run's "
                                   "resolved config (what the train rule writes to run.yaml).")
    s.add_argument("--config", default="config/config.yaml")
    s.add_argument("--resolve", metavar="RUN_ID", help="print this run's resolved config as YAML")
    s.set_defaults(func=_runs)

    from .costmodel.bytes import FIRST_INPUT
    from .kinds import CONVS
    from .planning.calibrate import CLOCKS
    from .planning.shape import DTYPE_BYTES

    pl = sub.add_parser(
        "plan", help="predict and compare graph / pipeline / hybrid layouts on a cluster",
        description="Predict, for every layout of --workers workers (graph parallelism, GNNPipe, "
                    "hybrid), the bytes per epoch (exact), the epoch time, the pipeline bubble and "
                    "the peak memory per worker on a hardware profile, and recommend the fastest "
                    "that fits. Partition statistics are computed with METIS on the graph and "
                    "cached next to it.")
    pl.add_argument("--graph", action="append", help="graph.h5 (repeat: samples of one shape to "
                                                     "extrapolate to --at-nodes)")
    pl.add_argument("--stats", help="a plan statistics JSON instead of --graph")
    pl.add_argument("--at-nodes", type=int, help="extrapolate the statistics to this many nodes")
    pl.add_argument("--at-edges", type=int, help="... and this many stored edges (default: same E/N)")
    pl.add_argument("--mirror-ratio", metavar="G:R", type=_ratio,
                    help="scale every partition's mirrors so that G parts have R*N (e.g. 8:2.1, a "
                         "published figure for the graph the statistics stand in for)")
    pl.add_argument("--model", help="YAML of the model config (a models.<name> entry)")
    # the names only: asking each entry for its work would import torch in every command's parser
    pl.add_argument("--kind", choices=CONVS.names(), help="override model.kind (a kind with graph layers)")
    pl.add_argument("--layers", type=int, help="override model.layers")
    pl.add_argument("--hidden", type=int, help="override model.hidden")
    pl.add_argument("--hardware", help="a profile name under config/hardware (e.g. 8xgpu-pcie) or a YAML file")
    pl.add_argument("--workers", type=int, help="number of workers P")
    pl.add_argument("--chunks-per-stage", type=int, default=4, help="pipeline chunks C = this x S")
    pl.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES))
    pl.add_argument("--method", default="metis", choices=["metis", "random", "contiguous"])
    pl.add_argument("--seed", type=int, default=0, help="partition seed")
    pl.add_argument("--balance", default="estimate", choices=["uniform", "estimate", "profile"],
                    help="stage split, as pipeline.balance")
    pl.add_argument("--no-overlap", dest="overlap", action="store_false",
                    help="graph parallelism without overlap of inner rows and halo exchange")
    pl.add_argument("--first-input", default="local", choices=list(FIRST_INPUT),
                    help="graph parallelism's first conv: input halo cached at set-up (local, the "
                         "engine's default), rows forward only, or rows and gradients (exchanged)")
    pl.add_argument("--calibrate", action="store_true",
                    help="fit the compute rates to this machine on the (last) graph first")
    pl.add_argument("--threads", type=int, default=1, help="compute threads per worker for --calibrate")
    pl.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                    help="--calibrate timing: wall clock, or the thread's CPU time (a shared machine)")
    pl.add_argument("--out", help="write the plan as JSON here")
    pl.add_argument("--run-config", help="instead: a node run's run.yaml, its memory per worker against "
                                         "--mem-mb-per-worker and this machine's share (gnnpipe.planning.fit)")
    pl.add_argument("--mem-mb-per-worker", type=int, help="with --run-config: resources.mem_mb_per_worker")
    pl.add_argument("--workers-per-node", type=int, help="with --run-config: workers sharing this machine "
                                                         "(default: all of the run's)")
    pl.add_argument("--check", action="store_true",
                    help="with --run-config: one line; exit 2 if the run does not fit (what gnnpipe launch asks)")
    pl.set_defaults(func=_plan, outputs=("out",))

    c = sub.add_parser(
        "calibrate", help="fit a hardware profile's compute rates to a run's graph and model",
        description="Fit the layers that --records' train jobs timed as they trained, or else time "
                    "every distinct conv of the run's model forward and backward on samples "
                    "of its graph (and the bare kernels); fit the cost model's compute rates "
                    "(dense FLOP/s, sparse and elementwise values/s, random numbers/s, per-call "
                    "overhead) and write the profile with those rates as YAML. The links keep the "
                    "profile's values. A fit found in --cache is reused.")
    c.add_argument("--run-config", required=True, help="results/runs/<run_id>/run.yaml of a run to fit to")
    c.add_argument("--hardware", required=True, help="base profile: a name under config/hardware or a YAML file")
    c.add_argument("--clock", default="cpu", choices=sorted(CLOCKS),
                   help="cpu (default): the timing thread's CPU time, blind to other jobs on the "
                        "machine; wall: wall-clock time (used anyway for several threads per worker)")
    c.add_argument("--cache", default=None,
                   help="directory of fitted profiles keyed by what the fit depends on (this machine and "
                        "base profile, graph content, model, dtype, threads, clock; from --records: the base "
                        "profile, graph content, model, dtype and the records' rows): one found there is "
                        "reused, one fitted is added (the workflow: results/calibration_cache)")
    c.add_argument("--records", nargs="*", default=[], metavar="METRICS_JSON",
                   help="run records (results/runs/<run_id>/metrics.json) of train jobs of the same dataset and "
                        "model: the layers they timed as they trained are fitted instead of timing samples here "
                        "(a one-process run's rows and a parallel run's give the rates and the cold-to-warm "
                        "speed-up together); "
                        "without a one-process run's rows, samples are timed as without --records")
    c.add_argument("--out", required=True, help="profile to write (YAML)")
    c.set_defaults(func=_calibrate, outputs=("out",))

    ps = sub.add_parser(
        "plan-stats", help="partition statistics the cost model needs, as JSON",
        description="Partition the graph into each of --parts parts (as the partition rule does) "
                    "and write the statistics the cost model reads: rows, inner rows, in-edges and "
                    "mirrors per part. An existing file for the same graph content, method and seed "
                    "is extended, not recomputed; a part count given an --assignment reads that "
                    "partition instead of partitioning again.")
    ps.add_argument("--graph", required=True, help="graph.h5")
    ps.add_argument("--parts", type=int, nargs="*", default=[],
                    help="part counts (none: the graph's sizes only)")
    ps.add_argument("--method", default="metis", choices=["metis", "random", "contiguous"])
    ps.add_argument("--seed", type=int, default=0)
    ps.add_argument("--no-balance-edges", dest="balance_edges", action="store_false")
    ps.add_argument("--no-balance-nodes", dest="balance_nodes", action="store_false")
    ps.add_argument("--assignment", type=_part_file, action="append", default=[], metavar="PARTS=FILE",
                    help="a partition already made (`gnnpipe partition` / the partition rule: the .npy, its "
                         ".json beside it) with this method, seed and balance; repeatable")
    ps.add_argument("--out", required=True, help="statistics JSON to write")
    ps.set_defaults(func=_plan_stats, outputs=("out",))
    return p


def check_outputs(args) -> None:
    """Refuse, before any work, an output the command could not write (``outputs``: files,
    ``output_dirs``: directories, as each sub-command declares them): a directory or a device
    where a file goes, a read-only file system, an empty path (gnnpipe.io.check_destination)."""
    from .io import check_destination, check_directory

    for names, check in ((getattr(args, "outputs", ()), check_destination),
                         (getattr(args, "output_dirs", ()), check_directory)):
        for name in names:
            if getattr(args, name) is not None:
                check(getattr(args, name), "--" + name.replace("_", "-"))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_outputs(args)
        return args.func(args) or 0  # launch returns its command's status; the others None
    except GnnPipeError as e:
        print(f"gnnpipe: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
