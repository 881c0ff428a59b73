"""``comm_log``: a record of every collective functp issues, forward and backward."""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

__all__ = ["comm_log", "CommEvent"]


class _Local(threading.local):      # per thread: functp.simulate runs a rank per thread
    def __init__(self) -> None:
        self.active: list[comm_log] = []


_local = _Local()


@dataclass(frozen=True)
class CommEvent:
    """One collective: ``op`` is ``all_reduce``, ``all_gather``, ``reduce_scatter``,
    ``all_to_all``, ``ragged_all_to_all`` or ``permute``; ``axes`` the mesh axes it ran
    over; ``nbytes`` the size of this rank's input buffer (for ``ragged_all_to_all``:
    the rows it sends)."""
    op: str
    axes: tuple[str, ...]
    nbytes: int


class comm_log:
    """Context manager that records the collectives issued while it is open.

    Backward passes count too, so open it around the whole step. Collectives traced
    by ``torch.compile`` are not recorded (they run inside the compiled graph).

    Example::

        with functp.comm_log() as log:
            grads = torch.func.grad(step)(params, x)
        log.count("all_reduce", axes=("dp",))   # how many all-reduces over 'dp'
        log.events                              # [CommEvent(op=..., axes=..., nbytes=...)]
    """

    def __init__(self) -> None:
        self.events: list[CommEvent] = []

    def __enter__(self) -> "comm_log":
        _local.active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _local.active.remove(self)

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self):
        return iter(self.events)

    def _select(self, op, axes):
        axes = (axes,) if isinstance(axes, str) else axes
        return [e for e in self.events if (op is None or e.op == op)
                and (axes is None or e.axes == tuple(axes))]

    def count(self, op: str | None = None, axes=None) -> int:
        """Number of events, optionally only those of one op and/or one axes tuple."""
        return len(self._select(op, axes))

    def nbytes(self, op: str | None = None, axes=None) -> int:
        """Total bytes of the selected events."""
        return sum(e.nbytes for e in self._select(op, axes))

    def summary(self) -> dict[tuple[str, tuple[str, ...]], int]:
        """``{(op, axes): count}`` for every kind of event seen."""
        return dict(Counter((e.op, e.axes) for e in self.events))


def record(op: str, axes: tuple[str, ...], nbytes: int) -> None:
    if _local.active:
        ev = CommEvent(op, axes, nbytes)
        for log in _local.active:
            log.events.append(ev)
