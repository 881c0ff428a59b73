"""A pipeline schedule as data: which action (F, B or W, with its microbatch and model
chunk) every rank starts at every tick, built by one pure function.

The table is what the executor (``_pipeline``) runs, what the tests check (each
action once, dependencies respected, how many microbatches are in flight), what
:meth:`Schedule.text` and :meth:`Schedule.plot` picture and what the bubble is read
from. It is built by simulating the ranks tick by tick: a forward takes one tick, a
whole backward two (it costs about twice the forward), and under ``"zero_bubble"``
the input gradient (B) and the weight gradient (W) one each. A rank starts, at each
tick, the first of these that is ready:

- the next backward in its order (its output gradient has arrived), which frees
  memory soonest;
- else the next forward in its order, if fewer than its limit of microbatches are in
  flight (GPipe: no limit; 1F1B: ``pp - rank``, Megatron's warm-up plus one);
- else (zero-bubble) a pending weight gradient: W fills the ticks 1F1B leaves idle,
  and waits as long as the rank holds fewer than ``pp`` microbatches' activations
  (1F1B's most, on rank 0).

The orders are Megatron's: microbatches ascending; interleaved, in rounds of ``pp``
microbatches per chunk (forwards chunk 0 first, backwards the last chunk first).

``"forward"`` is the table :meth:`Pipeline.evaluate` runs: every forward and no
backward, each as soon as its input is there (GPipe's forward phase), nothing held.
"""
from __future__ import annotations

from typing import NamedTuple

from ..runtime._errors import ShardingError

__all__ = ["Action", "Schedule", "pipeline_schedule", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
FORWARD = "forward"          # evaluation's table: forwards only (Pipeline.evaluate)
_TICKS = {"F": 1, "B": 2, "I": 1, "W": 1}     # I: a zero-bubble input gradient ("B")


class Action(NamedTuple):
    """One unit of work: ``kind`` "F" (forward), "B" (backward; under zero-bubble the
    input gradient only) or "W" (weight gradient), of ``microbatch`` on ``chunk`` (the
    rank's model chunk; virtual stage ``rank + chunk * pp``), starting at ``tick``
    and lasting ``ticks``."""
    kind: str
    microbatch: int
    chunk: int
    tick: int
    ticks: int


def _order(pp: int, m: int, v: int, backward: bool) -> list[tuple[int, int]]:
    """(chunk, microbatch) in Megatron's order: rounds of ``pp`` microbatches per chunk
    (the last round what is left), chunks ascending (descending for ``backward``)."""
    out = []
    for start in range(0, m, pp):
        size = min(pp, m - start)
        for j in range(v):
            chunk = v - 1 - j if backward else j
            out += [(chunk, start + i) for i in range(size)]
    return out


def _limit(schedule: str, pp: int, m: int, v: int, rank: int) -> int:
    if schedule in ("gpipe", FORWARD):
        return m * v
    if schedule == "interleaved":
        return min(m * v, (pp - rank - 1) * 2 + (v - 1) * pp + 1)
    return pp - rank


class _Rank:
    """One rank's queues and state while the schedule is simulated."""

    def __init__(self, schedule, pp, m, v, rank):
        self.fwd = _order(pp, m, v, False)
        self.bwd = [] if schedule == FORWARD else _order(pp, m, v, True)
        self.w: list[tuple[int, int]] = []
        self.limit, self.live, self.busy_until = _limit(schedule, pp, m, v, rank), 0, 0
        self.split = schedule == "zero_bubble"
        self.last = "F"          # the kind of its last forward or backward
        # live: forwards whose backward did not run; held: whose activations are
        # still kept (until W under zero-bubble), at most pp (rank 0's 1F1B peak)
        self.held = 0
        self.cap = self.limit if schedule in ("gpipe", FORWARD) else max(pp, self.limit)


def _simulate(schedule: str, pp: int, m: int, v: int) -> list[list[Action]]:
    """Each rank's actions in start order (see the module docstring)."""
    last = pp * v - 1
    done: dict = {}          # (kind, virtual stage, microbatch) -> the tick it ends
    ranks = [_Rank(schedule, pp, m, v, r) for r in range(pp)]
    out: list[list[Action]] = [[] for _ in range(pp)]
    per = {FORWARD: 1, "zero_bubble": 3}.get(schedule, 2)     # actions per microbatch
    tick, left = 0, per * pp * m * v

    def ready(key, t):
        return key in done and done[key] < t

    while left:
        started = False
        for r, st in enumerate(ranks):
            if st.busy_until > tick:
                continue
            act = _choose(st, r, pp, last, tick, ready, schedule == "gpipe")
            if act is None:
                continue
            kind, (j, mb) = act
            ticks = _TICKS["I" if kind == "B" and st.split else kind]
            out[r].append(Action(kind, mb, j, tick, ticks))
            done[(kind, r + j * pp, mb)] = tick + ticks - 1
            st.busy_until, left, started = tick + ticks, left - 1, True
            st.live += 1 if kind == "F" else -1 if kind == "B" else 0
            st.held += 1 if kind == "F" else -1 if kind == ("W" if st.split else "B") else 0
            if kind == "B" and st.split:
                st.w.append((j, mb))
        if not started and all(st.busy_until <= tick for st in ranks):
            raise AssertionError(f"schedule {schedule!r} pp={pp} M={m} v={v} deadlocks "
                                 f"at tick {tick}")
        tick += 1
    return out


def _choose(st: _Rank, r: int, pp: int, last: int, t: int, ready, gpipe: bool):
    """The action rank ``r`` starts at tick ``t``, if any (and takes it off its queue)."""
    b_ok = f_ok = False
    if st.bwd and not (gpipe and st.fwd):
        j, mb = st.bwd[0]
        vs = r + j * pp
        b_ok = ready(("F", vs, mb), t) and (vs == last or ready(("B", vs + 1, mb), t))
    if st.fwd and st.live < st.limit and st.held < st.cap:
        j, mb = st.fwd[0]
        vs = r + j * pp
        f_ok = vs == 0 or ready(("F", vs - 1, mb), t)
    # the steady state alternates (one forward, one backward), forward first
    if f_ok and (st.last == "B" or not b_ok):
        st.last = "F"
        return "F", st.fwd.pop(0)
    if b_ok:
        st.last = "B"
        return "B", st.bwd.pop(0)
    if st.w:
        return "W", st.w.pop(0)
    return None


class Schedule:
    """The table of a schedule: ``actions[rank]`` in start order (:class:`Action`).

    **Attributes:** ``schedule``, ``stages`` (pp), ``microbatches``, ``virtual_stages``;
    ``ticks`` (the step's length), ``bubble`` (the idle fraction of rank-ticks),
    ``peak_in_flight[rank]`` (most microbatches whose forward ran and whose last
    backward action did not).
    """

    def __init__(self, schedule: str, pp: int, m: int, v: int):
        self.schedule, self.stages, self.microbatches, self.virtual_stages = schedule, pp, m, v
        self.actions = _simulate(schedule, pp, m, v)
        self.ticks = max(a.tick + a.ticks for acts in self.actions for a in acts)
        busy = sum(a.ticks for acts in self.actions for a in acts)
        self.bubble = 1 - busy / (self.ticks * pp)
        closing = "W" if schedule == "zero_bubble" else "B"
        self.peak_in_flight = []
        for acts in self.actions:
            if schedule == FORWARD:      # (a forward keeps nothing for a backward)
                self.peak_in_flight.append(0)
                continue
            live = peak = 0
            for a in acts:
                live += 1 if a.kind == "F" else -1 if a.kind == closing else 0
                peak = max(peak, live)
            self.peak_in_flight.append(peak)

    def grid(self) -> list[list[Action | None]]:
        """``grid[rank][tick]``: the action running there, or None (idle)."""
        rows: list[list[Action | None]] = [[None] * self.ticks for _ in range(self.stages)]
        for r, acts in enumerate(self.actions):
            for a in acts:
                for t in range(a.tick, a.tick + a.ticks):
                    rows[r][t] = a
        return rows

    def text(self) -> str:
        """One line per rank, one cell per tick: ``F0`` is microbatch 0's forward
        (``F0.1``: of chunk 1, interleaved), ``.`` an idle tick."""
        v = self.virtual_stages > 1

        def cell(a):
            return "." if a is None else f"{a.kind}{a.microbatch}" + (f".{a.chunk}" if v else "")
        cells = [[cell(a) for a in row] for row in self.grid()]
        width = max(len(c) for row in cells for c in row)
        return "\n".join((f"rank {r}: " + " ".join(c.ljust(width) for c in row)).rstrip()
                         for r, row in enumerate(cells))

    def plot(self, path: str | None = None):
        """The table as a picture (ranks down, ticks across; F blue, B orange, W green,
        idle white), saved as a PNG at ``path`` if given. Needs matplotlib.

        **Returns:** the matplotlib figure."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("Schedule.plot needs matplotlib (pip install matplotlib); "
                              "Schedule.text() draws the same table as text") from e
        colours = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
        fig, ax = plt.subplots(figsize=(max(4, self.ticks * 0.35), 0.5 * self.stages + 1))
        for r, acts in enumerate(self.actions):
            for a in acts:
                shade = 0.55 + 0.45 * (a.chunk + 1) / self.virtual_stages
                ax.barh(r, a.ticks, left=a.tick, color=colours[a.kind], alpha=shade,
                        edgecolor="black", linewidth=0.5)
                ax.text(a.tick + a.ticks / 2, r, str(a.microbatch), ha="center",
                        va="center", fontsize=7, color="white")
        from matplotlib.patches import Patch
        names = {"F": "forward", "B": "backward" if self.schedule != "zero_bubble"
                 else "input grad (B)", "W": "weight grad (W)"}
        ax.legend(handles=[Patch(color=colours[k], label=names[k]) for k in
                           ("FBW" if self.schedule == "zero_bubble" else
                                                   "F" if self.schedule == FORWARD else "FB")],
                  loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, fontsize=8)
        ax.set_yticks(range(self.stages), [f"rank {r}" for r in range(self.stages)])
        ax.invert_yaxis()
        ax.set_xlabel("tick")
        ax.set_title(f"{self.schedule}: pp={self.stages}, M={self.microbatches}, "
                     f"v={self.virtual_stages}, bubble {self.bubble:.0%}")
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=120)
        return fig


def pipeline_schedule(schedule: str, stages: int, microbatches: int,
                      virtual_stages: int = 1) -> Schedule:
    """The table :func:`functp.pipeline` runs: every rank's actions, tick by tick.

    **Arguments:** ``schedule`` – "gpipe", "1f1b", "interleaved" or "zero_bubble";
    ``stages`` – the size of the pp axis; ``microbatches`` – M (any number >= 1);
    ``virtual_stages`` – model chunks per rank (``"interleaved"`` only; 1 otherwise).

    **Returns:** a :class:`Schedule` (``.actions``, ``.text()``, ``.plot(path)``,
    ``.bubble``, ``.peak_in_flight``).

    Example::

        print(functp.pipeline_schedule("1f1b", 2, 3).text())
        # prints:
        # rank 0: F0 F1 .  .  B0 B0 F2 B1 B1 .  B2 B2
        # rank 1: .  F0 B0 B0 F1 B1 B1 F2 B2 B2 .  .
    """
    if schedule not in SCHEDULES:
        raise ShardingError(f"functp.pipeline: schedule={schedule!r} is not one of "
                            f"{list(SCHEDULES)}")
    for name, val in (("stages", stages), ("microbatches", microbatches),
                      ("virtual_stages", virtual_stages)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ShardingError(f"functp.pipeline: {name}={val!r} must be an int >= 1")
    if virtual_stages != 1 and schedule != "interleaved":
        raise ShardingError(f"functp.pipeline: virtual_stages={virtual_stages} needs "
                            f"schedule='interleaved' (got {schedule!r}); give "
                            f"virtual_stages=1 for it")
    return Schedule(schedule, stages, microbatches, virtual_stages)
