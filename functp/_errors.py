"""The one exception type functp raises for a user's mistake."""
from __future__ import annotations


class ShardingError(ValueError):
    """A spec, shape, mesh axis or collective that does not fit the mesh.

    Raised identically on every rank before any communication, so that a bad input
    never leaves some ranks waiting in a collective. The message names the leaf (its
    pytree path), its shape, the spec, the mesh, and what to change.
    """
