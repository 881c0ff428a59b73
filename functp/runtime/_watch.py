"""Ranks in different functp calls, found while they wait (the check mode off).

A script that runs a collective program on some ranks only (``if master_process:
evaluate()``), or a call the others do not make, leaves every rank waiting in a
collective its peers never reach, until the mesh's timeout (10 minutes by default),
each reporting another collective. functp finds it within seconds instead, at no cost
to a step that does not wait: each rank notes, in a few Python attributes, which
top-level ``shard_map`` call it is in (how many that made a collective it has
entered, which function), and whether it is waiting in one of functp's collectives.
A daemon thread looks once a second: a wait longer than ``FUNCTP_WATCH_S`` (5 s) is
posted to the process group's store with this rank's call and where it was made (the
main thread's stack), and the posts of the peers that wait too are read. A peer
waiting in another call is a divergence: every waiting rank prints the same error (the
calls, the ranks in each, their source lines) and, once all have printed it (a
count in the store; at most ``SAY_S`` seconds), exits with status 1 — a
collective's wait cannot be interrupted (gloo's ``abort`` does not end it), and its
peers then fail at once ("connection closed"), raising the posted error. A rank that
is merely slow (a checkpoint write, outside any functp collective) posts nothing and
is waited for as before. ``FUNCTP_WATCH=0`` turns the thread off; the check mode
(``FUNCTP_DEBUG=1``) does without it (it compares every collective before it runs).
Not in ``functp.simulate`` (its ranks are threads of one process; its own timeout
applies) nor while torch.compile traces. On NCCL a wait returns at once and a hang
shows at the next host sync, outside functp: the thread sees no wait there.

One divergence is found without the peers waiting (so on NCCL too): a replay's
agreement (``parallel/_replayed``), which a rank enters when it records a
parallelized call anew. Each rank counts its parallelized calls (``planned``: an
attribute write per call, the same count on every rank of one program) and notes
which ones it agreed at; a rank in the agreement past ``FUNCTP_WATCH_S`` posts the
call's number, and every peer's thread (which looks for such a post once a second
once it has made a parallelized call) that made that call *without* the agreement
(it replayed it: another plain argument, another tensor present) says so, and every
rank fails as above, naming both calls' arguments.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback

from . import _world

__all__ = ["state", "entered", "start", "exiting", "stop", "cause"]

ENABLED = os.environ.get("FUNCTP_WATCH", "1").strip().lower() not in ("0", "false", "no")
WAIT_S = float(os.environ.get("FUNCTP_WATCH_S", "5"))
_PREFIX = "functp/watch/"
# an exchange every rank of its group enters at the same point of a call (a replay's
# agreement on its first record): a peer waiting elsewhere in that call diverged
AGREEMENT = "the replay's agreement"
_PKG = _world.PACKAGE_DIR


class _State:
    """This process's place: written by the main thread, read by the watcher.
    ``ops/_primitives._wait`` writes ``wait`` (and counts ``entered`` into
    ``calls``) inline, with no call: the watcher times a wait by seeing the same
    ``(op, group)`` tuple at each look."""
    calls = 0             # top-level shard_map calls that waited on a collective
    body = None           # the function of the latest one
    entered = None        # the call just entered, counted at its first wait
    wait = None           # (op, group) while in a functp collective's wait
    thread = None         # the watcher (False: none in this process)
    main = None           # the ident of the thread that waits
    # parallelized calls (parallel/_replayed writes these: attribute writes only)
    planned = 0           # made so far, recorded or replayed
    key = None            # the latest one's replay key, in words by describe(key)
    describe = None
    agreed: set = set()   # the numbers of those this rank agrees at (see went_past)
    agreeing = None       # (op, group) while in one, its host sync included (NCCL)


state = _State()


def entered(body) -> None:
    """A top-level ``shard_map`` call starts (``body``: its ``_Body``). It counts
    from its first collective: a call that makes none (a rank-local computation on
    one rank) is not a place its peers must also be."""
    state.entered = body


def exiting() -> None:
    """The process waits for its peers at its exit (functp's exit barrier): a peer
    still waiting in a call sees that this rank made no more calls."""
    if ENABLED and state.thread:
        state.body, state.entered = _EXIT, None
        state.wait = ("the barrier at the process's exit", None)


class _Exit:
    name = "no further call: the script ended"


_EXIT = _Exit()


def start() -> None:
    """Starts the watcher thread (once, in a multi-process run)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        state.thread = False
        return
    state.main = threading.get_ident()
    state.thread = threading.Thread(target=_watch, name="functp-watch", daemon=True)
    state.thread.start()


_STOP = threading.Event()


def stop() -> None:
    """Ends the watcher before the process group goes (functp's exit handler): a
    daemon thread still inside a store call when the interpreter finalizes cannot
    take the GIL back, and the process aborts ("terminate called without an active
    exception") after a clean run."""
    t = state.thread
    if t:
        _STOP.set()
        t.join(timeout=5.0)
        state.thread = False


def _store():
    from ._torch_compat import default_store
    return default_store()


def _describe(wait) -> dict:
    """This rank's post: its call, the collective it waits in and its stack."""
    import torch.distributed as dist
    op, g = wait
    body = state.body
    name = getattr(getattr(body, "f", None), "__qualname__", None) or getattr(body, "name", "?")
    code = getattr(getattr(body, "f", None), "__code__", None)
    defined = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else "-"
    frame = sys._current_frames().get(state.main)
    lines = []
    if frame is not None:
        for fs in traceback.extract_stack(frame):
            if not fs.filename.startswith(_PKG) and "/torch/" not in fs.filename:
                lines.append(f"{fs.filename}:{fs.lineno} in {fs.name}: {(fs.line or '').strip()}")
    if g is None:
        members, axes = list(range(dist.get_world_size())), []
    else:
        members, axes = [g.group_rank(i) for i in range(g.size)], list(g.axes)
        try:
            ranks = dist.get_process_group_ranks(g.pg())
            members = [ranks[m] for m in members]
        except Exception:   # noqa: BLE001 - the group's members as its own ranks then
            pass
    return {"rank": dist.get_rank(), "call": state.calls, "name": name, "defined": defined,
            "op": op, "axes": axes, "members": members, "where": lines[-3:],
            "planned": state.planned}


def _replayed(post: dict) -> dict | None:
    """This rank's post if it made the parallelized call a peer waits in the replay's
    agreement for (``post``) without entering it: None if it did not (it is behind,
    or it takes part)."""
    n = post.get("planned", 0)
    if post["op"].startswith(AGREEMENT) and went_past(n):
        mine = _describe((post["op"], None))
        words = state.describe(state.key) if state.describe and state.key else "?"
        mine.update(op=f"replayed planned call #{n} instead (its latest a call with "
                       f"{words})", axes=post["axes"], members=post["members"],
                    replayed=True)
        return mine
    return None


def went_past(n: int) -> bool:
    """Whether this rank made its parallelized call ``n`` without entering its
    agreement (it replayed it). A call being recorded counts as agreed at from its
    start (``parallel/_replayed`` marks it before it counts it), its agreement still
    to come: the watcher reads these while the main thread writes them."""
    return state.planned >= n and n not in state.agreed


def _watch() -> None:
    import torch.distributed as dist
    store, me = _store(), dist.get_rank()
    posted = seen = None
    since = 0.0
    while not _STOP.wait(1.0):
        wait = state.agreeing or state.wait
        if wait is not seen:          # a new wait (or none) since the last look
            seen, since = wait, time.monotonic() - 0.5
        try:
            waited = time.monotonic() - since if wait is not None else 0.0
            if waited >= 1.0 and store.check([f"{_PREFIX}error"]):
                _leave(store, me, store.get(f"{_PREFIX}error").decode())
            if state.planned and (wait is None or wait is not state.agreeing):
                _look_for_agreement(store, me)
            if waited < WAIT_S:
                if posted is not None:
                    store.set(f"{_PREFIX}{me}", "")
                    if posted[0].startswith(AGREEMENT):
                        store.set(f"{_PREFIX}agreement", "")
                    posted = None
                continue
            if posted is not wait:
                mine = _describe(wait)
                store.set(f"{_PREFIX}{me}", json.dumps(mine))
                if wait is state.agreeing:     # (its peers look for it: see _replayed)
                    store.set(f"{_PREFIX}agreement", json.dumps(mine))
                posted = wait
            peers = []
            for r in mine["members"]:
                if r != me and store.check([f"{_PREFIX}{r}"]):
                    raw = store.get(f"{_PREFIX}{r}").decode()
                    if raw:
                        peers.append(json.loads(raw))
            # a peer waits for this rank elsewhere: a divergence. A peer in another
            # call that waits on a group without this rank is merely behind (its own
            # group's slow rank): not one
            other = [p for p in peers if me in p["members"] and (
                (p["call"], p["name"]) != (mine["call"], mine["name"])
                or (p["op"] != mine["op"]
                    and (p["op"].startswith(AGREEMENT) or mine["op"].startswith(AGREEMENT))))]
            if other:
                message = _message([mine] + peers)
                store.set(f"{_PREFIX}error", message)
                _leave(store, me, message)
        except Exception:       # noqa: BLE001 - the store gone (the job ending): stop
            return


def _look_for_agreement(store, me: int) -> None:
    """A peer waits in a replay's agreement for a call this rank replayed: every rank
    is told (the error posted) and this one leaves."""
    if not store.check([f"{_PREFIX}agreement"]):
        return
    raw = store.get(f"{_PREFIX}agreement").decode()
    post = json.loads(raw) if raw else None
    if post is None or post["rank"] == me or me not in post["members"]:
        return
    mine = _replayed(post)
    if mine is not None:
        message = _message([post, mine])
        store.set(f"{_PREFIX}error", message)
        _leave(store, me, message)


# how long a rank that printed the error waits for its peers to print it too before it
# exits (they read it at their watcher's next look once they wait: a second or two,
# more on a loaded machine; a peer busy outside any wait reads it at its next one)
SAY_S = 30.0


def _leave(store, me: int, message: str) -> None:
    """Prints the error and ends the process (its wait cannot be interrupted) once
    every rank has printed it (a count in the store), or ``SAY_S`` seconds on: the
    first exit makes a launcher (torchrun) end the others, and a rank ended before it
    printed would say nothing of why. (A fixed linger was not enough on a loaded
    machine: a peer's watcher thread, scheduled late, was ended first.)"""
    import torch.distributed as dist
    sys.stderr.write(f"[rank {me}] ShardingError: {message}\n")
    sys.stderr.flush()
    try:
        store.add(f"{_PREFIX}said", 1)
        world, end = dist.get_world_size(), time.monotonic() + SAY_S
        while store.add(f"{_PREFIX}said", 0) < world and time.monotonic() < end:
            time.sleep(0.2)
    except Exception:       # noqa: BLE001 - the store gone (its host ended): leave now
        pass
    os._exit(1)


def _message(posts: list) -> str:
    groups: dict = {}
    for p in sorted(posts, key=lambda p: p["rank"]):
        groups.setdefault((p["call"], p["name"], p["op"]), []).append(p)
    parts = []
    for (call, name, _), ps in groups.items():
        where = "; ".join(ps[0]["where"]) or ps[0]["defined"]
        if ps[0].get("replayed"):          # (no wait: it went on, see _replayed)
            parts.append(f"ranks {[p['rank'] for p in ps]} {ps[0]['op']} and went on, "
                         f"now in shard_map call #{call} ({name}), at {where}")
            continue
        if ps[0]["defined"] == "-":          # (at the exit barrier)
            parts.append(f"ranks {[p['rank'] for p in ps]} made {call} shard_map calls "
                         f"and wait in {ps[0]['op']} ({where})")
            continue
        parts.append(f"ranks {[p['rank'] for p in ps]} wait in {ps[0]['op']} over "
                     f"{tuple(ps[0]['axes'])} in shard_map call #{call} ({name}, defined "
                     f"at {ps[0]['defined']}), called from {where}")
    return ("ranks entered different functp calls (or different points of one) and wait "
            "for each other (the check mode is off; found while waiting): "
            + " | ".join(parts) + ". Every rank of "
            "a mesh must make the same shard_map calls in the same order: a collective "
            "program run on some ranks only (`if rank == 0: evaluate()`) leaves the "
            "others waiting; run it on every rank and print on one. Where ranks wait in "
            f"{AGREEMENT}, they called a parallelized module with other plain arguments "
            "or other tensors present (an attention_mask on some ranks only), other plain "
            "attributes of its modules, or a forward hook added on some ranks only: give "
            "every rank of the body the same ones (a float may differ: it is not keyed)")


def cause() -> str | None:
    """The divergence a peer posted before it exited, if any (for a failed wait)."""
    if not state.thread:
        return None
    try:
        store = _store()
        if store.check([f"{_PREFIX}error"]):
            return store.get(f"{_PREFIX}error").decode() or None
    except Exception:       # noqa: BLE001 - no store: no cause to add
        return None
    return None
