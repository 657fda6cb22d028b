"""The bipartite block: the one aggregation every layer and every parallel mode uses.

A block has ``n_dst`` destination rows and ``n_src`` source rows. Destination row ``i``
*is* source row ``dst_offset + i``, so a layer finds its destination inputs as
``x_src[dst_offset : dst_offset + n_dst]`` (self terms, residuals). The edges are an
in-edge CSR: the sources of destination ``i`` are ``indices[indptr[i]:indptr[i+1]]``,
positions into the source rows.

* single process: dst = all N nodes, src = all N nodes, ``dst_offset = 0``;
* graph parallelism: dst = a partition's own rows, src = own rows then halo rows;
* GNNPipe: dst = one chunk (a contiguous id range), src = the whole graph's buffer.

Degrees are those of the *whole* graph (not of the block), so that normalisation is
the same whichever way the graph is cut: this is what makes every mode exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor


@dataclass(eq=False)
class Block:
    indptr: Tensor  # int64 (n_dst + 1,)
    indices: Tensor  # int64 (nnz,) positions in [0, n_src)
    n_src: int
    dst_offset: int  # destination row i is source row dst_offset + i
    deg_dst: Tensor  # float (n_dst,) whole-graph in-degree of each destination (no self loop)
    deg_src: Tensor  # float (n_src,) whole-graph out-degree of each source (no self loop)
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def n_dst(self) -> int:
        return int(self.indptr.shape[0] - 1)

    @property
    def nnz(self) -> int:
        return int(self.indices.shape[0])

    def dst_rows(self, x_src: Tensor) -> Tensor:
        """The destination rows of a source-row tensor: ``(n_dst, ...)``; ``x_src`` itself when
        they are all of its rows (a whole-graph block: no slice, whose backward would allocate
        and zero-fill a gradient the size of ``x_src`` to copy into)."""
        if self.dst_offset == 0 and self.n_dst == x_src.shape[0]:
            return x_src
        return x_src[self.dst_offset:self.dst_offset + self.n_dst]

    def dst_of_edge(self) -> Tensor:
        """Destination position of every edge ``(nnz,)`` (cached)."""
        if "row" not in self._cache:
            counts = self.indptr[1:] - self.indptr[:-1]
            self._cache["row"] = torch.repeat_interleave(
                torch.arange(self.n_dst, device=self.indptr.device), counts)
        return self._cache["row"]

    def cached(self, key, make):
        """Memoise a derived structure (normalised weights, transposed CSR) on the block."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def to(self, device=None, dtype=None) -> "Block":
        """A copy on ``device`` with float fields in ``dtype`` (caches dropped)."""
        return Block(self.indptr.to(device), self.indices.to(device), self.n_src, self.dst_offset,
                     self.deg_dst.to(device, dtype), self.deg_src.to(device, dtype))

    @classmethod
    def from_numpy(cls, indptr: np.ndarray, indices: np.ndarray, n_src: int, dst_offset: int,
                   deg_dst: np.ndarray, deg_src: np.ndarray, dtype=torch.float32) -> "Block":
        return cls(torch.as_tensor(np.asarray(indptr, dtype=np.int64)),
                   torch.as_tensor(np.asarray(indices, dtype=np.int64)), int(n_src), int(dst_offset),
                   torch.as_tensor(np.asarray(deg_dst)).to(dtype),
                   torch.as_tensor(np.asarray(deg_src)).to(dtype))

    @classmethod
    def full(cls, indptr: np.ndarray, indices: np.ndarray, dtype=torch.float32) -> "Block":
        """The whole graph as one block (single-process training and exact inference)."""
        n = len(indptr) - 1
        deg_in = np.diff(indptr)
        deg_out = np.bincount(indices, minlength=n)
        return cls.from_numpy(indptr, indices, n, 0, deg_in, deg_out, dtype)

    def __repr__(self) -> str:
        return f"Block(n_dst={self.n_dst}, n_src={self.n_src}, nnz={self.nnz}, dst_offset={self.dst_offset})"
