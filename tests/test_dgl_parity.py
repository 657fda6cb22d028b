"""Our layers against DGL's, the correctness oracle: same graph, same weights, float64.

Runs only in the pinned DGL environment (``make test-dgl``: DGL 2.1.0, torch 2.2.1,
numpy 1.x, gnnpipe imported from ``src/``); elsewhere the module is skipped, and under
``GNNPIPE_REQUIRE_DGL=1`` (set by ``make test-dgl``) a dgl that does not import fails.

Mapping of the layers (weights copied ours -> DGL):

* ``GCNConv``  <-> ``dgl.nn.GraphConv(norm='both')`` on the graph with ``dgl.add_self_loop``:
  DGL's degrees then include the self loop, ``1/sqrt((d_out(j)+1)(d_in(i)+1))``, which is
  our whole-graph normalisation. ``GraphConv.weight`` is ``(in, out)``: ours transposed.
* ``SAGEConv`` <-> ``dgl.nn.SAGEConv(aggregator_type='mean')`` on the plain graph:
  ``fc_self`` (with the bias) and ``fc_neigh``.
* ``GATConv``  <-> ``dgl.nn.GATConv`` on the graph with self loops: ``fc`` is our weight
  (heads-major), ``attn_l`` / ``attn_r`` our source / destination attention vectors; DGL
  returns ``(N, H, D)``, which concatenated is ours.

Every layer is checked on the whole graph and on a chunk block (destinations = a
contiguous id range, sources = the whole graph: what GNNPipe aggregates) against the
same rows of DGL's whole-graph output; forward values, and gradients of a random linear
functional of the output with respect to the input features and every weight.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

try:
    import dgl
    import dgl.nn.pytorch as dglnn
except Exception as e:  # ImportError, or a load error of DGL's C++ libraries under another torch
    if os.environ.get("GNNPIPE_REQUIRE_DGL"):
        raise
    pytest.skip(f"dgl is not importable here ({type(e).__name__}: {str(e)[:120]}); the parity "
                "tests run in the DGL environment: make test-dgl", allow_module_level=True)

from gnnpipe.models.block import Block
from gnnpipe.models.gat import GATConv
from gnnpipe.models.gcn import GCNConv
from gnnpipe.models.sage import SAGEConv

pytestmark = pytest.mark.dgl

DT = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)
N = 37


def make_edges(kind: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) of a random graph on N nodes; the last two nodes have no in-edges.

    ``symmetric``: every edge both ways, no self loops (the pipeline's default graph; the
    last two nodes are isolated); ``directed``: one-way edges (in- and out-degrees differ,
    the last two nodes only send) plus two self loops that are part of the data (an
    ordinary edge, counted on top of the layer's own self term).
    """
    rng = np.random.default_rng(seed)
    m = N - 2
    if kind == "symmetric":
        src, dst = rng.integers(0, m, 120), rng.integers(0, m, 120)
        src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
    else:
        src, dst = rng.integers(0, N, 160), rng.integers(0, m, 160)
    keep = src != dst
    src, dst = src[keep], dst[keep]
    if kind == "directed":
        src, dst = np.concatenate([src, [3, 5]]), np.concatenate([dst, [3, 5]])
    key = np.unique(dst * N + src)  # merge duplicates, sort by (dst, src)
    return key % N, key // N


def in_csr(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.lexsort((src, dst))
    indptr = np.zeros(N + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=N), out=indptr[1:])
    return indptr, src[order].astype(np.int64)


def our_block(indptr, indices, rows: slice) -> Block:
    """The whole graph (rows = all) or a chunk: dst = ``rows``, src = every node."""
    deg_in = np.diff(indptr)
    deg_out = np.bincount(indices, minlength=N)
    lo, hi = rows.start, rows.stop
    return Block.from_numpy(indptr[lo:hi + 1] - indptr[lo], indices[indptr[lo]:indptr[hi]], N, lo,
                            deg_in[lo:hi], deg_out, dtype=DT)


def copy_(dst: torch.Tensor, src: torch.Tensor) -> None:
    assert dst.shape == src.shape, (dst.shape, src.shape)
    with torch.no_grad():
        dst.copy_(src)


def gcn_pair(d_in, d_out, heads):
    ours = GCNConv(d_in, d_out).to(DT)
    with torch.no_grad():
        ours.bias.normal_()  # zero-initialised: make it count
    ref = dglnn.GraphConv(d_in, d_out, norm="both", weight=True, bias=True).to(DT)
    copy_(ref.weight, ours.weight.t())
    copy_(ref.bias, ours.bias)
    grads = lambda: {"weight": (ours.weight.grad, ref.weight.grad.t()),  # noqa: E731
                     "bias": (ours.bias.grad, ref.bias.grad)}
    return ours, ref, True, lambda out: out, grads


def sage_pair(d_in, d_out, heads):
    ours = SAGEConv(d_in, d_out).to(DT)
    with torch.no_grad():
        ours.bias.normal_()
    ref = dglnn.SAGEConv(d_in, d_out, aggregator_type="mean", bias=True).to(DT)
    copy_(ref.fc_self.weight, ours.weight_self)
    copy_(ref.fc_neigh.weight, ours.weight_neigh)
    copy_(ref.fc_self.bias, ours.bias)
    grads = lambda: {"weight_self": (ours.weight_self.grad, ref.fc_self.weight.grad),  # noqa: E731
                     "weight_neigh": (ours.weight_neigh.grad, ref.fc_neigh.weight.grad),
                     "bias": (ours.bias.grad, ref.fc_self.bias.grad)}
    return ours, ref, False, lambda out: out, grads


def gat_pair(d_in, d_out, heads):
    ours = GATConv(d_in, d_out, heads=heads).to(DT)
    with torch.no_grad():
        ours.bias.normal_()
    ref = dglnn.GATConv(d_in, d_out, num_heads=heads, feat_drop=0.0, attn_drop=0.0,
                        negative_slope=0.2, residual=False, bias=True).to(DT)
    copy_(ref.fc.weight, ours.weight)
    copy_(ref.attn_l, ours.att_src[None])
    copy_(ref.attn_r, ours.att_dst[None])
    copy_(ref.bias, ours.bias)
    grads = lambda: {"weight": (ours.weight.grad, ref.fc.weight.grad),  # noqa: E731
                     "att_src": (ours.att_src.grad, ref.attn_l.grad[0]),
                     "att_dst": (ours.att_dst.grad, ref.attn_r.grad[0]),
                     "bias": (ours.bias.grad, ref.bias.grad)}
    return ours, ref, True, lambda out: out.reshape(out.shape[0], -1), grads


PAIRS = {"gcn": gcn_pair, "sage": sage_pair, "gat": gat_pair}


@pytest.mark.parametrize("rows", [slice(0, N), slice(11, 24)], ids=["whole", "chunk"])
@pytest.mark.parametrize("graph", ["symmetric", "directed"])
@pytest.mark.parametrize("d_in,d_out,heads", [(7, 3, 2), (3, 9, 3)], ids=["narrowing", "widening"])
@pytest.mark.parametrize("layer", list(PAIRS))
def test_layer_matches_dgl(layer, d_in, d_out, heads, graph, rows):
    torch.manual_seed(0)
    src, dst = make_edges(graph)
    ours, ref, self_loops, flatten, grads = PAIRS[layer](d_in, d_out, heads)
    g = dgl.graph((torch.as_tensor(src), torch.as_tensor(dst)), num_nodes=N)
    if self_loops:
        g = dgl.add_self_loop(g)
    block = our_block(*in_csr(src, dst), rows)

    x = torch.randn(N, d_in, dtype=DT)
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = ours(x_ours, block)  # (rows, out)
    expect = flatten(ref(g, x_ref))[rows]  # DGL on the whole graph, the same rows
    assert out.shape == expect.shape
    torch.testing.assert_close(out, expect, **TOL)

    probe = torch.randn_like(out)  # a random linear functional of the output
    (out * probe).sum().backward()
    (expect * probe).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, **TOL)
    for name, (mine, theirs) in grads().items():
        torch.testing.assert_close(mine, theirs, **TOL, msg=lambda m: f"grad of {name}: {m}")


def test_graph_has_what_the_cases_need():
    """The random graphs exercise zero in-degree rows, degree asymmetry and data self loops."""
    for kind in ("symmetric", "directed"):
        src, dst = make_edges(kind)
        indptr, indices = in_csr(src, dst)
        deg_in, deg_out = np.diff(indptr), np.bincount(indices, minlength=N)
        assert np.all(deg_in[-2:] == 0) and np.all(deg_in[:-2] > 0) and len(src) > 100
        pairs = set(zip(src.tolist(), dst.tolist()))
        if kind == "symmetric":
            assert all((d, s) in pairs for s, d in pairs) and not np.any(src == dst)
        else:
            assert np.any(deg_in != deg_out) and {(3, 3), (5, 5)} <= pairs
