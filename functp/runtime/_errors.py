"""The exceptions functp raises: ShardingError for a user's mistake or ranks that
disagree, and its subclass CheckpointError for a checkpoint that cannot be written or read."""
from __future__ import annotations


class ShardingError(ValueError):
    """A spec, shape, mesh axis or collective that does not fit the mesh.

    Raised identically on every rank before any communication, so that a bad input
    never leaves some ranks waiting in a collective. The message names the leaf (its
    pytree path), its shape, the spec, the mesh, and what to change.
    """


class CheckpointError(ShardingError):
    """A checkpoint that cannot be written or read: a failed write, a missing,
    incomplete or damaged checkpoint, or one that does not hold what ``like=`` asks for.

    Raised by :func:`functp.save` and :func:`functp.load` on every rank together, so no
    rank is left waiting. The message's first line is the cause and the checkpoint's
    path; DCP's own report (every failed rank's traceback), when there is one, is
    chained as ``__cause__``.
    """


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message (``""`` for an empty one): what an error
    that reports another one quotes of it."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""


def keystr(root: str, path: tuple) -> str:
    """``('args', (0, 'w'))`` -> ``"args[0]['w']"``, the way JAX prints key paths
    (how every message names a leaf)."""
    return root + "".join(f"[{k!r}]" for k in path)
