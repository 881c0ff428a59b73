"""``estimate``: a dry run of an SPMD program on fake tensors — what one step issues,
computes and holds on a rank, without running it on the ranks.

The program runs as it would inside :func:`functp.simulate`, for one rank at a time,
under torch's ``FakeTensorMode``: tensors carry shapes, dtypes and devices but no
data, and ``make_mesh`` builds a mesh with no process groups behind it (the c10d
functional ops functp issues have fake kernels: they return the right shapes and
move nothing). What is measured is measured with torch's own counters on that run:
``comm_log`` for the collectives, ``FlopCounterMode`` for FLOPs, ``MemTracker`` for
memory. They see the same operators, in the same order, as on a real run, which is
why the collectives and FLOPs are exact and the memory close.
"""
from __future__ import annotations

import itertools
import linecache
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import optree
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from . import _comm_log, _crosscheck, _mesh, _world
from ._errors import ShardingError

__all__ = ["estimate", "Estimate", "RankEstimate"]

_ids = itertools.count()
_functorch = torch._C._functorch
_PKG = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
# operators that move or relabel data but compute nothing: not "uncounted"
_NO_COMPUTE = {"aten.detach", "aten.clone", "aten.copy_", "aten._to_copy", "aten.copy",
               "aten.lift_fresh", "aten.lift_fresh_copy", "aten._local_scalar_dense",
               "aten.empty_like", "aten.zeros_like", "aten.ones_like", "aten.full_like",
               "aten.new_empty", "aten.new_zeros", "aten.new_ones", "aten.new_full",
               "aten.empty_strided", "aten.zero_", "aten.fill_", "aten.cat", "aten.stack",
               "aten.index", "aten.index_select", "aten.gather", "aten.constant_pad_nd",
               "aten.slice_scatter", "aten.select_scatter", "aten.clone", "aten.contiguous"}


class _OpRecorder(TorchDispatchMode):
    """Below ``FlopCounterMode``: every operator it lets through (after its
    decompositions), with the FLOPs torch's formula gives this call and the bytes
    the call reads and writes (for the time model)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, int]] = []    # (operator, flops, bytes)
        self.uncounted: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func._overloadpacket)
        formula = flop_registry.get(func._overloadpacket)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        nbytes = sum(t.numel() * t.element_size() for t in
                     optree.tree_leaves((args, kwargs, out), none_is_leaf=True)
                     if isinstance(t, torch.Tensor))
        self.calls.append((name, flops, nbytes))
        if (formula is None and not func.is_view and func.namespace == "aten"
                and name not in _NO_COMPUTE
                and any(isinstance(t, torch.Tensor) for t in optree.tree_leaves(args))):
            self.uncounted[name] = self.uncounted.get(name, 0) + 1
        return out


class _Tracker(MemTracker):
    """torch's ``MemTracker`` without its per-module snapshots, which a training step
    cannot use: it refuses a second call of the root module (a second step), and it
    reads the storage of a module's parameters, which under ``torch.func`` are
    functorch wrappers without one. Module parameters and buffers are still filed as
    such (the tensors the wrappers stand for); the totals are MemTracker's own."""

    def _pre_fw_hook(self, module, inputs) -> None:
        for kind, tensors in ((_MemRefType.PARAM, module.parameters(recurse=False)),
                              (_MemRefType.BUFFER, module.buffers(recurse=False))):
            for t in tensors:
                while _functorch.is_functorch_wrapped_tensor(t):
                    t = _functorch.get_unwrapped(t)
                if not _functorch.is_batchedtensor(t):
                    self._update_and_maybe_create_winfos(t, kind)

    def _post_fw_hook(self, module, inputs, outputs) -> None:
        pass

    def _pre_bw_hook(self, module, args) -> None:
        pass

    def _post_bw_hook(self, module, args) -> None:
        pass


class _DryRank:
    """The rank an estimate traces: what ``process_index``/``process_count`` answer
    and what ``make_mesh`` builds inside it (``_world.dry_run()`` returns it)."""

    def __init__(self, rank: int, size: int, prefix: str):
        self.rank, self.size, self.prefix = rank, size, prefix
        self.meshes: dict[tuple, _mesh.Mesh] = {}

    def make_mesh(self, shape, names, device_type, timeout) -> _mesh.Mesh:
        """make_mesh in a dry run: the mesh of a real run, over groups that are names
        only (nothing resolves them: the fake collectives need their sizes)."""
        if device_type not in (None, "cpu"):
            raise ShardingError(
                f"make_mesh(device_type={device_type!r}) inside functp.estimate: the "
                f"dry run traces on CPU fake tensors; leave device_type out (the "
                f"hardware profile, not the device type, says what the step costs)")
        _mesh._check_world(shape, names, self.size)
        mesh = self.meshes.get((shape, names))
        if mesh is not None:
            return mesh
        with _disable_current_modes():       # the rank grid is host data, not the step's
            grid = torch.arange(self.size).reshape(shape)
            coord = tuple(int(c[0]) for c in (grid == self.rank).nonzero(as_tuple=True))
            groups = {}
            for sub in _mesh._subsets(names):
                at = tuple(slice(None) if a in sub else c for a, c in zip(names, coord))
                members = tuple(grid[at].flatten().tolist())
                groups[frozenset(sub)] = (
                    f"{self.prefix}{'-'.join(map(str, members))}_r{self.rank}", members)
            mesh = _mesh.Mesh.__new__(_mesh.Mesh)
            mesh._setup(names, grid, coord, groups, "cpu", None)
        mesh._debug_generation = _crosscheck.GENERATION   # (the check mode is off here)
        self.meshes[(shape, names)] = mesh
        return mesh


@dataclass
class RankEstimate:
    """What one rank's step issues, computes and holds.

    ``comm``: a :class:`functp.comm_log` of every collective, as a real run records
    it; ``flops``: the total ``FlopCounterMode`` counts, ``flops_by_op`` per operator;
    ``uncounted``: ``{operator: calls}`` of the compute operators that have no FLOP
    formula in torch (counted as 0 there: listed, so that a total is never silently
    short).
    """
    rank: int
    comm: _comm_log.comm_log
    flops: int
    flops_by_op: dict[str, int]
    uncounted: dict[str, int]
    peak_bytes: int
    memory: dict[str, int]
    calls: list = field(default_factory=list, repr=False)
    result: Any = field(default=None, repr=False)


@dataclass
class Estimate:
    """The result of :func:`estimate`: one :class:`RankEstimate` per traced rank.

    ``est.ranks`` lists the traced ranks; ``est[r]`` is rank ``r``'s estimate, and
    ``est.comm``, ``est.flops``, ``est.peak_bytes`` (every field of
    :class:`RankEstimate`) are the first traced rank's.
    """
    nprocs: int
    per_rank: dict[int, RankEstimate] = field(default_factory=dict)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.per_rank)

    def __getitem__(self, rank: int) -> RankEstimate:
        return self.per_rank[rank]

    def __getattr__(self, name: str):
        # est.comm, est.flops, est.peak_bytes, ...: those of the first traced rank
        if name in RankEstimate.__dataclass_fields__ and self.per_rank:
            return getattr(self.per_rank[self.ranks[0]], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def estimate(fn: Callable[..., Any], nprocs: int, *args: Any,
             ranks: Sequence[int] = (0,), **kwargs: Any) -> Estimate:
    """Runs ``fn(*args, **kwargs)`` as rank 0 (and ``ranks``) of ``nprocs`` on fake
    tensors, and reports what each traced rank's step issues and computes.

    The program is the one :func:`functp.simulate` runs: ``make_mesh``, ``shard``,
    ``parallelize``, ``shard_map``, collectives, ``torch.func.grad`` or tape backward
    and optimizer steps all work inside, but every tensor made inside is a fake
    (``FakeTensorMode``: shape, dtype, device, no data), the mesh has no process
    groups, and no byte moves. Tensors passed in ``args``/``kwargs`` are used as
    fakes of themselves.

    Which ranks to trace: ranks whose programs differ only in which block they hold
    issue the same collectives and FLOPs, so rank 0 stands for all of them. Trace
    more (``ranks=``) where the program branches on the rank: pipeline stages (each
    stage its own layers), uneven blocks (the last rank's smaller one), ``ppermute``
    with pairs that leave some ranks out, a rank-dependent loss.

    **Arguments:** ``fn`` – the per-rank program; ``nprocs`` – the number of ranks
    it is written for; ``ranks`` – which ranks to trace (default rank 0);
    ``*args``/``**kwargs`` – passed to ``fn``.

    **Returns:** an :class:`Estimate`: ``est.comm`` (a ``comm_log``), ``est.flops``
    of rank 0, and ``est[r]`` for each traced rank ``r`` in ``est.ranks``.

    Example::

        def program():
            mesh = functp.make_mesh((4,), ("tp",))
            w = functp.shard(torch.randn(4096, 1024), mesh, P("tp"))
            f = functp.shard_map(lambda w, x: functp.psum(x @ w, "tp"), mesh,
                                 in_specs=(P("tp"), P(None, "tp")), out_specs=P())
            x = functp.shard(torch.randn(8, 4096), mesh, P(None, "tp"))
            return f(w, x)

        est = functp.estimate(program, 4)
        est.comm.summary()       # {('all_reduce', ('tp',)): 1}
        est.flops                # 2 * 8 * 1024 * 1024 = 16777216
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ShardingError(f"functp.estimate: nprocs must be a positive int, got {nprocs!r}")
    ranks = sorted(set(int(r) for r in ranks))
    if not ranks or not all(0 <= r < nprocs for r in ranks):
        raise ShardingError(f"functp.estimate: ranks={list(ranks)} must be ranks of the "
                            f"world, 0 to {nprocs - 1}")
    if _world.current_run() is not None or _world.dry_run() is not None:
        raise ShardingError("functp.estimate was called inside a simulated or estimated "
                            "rank; call it once, from outside the program")
    est = Estimate(nprocs)
    for r in ranks:
        est.per_rank[r] = _trace(fn, nprocs, r, args, kwargs)
    return est


def _trace(fn, nprocs: int, rank: int, args, kwargs) -> RankEstimate:
    """Runs ``fn`` once as ``rank``, on fake tensors, under torch's counters."""
    prefix = f"functp_dry{next(_ids)}_"
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    caller = _world.process_state()
    previous = _crosscheck.set_debug(False)     # no peers to compare with
    _world.set_dry_run(_DryRank(rank, nprocs, prefix))
    try:
        with mode:
            fargs, fkwargs = optree.tree_map(
                lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x,
                (args, kwargs), none_is_leaf=True)
            # (MemTracker on top, as on a real run: it sees the operators the
            # program calls, not FlopCounterMode's decompositions of them)
            with _comm_log.comm_log() as log, _OpRecorder() as ops, \
                    FlopCounterMode(display=False) as flops, _Tracker() as mem:
                result = fn(*fargs, **fkwargs)
    finally:
        _world.set_dry_run(None)
        _crosscheck.set_debug(previous)
        _mesh.forget_groups(prefix)
        _world.restore_state(caller)      # the program's draws are not the caller's
    by_op = {str(op): int(n) for op, n in flops.get_flop_counts().get("Global", {}).items()}
    peak = mem.get_tracker_snapshot("peak")
    snap = next(iter(peak.values()), {})
    breakdown = {str(k.value if hasattr(k, "value") else k): int(v) for k, v in snap.items()
                 if k != "Total" and v}
    return RankEstimate(rank, log, int(flops.get_total_flops()), by_op, ops.uncounted,
                        int(snap.get("Total", 0)), breakdown, ops.calls, result)
