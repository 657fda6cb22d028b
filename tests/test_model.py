"""The GNN stack: shapes, the engine-facing interface, layer-by-layer exactness, deep training."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gnnpipe.config import ModelConfig
from gnnpipe.models import GNN, Block, GraphLayer
from gnnpipe.models.model import KINDS
from helpers import F64, TOL, chunk_splits, partition_splits, random_csr

pytestmark = pytest.mark.usefixtures("one_thread")

GRAPH_KINDS = [k for k in KINDS if k != "mlp"]


def model(kind, layers=3, hidden=12, F_=7, C=4, dropout=0.0, norm="none", seed=0, **kw):
    torch.manual_seed(seed)
    cfg = ModelConfig(kind=kind, layers=layers, hidden=hidden, dropout=dropout, norm=norm, heads=3, **kw)
    return GNN(cfg, F_, C)


def perturbed(kind, **kw):
    """A float64 model whose biases and norm affines are not at their 0/1 initial values."""
    m = model(kind, **kw).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m


@pytest.mark.parametrize("kind,dims,outs", [
    ("gcn", [7, 12, 12], [12, 12, 4]),
    ("sage", [7, 12, 12], [12, 12, 4]),
    ("gat", [7, 12, 12], [12, 12, 4]),
    ("gcnii", [12, 12, 12], [12, 12, 12]),
    ("resgcn", [12, 12, 12], [12, 12, 12]),
    ("mlp", [], []),
])
def test_exchange_dims_and_structure(kind, dims, outs):
    m = model(kind)
    assert m.exchange_dims() == dims
    assert m.conv_out_dims() == outs
    assert len(m.convs) == (0 if kind == "mlp" else 3)
    assert (m.encoder is None) == (kind in ("gcn", "sage", "gat"))
    assert (m.decoder is None) == (kind in ("gcn", "sage", "gat", "mlp"))
    assert m.needs_x0 == (kind == "gcnii")
    assert m.encode(torch.zeros(5, 7)).shape == (5, (dims or [4])[0])
    assert len(m.layer_costs(100, 1000)) == len(dims)


def test_single_layer_and_mlp_shapes():
    assert model("gcn", layers=1).exchange_dims() == [7]
    assert model("gcn", layers=1).conv_out_dims() == [4]
    mlp = model("mlp", layers=3)
    assert sum(isinstance(m, torch.nn.Linear) for m in mlp.encoder) == 3
    assert mlp(torch.randn(5, 7)).shape == (5, 4)  # no block needed


def test_plain_stack_post_processing():
    m = model("gcn", layers=3, dropout=0.5, norm="layer")
    assert all(isinstance(c, GraphLayer) for c in m.convs)
    assert [c.act for c in m.convs] == [True, True, False]
    assert [c.norm is not None for c in m.convs] == [True, True, False]
    assert [c.dropout for c in m.convs] == [0.5, 0.5, 0.0]
    assert "GCNConv(7, 12)" in repr(m) and "GCNConv(12, 4)" in repr(m)


def test_gat_heads_must_divide_hidden():
    with pytest.raises(ValueError, match="multiple of heads"):
        model("gat", hidden=10)


def test_forward_refuses_non_square_block_for_stacks():
    indptr, indices = random_csr(10, 0.3, 0)
    (blk, _, _), _ = chunk_splits(indptr, indices, [0, 4, 10])
    with pytest.raises(ValueError, match="square"):
        model("gcn").double()(torch.randn(10, 7, dtype=F64), blk)


@pytest.mark.parametrize("kind", KINDS)
def test_forward_is_encode_convs_decode(kind):
    indptr, indices = random_csr(15, 0.2, 1)
    block = Block.full(indptr, indices, F64)
    m = perturbed(kind).eval()
    x = torch.randn(15, 7, dtype=F64)
    h = m.encode(x)
    x0 = h if m.needs_x0 else None
    for conv in m.convs:
        h = conv(h, block, x0)
    torch.testing.assert_close(m(x, block), m.decode(h), **TOL)


@pytest.mark.parametrize("kind", GRAPH_KINDS)
@pytest.mark.parametrize("split", ["chunks", "partitions"])
def test_layerwise_blocks_match_whole_graph(kind, split):
    """Every layer computed block by block (fresh inputs): same logits, same weight grads.

    This is GNNPipe with one chunk per block and no staleness, and graph parallelism
    with a halo exchange before every layer, done by hand in one process.
    """
    n = 21
    indptr, indices = random_csr(n, 0.2, seed=2, symmetric=True, isolated=1)
    labels = torch.randint(0, 4, (n,))
    x = torch.randn(n, 7, dtype=F64)
    full_model = perturbed(kind)
    split_model = perturbed(kind)
    logits = full_model(x, Block.full(indptr, indices, F64))
    F.cross_entropy(logits, labels, reduction="sum").backward()

    blocks = (chunk_splits(indptr, indices, [0, 5, 6, 14, n]) if split == "chunks"
              else partition_splits(indptr, indices, np.arange(n) % 3))
    h = split_model.encode(x)  # each worker encodes its rows; rows are assembled per layer
    x0 = h if split_model.needs_x0 else None
    for conv in split_model.convs:
        out = [None] * len(blocks)
        for b, (blk, dst, src) in enumerate(blocks):
            out[b] = conv(h[src], blk, x0[dst] if x0 is not None else None)
        rows = torch.cat([torch.as_tensor(dst) for _, dst, _ in blocks])
        h = torch.cat(out)[torch.argsort(rows)]  # autograd carries gradients back through blocks
    split_logits = split_model.decode(h)
    F.cross_entropy(split_logits, labels, reduction="sum").backward()
    torch.testing.assert_close(split_logits, logits, **TOL)
    for (name, p), q in zip(full_model.named_parameters(), split_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", KINDS)
def test_reset_parameters_equals_fresh_init(kind):
    fresh = model(kind, norm="layer", seed=3)
    m = perturbed(kind, norm="layer", seed=3).float()
    torch.manual_seed(3)
    m.reset_parameters()
    for (name, p), q in zip(fresh.named_parameters(), m.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_runs_in_dtype(kind, dtype):
    indptr, indices = random_csr(20, 0.2, 4)
    m = model(kind, dropout=0.3).to(dtype).train()
    out = m(torch.randn(20, 7, dtype=dtype), Block.full(indptr, indices, dtype))
    assert out.dtype == dtype and out.shape == (20, 4)
    out.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_layer_costs_follow_the_graph():
    m = model("gcn", layers=4, hidden=16, F_=100)
    small, large = m.layer_costs(1000, 10_000), m.layer_costs(1000, 100_000)
    assert all(s > 0 for s in small) and all(b > s for s, b in zip(small[1:], large[1:]))
    assert small[0] == large[0]  # conv 1 aggregates the static features once, not per epoch
    assert small[0] > small[1] > small[-1]  # F=100 in, H=16 hidden, C=4 out
    assert m.encoder_cost(1000) == 0.0 and m.decoder_cost(1000) == 0.0
    deep = model("gcnii", layers=4, hidden=16, F_=100)
    assert len(set(deep.layer_costs(1000, 10_000))) == 1  # identical layers
    assert deep.encoder_cost(1000) == 3 * 2 * 1000 * 100 * 16


@pytest.mark.parametrize("kind", ["gcn", "sage"])
def test_first_layer_aggregates_static_features_once(kind, monkeypatch):
    """Raw features (no gradient, same tensor) are aggregated once and reused; the result
    is exact, and a new or modified feature tensor is never served the memo."""
    from gnnpipe.models import ops
    indptr, indices = random_csr(20, 0.2, 5)
    block = Block.full(indptr, indices, F64)
    m = perturbed(kind, layers=2)
    fresh = perturbed(kind, layers=2)
    fresh.convs[0].conv.static_input = False
    x, x2 = torch.randn(20, 7, dtype=F64), torch.randn(20, 7, dtype=F64)
    expect = [fresh(t, block) for t in (x, 2.0 * x, x2)]
    calls = []
    real = ops.apply_op
    monkeypatch.setattr(ops, "apply_op", lambda t, op: calls.append(t.shape[1]) or real(t, op))
    for _ in range(4):
        torch.testing.assert_close(m(x, block), expect[0], **TOL)
    # first sight: the usual path (F=7 < H: aggregate first); second: aggregated and kept
    assert calls.count(7) == 2
    with torch.no_grad():
        x.mul_(2.0)  # in place: the version counter changes
    torch.testing.assert_close(m(x, block), expect[1], **TOL)
    torch.testing.assert_close(m(x2, block), expect[2], **TOL)
    assert calls.count(7) == 4


@pytest.mark.parametrize("bias", [True, False])
def test_sage_memoised_first_layer_gradients(bias):
    """SAGE's first conv on raw features runs one product over the memoised ``[x | A x]``: its
    weight and bias gradients equal the unmemoised conv's (float64), on a partition block too
    (destination rows at an offset, a halo)."""
    from gnnpipe.models.sage import SAGEConv
    indptr, indices = random_csr(20, 0.2, 5)
    full = Block.full(indptr, indices, F64)
    lo, hi = 5, 13  # destinations 5..12 of 20 sources
    part = Block(torch.as_tensor(indptr[lo:hi + 1] - indptr[lo]), torch.as_tensor(indices[indptr[lo]:indptr[hi]]),
                 20, lo, full.deg_dst[lo:hi], full.deg_src)
    for block in (full, part):
        x = torch.randn(20, 7, dtype=F64)
        g = torch.randn(block.n_dst, 5, dtype=F64)
        grads = []
        for static in (False, True):
            torch.manual_seed(0)
            conv = SAGEConv(7, 5, bias=bias, static_input=static).double()
            with torch.no_grad():
                for p in conv.parameters():
                    p.add_(0.1)
            for _ in range(3):  # the memo is used from the second call on
                conv.zero_grad(set_to_none=True)
                out = conv(x, block)
                out.backward(g)
            grads.append((out.detach(), [p.grad for p in conv.parameters()]))
        torch.testing.assert_close(grads[1][0], grads[0][0], **TOL)
        for got, want in zip(grads[1][1], grads[0][1]):
            torch.testing.assert_close(got, want, **TOL)


def _planted_graph(n=160, classes=4, seed=0):
    """Communities with dense intra edges and features carrying a weak label signal."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    p = np.where(y[:, None] == y[None, :], 0.08, 0.005)
    adj = rng.random((n, n)) < p
    adj = adj | adj.T
    np.fill_diagonal(adj, False)
    indptr = np.concatenate([[0], np.cumsum(adj.sum(1))])
    x = rng.normal(size=(n, 8)) + 1.5 * np.eye(classes, 8)[y]
    return indptr, np.nonzero(adj)[1], torch.tensor(x, dtype=torch.float32), torch.tensor(y)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gcnii", "resgcn"])
def test_deep_models_train(kind):
    """32 layers train: a few Adam steps reduce the loss; every gradient is finite and non-zero."""
    indptr, indices, x, y = _planted_graph()
    block = Block.full(indptr, indices)
    m = model(kind, layers=32, hidden=16, F_=8, C=4, dropout=0.1)
    opt = torch.optim.Adam(m.parameters(), lr=0.03)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = F.cross_entropy(m(x, block), y)
        loss.backward()
        for name, p in m.named_parameters():
            assert torch.isfinite(p.grad).all(), name
        losses.append(loss.item())
        opt.step()
    first_conv = next(m.convs[0].parameters())
    assert first_conv.grad.abs().sum() > 0  # gradient reaches the bottom of the stack
    assert losses[-1] < 0.5 * losses[0], losses
