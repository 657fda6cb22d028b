rule report:
    """One table over this config's runs (modes side by side, graph ÷ pipeline) and plots."""
    input:
        unpack(run_records),
    output:
        report=f"{RESULTS}/report.md",
        plots=directory(f"{RESULTS}/plots"),
    log:
        "logs/report.log",
    params:
        runs=report_run_args,
        runs_dir=lambda wildcards, input: os.path.dirname(os.path.dirname(input.metrics[0])),
    conda:
        "../../envs/gnnpipe.yaml"
    shell:
        "gnnpipe report --runs-dir {params.runs_dir} {params.runs}"
        " --out {output.report} --plots {output.plots} > {log} 2>&1"
