"""Failing on every rank together: a checkpoint step that fails on some ranks only
raises a :class:`CheckpointError` on all of them (a flag all-reduce after each such
step), so that no rank goes on alone into DCP's collectives and waits there forever;
DCP's own failures, gathered by DCP, are raised as :class:`CheckpointError` too."""
from __future__ import annotations

import functools
import importlib.util
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..mapping._sharding import _broadcast_pickled
from ..runtime import _world
from ..runtime._errors import CheckpointError, ShardingError, first_line
from ..runtime._torch_compat import CheckpointException

__all__ = ["need_numpy", "describe_cause", "dcp_call", "all_ok", "peer_loss"]

def need_numpy(what: str) -> None:
    """DCP's object collectives call ``Tensor.numpy()``, and torch's CPU wheel does not
    install numpy: without it they fail mid-save on some step. Checked before any
    communication (the ranks share one environment, so all of them raise)."""
    if importlib.util.find_spec("numpy") is None:
        raise CheckpointError(f"{what} needs numpy (torch.distributed.checkpoint uses it); "
                              f"pip install numpy")


def describe_cause(e: BaseException) -> str:
    """``Type: first line`` of an error this one reports."""
    line = first_line(e)
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


def dcp_call(what: str, path: str, fn: Callable[[], Any], ranks: bool = True) -> Any:
    """``fn()`` (a DCP call) with its failures raised as :class:`CheckpointError`.

    DCP gathers a failure on any rank into a ``CheckpointException`` raised on every
    rank: a ``BaseException`` whose text starts ``CheckpointException ranks:...``; its
    ``failures`` maps each failed rank to ``(exception, traceback)``. The first failed
    rank's exception is the cause the message names; DCP's report is chained.
    """
    try:
        return fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        cause, where, more = e, "", ""
        if isinstance(e, CheckpointException) and e.failures:
            failures = {r: (f.exc if hasattr(f, "exc") else f[0] if isinstance(f, tuple) else f)
                        for r, f in e.failures.items()}
            me = dist.get_rank() if ranks and dist.is_initialized() else 0
            if isinstance(failures.get(me), (KeyboardInterrupt, SystemExit)):
                raise failures[me] from None     # DCP wrapped this rank's own interrupt
            cause = failures[min(failures)]
            if ranks:
                where = f" on rank {min(failures)}"
            if ranks and len(failures) > 1:
                more = (f"\nranks {sorted(failures)} failed; every rank's traceback is in "
                        f"the chained CheckpointException")
        if isinstance(cause, CheckpointError):     # functp's own, raised inside DCP
            raise CheckpointError(str(cause)) from e
        raise CheckpointError(f"{what}: {describe_cause(cause)}{where} ({path}){more}") from e


def all_ok(what: str, path: str, device: torch.device | None, fn: Callable[[], Any]) -> Any:
    """``fn()`` on every rank, then one flag all-reduce over the world.

    If ``fn`` raised on some rank, every rank raises: that rank its own error (a
    :class:`ShardingError` as it is, anything else as a :class:`CheckpointError`), the
    others a :class:`CheckpointError` naming the first failed rank and its error's
    first line. ``device`` – where the flag lives (the mesh's device); ``None`` – one
    process, no communication.
    """
    err = None
    out = None
    try:
        out = fn()
    except ShardingError as e:
        err = e
    except Exception as e:     # noqa: BLE001 - an OSError, say: a CheckpointError here
        err = CheckpointError(f"{what}: {describe_cause(e)} ({path})")
        err.__cause__ = e
    if device is None:
        if err is not None:
            raise err
        return out
    world = dist.get_world_size()
    flag = torch.tensor([world if err is None else dist.get_rank()], dtype=torch.int64,
                        device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    first = int(flag)
    if first == world:
        return out
    line = _broadcast_pickled(str(err).split("\n", 1)[0] if err is not None else "", first,
                              device)
    if err is not None:
        raise err
    line = line.removeprefix(f"{what}: ")
    raise CheckpointError(f"{what}: rank {first} failed: {line}"
                          + ("" if path in line else f" ({path})"))


def peer_loss(what: str) -> Callable:
    """``save``/``load`` with a lost or stalled peer (gloo's raw error from one of the
    world's flag all-reduces or broadcasts) raised as a :class:`CheckpointError`
    naming the operation and the timeout (``_world.peers``)."""
    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with _world.peers(what, cls=CheckpointError):
                return fn(*args, **kwargs)
        return wrapped
    return deco
