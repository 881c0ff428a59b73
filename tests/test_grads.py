"""Whole-tree gradient operations against the unsharded float64 program:
global_norm / clip_by_global_norm equal torch.nn.utils.clip_grad_norm_ on the full
gradients in every layout (inside a body and outside), and gradient accumulation with
shard_map(..., unreduced=) issues the gradient all-reduces of one batch and gives
the one-big-batch gradient."""
from __future__ import annotations

import math

import optree
import pytest
import torch

import functp
from functp import P
from _oracle import TOL, LivePeak, assert_tree_close, randn


def _full_grads():
    return {"emb": randn(10, 6, seed=1),       # uneven over 4 ranks
            "w1": randn(8, 6, seed=2), "w2": randn(6, 8, seed=3),
            "b": randn(8, seed=4), "scale": randn((), seed=5)}


def _layouts(mesh):
    """Spec trees of the canonical layouts on this mesh (names: its axes)."""
    a = mesh.axis_names
    if len(a) == 1:
        x = a[0]
        return {"dp": P(),
                "fsdp": {"emb": P(x), "w1": P(x), "w2": P(x), "b": P(x), "scale": P()},
                "tp": {"emb": P(None, x), "w1": P(x, None), "w2": P(None, x), "b": P(x),
                       "scale": P()}}
    dp, tp = a
    return {"2d": {"emb": P((dp, tp)), "w1": P(tp, dp), "w2": P(None, tp), "b": P(tp),
                   "scale": P()},
            "fsdp_tp": {"emb": P(dp, tp), "w1": P((tp, dp)), "w2": P(dp, tp), "b": P(),
                        "scale": P()}}


def _clip_reference(full, max_norm, p):
    grads = {k: v.clone().requires_grad_() for k, v in full.items()}
    for k, v in grads.items():
        v.grad = full[k].clone()
    norm = torch.nn.utils.clip_grad_norm_(list(grads.values()), max_norm, norm_type=p)
    return norm, {k: v.grad for k, v in grads.items()}


def _outside(shape, names):
    mesh = functp.make_mesh(shape, names)
    full = _full_grads()
    for name, specs in _layouts(mesh).items():
        local = functp.shard(full, mesh, specs)
        for p in (2.0, 1.0, math.inf):
            for max_norm in (0.5, 1e6):            # clipped, and left alone
                want_norm, want = _clip_reference(full, max_norm, p)
                got, norm = functp.clip_by_global_norm(local, max_norm, mesh, specs, norm_type=p)
                torch.testing.assert_close(norm, want_norm, **TOL, msg=f"{name} p={p}")
                assert_tree_close(functp.unshard(got, mesh, specs), want, f"{name} p={p}")


def _packed(world):
    """A packed gate_up weight: each rank's block is [its rows of gate; its rows of
    up], not a slice of cat([gate, up]); the global norm is still the full one's."""
    mesh = functp.make_mesh((world,), ("tp",))
    gate, up, other = randn(8, 4, seed=1), randn(8, 4, seed=2), randn(3, seed=3)
    r = mesh.coordinate["tp"]
    local = {"gate_up": torch.cat([gate.chunk(world)[r], up.chunk(world)[r]]), "b": other}
    specs = {"gate_up": P("tp", None), "b": P()}
    want_norm, want = _clip_reference({"gate_up": torch.cat([gate, up]), "b": other}, 0.5, 2.0)
    got, norm = functp.clip_by_global_norm(local, 0.5, mesh, specs)
    torch.testing.assert_close(norm, want_norm, **TOL)
    coef = want["b"] / other
    torch.testing.assert_close(got["gate_up"], local["gate_up"] * coef[0], **TOL)


@pytest.mark.parametrize("world", [2, 4])
def test_global_norm_of_a_packed_weight(run, world):
    run(world, _packed, world)


@pytest.mark.parametrize("world,shape,names", [(2, (2,), ("x",)), (4, (4,), ("x",)),
                                               (4, (2, 2), ("dp", "tp")),
                                               (8, (2, 4), ("dp", "tp"))],
                         ids=["2", "4", "2x2", "2x4"])
def test_global_norm_outside_a_body(run, world, shape, names):
    run(world, _outside, shape, names)


def _loss_global(p, x):
    h = torch.tanh(x @ p["w1"].T + p["b"])
    return ((h @ p["w2"].T) ** 2).sum() * p["scale"] + (p["emb"] ** 2).sum()


def _inside(shape, given_specs):
    """The gradient of a 2-D (or TP) program computed and clipped inside the body
    (vma tracking: a gradient taken inside a body is the full one only there; with
    check_vma=False it is each rank's contribution until the boundary sums it)."""
    mesh = functp.make_mesh(shape, ("dp", "tp"))
    specs = {"emb": P("tp"), "w1": P("tp", None), "w2": P(None, "tp"), "b": P("tp"),
             "scale": P()}
    full = {k: v for k, v in _full_grads().items()}
    full["emb"] = randn(8, 6, seed=1)
    x = randn(4, 6, seed=9)

    def local_loss(p, x):
        h = torch.tanh(x @ p["w1"].T + p["b"])
        y = functp.psum(h @ p["w2"].T, "tp")
        emb = functp.psum((p["emb"] ** 2).sum(), "tp")
        return functp.pmean((y ** 2).sum() * p["scale"] + emb, "dp")

    def body(p, x):
        g = torch.func.grad(local_loss)(p, x)
        kw = {"specs": specs} if given_specs else {}
        return functp.clip_by_global_norm(g, 0.5, **kw)

    step = functp.shard_map(body, mesh, in_specs=(specs, P("dp")), out_specs=(specs, P()))
    got, norm = step(functp.shard(full, mesh, specs), functp.shard(x, mesh, P("dp")))
    # the loss: the mean over the dp shards of x of each shard's loss
    full_g = torch.func.grad(lambda p: sum(_loss_global(p, xs) - (p["emb"] ** 2).sum()
                                           for xs in x.chunk(shape[0])) / shape[0]
                             + (p["emb"] ** 2).sum())(full)
    want_norm, want = _clip_reference(full_g, 0.5, 2.0)
    torch.testing.assert_close(norm, want_norm, **TOL)
    assert_tree_close(functp.unshard(got, mesh, specs), want, "clipped")


@pytest.mark.parametrize("given_specs", [False, True], ids=["vma", "specs"])
@pytest.mark.parametrize("world,shape", [(4, (2, 2)), (2, (1, 2))], ids=["2x2", "1x2"])
def test_clip_inside_a_body(run, world, shape, given_specs):
    run(world, _inside, shape, given_specs)


def _needs_specs():
    mesh = functp.make_mesh((2,), ("x",))
    with pytest.raises(functp.ShardingError, match="mesh= and specs="):
        functp.global_norm({"w": torch.ones(2)})
    f = functp.shard_map(lambda g: functp.global_norm(g), mesh, in_specs=P("x"),
                         out_specs=P(), check_vma=False)
    with pytest.raises(functp.ShardingError, match="pass specs="):
        f(torch.ones(2))


def test_global_norm_says_what_it_needs(run):
    run(2, _needs_specs)


# -- gradient accumulation: one reduction for k microbatches ---------------------------------

def _mlp_specs(two_d):
    if two_d:
        return {"w1": P("tp", None), "b1": P("tp"), "w2": P(None, "tp"), "g": P()}
    return P()


def _mlp_local(p, x, y, two_d):
    h = torch.tanh(x @ p["w1"].T + p["b1"]) @ p["w2"].T
    if two_d:
        h = functp.psum(h, "tp")
    h = h * p["g"]
    return functp.pmean(((h - y) ** 2).mean(), "dp")


def _accumulate(shape, k, how, check_vma):
    two_d = len(shape) == 2
    mesh = functp.make_mesh(shape, ("dp", "tp") if two_d else ("dp",))
    specs = _mlp_specs(two_d)
    params = {"w1": randn(8, 6, seed=1), "b1": randn(8, seed=2), "w2": randn(5, 8, seed=3),
              "g": randn(5, seed=4)}
    n = mesh.shape["dp"]
    x, y = randn(k * n * 2, 6, seed=5), randn(k * n * 2, 5, seed=6)
    local = functp.shard(params, mesh, specs)
    loss = lambda p, x, y: _mlp_local(p, x, y, two_d)   # noqa: E731
    one = functp.shard_map(loss, mesh, in_specs=(specs, P("dp"), P("dp")), out_specs=P(),
                           check_vma=check_vma)
    acc = functp.shard_map(loss, mesh, in_specs=(specs, P("dp"), P("dp")), out_specs=P(),
                           check_vma=check_vma, unreduced="dp")

    def grad(step, p, xb, yb):
        if how == "grad":
            return torch.func.grad(step)(p, xb, yb)
        p = {k2: v.detach().clone().requires_grad_() for k2, v in p.items()}
        g = torch.autograd.grad(step(p, xb, yb), list(p.values()))
        return dict(zip(p, g))

    # the microbatches: k slices of every rank's rows; the big batch: all of them
    xl, yl = functp.shard(x, mesh, P("dp")), functp.shard(y, mesh, P("dp"))
    with functp.comm_log() as big_log:
        big = grad(one, local, xl, yl)
    with functp.comm_log() as acc_log:
        total = None
        for xb, yb in zip(xl.chunk(k), yl.chunk(k)):
            g = grad(acc, local, xb, yb)
            total = g if total is None else optree.tree_map(torch.add, total, g)
        total = optree.tree_map(lambda t: t / k, total)     # the mean over microbatches
        total = functp.reduce_unreduced(total, mesh, specs, "dp")
    assert_tree_close(total, big, "accumulated grad")
    full = torch.func.grad(lambda p: sum(
        ((((torch.tanh(xs @ p["w1"].T + p["b1"]) @ p["w2"].T) * p["g"] - ys) ** 2).mean())
        for xs, ys in zip(x.chunk(n), y.chunk(n))) / n)(params)
    assert_tree_close(functp.unshard(total, mesh, specs), full, "against the oracle")

    # the gradient reductions: the collectives over dp that move more than the
    # loss's one scalar (its pmean, and the pmean's transpose under sum rules, run
    # once per microbatch)
    # ((count, bytes) of them; a 2-D step may reduce a fully replicated leaf over
    # (dp, tp) at once where reduce_unreduced buckets it with the others over dp)
    def grads_over_dp(log):
        ev = [e for e in log.events if "dp" in e.axes and e.nbytes > 8]
        return len(ev), sum(e.nbytes for e in ev)
    return grads_over_dp(acc_log), grads_over_dp(big_log)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "sum"])
@pytest.mark.parametrize("how", ["grad", "tape"])
@pytest.mark.parametrize("world,shape", [(2, (2,)), (4, (2, 2)), (8, (4, 2))],
                         ids=["dp2", "2x2", "4x2"])
def test_accumulation_reduces_once(run, world, shape, how, check_vma):
    for (n_acc, b_acc), (n_big, b_big) in run(world, _accumulate, shape, 3, how, check_vma):
        # k microbatches: no more gradient all-reduces over dp than one batch, the
        # same bytes
        assert 1 <= n_acc <= n_big and b_acc == b_big, ((n_acc, b_acc), (n_big, b_big))


def _bad_unreduced():
    mesh = functp.make_mesh((2,), ("x",))
    with pytest.raises(functp.ShardingError, match="unreduced"):
        functp.shard_map(lambda x: x, mesh, in_specs=P(), out_specs=P(), unreduced="dp")
    return functp.process_count()


def test_unreduced_names_body_axes(run):
    assert run(2, _bad_unreduced) == [2, 2]


# -- mixed precision: compute in one dtype, reduce gradients in another ---------------------

def _mixed(shape, param_dtype, reduce_dtype, how, check_vma):
    two_d = len(shape) == 2
    mesh = functp.make_mesh(shape, ("dp", "tp") if two_d else ("dp",))
    specs = _mlp_specs(two_d)
    master = {k: v.float() for k, v in {"w1": randn(8, 6, seed=1), "b1": randn(8, seed=2),
                                        "w2": randn(5, 8, seed=3), "g": randn(5, seed=4)}.items()}
    n = mesh.shape["dp"]
    x, y = randn(n * 4, 6, seed=5).float(), randn(n * 4, 5, seed=6).float()
    policy = functp.MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    loss = lambda p, x, y: _mlp_local(p, x, y, two_d)   # noqa: E731
    step = functp.shard_map(loss, mesh, in_specs=(specs, P("dp"), P("dp")), out_specs=P(),
                            check_vma=check_vma, mixed_precision=policy)
    local = functp.shard(master, mesh, specs)
    xl, yl = functp.shard(x, mesh, P("dp")), functp.shard(y, mesh, P("dp"))
    with functp.comm_log() as log:
        if how == "grad":
            g = torch.func.grad(step)(local, xl, yl)
        else:
            p = {k: v.detach().clone().requires_grad_() for k, v in local.items()}
            g = dict(zip(p, torch.autograd.grad(step(p, xl, yl), list(p.values()))))
    assert all(v.dtype == torch.float32 for v in g.values()), "gradients in the masters' dtype"

    # the unsharded program in the same precisions: bf16 compute from fp32 masters
    def ref(p):
        c = {k: v.to(param_dtype) for k, v in p.items()}
        xs, ys = x.to(param_dtype), y.to(param_dtype)
        return sum((((torch.tanh(a @ c["w1"].T + c["b1"]) @ c["w2"].T) * c["g"] - b) ** 2).mean()
                   for a, b in zip(xs.chunk(n), ys.chunk(n))) / n
    want = torch.func.grad(ref)(master)
    got = functp.unshard(g, mesh, specs)
    tol = dict(rtol=3e-2, atol=3e-2) if param_dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **tol, msg=k)
    # the gradient all-reduces over dp move reduce_dtype's bytes
    sizes = {e.nbytes for e in log.events if "dp" in e.axes and e.nbytes > 8}
    return sorted(sizes)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "sum"])
@pytest.mark.parametrize("how", ["grad", "tape"])
@pytest.mark.parametrize("world,shape", [(2, (2,)), (4, (2, 2))], ids=["dp2", "2x2"])
def test_mixed_precision_reduces_in_reduce_dtype(run, world, shape, how, check_vma):
    bf16, f32 = torch.bfloat16, torch.float32
    fp32_red = run(world, _mixed, shape, bf16, f32, how, check_vma)[0]
    bf16_red = run(world, _mixed, shape, bf16, None, how, check_vma)[0]
    # the same gradient reductions, at twice the bytes in float32
    assert fp32_red and [2 * b for b in bf16_red] == fp32_red, (fp32_red, bf16_red)
    assert run(world, _mixed, shape, torch.float32, torch.float64, how, check_vma)


# ---------------------------------------------------------------------------------
# Memory of the gradient bucket: a tape step reduces the replicated parameters'
# gradients in one all-reduce *in place* (as DDP does); out of place, the backward's
# peak would hold a second bucket. Counted in bytes of live tensor storage (a
# dispatch mode sees every op): deterministic, unlike resident memory.

def _bucket_memory_body():
    mesh = functp.make_mesh((2,), ("dp",))
    params = {f"w{i}": randn(256, 256, seed=i).requires_grad_() for i in range(4)}
    x = functp.shard(randn(8, 256, seed=9), mesh, P("dp"))
    loss = lambda p, x: functp.pmean(sum((x @ w).square().mean() for w in p.values()), "dp")
    step = functp.shard_map(loss, mesh, in_specs=(P(), P("dp")), out_specs=P())
    with LivePeak() as functp_step:
        grads = torch.autograd.grad(step(params, x), list(params.values()))
    del grads
    with LivePeak() as floor:     # the same backward, then the gradients copied to a bucket
        grads = torch.autograd.grad(loss_local(params, x), list(params.values()))
        torch.cat([g.reshape(-1) for g in grads])
    bucket = 4 * 256 * 256 * 8
    assert functp_step.peak <= floor.peak + bucket // 8, (functp_step.peak, floor.peak, bucket)
    # the same under torch.func.grad (the bucket op owns its buffer there too)
    plain = {k: v.detach() for k, v in params.items()}
    with LivePeak() as functp_step:
        grads = torch.func.grad(step)(plain, x)
    del grads
    with LivePeak() as floor:
        grads = torch.func.grad(loss_local)(plain, x)
        torch.cat([g.reshape(-1) for g in grads.values()])
    assert functp_step.peak <= floor.peak + bucket // 8, (functp_step.peak, floor.peak, bucket)


def loss_local(p, x):
    return sum((x @ w).square().mean() for w in p.values())


def test_tape_gradient_bucket_is_reduced_in_place(run):
    run(2, _bucket_memory_body)
