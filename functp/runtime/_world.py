"""Who this rank is: a process of ``torch.distributed``'s default group, or a rank that
:func:`functp.simulate` runs in a thread of this process.

A simulated rank owns real gloo process groups, made by functp over one in-memory
store and registered with c10d under names no other rank uses, so the functional
c10d ops functp's collectives issue run unchanged (and add in gloo's order). Nothing
of torch's global ``torch.distributed`` state is touched: a simulated rank has no
default group, which is why DTensor and checkpoints are not available in one.

Simulated ranks take turns: one runs at a time, holding the run's baton, and hands it
on only where it blocks (a collective's wait, making a group). What a process would
own alone but a thread shares is swapped at each hand-over: torch's and Python's
random number generators and the default dtype, so ``torch.manual_seed(0)`` then
``torch.randn`` gives every rank the same numbers, as under torchrun.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import random
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from ._errors import ShardingError, first_line

# where functp's own code lives: frames from here are functp's, not the user's (the check
# mode's call sites, simulate's stuck-rank report, estimate's host reads)
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from ._torch_compat import (backend_timeout, c10d_functional as _c10d, cpu_group,
                            forward_ad, gloo_backend, set_group_timeout,
                            unregister_process_group)

# True while some simulate() runs: the one test the hot path pays for waits
SIMULATING = False


@dataclass
class Run:
    """One :func:`functp.simulate` call: what its ranks share."""
    id: int
    size: int
    timeout: datetime.timedelta
    store: dist.Store = field(default_factory=dist.HashStore)
    # per rank: c10d group names registered (unregistered when the rank ends), the
    # groups themselves (their only owner, so that dropping them closes gloo's
    # sockets and unblocks peers waiting on this rank), and since when the rank
    # waits in a collective (None: not waiting)
    names: list = field(default_factory=list)
    groups: list = field(default_factory=list)
    waiting: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    baton: threading.Lock = field(default_factory=threading.Lock)
    state: list = field(default_factory=list)      # per rank: what hold() restores
    meshes: list = field(default_factory=list)     # per rank: make_mesh's cache
    # One gloo device (one loopback event loop) for all of the run's groups, and one
    # worker thread per group: with a device and two workers per group, as gloo
    # makes by default, an in-process all-reduce took 3.2 ms on 4 ranks (thread
    # wake-ups on 2 cores); shared, 0.7 ms
    device: object = None
    # the rank holding the baton and since when; each rank's thread; set once a rank
    # is found stuck outside any collective: (rank, where), and the ranks then fail
    holder: int | None = None
    held_since: float = 0.0
    threads: list = field(default_factory=list)
    stuck: tuple | None = None

    def __post_init__(self) -> None:
        self.names = [[] for _ in range(self.size)]
        self.groups = [[] for _ in range(self.size)]
        self.waiting = [None] * self.size
        self.meshes = [{} for _ in range(self.size)]
        self.threads = [None] * self.size

    def start(self, timeout: datetime.timedelta) -> None:
        """Readies the run for a program: every rank starts with the caller's random
        state and default dtype, and groups made earlier wait ``timeout``."""
        self.state = [process_state()] * self.size
        # every time: a program may have changed some with make_mesh(timeout=)
        self.timeout = timeout
        for rank_names in self.names:
            for name in rank_names:
                set_timeout(name, timeout)
        for rank_meshes in self.meshes:
            for mesh in rank_meshes.values():
                mesh.timeout = timeout

    def hold(self, rank: int) -> None:
        """Rank ``rank`` runs: takes the baton and its process-like state."""
        self.baton.acquire()
        if self.stuck is not None and self.stuck[0] != rank:
            self.baton.release()
            raise ShardingError(
                f"functp.simulate: rank {self.stuck[0]} was stuck outside any collective "
                f"(see its error); rank {rank} stops here")
        restore_state(self.state[rank])
        self.holder, self.held_since = rank, time.monotonic()

    def release(self, rank: int) -> None:
        """Rank ``rank`` blocks or ends: keeps its state and hands the baton on."""
        if self.holder != rank:       # (hold() refused it the baton: the run failed)
            return
        self.state[rank] = process_state()
        self.holder = None
        self.baton.release()

    def close(self, rank: int) -> None:
        """Drops ``rank``'s groups: peers blocked on it fail at once ("connection
        closed by peer") instead of waiting out the timeout."""
        with self.lock:
            for name in self.names[rank]:
                unregister_process_group(name)
            self.names[rank] = []
            self.groups[rank] = []


def process_state() -> tuple:
    """What a process owns alone but threads share: the random generators' states
    and the default dtype."""
    return torch.get_rng_state(), random.getstate(), torch.get_default_dtype()


def restore_state(state: tuple) -> None:
    """Makes ``state`` (from :func:`process_state`) current."""
    torch.set_rng_state(state[0])
    random.setstate(state[1])
    torch.set_default_dtype(state[2])


class _Local(threading.local):
    def __init__(self) -> None:
        self.run: Run | None = None
        self.rank = 0
        self.dry = None      # the functp.estimate rank this thread traces (its .rank, .size)


_local = _Local()

# Runs whose programs ended cleanly keep their groups for the next simulate() of the
# same size: making gloo groups is most of a short simulation's cost (~1 s for a
# 3-d mesh of 8 ranks), and the groups are as good as new after a clean end.
_idle: dict[int, Run] = {}
_idle_lock = threading.Lock()
_ids = iter(range(1 << 62))


def take_run(size: int, timeout: datetime.timedelta) -> Run:
    """A run of ``size`` ranks: an idle one, or a new one."""
    with _idle_lock:
        run = _idle.pop(size, None)
        if run is None:
            run = Run(next(_ids), size, timeout)
    run.start(timeout)
    return run


def take_all_idle() -> list[Run]:
    """Every idle run, no longer kept."""
    with _idle_lock:
        runs = list(_idle.values())
        _idle.clear()
    return runs


def keep_run(run: Run) -> Run | None:
    """Keeps a cleanly ended run for reuse; returns the idle run it replaces, if any."""
    with _idle_lock:
        old, _idle[run.size] = _idle.get(run.size), run
    return old


def current_run() -> Run | None:
    """The simulation this thread is a rank of, or None."""
    return _local.run


def enter(run: Run, rank: int) -> None:
    _local.run, _local.rank = run, rank
    run.threads[rank] = threading.get_ident()
    world_group()          # every rank has a world group: made now, by every rank


def leave() -> None:
    _local.run, _local.rank = None, 0


def dry_run():
    """The :func:`functp.estimate` rank this thread traces on fake tensors, or None."""
    return _local.dry


def set_dry_run(dry) -> None:
    _local.dry = dry


def meshes() -> dict | None:
    """make_mesh's cache for this simulated rank; None outside a simulation."""
    return _local.run.meshes[_local.rank] if _local.run is not None else None


def world_group() -> str:
    """The c10d name of the group of every rank."""
    if _local.run is None:
        return dist.group.WORLD.group_name
    return new_group(tuple(range(_local.run.size)), "world")


def new_group(members: tuple[int, ...], tag: str) -> str:
    """A gloo group of ``members`` (global ranks, in group order) for this simulated
    rank; its c10d name. Every member calls it with the same arguments."""
    run, me = _local.run, _local.rank
    name = f"functp_sim{run.id}_{tag}_{'-'.join(map(str, members))}_r{me}"
    if name in run.names[me]:
        return name
    prefix = dist.PrefixStore(f"{tag}/{'-'.join(map(str, members))}/", run.store)
    grank = members.index(me)
    if run.device is None:     # (made while this rank holds the baton: once)
        run.device = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    run.release(me)            # the other members must run to join the group
    try:
        backend = gloo_backend(prefix, grank, len(members), run.device, run.timeout)
    finally:
        run.hold(me)
    pg = cpu_group(prefix, grank, len(members), backend, name)
    with run.lock:
        run.names[me].append(name)
        run.groups[me].append(pg)
    return name


def set_timeout(name: str, timeout: datetime.timedelta) -> None:
    """Sets how long collectives of the c10d group ``name`` (simulated or not) wait."""
    set_group_timeout(name, timeout)


def check_collective() -> None:
    """Before a simulated rank issues a collective: what cannot be simulated, besides
    torch.compile (``_compile.check_collective`` refuses that, then calls this)."""
    if _local.run is None:
        return
    if forward_ad._current_level >= 0:
        # torch keeps one forward-AD level per process: ranks taking turns inside
        # their jvps would enter and leave it out of order and corrupt each other's
        raise ShardingError(
            "forward-mode AD (torch.func.jvp, jacfwd, torch.autograd.forward_ad) "
            "around a collective cannot run inside functp.simulate: torch has one "
            "forward-AD level per process, which simulated ranks would share; run "
            "it under torchrun (reverse mode, vmap and tape autograd are fine)")


def wait(t: torch.Tensor) -> torch.Tensor:
    """``wait_tensor`` that tells a simulation this rank is blocked meanwhile."""
    run = _local.run
    if run is None:
        return _c10d.wait_tensor(t)
    me = _local.rank
    run.release(me)            # the other ranks must run to reach this collective
    run.waiting[me] = time.monotonic()
    try:
        return _c10d.wait_tensor(t)
    finally:
        run.waiting[me] = None
        run.hold(me)


def _world_timeout() -> str:
    """How long the world group waits, as words (the message of a lost peer)."""
    try:
        t = (_local.run.timeout if _local.run is not None
             else backend_timeout(dist.group.WORLD, device().type))
        return f"{t.total_seconds():g} s"
    except Exception:         # noqa: BLE001 - the timeout is a courtesy in a message
        return "the process group's timeout"


@contextlib.contextmanager
def peers(what: str, peer: int | None = None, cls: type = ShardingError):
    """Around a world-group operation (``what``, as the user called it): a backend's
    error from waiting on the others (gloo's "Timed out waiting ...", "Connection
    closed by peer") raised as ``cls`` naming the operation, the ``peer`` it waited
    for (when known) and the timeout, as a failed collective's is. Example::

        with peers("functp.print_ranks"):
            texts = all_gather_bytes(data)
    """
    try:
        yield
    except RuntimeError as e:    # (functp's own errors are ValueErrors: passed on)
        reason = re.sub(r"^\[[^\]]*\]\s*", "", first_line(e))[:200] or type(e).__name__
        who = f"rank {peer}" if peer is not None else "a rank"
        err = cls(
            f"{what} failed: {reason}. It waits for every rank of the world, and {who} "
            f"did not join it within the timeout ({_world_timeout()}), or exited: check "
            f"that every rank calls {what} at the same point of the program and that "
            f"none raised or returned before it (its own error says why); "
            f"make_mesh(..., timeout=seconds) sets how long to wait")
        err.__functp_agreed__ = True     # (past agreeing: a peer is gone)
        raise err from e


def broadcast(t: torch.Tensor, src: int) -> torch.Tensor:
    """``t`` of global rank ``src`` on every rank (same shape and dtype on all)."""
    if process_count() == 1:
        return t
    return wait(_c10d.broadcast(t.contiguous(), src, world_group()))


def device() -> torch.device:
    """Where the world group's tensors live: the GPU of this rank under NCCL."""
    if _local.run is None and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's ``data``, in rank order (lengths may differ)."""
    n = process_count()
    if n == 1:
        return [data]
    g, dev = world_group(), device()
    mine = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    lens = wait(_c10d.all_gather_into_tensor(mine, n, g)).tolist()
    buf = torch.zeros(max(lens), dtype=torch.uint8)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = wait(_c10d.all_gather_into_tensor(buf.to(dev), n, g)).view(n, -1).cpu()
    return [bytes(out[r, :lens[r]].tolist()) for r in range(n)]


def require_torch_distributed(what: str) -> None:
    """Raises for features that need torch.distributed's default group."""
    if _local.run is not None:
        raise ShardingError(
            f"{what} is not available inside functp.simulate: it needs "
            f"torch.distributed's default process group (DTensor, DeviceMesh, "
            f"distributed checkpoints), which simulated ranks do not have; run this "
            f"part under torchrun")


def process_index() -> int:
    """This process's rank in the world: ``torch.distributed.get_rank()``, or the
    simulated rank inside :func:`functp.simulate` (where torch's own ``get_rank`` has
    no default group to ask); torchrun's ``RANK`` before the process group exists,
    0 with neither.

    Example::

        functp.simulate(lambda: functp.process_index(), 3)     # [0, 1, 2]
    """
    if _local.run is not None:
        return _local.rank
    if _local.dry is not None:
        return _local.dry.rank
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def process_count() -> int:
    """The number of ranks in the world (``torch.distributed.get_world_size()``, or
    ``nprocs`` inside :func:`functp.simulate`); torchrun's ``WORLD_SIZE`` before the
    process group exists, 1 with neither."""
    if _local.run is not None:
        return _local.run.size
    if _local.dry is not None:
        return _local.dry.size
    return (dist.get_world_size() if dist.is_initialized()
            else int(os.environ.get("WORLD_SIZE", 1)))
