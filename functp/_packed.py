"""Packed dimensions (``P(..., packed={dim: k})``) as views in which they are ordinary
splits: ``x.unflatten(dim, (k, -1))`` under the spec with ``(None, axes)`` in place of
the packed entry. Shapes and views only: the modules that move blocks use these."""
from __future__ import annotations

from typing import Sequence

import torch

from ._errors import ShardingError
from ._spec import P


def packing(spec: P | None) -> tuple[tuple[int, int], ...]:
    return () if spec is None else getattr(spec, "packed", ())


def view_spec(spec: P) -> P:
    entries = list(spec)
    for d, _ in reversed(packing(spec)):
        entries[d:d + 1] = [None, entries[d]]
    return P(*entries)


def view(x: torch.Tensor, spec: P) -> torch.Tensor:
    for d, k in reversed(packing(spec)):
        x = x.unflatten(d, (k, -1))
    return x


def unview(x: torch.Tensor, spec: P) -> torch.Tensor:
    for d, _ in packing(spec):
        x = x.flatten(d, d + 1)
    return x


def view_shape(shape: Sequence[int], spec: P) -> tuple[int, ...]:
    out = list(shape)
    for d, k in reversed(packing(spec)):
        out[d:d + 1] = [k, out[d] // k]
    return tuple(out)


def check(path: str, shape: Sequence[int], spec: P, sizes: dict[str, int]) -> None:
    """A packed dimension must hold whole, evenly split blocks."""
    for d, k in packing(spec):
        n = 1
        for a in spec.dim_axes(d):
            n *= sizes[a]
        if d >= len(shape) or shape[d] % (k * n):
            raise ShardingError(
                f"{path} (shape {tuple(shape)}) under {spec!r}: dimension {d} must hold "
                f"{k} blocks that each split evenly over {n} ranks; its size must be a "
                f"multiple of {k * n}")
