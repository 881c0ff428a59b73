"""Helpers that test bodies run on every rank: seeded data and the float64 oracle."""
from __future__ import annotations

import contextlib
import threading

import optree
import torch

import functp
from functp import P

TOL = dict(rtol=1e-10, atol=1e-10)

# check_program appends its raw results here while a body records them (one list per
# thread: simulated ranks are threads), so that a test can compare two runs bit for bit
_recorded = threading.local()


@contextlib.contextmanager
def recording():
    """Collects ``[loss, grads, tape loss, tape grads]`` of every ``check_program``."""
    _recorded.out = out = []
    try:
        yield out
    finally:
        _recorded.out = None


def randn(*shape, seed: int = 0) -> torch.Tensor:
    """The same float64 tensor on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def assert_tree_close(actual, expected, what: str = "value", tol: dict = TOL) -> None:
    a_paths, a, _ = optree.tree_flatten_with_path(actual)
    e_paths, e, _ = optree.tree_flatten_with_path(expected)
    assert a_paths == e_paths, f"{what}: structures differ: {a_paths} vs {e_paths}"
    for p, x, y in zip(a_paths, a, e):
        torch.testing.assert_close(x, y, **tol, msg=lambda m: f"rank {functp.process_index()} {what}{list(p)}: {m}")


def check_program(mesh, global_fn, local_fn, args, in_specs, *, check_vma=True, argnums=None):
    """Loss and gradients of a shard_map'd scalar program equal the unsharded oracle.

    ``global_fn(*full_args)`` is the single-device program, ``local_fn`` the per-shard
    one returning a replicated scalar. Checks ``torch.func.grad`` and tape autograd,
    differentiating the arguments ``argnums`` (default: all). Returns the comm_log of
    the ``torch.func`` step.
    """
    argnums = tuple(range(len(args))) if argnums is None else argnums
    full_specs = in_specs if type(in_specs) is tuple else (in_specs,) * len(args)
    grad_specs = tuple(full_specs[i] for i in argnums)
    ref_grads, ref_loss = torch.func.grad_and_value(global_fn, argnums=argnums)(*args)
    local = functp.shard(args, mesh, in_specs)
    step = functp.shard_map(local_fn, mesh, in_specs=in_specs, out_specs=P(), check_vma=check_vma)

    with functp.comm_log() as log:
        grads, loss = torch.func.grad_and_value(step, argnums=argnums)(*local)
    assert_tree_close(loss, ref_loss, "loss (torch.func)")
    assert_tree_close(functp.unshard(grads, mesh, grad_specs), ref_grads, "grad (torch.func)")

    local = [optree.tree_map(lambda x: x.detach().clone().requires_grad_(i in argnums), a)
             for i, a in enumerate(local)]
    loss2 = step(*local)
    leaves, spec = optree.tree_flatten(tuple(local[i] for i in argnums))
    tape = torch.autograd.grad(loss2, leaves)
    if getattr(_recorded, "out", None) is not None:
        _recorded.out.append([loss, grads, loss2.detach(), list(tape)])
    assert_tree_close(loss2.detach(), ref_loss, "loss (autograd)")
    assert_tree_close(functp.unshard(optree.tree_unflatten(spec, list(tape)), mesh, grad_specs),
                      ref_grads, "grad (autograd)")
    return log


def grads_and_loss(step, params: dict, *args, tape: bool):
    """``step(params, *args)``'s gradients with respect to ``params`` (a dict) and its
    loss: through tape autograd (``tape``) or ``torch.func.grad_and_value``."""
    if not tape:
        return torch.func.grad_and_value(step)(params, *args)
    p = {k: v.detach().requires_grad_() for k, v in params.items()}
    loss = step(p, *args)
    loss.backward()
    return {k: v.grad for k, v in p.items()}, loss


def comm_stats(log) -> dict[str, tuple[int, int]]:
    """``{"all_reduce:dp": (count, nbytes)}`` for a comm_log."""
    out: dict[str, tuple[int, int]] = {}
    for e in log.events:
        k = f"{e.op}:{'+'.join(e.axes)}"
        c, b = out.get(k, (0, 0))
        out[k] = (c + 1, b + e.nbytes)
    return out


class LivePeak(torch.utils._python_dispatch.TorchDispatchMode):
    """Within it, ``peak``: the most bytes of tensor storage alive at once among the
    storages the ops made (views and in-place results count as their input's)."""

    def __init__(self):
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef
        self.weak, self.live, self.peak = StorageWeakRef, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # (a view's or an in-place op's storage is its input's: made before, if unseen)
        given = {t.untyped_storage().data_ptr()
                 for t in optree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in optree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st.data_ptr() not in self.live and st.data_ptr() not in given:
                    self.live[st.data_ptr()] = (self.weak(st), st.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def error_text(fn) -> str:
    """The message of the ShardingError ``fn()`` raises, or ``"ran"`` if it raises none
    (a rank's body returns it, so the test compares every rank's)."""
    try:
        fn()
    except functp.ShardingError as e:
        return str(e)
    return "ran"
