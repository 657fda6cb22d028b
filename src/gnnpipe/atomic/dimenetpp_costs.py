"""DimeNet++'s sizes and costs: closed-form bytes of a step, memory per worker with its triplet
blocks, the blocks' padded counts on a batch, and the measurement of what a step keeps.

What the registry's ``dimenetpp`` entry (``protocol.DIMENETPP``) answers for: ``step_bytes`` (the
ledger's closed form), ``memory_per_worker`` (what ``gnnpipe plan-atomic`` and the launcher's check
size), ``inference_memory`` (an inference call's, the domains layout's plan), ``block_counts`` (its kind-specific sizes on a batch: ``AtomicModelKind.batch_counts``) and
``saved_bytes_by_rows`` (the measurement the estimate's coefficients come from; tests, benchmarks).
GemNet's are beside its model, in ``gemnet.py``; DimeNet++'s module is long enough already.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .dimenetpp import count_parameters, triplet_blocks
from .parallel import collective_passes, shard_graph


def step_bytes(cfg, edges: Sequence[int], atoms: Sequence[int], systems: Sequence[int], ways: int,
               dtype_bytes: int, params: int, training: bool = True, forces: bool = True) -> int:
    """Bytes one DimeNet++ training step sends, summed over every rank (what the ledger counts).

    ``edges[d], atoms[d], systems[d]``: the batch of replica d. With P ways, I = int_emb_size,
    H = hidden, K = num_blocks, b = dtype bytes, per replica:

    * gradient forces (double backward): edge rows ``4·K·(P-1)·E·I·b`` (all-gather forward, its
      reduce-scatter in the force pass, both again in the parameter pass), atom rows
      ``4·(K+1)·(P-1)·N·H·b`` (K+1 output blocks, the same four passes), forces
      ``2·(P-1)·3N·b`` (reduce-scatter, and its all-gather in the parameter pass);
    * direct forces: ``2·K·(P-1)·E·I·b + 2·(K+1)·(P-1)·N·H·b + 2·(P-1)·3N·b``;
    * energies: ``2·(P-1)·B·b`` (ring all-reduce); parameters: ``2·(P-1)·params·b`` per replica
      and ``2·(D-1)·params·b`` per way across replicas.

    ``training=False``: one inference call (energies and forces, no loss): half the passes (forward,
    and the force pass with the gradient head), the forces' exchange once, no parameters.
    ``forces=False`` (energy-only training): the direct head's two passes, either head, and no forces.
    """
    p, d, b = ways, len(edges), dtype_bytes
    k, i, h = cfg.num_blocks, cfg.int_emb_size, cfg.hidden_channels
    passes, once = collective_passes(cfg.force_head, training, forces)
    total = 0
    for e, n, s in zip(edges, atoms, systems):
        total += (p - 1) * b * (passes * k * e * i + passes * (k + 1) * n * h + once * 3 * n + 2 * s)
    return total + training * (d * 2 * (p - 1) * params * b + p * 2 * (d - 1) * params * b)



# --------------------------------------------------------------------------- memory
#: Default padded block counts per worker, per ceil(E/P) local edges or ceil(T/P) local triplets, when
#: the caller does not pass the measured ones (``block_counts``). Measured on the EMT slabs
#: (``data.generate``; cutoff 4.5 Å / 12 neighbours and 5 Å / 24; batches of 1-16 systems, P = 1-8,
#: the largest way) with the blocks bucketed by width (#37): block rows ΣG·Ro 1.00-1.02 × E_loc at
#: P = 1, up to 2.1 at P = 8; block entries ΣG·Ro·Ki 1.06-1.10 × T_loc at P = 1, up to 2.2 at P = 8
#: (a centre's rows split over ways, its columns not); block columns ΣG·Ki 1.00-1.02 × E_loc at P = 1,
#: more where a system is split over ways (see memory_per_worker). The values below were fitted to the
#: single-width blocks before (rows 1.2-1.6, entries 1.3-1.7, columns 1.01-1.10 at P = 1) and are kept:
#: upper bounds now at P = 1 (larger than measured: estimates on their defaults are conservative), and
#: ``INFERENCE_FRACTION`` was fitted against them.
ROWS_PER_EDGE = 1.5
ENTRIES_PER_TRIPLET = 1.6
COLUMNS_PER_EDGE = 1.1


def block_counts(b: dict, ways: int) -> dict:
    """The padded :class:`~gnnpipe.atomic.dimenetpp.TripletBlocks` sizes of batch ``b`` split ``ways``
    ways, each the largest over the ways: ``rows`` ΣG·Ro, ``columns`` ΣG·Ki, ``entries`` ΣG·Ro·Ki (sums over the buckets)
    (the keyword arguments of :func:`memory_per_worker`). Index work only, no model."""
    out = {"rows": 0, "columns": 0, "entries": 0}
    for way in range(ways):
        tb = triplet_blocks(shard_graph(b, ways, way, None))
        for key in out:
            out[key] = max(out[key], tb.count(key))
    return out


def saved_bytes_by_rows(model, g, step: Callable[[], None]) -> dict:
    """Bytes autograd keeps for backward while ``step()`` runs (e.g. a training step's forward and
    backward on ``g``), by what the tensors' rows are, as :func:`memory_per_worker` counts them:
    ``edge`` (local edges, and padded block rows ΣG·Ro), ``column`` (block columns ΣG·Ki, also flattened
    with the S orders or after them: (S, ΣG·Ki, ·)), ``entry`` (block entries ΣG·Ro·Ki), ``atom`` (the view's atoms or own atoms),
    ``other``. Floating tensors only, each storage once (its whole size; a view counts once),
    ``model``'s parameters not. The block sizes and the model's widths must not coincide, except
    rows and columns: on a symmetric graph in one process a centre has as many output edges as
    input edges (Ro = Ki), and their parts are one, ``edge+column``."""
    tb = triplet_blocks(g)
    s = model.cfg.num_spherical
    nrow, ncol, nent = (tb.count(p) for p in ("rows", "columns", "entries"))
    rows = {g.num_local_edges: "edge", g.num_atoms: "atom", g.atom_hi - g.atom_lo: "atom"}
    atom_widths = {model.cfg.hidden_channels, model.cfg.out_emb_channels, 1, 3}  # (N, w) where a bucket's G = N
    flat = [{nent}, {nrow, nrow + 1} | {ncol, ncol * s}, set(rows)]  # flat tensors' first sizes, by part
    if sum(map(len, flat)) != len(set().union(*flat)) or len({nrow, nrow + 1, ncol, ncol * s}) < 3 + (nrow != ncol) \
            or s in set().union(*flat) \
            or any(rows.get(gb) == "atom" and atom_widths & {ro, ki, ki * s} for gb, ro, ki in tb.shapes):
        raise ValueError(f"ambiguous rows: blocks {tb.shapes}, {rows}, widths {atom_widths}")
    merged = nrow == ncol and all(ro == ki for _, ro, ki in tb.shapes)
    entry = [[gb, ro, ki] for gb, ro, ki in tb.shapes] + [[gb, ro, ki * s] for gb, ro, ki in tb.shapes]
    row = [[gb, ro] for gb, ro, _ in tb.shapes]
    column = [[gb, ki] for gb, _, ki in tb.shapes] + [[gb, ki * s] for gb, _, ki in tb.shapes]

    def kind(t: torch.Tensor) -> str:
        d = list((t if t._base is None else t._base).shape)  # a bucket's view: its flat tensor's rows
        if d[:2] == [s, ncol]:
            return "edge+column" if merged else "column"  # per input edge, the S orders first: radial basis, messages
        if d[0] == nent or d[:3] in entry:
            return "entry"  # the angular basis (ΣG·Ro·Ki, S) and its recurrence, a bucket's (G, Ro, Ki[·S])
        if d[0] in (nrow, nrow + 1) or d[:2] in row:
            return "edge+column" if merged else "edge"  # block rows: the (G, Ro, I) sums
        if d[0] in (ncol, ncol * s) or d[:2] in column or d[1:] in ([3, ki] for _, _, ki in tb.shapes):
            return "edge+column" if merged else "column"  # per input edge: radial basis, messages
        part = rows.get(d[0], "other")
        return "edge+column" if merged and part == "edge" else part

    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    out = ({"edge+column": 0} if merged else {"edge": 0, "column": 0}) | {"entry": 0, "atom": 0, "other": 0}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen and t.numel() and t.is_floating_point():
            seen.add(ptr)
            out[kind(t)] += t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return out


def memory_per_worker(cfg, atoms: int, edges: int, triplets: int, ways: int, dtype_bytes: int = 4, *,
                      rows: Optional[int] = None, columns: Optional[int] = None,
                      entries: Optional[int] = None) -> dict:
    """Estimated bytes one of P ways holds for a training step on a batch of that size.

    Parameters, gradients and Adam's two moments: 4 copies, replicated. Activations autograd keeps
    for backward, by what their rows are (none is per triplet: ``dimenetpp`` lays the triplets out as
    dense per-centre blocks, :class:`~gnnpipe.atomic.dimenetpp.TripletBlocks`):

    * **edge**: per local edge (``ceil(E/P)``), and per padded block row (ΣG·Ro, ``rows``: an output
      edge of a centre; default ``ROWS_PER_EDGE``·E_loc);
    * **column**: per padded block column (ΣG·Ki, ``columns``: a distinct input edge read by the
      way's triplets, padded to its bucket's width; default ``COLUMNS_PER_EDGE``·E_loc). The
      radial basis and each block's per-column messages live here. The default holds when a way's
      edges cover whole systems; a system split over ways reads the input edges of atoms across
      the cut as well (one 13-atom slab at P = 8: 8 × E_loc, at most ~1.1 × E): pass the measured
      counts (``block_counts``; ``engine.plan_ways``/``gnnpipe plan-atomic`` do);
    * **entry**: per block entry (ΣG·Ro·Ki, ``entries``, 1.06-2.2 × T_loc; default
      ``ENTRIES_PER_TRIPLET``·T_loc): the angular basis and its Legendre recurrence, shared by
      all blocks;
    * **atom**: per own atom (``ceil(N/P)``): the output blocks' MLPs (after ``sum_atoms``);
    * **gathered_edges**: one block's all-gathered input messages (E, I), alive while they are
      indexed into the columns (not kept for backward; P does not divide it).

    Elements per row (K blocks, H hidden, I int_emb, B basis_emb, O out_emb, L output layers,
    S spherical, R radial, n = num_before_skip + num_after_skip):

    ================  ===================================================  ==============================
    rows              gradient forces (double backward)                    direct forces
    ================  ===================================================  ==============================
    local edge        K(21H + 8nH + 5I) + 11H + 7R + 33                    K(10H + 4nH + 2I) + 7H
                                                                           + (2L+1)O + 2R + 6
    block row         K·I + 3                                              0
    block column      K(4S+1)I + (3S+17)SR - 8R + 35                       K(S+1)I + SR
    block entry       4S - 5 (S >= 3; 2S at S = 2)                         S
    own atom          (K+1)(H + (4L+2)O) + 5                               (K+1)(H + (2L+1)O) + 4
    ================  ===================================================  ==============================

    Where an output MLP has more rows than H (own atoms; the direct head's local edges) its first two
    products are one (``OutputPPBlock.mlp``) and the output of ``lin_up`` is not kept: 2O (gradient) or
    O (direct) less per such row and block (measured the same way, at 3 sizes per head).

    A direct step keeps what its ops save (a Linear its input, an activation its input, a
    product both factors: a residual layer 4H, an output MLP layer 2O; the force head's edge MLP
    ``(2L+1)O``); the gradient step's double backward also keeps the graph of the force pass,
    1.7-1.9 times the direct step's per edge and atom and four times per column (the spherical
    Bessel recurrence ``(3S+17)SR`` and the per-column messages ``4S·I`` per block). The
    coefficients were measured, not only counted: ``saved_tensors_hooks`` over one training
    step (``engine.step_loss`` + ``backward``), distinct storages (a view counts once, parameters
    not), by row kind, on 2 EMT slabs at 30 random sizes per head (K 1-4, H 36-56, I 10-20,
    B 4-8, O 36-60, S 2-8, R 2-8, L 1-3, n 0-4): a least-squares fit in the products above is
    exact (integer coefficients, residual < 1e-10 elements per row), and holds at P = 2 and 4
    (``benchmarks/bench_atomic.py`` prints the estimate per part beside the measurement). Since
    #37 the per-column messages come from the radial basis by one product per order l (W_sbf2 W_sbf1
    per l), with no (·, S, B) tensor, and the edges' basis by one (W_rbf2 W_rbf1), with no (E, B) one:
    per block, the block-column rows lost ``2SB`` (gradient) and ``SB`` (direct), the local edges
    ``2B`` and gained ``I`` (gradient: the gathers' double backward) or lost ``B`` (direct); the
    changes measured the same way, against the code before, at 8-12 sizes per head. Since the edges ->
    atoms sum keeps its index alone (``batch.sum_rows``; autograd's ``index_add`` kept the summed rows),
    what each output block sums, (E, H), and the direct head's force vectors, (E, 3), are not kept:
    the local edges lost ``(K+1)H`` (both heads) and ``3`` (direct), measured the same way (the
    estimate had run 2.5 % over on the edges).
    Not counted: index arrays (the graph's 4 int64 per triplet, the blocks' bool mask per entry)
    and parameter-sized copies (transposed weights, W_sbf2 W_sbf1 per order), < 1 % here.

    The direct step keeps about half the gradient step's memory (0.48 at the default sizes on the
    slabs; the old per-triplet estimate took a third). An estimate for sizing (tests: each part within 1 % of a measured step of each
    head, at a size not used above), not an allocator trace: transient tensors (a backward's
    gradient buffers) come on top.
    """
    k, h, i, be, o = cfg.num_blocks, cfg.hidden_channels, cfg.int_emb_size, cfg.basis_emb_size, cfg.out_emb_channels
    s, r, lo = cfg.num_spherical, cfg.num_radial, cfg.num_output_layers
    res = cfg.num_before_skip + cfg.num_after_skip
    b = dtype_bytes
    local = lambda n: -(-n // ways)  # noqa: E731 - the largest block of np.array_split
    e_loc, t_loc, n_own = local(edges), local(triplets), local(atoms)
    rows = ROWS_PER_EDGE * e_loc if rows is None else rows
    columns = COLUMNS_PER_EDGE * e_loc if columns is None else columns
    entries = ENTRIES_PER_TRIPLET * t_loc if entries is None else entries
    # an output MLP over more rows than H applies lin_up and the next layer as one (OutputPPBlock.mlp):
    # lin_up's output is not kept (O a row; the gradient step's double backward 2O)
    atoms_fused, edges_fused = n_own > h, e_loc > h
    if cfg.force_head == "gradient":
        per_edge = k * (21 * h + 8 * res * h + 5 * i) + 11 * h + 7 * r + 33
        per_row = k * i + 3
        per_column = k * (4 * s + 1) * i + (3 * s + 17) * s * r - 8 * r + 35
        per_entry = max(4 * s - 5, 2 * s)
        per_atom = (k + 1) * (h + (4 * lo + 2 - 2 * atoms_fused) * o) + 5
    else:
        per_edge = k * (10 * h + 4 * res * h + 2 * i) + 7 * h + (2 * lo + 1 - edges_fused) * o + 2 * r + 6
        per_row = 0
        per_column = k * (s + 1) * i + s * r
        per_entry = s
        per_atom = (k + 1) * (h + (2 * lo + 1 - atoms_fused) * o) + 4
    out = {"parameters": 4 * count_parameters(cfg) * b,
           "edge": int((per_edge * e_loc + per_row * rows) * b),
           "column": int(per_column * columns * b),
           "entry": int(per_entry * entries * b),
           "atom": int(per_atom * n_own * b),
           "gathered_edges": int(i * edges * b) if ways > 1 else 0}
    out["total"] = sum(out.values())
    return out


#: An inference call's activations (energy and gradient forces ``-dE/dpos``, no loss, no parameter
#: gradients) over a training step's at the same sizes (:func:`memory_per_worker` without the
#: parameters' copies): the peak RSS above a worker's RSS before the call, measured on Cu fcc with
#: DimeNet++ small, float32, cutoff 3 Å, in the domains layout (benchmarks/results/domains_weak_md.json
#: and domains_weak_large.json: 16,384 and 27,436 own atoms at P = 1, 2, 4), fitted so that the largest
#: relative miss is least: the estimate is within 10 % of each (0.90-1.09; low on the 16,384-atom P = 2
#: view, whose two symmetric workers peaked 14 % apart: glibc's heap, not the model). Re-measured at stop
#: 47 (the peaks 3-9 % lower than the run before, after the output MLPs stopped keeping lin_up's rows and
#: the residual sums went into the activations' buffers; least squares gave 0.52, 0.87 at that view).
#: Before: 0.53 (least squares on the earlier peaks); 0.63 before #34's edges -> atoms sum (638eb4c)
#: lowered the peaks (domains_weak.json, domains_strong.json).
INFERENCE_FRACTION = 0.55


def inference_memory(cfg, atoms: int, edges: int, triplets: int, halo_edges: int, dtype_bytes: int = 4) -> dict:
    """Estimated bytes one worker holds at the peak of an inference call (energy and forces) on a view
    of ``atoms`` own atoms, the ``edges`` into them, their ``triplets`` and ``halo_edges`` input edges
    of those triplets owned by other workers (the atoms layout's ``kj`` halo: block columns too).

    ``parameters``: one copy; ``activations``: ``INFERENCE_FRACTION`` × the training step's
    (:func:`memory_per_worker` at one way, its block columns ``COLUMNS_PER_EDGE`` × (edges +
    halo_edges)): the forward's saved tensors and the force pass's transients, without the double
    backward's graph. Calibrated for the gradient force head only (the direct head's call keeps no
    force pass: the same fraction overestimates it). Not counted: the process's own RSS before the
    call (torch, the model: some 240 MB on CPU)."""
    train = memory_per_worker(cfg, atoms, edges, triplets, 1, dtype_bytes,
                              columns=COLUMNS_PER_EDGE * (edges + halo_edges))
    out = {"parameters": count_parameters(cfg) * dtype_bytes,
           "activations": int(INFERENCE_FRACTION * (train["total"] - train["parameters"]))}
    out["total"] = sum(out.values())
    return out
