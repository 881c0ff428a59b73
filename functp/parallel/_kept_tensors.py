"""Two tensors that stand where the module ``parallelize`` kept holds nothing that
trains, so that a ported script's own line over it fails by name instead of doing
nothing:

- :class:`NoGrad`, each kept parameter's ``.grad``. The blocks get the gradients; the
  kept parameters get none, and ``clip_grad_norm_(model.parameters(), 1.0)`` skips a
  parameter whose ``.grad`` is None: it would return 0 and clip nothing, silently.
  With a ``NoGrad`` there, the clip, ``clip_grad_value_``, a grad-norm log line
  (``p.grad.norm()``) and ``model.zero_grad(set_to_none=False)`` raise, naming the
  blocks. Its storage is one element expanded to the parameter's shape (``.grad``
  must have the parameter's shape, dtype and device). Reading its metadata, moving
  it with the module (``model.double()``) and printing it work; a backward through
  the kept module itself (a reference run) replaces it with the real gradient.
- :class:`Released`, the meta tensor left for a released (``keep_module=False``,
  ``from_pretrained``) embedding or LM head weight: transformers'
  ``resize_token_embeddings`` reads its values (the mean and covariance of the old
  rows, or a copy of them), which a meta tensor cannot give; a ``Released`` raises
  naming ``functp.resize_token_embeddings`` there, where a plain meta tensor raised
  ``Tensor.item() cannot be called on meta tensors``. Shape-only work on it (what
  functp itself does with a released parameter) gives plain results or more
  ``Released`` meta tensors.

Both are ``torch.Tensor`` subclasses through the public ``__torch_function__``
protocol (no torch function is patched); neither is ever an input of ``apply``,
which swaps the blocks into the module for its call.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

from ..runtime._errors import ShardingError

__all__ = ["NoGrad", "Released", "no_grad_of", "released_like"]

# what a NoGrad lets through: metadata, moves with its module, pickling, printing
_NOGRAD_PASS = frozenset((
    "__get__", "__set__", "size", "dim", "numel", "nelement", "stride", "element_size",
    "storage_offset", "untyped_storage", "data_ptr",
    "is_floating_point", "is_complex", "is_contiguous", "get_device", "requires_grad_",
    "detach", "detach_", "to", "double", "float", "half", "bfloat16", "cuda", "cpu",
    "_has_compatible_shallow_copy_type", "__reduce_ex__", "__setstate__", "__format__",
    "__deepcopy__", "type"))
# what reads a Released tensor's values, or writes them into another tensor
_RELEASED_READS = frozenset((
    "__bool__", "item", "tolist", "__int__", "__float__", "__index__", "numpy",
    "__setitem__", "copy_", "_local_scalar_dense"))
# (transformers' resize reads the old rows through .data: the first place to name it)
_DATA = inspect.getattr_static(torch.Tensor, "data")


def _first(args: Any, cls: type):
    for a in args:
        if isinstance(a, cls):
            return a
        if isinstance(a, (list, tuple)):
            found = _first(a, cls)
            if found is not None:
                return found
    return None


class NoGrad(torch.Tensor):
    """A kept parameter's ``.grad`` (see the module's docstring)."""

    _where = ("module", "a parameter")       # (the module's class, the parameter's name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        mine = _first(args, NoGrad)
        # (queries pass: torch.compile reads a module's parameters' .grad's metadata
        # with _is_view(), is_conj() and the like when it guards on them)
        if name not in _NOGRAD_PASS and not name.startswith(("is_", "_is_")):
            raise no_grad_error(name, *(mine._where if mine is not None else cls._where))
        out = super().__torch_function__(func, types, args, kwargs or {})
        if isinstance(out, NoGrad) and mine is not None:
            out._where = mine._where
        return out

    def __repr__(self) -> str:
        kind, name = self._where
        return (f"NoGrad({name!r} of the parallelized {kind}: no gradient; the blocks "
                f"hold them)")


def no_grad_of(p: torch.Tensor, kind: str, name: str) -> NoGrad:
    """A :class:`NoGrad` for ``p`` (the parameter ``name`` of a ``kind`` module)."""
    g = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape).as_subclass(NoGrad)
    g._where = (kind, name)
    return g


def no_grad_error(op: str, kind: str, name: str) -> ShardingError:
    return ShardingError(
        f"{op}() on the .grad of {name!r} of the parallelized {kind}: the module "
        f"parallelize kept gets no gradients (apply trains the blocks it returned), so "
        f"this line would read or change nothing that trains; "
        f"clip_grad_norm_(model.parameters(), max_norm) would clip nothing. Over the "
        f"blocks instead, `apply, params, specs = functp.parallelize(model, ...)`: "
        f"grads = {{k: p.grad for k, p in params.items()}}; clip with "
        f"`grads, norm = functp.clip_by_global_norm(grads, max_norm, mesh, specs)` and "
        f"`functp.set_grads(params, grads)`; log `functp.global_norm(grads, mesh, specs)`; "
        f"zero with the optimizer over the blocks (optimizer.zero_grad()). "
        f"docs/porting.md shows the whole loop")


class Released(torch.Tensor):
    """A released embedding or LM head weight (see the module's docstring)."""

    _where = ("module", "a parameter")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if getattr(func, "__self__", None) is _DATA:
            mine = _first(args, Released)
            raise released_error(".data", *(mine._where if mine is not None else cls._where))
        if name in _RELEASED_READS and not (name in ("__setitem__", "copy_")
                                            and isinstance(args[0], Released)):
            mine = _first(args, Released)
            raise released_error(name, *(mine._where if mine is not None else cls._where))
        out = super().__torch_function__(func, types, args, kwargs or {})
        mine = _first(args, Released)
        if isinstance(out, Released) and mine is not None:
            out._where = mine._where
        # (a result on another device is a plain tensor: only a meta one stays Released)
        if isinstance(out, Released) and not out.is_meta:
            return out.as_subclass(torch.Tensor)
        return out


def released_like(p: torch.Tensor, kind: str, name: str) -> Released:
    """A :class:`Released` meta tensor with ``p``'s shape and dtype."""
    r = torch.empty(p.shape, dtype=p.dtype, device="meta").as_subclass(Released)
    r._where = (kind, name)
    return r


def released_error(op: str, kind: str, name: str) -> ShardingError:
    return ShardingError(
        f"{op if op.startswith('.') else op + '()'} reads the values of {name!r} of the parallelized {kind}, which "
        f"parallelize released (a meta tensor: keep_module=False, or "
        f"functp.from_pretrained): its values are in the blocks. To grow the "
        f"vocabulary (model.resize_token_embeddings), call "
        f"`apply, params, specs = functp.resize_token_embeddings(apply, params, "
        f"new_num_tokens)` on every rank: transformers' own resize on the whole "
        f"embedding, gathered from the blocks (mean_resizing included), laid out again")
