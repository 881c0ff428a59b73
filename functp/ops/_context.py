"""The shard_map body currently running on this process (its mesh and mode).

Only the *forward* of a collective reads this: it resolves axis names to groups and
stores them in its autograd context, so a backward that runs later (tape autograd
after shard_map returned, or an outer transform) needs nothing from here.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any

from ..runtime._errors import ShardingError
from ..mesh._mesh import Mesh


@dataclass(frozen=True)
class Frame:
    mesh: Mesh
    check_vma: bool
    tracker: Any = None      # the vma Tracker when check_vma is on (and not compiling)
    manual: tuple[str, ...] = ()   # the mesh axes collectives may name here
    # axis name (or tuple) -> its AxisGroup, once resolved and checked in this body
    groups: dict = field(default_factory=dict, compare=False)

    def check_axes(self, axes: tuple[str, ...], what: str) -> None:
        auto = [a for a in axes if a not in self.manual]
        if auto:
            raise ShardingError(
                f"{what}: mesh axis {auto[0]!r} is not manual in the enclosing shard_map "
                f"(its axis_names are {self.manual}); values there are whole along "
                f"{auto[0]!r}, so there is nothing to communicate over it. Add it to "
                f"axis_names, or use a nested shard_map over {auto[0]!r}")


class _Local(threading.local):      # per thread: functp.simulate runs a rank per thread
    def __init__(self) -> None:
        self.stack: list[Frame] = []
        # frames entered so far and what the latest was: a planned call's recorder
        # (ops/_replay) sees by them that user code ran in a frame of its own inside it
        self.entered = 0
        self.what: str | None = None


_local = _Local()


def current(what: str) -> Frame:
    if not _local.stack:
        raise ShardingError(
            f"functp.{what} was called outside a shard_map body. Collectives name mesh "
            f"axes, which are bound only while a function wrapped by "
            f"functp.shard_map(fn, mesh, in_specs, out_specs) runs; call it from inside "
            f"that function")
    return _local.stack[-1]


def active() -> bool:
    return bool(_local.stack)


def top() -> Frame | None:
    return _local.stack[-1] if _local.stack else None


def entered() -> tuple[int, str | None]:
    """How many frames this thread has entered (:func:`frame`, :func:`reentered`), and
    what the latest was. Example: ``entered()`` is ``(3, "functp.checkpoint")``."""
    return _local.entered, _local.what


@contextlib.contextmanager
def frame(mesh: Mesh, check_vma: bool, tracker: Any = None, manual: tuple[str, ...] = (),
          groups: dict | None = None):
    """Binds a body's mesh axes while it runs. ``groups``: a cache of resolved axis
    groups that the caller keeps across calls with the same mesh and manual axes."""
    _local.entered, _local.what = _local.entered + 1, "a shard_map body"
    _local.stack.append(Frame(mesh, check_vma, tracker, manual or mesh.axis_names,
                        {} if groups is None else groups))
    try:
        yield _local.stack[-1]
    finally:
        _local.stack.pop()


@contextlib.contextmanager
def reentered(fr: Frame | None, what: str = "a recompute"):
    """``fr`` current again (a recompute in a backward that runs after its body
    returned, or ``what`` runs the user's code apart: functp.checkpoint's first run,
    a parallelized call inside another); nothing for ``None``."""
    if fr is None:
        yield None
        return
    _local.entered, _local.what = _local.entered + 1, what
    _local.stack.append(fr)
    try:
        yield fr
    finally:
        _local.stack.pop()
