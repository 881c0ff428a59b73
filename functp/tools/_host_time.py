"""A step's time as the estimate predicts it: the device's compute and communication
and the host's work, per stretch between host reads (:class:`StepTime`), and the
counting of the host's work while a step is traced (``_Host``)."""
from __future__ import annotations

from dataclasses import dataclass

from . import _host_count
from ._hardware import Hardware, collective_seconds, op_seconds


def _secs(t: float) -> str:
    return f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"



@dataclass(frozen=True)
class StepTime:
    """A predicted step time (seconds) and its two bounds: ``overlapped`` if every
    collective hides behind computation, ``serial`` if none does.

    ``host``: the time the host takes to issue the step: its operator calls
    (``host_calls``) times the profile's ``host_call`` plus its Python function
    calls (``python_calls``: the model's, torch's and functp's own Python, C
    functions called from Python included) times ``host_python`` (0 where the
    profile has none). The device runs no faster than the host issues work, and
    waits for it after each synchronization: the step is cut into ``stretches``
    at each host read (``.item()``, ``tolist()``, ``bool()``, a shape that depends
    on values), each a ``(compute, communication, host)`` triple, and a bound is
    the sum over stretches of ``max(device, host)``; ``compute``, ``communication``
    and ``host`` are the sums. ``bound`` says which side most of the step sits on
    (``"host"`` or ``"device"``). ``idle``: a pipeline stage's wait for its peers
    (the bubble), in both bounds: its idle ticks of the schedule's table, each as long
    as its busy ones on average."""
    compute: float
    communication: float
    host: float = 0.0
    host_calls: int = 0
    python_calls: int = 0
    stretches: tuple = ()
    idle: float = 0.0

    def _parts(self) -> tuple:
        return self.stretches or ((self.compute, self.communication, self.host),)

    @property
    def overlapped(self) -> float:
        return sum(max(c, m, h) for c, m, h in self._parts()) + self.idle

    @property
    def serial(self) -> float:
        return sum(max(c + m, h) for c, m, h in self._parts()) + self.idle

    @property
    def bound(self) -> str:
        on_host = sum(h for c, m, h in self._parts() if h > max(c, m))
        return "host" if on_host > self.overlapped / 2 else "device"

    def __str__(self) -> str:
        return f"{_secs(self.overlapped)} .. {_secs(self.serial)}"


class _Host:
    """The host's work in a traced step and where the step synchronizes: operators
    the program dispatched (``ops``, counted by the top mode), Python calls
    (``python``), and at each host read a cut: (operator records, collectives,
    operators dispatched, Python calls) so far."""

    def __init__(self) -> None:
        self.ops = 0
        self.python = _host_count.PyCalls()
        self.python.ops = self
        self.start: tuple | None = None
        self.cuts: list[tuple] = []
        self.whole = True         # the device's time from the program's first operator
        self._calls: list = []
        self._events: list = []

    def watch(self, calls: list, events: list) -> None:
        self._calls, self._events = calls, events

    def now(self) -> tuple:
        return (len(self._calls), len(self._events), self.ops,
                self.python.total + self.python.builtin)

    def begin(self, index: int) -> None:
        """The step starts at operator record ``index``, the first that computes
        (building a model computes nothing; its initialization is not the step's),
        inside the operator just counted; its host work from where the program's
        call that issued it began (``PyCalls.entered``)."""
        _, events, ops, py = self.now()
        self.start = (index, events, ops - 1, py)
        at = self.python.entered()
        if at is not None:               # from where the step's outermost call began
            self.start = (index, events, at[1], at[0])

    def start_here(self) -> None:
        """The step starts now, device and host (a step called after its warm-up)."""
        self.start, self.whole = self.now(), False

    def sync(self) -> None:
        self.cuts.append(self.now())

    def time(self, hw: Hardware, calls: list, events: list, members: dict) -> "StepTime":
        """The step's :class:`StepTime`: per stretch between host reads (from the
        step's start), the device's compute and communication over that stretch's
        operators and collectives, and the host's operators and Python calls."""
        end = self.now()
        start = self.start or (0, 0, 0, 0)
        # the device's time from the first record (as before the host was counted),
        # the host's from the step's start
        marks = [(0, 0, start[2], start[3]) if self.whole else start]
        for c in self.cuts + [end]:       # (reads before the step are its setup's)
            if c[0] > start[0] and c != marks[-1]:
                marks.append(c)
        if len(marks) == 1:
            marks.append(end)
        parts, ops, py = [], 0, 0
        for a, b in zip(marks, marks[1:]):
            compute = sum(op_seconds(hw, f, n, d) for _, f, n, d in calls[a[0]:b[0]])
            comm = sum(collective_seconds(hw, e.op, e.nbytes, members[frozenset(e.axes)])
                       for e in events[a[1]:b[1]])
            parts.append((compute, comm, (b[2] - a[2]) * hw.host_call +
                          (b[3] - a[3]) * hw.host_python))
            ops, py = ops + b[2] - a[2], py + b[3] - a[3]
        return StepTime(sum(p[0] for p in parts), sum(p[1] for p in parts),
                        sum(p[2] for p in parts), ops, py, tuple(parts))
