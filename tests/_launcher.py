"""A pool of gloo worker processes that runs test bodies on every rank.

Starting processes and process groups is the slow part of a distributed test, so a
pool per world size lives for the whole session and runs one test body after the
other, and its processes are forked from a forkserver that has imported torch and
transformers once (``_PRELOAD``) rather than each importing them afresh (spawn): a
pool's start costs a fork, not ~2.5 s of CPU a rank. A body is a module-level
function (pickled by reference); every rank runs it and sends back its return value
or its traceback. A failure or a hang tears the pool
down (a failed collective can leave ranks out of step) and the next test starts a
fresh one; nothing waits forever.
"""
from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results) -> None:
    # the cross-rank check mode is on in every test unless FUNCTP_DEBUG=0 is given
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
                      FUNCTP_DEBUG=os.environ.get("FUNCTP_DEBUG", "1"))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args = item
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # noqa: BLE001 - everything goes back to the driver
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


# What every worker imports, imported once by the forkserver the workers are forked
# from (~2.5 s of CPU a worker otherwise, on this 2-core machine: torch, DTensor, which
# functp's placement types pull in, and transformers). Not functp itself: it reads
# FUNCTP_DEBUG at import, which _worker sets after the fork
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "transformers"]


class Pool:
    def __init__(self, world: int):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        self.world = world
        self.tasks = [ctx.SimpleQueue() for _ in range(world)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.tasks[r], self.results),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, args=(), timeout: float = 300.0):
        for q in self.tasks:
            q.put((fn, args))
        done: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout
        while len(done) < self.world:
            try:
                rank, ok, val = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            done[rank] = (ok, val)
            if not ok:  # the others may be stuck in a collective: give them a moment
                deadline = min(deadline, time.monotonic() + 10)
        failed = [(r, v) for r, (ok, v) in sorted(done.items()) if not ok]
        missing = [r for r in range(self.world) if r not in done]
        if failed or missing:
            self.close(force=True)
            msg = [f"{fn.__name__} on {self.world} ranks:"]
            msg += [f"--- rank {r} raised:\n{v}" for r, v in failed[:2]]
            if missing:
                msg.append(f"--- ranks {missing} did not finish (hang or crash)")
            raise AssertionError("\n".join(msg))
        return [done[r][1] for r in range(self.world)]

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
