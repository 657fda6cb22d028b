"""Bytes per epoch, exact: the closed forms the engines' ``predicted_bytes()``, ``gnnpipe plan``
and the report all use (docs/ARCHITECTURE.md, docs/DESIGN.md §4). The only part of the cost
model the engines import: no torch, no files, no hardware.

``b`` bytes per value, ``d_l`` the exchange width of conv ``l`` (``GNN.exchange_dims()``, each
conv's own declaration):

* graph parallelism over ``P`` parts with ``M_p`` mirrors each:
  ``halo = 2 · Σ_p M_p · Σ_l d_l · b`` (halo rows forward, their gradients backward) and
  ``allreduce = 2 (P-1) · num_params · b`` (the ring rule ``2 (P-1)/P`` per rank, summed);
* GNNPipe over ``S`` stages: ``p2p = 2 · Σ_{s=1}^{S-1} N · d_{first conv of s} · b``, doubled
  when the initial residual ``x0`` (same width) travels too (GCNII);
* hybrid ``S × G``: the pipeline term (each way sends its own rows; the ways' rows sum to
  ``N``), the halo term of the G ways (way ``g`` = chunks ``g·C/G ..``) for every conv (whichever stage owns it),
  and per stage the all-reduce of that stage's parameters across its ``G`` ways.
  ``G = P`` is graph parallelism, ``G = 1`` GNNPipe (tested identities): the one engine
  (``gnnpipe.parallel.layout_engine``) predicts every layout with :func:`hybrid_bytes`.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..io import GnnPipeError


def allreduce_bytes(num_params: int, bytes_per_value: int, ranks: int) -> int:
    """Bytes all ``ranks`` send together in a ring all-reduce of ``num_params`` values:
    ``2 (n-1) · num_params · b`` (the communicator counts each rank's exact share)."""
    if ranks <= 1:
        return 0
    return 2 * (int(ranks) - 1) * int(num_params) * int(bytes_per_value)


def _bytes(halo: int = 0, p2p: int = 0, allreduce: int = 0) -> dict:
    return {"halo": int(halo), "p2p": int(p2p), "allreduce": int(allreduce),
            "total": int(halo) + int(p2p) + int(allreduce)}


FIRST_INPUT = ("exchanged", "forward", "local")


def halo_values(exchange_dims: Sequence[int], first_input: str) -> int:
    """Values one mirror costs per epoch over all convs, both directions.

    ``first_input``: what the first conv's input costs: ``"exchanged"`` (rows forward,
    gradients back: docs/DESIGN.md's ``2 · Σ_l d_l``), ``"forward"`` (raw features: rows forward
    only, no gradient) or ``"local"`` (the input halo is cached at set-up: nothing).
    """
    if first_input not in FIRST_INPUT:
        raise GnnPipeError(f"first_input must be one of {', '.join(FIRST_INPUT)}, got {first_input!r}")
    dims = [int(d) for d in exchange_dims]
    if not dims:
        return 0
    return 2 * sum(dims[1:]) + {"exchanged": 2, "forward": 1, "local": 0}[first_input] * dims[0]


def first_input(model, graph_parallel_cfg) -> str:
    """What the first conv's halo costs graph parallelism (one of ``FIRST_INPUT``), as the
    graph engine runs ``model`` (a built ``GNN``: its ``convs`` and ``encoder``) under
    ``graph_parallel_cfg`` (``config.GraphParallelConfig``): ``"local"`` when the input
    halo is cached at set-up (``cache_input_halo``) or there is no graph layer; else
    ``"exchanged"`` when the first conv reads an encoder's output (its gradient goes
    back) and ``"forward"`` when it reads the raw features (no gradient)."""
    if graph_parallel_cfg.cache_input_halo or not len(model.convs):
        return "local"
    return "exchanged" if model.encoder is not None else "forward"


def graph_parallel_bytes(mirrors_per_part: Sequence[int], exchange_dims: Sequence[int],
                         bytes_per_value: int, num_params: int, world: int,
                         first_input: str = "exchanged", halo_dims: Optional[Sequence[int]] = None) -> dict:
    """Bytes sent per epoch by all ranks of graph parallelism (``world`` parts).

    ``halo = 2 · Σ_p M_p · Σ_l d_l · b`` (``first_input="exchanged"``; see
    :func:`_halo_values` for the cheaper first-conv variants); ``allreduce = 2 (P-1) ·
    num_params · b``. For a GCN of ``L`` layers ``Σ_l d_l = F + (L-1) H``. ``halo_dims``: the
    halo width of every conv where it differs from ``exchange_dims`` (``GNN.halo_dims()``, the
    narrow side: ``min(in, out)`` for GCN / SAGE).
    """
    if len(mirrors_per_part) != world:
        raise GnnPipeError(f"graph parallelism on {world} workers needs {world} mirror counts, "
                           f"got {len(mirrors_per_part)}")
    halo = sum(int(m) for m in mirrors_per_part) * halo_values(halo_dims or exchange_dims, first_input) \
        * int(bytes_per_value)
    return _bytes(halo=halo, allreduce=allreduce_bytes(num_params, bytes_per_value, world))


def pipeline_bytes(num_nodes: int, stage_boundary_dims: Sequence[int], bytes_per_value: int,
                   carries_x0: bool = False) -> dict:
    """Bytes sent per epoch by all stages of GNNPipe.

    ``stage_boundary_dims[k]``: the width of the rows crossing boundary ``k`` (the input
    width of the first conv of stage ``k+1``). Every node's row crosses every boundary
    once forward and its gradient once backward: ``2 · Σ_k N · d_k · b``; doubled when
    ``x0`` (of the same width) travels with it.
    """
    per_row = sum(int(d) for d in stage_boundary_dims) * (2 if carries_x0 else 1)
    return _bytes(p2p=2 * int(num_nodes) * per_row * int(bytes_per_value))


def boundary_dims(exchange_dims: Sequence[int], stage_bounds: Sequence[tuple[int, int]]) -> list[int]:
    """The width crossing each stage boundary: the input width of stages 1..S-1's first conv."""
    return [int(exchange_dims[a]) for a, _ in list(stage_bounds)[1:]]


def hybrid_bytes(num_nodes: int, mirrors_per_way: Sequence[int], exchange_dims: Sequence[int],
                 stage_bounds: Sequence[tuple[int, int]], params_per_stage: Sequence[int],
                 bytes_per_value: int, carries_x0: bool = False,
                 nodes_per_way: Optional[Sequence[int]] = None, first_input: str = "exchanged",
                 halo_dims: Optional[Sequence[int]] = None) -> dict:
    """Bytes sent per epoch by all ranks of hybrid ``S × G`` (``G = len(mirrors_per_way)``).

    * p2p: every way sends its ``N_g`` rows across every stage boundary and their
      gradients back (``Σ_g N_g = N``): the pipeline term;
    * halo: inside the stage that owns conv ``l``, the ``G`` ways exchange the mirrors of
      the G-way partition, ``2 · Σ_g M_g · d_l · b`` per conv (so ``Σ_l`` over all convs;
      ``first_input`` as in :func:`graph_parallel_bytes`);
    * allreduce: stage ``s``'s parameters across its ``G`` ways, ``2 (G-1) · params_s · b``.

    ``halo_dims`` (default ``exchange_dims``): the halo width of every conv, the narrow side
    where nothing is buffered (one chunk per way: ``GNN.halo_dims()``); the stage boundaries
    always carry the input width.

    ``G = P`` (one stage) equals :func:`graph_parallel_bytes`, ``G = 1``
    :func:`pipeline_bytes`.
    """
    ways = len(mirrors_per_way)
    if ways < 1:
        raise GnnPipeError("hybrid needs at least one way")
    if len(params_per_stage) != len(stage_bounds):
        raise GnnPipeError(f"{len(stage_bounds)} stages but {len(params_per_stage)} parameter counts")
    if nodes_per_way is None:
        nodes_per_way = [num_nodes]  # only the sum matters for the total
    elif len(nodes_per_way) != ways or sum(int(n) for n in nodes_per_way) != num_nodes:
        raise GnnPipeError(f"nodes_per_way must hold {ways} counts summing to {num_nodes}")
    dims = boundary_dims(exchange_dims, stage_bounds)
    p2p = sum(pipeline_bytes(n, dims, bytes_per_value, carries_x0)["p2p"] for n in nodes_per_way)
    covered = sorted(l for a, b in stage_bounds for l in range(a, b))
    if covered != list(range(len(exchange_dims))):
        raise GnnPipeError(f"stage bounds {list(stage_bounds)} do not cover convs 0..{len(exchange_dims) - 1} "
                           "exactly once")
    if halo_dims is not None and len(halo_dims) != len(exchange_dims):
        raise GnnPipeError(f"{len(exchange_dims)} convs but {len(halo_dims)} halo widths")
    halo = sum(int(m) for m in mirrors_per_way) * halo_values(halo_dims or exchange_dims, first_input) \
        * int(bytes_per_value)
    allreduce = sum(allreduce_bytes(p, bytes_per_value, ways) for p in params_per_stage)
    return _bytes(halo=halo, p2p=p2p, allreduce=allreduce)
