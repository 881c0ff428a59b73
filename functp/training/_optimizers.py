"""Functional optimizers over parameter pytrees: ``functp.adamw`` and ``functp.sgd``.

optax's shape, torch.optim's arithmetic: ``state = opt.init(params)``, then
``params, state = opt.update(params, grads, state)``, two pure functions over trees
of local blocks. An elementwise update of a rank's blocks is the update of the full
tensors, so nothing here communicates; what makes them worth having beside
torch.optim is that ``torch.compile`` traces them: torch.optim's ``step`` breaks the
graph on purpose (its ``_use_grad`` wrapper), so a compiled step with it is two graphs
and a host round trip between them, where one with these is one graph.

Three choices make that graph replayable as one CUDA graph:

- the step count is a 0-d tensor in the state, not a Python int: the bias
  corrections and a learning-rate schedule are computed from it on the device, so no
  step recompiles and none reads the host (torch.optim's non-capturable steps call
  ``.item()`` on it);
- the update uses ``torch._foreach_*`` ops, one call per list of blocks of a dtype;
- ``donate=True`` writes the new parameters and state into the caller's tensors
  (a graph input updated in place keeps its address), where the default returns new
  ones and leaves the arguments alone.

The state is a dict of trees shaped like ``params`` (``exp_avg`` ...) and the count
``step``; :meth:`Optimizer.specs` lays it out by the parameters' specs, for
:func:`save` / :func:`load` on any mesh.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import optree
import torch

from ..runtime import _torch_compat as tc
from ..runtime._errors import ShardingError, keystr, leaf_text
from ..mesh._spec import P

__all__ = ["adamw", "sgd", "Optimizer"]

Rate = "float | torch.Tensor | Callable[[torch.Tensor], float | torch.Tensor]"


class Optimizer:
    """An optimizer as two pure functions over trees of local blocks (optax's
    ``GradientTransformation`` with the parameters applied): :meth:`init`,
    :meth:`update`, and :meth:`specs` for its state's layout. Made by :func:`adamw`
    and :func:`sgd`."""

    def __init__(self, name: str, moments: tuple[str, ...], step: Callable, lr: Any,
                 hyper: dict):
        self.name, self.moments, self._step, self.lr, self.hyper = name, moments, step, lr, hyper

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyper.items())
        return f"functp.{self.name}(lr={self.lr!r}, {args})"

    def init(self, params: Any) -> dict:
        """The state before the first update: ``{"step": 0-d int64 tensor, name: tree
        of zeros like params}`` for each moment (AdamW: ``exp_avg``, ``exp_avg_sq``,
        with amsgrad ``max_exp_avg_sq``; SGD with momentum: ``momentum_buffer``).

        **Arguments:** ``params`` – a pytree of floating-point tensors (local blocks).

        **Returns:** the state dict, its tensors on the parameters' device."""
        paths, leaves, tree = optree.tree_flatten_with_path(params, none_is_leaf=True)
        for path, x in zip(paths, leaves):
            _check_param(self.name, path, x)
        device = leaves[0].device if leaves else torch.device("cpu")
        state = {"step": torch.zeros((), dtype=torch.int64, device=device)}
        for m in self.moments:
            state[m] = optree.tree_unflatten(tree, [torch.zeros_like(x) for x in leaves])
        return state

    def specs(self, param_specs: Any) -> dict:
        """The spec tree of the state, for :func:`save` / :func:`load`.

        **Arguments:** ``param_specs`` – the parameters' specs (a tree prefix, as for
        :func:`shard`).

        **Returns:** ``{"step": P(), name: param_specs}`` for each moment: a moment is
        laid out as its parameter."""
        return {"step": P(), **{m: param_specs for m in self.moments}}

    def update(self, params: Any, grads: Any, state: dict, *,
               donate: bool = False) -> tuple[Any, dict]:
        """One step: the new parameters and state.

        **Arguments:** ``params`` – the blocks; ``grads`` – their gradients, the same
        tree structure and shapes (cast to each parameter's dtype); ``state`` – from
        :meth:`init` or the last update; ``donate`` – write the results into
        ``params``' and ``state``'s own tensors (returned again), for a compiled step
        whose inputs must keep their addresses (CUDA graphs); by default new tensors
        are returned and the arguments are left as they were.

        **Returns:** ``(params, state)``. Runs under ``torch.no_grad()``: the update is
        not differentiated."""
        p_leaves, g_leaves, moments, tree = self._flatten(params, grads, state)
        step = state["step"]
        with torch.no_grad():
            # (float64: the count is exact, and a schedule's arithmetic on it is
            # torch.optim's Python-float arithmetic, not float32's)
            rate = self.lr(step.to(torch.float64)) if callable(self.lr) else self.lr
            new_p = list(p_leaves)
            new_m = {m: list(v) for m, v in moments.items()}
            for idx in _groups(p_leaves):
                g = [g_leaves[i].detach().to(p_leaves[i].dtype) for i in idx]
                ms = {m: [v[i] for i in idx] for m, v in moments.items()}
                out_p, out_m = self._step([p_leaves[i] for i in idx], g, ms, step, rate,
                                          donate, **self.hyper)
                for j, i in enumerate(idx):
                    new_p[i] = out_p[j]
                    for m in moments:
                        new_m[m][i] = out_m[m][j]
            if donate:
                step.add_(1)
            else:
                step = step + 1
        new_state = {"step": step, **{m: optree.tree_unflatten(tree, new_m[m])
                                      for m in moments}}
        return optree.tree_unflatten(tree, new_p), new_state

    def _flatten(self, params, grads, state):
        what = f"functp.{self.name}(...).update"
        paths, p_leaves, tree = optree.tree_flatten_with_path(params, none_is_leaf=True)
        g_leaves, g_tree = optree.tree_flatten(grads, none_is_leaf=True)
        if g_tree != tree:
            raise ShardingError(
                f"{what}: grads have the structure {g_tree}, params {tree}; give the "
                f"gradient tree of params itself (torch.func.grad with respect to it)")
        if not isinstance(state, dict) or set(state) != {"step", *self.moments}:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ShardingError(
                f"{what}: state has {got}, not {sorted({'step', *self.moments})}; pass the "
                f"state this optimizer's init (or its last update) returned")
        moments = {}
        for m in self.moments:
            leaves, m_tree = optree.tree_flatten(state[m], none_is_leaf=True)
            if m_tree != tree:
                raise ShardingError(f"{what}: state[{m!r}] has the structure {m_tree}, "
                                    f"params {tree}; make the state with init(params)")
            moments[m] = leaves
        for k, (path, p, g) in enumerate(zip(paths, p_leaves, g_leaves)):
            _check_param(self.name, path, p)
            if not isinstance(g, torch.Tensor) or g.shape != p.shape:
                shape = g.shape if isinstance(g, torch.Tensor) else None
                raise ShardingError(
                    f"{what}: {leaf_text(keystr('grads', path), shape)} does not fit "
                    f"{leaf_text(keystr('params', path), p.shape)}; give each block the "
                    f"gradient of its block (a zero tensor where the loss does not reach it)")
            for m, leaves in moments.items():
                if leaves[k].shape != p.shape:
                    raise ShardingError(
                        f"{what}: {leaf_text(keystr(f'state[{m!r}]', path), leaves[k].shape)}"
                        f" does not fit {leaf_text(keystr('params', path), p.shape)}; was "
                        f"the state loaded with another mesh's specs? load it with "
                        f"opt.specs(specs) on this mesh")
        return p_leaves, g_leaves, moments, tree


def _check_param(name: str, path, x) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        kind = str(x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ShardingError(
            f"functp.{name}: {keystr('params', path)} is {kind}; the parameter tree "
            f"holds floating-point tensors only: keep buffers and other values apart")


def _groups(leaves: list[torch.Tensor]) -> list[list[int]]:
    """Indices by (device, dtype): a foreach call takes one of each."""
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault((x.device, x.dtype), []).append(i)
    return list(groups.values())


def _first(inplace: Callable, outplace: Callable, donate: bool, xs, *args, **kw):
    """A buffer's first op: in place when donated, else into new tensors (which the
    later ops may then update in place)."""
    if donate:
        inplace(xs, *args, **kw)
        return xs
    return outplace(xs, *args, **kw)


def _scalar(x: Any, like: torch.Tensor) -> Any:
    """A float stays a float (a Scalar overload); a tensor goes to the group's dtype
    and device (a 0-d tensor overload)."""
    return x.to(dtype=like.dtype, device=like.device) if isinstance(x, torch.Tensor) else x


def _check_rate(name: str, lr: Any) -> None:
    if callable(lr) or isinstance(lr, torch.Tensor) and lr.numel() == 1:
        return
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr >= 0:
        raise ShardingError(
            f"functp.{name}: lr={lr!r}; give a float >= 0, a one-element tensor, or a "
            f"schedule: a function of the step count (a 0-d float64 tensor) written with "
            f"torch ops, e.g. lambda step: 1e-3 * torch.clamp((step + 1) / 100, max=1.0)")


# -- AdamW ----------------------------------------------------------------------------


def _adamw_step(p, g, ms, step, lr, donate, *, betas, eps, weight_decay, amsgrad):
    b1, b2 = betas
    t = (step + 1).to(torch.float64)            # the count after this update, as torch's
    # torch.optim computes these in Python floats (float64): so do we, on the device
    bc1 = 1 - torch.pow(b1, t)
    bc2_sqrt = torch.sqrt(1 - torch.pow(b2, t))
    step_size = _scalar(lr / bc1, p[0])
    m = _first(tc.foreach_lerp_, tc.foreach_lerp, donate, ms["exp_avg"], g, 1 - b1)
    v = _first(tc.foreach_mul_, tc.foreach_mul, donate, ms["exp_avg_sq"], b2)
    tc.foreach_addcmul_(v, g, g, value=1 - b2)
    out = {"exp_avg": m, "exp_avg_sq": v}
    if amsgrad:
        v = _first(tc.foreach_maximum_, tc.foreach_maximum, donate, ms["max_exp_avg_sq"], v)
        out["max_exp_avg_sq"] = v
    denom = tc.foreach_sqrt(v)
    tc.foreach_div_(denom, _scalar(bc2_sqrt, p[0]))
    tc.foreach_add_(denom, eps)
    upd = tc.foreach_div(m, denom)
    tc.foreach_mul_(upd, step_size)
    if weight_decay:                      # decoupled: the parameter shrinks, not the gradient
        p = _first(tc.foreach_mul_, tc.foreach_mul, donate, p,
                   _scalar(1 - lr * weight_decay, p[0]))
        tc.foreach_sub_(p, upd)
    else:
        p = _first(tc.foreach_sub_, tc.foreach_sub, donate, p, upd)
    return p, out


def adamw(lr: float | torch.Tensor | Callable = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
          eps: float = 1e-8, weight_decay: float = 1e-2, *, amsgrad: bool = False) -> Optimizer:
    """AdamW as a functional optimizer: ``torch.optim.AdamW``'s arithmetic (decoupled
    weight decay, bias correction, amsgrad optional) over a tree of local blocks.

    **Arguments:** ``lr`` – a float, a one-element tensor (change it in place between
    steps: no recompile), or a schedule, a function of the step count (a 0-d float64
    tensor, 0 at the first update, as torch's LR schedulers count) written with
    torch ops so that a compiled step reads no host value; ``betas``, ``eps``,
    ``weight_decay``, ``amsgrad`` – as torch.optim.AdamW's.

    **Returns:** an :class:`Optimizer`: ``init``, ``update``, ``specs``. Example::

        opt = functp.adamw(1e-3, weight_decay=0.1)
        state = opt.init(params)
        def train_step(params, state, x):
            loss, grads = functp.value_and_grad(step)(params, x)
            grads, _ = functp.clip_by_global_norm(grads, 1.0, mesh, specs)
            params, state = opt.update(params, grads, state, donate=True)
            return loss, params, state
        train_step = torch.compile(train_step, fullgraph=True)     # one graph
    """
    _check_rate("adamw", lr)
    b1, b2 = betas
    for name, value, ok in (("betas[0]", b1, 0 <= b1 < 1), ("betas[1]", b2, 0 <= b2 < 1),
                            ("eps", eps, eps >= 0), ("weight_decay", weight_decay,
                                                     weight_decay >= 0)):
        if not ok or math.isnan(value):
            raise ShardingError(f"functp.adamw: {name}={value!r} is out of range "
                                f"(betas in [0, 1), eps and weight_decay >= 0)")
    moments = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    return Optimizer("adamw", moments, _adamw_step, lr,
                     dict(betas=(b1, b2), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad))


# -- SGD ------------------------------------------------------------------------------


def _sgd_step(p, g, ms, step, lr, donate, *, momentum, dampening, weight_decay, nesterov):
    d = tc.foreach_add(g, p, alpha=weight_decay) if weight_decay else g
    out = {}
    if momentum:
        # torch.optim's first step sets the buffer to d itself (no dampening): from a
        # zero buffer that is d times 1, so the dampening factor is 1 at step 0
        damp = 1 - dampening * (step != 0).to(torch.float64) if dampening else 1.0
        buf = _first(tc.foreach_mul_, tc.foreach_mul, donate, ms["momentum_buffer"], momentum)
        tc.foreach_add_(buf, tc.foreach_mul(d, _scalar(damp, p[0])) if dampening else d)
        out["momentum_buffer"] = buf
        d = tc.foreach_add(d, buf, alpha=momentum) if nesterov else buf
    if isinstance(lr, torch.Tensor):
        return _first(tc.foreach_sub_, tc.foreach_sub, donate, p,
                      tc.foreach_mul(d, _scalar(lr, p[0]))), out
    return _first(tc.foreach_add_, tc.foreach_add, donate, p, d, alpha=-lr), out


def sgd(lr: float | torch.Tensor | Callable, momentum: float = 0.0, dampening: float = 0.0,
        weight_decay: float = 0.0, nesterov: bool = False) -> Optimizer:
    """SGD as a functional optimizer: ``torch.optim.SGD``'s arithmetic (L2 weight
    decay added to the gradient, momentum with dampening, Nesterov) over a tree of
    local blocks.

    **Arguments:** ``lr`` – as :func:`adamw`'s; ``momentum``, ``dampening``,
    ``weight_decay``, ``nesterov`` – as torch.optim.SGD's (Nesterov needs a momentum
    and no dampening).

    **Returns:** an :class:`Optimizer`; its state holds ``momentum_buffer`` when
    ``momentum`` is not 0. Example::

        opt = functp.sgd(0.1, momentum=0.9, nesterov=True)
        state = opt.init(params)
        params, state = opt.update(params, grads, state)
    """
    _check_rate("sgd", lr)
    if momentum < 0 or weight_decay < 0:
        raise ShardingError(f"functp.sgd: momentum={momentum!r} and weight_decay="
                            f"{weight_decay!r} must be >= 0")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ShardingError(f"functp.sgd: nesterov=True needs momentum > 0 and dampening "
                            f"0 (as torch.optim.SGD), got momentum={momentum!r}, "
                            f"dampening={dampening!r}")
    moments = ("momentum_buffer",) if momentum else ()
    return Optimizer("sgd", moments, _sgd_step, lr,
                     dict(momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                          nesterov=nesterov))
