"""What a dry run answers when the program reads a tensor's value on the host.

Fake tensors have shapes but no values, yet programs read values: transformers'
mask code asks ``padding_mask.all()``, an expert-parallel layer counts its tokens
per expert (``bincount``) and sends that many rows, a loop stops on ``.item()``.
:func:`functp.estimate` answers each such read by a visible rule, in this order:

1. **your value**: ``reads={"site": value}``, where ``site`` is a substring of
   the call site the estimate prints: file and line, function, and the line's code
   (``"masking_utils.py:123"``, ``"in find_packed_sequence_indices"``, ``"x.all()"``);
2. **the value the program made**: small tensors whose values follow from what the
   program itself made (``torch.arange``, ``torch.ones_like(ids)``, a batch drawn
   with ``torch.randint``, tensors passed in) are computed for real beside their
   fakes, so a mask built from them reads what a real run reads;
3. **the routing assumption**: every ``topk`` (a router's) picks experts so that
   each gets the same number of (token, choice) pairs (``routing="uniform"``), or
   the counts given (``routing=[c0, c1, ...]``: this rank's pairs per expert, the
   same on every rank), whatever the scores; the counts, offsets and sizes computed
   from those picks follow exactly (rule 2 applies to them);
4. **the default**: any other value reads as zero (``0``, ``0.0``, ``False``);
   an operator whose output shape depends on such values (``nonzero``, masked
   indexing) sees zeros.

A collective's known result assumes every peer holds what this rank holds (an
all-gather of counts repeats them). Each read is listed, with its operator, call site
and how it was answered, in ``est[r].reads`` and in the estimate's printout.
"""
from __future__ import annotations

import functools
import linecache
import os
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import optree
import torch
from torch.overrides import TorchFunctionMode

from ..mesh import _mesh
from ..runtime._errors import ShardingError
from ..runtime._world import PACKAGE_DIR
from ..runtime._torch_compat import (DataDependentOutputException, DynamicOutputShapeException,
                                     FakeTensor, TorchDispatchMode, c10d_functional,
                                     disable_current_modes, unwrap_functorch)

__all__ = ["HostRead", "Values", "ToList", "refused"]

LIMIT = 1 << 16          # elements: larger tensors are not computed for real beside fakes
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_HERE = os.path.dirname(os.path.abspath(__file__))
_SCALAR = "aten::_local_scalar_dense"     # (.item(), bool(), int() of a tensor)
_TOPK = torch.ops.aten.topk.default
_KEY = "_functp_value"      # a fake's real value, in its __dict__: a weak reference to a
                            # tensor would stop torch.utils.swap_tensors (module.to())


@dataclass(frozen=True)
class HostRead:
    """One kind of read: ``op`` at ``site`` (file:line in function), answered ``how``
    (``"yours"``, ``"computed"``, ``"routing ..."``, ``"default 0"``), ``calls`` times;
    ``value``: what the last call got."""
    op: str
    site: str
    how: str
    value: Any
    calls: int = 1

    def __str__(self) -> str:
        v = repr(self.value)
        v = v if len(v) <= 40 else v[:37] + "..."
        return f"{self.op} at {self.site}: {self.how} -> {v} (x{self.calls})"


def _site() -> str:
    """Where the program read: the innermost frame outside torch, functp and the
    estimator, and the innermost functp frame if the read was functp's own."""
    f, via = sys._getframe(1), ""
    while f is not None:
        name = f.f_code.co_filename
        if not (name.startswith(_TORCH) or name.startswith(_HERE) or name.startswith("<frozen")):
            code = linecache.getline(name, f.f_lineno).strip()
            code = code if len(code) <= 60 else code[:57] + "..."
            where = f"{os.path.basename(name)}:{f.f_lineno} in {f.f_code.co_name} ({code})"
            if not name.startswith(PACKAGE_DIR):
                return where + (f" (via functp's {via})" if via else "")
            if f.f_code.co_name not in ("__torch_function__", "__torch_dispatch__"):
                via = via or where       # (not a mode passing the call on)
        f = f.f_back
    return via or "?"


def _check_routing(routing) -> Any:
    if isinstance(routing, str) and routing == "uniform":
        return routing
    try:
        counts = [int(c) for c in routing]
    except (TypeError, ValueError):
        counts = None
    if not counts or any(c < 0 for c in counts):
        raise ShardingError(
            f"functp.estimate: routing={routing!r} must be \"uniform\" or this rank's "
            f"(token, choice) pairs per expert, non-negative ints (e.g. [8, 8, 0, 16])")
    return counts


def _picks(shape: tuple, dim: int, counts: list[int]) -> torch.Tensor:
    """topk indices of ``shape`` (``k`` along ``dim``) in which expert ``e`` is picked
    ``counts[e]`` times, never twice for one row: the experts in order, dealt out one
    choice column at a time (a run of at most ``rows`` picks meets a row once)."""
    k = shape[dim]
    rows = 1
    for i, s in enumerate(shape):
        rows *= s if i != dim % len(shape) else 1
    seq = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return seq.reshape(k, rows).T.reshape(*[s for i, s in enumerate(shape)
                                            if i != dim % len(shape)], k).movedim(-1, dim)


class Values(TorchDispatchMode):
    """Just above ``FakeTensorMode``: small tensors whose values the program made are
    computed for real beside their fakes, and each host read or
    value-dependent shape is answered by the rules above and noted (``reads``)."""

    def __init__(self, reads: dict | None = None, routing: Any = "uniform") -> None:
        super().__init__()
        self.rules = dict(reads or {})
        self.routing = _check_routing(routing)
        self._reads: dict[tuple, HostRead] = {}
        # called at each read that waits for the device on a real run (a value read
        # on the host, a shape that depends on values): the estimate cuts its step
        # time there (None: nothing to tell)
        self.on_sync: Any = None

    @property
    def reads(self) -> list[HostRead]:
        return list(self._reads.values())

    def forget_reads(self) -> None:
        """Reads from now on only (a measured step after its warm-up calls)."""
        self._reads = {}

    def note(self, op: str, how: str, value: Any) -> None:
        key = (op, _site(), how)
        old = self._reads.get(key)
        self._reads[key] = HostRead(op, key[1], how, value, old.calls + 1 if old else 1)

    def fake_of(self, mode, x: Any) -> Any:
        """A tensor passed to the program, as a fake whose value is known if small."""
        if not isinstance(x, torch.Tensor):
            return x
        f = mode.from_tensor(x)
        if x.numel() <= LIMIT:
            with disable_current_modes():
                _know(f, x.detach())
        return f

    def value_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t``'s real value, where it is known."""
        if not isinstance(t, FakeTensor):
            return t
        return t.__dict__.get(_KEY)

    def read(self, op: str, t: torch.Tensor, convert) -> Any:
        """A host read of ``t``, answered by the first rule that applies."""
        if self.on_sync is not None:
            self.on_sync()
        site = _site()
        for where, value in self.rules.items():
            if where in site:
                self.note(op, f"yours ({where!r})", value)
                return value
        real = self.value_of(t)
        how = "computed" if real is not None else "default 0"
        with disable_current_modes():
            if real is None:
                real = torch.zeros((), dtype=t.dtype).expand(t.shape)
            value = convert(real)
        self.note(op, how, value)
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.name == _SCALAR:
            return self.read("aten._local_scalar_dense", args[0], lambda r: r.item())
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            return self._from_values(func, args, kwargs)
        if func is _TOPK:        # (routing is data: always the stated assumption)
            self._route(args, kwargs, out)
        else:
            self._follow(func, args, kwargs, out)
        return out

    def _reals(self, args, kwargs, default: bool):
        """The real values of the arguments (unknown ones as zeros, with ``default``),
        or None if one is unknown."""
        missing = []

        def real(x):
            if not isinstance(x, torch.Tensor):
                return torch.device("cpu") if isinstance(x, torch.device) else x
            v = self.value_of(x)
            if v is None:
                missing.append(x)
                v = torch.zeros((), dtype=x.dtype).expand(x.shape) if default else x
            return v
        with disable_current_modes():
            out = optree.tree_map(real, (args, kwargs), none_is_leaf=True)
        return None if missing and not default else (out, bool(missing))

    def _follow(self, func, args, kwargs, out) -> None:
        """Computes ``out`` for real where its inputs are known and it is small."""
        if func.namespace not in ("aten", "prims", "_c10d_functional"):
            return
        outs = [t for t in optree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs:
            return
        # (most of a trace's operators read an activation, whose value is not known:
        # found without leaving the modes, which costs an operator more than this)
        if any(t.numel() > LIMIT for t in outs) or not _all_known((args, kwargs)):
            return self._forget(func, args)
        (rargs, rkwargs), _ = self._reals(args, kwargs, default=False)
        try:
            with disable_current_modes():
                real = (_collective(func, rargs) if func.namespace == "_c10d_functional"
                        else func(*rargs, **rkwargs))
        except Exception:       # (the shadow's strides may differ from the fake's)
            return self._forget(func, args)
        if real is None:
            return
        for f, r in zip(outs, [t for t in optree.tree_leaves(real) if isinstance(t, torch.Tensor)]):
            _know(f, r)

    def _forget(self, func, args) -> None:
        # an op that writes into a known tensor with unknown values: no longer known
        for i in _written(func):
            if i < len(args) and isinstance(args[i], torch.Tensor):
                args[i].__dict__.pop(_KEY, None)

    def _from_values(self, func, args, kwargs):
        """An operator whose output (or its shape) depends on values: run for real on
        the known values, zeros for the unknown, and its output made fake."""
        if self.on_sync is not None:        # (a real run reads the size on the host)
            self.on_sync()
        (rargs, rkwargs), missing = self._reals(args, kwargs, default=True)
        with disable_current_modes():      # (the fake mode below would take the reals)
            real = func(*rargs, **rkwargs)
            brief = _brief(real)
        self.note(str(func._overloadpacket), "default 0" if missing else "computed", brief)

        def fake(r):
            if not isinstance(r, torch.Tensor):
                return r
            f = torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=_device(args))
            if not missing and r.numel() <= LIMIT:
                _know(f, r)
            return f
        return optree.tree_map(fake, real, none_is_leaf=True)

    def _route(self, args, kwargs, out) -> None:
        """topk (a router's, known scores or not): the routing assumption picks the
        indices; the values stay what they were."""
        x, k = args[0], args[1]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        idx = out[1]
        if idx.numel() > LIMIT or x.dim() == 0:
            return
        n, pairs = x.shape[dim], idx.numel()
        counts = self.routing
        how = f"routing {counts}"
        if counts == "uniform" or len(counts) != n:
            how = "routing uniform" + ("" if counts == "uniform" else
                                       f" (routing= gives {len(counts)} experts, not {n})")
            counts = [pairs // n + (e < pairs % n) for e in range(n)]
        rows = pairs // k if k else 0
        if sum(counts) != pairs or any(c > rows for c in counts):
            raise ShardingError(
                f"functp.estimate: routing={self.routing} at {_site()}: topk picks {pairs} "
                f"(token, choice) pairs ({rows} tokens x {k}) among {n} experts; the counts "
                f"must add up to {pairs}, none above {rows} (a token picks an expert once)")
        with disable_current_modes():
            _know(idx, _picks(tuple(idx.shape), dim, counts))
        self.note("aten.topk", how, counts)


def _all_known(tree) -> bool:
    """Whether every fake tensor of ``tree`` has a known value."""
    return all(_KEY in t.__dict__ for t in optree.tree_leaves(tree, none_is_leaf=True)
               if isinstance(t, FakeTensor))


@functools.lru_cache(maxsize=None)
def _written(func) -> tuple[int, ...]:
    """The positions of the arguments ``func`` writes into (an operator's schema
    does not change: read once)."""
    if not func._schema.is_mutable:
        return ()
    return tuple(i for i, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def _know(fake: torch.Tensor, real: torch.Tensor) -> None:
    """Files ``real`` as ``fake``'s value, laid out as the fake is (a view taken of
    it later must work on both)."""
    if not isinstance(fake, FakeTensor):
        return
    if real.shape != fake.shape or real.stride() != fake.stride():
        with disable_current_modes():
            try:
                real = torch.empty_strided(fake.shape, fake.stride(),
                                           dtype=real.dtype).copy_(real)
            except RuntimeError:        # (an overlapping layout, an expanded zero)
                return
    fake.__dict__[_KEY] = real


def _collective(func, rargs):
    """A collective's result where every peer holds what this rank holds."""
    if func is c10d_functional.wait_tensor.default:
        return rargs[0]
    if func is c10d_functional.all_gather_into_tensor.default:
        return torch.cat([rargs[0]] * rargs[1])
    if func is c10d_functional.all_reduce.default:
        return rargs[0] * 1 if rargs[1] != "sum" else rargs[0] * _size(rargs[2])
    return None


def _size(group_name: str) -> int:
    # (c10d names the group; its functp axis group has the size)
    return next(g.size for g in _mesh._GROUPS.values() if g.group_name == group_name)


def _device(args) -> torch.device:
    for t in optree.tree_leaves(args):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def _brief(real) -> Any:
    if isinstance(real, torch.Tensor):
        return tuple(real.shape) if real.numel() > 8 else real.tolist()
    return real


class ToList(TorchFunctionMode):
    """``Tensor.tolist()`` reads a fake's storage directly (no operator): answered by
    the same rules as ``.item()``."""

    def __init__(self, values: Values) -> None:
        super().__init__()
        self.values = values

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            t = unwrap_functorch(args[0])
            if isinstance(t, FakeTensor):
                return self.values.read("Tensor.tolist", t, lambda r: r.tolist())
        return func(*args, **(kwargs or {}))


def refused(e: BaseException, rank: int) -> ShardingError:
    """The error for a program that needs a tensor's value on the host where no rule
    can answer (a data-dependent shape torch refuses), naming the line of the user's
    code that asked for it."""
    where, tb = "", e.__traceback__
    while tb is not None:        # the innermost frame outside functp and torch
        name = tb.tb_frame.f_code.co_filename
        if not (name.startswith(PACKAGE_DIR) or name.startswith(_TORCH)
                or name.startswith("<frozen")):
            src = linecache.getline(name, tb.tb_lineno).strip()
            where = (f" at {os.path.basename(name)}:{tb.tb_lineno} in "
                     f"{tb.tb_frame.f_code.co_name}: {src}")
        tb = tb.tb_next
    what = ("calls an operator whose output shape depends on the values (nonzero, "
            "masked indexing, unique)" if isinstance(e, DynamicOutputShapeException) else
            "reads a tensor's value on the host (.item(), .tolist(), bool(), int(), an "
            "if on a tensor)")
    return ShardingError(
        f"functp.estimate (rank {rank}): the program {what}{where}; a dry run "
        f"has shapes but no values ({e.func if hasattr(e, 'func') else e}). Make it "
        f"depend on shapes only, or pass what it reads in as Python numbers (e.g. "
        f"split sizes, token counts per rank) as arguments of the program")
