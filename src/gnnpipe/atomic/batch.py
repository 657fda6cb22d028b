"""``AtomGraph``: what an atomistic model computes on, in one process or as one rank's shard.

A batch of B systems is one graph of N atoms and E directed edges ``j -> i`` (``src`` j,
``dst`` i) inside the cutoff, periodic images included: the neighbour's image sits at
``pos[j] + shift``, so the edge vector (from neighbour to target, PyG's ``pos[i] - pos[j]``)
is ``v = pos[i] - pos[j] - shift``. A triplet ``k -> j -> i`` pairs an input edge
``kj`` (``k -> j``) with an output edge ``ji`` (``j -> i``), excluding ``k == i`` on the
same image (``shift_kj + shift_ji != 0`` keeps a periodic ``k == i``).

The model never sees a process group. It computes on the edges and triplets this view
holds and calls reductions whose meaning is the same in one process and sharded:

============================  =========================  ===================================
call                          one process (this class)   a rank of a P-way group (parallel)
============================  =========================  ===================================
``gather_edges(x)``           identity                   all-gather of the E_loc edge rows
  (E_loc, w) -> (E, w)                                   (gradient: sum-reduce-scatter)
``sum_atoms(partial)``        identity                   reduce-scatter to the own atom
  (N, w) -> (N_own, w)                                   block (gradient: all-gather)
``sum_systems(x_own)``        scatter-add over systems   local scatter-add + all-reduce
  (N_own, w) -> (B, w)                                   (gradient: identity, see parallel)
``gather_atoms(x_own)``       identity                   all-gather of the atom blocks
  (N_own, w) -> (N, w)                                   (gradient: sum-reduce-scatter)
============================  =========================  ===================================

``edges_to_atoms(msg)`` = ``sum_atoms(scatter_add(msg over dst))``: the sum of every edge
message of the batch into the rank's own atoms. Everything with parameters runs on local
edges, local triplets or own atoms, never replicated, so parameter gradients of the ranks
*sum* to the single-process gradient.

Index conventions (all int64):

* ``idx_kj`` (T_loc,): the triplet's input edge, an index into the **gathered** edge rows
  ``[0, E)``;
* ``idx_ji`` (T_loc,): the triplet's output edge, an index into the **local** edges
  ``[0, E_loc)``;
* ``kj_src, kj_dst, kj_shift``: the geometry of each triplet's input edge (it may be
  another rank's), so that angles and the spherical basis are computed locally.

Index sets only some models declare (``None`` where the batch was built without them):

* ``id_swap`` (E_loc,): the reverse edge ``i -> j`` (image ``-shift``) of each local edge
  ``j -> i``, an index into the **gathered** edge rows ``[0, E)``; needs a symmetric edge
  set (``gnnpipe.atomic.neighbors``). GemNet's message of the reverse direction.
* ``triplet_rank`` (T_loc,): the triplet's rank among the triplets of its output edge
  (``0 .. count-1`` in triplet order): its column in the padded (E_loc, K_max) layout of
  GemNet's efficient bilinear layer. A triplet lives on the rank of its output edge, so all
  of an edge's triplets are on one rank and the ranks are the unsharded ones.

**Strain** (stress): ``strain`` (3, 3), ``None`` unless set, deforms the geometry the model reads
homogeneously, every edge vector ``v -> v (I + ε)`` (row vectors, ASE's convention). That is the
deformation of positions *and* cell together: ``pos_i - pos_j - n·cell`` becomes
``pos_i (I+ε) - pos_j (I+ε) - n·cell (I+ε)``, so integer image offsets need not be carried. At
``ε = 0`` the vectors are bitwise the undeformed ones, and ``dE/dε`` is the virial whose
symmetric part over the volume is the stress. ``gradient_forces`` differentiates it alongside
``pos`` when it requires grad (one backward pass).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor


class _SumRows(torch.autograd.Function):
    """``index_add`` forward, ``index_select`` backward, keeping the index alone for backward (autograd's
    ``index_add`` keeps ``msg`` too; an accumulating ``index_put`` keeps the index alone but sorts it, in
    its forward and in its gradient's: 3x slower forward + backward for (E, 128) -> (N, 128) here). Its
    backward is differentiable (``index_select``): a double backward (gradient forces) runs through it."""

    @staticmethod
    def forward(ctx, msg: Tensor, index: Tensor, rows: int) -> Tensor:
        ctx.save_for_backward(index)
        return msg.new_zeros((rows, *msg.shape[1:])).index_add_(0, index, msg)

    @staticmethod
    def backward(ctx, grad: Tensor):
        index, = ctx.saved_tensors
        return grad.index_select(0, index), None, None


def sum_rows(msg: Tensor, index: Tensor, rows: int) -> Tensor:
    """``(E, ...)`` messages summed into ``rows`` rows by ``index`` (:class:`_SumRows`: autograd keeps
    its index alone): every layout's edges -> atoms sum (``AtomGraph``, ``halo.HaloAtomGraph``)."""
    return _SumRows.apply(msg, index, rows)


@dataclass
class AtomGraph:
    """One process's whole batch (the single-process reference). See the module docstring."""

    z: Tensor  # (N,) atomic numbers
    pos: Tensor  # (N, 3) positions, Å (set requires_grad for gradient forces)
    system: Tensor  # (N,) system index of each atom in [0, B), non-decreasing
    num_systems: int  # B
    edge_src: Tensor  # (E_loc,) j
    edge_dst: Tensor  # (E_loc,) i
    edge_shift: Tensor  # (E_loc, 3) image offset of j, Å
    idx_kj: Tensor  # (T_loc,) into the gathered edges [0, E)
    idx_ji: Tensor  # (T_loc,) into the local edges [0, E_loc)
    kj_src: Tensor  # (T_loc,) k
    kj_dst: Tensor  # (T_loc,) j
    kj_shift: Tensor  # (T_loc, 3)
    num_edges: int  # E, edges of the whole batch (over all ranks)
    atom_lo: int = 0  # this view's own atoms: [atom_lo, atom_hi)
    atom_hi: int = -1
    id_swap: Optional[Tensor] = None  # (E_loc,) reverse edge, into the gathered edges [0, E)
    triplet_rank: Optional[Tensor] = None  # (T_loc,) rank among the output edge's triplets
    strain: Optional[Tensor] = None  # (3, 3) homogeneous strain ε of the geometry (stress), None: none

    def __post_init__(self):
        if self.atom_hi < 0:
            self.atom_hi = int(self.z.shape[0])

    # ------------------------------------------------------------------ sizes
    @property
    def num_atoms(self) -> int:
        return int(self.z.shape[0])

    @property
    def num_local_edges(self) -> int:
        return int(self.edge_src.shape[0])

    @property
    def num_local_triplets(self) -> int:
        return int(self.idx_kj.shape[0])

    @property
    def own_atoms(self) -> slice:
        return slice(self.atom_lo, self.atom_hi)

    # ------------------------------------------------------------------ geometry
    def edge_vectors(self) -> Tensor:
        """(E_loc, 3) ``pos[i] - pos[j] - shift`` of the local edges (differentiable in pos),
        deformed by ``strain`` if set."""
        return self._strained(self.pos[self.edge_dst] - self.pos[self.edge_src] - self.edge_shift)

    def kj_vectors(self, triplets: Optional[Tensor] = None) -> Tensor:
        """(T_loc, 3) the edge vector of each local triplet's input edge ``k -> j``; of the local triplets
        ``triplets`` (ids) alone if given."""
        if triplets is None:
            return self._strained(self.pos[self.kj_dst] - self.pos[self.kj_src] - self.kj_shift)
        return self._strained(self.pos[self.kj_dst[triplets]] - self.pos[self.kj_src[triplets]]
                              - self.kj_shift[triplets])

    def _strained(self, v: Tensor) -> Tensor:
        return v if self.strain is None else v + v @ self.strain  # v (I + ε)

    # ------------------------------------------------------------------ reductions
    def gather_edges(self, x: Tensor, rows: str = "kj") -> Tensor:
        """(E_loc, w) -> (E, w): every edge's row, in global edge order. ``rows`` names the index that
        will read the result (``"kj"``: ``idx_kj``, ``"swap"``: ``id_swap``); the atoms layout
        (``gnnpipe.atomic.halo``) gathers only the rows that index reads."""
        return x

    def sum_atoms(self, partial: Tensor) -> Tensor:
        """(N, w) partial sums from this view's edges -> (N_own, w) complete sums."""
        return partial

    def sum_systems(self, x_own: Tensor) -> Tensor:
        """(N_own, w) per own atom -> (B, w) per system, summed over every atom."""
        out = x_own.new_zeros((self.num_systems, *x_own.shape[1:]))
        return out.index_add(0, self.system[self.own_atoms], x_own)

    def gather_atoms(self, x_own: Tensor) -> Tensor:
        """(N_own, w) per own atom -> (N, w): every atom's row, in atom order."""
        return x_own

    def edges_to_atoms(self, msg: Tensor) -> Tensor:
        """(E_loc, w) edge messages -> (N_own, w): their sum into each own target atom."""
        return self.sum_atoms(sum_rows(msg, self.edge_dst, self.num_atoms))

    def to(self, device=None, dtype=None) -> "AtomGraph":
        """A copy on ``device`` with floating tensors (pos, shifts) cast to ``dtype``."""
        def mv(t: Tensor) -> Tensor:
            return t.to(device=device, dtype=dtype if (dtype is not None and t.is_floating_point()) else t.dtype)
        return dataclasses.replace(self, **{f.name: mv(getattr(self, f.name)) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), Tensor)})


def gradient_forces(energy_of: Callable[[AtomGraph], Tensor], g: AtomGraph, create_graph: bool) -> dict:
    """``{"energy": energy_of(g) (B,), "forces": -dE/dpos (N_own, 3)}``: energy-conserving forces.

    ``g.pos`` is differentiated (a leaf copy that requires grad is made if it does not); the
    view's ``-dE/dpos`` is a partial sum over its edges that ``sum_atoms`` completes (a
    reduce-scatter when sharded). ``create_graph=True`` keeps the graph for a loss on the
    forces (double backward, training). If ``g.strain`` requires grad, the same backward pass
    also gives ``"strain_grad"``: ``dE/dε`` (3, 3) of this view's edges and triplets, a partial
    sum over the ways of a graph-parallel group (the caller adds them up).
    """
    with torch.enable_grad():
        if not g.pos.requires_grad:
            g = dataclasses.replace(g, pos=g.pos.detach().requires_grad_(True))
        energy = energy_of(g)
        strained = g.strain is not None and g.strain.requires_grad
        grads = torch.autograd.grad(energy.sum(), (g.pos, g.strain) if strained else (g.pos,),
                                    create_graph=create_graph)
    out = {"energy": energy, "forces": -g.sum_atoms(grads[0])}
    if strained:
        out["strain_grad"] = grads[1]
    return out
