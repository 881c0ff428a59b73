"""The exceptions functp raises: ShardingError for a user's mistake or ranks that
disagree, and its subclass CheckpointError for a checkpoint that cannot be written or
read; and how their messages name a leaf (``keystr``, ``leaf_text``)."""
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


def leaf_text(where: str, shape=None, spec=None, mesh=None) -> str:
    """How every message names a leaf: where it is (its pytree path, with the argument
    it came in), then what is known of it, in one parenthesis and one order:
    ``"in_specs for args[0]['w'] (shape (4, 6))"``, ``"tree['w'] (shape (5, 4), spec
    P('tp'), mesh Mesh(tp=2; cpu))"``. Parts given as ``None`` are left out."""
    parts = [f"shape {tuple(shape)}" if shape is not None else None,
             f"spec {spec!r}" if spec is not None else None,
             f"mesh {mesh}" if mesh is not None else None]
    known = ", ".join(p for p in parts if p is not None)
    return f"{where} ({known})" if known else where
