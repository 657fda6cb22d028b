"""Graph layers on PyTorch sparse kernels and the GNN stack built from them.

Every conv aggregates a bipartite :class:`Block`: ``conv(h_src, block, x0_dst=None)``.
"""

from .block import Block
from .gat import GATConv
from .gcn import GCNConv
from .gcnii import GCNIIConv
from .model import GNN, KINDS, GraphLayer
from .resgcn import ResGCNLayer
from .sage import SAGEConv

__all__ = ["Block", "GATConv", "GCNConv", "GCNIIConv", "GNN", "GraphLayer", "KINDS",
           "ResGCNLayer", "SAGEConv"]
