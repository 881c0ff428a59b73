"""A tape-autograd step with functp collectives compiles with fullgraph=True (no graph
breaks) and gives the eager numbers. (torch.compile of torch.func.grad with a
collective inside is not supported by torch 2.13; see docs.)"""
from __future__ import annotations

import torch

import functp
from functp import P
from _oracle import assert_tree_close, randn

SPECS = {"w1": P("tp", None), "b1": P("tp"), "w2": P(None, "tp"), "b2": P()}


def _loss(p, x, y):
    h = torch.tanh(x @ p["w1"].T + p["b1"])
    h = functp.all_gather(h, "tp", axis=1, tiled=True)        # exercise a dim argument
    h = functp.psum_scatter(h, "tp", scatter_dimension=1, tiled=True)
    out = functp.psum(h @ p["w2"].T, "tp") + p["b2"]
    return ((out - y) ** 2).mean()


def _compile_body():
    import torch._dynamo
    mesh = functp.make_mesh((2,), ("tp",))
    params = {"w1": randn(8, 4, seed=1), "b1": randn(8, seed=2), "w2": randn(4, 8, seed=3),
              "b2": randn(4, seed=4)}
    local = {k: v.requires_grad_() for k, v in functp.shard(params, mesh, SPECS).items()}
    x, y = randn(3, 4, seed=5), randn(3, 4, seed=6)
    step = functp.shard_map(_loss, mesh, in_specs=(SPECS, P(), P()), out_specs=P())

    def train_step(p, x, y):
        loss = step(p, x, y)
        return loss.detach(), torch.autograd.grad(loss, list(p.values()))

    eager = train_step(local, x, y)
    torch._dynamo.reset()
    # 1. the forward compiled as one graph; AOTAutograd compiles its backward
    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(local, x, y)
    got = (loss.detach(), torch.autograd.grad(loss, list(local.values())))
    assert_tree_close(got, eager, "compiled forward, tape backward")
    # 2. the whole step, torch.autograd.grad included
    torch._dynamo.reset()
    old = torch._dynamo.config.trace_autograd_ops
    torch._dynamo.config.trace_autograd_ops = True
    try:
        got = torch.compile(train_step, fullgraph=True, backend="aot_eager")(local, x, y)
    finally:
        torch._dynamo.config.trace_autograd_ops = old
    assert_tree_close(got, eager, "compiled train step")


def test_tape_autograd_step_compiles_fullgraph(run):
    run(2, _compile_body, timeout=600)
