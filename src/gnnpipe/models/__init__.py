"""Graph layers on PyTorch sparse kernels and the GNN stack built from them.

Every conv aggregates a bipartite :class:`Block`: ``conv(h_src, block, x0_dst=None)``. Every
kind defines its entry of :data:`gnnpipe.kinds.CONVS` (its stack, its work, its exchange width)
beside its ``forward`` (``KIND``).
"""

from ..kinds import CONVS
from .block import Block
from .gat import GATConv
from .gcn import GCNConv
from .gcnii import GCNIIConv
from .conv_kind import ConvKind
from .layer import GraphLayer
from .model import GNN, KINDS
from .resgcn import ResGCNLayer
from .sage import SAGEConv

__all__ = ["Block", "CONVS", "ConvKind", "GATConv", "GCNConv", "GCNIIConv", "GNN", "GraphLayer", "KINDS",
           "ResGCNLayer", "SAGEConv"]
