"""The eager union rule's cost (issue 39 item 2): torch calls with keyword arguments
and tuples of sizes take its fast path, counted in Python calls (no timings), with
the same gradients and errors as before."""
from __future__ import annotations

import cProfile
import pstats

import pytest
import torch

import functp
from functp import P, ShardingError
from _oracle import assert_tree_close, randn


def _norm_like(w, x):
    """Keyword arguments and tuples of sizes, as transformers' layers write them;
    ``w`` (replicated) meets ``x`` (split over dp) through keywords too."""
    h = x.to(dtype=torch.float64)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    h = torch.add(h, w.transpose(dim0=0, dim1=1).sum(dim=(0,)), alpha=0.5)   # mixed
    h = torch.softmax(h.view((h.shape[0], 2, 3)), dim=-1).reshape(h.shape[0], 6)
    return h.sum(dim=(0, 1), keepdim=False)


def _general_calls(fn) -> int:
    """Calls of the union rule's slow path (``UnionRule._general``) in one ``fn()``."""
    fn()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    return sum(n for (file, _, name), (_, n, *_) in pstats.Stats(prof).stats.items()
               if name == "_general" and file.endswith("_vma_mode.py"))


def _keywords_body():
    mesh = functp.make_mesh((2,), ("dp",))
    w, x = randn(6, 4, seed=1), randn(4, 6, seed=2)

    def make(check_vma):
        return functp.shard_map(lambda w, x: functp.psum(_norm_like(w, x), "dp"), mesh,
                                in_specs=(P(), P("dp")), out_specs=P(),
                                check_vma=check_vma)
    # the same gradients as sum semantics (the implicit pvary of w under alpha=)
    g = torch.func.grad(make(True), argnums=(0, 1))(w, x)
    assert_tree_close(g, torch.func.grad(make(False), argnums=(0, 1))(w, x))
    wl = w.clone().requires_grad_()
    make(True)(wl, x).backward()
    assert_tree_close(wl.grad, g[0])
    # inputs that agree: no torch call of the body takes the slow path (before: every
    # call with a keyword or a tuple of sizes did, 7 of them); the one mixing w and x
    # (torch.add with alpha=) still does
    agree = functp.shard_map(_norm_like, mesh, in_specs=(P(), P()), out_specs=P())
    assert _general_calls(lambda: agree(w, x)) == 0
    assert _general_calls(lambda: make(True)(w, x)) == 1
    # and the vma errors still fire through keyword calls
    with pytest.raises(ShardingError, match="varies over mesh axis 'dp'"):
        functp.shard_map(lambda x: x.sum(dim=(0,), keepdim=True), mesh, in_specs=P("dp"),
                         out_specs=P())(x)


def test_keyword_calls_take_the_fast_path_with_the_same_gradients(run):
    run(2, _keywords_body)


def _graph_ops(t: torch.Tensor) -> list[str]:
    """The names of the autograd nodes behind ``t``."""
    seen, todo, names = set(), [t.grad_fn], []
    while todo:
        n = todo.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        names.append(type(n).__name__)
        todo.extend(f for f, _ in n.next_functions)
    return names


def _size1_body():
    # tp has size 1: the pvarys over it (w meeting x, split over tp; the
    # replicated bias meeting both) need no gradient psum, so no pvary op
    mesh = functp.make_mesh((2, 1), ("dp", "tp"))
    w, b, x = randn(3, 4, seed=1), randn(4, seed=2), randn(4, 3, seed=3)

    def f(w, b, x):
        return functp.psum((torch.tanh(x @ w + b) ** 2).sum(), ("dp", "tp"))

    def make(check_vma):
        return functp.shard_map(f, mesh, in_specs=(P(None, "tp"), P(), P("dp")),
                                out_specs=P(), check_vma=check_vma)
    wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
    out = make(True)(wl, bl, x)
    ops = _graph_ops(out)
    # the boundary aliases of w over dp and of b over (dp, tp) (size 2) are left;
    # before, x's pvary over tp was a third
    assert sum("pvary" in n for n in ops) == 2, ops
    out.backward()
    g = torch.func.grad(make(True), argnums=(0, 1))(w, b, x)
    assert_tree_close((wl.grad, bl.grad), g)
    assert_tree_close(g, torch.func.grad(make(False), argnums=(0, 1))(w, b, x))
    # the vma errors over a size-1 axis still fire
    with pytest.raises(ShardingError, match="varies over mesh axis 'tp'"):
        functp.shard_map(lambda w, x: x @ w, mesh, in_specs=(P(None, "tp"), P("dp")),
                         out_specs=P("dp"))(w, x)


def test_size1_axes_add_no_pvary_ops_with_the_same_gradients(run):
    run(2, _size1_body)
