"""functp.checkpoint (remat) inside a shard_map body and around one: gradients equal
the unsharded float64 program under torch.func.grad and tape autograd, with vma and
sum rules, on 1-d and 2-d meshes; the recompute's extra collectives are counted; a
policy keeps what it names."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import functp
from functp import P
from _oracle import check_program, randn

LAYERS = 2


def _params():
    return {f"l{i}": {"w1": randn(8, 6, seed=10 * i + 1), "w2": randn(6, 8, seed=10 * i + 2)}
            for i in range(LAYERS)}


def _block_global(p, h):
    return h + torch.tanh(h @ p["w1"].T) @ p["w2"].T


def _global(params, x):
    h = x
    for i in range(LAYERS):
        h = _block_global(params[f"l{i}"], h)
    return (h ** 2).mean()


def _specs(tp: str):
    return {f"l{i}": {"w1": P(tp, None), "w2": P(None, tp)} for i in range(LAYERS)}


def _local(policy, dp):
    """Megatron TP blocks, each rematerialized; the loss averaged over dp."""
    def block(p, h):
        a = functp.checkpoint_name(torch.tanh(h @ p["w1"].T), "act")
        return h + functp.psum(a @ p["w2"].T, "tp")

    block = functp.checkpoint(block, policy=policy) if policy != "none" else block

    def loss(params, x):
        h = x
        for i in range(LAYERS):
            h = block(params[f"l{i}"], h)
        m = (h ** 2).mean()
        return functp.pmean(m, dp) if dp else m
    return loss


_POLICIES = {"none": "none", "nothing": None,
             "dots": functp.remat_policies.dots_saveable,
             "names": functp.remat_policies.save_only_these_names("act")}


def _inside(shape, policy, check_vma):
    two_d = len(shape) == 2
    mesh = functp.make_mesh(shape, ("dp", "tp") if two_d else ("tp",))
    x = randn(4 * (shape[0] if two_d else 1), 6, seed=7)
    xspec = P("dp") if two_d else P()
    glob = _global if not two_d else (
        lambda p, x: sum(_global(p, xs) for xs in x.chunk(shape[0])) / shape[0])
    log = check_program(mesh, glob, _local(_POLICIES[policy], "dp" if two_d else None),
                        (_params(), x), (_specs("tp"), xspec), check_vma=check_vma,
                        argnums=(0,))
    return log.count("all_reduce", ("tp",))


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "sum"])
@pytest.mark.parametrize("policy", list(_POLICIES))
@pytest.mark.parametrize("world,shape", [(2, (2,)), (4, (2, 2)), (8, (2, 4))],
                         ids=["tp2", "2x2", "2x4"])
def test_remat_inside_a_body(run, world, shape, policy, check_vma):
    counts = run(world, _inside, shape, policy, check_vma)
    base = run(world, _inside, shape, "none", check_vma)
    # the recompute runs each block's forward psum again
    extra = 0 if policy == "none" else LAYERS
    assert counts == [b + extra for b in base], (counts, base)


def _around(world, inner):
    mesh = functp.make_mesh((world,), ("tp",))
    step = functp.shard_map(_local(inner, None), mesh, in_specs=(_specs("tp"), P()),
                            out_specs=P())
    # the whole shard_map'd function; checkpointed blocks inside it then run plainly
    outer = functp.checkpoint(step)
    x = randn(4, 6, seed=7)
    local = functp.shard(_params(), mesh, _specs("tp"))
    ref = torch.func.grad(_global)(_params(), x)
    for g in (torch.func.grad(outer)(local, x),
              torch.func.grad(lambda p: outer(p, x))(local)):
        full = functp.unshard(g, mesh, _specs("tp"))
        for k in ref:
            for n in ref[k]:
                torch.testing.assert_close(full[k][n], ref[k][n], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("inner", ["none", None], ids=["plain", "nested"])
@pytest.mark.parametrize("world", [2, 4])
def test_remat_around_a_shard_map(run, world, inner):
    run(world, _around, world, inner)


class _CountMM(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.n += 1
        return func(*args, **(kwargs or {}))


def test_dots_policy_skips_matmuls_in_the_recompute():
    w, x = randn(5, 4, seed=1), randn(3, 4, seed=2)

    def blk(w, x):
        return torch.tanh(torch.tanh(x @ w.T) @ w)

    counts, grads = {}, {}
    for name, pol in (("nothing", None), ("dots", functp.remat_policies.dots_saveable)):
        f = functp.checkpoint(blk, policy=pol)
        with _CountMM() as c:
            grads[name] = torch.func.grad(lambda w: f(w, x).sum())(w)
        counts[name] = c.n
    ref = torch.func.grad(lambda w: blk(w, x).sum())(w)
    assert all(torch.allclose(g, ref, rtol=1e-12, atol=1e-12) for g in grads.values())
    # forward 2, backward 3 (x needs no gradient), and the recompute's 2 unless kept
    assert counts == {"nothing": 7, "dots": 5}, counts


def test_transforms_of_a_checkpointed_function():
    w, x = randn(5, 4, seed=1), randn(3, 4, seed=2)

    def blk(w, x):
        return torch.sin(x @ w.T) @ w

    c = functp.checkpoint(blk)

    def loss(f):
        return lambda w, x: (f(w, f(w, x)) ** 2).sum()
    tol = dict(rtol=1e-10, atol=1e-10)
    ref = torch.func.grad(loss(blk))(w, x)
    torch.testing.assert_close(torch.func.grad(loss(c))(w, x), ref, **tol)
    wt = w.clone().requires_grad_()
    loss(c)(wt, x).backward()
    torch.testing.assert_close(wt.grad, ref, **tol)
    hvp = lambda f: torch.func.grad(lambda w: (torch.func.grad(loss(f))(w, x) ** 2).sum())(w)  # noqa: E731
    torch.testing.assert_close(hvp(c), hvp(blk), **tol)
    xs = torch.stack([x, 2 * x])
    vm = lambda f: torch.func.vmap(lambda xx: torch.func.grad(loss(f))(w, xx))(xs)  # noqa: E731
    torch.testing.assert_close(vm(c), vm(blk), **tol)
    # dropout masks repeat in the recompute
    torch.manual_seed(0)
    d = functp.checkpoint(lambda w, x: torch.nn.functional.dropout(x @ w.T, 0.5) @ w)
    g = torch.func.grad(lambda w: d(w, x).sum())(w)
    torch.manual_seed(0)
    g2 = torch.func.grad(lambda w: (torch.nn.functional.dropout(x @ w.T, 0.5) @ w).sum())(w)
    torch.testing.assert_close(g, g2, **tol)
