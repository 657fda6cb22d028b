"""Planning: which way of spreading a whole-graph GNN over P workers wins, and why.

For a graph, a model, a hardware profile (``config/hardware/*.yaml``) and a worker count,
the plan enumerates every layout the engines run::

    graph     S = 1, G = P        (P METIS parts)
    pipeline  S = P, G = 1        (when P <= layers)
    hybrid    S x G = P, 1 < S < P
    single    (P = 1 only)

and predicts for each, with :mod:`gnnpipe.costmodel`, the bytes per epoch (exact), the
epoch time and its compute / communication / bubble split, the stage imbalance and the
peak memory per worker; it recommends the fastest layout that fits in memory and says
why in one paragraph. Stages are split the way the pipeline engine splits them
(``gnnpipe.parallel.balance``, ``estimate`` by default).

The modules, by what they do:

* :mod:`.shape`: the built model as the cost model sees it (``model_shape``), ``build_model``;
* :mod:`.stats`: the graph's partition statistics and their cache, extrapolation to a larger
  graph of the same shape, a mirror-ratio override;
* :mod:`.plan`: the layouts, the prediction of one layout (``predict_layout``, also the
  report's), the plan and its reasons, ``run_plan`` (``gnnpipe plan``);
* :mod:`.calibrate`: the compute rates fitted to this machine (``gnnpipe calibrate``,
  ``gnnpipe plan --calibrate``).

The command-line parsers (``gnnpipe plan``, ``plan-stats``, ``calibrate``) are in
:mod:`gnnpipe.cli`.
"""
