"""GNNPipe: full-graph GNN training across many workers, and a fair way to compare how."""

__version__ = "0.1.0"
