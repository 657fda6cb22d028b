rule partition:
    """Split the nodes into k parts (METIS, random or contiguous) with cut/halo statistics."""
    input:
        graph=f"{RESULTS}/data/{{dataset}}/graph.h5",
    output:
        assignment=f"{RESULTS}/partitions/{{dataset}}/{{method}}-{{parts}}.npy",
        stats=f"{RESULTS}/partitions/{{dataset}}/{{method}}-{{parts}}.json",
    log:
        f"{LOGS}/partition/{{dataset}}/{{method}}-{{parts}}.log",
    benchmark:
        bench("partition", "{dataset}/{method}-{parts}"),
    params:
        seed=WF.partitioning.seed,
        balance_edges="" if WF.partitioning.balance_edges else "--no-balance-edges",
        balance_nodes="" if WF.partitioning.balance_nodes else "--no-balance-nodes",
    conda:
        "../../envs/gnnpipe.yaml"
    shell:
        "gnnpipe partition --graph {input.graph:q} --method {wildcards.method:q}"
        " --parts {wildcards.parts:q} --seed {params.seed:q} {params.balance_edges:q} {params.balance_nodes:q}"
        " --out {output.assignment:q} --stats {output.stats:q} > {log:q} 2>&1"


rule materialize:
    """The chunk store: parts renumbered to contiguous id ranges, halos and send lists."""
    input:
        graph=f"{RESULTS}/data/{{dataset}}/graph.h5",
        assignment=f"{RESULTS}/partitions/{{dataset}}/{{method}}-{{parts}}.npy",
    output:
        store=store_path(RESULTS, "{dataset}", "{method}", "{parts}"),
    log:
        f"{LOGS}/materialize/{{dataset}}/{{method}}-{{parts}}.log",
    benchmark:
        bench("materialize", "{dataset}/{method}-{parts}"),
    conda:
        "../../envs/gnnpipe.yaml"
    shell:
        "gnnpipe materialize --graph {input.graph:q} --assignment {input.assignment:q}"
        " --out {output.store:q} > {log:q} 2>&1"


rule locality:
    """The single engine's node order (training.node_order locality: METIS parts of ~1,024 nodes),
    once per graph: every single-process run and calibration on the graph reads it."""
    input:
        graph=f"{RESULTS}/data/{{dataset}}/graph.h5",
    output:
        order=locality_path(RESULTS, "{dataset}"),
    log:
        f"{LOGS}/partition/{{dataset}}/locality.log",
    benchmark:
        bench("locality", "{dataset}"),
    params:
        seed=WF.partitioning.seed,
    conda:
        "../../envs/gnnpipe.yaml"
    shell:
        "gnnpipe locality --graph {input.graph:q} --seed {params.seed:q} --out {output.order:q} > {log:q} 2>&1"
