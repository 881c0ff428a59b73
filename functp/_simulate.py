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
import datetime
import threading
import time
from typing import Any, Callable


from . import _crosscheck, _mesh, _world
from ._errors import ShardingError, first_line

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

    def rank_main(r: int) -> None:
        run.hold(r)
        try:
            _world.enter(run, r)
            results[r] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - every rank's error goes to the caller
            errors[r] = (time.monotonic(), e)
        finally:
            _world.leave()
            run.release(r)
        if r in errors:
            run.close(r)            # peers blocked on this rank fail at once
        finished[r] = True

    with _lock:
        _running[0] += 1
        _world.SIMULATING = True
        previous = _crosscheck.set_debug(check) if check is not None else None
    caller = _world.process_state()
    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True,
                                name=f"functp-rank-{r}") for r in range(nprocs)]
    try:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            threads[[t.is_alive() for t in threads].index(True)].join(0.05)
            _unblock_orphans(run, finished, orphaned)
    finally:
        with _lock:
            _running[0] -= 1
            _world.SIMULATING = _running[0] > 0
            if previous is not None:
                _crosscheck.set_debug(previous)
        if errors or orphaned or any(t.is_alive() for t in threads):
            _discard(run)
        else:
            old = _world.keep_run(run)
            if old is not None:
                _discard(old)
        _world.restore_state(caller)     # the ranks' draws are theirs, not the caller's
    if errors:
        _raise_first(errors, orphaned, nprocs)
    return results


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
