# GNNPipe: full-graph GNN training across many workers, compared mode against mode.
#
#   snakemake --cores all                                  # config/config.yaml, locally
#   snakemake --profile profiles/slurm                     # on a Slurm cluster
#   snakemake --cores 2 --configfile .test/config.yaml --replace-workflow-config
#
# DAG: dataset_spec -> build_graph -> partition -> materialize -> run_config -> train (node runs:
#      + eval.json) [-> evaluate_atomic -> relax, atomic runs] -> report   (docs/WORKFLOW.md)
from snakemake.utils import min_version

min_version("8.0")


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/partition.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/report.smk"


localrules:
    all,
    dataset_spec,
    run_config,
    cost_predictions,
    report,


rule all:
    input:
        final_outputs(),
    default_target: True
