"""The adjoint identity of a collective, checked inside a shard_map body.

For an op ``f`` linear in ``x``, ``<f(x), y> = <x, fᵀ(y)>`` for every ``x`` and ``y``,
where ``fᵀ`` is the op's backward: here through ``torch.func.vjp`` and through tape
autograd. (For a nonlinear op, ``f`` is its linearization at a point: the jvp.)

The inner product follows the values' vma types (docs/architecture.md, "vma types and
the autodiff contract"): a value varying over axes ``V`` is one block per coordinate
along ``V``, so the ranks' local products are summed over ``V`` (``psum``), while
along the axes it is invariant over it is one value held by every rank and counts
once. So ``psum: V[a] -> I[a]`` has
``<psum(x), y> = Σₐ <xᵢ, y>`` and its transpose is ``pvary``; ``pvary: I[a] -> V[a]``
has ``<pvary(x), y> = <x, Σₐ yᵢ>``, transpose ``psum``. Each test declares the types
it expects, and the vma check holds it to them: a declared type too small leaves a
varying result at ``out_specs=P()`` (an error), one too large sums an invariant value
(an error). With ``check_vma=False`` every value is a set of per-rank contributions
and the products are summed over every rank: the sum rules' transposes (psumᵀ = psum)
are the adjoints of that inner product.
"""
from __future__ import annotations

import math

import torch

import functp
from functp import P
from _oracle import randn


def typed(shape, axes: tuple, seed: int) -> torch.Tensor:
    """A random float64 tensor varying over ``axes``: the same on the ranks that share
    their coordinates along ``axes``, and marked as varying over them."""
    k = functp.axis_index(axes) if axes else 0
    t = randn(*shape, seed=1000 * seed + k)
    return functp.pvary(t, axes) if axes else t


class Checker:
    """Collects ``[<f(x), y>, <x, fᵀy> by vjp, <x, fᵀy> by tape, vmap error]`` per case,
    inside one body; ``result()`` stacks them (invariant: out_specs ``P()``)."""

    def __init__(self, mesh_axes: tuple, check_vma: bool):
        self.mesh_axes, self.check_vma, self.rows = mesh_axes, check_vma, []

    def inner(self, u, v, axes: tuple) -> torch.Tensor:
        """``<u, v>`` of two values of the vma type ``axes`` (every rank in sum mode)."""
        over = axes if self.check_vma else self.mesh_axes
        s = (u * v).sum()
        return functp.psum(s, over) if over else s

    def linear(self, f, xs: tuple, x_types: tuple, y_type: tuple, seed: int = 7):
        """Checks ``f(*xs)`` (linear in each of ``xs``) against its backward."""
        out, pull = torch.func.vjp(f, *xs)
        y = typed(out.shape, y_type, seed)
        lhs = self.inner(out, y, y_type)
        leaves = [x.detach().requires_grad_() for x in xs]
        tape = torch.autograd.grad(f(*leaves), leaves, y)
        rhs = [sum(self.inner(x, g, t) for x, g, t in zip(xs, gs, x_types))
               for gs in (pull(y), tape)]
        self.rows.append(torch.stack([lhs, *rhs, self._vmap_error(f, xs)]))

    def linearized(self, f, x0, x_type: tuple, y_type: tuple, seed: int = 7):
        """Checks the jvp of ``f`` at ``x0`` against its vjp: ``<J ẋ, y> = <ẋ, Jᵀ y>``."""
        xdot = typed(x0.shape, x_type, seed + 1)
        out, jx = torch.func.jvp(f, (x0,), (xdot,))
        y = typed(out.shape, y_type, seed)
        lhs = self.inner(jx, y, y_type)
        leaf = x0.detach().requires_grad_()
        rhs = [self.inner(xdot, g, x_type)
               for g in (torch.func.vjp(f, x0)[1](y)[0],
                         torch.autograd.grad(f(leaf), leaf, y)[0])]
        self.rows.append(torch.stack([lhs, *rhs, self._vmap_error(f, (x0,))]))

    def _vmap_error(self, f, xs) -> torch.Tensor:
        """The op's batching rule: vmap over a new dim 1 equals a loop."""
        batch = [torch.stack([x, 2 * x + 1], 1) for x in xs]
        looped = torch.stack([f(*[b.select(1, i) for b in batch]) for i in range(2)])
        err = (torch.vmap(f, in_dims=1)(*batch) - looped).abs().max()
        return functp.pmax(err, self.mesh_axes)

    def result(self) -> torch.Tensor:
        return torch.stack(self.rows)


# (mesh shape, axis names, the collective's axes A, the axes E the input varies over
# besides A): 1-d meshes of 2 and 4 ranks, and a 2x2 mesh, over both axes or one
MESHES = [((2,), ("x",), ("x",), ()), ((4,), ("x",), ("x",), ()),
          ((2, 2), ("a", "b"), ("a", "b"), ()), ((2, 2), ("a", "b"), ("b",), ("a",))]
MESH_IDS = ["2", "4", "2x2-a+b", "2x2-b-varying-a"]


def body(mesh: tuple, check_vma: bool, cases) -> torch.Tensor:
    """Runs ``cases(checker, A, n, X, E)`` in a shard_map body: ``A`` the axis name
    (or tuple) to run the op over, ``n`` its size, ``X`` the axes its input varies
    over (``A`` and ``E``), ``E`` the others. Returns the stacked rows, on this rank."""
    shape, names, axes, extra = mesh
    size = dict(zip(names, shape))
    X = tuple(a for a in names if a in axes or a in extra)
    A = axes if len(axes) > 1 else axes[0]

    def run(token):
        ch = Checker(tuple(names), check_vma)
        cases(ch, A, math.prod(size[a] for a in axes), X, tuple(extra))
        return ch.result() + token.sum() * 0
    return functp.shard_map(run, functp.make_mesh(shape, names), in_specs=P(), out_specs=P(),
                            check_vma=check_vma)(torch.zeros(1, dtype=torch.float64))


def assert_adjoint(results) -> None:
    """Every rank, every case: the two transposes match the forward, the products are
    not trivially zero, and vmap matches the loop."""
    for rank, rows in enumerate(results):
        for i, (lhs, vjp, tape, vmap_err) in enumerate(rows.tolist()):
            where = f"rank {rank}, case {i}"
            assert abs(lhs) > 1e-3, f"{where}: <f(x), y> = {lhs} is too small to check anything"
            assert math.isclose(vjp, lhs, rel_tol=1e-10), f"{where}: <x, vjp(y)> = {vjp} != {lhs}"
            assert math.isclose(tape, lhs, rel_tol=1e-10), f"{where}: <x, tape(y)> = {tape} != {lhs}"
            assert vmap_err < 1e-12, f"{where}: vmap differs from the loop by {vmap_err}"
