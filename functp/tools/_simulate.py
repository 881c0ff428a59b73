"""``simulate``: an SPMD program on N ranks inside this Python process.

Each rank is a thread of this process with gloo process groups of its own (see
``_world``), so every collective is the one torchrun would run and adds in gloo's
order: results are bit-identical to a gloo run. Threads rather than processes
because a rank's values, tracebacks and return values are then plain Python objects
of the caller (nothing is pickled) and start-up costs milliseconds. The ranks share
the GIL, so this is for debugging, tests and docs, not for speed.
"""
from __future__ import annotations

import atexit
import ctypes
import datetime
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch


from ..runtime import _compile
from ..runtime import _crosscheck
from ..runtime import _torch_compat
from ..mesh import _mesh
from ..runtime import _world
from ..runtime._errors import ShardingError, first_line

__all__ = ["simulate"]

_running = [0]          # simulate() calls in progress (in any thread)
_lock = threading.Lock()

# a rank blocked this long in a collective while another rank has returned from the
# program waits for something that rank will never send (an in-process send takes
# microseconds); its peer's groups are then closed so that its wait fails now
_ORPHANED_AFTER = 1.0


def simulate(fn: Callable[..., Any], nprocs: int, *args: Any, timeout: float = 60.0,
             check: bool | None = True, **kwargs: Any) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` as ``nprocs`` SPMD ranks in this process; returns
    their results in rank order.

    Inside ``fn`` everything works as under ``torchrun --nproc-per-node nprocs``:
    ``make_mesh``, ``shard``/``unshard``/``reshard``, ``shard_map``, the collectives
    and their gradients (``torch.func`` and tape autograd), ``parallelize``,
    ``comm_log``. Each rank is a thread with real gloo process groups, so values are
    bit-identical to a gloo run. The ranks take turns (one runs at a time, handing
    over at collectives), each with its own random generators and default dtype, so
    ``torch.manual_seed(0)`` then ``torch.randn`` agree across ranks as with
    processes. Ask :func:`functp.process_index` for the rank
    (``torch.distributed.get_rank`` has no default group here). Not available
    inside, each with a clear error: DTensor interop and checkpoints (they need
    torch's default group), ``torch.compile`` (its graphs wait on collectives
    inside) and forward-mode AD around a collective (one level per process).

    **Arguments:** ``fn`` – the per-rank program; ``nprocs`` – number of ranks;
    ``timeout`` – seconds a collective waits for the other ranks; ``check`` – the
    cross-rank check mode (``FUNCTP_DEBUG``) for the run: on by default, so ranks that
    disagree fail with a description instead of waiting; ``None`` leaves the current
    setting; ``*args``/``**kwargs`` – passed to ``fn`` on every rank.

    **Returns:** ``[fn's result on rank 0, on rank 1, ...]``. If a rank raises, its
    exception is raised here with a note naming the rank (and the other ranks'
    errors, usually consequences); the other ranks do not hang.

    Example::

        def program():
            mesh = functp.make_mesh((4,), ("x",))
            block = functp.shard(torch.arange(8.0), mesh, P("x"))   # 2 numbers a rank
            total = functp.shard_map(lambda b: functp.psum(b.sum(), "x"), mesh,
                                     in_specs=P("x"), out_specs=P())
            return block, total(block)

        functp.simulate(program, 4)
        # [(tensor([0., 1.]), tensor(28.)), (tensor([2., 3.]), tensor(28.)), ...]
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ShardingError(f"functp.simulate: nprocs must be a positive int, got {nprocs!r}")
    if _world.current_run() is not None:
        raise ShardingError("functp.simulate was called inside a simulated rank; "
                            "call it once, from outside the program")
    run = _world.take_run(nprocs, datetime.timedelta(seconds=float(timeout)))
    results: list[Any] = [None] * nprocs
    errors: dict[int, tuple[float, BaseException]] = {}
    finished = [False] * nprocs
    orphaned: list[int] = []       # ranks closed because others waited on them
    threads = [threading.Thread(target=_rank_main, daemon=True, name=f"functp-rank-{r}",
                                args=(run, r, fn, args, kwargs, results, errors, finished))
               for r in range(nprocs)]
    _torch_compat.before_rank_threads()
    previous = _begin(check)
    caller = _world.process_state()
    try:
        _wait_for_ranks(run, threads, finished, errors, orphaned, float(timeout))
    finally:
        _end(previous)
        if errors or orphaned or any(t.is_alive() for t in threads):
            _discard(run)
        else:
            old = _world.keep_run(run)
            if old is not None:
                _discard(old)
        _world.restore_state(caller)     # the ranks' draws are theirs, not the caller's
    if run.stuck is not None:
        _raise_stuck(run, errors, orphaned, nprocs, float(timeout))
    if errors:
        _raise_first(errors, orphaned, nprocs)
    return results


def _rank_main(run: _world.Run, r: int, fn, args, kwargs, results: list, errors: dict,
               finished: list) -> None:
    """Rank ``r``'s thread: ``fn`` with the baton held, its result or error recorded."""
    try:
        run.hold(r)
        try:
            _world.enter(run, r)
            results[r] = fn(*args, **kwargs)
        finally:
            _world.leave()
            run.release(r)
    except BaseException as e:  # noqa: BLE001 - every rank's error goes to the caller
        errors[r] = (time.monotonic(), _no_default_group(e) or e)
    if r in errors:
        run.close(r)            # peers blocked on this rank fail at once
    finished[r] = True


def _begin(check: bool | None):
    """A simulation starts (in any thread): the check mode as asked; the previous one."""
    _compile.arm_refusal()
    with _lock:
        _running[0] += 1
        _world.SIMULATING = True
        return _crosscheck.set_debug(check) if check is not None else None


def _end(previous) -> None:
    with _lock:
        _running[0] -= 1
        _world.SIMULATING = _running[0] > 0
        if previous is not None:
            _crosscheck.set_debug(previous)


def _wait_for_ranks(run: _world.Run, threads: list, finished: list, errors: dict,
                    orphaned: list, timeout: float) -> None:
    """Starts the ranks and waits for them, unblocking orphans and stopping a stuck
    rank (which does not run Python then: left behind)."""
    for t in threads:
        t.start()
    while True:
        # (one look at the threads: one that ends between two looks is not alive in
        # the second, which left nothing to join)
        alive = [t for t in threads if t.is_alive()]
        if not alive:
            break
        alive[0].join(0.05)
        _unblock_orphans(run, finished, orphaned)
        if _stop_stuck(run, finished, errors, timeout):
            break


def _discard(run: _world.Run) -> None:
    """Closes every group of ``run`` and forgets what was registered for them."""
    for r in range(run.size):
        run.close(r)
    run.meshes = [{} for _ in range(run.size)]
    run.device = None
    _mesh.forget_groups(f"functp_sim{run.id}_")
    _crosscheck.forget(f"functp_sim{run.id}_")


@atexit.register
def _discard_idle() -> None:
    # gloo's threads must be joined while the interpreter is alive: left to the
    # exit's static destructors they abort the process ("terminate called without
    # an active exception")
    for run in _world.take_all_idle():
        _discard(run)


def _unblock_orphans(run: _world.Run, finished: list[bool], orphaned: list[int]) -> None:
    """Closes the groups of ranks that returned when every rank still running has
    waited in a collective for a while: that collective can never complete."""
    done = [r for r, f in enumerate(finished) if f and r not in orphaned]
    running = [r for r, f in enumerate(finished) if not f]
    if not done or not running:
        return
    now = time.monotonic()
    if all(run.waiting[r] is not None and now - run.waiting[r] > _ORPHANED_AFTER
           for r in running):
        for r in done:
            orphaned.append(r)
            run.close(r)


# what a program calls in torch.distributed, and what it calls instead to run both
# under torchrun and in functp.simulate (whose ranks have no default group)
_EQUIVALENTS = {
    "get_rank": "functp.process_index()", "get_world_size": "functp.process_count()",
    "all_reduce": "functp.psum / pmean / pmax inside a shard_map body",
    "all_gather": "functp.all_gather inside a shard_map body",
    "all_gather_into_tensor": "functp.all_gather inside a shard_map body",
    "reduce_scatter": "functp.psum_scatter inside a shard_map body",
    "reduce_scatter_tensor": "functp.psum_scatter inside a shard_map body",
    "all_to_all": "functp.all_to_all inside a shard_map body",
    "all_to_all_single": "functp.all_to_all inside a shard_map body",
    "broadcast": "functp.shard(tree, mesh, specs, src_rank=...) (or a psum of "
                 "a value that is zero on the other ranks)",
    "barrier": "a functp collective (every collective waits for all ranks)",
    "send": "functp.ppermute inside a shard_map body",
    "recv": "functp.ppermute inside a shard_map body",
    "init_process_group": "functp.make_mesh (it starts the process group under torchrun)",
}


def _no_default_group(e: BaseException) -> ShardingError | None:
    """A ``torch.distributed`` call that needs the default process group, which
    simulated ranks do not have: a ``ShardingError`` naming the call and functp's
    equivalent (``e`` chained), or None for any other error."""
    if "Default process group has not been initialized" not in str(e):
        return None
    call, where, tb = None, "", e.__traceback__
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.startswith(torch_dir):
            if call is None and code.co_name in _EQUIVALENTS:
                call = code.co_name
        elif not code.co_filename.startswith(_world.PACKAGE_DIR):
            where = f" at {os.path.basename(code.co_filename)}:{tb.tb_lineno} in {code.co_name}"
        tb = tb.tb_next
    name = f"torch.distributed.{call}" if call else "a torch.distributed call"
    instead = _EQUIVALENTS.get(call, "functp's own API (process_index, process_count, "
                                     "make_mesh, and its collectives inside shard_map)")
    err = ShardingError(
        f"{name}{where} needs torch.distributed's default process group, which ranks "
        f"inside functp.simulate do not have (each owns its own gloo groups); use "
        f"{instead}, which works both here and under torchrun")
    err.__cause__ = e
    return err


class _Stuck(ShardingError):
    """Raised inside a rank found stuck outside any collective (see _stop_stuck)."""


# how long a stuck rank, once told, has to stop before simulate() leaves it behind
_STUCK_GRACE = 2.0
# where a rank that holds the turn is working (functp's code, torch's, an import), not
# waiting for another rank: never reported as stuck
_BUSY = (_world.PACKAGE_DIR, os.path.dirname(os.path.abspath(torch.__file__)),
         "<frozen importlib")


def _stop_stuck(run: _world.Run, finished: list[bool], errors: dict, timeout: float) -> bool:
    """Finds a rank that has held the baton for ``timeout`` seconds, outside any
    collective, while another rank waits for it (its turn, or a collective with it):
    ranks take turns only at collectives, so a rank waiting for something another
    rank does outside functp (a file it writes) would wait forever. Records where it
    is, raises ``_Stuck`` inside it, and returns True once it has had time to stop."""
    now = time.monotonic()
    if run.stuck is not None:
        return now - run.stuck[2] > _STUCK_GRACE
    h, since = run.holder, run.held_since
    if h is None or finished[h] or now - since < timeout:
        return False
    others = [r for r in range(run.size) if r != h]
    # someone waits for it, or a rank failed (torchrun would end the others then);
    # a rank alone after the others returned may take its time
    if not any(not finished[r] or r in errors for r in others):
        return False
    ident = run.threads[h]
    frame = sys._current_frames().get(ident)
    if frame is not None and frame.f_code.co_filename.startswith(_BUSY):
        return False        # inside functp, torch or an import: working, not waiting
    mine = (_world.PACKAGE_DIR, threading.__file__)
    stack = [f for f in (traceback.extract_stack(frame) if frame is not None else [])
             if not f.filename.startswith(mine)]
    where = "".join(traceback.format_list(stack[-4:]))
    run.stuck = (h, where, now, since)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(_Stuck))
    return False


def _raise_stuck(run: _world.Run, errors: dict, orphaned: list[int], nprocs: int,
                 timeout: float) -> None:
    h, where, _, since = run.stuck
    early = {r: v for r, v in errors.items() if r != h and v[0] < since}
    if early:      # a rank failed first: that is the cause; the stuck one was waiting on it
        first = min(early.values(), key=lambda v: v[0])[1]
        if hasattr(first, "add_note"):
            first.add_note(f"rank {h} was then stopped: it ran for {timeout:g} s without "
                           f"reaching a collective")
        _raise_first(early, orphaned, nprocs)
    err = ShardingError(
        f"functp.simulate: rank {h} ran for {timeout:g} s without reaching a collective "
        f"while other ranks waited for it. Simulated ranks take turns at collectives, so "
        f"a rank that waits for something another rank does outside functp (a file it "
        f"writes, a queue, a barrier of its own) waits forever here; exchange it through "
        f"a collective instead, or run the program under torchrun. (A rank that "
        f"computes longer than that between collectives needs a larger "
        f"simulate(..., timeout=).) Rank {h} was at:\n{where.rstrip()}")
    for r in sorted(errors):
        e = errors[r][1]
        if r != h and not isinstance(e, _Stuck):
            err.add_note(f"rank {r} then raised {type(e).__name__}: {first_line(e)[:200]}")
    raise err


def _raise_first(errors: dict, orphaned: list[int], nprocs: int) -> None:
    """Raises the earliest error (the cause; later ones are mostly its consequences)
    with a note naming its rank and summing up the others."""
    order = sorted(errors, key=lambda r: errors[r][0])
    first = errors[order[0]][1]
    note = [f"raised on rank {order[0]} of functp.simulate(..., {nprocs})"]
    for r in order[1:]:
        e = errors[r][1]
        note.append(f"rank {r} also raised {type(e).__name__}: {first_line(e)[:200]}")
    if orphaned:
        note.append(f"ranks {sorted(orphaned)} had returned while the others waited in a "
                    f"collective: the ranks did not issue the same collectives")
    if hasattr(first, "add_note"):
        for line in note:
            first.add_note(line)
    raise first
