rule dataset_spec:
    """The dataset's config (datasets.<name>) as YAML: what `gnnpipe data` reads."""
    output:
        spec=f"{RESULTS}/data/{{dataset}}/dataset.yaml",
    log:
        "logs/data/{dataset}.spec.log",
    params:
        text=dataset_spec_text,
    conda:
        "../../envs/gnnpipe.yaml"
    shell:
        "printf '%s' {params.text:q} > {output.spec} 2> {log}"


rule download:
    """Generate (synthetic), download or read (ogb) or load (files) the graph.h5."""
    input:
        unpack(dataset_inputs),
    output:
        graph=f"{RESULTS}/data/{{dataset}}/graph.h5",
        stats=f"{RESULTS}/data/{{dataset}}/stats.json",
    log:
        "logs/data/{dataset}.log",
    conda:
        "../../envs/gnnpipe.yaml"
    shell:
        "gnnpipe data --spec {input.spec} --name {wildcards.dataset}"
        " --out {output.graph} --stats {output.stats} > {log} 2>&1"
