rule report:
    """Tables over this config's runs (modes side by side, seeds pooled, graph ÷ pipeline and
    ÷ hybrid, measured vs cost model) and plots; `snakemake --report` shows the plots."""
    input:
        unpack(run_records),
    output:
        report=report(f"{RESULTS}/report.md", caption="../report/report_md.rst", category="Report"),
        plots=report(directory(f"{RESULTS}/plots"), patterns=["{name}.png"],
                     caption="../report/plots.rst", category="Plots"),
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
