"""Every collective, one test class per op: its value and gradient against the
unsharded float64 oracle, through torch.func.grad and tape autograd, on 1-d meshes of
2, 4 and 8 ranks and on axis tuples of 2-d meshes (in and out of mesh order); and
its adjoint identity <f(x), y> = <x, fᵀ(y)> on the vma types of its input and
output, with fᵀ its backward (vjp and tape), and its batching rule (``_adjoint.py``)."""
from __future__ import annotations

import math

import pytest
import torch

import functp
from functp import P
import _adjoint
from _adjoint import MESH_IDS, MESHES, assert_adjoint, typed
from _oracle import check_program, randn

# (mesh shape, mesh axis names, the axis tuple the collective runs over)
GROUPS = [
    ((2,), ("x",), ("x",)),
    ((4,), ("x",), ("x",)),
    ((8,), ("x",), ("x",)),
    ((2, 2), ("a", "b"), ("a", "b")),
    ((2, 2), ("a", "b"), ("b", "a")),
    ((2, 4), ("a", "b"), ("b",)),
    ((2, 4), ("a", "b"), ("b", "a")),
]
GROUP_IDS = [f"{'x'.join(map(str, s))}-{'+'.join(ax)}" for s, _, ax in GROUPS]


def _readout(out, w):
    """A nonlinear scalar of a collective's output, so its cotangent is not constant."""
    return (out * w).sum() + 0.5 * (out.sin() ** 2).sum()


def _case(name, mesh, axes, **kw):
    """(global_fn, local_fn, args, in_specs) for one collective over ``axes``."""
    n = mesh.axis_size(axes)
    A = axes if len(axes) > 1 else axes[0]
    x = randn(n * 2, 3, seed=1)
    if name in ("psum", "pmean", "pmax", "pmin"):
        red = {"psum": lambda b: b.sum(0), "pmean": lambda b: b.mean(0),
               "pmax": lambda b: b.amax(0), "pmin": lambda b: b.amin(0)}[name]
        coll = getattr(functp, name)
        if kw.get("ties"):
            x = randn(2, 3, seed=1).repeat(n, 1)
            x[0, 0] += 1.0            # one element with a unique extremum
        w = randn(2, 3, seed=2)
        return (lambda x, w: _readout(red(x.view(n, 2, 3)), w),
                lambda x, w: _readout(coll(x, A), w), (x, w), (P(A), P()))
    if name in ("all_gather", "all_gather_invariant"):
        axis, tiled = kw["axis"], kw["tiled"]
        join = torch.cat if tiled else torch.stack
        w = join(list(randn(n * 2, 3, seed=2).view(n, 2, 3)), axis)
        if name == "all_gather":    # the result varies over A: every rank's copy is
            # averaged back to one replicated value (pmean of identical copies)
            loc = lambda x, w: functp.pmean(_readout(functp.all_gather(x, A, axis=axis, tiled=tiled), w), A)
        else:
            loc = lambda x, w: _readout(functp.all_gather_invariant(x, A, axis=axis, tiled=tiled), w)
        return (lambda x, w: _readout(join(list(x.view(n, 2, 3)), axis), w), loc,
                (x, w), (P(A), P()))
    if name == "psum_scatter":
        d, tiled = kw["dim"], kw["tiled"]
        shape = [2, 3]
        shape[d] = 2 * n if tiled else n
        xs = randn(n, *shape, seed=1)       # rank i contributes xs[i]
        total = xs.sum(0)
        if tiled:
            out_spec = P(*[None] * d, A)
            w = randn(*total.shape, seed=2)
            glob = lambda xs, w: _readout(xs.sum(0), w)
            loc = lambda xs, w: functp.psum(_readout(
                functp.psum_scatter(xs[0], A, scatter_dimension=d, tiled=True), w), A)
        else:
            out_spec = P(A)
            w = randn(*total.movedim(d, 0).shape, seed=2)
            glob = lambda xs, w: _readout(xs.sum(0).movedim(d, 0), w)
            loc = lambda xs, w: functp.psum(_readout(
                functp.psum_scatter(xs[0], A, scatter_dimension=d).unsqueeze(0), w), A)
        return glob, loc, (xs, w), (P(A), out_spec)
    if name == "all_to_all":
        split, concat, tiled = kw["split"], kw["concat"], kw["tiled"]
        if tiled:   # moves the split of a (2n, 3n) matrix from dim `concat` to `split`
            x = randn(2 * n, 3 * n, seed=1)
            in_spec = P(*[None] * concat, A)
            out_spec = P(*[None] * split, A)
            w = randn(2 * n, 3 * n, seed=2)
            glob = lambda x, w: _readout(x, w)
        else:       # split=0, concat=1: rank j gets row j of every rank's block
            x = randn(n * n, 5, seed=1)
            in_spec, out_spec = P(A), P(A)
            w = randn(n * 5, n, seed=2)
            glob = lambda x, w: _readout(torch.cat([x.view(n, n, 5)[:, j].T for j in range(n)]), w)
        loc = lambda x, w: functp.psum(_readout(
            functp.all_to_all(x, A, split, concat, tiled=tiled), w), A)
        return glob, loc, (x, w), (in_spec, out_spec)
    if name == "ppermute":
        perm = kw["perm"](n)
        w = randn(n * 2, 3, seed=2)

        def glob(x, w):
            blocks = list(x.view(n, 2, 3))
            out = [torch.zeros_like(blocks[0]) for _ in range(n)]
            for s, d in perm:
                out[d] = blocks[s]
            return _readout(torch.cat(out), w)
        loc = lambda x, w: functp.psum(_readout(functp.ppermute(x, A, perm), w), A)
        return glob, loc, (x, w), (P(A), P(A))
    raise KeyError(name)


def _collective_body(shape, names, axes, name, kw, check_vma):
    mesh = functp.make_mesh(shape, names)
    glob, loc, args, specs = _case(name, mesh, axes, **kw)
    check_program(mesh, glob, loc, args, specs, check_vma=check_vma)


VMA = pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "sum"])
ON_GROUPS = pytest.mark.parametrize("group", GROUPS, ids=GROUP_IDS)
ADJOINT = pytest.mark.parametrize("mesh", MESHES, ids=MESH_IDS)


def _value(run, group, name, kw, check_vma):
    shape, names, axes = group
    run(math.prod(shape), _collective_body, shape, names, axes, name, kw, check_vma)


def _check_adjoint(run, mesh, check_vma, cases, gloo=False):
    assert_adjoint(run(math.prod(mesh[0]), _adjoint.body, mesh, check_vma, cases, gloo=gloo))


def _ring(n):
    return [(i, (i + 1) % n) for i in range(n)]


def _one_pair(n):
    return [(0, n - 1)]


# -- the adjoint cases: (checker, A, n, X, E) as _adjoint.body gives them ----------------------

def _psum_cases(ch, A, n, X, E):
    # x: V[A ∪ E] -> I[A]: the transpose is pvary
    ch.linear(lambda x: functp.psum(x, A), (typed((2, 3), X, 1),), (X,), E)


def _pmean_cases(ch, A, n, X, E):
    ch.linear(lambda x: functp.pmean(x, A), (typed((2, 3), X, 1),), (X,), E)
    # the mean of a value invariant over A is that value (implicitly pvary'd first)
    ch.linear(lambda x: functp.pmean(x, A), (typed((2, 3), E, 1),), (E,), E)


def _extremum_cases(ch, A, n, X, E):
    # nonlinear: the jvp at a point with ties across ranks against the vjp there
    for op in (functp.pmax, functp.pmin):
        ch.linearized(lambda x: op(x, A), typed((4, 3), X, 1).round(), X, E)


def _pvary_cases(ch, A, n, X, E):
    # x: I[A] -> V[A]: the transpose is psum
    x = typed((2, 3), E, 1)
    ch.linear(lambda x: functp.pvary(x, A), (x,), (E,), X)
    ch.linear(lambda x: functp.pcast(x, A, to="varying"), (x,), (E,), X)


def _all_gather_cases(ch, A, n, X, E):
    for axis, tiled in [(0, True), (0, False), (1, True)]:
        ch.linear(lambda x: functp.all_gather(x, A, axis=axis, tiled=tiled),
                  (typed((2, 3), X, 1),), (X,), X)


def _all_gather_invariant_cases(ch, A, n, X, E):
    # the result is I[A]: the transpose keeps this rank's block
    for axis, tiled in [(0, True), (0, False), (1, True)]:
        ch.linear(lambda x: functp.all_gather_invariant(x, A, axis=axis, tiled=tiled),
                  (typed((2, 3), X, 1),), (X,), E)
    ch.linear(lambda x: functp.all_gather(x, A, tiled=True, to="invarying"),
              (typed((2, 3), X, 1),), (X,), E)


def _psum_scatter_cases(ch, A, n, X, E):
    ch.linear(lambda x: functp.psum_scatter(x, A, scatter_dimension=0, tiled=True),
              (typed((2 * n, 3), X, 1),), (X,), X)
    ch.linear(lambda x: functp.psum_scatter(x, A, scatter_dimension=1),
              (typed((2, n), X, 1),), (X,), X)


def _all_to_all_cases(ch, A, n, X, E):
    for split, concat, tiled, shape in [(0, 1, True, (2 * n, 3)), (1, 0, True, (2, 3 * n)),
                                        (0, 1, False, (n, 3))]:
        ch.linear(lambda x: functp.all_to_all(x, A, split, concat, tiled=tiled),
                  (typed(shape, X, 1),), (X,), X)


def _ppermute_cases(ch, A, n, X, E):
    for perm in (_ring(n), _one_pair(n)):
        ch.linear(lambda x: functp.ppermute(x, A, perm), (typed((2, 3), X, 1),), (X,), X)


# -- one class per op ---------------------------------------------------------------------------

@VMA
class TestPsum:
    @ON_GROUPS
    def test_matches_oracle(self, run, group, check_vma):
        _value(run, group, "psum", {}, check_vma)

    @ADJOINT
    def test_adjoint(self, run, mesh, check_vma):
        _check_adjoint(run, mesh, check_vma, _psum_cases)

    def test_of_a_python_number_counts_ranks(self, run, check_vma):
        run(4, _python_scalar_body, check_vma)


@VMA
class TestPmean:
    @ON_GROUPS
    def test_matches_oracle(self, run, group, check_vma):
        _value(run, group, "pmean", {}, check_vma)

    @ADJOINT
    def test_adjoint(self, run, mesh, check_vma):
        _check_adjoint(run, mesh, check_vma, _pmean_cases)


@VMA
class TestPmaxPmin:
    @ON_GROUPS
    @pytest.mark.parametrize("name", ["pmax", "pmin"])
    def test_matches_oracle(self, run, group, name, check_vma):
        _value(run, group, name, {}, check_vma)

    @pytest.mark.parametrize("name", ["pmax", "pmin"])
    def test_gradient_is_shared_among_ties(self, run, name, check_vma):
        run(4, _collective_body, (4,), ("x",), ("x",), name, {"ties": True}, check_vma)

    @ADJOINT
    def test_adjoint_of_the_linearization(self, run, mesh, check_vma):
        # processes: simulated ranks would share torch's one forward-AD level
        _check_adjoint(run, mesh, check_vma, _extremum_cases, gloo=True)


@VMA
class TestPvary:
    # its values: test_vma.py (explicit pvary, and the implicit one of every op)
    @ADJOINT
    def test_adjoint(self, run, mesh, check_vma):
        _check_adjoint(run, mesh, check_vma, _pvary_cases)


@VMA
class TestAllGather:
    @ON_GROUPS
    @pytest.mark.parametrize("axis,tiled", [(0, True), (0, False), (1, True), (2, False)])
    def test_matches_oracle(self, run, group, axis, tiled, check_vma):
        _value(run, group, "all_gather", {"axis": axis, "tiled": tiled}, check_vma)

    @ADJOINT
    def test_adjoint(self, run, mesh, check_vma):
        _check_adjoint(run, mesh, check_vma, _all_gather_cases)


@VMA
class TestAllGatherInvariant:
    @ON_GROUPS
    @pytest.mark.parametrize("axis,tiled", [(0, True), (0, False), (1, True), (2, False)])
    def test_matches_oracle(self, run, group, axis, tiled, check_vma):
        _value(run, group, "all_gather_invariant", {"axis": axis, "tiled": tiled}, check_vma)

    @ADJOINT
    def test_adjoint(self, run, mesh, check_vma):
        _check_adjoint(run, mesh, check_vma, _all_gather_invariant_cases)


@VMA
class TestPsumScatter:
    @ON_GROUPS
    @pytest.mark.parametrize("dim,tiled", [(0, True), (1, True), (0, False), (1, False)])
    def test_matches_oracle(self, run, group, dim, tiled, check_vma):
        _value(run, group, "psum_scatter", {"dim": dim, "tiled": tiled}, check_vma)

    @ADJOINT
    def test_adjoint(self, run, mesh, check_vma):
        _check_adjoint(run, mesh, check_vma, _psum_scatter_cases)


@VMA
class TestAllToAll:
    @ON_GROUPS
    @pytest.mark.parametrize("split,concat,tiled", [(1, 0, True), (0, 1, True), (0, 1, False)])
    def test_matches_oracle(self, run, group, split, concat, tiled, check_vma):
        _value(run, group, "all_to_all", {"split": split, "concat": concat, "tiled": tiled},
               check_vma)

    @ADJOINT
    def test_adjoint(self, run, mesh, check_vma):
        _check_adjoint(run, mesh, check_vma, _all_to_all_cases)


@VMA
class TestPpermute:
    @ON_GROUPS
    @pytest.mark.parametrize("perm", [_ring, _one_pair], ids=["ring", "one-pair"])
    def test_matches_oracle(self, run, group, perm, check_vma):
        _value(run, group, "ppermute", {"perm": perm}, check_vma)

    @ADJOINT
    def test_adjoint(self, run, mesh, check_vma):
        _check_adjoint(run, mesh, check_vma, _ppermute_cases)


def _axis_index_body():
    mesh = functp.make_mesh((2, 2), ("a", "b"))
    seen = {}

    def body(x):
        seen.update(a=functp.axis_index("a"), b=functp.axis_index("b"),
                    ab=functp.axis_index(("a", "b")), ba=functp.axis_index(("b", "a")),
                    size=functp.axis_size(("a", "b")))
        return x
    functp.shard_map(body, mesh, in_specs=P(), out_specs=P())(torch.zeros(1))
    c = mesh.coordinate
    assert seen == dict(a=c["a"], b=c["b"], ab=2 * c["a"] + c["b"], ba=2 * c["b"] + c["a"], size=4)


class TestAxisIndex:
    # a Python int: no transpose, so no adjoint to check
    def test_axis_index_and_size(self, run):
        run(4, _axis_index_body)


def _python_scalar_body(check_vma):
    mesh = functp.make_mesh((4,), ("x",))
    out = functp.shard_map(lambda x: functp.psum(1, "x") * x, mesh, in_specs=P(), out_specs=P(),
                           check_vma=check_vma)(torch.ones(2))
    assert out.tolist() == [4.0, 4.0]
