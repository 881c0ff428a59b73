"""Named device meshes: ``make_mesh`` and the process group behind every axis tuple."""
from __future__ import annotations

import atexit
import datetime
import itertools
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..runtime import _crosscheck
from ..runtime import _watch
from ..runtime import _world
from ..runtime._errors import ShardingError
from ..runtime._torch_compat import backend_timeout, resolve_process_group

__all__ = ["Mesh", "make_mesh", "AxisGroup"]


@dataclass(frozen=True)
class CheckGroup:
    """The process group of a whole mesh, over which the cross-rank check mode
    (``_crosscheck``) compares what the ranks are about to do."""
    group_name: str
    size: int
    ranks: tuple[int, ...]       # global ranks, in group order
    device: torch.device
    mesh: str                    # the mesh, as printed in errors
    axis_names: tuple[str, ...] = ()    # the mesh's axes, and this rank's place on them:
    coordinate: tuple[int, ...] = ()    # which ranks share a group over some of them
    axis_sizes: tuple[int, ...] = ()    # (the check mode sends a rank's place as one int)


@dataclass(frozen=True)
class AxisGroup:
    """Everything a collective over a tuple of mesh axes needs, resolved once.

    functp's ops take it by ``key`` (a string: op schemas hold no Python objects) and
    keep that key in their autograd context, so a backward never reads ambient state
    (it may run after ``shard_map`` has returned). ``order[i]`` is the process-group
    rank of the member whose index along ``axes`` (major to minor, in the order
    given) is ``i``; ``None`` when they coincide. ``axis_set`` is ``axes`` as a set.
    """
    axes: tuple[str, ...]
    size: int
    index: int
    group_name: str
    order: tuple[int, ...] | None
    check: CheckGroup | None = None
    instance: int = 0          # which of the mesh's groups over these axes this rank is in
    key: str = field(init=False)
    axis_set: frozenset = field(init=False)

    def __post_init__(self) -> None:
        # derived once: collectives read both on every call. The key names everything
        # the ops read from the group, not just the process group and the axes: two
        # meshes over the same ranks with other axis orders share c10d groups, and a
        # key of name and axes alone let the later mesh's member order replace the
        # earlier's in _GROUPS (its all_gather then came back in the wrong order).
        # The check group is read too (the check mode's rows carry its mesh's axes and
        # this rank's coordinates): a 4-d mesh whose 'ep' groups were a 2-d mesh's
        # replaced the 2-d mesh's check group, and its ragged exchange then sent rows
        # of another length than its peers' in one all-gather (gloo aborted, issue 41).
        order = "" if self.order is None else ",".join(map(str, self.order))
        c = self.check
        mesh = "" if c is None else f"|{c.group_name}|{c.mesh}|{','.join(c.axis_names)}|" \
                                    f"{','.join(map(str, c.coordinate))}"
        object.__setattr__(self, "key", f"{self.group_name}|{','.join(self.axes)}|"
                                        f"{self.size}|{self.index}|{order}|{self.instance}"
                                        f"{mesh}")
        object.__setattr__(self, "axis_set", frozenset(self.axes))

    def group_rank(self, i: int) -> int:
        return i if self.order is None else self.order[i]

    def pg(self) -> dist.ProcessGroup:
        return resolve_process_group(self.group_name)


# Every AxisGroup of every mesh, by key: functp's torch ops take a group as a string
# (an op schema has no place for a Python object) and look it up here.
_GROUPS: dict[str, AxisGroup] = {}


def group_of(key: str) -> AxisGroup:
    return _GROUPS[key]


def _subsets(names: tuple[str, ...]):
    """Every non-empty subset of the mesh axes ``names``, in mesh order: each gets its
    process group when the mesh is made."""
    return (sub for k in range(1, len(names) + 1) for sub in itertools.combinations(names, k))


class Mesh:
    """An n-d grid of ranks with named axes, over a ``torch.distributed.DeviceMesh``
    (or, inside :func:`functp.simulate`, over groups functp makes itself).

    Build one with :func:`make_mesh` or :meth:`Mesh.from_device_mesh`. ``mesh.shape``
    maps axis names to sizes; ``mesh.coordinate`` is this rank's position.
    """

    def __init__(self, device_mesh: DeviceMesh):
        names = device_mesh.mesh_dim_names
        if not names:
            raise ShardingError(
                "functp needs a DeviceMesh with named dimensions: build it with "
                "init_device_mesh(..., mesh_dim_names=(...)) or use functp.make_mesh")
        coord = device_mesh.get_coordinate()
        if coord is None:
            raise ShardingError(
                f"this rank ({dist.get_rank()}) is not part of the mesh {device_mesh}; "
                f"every process that calls shard_map must belong to its mesh")
        # Every subset of axes gets its process group up front: creating a group is a
        # collective over the whole world, so doing it lazily inside a step could make
        # ranks disagree (and would break torch.compile tracing).
        groups = {}
        for sub in _subsets(names):
            pg = (device_mesh.get_group(sub[0]) if len(sub) == 1
                  else device_mesh[sub]._flatten().get_group())
            groups[frozenset(sub)] = (pg.group_name, tuple(dist.get_process_group_ranks(pg)))
        self._setup(tuple(names), device_mesh.mesh, tuple(coord), groups,
                    device_mesh.device_type, device_mesh)

    def _setup(self, names: tuple[str, ...], grid: torch.Tensor, coord: tuple[int, ...],
               groups: dict, device_type: str, device_mesh: DeviceMesh | None) -> None:
        """``grid``: the global rank at each mesh position; ``groups``: axis set ->
        (c10d group name, member global ranks in group order)."""
        self.device_mesh = device_mesh     # None inside functp.simulate
        self.axis_names: tuple[str, ...] = names
        self.axis_sizes: tuple[int, ...] = tuple(int(s) for s in grid.shape)
        self.shape: dict[str, int] = dict(zip(self.axis_names, self.axis_sizes))
        self.device_type: str = device_type
        self.coordinate: dict[str, int] = dict(zip(self.axis_names, coord))
        self._groups = groups
        self._positions = {int(r): pos for pos, r in
                           zip(itertools.product(*map(range, self.axis_sizes)),
                               grid.flatten().tolist())}
        self.timeout: datetime.timedelta | None = None     # set by make_mesh / set_timeout
        self._debug_generation = -1      # the check mode's setting last agreed at (_crosscheck)
        whole_name, whole_ranks = groups[frozenset(self.axis_names)]
        self.check = CheckGroup(
            whole_name, math.prod(self.axis_sizes), whole_ranks,
            torch.device("cuda", torch.cuda.current_device()) if self.device_type == "cuda"
            else torch.device(self.device_type), repr(self), self.axis_names, tuple(coord),
            self.axis_sizes)
        # every ordered tuple of axes resolved now, so that a step (compiled or not)
        # only looks groups up: resolving needs host-side work and group queries. A
        # set of axes maps to its tuple in mesh order (what vma's pvary asks for).
        self._axis_groups: dict[tuple[str, ...] | frozenset, AxisGroup] = {}
        for k in range(1, len(self.axis_names) + 1):
            for axes in itertools.permutations(self.axis_names, k):
                ag = self._resolve(axes)
                self._axis_groups[axes] = ag
                _GROUPS[ag.key] = ag
            for axes in itertools.combinations(self.axis_names, k):
                self._axis_groups[frozenset(axes)] = self._axis_groups[axes]

    @classmethod
    def from_device_mesh(cls, device_mesh: DeviceMesh) -> "Mesh":
        """Wraps an existing DeviceMesh (its dimensions must be named)."""
        return cls(device_mesh)

    @property
    def size(self) -> int:
        return math.prod(self.axis_sizes)

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in self.shape.items())
        return f"Mesh({axes}; {self.device_type})"

    def set_timeout(self, timeout: float | datetime.timedelta) -> None:
        """How long a collective on this mesh waits for the other ranks before it
        fails (``ShardingError`` naming the collective); every group of the mesh."""
        td = timeout if isinstance(timeout, datetime.timedelta) else \
            datetime.timedelta(seconds=float(timeout))
        if td.total_seconds() <= 0:
            raise ShardingError(f"make_mesh: timeout must be positive, got {timeout!r}")
        for name in {name for name, _ in self._groups.values()}:
            _world.set_timeout(name, td)
        self.timeout = td

    def _check_axes(self, axis_name, what: str) -> tuple[str, ...]:
        axes = ((axis_name,) if isinstance(axis_name, str) else
                tuple(axis_name) if isinstance(axis_name, (tuple, list)) else ())
        if not axes or not all(isinstance(a, str) for a in axes):
            raise ShardingError(
                f"{what}: axis_name must be a mesh axis name or a non-empty tuple of "
                f"names, got {axis_name!r}")
        for a in axes:
            if a not in self.shape:
                raise ShardingError(
                    f"{what}: unknown mesh axis '{a}'; the mesh has axes "
                    f"{self.axis_names}")
        if len(set(axes)) != len(axes):
            raise ShardingError(f"{what}: axis tuple {axes} names an axis twice")
        return axes

    def axis_group(self, axis_name, what: str = "collective") -> AxisGroup:
        """The resolved group for one axis name, a tuple of them (major to minor) or a
        frozenset of them (in mesh order)."""
        key = ((axis_name,) if isinstance(axis_name, str) else
               tuple(axis_name) if isinstance(axis_name, (tuple, list)) else
               axis_name if isinstance(axis_name, frozenset) else None)
        hit = self._axis_groups.get(key)
        if hit is not None:
            return hit
        self._check_axes(axis_name, what)
        raise AssertionError(f"no group for {key}")   # _check_axes rejects every other key

    def _resolve(self, axes: tuple[str, ...]) -> AxisGroup:
        name, members = self._groups[frozenset(axes)]
        desired = [self._linear(axes, dict(zip(self.axis_names, self._positions[r])))
                   for r in members]
        order = [0] * len(members)
        for g, d in enumerate(desired):
            order[d] = g
        return AxisGroup(axes, math.prod(self.shape[a] for a in axes),
                         self._linear(axes, self.coordinate), name,
                         None if order == list(range(len(order))) else tuple(order),
                         self.check,
                         self._linear([a for a in self.axis_names if a not in axes],
                                      self.coordinate))

    def _linear(self, axes: Sequence[str], coord: dict[str, int]) -> int:
        i = 0
        for a in axes:
            i = i * self.shape[a] + coord[a]
        return i

    def axis_index(self, axis_name) -> int:
        """This rank's index along an axis (a tuple: the flattened index, major first)."""
        return self._linear(self._check_axes(axis_name, "axis_index"), self.coordinate)

    def axis_size(self, axis_name) -> int:
        """Number of ranks along an axis (a tuple: the product of their sizes)."""
        return math.prod([self.shape[a] for a in self._check_axes(axis_name, "axis_size")])


_MESHES: dict[tuple, Mesh] = {}


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# the timeout functp gives a process group it creates (NCCL's default; gloo's is 30 min)
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def _world_timeout() -> datetime.timedelta:
    """The default group's timeout: the one ``init_process_group(timeout=)`` set."""
    world = dist.group.WORLD
    for dev in ("cpu", "cuda"):
        try:
            return backend_timeout(world, dev)
        except Exception:        # noqa: BLE001 - no such backend, or no options on it
            continue
    return DEFAULT_TIMEOUT


def _ensure_process_group(device_type: str, needed: int) -> None:
    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                timeout=DEFAULT_TIMEOUT)
        atexit.register(_end_process_group, dist.group.WORLD)
    elif needed == 1:
        # A one-process mesh needs no launcher: handy for the unsharded reference run.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=DEFAULT_TIMEOUT)
        atexit.register(_end_process_group, dist.group.WORLD)
    else:
        raise ShardingError(
            f"a mesh of {needed} ranks needs {needed} processes, but this one was not "
            f"started by torchrun (RANK and WORLD_SIZE are unset); run "
            f"`torchrun --standalone --nproc-per-node {needed} your_script.py`")


def _end_process_group(world) -> None:
    """At exit: destroys the default process group that functp started (``make_mesh``
    under torchrun), unless the program already did.

    Left to the interpreter's teardown, torch 2.13's gloo aborts the process
    (SIGABRT) at exit. The barrier first: a rank that destroys its groups while a
    peer still uses them can abort that peer. Skipped after an uncaught exception
    (``sys.last_value``): the other ranks may never reach the barrier, and torchrun
    ends them anyway. Never raises: it runs while the interpreter shuts down.

    Then it yields the GIL for a moment (:data:`_EXIT_GRACE` seconds), whoever ended
    the group: a gloo worker thread releases a finished collective's tensors after the
    waiting thread has already moved on, and if the interpreter is finalizing by then
    that thread cannot take the GIL and the process aborts ("terminate called without
    an active exception"). Plain torch does the same on a loaded machine, with no
    functp involved (an all-gather, ``destroy_process_group()``, exit: 8 of 16 runs
    aborted on 2 busy cores, torch 2.11 to 2.15); 10 ms of grace took it to 0 of 16."""
    try:
        if not dist.is_initialized() or dist.group.WORLD is not world:
            _watch.stop()
            return              # destroyed by the program (and perhaps started again)
        try:
            if getattr(sys, "last_value", None) is None and dist.get_world_size() > 1:
                _watch.exiting()     # (a peer still in a call is told: runtime/_watch)
                dist.barrier()
            _watch.stop()       # before the group and the interpreter go
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - at exit: report, do not raise
            print(f"functp: could not end the process group at exit: {e!r}",
                  file=sys.stderr)
        finally:
            _MESHES.clear()     # their groups are gone
    finally:
        time.sleep(_EXIT_GRACE)


# seconds the exit handler lets torch's collective threads finish releasing tensors
_EXIT_GRACE = 0.05


def make_mesh(shape: Sequence[int], axis_names: Sequence[str],
              device_type: str | None = None, *,
              timeout: float | datetime.timedelta | None = None) -> Mesh:
    """Builds a named mesh over all processes, joining the process group if needed.

    **Arguments:** ``shape`` – ranks along each axis (their product must equal the
    world size); ``axis_names`` – one unique name per axis; ``device_type`` – ``"cpu"``
    (gloo) or ``"cuda"`` (nccl), by default cuda when available; ``timeout`` –
    seconds (or a ``timedelta``) a collective waits for the other ranks before it
    raises ``ShardingError`` naming it. By default every group of the mesh gets the
    world group's timeout: the one given to ``init_process_group``, or 10 minutes when
    functp starts the process group (torch's own default for gloo is 30 minutes). On
    NCCL a timed-out collective is also aborted by NCCL's watchdog.

    Calling it again with the same arguments returns the same mesh (groups are made
    once). A process group that ``make_mesh`` started is also ended by functp when
    the program exits (after a barrier, so that exit status 0 stays 0), unless the
    program destroyed it first. Example, under ``torchrun --nproc-per-node 4``::

        mesh = functp.make_mesh((2, 2), ("dp", "tp"))
        mesh.shape        # {'dp': 2, 'tp': 2}
    """
    shape = tuple(int(s) for s in shape)
    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    if len(shape) != len(names):
        raise ShardingError(
            f"make_mesh{shape, names}: {len(shape)} sizes but {len(names)} axis names; "
            f"give one name per mesh axis")
    if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        raise ShardingError(f"make_mesh: axis names {names} must be distinct non-empty strings")
    if any(s < 1 for s in shape):
        raise ShardingError(f"make_mesh: every axis size must be >= 1, got {shape}")
    if _world.dry_run() is not None:         # functp.estimate: no process groups
        return _world.dry_run().make_mesh(shape, names, device_type, timeout)
    if _world.current_run() is not None:
        return _simulated_mesh(shape, names, device_type, timeout)
    device_type = device_type or _default_device_type()
    _ensure_process_group(device_type, math.prod(shape))
    world = dist.get_world_size()
    _check_world(shape, names, world)
    key = (shape, names, device_type, id(dist.group.WORLD))
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = _MESHES[key] = Mesh(init_device_mesh(device_type, shape, mesh_dim_names=names))
        # DeviceMesh's subgroups get torch's default timeout, not the world's
        mesh.set_timeout(timeout if timeout is not None else _world_timeout())
    elif timeout is not None:
        mesh.set_timeout(timeout)
    _agree_check_mode(mesh)
    return mesh


def _agree_check_mode(mesh: Mesh) -> None:
    # (every rank makes its meshes at the same point: the check mode's setting is
    # compared there, not in the middle of a step)
    if mesh._debug_generation != _crosscheck.GENERATION:
        _crosscheck.agree_mode(mesh)


def _check_world(shape: tuple[int, ...], names: tuple[str, ...], world: int) -> None:
    if math.prod(shape) != world:
        raise ShardingError(
            f"make_mesh{shape, names}: the mesh has {math.prod(shape)} ranks but the world "
            f"has {world} processes; choose a shape whose sizes multiply to {world}")


def _simulated_mesh(shape: tuple[int, ...], names: tuple[str, ...], device_type: str | None,
                    timeout) -> Mesh:
    """make_mesh inside functp.simulate: gloo groups functp makes for this thread's rank
    (ranks laid out row-major, as init_device_mesh does), cached per simulated rank."""
    if device_type not in (None, "cpu"):
        raise ShardingError(
            f"make_mesh(device_type={device_type!r}) inside functp.simulate: simulated "
            f"ranks share this process and run on the CPU (gloo); leave device_type out")
    _check_world(shape, names, _world.process_count())
    cache = _world.meshes()
    mesh = cache.get((shape, names))
    if mesh is None:
        grid = torch.arange(_world.process_count()).reshape(shape)
        coord = tuple(int(c[0]) for c in (grid == _world.process_index()).nonzero(as_tuple=True))
        groups = {}
        for sub in _subsets(names):
            at = tuple(slice(None) if a in sub else c for a, c in zip(names, coord))
            members = tuple(grid[at].flatten().tolist())
            # the whole mesh is the world group
            tag = "world" if len(sub) == len(names) else "mesh"
            groups[frozenset(sub)] = (_world.new_group(members, tag), members)
        mesh = cache[(shape, names)] = Mesh.__new__(Mesh)
        mesh._setup(names, grid, coord, groups, "cpu", None)
        mesh.timeout = _world.current_run().timeout
    if timeout is not None:
        mesh.set_timeout(timeout)
    _agree_check_mode(mesh)
    return mesh


def forget_groups(prefix: str) -> None:
    """Drops the registered axis groups whose c10d names start with ``prefix`` (those
    of a finished simulation)."""
    for key in [k for k, g in _GROUPS.items() if g.group_name.startswith(prefix)]:
        del _GROUPS[key]
