"""Peak memory of the whole-graph stages (data, partition, materialize): one process that holds
the whole graph, before any training job starts.

Each stage's peak is ``BASE + bytes_per_entry[stage]·E + 64·N`` (``E`` stored CSR entries, ``N``
nodes) plus ``4·N·F`` for the float32 features where the stage holds them (data, materialize; the
partition rule reads the structure only): the interpreter and its libraries, the edge-proportional
arrays of the stage, a few per-node arrays. The per-entry counts follow the
arrays each stage makes (graph.h5 format 2, int32 ids); the constants were set from
``benchmarks/bench_scale.py``'s measured peaks (reddit-like shape, F = 602) so that every stage is
priced at or above them: at 10^8 edges (N = 2·10^5) data / METIS / materialize measured 2.58 /
4.46 / 3.48 GiB against 2.70 / 4.70 / 3.57 priced (benchmarks/results/scale.json); at 10^7
(``--edges 1e7 --avg-degree 100``: N = 10^5) 0.73 / 0.83 / 0.81 against 1.04 / 0.83 / 0.90:

* ``data`` (synthetic): the sorted undirected keys (4 B per stored entry), the endpoint arrays
  (8), the CSR's ids (4) and the row-merge's flags (1), plus the sampler's draws;
* ``partition`` (METIS): the graph's ids (4), the symmetric adjacency built with scipy (row ids,
  a boolean CSR and its sum with the transpose: ~17), the int64 copy handed to METIS (8) and
  METIS's own graph and coarsened levels (~17: not ours, measured);
* ``materialize``: the renumbering's int64 row, gather and renumbered-id arrays and the per-row
  sort's boolean CSR (~29). Before them, METIS cuts each part into locality pieces on the
  subgraph the part induces (``partition.part_locality_key``), one part at a time, which peaks
  lower: at 10^8 edges with 2 parts the stage measured 3.45 GiB (71.8 s; 3.42 GiB, 28.5 s without
  the pieces, the same machine), within the 3.57 priced.

:func:`metis_extra_bytes` is what METIS needs beyond the graph already in memory:
``gnnpipe partition`` refuses before building anything when the machine has less available.
"""

from __future__ import annotations

from typing import Optional

BASE_BYTES = 0.4 * 2**30  # python, numpy, scipy, h5py, pymetis
SAMPLER_BYTES = 0.25 * 2**30  # the synthetic sampler's rounds of draws (MAX_DRAW), net of what is freed
BYTES_PER_ENTRY = {"data": 17.0, "partition": 46.0, "materialize": 29.0}
BYTES_PER_NODE = 64.0
GRAPH_BYTES_PER_ENTRY = 4.0  # int32 ids of graph.h5 format 2


def graph_stage_memory(num_nodes: int, num_edges: int, num_features: int) -> dict[str, float]:
    """Estimated peak resident bytes of each whole-graph stage (``data``, ``partition``,
    ``materialize``) for a graph of ``num_nodes`` nodes, ``num_edges`` stored entries and
    ``num_features`` float32 features."""
    fixed = BASE_BYTES + BYTES_PER_NODE * num_nodes
    out = {stage: fixed + per * num_edges for stage, per in BYTES_PER_ENTRY.items()}
    out["data"] += SAMPLER_BYTES + 4.0 * num_nodes * num_features
    out["materialize"] += 4.0 * num_nodes * num_features  # the partition rule reads no features
    return out


def metis_extra_bytes(num_nodes: int, num_edges: int) -> float:
    """Bytes METIS partitioning needs beyond the graph already held (adjacency + METIS)."""
    return (BYTES_PER_ENTRY["partition"] - GRAPH_BYTES_PER_ENTRY) * num_edges + BYTES_PER_NODE * num_nodes


def available_memory() -> Optional[int]:
    """The machine's available memory in bytes (``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
