"""Atomistic GNNs trained on one system's graph split across workers (Sriram et al., ICLR 2022).

* ``systems``  — the dataset: structures with energies and forces (ASE-generated, ASE db,
  extxyz), ``systems.h5``;
* ``graphs``   — radius graphs with periodic images and triplets k->j->i, ``graphs.h5``;
* ``batch``    — :class:`AtomGraph`, one rank's view of a batch of systems: the data the
  model computes on and the four reductions it needs (local in one process);
* ``dimenetpp``— DimeNet++ on torch primitives, written against :class:`AtomGraph` only;
* ``parallel`` — the edge/triplet-sharded ``AtomGraph`` (collectives as autograd pairs)
  and the engine of modes ``single`` and ``graph`` for atomic models.

Using a trained model: ``modelfile`` (the self-describing model file), ``inference`` (one
structure's energy, forces, stress; 1 or N graph-parallel worker processes), ``calculator``
(``GNNPipeCalculator``, the ASE calculator, also ``gnnpipe.ase``), ``predict`` (structures to
extxyz; per-system predictions of a split) and ``is2rs`` (relaxations, ADwT / FbT / AFbT).

See docs/ARCHITECTURE.md "Atomic models".
"""
