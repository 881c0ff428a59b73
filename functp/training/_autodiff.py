"""``functp.grad`` / ``functp.value_and_grad``: JAX's transforms, as plain reverse mode
where nothing needs more.

``torch.func.grad`` differentiates with ``create_graph=True`` so that it can be nested
(grad of grad, vmap of grad): the backward is recorded and every saved activation
lives until the step ends (1.77x tape autograd's live memory on the benchmarks'
model, with no collective). A training step needs none of that. These transforms
take the same arguments as ``torch.func.grad_and_value`` and, called at the top (not
inside another ``torch.func`` transform, a ``shard_map`` body or a compiled region),
run ``torch.autograd.grad`` once without recording the backward: tape autograd's
memory and time. Nested, they are ``torch.func``'s, so composition is unchanged.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import optree
import torch

from ..runtime import _compile
from ..ops import _context
from ..runtime._errors import ShardingError
from ..runtime._torch_compat import layer_stack_depth as _depth

__all__ = ["grad", "value_and_grad"]

def _nested() -> bool:
    """Inside a torch.func transform, a shard_map body or a compiled region: the
    caller may differentiate or batch through us, so torch.func must run."""
    # (compiling first: torch 2.11/2.12's Dynamo cannot trace functorch's layer-depth
    # query, and traced, the answer is True whatever the depth)
    return _compile.tracing() or _depth() > 0 or _context.top() is not None


# Dynamo traces functorch's layer-depth query from torch 2.13 (0 at the top, 1 inside a
# torch.func.grad it traces); 2.11/2.12 cannot, so there a compiled call keeps the
# caller's leaves attached
_DEPTH_TRACED = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def _compiled_at_top() -> bool:
    """Dynamo traces this call outside any torch.func transform and shard_map body:
    nothing differentiates through its result (eager, the tape gives detached
    results), so the differentiated leaves may be detached first."""
    return (_DEPTH_TRACED and _compile.dynamo_tracing() and _depth() == 0
            and _context.top() is None)


def _detached(args: tuple, nums: tuple[int, ...]) -> tuple:
    # grad_and_value of leaves that require grad (nn.Parameters do) returns gradients
    # that require grad themselves: AOTAutograd then traces a joint graph whose
    # backward differentiates the backward (double backward: SDPA's CPU flash
    # attention has none), which nobody asked for
    return tuple(optree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, a)
                 if i in nums else a for i, a in enumerate(args))


def _argnums(argnums, n: int, name: str) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or not all(isinstance(i, int) and -n <= i < n for i in nums):
        raise ShardingError(f"functp.{name}: argnums={argnums!r} must name positional "
                            f"arguments of the {n} given")
    return tuple(i % n for i in nums)


def value_and_grad(fn: Callable, argnums: int | tuple[int, ...] = 0, *,
                   has_aux: bool = False) -> Callable:
    """``fn``'s value and its gradient with respect to the arguments ``argnums``
    (JAX's ``jax.value_and_grad``; ``torch.func.grad_and_value`` with the results in
    JAX's order).

    **Arguments:** ``fn`` – returns a scalar tensor (with ``has_aux``: ``(scalar,
    aux)``); ``argnums`` – an int or a tuple of ints: which positional arguments
    (pytrees of floating tensors) to differentiate.

    **Returns:** a function returning ``(value, grads)`` (``((value, aux), grads)``
    with ``has_aux``); ``grads`` has the structure of the argument (a tuple of them
    for a tuple ``argnums``); an input that does not reach the value gets zeros. At
    the top level it runs tape autograd once (no graph kept for higher derivatives:
    tape autograd's memory); nested in ``torch.func`` transforms, in a ``shard_map``
    body or under ``torch.compile`` it is ``torch.func.grad_and_value``. Example::

        step = functp.shard_map(loss, mesh, in_specs=(specs, P("dp")), out_specs=P())
        loss_value, grads = functp.value_and_grad(step)(params, batch)
    """
    if not callable(fn):
        raise ShardingError(f"functp.value_and_grad: fn must be a function, got {fn!r}")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        nums = _argnums(argnums, len(args), "value_and_grad")
        if _nested():
            if _compiled_at_top():
                args = _detached(args, nums)
            g, v = torch.func.grad_and_value(fn, argnums, has_aux=has_aux)(*args, **kwargs)
            return v, g
        return _tape(fn, nums, not isinstance(argnums, int), has_aux, args, kwargs)
    return wrapped


def grad(fn: Callable, argnums: int | tuple[int, ...] = 0, *, has_aux: bool = False) -> Callable:
    """The gradient of ``fn`` (JAX's ``jax.grad``): :func:`value_and_grad` without
    the value (with ``has_aux``: ``(grads, aux)``, as ``torch.func.grad``). Example::

        grads = functp.grad(step)(params, batch)
    """
    vg = value_and_grad(fn, argnums, has_aux=has_aux)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        v, g = vg(*args, **kwargs)
        return (g, v[1]) if has_aux else g
    return wrapped


def _tape(fn, nums: tuple[int, ...], as_tuple: bool, has_aux: bool, args, kwargs):
    args = list(args)
    trees, leaves_of = [], []
    for i in nums:
        leaves, tree = optree.tree_flatten(args[i])
        fresh = []
        for j, x in enumerate(leaves):
            if not isinstance(x, torch.Tensor) or not (x.is_floating_point() or x.is_complex()):
                raise ShardingError(
                    f"functp.value_and_grad: argument {i} has a leaf {j} of type "
                    f"{type(x).__name__}{'' if not isinstance(x, torch.Tensor) else ' ' + str(x.dtype)}"
                    f"; the arguments differentiated (argnums) must hold floating-point "
                    f"tensors only: pass the others as other arguments")
            fresh.append(x.detach().requires_grad_())
        args[i] = optree.tree_unflatten(tree, fresh)
        trees.append(tree)
        leaves_of.append(fresh)
    with torch.enable_grad():
        out = fn(*args, **kwargs)
    value, aux = (out if has_aux else (out, None))
    if has_aux and not (isinstance(out, tuple) and len(out) == 2):
        raise ShardingError("functp.value_and_grad(..., has_aux=True): fn must return "
                            "(scalar, aux)")
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ShardingError(
            f"functp.value_and_grad: fn must return a scalar tensor (the loss), got "
            f"{type(value).__name__}{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}")
    flat = [x for leaves in leaves_of for x in leaves]
    got = torch.autograd.grad(value, flat, allow_unused=True) if value.requires_grad \
        else [None] * len(flat)
    got = [g if g is not None else torch.zeros_like(x) for g, x in zip(got, flat)]
    grads, k = [], 0
    for tree, leaves in zip(trees, leaves_of):
        grads.append(optree.tree_unflatten(tree, got[k:k + len(leaves)]))
        k += len(leaves)
    g = tuple(grads) if as_tuple else grads[0]
    value = value.detach()
    return ((value, aux) if has_aux else value), g
