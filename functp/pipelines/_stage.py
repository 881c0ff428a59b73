"""One stage's forward, backward and weight gradient on one microbatch, kept between
the schedule's actions: the closures a forward leaves for its backward.

Two ways to differentiate a stage, the same numbers:

- ``"tape"`` (the default): the forward runs on detached leaves under autograd and
  keeps its graph; the backward is ``torch.autograd.grad``. Zero-bubble's input
  gradient (B) and weight gradient (W) are two ``autograd.grad`` calls over the one
  graph (the first retains it): no forward runs twice. Cheapest at the top level.
- ``"func"``: ``torch.func.vjp`` closures. The whole backward is the forward's one
  closure; under zero-bubble B is the closure of a vjp over the input alone, and W
  a second vjp over the parameters, which reruns the stage's forward (a vjp computes
  the cotangents of all its primals at once, so one closure cannot leave the weight
  gradient for later).
"""
from __future__ import annotations

from typing import Any, Callable

import optree
import torch

__all__ = ["Saved", "forward", "backward", "weight_grad"]


def _diff(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


class Saved:
    """What one forward left for its backward: ``out`` (the stage's output, or the
    microbatch loss on the last stage), and the closures or graph to differentiate."""
    __slots__ = ("out", "x", "leaves", "vjp", "ct", "params")

    def __init__(self, out, x, leaves, vjp, params):
        self.out, self.x, self.leaves, self.vjp, self.params = out, x, leaves, vjp, params
        self.ct = None


def forward(call: Callable, params: Any, x: Any, mode: str, split: bool) -> Saved:
    """Runs ``call(params, x)`` keeping what its backward needs. ``split``: the input
    and weight gradients will be asked for separately (zero-bubble)."""
    need_x = _diff(x)
    if mode == "tape":
        leaves, spec = optree.tree_flatten(params)
        ps = [t.detach().requires_grad_() if _diff(t) else t for t in leaves]
        xi = x.detach().requires_grad_() if need_x else x
        with torch.enable_grad():
            out = call(optree.tree_unflatten(spec, ps), _inner(xi))
        return Saved(out, xi, ps, None, params)
    if split:
        if need_x:
            out, vjp = torch.func.vjp(lambda x_: call(params, _inner(x_)), x)
        else:      # the first stage: no input gradient, W takes the parameters' vjp
            out, vjp = torch.func.vjp(lambda p: call(p, x), params)
        return Saved(out, x, None, vjp, params)
    if need_x:
        out, vjp = torch.func.vjp(lambda p, x_: call(p, _inner(x_)), params, x)
    else:
        out, vjp = torch.func.vjp(lambda p: call(p, x), params)
    return Saved(out, x, None, vjp, params)


def _inner(x: torch.Tensor) -> torch.Tensor:
    """The input a stage computes on: a view of the leaf its gradient is taken for,
    so that a module hook on it (torch's ModTracker, which MemTracker uses:
    ``functp.estimate``) sees a non-leaf, which
    ``torch.autograd.grad`` lets it ask about ("A leaf node was passed to
    _will_engine_execute_node" otherwise)."""
    return x.view_as(x)


def backward(s: Saved, ct: torch.Tensor, mode: str, split: bool):
    """The backward of ``s`` for the output cotangent ``ct``: ``(input grad or None,
    parameter grads or None)``; under ``split`` the parameters' wait for
    :func:`weight_grad`."""
    need_x = _diff(s.x)
    if mode == "tape":
        diff = [p for p in s.leaves if _diff(p)]
        if split:
            s.ct = ct
            if not need_x:
                return None, None
            (gx,) = torch.autograd.grad(s.out, [s.x], ct, retain_graph=True)
            return gx, None
        got = torch.autograd.grad(s.out, ([s.x] if need_x else []) + diff, ct,
                                  allow_unused=True)
        gx, gp = (got[0], got[1:]) if need_x else (None, got)
        return gx, _tree(s, gp)
    if split:
        s.ct = ct
        return (s.vjp(ct)[0] if need_x else None), None
    got = s.vjp(ct)
    return (got[1], got[0]) if need_x else (None, got[0])


def weight_grad(s: Saved, call: Callable):
    """Zero-bubble's W: the parameters' gradient for the cotangent B was given."""
    if s.leaves is not None:           # tape: the graph B retained
        diff = [p for p in s.leaves if _diff(p)]
        return _tree(s, torch.autograd.grad(s.out, diff, s.ct, allow_unused=True))
    if not _diff(s.x):                 # func, first stage: the forward's own closure
        return s.vjp(s.ct)[0]
    _, vjp = torch.func.vjp(lambda p: call(p, s.x), s.params)
    return vjp(s.ct)[0]


def _tree(s: Saved, grads) -> Any:
    """Gradients of the differentiable leaves, as the parameters' tree (zeros for an
    unused one, None for a leaf that is not a float)."""
    it = iter(grads)
    out = []
    for p in s.leaves:
        if _diff(p):
            g = next(it)
            out.append(torch.zeros_like(p) if g is None else g)
        else:
            out.append(None)
    return optree.tree_unflatten(optree.tree_structure(s.params), out)
