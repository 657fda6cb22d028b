rule dataset_spec:
    """The dataset's config (datasets.<name>) as YAML: what `gnnpipe data` reads."""
    output:
        spec=f"{RESULTS}/data/{{dataset}}/dataset.yaml",
    log:
        f"{LOGS}/data/{{dataset}}.spec.log",
    benchmark:
        bench("dataset_spec", "{dataset}"),
    params:
        text=dataset_spec_text,
    conda:
        "../../envs/gnnpipe.yaml"
    shell:
        "printf '%s' {params.text:q} > {output.spec:q} 2> {log:q}"


rule build_graph:
    """Generate (synthetic), download or read (ogb) or load (files) the graph.h5 of a node dataset."""
    input:
        unpack(dataset_inputs),
    output:
        graph=f"{RESULTS}/data/{{dataset}}/graph.h5",
        stats=f"{RESULTS}/data/{{dataset}}/stats.json",
    log:
        f"{LOGS}/data/{{dataset}}.log",
    benchmark:
        bench("build_graph", "{dataset}"),
    conda:
        "../../envs/gnnpipe.yaml"
    shell:
        "gnnpipe data --spec {input.spec:q} --name {wildcards.dataset:q}"
        " --out {output.graph:q} --stats {output.stats:q} > {log:q} 2>&1"


rule build_systems:
    """Generate (frames along EMT relaxations of slabs + adsorbates) or read (ASE db / extxyz / fairchem .aselmdb / an
    OC20 S2EF folder, downloading a named S2EF split when its folder is missing) an atoms dataset: systems.h5."""
    input:
        unpack(dataset_inputs),
    output:
        systems=f"{RESULTS}/data/{{dataset}}/systems.h5",
        stats=f"{RESULTS}/data/{{dataset}}/systems-stats.json",
    log:
        f"{LOGS}/data/{{dataset}}.systems.log",
    benchmark:
        bench("build_systems", "{dataset}"),
    conda:
        "../../envs/gnnpipe.yaml"
    shell:
        "gnnpipe data --spec {input.spec:q} --name {wildcards.dataset:q}"
        " --out {output.systems:q} --stats {output.stats:q} > {log:q} 2>&1"


rule atom_graphs:
    """Symmetric radius graphs over periodic images, reverse edges and triplets k->j->i of every system: graphs.h5."""
    input:
        systems=f"{RESULTS}/data/{{dataset}}/systems.h5",
    output:
        graphs=f"{RESULTS}/data/{{dataset}}/graphs.h5",
        stats=f"{RESULTS}/data/{{dataset}}/graphs-stats.json",
    log:
        f"{LOGS}/data/{{dataset}}.graphs.log",
    benchmark:
        bench("atom_graphs", "{dataset}"),
    params:
        cutoff=lambda wildcards: WF.datasets[wildcards.dataset].atoms.cutoff,
        max_neighbors=lambda wildcards: WF.datasets[wildcards.dataset].atoms.max_neighbors,
        neighbors=lambda wildcards: WF.datasets[wildcards.dataset].atoms.neighbors,
        format_version=GRAPHS_FORMAT,  # a new format rebuilds graphs.h5 (Snakemake's params trigger)
    conda:
        "../../envs/gnnpipe.yaml"
    shell:
        "gnnpipe atom-graphs --systems {input.systems:q} --cutoff {params.cutoff:q}"
        " --max-neighbors {params.max_neighbors:q} --neighbors {params.neighbors:q}"
        " --out {output.graphs:q} --stats {output.stats:q} > {log:q} 2>&1"
