"""The reshard planner: which collectives move a block from one layout to another.

A pure function of the two layouts (per-dimension axis tuples, ``_layout.Layout``),
so every rank builds the same plan and it is testable without ranks. An axis can be
appended to the minor end of a dimension without communication (a local slice),
moved from the minor end of one dimension to the minor end of another (one
all-to-all) or dropped from the minor end (an all-gather); each step covers as many
axes, and the gathers as many dimensions, as one collective can. Example::

    plan((("x",), ()), ((), ("x",)))     # (("a2a", 0, 1, ("x",)),)
    plan(((), ()), (("x",), ()))         # (("slice", 0, ("x",)),): no communication

``_reshard.run_plan`` executes a plan on a block.
"""
from __future__ import annotations

import functools
import itertools

from ..mesh._layout import Layout

__all__ = ["plan", "communicates"]


def _prefix(a: tuple, b: tuple) -> bool:
    return b[:len(a)] == a


@functools.lru_cache(maxsize=4096)
def plan(src: Layout, dst: Layout) -> tuple[tuple, ...]:
    """Steps from layout ``src`` to ``dst``: ``("slice", d, axes)``, ``("a2a", d, e,
    axes)`` (minor axes of dim ``d`` move to the minor end of dim ``e``) and
    ``("gather", ((d, axes), ...))`` (one all-gather for several dimensions)."""
    cur = list(src)
    steps: list[tuple] = []
    while tuple(cur) != dst:
        # free: append the next axes of a dimension's target that nothing uses yet
        used = {a for t in cur for a in t}
        for e, (c, t) in enumerate(zip(cur, dst)):
            if _prefix(c, t):
                run = tuple(itertools.takewhile(lambda a: a not in used, t[len(c):]))
                if run:
                    steps.append(("slice", e, run))
                    cur[e] = c + run
                    used |= set(run)
        if tuple(cur) == dst:
            break
        stuck = [d for d in range(len(cur)) if not _prefix(cur[d], dst[d])]
        # move the longest minor run to a dimension whose target continues with it
        move = None
        for d in stuck:
            keep = next(i for i in range(len(cur[d]) + 1)
                        if i == len(cur[d]) or i == len(dst[d]) or cur[d][i] != dst[d][i])
            extra = cur[d][keep:]
            for n in range(len(extra), 0, -1):
                tail = extra[-n:]
                e = next((e for e in range(len(cur)) if e != d and _prefix(cur[e], dst[e])
                          and _prefix(cur[e] + tail, dst[e])), None)
                if e is not None:
                    move = (d, e, tail)
                    break
            if move:
                break
        if move:
            d, e, tail = move
            steps.append(("a2a", d, e, tail))
            cur[d], cur[e] = cur[d][:-len(tail)], cur[e] + tail
            continue
        # nothing can move now: drop every misplaced run in one all-gather
        parts = []
        for d in stuck:
            keep = next(i for i in range(len(cur[d]) + 1)
                        if i == len(cur[d]) or i == len(dst[d]) or cur[d][i] != dst[d][i])
            parts.append((d, cur[d][keep:]))
            cur[d] = cur[d][:keep]
        steps.append(("gather", tuple(parts)))
    return tuple(steps)


def communicates(steps) -> bool:
    return any(s[0] != "slice" for s in steps)
