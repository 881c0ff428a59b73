"""Every collective against the unsharded float64 oracle: value and gradient, through
torch.func.grad and tape autograd, on 1-d meshes of 2, 4 and 8 ranks and on axis
tuples of 2-d meshes (in and out of mesh order)."""
from __future__ import annotations

import math

import pytest
import torch

import functp
from functp import P
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


@VMA
@pytest.mark.parametrize("group", GROUPS, ids=GROUP_IDS)
@pytest.mark.parametrize("name", ["psum", "pmean", "pmax", "pmin"])
def test_reductions_match_oracle(run, group, name, check_vma):
    shape, names, axes = group
    run(math.prod(shape), _collective_body, shape, names, axes, name, {}, check_vma)


@VMA
@pytest.mark.parametrize("name", ["pmax", "pmin"])
def test_extremum_gradient_is_shared_among_ties(run, name, check_vma):
    run(4, _collective_body, (4,), ("x",), ("x",), name, {"ties": True}, check_vma)


@VMA
@pytest.mark.parametrize("group", GROUPS, ids=GROUP_IDS)
@pytest.mark.parametrize("axis,tiled", [(0, True), (0, False), (1, True), (2, False)])
@pytest.mark.parametrize("name", ["all_gather", "all_gather_invariant"])
def test_all_gather_matches_oracle(run, group, name, axis, tiled, check_vma):
    shape, names, axes = group
    run(math.prod(shape), _collective_body, shape, names, axes, name,
        {"axis": axis, "tiled": tiled}, check_vma)


@VMA
@pytest.mark.parametrize("group", GROUPS, ids=GROUP_IDS)
@pytest.mark.parametrize("dim,tiled", [(0, True), (1, True), (0, False), (1, False)])
def test_psum_scatter_matches_oracle(run, group, dim, tiled, check_vma):
    shape, names, axes = group
    run(math.prod(shape), _collective_body, shape, names, axes, "psum_scatter",
        {"dim": dim, "tiled": tiled}, check_vma)


@VMA
@pytest.mark.parametrize("group", GROUPS, ids=GROUP_IDS)
@pytest.mark.parametrize("split,concat,tiled", [(1, 0, True), (0, 1, True), (0, 1, False)])
def test_all_to_all_matches_oracle(run, group, split, concat, tiled, check_vma):
    shape, names, axes = group
    run(math.prod(shape), _collective_body, shape, names, axes, "all_to_all",
        {"split": split, "concat": concat, "tiled": tiled}, check_vma)


def _ring(n):
    return [(i, (i + 1) % n) for i in range(n)]


def _one_pair(n):
    return [(0, n - 1)]


@VMA
@pytest.mark.parametrize("group", GROUPS, ids=GROUP_IDS)
@pytest.mark.parametrize("perm", [_ring, _one_pair], ids=["ring", "one-pair"])
def test_ppermute_matches_oracle(run, group, perm, check_vma):
    shape, names, axes = group
    run(math.prod(shape), _collective_body, shape, names, axes, "ppermute", {"perm": perm}, check_vma)


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


def test_axis_index_and_size(run):
    run(4, _axis_index_body)


def _python_scalar_body():
    mesh = functp.make_mesh((4,), ("x",))
    out = functp.shard_map(lambda x: functp.psum(1, "x") * x, mesh, in_specs=P(), out_specs=P())(
        torch.ones(2))
    assert out.tolist() == [4.0, 4.0]


def test_psum_of_python_number_counts_ranks(run):
    run(4, _python_scalar_body)
