rule run_config:
    """One run's resolved config (RunConfig) as YAML: what train and evaluate read."""
    output:
        run_config=f"{RESULTS}/runs/{{run_id}}/run.yaml",
    log:
        f"{LOGS}/runs/{{run_id}}.run_config.log",
    benchmark:
        bench("run_config", "{run_id}"),
    params:
        text=run_config_text,
    conda:
        "../../envs/gnnpipe.yaml"
    shell:
        "printf '%s' {params.text:q} > {output.run_config:q} 2> {log:q}"


rule train:
    """Train one run: one process (single) or torchrun over the run's workers, started by
    `gnnpipe launch` (a run whose layout does not fit a worker's memory is refused first).
    A node run's job then evaluates its finished model itself, rank 0: the exact (non-stale)
    full-graph pass `gnnpipe evaluate` makes, in the process that already holds torch, the
    weights and MLflow's client (eval.json; its time is metrics.json's evaluate_s)."""
    wildcard_constraints:
        run_id=run_id_pattern(NODE_RUNS),
    input:
        unpack(run_inputs),
        init=init_from_input,
    output:
        metrics=f"{RESULTS}/runs/{{run_id}}/metrics.json",
        model=f"{RESULTS}/runs/{{run_id}}/model.pt",
        evaluation=f"{RESULTS}/runs/{{run_id}}/eval.json",
    log:
        f"{LOGS}/train/{{run_id}}.log",
    benchmark:
        bench("train", "{run_id}"),
    threads: timed_threads
    resources:
        nodes=train_resource("nodes"),
        tasks=train_resource("tasks"),
        cpus_per_task=train_resource("cpus_per_task"),
        mem_mb=train_resource("mem_mb"),
        runtime=train_resource("runtime"),
        gres=train_resource("gres"),
        tasks_per_gpu=train_resource("tasks_per_gpu"),
        mpi=train_resource("mpi"),
    params:
        launch=train_launcher,  # a command line built in common.smk (no path in it): not quoted
        omp=WF.training.threads_per_worker,
        mem=WF.resources.mem_mb_per_worker,
    conda:
        "../../envs/gnnpipe.yaml"
    shell:
        "export OMP_NUM_THREADS={params.omp:q};"
        " gnnpipe launch --run-config {input.run_config:q} --mem-mb-per-worker {params.mem:q}"
        " -- {params.launch} train --run-config {input.run_config:q} > {log:q} 2>&1"


use rule train as train_atomic with:
    """Train one atomic run (as train, without its evaluation: evaluate_atomic scores every split's
    systems and writes the test split's predictions.h5, in a process of its own)."""
    wildcard_constraints:
        run_id=run_id_pattern(ATOMIC_RUNS),
    output:
        metrics=f"{RESULTS}/runs/{{run_id}}/metrics.json",
        model=f"{RESULTS}/runs/{{run_id}}/model.pt",


rule evaluate_atomic:
    """An atomic run's S2EF metrics (eval.json) and its test split's per-system predicted energy
    and forces (predictions.h5), in one process whatever mode trained it."""
    wildcard_constraints:
        run_id=run_id_pattern(ATOMIC_RUNS),
    input:
        unpack(run_inputs),
        model=f"{RESULTS}/runs/{{run_id}}/model.pt",
        metrics=f"{RESULTS}/runs/{{run_id}}/metrics.json",
    output:
        evaluation=f"{RESULTS}/runs/{{run_id}}/eval.json",
        predictions=f"{RESULTS}/runs/{{run_id}}/predictions.h5",
    log:
        f"{LOGS}/evaluate/{{run_id}}.log",
    benchmark:
        bench("evaluate_atomic", "{run_id}"),
    threads: train_threads
    resources:
        mem_mb=train_resource("mem_mb"),
        runtime=train_resource("runtime"),
    conda:
        "../../envs/gnnpipe.yaml"
    shell:
        "export OMP_NUM_THREADS={threads:q};"
        " gnnpipe evaluate --run-config {input.run_config:q} --out {output.evaluation:q}"
        " --predictions {output.predictions:q} > {log:q} 2>&1"


rule relax:
    """IS2RS (config relax:): a seeded sample of test systems rattled and relaxed with the run's model,
    one process whatever mode trained it, and with the reference (relax.reference; by default EMT
    for generated data, none for a user's file); relax.json, trajectories."""
    wildcard_constraints:
        run_id=run_id_pattern(RELAX_RUNS),
    input:
        run_config=f"{RESULTS}/runs/{{run_id}}/run.yaml",
        systems=lambda wildcards: RUNS[wildcards.run_id].systems_path,
        model=f"{RESULTS}/runs/{{run_id}}/model.pt",
        evaluation=f"{RESULTS}/runs/{{run_id}}/eval.json",
    output:
        relax=f"{RESULTS}/runs/{{run_id}}/relax.json",
        trajectories=directory(f"{RESULTS}/runs/{{run_id}}/relax"),
    log:
        f"{LOGS}/relax/{{run_id}}.log",
    benchmark:
        bench("relax", "{run_id}"),
    threads: 1
    resources:
        mem_mb=train_resource("mem_mb"),
        runtime=train_resource("runtime"),
    params:
        systems=WF.relax.systems,
        optimizer=WF.relax.optimizer,
        fmax=WF.relax.fmax,
        steps=WF.relax.steps,
        rattle=WF.relax.rattle,
        seed=WF.relax.seed,
        reference=relax_reference,
    conda:
        "../../envs/gnnpipe.yaml"
    shell:
        "export OMP_NUM_THREADS=1;"
        " gnnpipe relax --run-config {input.run_config:q} --systems {params.systems:q}"
        " --optimizer {params.optimizer:q} --fmax {params.fmax:q} --steps {params.steps:q}"
        " --rattle {params.rattle:q} --seed {params.seed:q} --reference {params.reference:q}"
        " --out {output.relax:q} --trajectories {output.trajectories:q} > {log:q} 2>&1"
