"""How a functp collective becomes a registered torch operator (``functp::<name>``):
``_define`` registers its raw kernel (``CompositeExplicitAutograd``), its fake kernel
(shapes only, for ``torch.compile``), its batching rule and an Autograd kernel that
applies the op's own backward and jvp; ``_ops.py`` (and ``_ragged.py``,
``_overlap.py``) hold the ops defined with it.

The Autograd kernel is what makes the ops cheap under ``torch.func``. A Python
``autograd.Function`` called under a transform goes through functorch's
``custom_function_call``, which builds a new class per call and flattens pytrees
(~2,000 Python calls per psum under ``torch.func.grad``). Here the op reaches the
Autograd kernel at the transform's own level, the kernel applies a fixed
single-level Function whose forward re-dispatches the op *below* autograd on the
still-wrapped tensors — as a native autograd kernel does — and functorch itself
unwraps, runs the lower levels (recording their graphs) and rewraps.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..runtime import _compile
from ..runtime._torch_compat import (BelowAutograd as _below_autograd, forward_ad as _fwd_ad,
                            is_fwd_grad_enabled, peek_interpreter_stack as _peek,
                            set_fwd_grad_enabled, set_grad_enabled,
                            set_single_level_allowed as _set_single_allowed,
                            single_level_allowed as _single_allowed,
                            SingleLevelFunction as _SingleLevelFunction)

__all__ = ["_define"]

_lib = torch.library.Library("functp", "DEF")


def _needs_autograd(args) -> bool:
    """Outside torch.func: does this call need the autograd Function? Every functp op
    takes its tensor (or its list of tensors) first."""
    if _fwd_ad._current_level >= 0:       # a forward-mode AD level outside torch.func
        return True
    if not torch.is_grad_enabled():
        return False
    x = args[0]
    if x.__class__ is list:
        return any([t.requires_grad for t in x])
    return x.requires_grad


def _autograd_rule(name: str, op, raw: Callable, listy: bool, returns_list: bool,
                   setup_context: Callable, backward: Callable, jvp: Callable) -> type:
    """The single-level ``autograd.Function`` that ``_define``'s Autograd kernel
    applies: its forward computes the op (or re-dispatches it below autograd at one
    torch.func level), the rest is the op's own rules, unflattened."""
    # Function.apply sees only top-level tensors: a Tensor[] first argument travels
    # flattened after the other arguments, as (interp, others, *tensors)
    def unflat(args):
        return (list(args[1:]), *args[0]) if listy else args

    def forward(interp, *args):
        args = unflat(args)
        if interp is None:                    # no torch.func level: compute it
            with _below_autograd():           # (funcol's own autograd is not wanted)
                out = raw(*args)
            return tuple(out) if returns_list else out
        # one level of torch.func: re-dispatch below autograd on the wrapped inputs;
        # functorch unwraps them, lets the lower levels record their own graphs, and
        # wraps the result for this level (grad on: Function.apply turned it off, and
        # the lower levels must see the user's grad mode, not ours)
        prev, prev_fwd = torch.is_grad_enabled(), is_fwd_grad_enabled()
        set_grad_enabled(True)
        set_fwd_grad_enabled(True)
        try:
            with _below_autograd():
                out = op(*args)
        finally:
            set_grad_enabled(prev)
            set_fwd_grad_enabled(prev_fwd)
        return tuple(out) if returns_list else out

    def rule_setup_context(ctx, inputs, output):
        setup_context(ctx, unflat(inputs[1:]), output)

    def rule_backward(ctx, *cts):
        grads = backward(ctx, *cts)
        return (None, None, *grads[0]) if listy else (None, *grads)

    def rule_jvp(ctx, *tangents):      # tangents of non-tensors are None
        return jvp(ctx, list(tangents[2:])) if listy else jvp(ctx, *tangents[1:])

    return type(name, (_SingleLevelFunction,), {
        "forward": staticmethod(forward),
        "setup_context": staticmethod(rule_setup_context),
        "backward": staticmethod(rule_backward),
        "jvp": staticmethod(rule_jvp),
        "__module__": __name__,
        "__qualname__": f"functp::{name}",
        "__doc__": raw.__doc__,
    })


def _define(schema: str, raw: Callable, fake: Callable, *, setup_context: Callable,
            backward: Callable, jvp: Callable, vmap: Callable):
    """Registers ``functp::<schema>`` and returns its OpOverload.

    ``raw(*args)`` computes the result; ``setup_context(ctx, args, output)``,
    ``backward(ctx, *cts)`` (one gradient per argument) and ``jvp(ctx, *tangents)``
    follow ``autograd.Function``'s new-style contract; ``vmap(info, in_dims, *args)``
    returns ``(output, out_dims)``. ``raw``'s docstring, which draws the op's forward
    and backward, becomes the op's.
    """
    name = schema.split("(", 1)[0]
    _lib.define(schema)
    op = getattr(torch.ops.functp, name).default
    listy = schema.split("(", 1)[1].startswith("Tensor[] ")    # takes a list of tensors
    returns_list = schema.rstrip().endswith("Tensor[]")

    rule = _autograd_rule(name, op, raw, listy, returns_list, setup_context, backward, jvp)

    def autograd_kernel(*args):
        interp = _peek()
        if interp is None and not _needs_autograd(args):
            with _below_autograd():
                return raw(*args)
        flat = (interp, args[1:], *args[0]) if listy else (interp, *args)
        if interp is None:     # functorch refuses a single-level Function only under it
            out = rule.apply(*flat)
        else:
            allowed = _single_allowed()
            _set_single_allowed(True)
            try:
                out = rule.apply(*flat)
            finally:
                _set_single_allowed(allowed)
        return list(out) if returns_list else out

    def fake_kernel(*args):
        _compile.check_fake()     # (refused inside functp.simulate)
        return fake(*args)

    _lib.impl(name, raw, "CompositeExplicitAutograd")   # (a Tensor[] op's raw returns a list)
    _lib.impl(name, autograd_kernel, "Autograd")
    torch.library.register_fake(f"functp::{name}", fake_kernel, lib=_lib)
    torch.library.register_vmap(f"functp::{name}", vmap, lib=_lib)
    # the forward's docstring draws the op (help(torch.ops.functp.psum))
    op.__doc__ = getattr(torch.ops.functp, name).__doc__ = raw.__doc__
    return op
