"""Layers and aggregation primitives against dense references (float64).

* every custom autograd Function passes ``torch.autograd.gradcheck``;
* every conv matches a dense implementation (dense normalised adjacency etc.),
  forward and gradients w.r.t. inputs and parameters;
* every conv gives the same destination rows and the same (summed) input and weight
  gradients whether the graph is one block, contiguous chunks against the whole graph
  (GNNPipe) or partitions with their halo (graph parallelism): the exactness of every
  parallel mode rests on this.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gnnpipe.models import Block, GATConv, GCNConv, GCNIIConv, ResGCNLayer, SAGEConv
from gnnpipe.models import ops
from helpers import F64, TOL, chunk_splits, partition_splits, random_csr

pytestmark = pytest.mark.usefixtures("one_thread")

# --------------------------------------------------------------------------- graphs and blocks
def dense_adj(indptr, indices, n_src=None) -> torch.Tensor:
    """``A[i, j] = 1`` for every edge ``j -> i`` (in float64)."""
    n = len(indptr) - 1
    a = torch.zeros(n, n_src or n, dtype=F64)
    rows = np.repeat(np.arange(n), np.diff(indptr))
    a[rows, indices] = 1.0
    return a


def all_splits(indptr, indices, seed=0):
    n = len(indptr) - 1
    rng = np.random.default_rng(seed)
    full = Block.full(indptr, indices, F64)
    cuts = np.sort(rng.choice(np.arange(1, n), 3, replace=False))
    return {
        "full": [(full, np.arange(n), np.arange(n))],
        "chunks": chunk_splits(indptr, indices, [0, *cuts, n]),
        "chunks_singletons": chunk_splits(indptr, indices, [0, 1, 2, n - 1, n]),
        "partitions": partition_splits(indptr, indices, rng.integers(0, 3, n)),
        "partition_one_row": partition_splits(indptr, indices, (np.arange(n) != 5).astype(int)),
    }


# --------------------------------------------------------------------------- dense references
def gcn_matrix(a: torch.Tensor, dst_offset: int = 0) -> torch.Tensor:
    """``P~ = (A + I) / sqrt((d_in + 1)(d_out + 1))`` of a square graph."""
    n = a.shape[0]
    d_in, d_out = a.sum(1), a.sum(0)
    return (a + torch.eye(n, dtype=a.dtype)) / torch.sqrt((d_in[:, None] + 1) * (d_out[None, :] + 1))


def gcn_dense(conv: GCNConv, x, a):
    return gcn_matrix(a) @ x @ conv.weight.t() + conv.bias


def sage_dense(conv: SAGEConv, x, a):
    mean = a / a.sum(1, keepdim=True).clamp(min=1)
    return x @ conv.weight_self.t() + mean @ x @ conv.weight_neigh.t() + conv.bias


def gat_dense(conv: GATConv, x, a):
    n, H, D = x.shape[0], conv.heads, conv.out_dim_head
    z = (x @ conv.weight.t()).view(n, H, D)
    el = (z * conv.att_src).sum(-1)  # (n, H) source score
    er = (z * conv.att_dst).sum(-1)  # (n, H) destination score
    e = F.leaky_relu(er[:, None, :] + el[None, :, :], 0.2)  # (i, j, H)
    mask = (a + torch.eye(n, dtype=a.dtype)) > 0
    attn = torch.softmax(e.masked_fill(~mask[..., None], -math.inf), dim=1)
    out = torch.einsum("ijh,jhd->ihd", attn, z)
    out = out.reshape(n, H * D) if conv.concat else out.mean(1)
    return out + conv.bias


def gcnii_dense(conv: GCNIIConv, x, a, x0):
    support = (1 - conv.alpha) * gcn_matrix(a) @ x + conv.alpha * x0
    eye = torch.eye(conv.in_dim, dtype=x.dtype)
    return torch.relu(support @ ((1 - conv.beta) * eye + conv.beta * conv.weight))


def resgcn_dense(layer: ResGCNLayer, x, a):
    z = torch.relu(F.layer_norm(x, (x.shape[1],), layer.norm.weight, layer.norm.bias, layer.norm.eps))
    return x + gcn_dense(layer.conv, z, a)


def make_conv(kind: str, d_in: int, d_out: int) -> torch.nn.Module:
    if kind == "gcn":
        return GCNConv(d_in, d_out)
    if kind == "sage":
        return SAGEConv(d_in, d_out)
    if kind == "gat":
        return GATConv(d_in, d_out, heads=3)
    if kind == "gat_mean":
        return GATConv(d_in, d_out, heads=2, concat=False)
    if kind == "gcnii":
        return GCNIIConv(d_in, layer=3, alpha=0.2, lambda_=0.5)
    if kind == "resgcn":
        return ResGCNLayer(d_in)
    raise ValueError(kind)


DENSE = {"gcn": gcn_dense, "sage": sage_dense, "gat": gat_dense, "gat_mean": gat_dense,
         "resgcn": resgcn_dense}
KINDS = ["gcn", "sage", "gat", "gat_mean", "gcnii", "resgcn"]


def perturb(module: torch.nn.Module, seed: int = 0) -> None:
    """Non-trivial values everywhere (biases and LayerNorm affine are 0/1 after init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def setup(kind, d_in=5, d_out=4, seed=0):
    torch.manual_seed(seed)
    if kind in ("gcnii", "resgcn"):
        d_out = d_in
    conv = make_conv(kind, d_in, d_out).double()
    perturb(conv, seed)
    return conv


def run(conv, kind, x, block, x0=None):
    return conv(x, block, x0) if kind == "gcnii" else conv(x, block)


# --------------------------------------------------------------------------- primitives
@pytest.fixture(params=["embedding_bag", "sparse", "gather"])
def kernel(request, monkeypatch):
    """Run a test through each CPU kernel of ``CSR.mm``: embedding_bag (the default for
    large products), the sparse CSR tensor product (what CUDA runs) and the
    small-product gather + index_add_ path."""
    monkeypatch.setattr(ops, "_SMALL", 1 << 40 if request.param == "gather" else 0)
    if request.param != "gather":
        monkeypatch.setattr(ops, "CPU_KERNEL", request.param)
    return request.param


def tiny_csr(seed=0, n_rows=4, n_cols=6, p=0.5):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n_rows, n_cols, generator=g) < p
    mask[1] = False  # an empty row
    indptr = torch.zeros(n_rows + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(mask.sum(1), 0)
    return ops.make_csr(indptr, torch.nonzero(mask)[:, 1], n_cols), mask


def test_make_csr_transpose_matches_dense(kernel):
    csr, mask = tiny_csr()
    vals = torch.arange(1, csr.nnz + 1, dtype=F64)
    dense = torch.zeros(mask.shape, dtype=F64)
    dense[mask] = vals
    assert torch.equal(csr.matrix(vals).to_dense(), dense)
    assert torch.equal(csr.matrix_t(vals).to_dense(), dense.t())
    assert csr.indices.dtype == torch.int32  # MKL's native width when it fits


def test_self_loop_csr_matches_dense(kernel):
    indptr, indices = random_csr(9, 0.3, 1, isolated=2)
    (blk, dst, _), *_ = chunk_splits(indptr, indices, [3, 8])
    csr = ops.self_loop_csr(blk)
    dense = csr.matrix(torch.ones(csr.nnz, dtype=F64)).to_dense()
    expect = dense_adj(indptr, indices)[3:8]
    expect[torch.arange(5), torch.arange(3, 8)] += 1
    assert torch.equal(dense, expect)
    assert csr is ops.self_loop_csr(blk)  # cached on the block


def test_compact_block_reads_only_used_rows():
    indptr, indices = random_csr(12, 0.15, 2, isolated=3)
    (blk, dst, _), _ = chunk_splits(indptr, indices, [4, 7, 12])
    sub, used = ops.compact(blk)
    expect = np.union1d(indices[indptr[4]:indptr[7]], dst)
    assert used.tolist() == expect.tolist()
    assert sub.n_src == len(expect) and sub.n_dst == 3
    assert used[sub.dst_offset:sub.dst_offset + 3].tolist() == dst.tolist()
    assert torch.equal(used[sub.indices], blk.indices)
    assert torch.equal(sub.deg_src, blk.deg_src[used])
    full = Block.full(indptr, indices, F64)
    assert ops.compact(full) == (full, None)


def test_spmm_gradcheck(kernel):
    csr, _ = tiny_csr()
    vals = torch.rand(csr.nnz, dtype=F64)
    x = torch.randn(csr.n_cols, 3, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: ops.spmm(t, csr, vals), (x,))
    x1 = torch.randn(csr.n_cols, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: ops.spmm(t, csr, vals), (x1,))


def test_spmm_rejects_mixed_dtypes():
    csr, _ = tiny_csr()
    with pytest.raises(TypeError, match="float32"):
        ops.spmm(torch.randn(csr.n_cols, 2, dtype=F64), csr, torch.rand(csr.nnz))


def test_edge_softmax_gradcheck_and_normalised(kernel):
    csr, mask = tiny_csr(seed=2)
    scores = torch.randn(csr.nnz, 2, dtype=F64, requires_grad=True)
    alpha = ops.edge_softmax(scores, csr)
    sums = ops.segment_sum(alpha, csr)
    nonempty = mask.any(1)
    torch.testing.assert_close(sums[nonempty], torch.ones(int(nonempty.sum()), 2, dtype=F64))
    assert torch.all(sums[~nonempty] == 0)
    assert torch.autograd.gradcheck(lambda s: ops.edge_softmax(s, csr), (scores,))


@pytest.mark.parametrize("shared", [False, True])
def test_edge_spmm_gradcheck_and_dense(shared, kernel):
    csr, mask = tiny_csr(seed=3)
    heads = 3
    alpha = torch.rand(csr.nnz, heads, dtype=F64, requires_grad=True)
    x = torch.randn(csr.n_cols, 1 if shared else heads, 2, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, t: ops.edge_spmm(a, t, csr), (alpha, x))
    out = ops.edge_spmm(alpha, x, csr)
    for h in range(heads):
        dense = torch.zeros(mask.shape, dtype=F64)
        dense[mask] = alpha[:, h].detach()
        torch.testing.assert_close(out[:, h].detach(), dense @ x[:, 0 if shared else h].detach())


def test_spmm_empty_block(kernel):
    blk = Block.from_numpy(np.zeros(4, np.int64), np.zeros(0, np.int64), 6, 1,
                           np.zeros(3), np.zeros(6), F64)
    x = torch.randn(6, 2, dtype=F64, requires_grad=True)
    out = ops.mean_aggregate(x, blk)
    assert torch.equal(out, torch.zeros(3, 2, dtype=F64))
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros(6, 2, dtype=F64))


# --------------------------------------------------------------------------- convs vs dense
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(5, 4), (4, 9)])  # both orders of transform / aggregate
def test_conv_matches_dense(kind, shape, kernel):
    indptr, indices = random_csr(12, 0.25, seed=4, isolated=2)  # directed, with zero in-degree
    a = dense_adj(indptr, indices)
    block = Block.full(indptr, indices, F64)
    conv = setup(kind, *shape)
    x = torch.randn(12, conv.in_dim, dtype=F64, requires_grad=True)
    x0 = torch.randn(12, conv.in_dim, dtype=F64, requires_grad=True)
    out = run(conv, kind, x, block, x0)
    ref = gcnii_dense(conv, x, a, x0) if kind == "gcnii" else DENSE[kind](conv, x, a)
    assert out.shape == (12, conv.out_dim)
    torch.testing.assert_close(out, ref, **TOL)
    g = torch.randn_like(out)
    inputs = [x, x0] if kind == "gcnii" else [x]
    params = list(conv.parameters())
    ours = torch.autograd.grad(out, inputs + params, g)
    theirs = torch.autograd.grad(ref, inputs + params, g)
    for o, t in zip(ours, theirs):
        torch.testing.assert_close(o, t, **TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_conv_gradcheck(kind):
    indptr, indices = random_csr(6, 0.4, seed=5, isolated=1)
    block = Block.full(indptr, indices, F64)
    conv = setup(kind, 3, 2)
    x = torch.randn(6, conv.in_dim, dtype=F64, requires_grad=True)
    x0 = torch.randn(6, conv.in_dim, dtype=F64)
    assert torch.autograd.gradcheck(lambda t: run(conv, kind, t, block, x0), (x,))


@pytest.mark.parametrize("shape", [(5, 4), (4, 9)])  # project first (one product for both maps), aggregate first
def test_sage_without_bias_matches_dense(shape):
    indptr, indices = random_csr(12, 0.25, seed=4, isolated=2)
    a = dense_adj(indptr, indices)
    torch.manual_seed(0)
    conv = SAGEConv(*shape, bias=False).double()
    x = torch.randn(12, shape[0], dtype=F64, requires_grad=True)
    out = conv(x, Block.full(indptr, indices, F64))
    mean = a / a.sum(1, keepdim=True).clamp(min=1)
    ref = x @ conv.weight_self.t() + mean @ x @ conv.weight_neigh.t()
    torch.testing.assert_close(out, ref, **TOL)
    g = torch.randn_like(out)
    params = [x, conv.weight_self, conv.weight_neigh]
    for o, t in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g)):
        torch.testing.assert_close(o, t, **TOL)


def test_zero_in_degree_rows():
    indptr, indices = random_csr(8, 0.5, seed=6, isolated=3)
    block = Block.full(indptr, indices, F64)
    deg_out = torch.as_tensor(np.bincount(indices, minlength=8), dtype=F64)
    x = torch.randn(8, 4, dtype=F64)
    iso = slice(5, 8)
    sage = setup("sage", 4, 3)
    torch.testing.assert_close(sage(x, block)[iso], x[iso] @ sage.weight_self.t() + sage.bias, **TOL)
    gcn = setup("gcn", 4, 3)  # only the self term: x_i / sqrt(1 * (d_out_i + 1))
    ref = (x[iso] / torch.sqrt(deg_out[iso] + 1)[:, None]) @ gcn.weight.t() + gcn.bias
    torch.testing.assert_close(gcn(x, block)[iso], ref, **TOL)
    gat = setup("gat", 4, 2)  # attends to itself only
    z = x[iso] @ gat.weight.t()
    torch.testing.assert_close(gat(x, block)[iso], z + gat.bias, **TOL)


# --------------------------------------------------------------------------- invariance to the cut
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("symmetric", [True, False])
def test_conv_same_on_every_split(kind, symmetric, kernel):
    """Whole graph vs chunks vs partitions+halo: same rows, same summed gradients."""
    n = 23
    indptr, indices = random_csr(n, 0.2, seed=7, symmetric=symmetric, isolated=2)
    conv = setup(kind, 6, 4)
    h = torch.randn(n, conv.in_dim, dtype=F64, requires_grad=True)
    x0 = torch.randn(n, conv.in_dim, dtype=F64, requires_grad=True)
    g = torch.randn(n, conv.out_dim, dtype=F64)
    wrt = [h, x0, *conv.parameters()] if kind == "gcnii" else [h, *conv.parameters()]
    ref_out = ref_grads = None
    for name, blocks in all_splits(indptr, indices).items():
        out = torch.empty(n, conv.out_dim, dtype=F64)
        loss = 0.0
        for blk, dst, src in blocks:
            o = run(conv, kind, h[src], blk, x0[dst])
            out[dst] = o.detach()
            loss = loss + (o * g[dst]).sum()
        grads = torch.autograd.grad(loss, wrt, allow_unused=kind != "gcnii")
        if ref_out is None:
            ref_out, ref_grads = out, grads
            continue
        torch.testing.assert_close(out, ref_out, **TOL, msg=lambda m: f"{name}: {m}")
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{name} grad: {m}")


# --------------------------------------------------------------------------- API details
@pytest.mark.parametrize("kind", KINDS)
def test_reset_parameters_reinitialises(kind):
    torch.manual_seed(11)
    fresh = make_conv(kind, 5, 5)
    torch.manual_seed(11)
    conv = make_conv(kind, 5, 5)
    perturb(conv)
    assert any(not torch.equal(p, q) for p, q in zip(conv.parameters(), fresh.parameters()))
    torch.manual_seed(11)
    conv.reset_parameters()
    for p, q in zip(conv.parameters(), fresh.parameters()):
        assert torch.equal(p, q)


def test_reprs():
    assert repr(GCNConv(8, 32)) == "GCNConv(8, 32)"
    assert repr(SAGEConv(8, 32)) == "SAGEConv(8, 32, aggr=mean)"
    assert repr(GATConv(8, 4, heads=4)) == "GATConv(8, 4, heads=4)"
    assert repr(GATConv(8, 3, heads=2, concat=False)) == "GATConv(8, 3, heads=2, concat=False)"
    assert repr(GCNIIConv(16, layer=1, lambda_=0.5)).startswith("GCNIIConv(16, layer=1, alpha=0.1")


def test_gcnii_needs_x0_and_beta():
    conv = GCNIIConv(4, layer=2, lambda_=0.5)
    assert conv.beta == pytest.approx(math.log(0.5 / 2 + 1))
    indptr, indices = random_csr(5, 0.5, 0)
    with pytest.raises(ValueError, match="x0_dst"):
        conv(torch.randn(5, 4), Block.full(indptr, indices))


@pytest.mark.parametrize("kind", KINDS)
def test_float32_matches_float64(kind):
    indptr, indices = random_csr(30, 0.15, seed=8)
    conv64 = setup(kind, 6, 5)
    conv32 = make_conv(kind, 6, conv64.out_dim if kind != "gat" else 5)
    conv32.load_state_dict({k: v.float() for k, v in conv64.state_dict().items()})
    x = torch.randn(30, conv64.in_dim, dtype=F64)
    x0 = torch.randn(30, conv64.in_dim, dtype=F64)
    out64 = run(conv64, kind, x, Block.full(indptr, indices, F64), x0)
    out32 = run(conv32, kind, x.float(), Block.full(indptr, indices, torch.float32), x0.float())
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), out64, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_matches_cpu(kind):
    indptr, indices = random_csr(40, 0.15, seed=9)
    conv = setup(kind, 6, 4)
    x = torch.randn(40, conv.in_dim, dtype=F64, requires_grad=True)
    x0 = torch.randn(40, conv.in_dim, dtype=F64)
    block = Block.full(indptr, indices, F64)
    out = run(conv, kind, x, block, x0)
    (gx,) = torch.autograd.grad(out.sum(), x)
    conv_c = conv.to("cuda")
    xc = x.detach().cuda().requires_grad_()
    out_c = run(conv_c, kind, xc, block.to("cuda"), x0.cuda())
    (gxc,) = torch.autograd.grad(out_c.sum(), xc)
    torch.testing.assert_close(out_c.cpu(), out.detach(), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(gxc.cpu(), gx, atol=1e-10, rtol=1e-10)


def test_gat_attention_dropout_only_in_training():
    indptr, indices = random_csr(15, 0.3, seed=10)
    block = Block.full(indptr, indices, F64)
    torch.manual_seed(0)
    plain = GATConv(4, 3, heads=2).double()
    dropped = GATConv(4, 3, heads=2, attn_dropout=0.5).double()
    dropped.load_state_dict(plain.state_dict())
    x = torch.randn(15, 4, dtype=F64)
    torch.testing.assert_close(dropped.eval()(x, block), plain(x, block), **TOL)
    torch.manual_seed(1)
    assert not torch.allclose(dropped.train()(x, block), plain(x, block))


# --------------------------------------------------------------------------- the dense map
needs_onednn = pytest.mark.skipif(not ops.ONEDNN, reason="this torch build has no oneDNN matmul")


@needs_onednn
@pytest.mark.parametrize("n,d_in,d_out,bias", [(1000, 128, 32, True), (777, 32, 128, False), (5, 7, 3, True)])
def test_linear_on_onednn_is_f_linear_forward_and_backward(n, d_in, d_out, bias):
    """float32 CPU ``ops.linear`` runs on oneDNN (its own autograd Function) and equals
    ``F.linear``: output, input, weight and bias gradients (float32 rounding)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, d_in, generator=g, requires_grad=True)
    w = torch.randn(d_out, d_in, generator=g, requires_grad=True)
    b = torch.randn(d_out, generator=g, requires_grad=True) if bias else None
    leaves = [x, w] + ([b] if bias else [])
    y, ref = ops.linear(x, w, b), F.linear(x, w, b)
    assert "OneDNNLinear" in type(y.grad_fn).__name__
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    gy = torch.randn(n, d_out, generator=g)
    for got, want in zip(torch.autograd.grad(y, leaves, gy), torch.autograd.grad(ref, leaves, gy)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)


def test_linear_takes_f_linear_off_float32_cpu_and_skips_unwanted_gradients():
    x, w = torch.randn(6, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert "OneDNN" not in type(ops.linear(x, w).grad_fn).__name__  # float64: F.linear
    x32, w32 = x.float(), w.detach().float().requires_grad_()
    (gw,) = torch.autograd.grad(ops.linear(x32, w32).sum(), [w32])  # x needs no gradient: none is made
    torch.testing.assert_close(gw, x32.sum(0).expand(3, 4))


@needs_onednn
@pytest.mark.parametrize("kind", ["sage", "gcn", "gat"])
def test_models_on_onednn_equal_the_aten_products(kind, monkeypatch):
    """A whole float32 model (first layer memoised, a hidden layer, the narrow last one), forward
    and every parameter gradient, with oneDNN's products and with torch's own: equal to float32
    rounding (the layers' in-place updates of a oneDNN output are safe for autograd)."""
    from gnnpipe.config import ModelConfig
    from gnnpipe.models.model import GNN

    indptr, indices = random_csr(400, 0.03, seed=1, symmetric=True)
    block = Block.full(indptr, indices)
    x = torch.randn(400, 24, generator=torch.Generator().manual_seed(0))
    grads = {}
    for onednn in (True, False):
        monkeypatch.setattr(ops, "ONEDNN", onednn)
        torch.manual_seed(0)
        model = GNN(ModelConfig(kind=kind, layers=3, hidden=32, dropout=0.0, heads=2), 24, 5)
        for _ in range(2):  # the second pass reads the memoised first-layer aggregation
            out = model(x, block)
        out.square().sum().backward()
        grads[onednn] = (out.detach(), {k: p.grad for k, p in model.named_parameters()})
    torch.testing.assert_close(grads[True][0], grads[False][0], rtol=1e-5, atol=1e-5)
    for k, g in grads[False][1].items():
        torch.testing.assert_close(grads[True][1][k], g, rtol=1e-4, atol=1e-4)
