rule cost_predictions:
    """The cost model's prediction of every node run (bytes, epoch time and its split, peak memory)
    on its graph's partition statistics and the profile fitted to its model: the report's
    "measured vs cost model" column, made here so the report itself imports no torch (#36)."""
    input:
        unpack(cost_model_inputs),
        metrics=[f"{RESULTS}/runs/{rid}/metrics.json" for rid in NODE_RUNS],
        run_configs=[f"{RESULTS}/runs/{rid}/run.yaml" for rid in NODE_RUNS],
    output:
        predictions=PREDICTIONS,
    log:
        f"{LOGS}/cost_model/predictions.log",
    benchmark:
        bench("cost_predictions", "cost_predictions"),
    params:
        runs=[arg for rid in NODE_RUNS for arg in ("--run", rid)],
        runs_dir=lambda wildcards, input: os.path.dirname(os.path.dirname(input.metrics[0])),
        cost_dir=lambda wildcards, output: os.path.dirname(output.predictions),
    conda:
        "../../envs/gnnpipe.yaml"
    shell:
        "gnnpipe predict-costs --runs-dir {params.runs_dir:q} {params.runs:q}"
        " --hardware {input.hardware:q} --cost-model-dir {params.cost_dir:q} --out {output.predictions:q} > {log:q} 2>&1"


rule report:
    """Tables over this config's runs (modes side by side, seeds pooled, graph ÷ pipeline and
    ÷ hybrid, measured vs cost model) and plots; `snakemake --report` shows the plots. It reads
    the cost model's predictions (rule cost_predictions): it builds no model and imports no torch."""
    input:
        unpack(run_records),
        unpack(cost_model_inputs),
        unpack(report_predictions),
    output:
        report=report(f"{RESULTS}/report.md", caption="../report/report_md.rst", category="Report"),
        plots=report(directory(f"{RESULTS}/plots"), patterns=["{name}.png"],
                     caption="../report/plots.rst", category="Plots"),
    log:
        f"{LOGS}/report.log",
    benchmark:
        bench("report", "report"),
    params:
        runs=report_run_args,
        runs_dir=lambda wildcards, input: os.path.dirname(os.path.dirname(input.metrics[0])),
        cost_dir=COST_DIR,
        benchmarks=BENCHMARKS,  # every job upstream of this one has written its file
        predictions=report_predictions_arg,  # quoted there (empty without node runs): not quoted
    conda:
        "../../envs/gnnpipe.yaml"
    shell:
        "gnnpipe report --runs-dir {params.runs_dir:q} {params.runs:q}"
        " --hardware {input.hardware:q} --cost-model-dir {params.cost_dir:q} --benchmarks {params.benchmarks:q}"
        " {params.predictions} --out {output.report:q} --plots {output.plots:q} > {log:q} 2>&1"


rule plan_stats:
    """Partition statistics of a dataset for the cost model: every partition its runs use (those
    the partition rule makes for the chunk stores are read, not computed again)."""
    input:
        unpack(plan_assignments),
        graph=f"{RESULTS}/data/{{dataset}}/graph.h5",
    output:
        stats=f"{COST_DIR}/{{dataset}}/plan-stats.json",
    log:
        f"{LOGS}/cost_model/{{dataset}}.plan-stats.log",
    benchmark:
        bench("plan_stats", "{dataset}"),
    params:
        parts=plan_parts,
        method=WF.partitioning.method,
        seed=WF.partitioning.seed,
        balance_edges="" if WF.partitioning.balance_edges else "--no-balance-edges",
        balance_nodes="" if WF.partitioning.balance_nodes else "--no-balance-nodes",
        assignments=plan_assignment_args,
    conda:
        "../../envs/gnnpipe.yaml"
    shell:
        "gnnpipe plan-stats --graph {input.graph:q} --parts {params.parts:q} --method {params.method:q}"
        " --seed {params.seed:q} {params.balance_edges:q} {params.balance_nodes:q}"
        " {params.assignments}"
        " --out {output.stats:q} > {log:q} 2>&1"


rule calibrate:
    """The cost model's hardware profile with its compute rates fitted, on this machine, to
    a dataset's graph and a model: to the layers its train jobs timed as they trained (their
    run records; it feeds only the report, which waits for them anyway), or, without a
    one-process run's, to samples timed here (on the thread's CPU clock: other jobs may run)."""
    input:
        unpack(calibration_inputs),
        graph=f"{RESULTS}/data/{{dataset}}/graph.h5",
        hardware=HARDWARE_FILE,
    output:
        profile=f"{COST_DIR}/{{dataset}}/{{model}}.yaml",
    log:
        f"{LOGS}/cost_model/{{dataset}}.{{model}}.calibrate.log",
    benchmark:
        bench("calibrate", "{dataset}/{model}"),
    params:
        cache=f"{RESULTS}/calibration_cache",  # content-keyed: another config or rerun on the same graph reuses a fit
    # from the train jobs' records: a fraction of a second, one thread; timing its own samples
    # (tens of seconds on a 10^5-node graph, once per graph and model: cached): alone on the machine
    threads: calibration_threads
    conda:
        "../../envs/gnnpipe.yaml"
    shell:
        "gnnpipe calibrate --run-config {input.run_config:q} --hardware {input.hardware:q}"
        " --cache {params.cache:q} --records {input.records:q} --out {output.profile:q} > {log:q} 2>&1"
