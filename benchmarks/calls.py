"""Python calls per collective and per training step, counted with cProfile.

    python benchmarks/calls.py            # launches 2 local gloo processes

Counts are stable on a noisy machine, times are not: this is the host-overhead
measurement the fast core is judged by. Rank 0 prints, and writes
benchmarks/results/calls.json:

- per psum: the calls one more psum adds to a step, under ``torch.func.grad`` and
  through tape autograd, against a hand-written Megatron ``autograd.Function``
  around ``torch.distributed.all_reduce`` (tape autograd);
- per step: the 2-layer tensor-parallel MLP of ``_models.py`` (small size) under
  ``torch.func.grad`` and tape autograd, against the same model without collectives
  (one process, the unsharded parameters) and the hand-written Megatron step;
- per parallelized step (with transformers installed): the host-bound Llama of
  ``gpu_step.py`` (8 layers, hidden 64, 8 tokens) through ``parallelize(model, mesh,
  "auto")`` over tp=2, tape and ``torch.func.grad``, with and without vma tracking,
  against the plain module's tape step (one process, full parameters).
"""
from __future__ import annotations

import cProfile
import os
import pstats
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import functp  # noqa: E402
from functp import P  # noqa: E402
import _models as M  # noqa: E402
from _run import main_or_launch, save_and_leave  # noqa: E402

REPS = 20


def count(fn, reps: int = REPS) -> float:
    """Python calls (functions and builtins) per call of ``fn``, after a warm-up."""
    for _ in range(3):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    return pstats.Stats(prof).total_calls / reps


class _MegatronAllReduce(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward, identity backward (hand-written)."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class _MegatronIdentity(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce backward (hand-written)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


def per_psum(mesh, k: int = 8) -> dict[str, float]:
    """Calls that one more psum adds: (a step with k + 1 psums of the same value -
    one with 1) / k."""
    x = torch.randn(16)

    def body(n):
        def f(x):
            return sum(functp.psum(x, "tp") for _ in range(n)).sum()
        return functp.shard_map(f, mesh, in_specs=P("tp"), out_specs=P())

    def hand(n):
        def step():
            xl = x.clone().requires_grad_()
            sum(_MegatronAllReduce.apply(xl) for _ in range(n)).sum().backward()
        return step

    def tape(fn):
        def step():
            xl = x.clone().requires_grad_()
            fn(xl).backward()
        return step

    out = {}
    for name, make in (("functp torch.func.grad", lambda n: (lambda f=body(n): torch.func.grad(f)(x))),
                       ("functp tape", lambda n: tape(body(n))),
                       ("hand-written Function, tape", hand)):
        out[name] = (count(make(k + 1)) - count(make(1))) / k
    return out


def per_step(mesh) -> dict[str, float]:
    """Calls per training step of the TP MLP (with and without vma tracking), and of the
    same model unsharded."""
    hidden, ffn = M.SIZES["small"]
    params = M.init_params(hidden, ffn)
    x, y = M.init_data(hidden)
    specs = {}
    for name in params:
        kind = name.split(".", 2)[2]
        specs[name] = {"fc1.weight": P("tp", None), "fc1.bias": P("tp"),
                       "fc2.weight": P(None, "tp")}.get(kind, P())
    local = functp.shard(params, mesh, specs)
    psum = lambda h: functp.psum(h, "tp")
    loss = lambda p, x, y: M.mse(M.forward(p, x, post=psum), y)
    step = functp.shard_map(loss, mesh, in_specs=(specs, P(), P()), out_specs=P())
    step_novma = functp.shard_map(loss, mesh, in_specs=(specs, P(), P()), out_specs=P(),
                                  check_vma=False)

    def tape_step():
        p = {k: v.detach().requires_grad_() for k, v in local.items()}
        torch.autograd.grad(step(p, x, y), list(p.values()))

    def f(t):     # Megatron's f on the activations entering fc1
        return _MegatronIdentity.apply(t)

    def hand_step():
        p = {k: v.detach().requires_grad_() for k, v in local.items()}
        loss = M.mse(M.forward(p, x, pre=f, post=_MegatronAllReduce.apply), y)
        torch.autograd.grad(loss, list(p.values()))

    def unsharded_tape():
        p = {k: v.detach().requires_grad_() for k, v in params.items()}
        torch.autograd.grad(M.global_loss(p, x, y), list(p.values()))

    return {
        "functp torch.func.grad": count(lambda: torch.func.grad(step)(local, x, y)),
        "functp torch.func.grad, check_vma=False":
            count(lambda: torch.func.grad(step_novma)(local, x, y)),
        "functp tape": count(tape_step),
        "hand-written Megatron, tape": count(hand_step),
        "no collectives (unsharded), torch.func.grad":
            count(lambda: torch.func.grad(M.global_loss)(params, x, y)),
        "no collectives (unsharded), tape": count(unsharded_tape),
    }


def per_parallelized_step(mesh) -> dict[str, float]:
    """Calls per step of a transformers Llama under ``parallelize(..., "auto")``: what
    functp's plan costs on top of the module (hooks, parameter swap, boundary)."""
    try:
        import gpu_step
    except ImportError:       # (no transformers: the row is left out)
        return {}
    model, ids = gpu_step.build(gpu_step.CONFIGS["host-bound h64 L8 1x8"], "cpu",
                                torch.float32)
    plain = [p for p in model.parameters()]
    out = {"plain module, tape": count(lambda: torch.autograd.grad(
        gpu_step.lm_loss(model(ids, use_cache=False).logits, ids), plain), 5)}
    apply, params, specs = functp.parallelize(model, mesh, "auto")
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    for check_vma in (True, False):
        step = functp.shard_map(
            lambda p, i: gpu_step.lm_loss(apply(p, i, use_cache=False).logits, i), mesh,
            in_specs=(specs, P()), out_specs=P(), check_vma=check_vma)
        tag = "" if check_vma else ", check_vma=False"
        out[f"functp tape{tag}"] = count(
            lambda: torch.autograd.grad(step(leaves, ids), list(leaves.values())), 5)
        out[f"functp torch.func.grad{tag}"] = count(
            lambda: torch.func.grad(step)(params, ids), 5)
    return out


def main() -> None:
    torch.set_num_threads(1)
    mesh = functp.make_mesh((dist.get_world_size() if dist.is_initialized() else 2,), ("tp",))
    res = {"torch": torch.__version__, "ranks": mesh.size, "per_psum": per_psum(mesh),
           "per_step": per_step(mesh), "per_parallelized_step": per_parallelized_step(mesh)}
    if dist.get_rank() == 0:
        pp, ps = res["per_psum"], res["per_step"]
        hand = pp["hand-written Function, tape"]
        print(f"Python calls per psum (torch {torch.__version__}, {mesh.size} gloo ranks)")
        for k, v in pp.items():
            print(f"  {k:45s} {v:8.1f}   {v / hand:5.2f}x hand-written")
        base = ps["no collectives (unsharded), torch.func.grad"]
        print("Python calls per TP MLP step (2 layers, small)")
        for k, v in ps.items():
            print(f"  {k:45s} {v:8.1f}   {v / base:5.2f}x unsharded torch.func.grad")
        pp = res["per_parallelized_step"]
        if pp:
            print("Python calls per step of parallelize(Llama, 'auto') over tp=2 "
                  "(8 layers, hidden 64, 8 tokens)")
            for k, v in pp.items():
                print(f"  {k:45s} {v:8.1f}   {v / pp['plain module, tape']:5.2f}x "
                      f"the plain module's tape step")
    save_and_leave("calls", res)


if __name__ == "__main__":
    main_or_launch(main, 2, __file__)
