"""A small all-gather between processes by point-to-point messages through the
group's first rank: every rank sends it its rows, it sends the whole table back.

For the few numbers functp's agreements exchange (the check mode's fingerprints
before every collective, a pipeline's agreement and close), latency is all that
counts, and gloo's all-gather is a ring, ``size - 1`` messages deep, each a wakeup
of the next process. Measured on 4 CPU processes on this project's 2-core machine
(7 float64 numbers a rank, 300 calls): the all-gather 4.0 ms and 1.5 ms of CPU a
rank and call, the star 0.56 ms and 0.14-0.44 ms. It keeps the all-gather's order
(the table's rows are the group's ranks in order) and its timeout (each wait is the
process group's). Not under ``functp.simulate`` (its groups are not torch's
point-to-point peers) and not for NCCL groups, whose all-gather is a kernel.
"""
from __future__ import annotations

from typing import Callable

import torch

from ._torch_compat import backend_timeout

__all__ = ["gather"]


def gather(t: torch.Tensor, pg,
           wait: Callable[[Callable[[], None]], None] = lambda block: block(),
           ) -> Callable[[], torch.Tensor]:
    """Starts gathering ``t`` (the same shape on every rank) from the ranks of ``pg``.

    **Arguments:** ``pg`` – the process group (its first rank, group rank 0, is the
    centre); ``wait`` – runs the function that waits (the caller's, to watch or name
    the wait). Each work is waited for with the group's timeout (gloo's
    point-to-point waits otherwise keep the one it was made with, not a mesh's
    ``timeout=``).

    **Returns:** a function that waits and returns every rank's ``t`` concatenated
    on dimension 0 in group-rank order, as ``all_gather_into_tensor`` would. Every
    rank must call it before its next exchange over ``pg``.

    Example (every process of a 2-process gloo job)::

        table = gather(torch.tensor([[float(rank)]]), torch.distributed.group.WORLD)()
        # tensor([[0.], [1.]])
    """
    t = t.contiguous()
    n, size = t.shape[0], pg.size()
    timeout = backend_timeout(pg, "cpu")

    def until(works) -> Callable[[], None]:
        def block() -> None:
            for w in works:
                w.wait(timeout)
        return block
    table = t.new_empty((size * n, *t.shape[1:]))
    # (the group's own send and recv, by group rank: ``dist.isend``'s checks and rank
    # translation cost ~150 Python calls a message)
    if pg.rank() != 0:
        works = [pg.send([t], 0, 0), pg.recv([table], 0, 0)]

        def received() -> torch.Tensor:
            wait(until(works))
            return table
        return received
    table[:n] = t
    got = [pg.recv([table[i * n:(i + 1) * n]], i, 0) for i in range(1, size)]

    def sent() -> torch.Tensor:
        wait(until(got))
        wait(until([pg.send([table], i, 0) for i in range(1, size)]))
        return table
    return sent
