"""shard_map'd programs under torch.func transforms and their compositions:
vmap (around and inside the body), jvp, jacrev, vmap(grad), grad(vmap)."""
from __future__ import annotations

import pytest
import torch

import functp
from functp import P
from _oracle import assert_tree_close, randn

N = 4


def _mesh():
    return functp.make_mesh((N,), ("x",))


def _shard_map(f, mesh, in_specs, out_specs):
    return functp.shard_map(f, mesh, in_specs=in_specs, out_specs=out_specs, check_vma=_MODE[0])


_MODE = [True]


def _gather_program(x):
    # several collectives with dimension arguments, to exercise the vmap rules
    g = functp.all_gather(x, "x", axis=1, tiled=True)                 # (2, 3N)
    s = functp.psum_scatter(g.sin(), "x", scatter_dimension=1, tiled=True)   # (2, 3)
    t = functp.all_to_all(s.repeat(1, N), "x", 1, 0, tiled=True)      # (2N, 3)
    r = functp.ppermute(t, "x", [(i, (i + 1) % N) for i in range(N)])
    return functp.pmax(r.sum(0), "x") + functp.pmean(x.sum(0), "x")  # (3,)


def _vmap_around_body():
    mesh = _mesh()
    f = _shard_map(_gather_program, mesh, P(), P())
    xs = functp.shard(randn(5, 2 * N, 3, seed=1), mesh, P(None, "x"))
    batched = torch.vmap(f)(xs)
    assert_tree_close(batched, torch.stack([f(x) for x in xs]), "vmap(shard_map)")
    moved = torch.vmap(f, in_dims=1)(xs.movedim(0, 1).contiguous())
    assert_tree_close(moved, batched, "vmap(in_dims=1)")


def _vmap_inside_body():
    mesh = _mesh()

    def body(xs):
        return torch.vmap(_gather_program)(xs)
    f = _shard_map(body, mesh, P(), P())
    g = _shard_map(lambda xs: torch.stack([_gather_program(x) for x in xs]), mesh,
                         P(), P())
    xs = functp.shard(randn(3, 2 * N, 3, seed=1), mesh, P(None, "x"))
    assert_tree_close(f(xs), g(xs), "vmap inside the body")


def _loss_program():
    mesh = _mesh()

    def glob(x, w):
        return (torch.tanh(x @ w) ** 2).sum()

    def local(x, w):
        return functp.psum((torch.tanh(x @ w) ** 2).sum(), "x")
    step = _shard_map(local, mesh, (P("x"), P()), P())
    return mesh, glob, step


def _jvp_body():
    mesh, glob, step = _loss_program()
    x, w, tx, tw = randn(2 * N, 3, seed=1), randn(3, 2, seed=2), randn(2 * N, 3, seed=3), randn(3, 2, seed=4)
    ref = torch.func.jvp(glob, (x, w), (tx, tw))
    xl, txl = functp.shard((x, tx), mesh, P("x"))
    out = torch.func.jvp(step, (xl, w), (txl, tw))
    assert_tree_close(out, ref, "jvp")


def _vjp_body():
    mesh = _mesh()
    x = randn(2 * N, 3, seed=1)
    glob = lambda x: torch.tanh(x.view(N, 2, 3).sum(0))
    f = _shard_map(lambda x: torch.tanh(functp.psum(x, "x")), mesh, P("x"), P())
    ct = randn(2, 3, seed=2)
    out, pullback = torch.func.vjp(f, functp.shard(x, mesh, P("x")))
    ref_out, ref_pullback = torch.func.vjp(glob, x)
    assert_tree_close(out, ref_out, "vjp value")
    assert_tree_close(functp.unshard(pullback(ct)[0], mesh, P("x")), ref_pullback(ct)[0], "vjp")


def _jacrev_body():
    mesh = _mesh()
    x = randn(2 * N, 3, seed=1)
    glob = lambda x: torch.tanh(x.view(N, 2, 3).sum(0)).reshape(-1)
    f = _shard_map(lambda x: torch.tanh(functp.psum(x, "x")).reshape(-1), mesh,
                         P("x"), P())
    jac = torch.func.jacrev(f)(functp.shard(x, mesh, P("x")))       # (6, 2, 3) local block
    assert_tree_close(functp.unshard(jac, mesh, P(None, "x")), torch.func.jacrev(glob)(x), "jacrev")
    # (jacfwd is vmap(jvp) over a *local* basis: every rank perturbs its own element i
    # at once, so it yields the sum over ranks of the global Jacobian's blocks, not one
    # block. Reverse mode from a replicated output has no such ambiguity.)


def _vmap_grad_body():
    """Per-example gradients: vmap over examples of grad of a sharded loss."""
    mesh, glob, step = _loss_program()
    xs, w = randn(3, 2 * N, 3, seed=1), randn(3, 2, seed=2)
    ref = torch.vmap(torch.func.grad(glob, argnums=1), in_dims=(0, None))(xs, w)
    xls = functp.shard(xs, mesh, P(None, "x"))
    got = torch.vmap(torch.func.grad(step, argnums=1), in_dims=(0, None))(xls, w)
    assert_tree_close(got, ref, "vmap(grad)")


def _grad_vmap_body():
    mesh, glob, step = _loss_program()
    xs, w = randn(3, 2 * N, 3, seed=1), randn(3, 2, seed=2)
    ref = torch.func.grad(lambda xs, w: torch.vmap(glob, in_dims=(0, None))(xs, w).sum(),
                          argnums=(0, 1))(xs, w)
    xls = functp.shard(xs, mesh, P(None, "x"))
    got = torch.func.grad(lambda xs, w: torch.vmap(step, in_dims=(0, None))(xs, w).sum(),
                          argnums=(0, 1))(xls, w)
    assert_tree_close((functp.unshard(got[0], mesh, P(None, "x")), got[1]), ref, "grad(vmap)")


def _second_order_program():
    """(global, local) programs whose second derivatives pass through psum,
    all_gather and psum_scatter."""
    def glob(x):
        return (torch.sin(x).sum(0) ** 2).sum() + (x ** 3).sum()

    def local(x):
        full = functp.all_gather(x, "x", tiled=True)
        col = functp.psum(torch.sin(x).sum(0), "x")
        own = functp.psum_scatter(full ** 3, "x", tiled=True) / N
        return (col ** 2).sum() + functp.psum(own.sum(), "x")
    return glob, local


def _hessian_vector_body():
    """Second order: grad of (grad . v)."""
    mesh = _mesh()
    glob, local = _second_order_program()
    x, v = randn(2 * N, 3, seed=1), randn(2 * N, 3, seed=2)
    f = _shard_map(local, mesh, P("x"), P())
    hvp_ref = torch.func.grad(lambda x: (torch.func.grad(glob)(x) * v).sum())(x)
    xl, vl = functp.shard((x, v), mesh, P("x"))
    hvp = torch.func.grad(lambda x: (torch.func.grad(f)(x) * vl).sum())(xl)
    # the inner grad is a local block: the outer function sums blocks only locally,
    # so its gradient is this rank's block of the global hvp
    assert_tree_close(functp.unshard(hvp, mesh, P("x")), hvp_ref, "hessian-vector product")


def _forward_over_reverse_body():
    """The hvp as jvp of grad: the collectives' backward runs under a jvp level."""
    mesh = _mesh()
    glob, local = _second_order_program()
    x, v = randn(2 * N, 3, seed=1), randn(2 * N, 3, seed=2)
    f = _shard_map(local, mesh, P("x"), P())
    ref = torch.func.jvp(torch.func.grad(glob), (x,), (v,))[1]
    xl, vl = functp.shard((x, v), mesh, P("x"))
    got = torch.func.jvp(torch.func.grad(f), (xl,), (vl,))[1]
    assert_tree_close(functp.unshard(got, mesh, P("x")), ref, "jvp(grad)")


def _tape_double_backward_body():
    """Tape autograd with create_graph=True, then backward through that gradient."""
    mesh = _mesh()
    glob, local = _second_order_program()
    x, v = randn(2 * N, 3, seed=1), randn(2 * N, 3, seed=2)
    xg = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(glob(xg), xg, create_graph=True)
    (ref,) = torch.autograd.grad((g * v).sum(), xg)
    f = _shard_map(local, mesh, P("x"), P())
    xl, vl = functp.shard((x, v), mesh, P("x"))
    xl = xl.clone().requires_grad_()
    (gl,) = torch.autograd.grad(f(xl), xl, create_graph=True)
    (got,) = torch.autograd.grad((gl * vl).sum(), xl)
    assert_tree_close(functp.unshard(gl.detach(), mesh, P("x")), g.detach(), "tape grad")
    assert_tree_close(functp.unshard(got, mesh, P("x")), ref, "tape double backward")


def _bucket_program():
    """Two replicated weights meet split data: their gradients are summed over the
    axis in one bucketed all-reduce (functp::bucket_psum), whose own derivatives the
    second-order transforms take."""
    mesh = _mesh()

    def glob(x, w1, w2):
        return ((torch.tanh(x @ w1) @ w2) ** 2).sum()

    def local(x, w1, w2):
        return functp.psum(((torch.tanh(x @ w1) @ w2) ** 2).sum(), "x")
    step = _shard_map(local, mesh, (P("x"), P(), P()), P())
    x, w1, w2 = randn(2 * N, 3, seed=1), randn(3, 4, seed=2), randn(4, 2, seed=3)
    v1, v2 = randn(3, 4, seed=4), randn(4, 2, seed=5)
    return mesh, glob, step, x, (w1, w2), (v1, v2)


def _bucket_body():
    mesh, glob, step, x, ws, vs = _bucket_program()
    xl = functp.shard(x, mesh, P("x"))
    g = torch.func.grad(glob, argnums=(1, 2))
    gl = torch.func.grad(step, argnums=(1, 2))
    assert_tree_close(gl(xl, *ws), g(x, *ws), "bucket: grad")

    def hvp(grad, x):          # grad of (grad . v): the bucket's backward, differentiated
        return torch.func.grad(lambda w1, w2: sum((a * v).sum() for a, v in
                                                   zip(grad(x, w1, w2), vs)), argnums=(0, 1))
    assert_tree_close(hvp(gl, xl)(*ws), hvp(g, x)(*ws), "bucket: grad of grad")
    xs = randn(3, 2 * N, 3, seed=6)          # per-example gradients: vmap of the bucket
    ref = torch.vmap(g, in_dims=(0, None, None))(xs, *ws)
    got = torch.vmap(gl, in_dims=(0, None, None))(functp.shard(xs, mesh, P(None, "x")), *ws)
    assert_tree_close(got, ref, "bucket: vmap(grad)")
    wr = [w.clone().requires_grad_() for w in ws]      # tape, create_graph, backward again
    gr = torch.autograd.grad(glob(x, *wr), wr, create_graph=True)
    ref = torch.autograd.grad(sum((a * v).sum() for a, v in zip(gr, vs)), wr)
    wl = [w.clone().requires_grad_() for w in ws]
    gt = torch.autograd.grad(step(xl, *wl), wl, create_graph=True)
    got = torch.autograd.grad(sum((a * v).sum() for a, v in zip(gt, vs)), wl)
    assert_tree_close(got, ref, "bucket: tape double backward")


def _bucket_2d_body():
    """The same on a 2 x 2 mesh: Megatron weights split over tp, their gradients
    summed over dp in one bucket; grad and grad of grad against the oracle."""
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))

    def glob(x, w1, w2):
        return ((torch.tanh(x @ w1) @ w2) ** 2).sum()

    def local(x, w1, w2):
        y = functp.psum(torch.tanh(x @ w1) @ w2, "tp")
        return functp.psum((y ** 2).sum(), "dp")
    specs = (P("dp"), P(None, "tp"), P("tp", None))
    step = _shard_map(local, mesh, specs, P())
    x, w1, w2 = randn(4, 3, seed=1), randn(3, 4, seed=2), randn(4, 2, seed=3)
    v1, v2 = randn(3, 4, seed=4), randn(4, 2, seed=5)
    xl, w1l, w2l, v1l, v2l = functp.shard((x, w1, w2, v1, v2), mesh, specs + specs[1:])

    def hvp(grad, x, vs):
        return torch.func.grad(lambda w1, w2: sum((a * v).sum() for a, v in
                                                   zip(grad(x, w1, w2), vs)), argnums=(0, 1))
    g = torch.func.grad(glob, argnums=(1, 2))
    gl = torch.func.grad(step, argnums=(1, 2))
    assert_tree_close(functp.unshard(gl(xl, w1l, w2l), mesh, specs[1:]), g(x, w1, w2),
                      "2-d bucket: grad")
    # the outer function sums each rank's local blocks: along dp they are copies, so
    # its gradient is the global hvp, counted once
    got = hvp(gl, xl, (v1l, v2l))(w1l, w2l)
    assert_tree_close(functp.unshard(got, mesh, specs[1:]), hvp(g, x, (v1, v2))(w1, w2),
                      "2-d bucket: grad of grad")


def _bucket_jvp_body():
    mesh, glob, step, x, ws, vs = _bucket_program()
    ref = torch.func.jvp(lambda *w: torch.func.grad(glob, argnums=(1, 2))(x, *w), ws, vs)
    xl = functp.shard(x, mesh, P("x"))
    got = torch.func.jvp(lambda *w: torch.func.grad(step, argnums=(1, 2))(xl, *w), ws, vs)
    assert_tree_close(got, ref, "bucket: jvp(grad)")


@pytest.mark.parametrize("body", [_vmap_around_body, _vmap_inside_body, _jvp_body, _vjp_body,
                                  _jacrev_body,
                                  _vmap_grad_body, _grad_vmap_body, _hessian_vector_body,
                                  _forward_over_reverse_body, _tape_double_backward_body,
                                  _bucket_body, _bucket_2d_body, _bucket_jvp_body],
                         ids=lambda b: b.__name__.strip("_").replace("_body", ""))
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "sum"])
def test_transform(run, body, check_vma):
    # forward-mode AD cannot be simulated (one forward-AD level per process)
    run(N, _in_mode, body, check_vma,
        gloo=body in (_jvp_body, _forward_over_reverse_body, _bucket_jvp_body))


def _in_mode(body, check_vma):
    _MODE[0] = check_vma
    body()
