"""Every collective, one test class per op: its value and gradient against the
unsharded float64 oracle, through torch.func.grad and tape autograd, on 1-d meshes of
2, 4 and 8 ranks and on axis tuples of 2-d meshes (in and out of mesh order); and
its adjoint identity <f(x), y> = <x, fᵀ(y)> on the vma types of its input and
output, with fᵀ its backward (vjp and tape), and its batching rule (``_adjoint.py``).
Each op's program and its unsharded equivalent: ``_programs._case``."""
from __future__ import annotations

import math

import pytest
import torch

import functp
from functp import P
import _adjoint
from _adjoint import MESH_IDS, MESHES, assert_adjoint, typed
from _programs import _collective_body, _one_pair, _ring

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


VMA = pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "sum"])
ON_GROUPS = pytest.mark.parametrize("group", GROUPS, ids=GROUP_IDS)
ADJOINT = pytest.mark.parametrize("mesh", MESHES, ids=MESH_IDS)


def _value(run, group, name, kw, check_vma):
    shape, names, axes = group
    run(math.prod(shape), _collective_body, shape, names, axes, name, kw, check_vma)


def _check_adjoint(run, mesh, check_vma, cases, gloo=False):
    assert_adjoint(run(math.prod(mesh[0]), _adjoint.body, mesh, check_vma, cases, gloo=gloo))


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


def _gather_before_and_after_another_mesh():
    """An all_gather over ("b", "a") of a (2, 2) mesh, before and after a second mesh
    over the same ranks with the other axis order is made."""
    mesh = functp.make_mesh((2, 2), ("a", "b"))
    step = functp.shard_map(lambda x: functp.all_gather(x, ("b", "a"), axis=0, tiled=True),
                            mesh, in_specs=P(("a", "b")), out_specs=P(), check_vma=False)
    x = torch.arange(4.0)
    before = step(functp.shard(x, mesh, P(("a", "b"))))
    functp.make_mesh((2, 2), ("b", "a"))
    after = step(functp.shard(x, mesh, P(("a", "b"))))
    return before.tolist(), after.tolist()


def test_a_second_mesh_over_the_same_ranks_leaves_the_first_meshs_groups_alone():
    # fails on the code before: the groups were registered by c10d name and axes only,
    # so the second mesh's member order replaced the first's ([0, 1, 2, 3] after)
    for rank, (before, after) in enumerate(functp.simulate(_gather_before_and_after_another_mesh, 4)):
        assert before == after == [0.0, 2.0, 1.0, 3.0], (rank, before, after)
