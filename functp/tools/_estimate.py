"""``estimate``: a dry run of an SPMD program on fake tensors — what one step issues,
computes and holds on a rank, without running it on the ranks.

The program runs as it would inside :func:`functp.simulate`, for one rank at a time,
under torch's ``FakeTensorMode``: tensors carry shapes, dtypes and devices but no
data, and ``make_mesh`` builds a mesh with no process groups behind it (the c10d
functional ops functp issues have fake kernels: they return the right shapes and
move nothing). What is measured is measured with torch's own counters on that run:
``comm_log`` for the collectives, ``FlopCounterMode``'s formulas for FLOPs,
``MemTracker`` for memory. They see the same operators, in the same order, as on a
real run, which is why the collectives and FLOPs are exact and the memory close. A step time is a
prediction from a hardware profile (``_hardware``), with two bounds.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import os
import sys
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import optree
import torch

from ..runtime import _comm_log
from ..runtime import _crosscheck
from . import _estimate_plot
from . import _fake_devices
from . import _host_reads
from ._op_recorder import _OpRecorder
from ..mesh import _mesh
from ..runtime import _world
from ..runtime._errors import ShardingError
from ._hardware import Hardware, hardware_profile
from ._host_time import StepTime, _Host, _secs
from ..runtime._torch_compat import (DataDependentOutputException, DynamicOutputShapeException,
                            FakeTensorMode, c10d_functional,
                            disable_current_modes as _disable_current_modes,
                            mem_tracker, unwrap_functorch)

__all__ = ["estimate", "Estimate", "RankEstimate", "StepTime"]

_ids = itertools.count()
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
# collective ops that make no buffer (waiting returns its argument), those that write
# into their input, and the copy ``x.contiguous()`` makes of a collective's input
_NOT_A_BUFFER = {c10d_functional.wait_tensor.default}
_IN_PLACE = {c10d_functional.all_reduce_.default}
_COPIES = {torch.ops.aten.clone}


class _TrackerParts:
    """torch's ``MemTracker`` without its per-module snapshots, which a training step
    cannot use: it refuses a second call of the root module (a second step), and it
    reads the storage of a module's parameters, which under ``torch.func`` are
    functorch wrappers without one. Module parameters and buffers are still filed as
    such (the tensors the wrappers stand for); the totals are MemTracker's own.
    (MemTracker's subclass ``_Tracker`` is made at the first estimate: its module is
    slow to import.)"""

    _ref: Any = None            # MemTracker's _MemRefType

    def _pre_fw_hook(self, module, inputs) -> None:
        for kind, tensors in ((self._ref.PARAM, module.parameters(recurse=False)),
                              (self._ref.BUFFER, module.buffers(recurse=False))):
            for t in tensors:
                # the storage under every torch.func wrapper (vmap's too: a batched
                # parameter's memory is the stacked tensor, filed once as the parameter)
                self._update_and_maybe_create_winfos(unwrap_functorch(t), kind)

    def _post_fw_hook(self, module, inputs, outputs) -> None:
        pass

    def _pre_bw_hook(self, module, args) -> None:
        pass

    def _post_bw_hook(self, module, args) -> None:
        pass

    def __init__(self, host: "_Host | None" = None) -> None:
        super().__init__()
        self.host = host              # counts the operators the program dispatches
        self._comm: dict[int, tuple[Any, Any]] = {}  # id -> (weakref to storage, its winfo)
        self._copy: Any = None        # weakref to the storage the last op copied into
        self._peaks: dict = {}        # MemTracker's peak per device, as last seen
        # {device: {MemTracker's category: bytes}} of communication buffers at the peak
        self.comm_at_peak: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # MemTracker's state read here (_peak_mem, _WINFO) is set in its __init__;
        # a torch without it fails the estimate tests, not silently
        if self.host is None:
            return self._dispatch(func, types, args, kwargs)
        # the top mode: the operator as the program dispatched it; what runs below
        # (fake kernels, counters) is no Python work of a real step
        was = sys.getprofile()
        sys.setprofile(None)
        if func.namespace != "prim":
            self.host.ops += 1
        try:
            return self._dispatch(func, types, args, kwargs)
        finally:
            sys.setprofile(was)

    def _dispatch(self, func, types, args, kwargs):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func.namespace == "_c10d_functional" and func not in _NOT_A_BUFFER:
            self._note_comm(func, args, out)
        elif func._overloadpacket in _COPIES and isinstance(out, torch.Tensor):
            self._copy = weakref.ref(out.untyped_storage())
        else:
            self._copy = None
        if self._peak_mem != self._peaks:      # a new peak: this op set it
            self._peaks = dict(self._peak_mem)
            self.comm_at_peak = {}
            for _, winfo in self._comm.values():
                at = self.comm_at_peak.setdefault(winfo.device, {})
                at[winfo.reftype] = at.get(winfo.reftype, 0) + winfo.mem_consumed
        return out

    def restart(self) -> int:
        """The peak from now on (as MemTracker starts it when entered: what is held
        now); returns the bytes held now (a step's resident bytes, on a GPU
        ``torch.cuda.memory_allocated()`` before it)."""
        self._peak_mem_snap = self.get_tracker_snapshot()
        self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}
        self._peaks = dict(self._peak_mem)
        self.comm_at_peak = {}
        for _, winfo in self._comm.values():
            at = self.comm_at_peak.setdefault(winfo.device, {})
            at[winfo.reftype] = at.get(winfo.reftype, 0) + winfo.mem_consumed
        return max(self._peak_mem.values(), default=0)

    def _note_comm(self, func, args, out) -> None:
        """Files the buffers of a collective as communication: its outputs, the
        buffer an in-place all-reduce writes into (a gradient bucket), and an input
        copied just before it (the contiguous copy made for it)."""
        ins = [t for t in optree.tree_leaves(args) if isinstance(t, torch.Tensor)]
        outs = [t for t in optree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        in_st = {t.untyped_storage() for t in ins}
        copied = self._copy() if self._copy is not None else None
        self._copy = None
        sts = [t.untyped_storage() for t in outs]
        sts = [s for s in sts if s not in in_st or func in _IN_PLACE]
        sts += [s for s in in_st if s is copied]
        for st in sts:
            winfo, _ = self._WINFO.get(st, (None, None))
            if winfo is not None and id(winfo) not in self._comm:
                key = id(winfo)
                self._comm[key] = (weakref.ref(st, lambda _, k=key: self._comm.pop(k, None)),
                                   winfo)


_Tracker: type | None = None       # _TrackerParts over MemTracker, once made


def _tracker_class() -> type:
    """``_Tracker``: :class:`_TrackerParts` over torch's ``MemTracker``, made once."""
    global _Tracker
    if _Tracker is None:
        base, ref = mem_tracker()
        _Tracker = type("_Tracker", (_TrackerParts, base),
                        {"_ref": ref, "__doc__": _TrackerParts.__doc__})
    return _Tracker


class _DryRank:
    """The rank an estimate traces: what ``process_index``/``process_count`` answer
    and what ``make_mesh`` builds inside it (``_world.dry_run()`` returns it)."""

    def __init__(self, rank: int, size: int, prefix: str, board: dict | None = None):
        self.rank, self.size, self.prefix = rank, size, prefix
        # what the ranks traced before this one published for later ones (a
        # pipeline stage's output shape: pipelines/_run.py), one estimate's
        self.board = board if board is not None else {}
        # (this rank's busy ticks, the schedule's ticks) of each pipelined step
        self.pipelined: list[tuple[int, int]] = []
        self.meshes: dict[tuple, _mesh.Mesh] = {}
        self.members: dict[frozenset, tuple[int, ...]] = {}   # axes -> group's ranks

    def make_mesh(self, shape, names, device_type, timeout) -> _mesh.Mesh:
        """make_mesh in a dry run: the mesh of a real run, over groups that are names
        only (nothing resolves them: the fake collectives need their sizes)."""
        # (any device_type: the groups are names only, the fakes are traced on the
        # CPU where this torch cannot run the device, see _fake_devices)
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
        self.members.update({axes: m for axes, (_, m) in groups.items()})
        return mesh


def _ranges(ranks) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    out, ranks = [], sorted(ranks)
    for _, run in itertools.groupby(enumerate(ranks), lambda ir: ir[1] - ir[0]):
        run = [r for _, r in run]
        out.append(f"{run[0]}" if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(out)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.4g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def _count(n: float) -> str:
    for unit, k in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= k:
            return f"{n / k:.4g} {unit}"
    return f"{int(n)} "


@dataclass
class RankEstimate:
    """What one rank's step issues, computes and holds.

    ``comm``: a :class:`functp.comm_log` of every collective, as a real run records
    it; ``flops``: the total ``FlopCounterMode`` counts, ``flops_by_op`` per operator;
    ``uncounted``: ``{operator: calls}`` of the compute operators that have no FLOP
    formula in torch (counted as 0 there: listed, so that a total is never silently
    short); ``peak_bytes``: the most memory held at once, as ``MemTracker`` counts
    it, and ``memory`` its breakdown at that moment by MemTracker's categories
    (``Parameter``, ``Gradient``, ``Optstate``, ``Activation``, ``Temp``, ...) and
    ``Communication``: the buffers collectives wrote (their outputs, the gradient
    buckets reduced in place, the contiguous copies made for them), taken out of
    the category MemTracker filed them under (the total is MemTracker's);
    ``seconds``: the predicted step time on the ``hardware=`` profile, or None;
    ``reads``: each value the program read on the host (``.item()``, ``tolist()``,
    ``bool()``, a value-dependent shape, a router's ``topk``) as a
    :class:`~functp.tools._host_reads.HostRead`: the operator, the call site and
    the rule that answered it; ``resident_bytes``: what the rank holds when its step
    starts, the parameters, buffers and optimizer state held at the peak (on a GPU:
    ``torch.cuda.memory_allocated()`` before the step), and ``step_peak_bytes`` the
    step's own peak above them (``max_memory_allocated()`` of one step minus the
    resident bytes); ``device``: how a device this torch cannot run was traced
    (None: as itself).
    """
    rank: int
    comm: _comm_log.comm_log
    flops: int
    flops_by_op: dict[str, int]
    uncounted: dict[str, int]
    peak_bytes: int
    memory: dict[str, int]
    seconds: StepTime | None = None
    reads: list = field(default_factory=list)
    calls: list = field(default_factory=list, repr=False)
    result: Any = field(default=None, repr=False)
    resident_bytes: int = 0
    device: str | None = None

    @property
    def step_peak_bytes(self) -> int:
        return self.peak_bytes - self.resident_bytes


@dataclass
class Estimate:
    """The result of :func:`estimate`: one :class:`RankEstimate` per distinct rank.

    ``est.ranks`` lists the ranks whose programs differ (with ``ranks=`` given: those
    ranks); ``est[r]`` is rank ``r``'s estimate; ``est.alike[r]`` the ranks whose
    program is rank ``r``'s (``r`` stands for them); ``est.traced`` every rank the
    estimate ran (some were found alike and dropped). ``est.comm``, ``est.flops``,
    ``est.peak_bytes`` (every field of :class:`RankEstimate`) are the first rank's.
    """
    nprocs: int
    per_rank: dict[int, RankEstimate] = field(default_factory=dict)
    hardware: Hardware | None = None
    alike: dict[int, list[int]] = field(default_factory=dict)
    traced: list[int] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.per_rank)

    def __getitem__(self, rank: int) -> RankEstimate:
        return self.per_rank[rank]

    def __getattr__(self, name: str):
        # est.comm, est.flops, est.peak_bytes, ...: those of the first traced rank
        if (name in RankEstimate.__dataclass_fields__ or name == "step_peak_bytes") \
                and self.per_rank:
            return getattr(self.per_rank[self.ranks[0]], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def plot(self, path=None):
        """A PNG (``path``) and a matplotlib ``Figure`` of each distinct rank's memory
        breakdown at the peak and its predicted compute and communication time;
        needs matplotlib (an optional extra).

        **Arguments:** ``path`` – where to write the PNG, or None.

        **Returns:** the ``Figure``. Example::

            functp.estimate(program, 8, hardware="h100-sxm").plot("estimate.png")
        """
        return _estimate_plot.plot(self, path)   # (matplotlib imported there, lazily)

    def __str__(self) -> str:
        on = (f"predicted on {self.hardware.name}" if self.hardware is not None
              else "no time: pass hardware=")
        lines = [f"functp.estimate: {self.nprocs} ranks, {len(self.ranks)} distinct "
                 f"(traced {_ranges(self.traced)}) ({on})",
                 f"{'rank':>4}  {'alike':>5}  {'FLOP':>10}  {'collectives':>11}  "
                 f"{'comm bytes':>11}  {'peak memory':>11}  step time (all overlapped .. none)"]
        for r in self.ranks:
            e = self.per_rank[r]
            lines.append(f"{r:>4}  {len(self.alike.get(r, [r])):>5}  {_count(e.flops):>10}  "
                         f"{len(e.comm):>11}  "
                         f"{_bytes(e.comm.nbytes()):>11}  {_bytes(e.peak_bytes):>11}  "
                         f"{e.seconds if e.seconds is not None else '-'}")
        for r in self.ranks:
            e = self.per_rank[r]
            kinds = ", ".join(f"{op} over {','.join(ax)} x{k}"
                              for (op, ax), k in e.comm.summary().items())
            mem = ", ".join(f"{k} {_bytes(v)}" for k, v in
                            sorted(e.memory.items(), key=lambda kv: -kv[1]))
            lines.append(f"rank {r} (and the ranks alike: {_ranges(self.alike.get(r, [r]))}):")
            lines.append(f"        collectives: {kinds or 'none'}")
            lines.append(f"        memory at peak: {mem or 'none'}")
            lines.append(f"        resident when the step starts {_bytes(e.resident_bytes)}, "
                         f"the step's peak above it {_bytes(e.step_peak_bytes)}")
            if e.device is not None:
                lines.append(f"        device: {e.device}")
            if e.seconds is not None:
                t = e.seconds
                cut = (f" over {len(t.stretches)} stretches between host reads"
                       if len(t.stretches) > 1 else "")
                lines.append(f"        compute {_secs(t.compute)}, communication "
                             f"{_secs(t.communication)}, host {_secs(t.host)} "
                             f"({t.host_calls} operator calls, {t.python_calls} Python "
                             f"calls){cut}: {t.bound}-bound")
            for read in e.reads:
                lines.append(f"        host read: {read}")
            if e.uncounted:       # the most called first; est[r].uncounted has them all
                top = sorted(e.uncounted.items(), key=lambda kv: (-kv[1], kv[0]))
                more = f", and {len(top) - 5} more" if len(top) > 5 else ""
                lines.append(f"        not counted (torch has no FLOP formula): "
                             f"{', '.join(f'{k} x{v}' for k, v in top[:5])}{more}")
        return "\n".join(lines)


def estimate(fn: Callable[..., Any], nprocs: int, *args: Any,
             hardware: str | Hardware | None = None, ranks: str | Sequence[int] = "auto",
             reads: dict | None = None, routing: str | Sequence[int] = "uniform",
             warmup: int = 0, **kwargs: Any) -> Estimate:
    """Runs ``fn(*args, **kwargs)`` as rank 0 (and ``ranks``) of ``nprocs`` on fake
    tensors, and reports what each traced rank's step issues and computes.

    The program is the one :func:`functp.simulate` runs: ``make_mesh``, ``shard``,
    ``parallelize``, ``shard_map``, collectives, ``torch.func.grad`` or tape backward
    and optimizer steps all work inside, but every tensor made inside is a fake
    (``FakeTensorMode``: shape, dtype, device, no data), the mesh has no process
    groups, and no byte moves. Tensors passed in ``args``/``kwargs`` are used as
    fakes of themselves.

    Which ranks to trace: ranks whose programs differ only in which block they hold
    issue the same collectives and FLOPs, so one rank stands for all. With
    ``ranks="auto"`` rank 0 is traced, then position 1 and the last along each axis
    of the program's first mesh, crossing the axes where those differ (pipeline
    stages, a smaller last block); ``ranks=`` traces exactly those ranks. Values
    read on the host (``.item()``, ``.tolist()``, ``if`` on a tensor, masks, a
    router's ``topk``) follow the rules of ``tools/_host_reads.py``, each listed
    in the printout with its call site and rule.

    A first step does work later steps do not (caches filled on a first call:
    functp's per-body plans are a third of a small functp step's Python calls;
    optimizer state made). With ``warmup=k`` the program sets up and *returns* its
    step, a function of no arguments, called ``k`` times and once more: everything
    reported is that last call's, ``resident_bytes`` all held when it starts
    (``torch.cuda.memory_allocated()`` between steps). With ``warmup=0`` the
    program is the step, counted from its first computing operator.

    **Arguments:** ``fn`` – the per-rank program; ``nprocs`` – the number of ranks
    it is written for; ``hardware`` – a profile name (``"h100-sxm"``, ``"a100"``)
    or a ``Hardware``, to predict the step time; ``ranks`` – ``"auto"`` or the
    ranks to trace; ``reads`` – ``{call site substring: value}``; ``routing`` –
    ``"uniform"`` or each expert's (token, choice) pairs; ``warmup`` – 0, or the calls
    of the step ``fn`` returns before the one measured; ``*args``/``**kwargs`` – to ``fn``.

    **Returns:** an :class:`Estimate`: ``est.comm`` (a ``comm_log``), ``est.flops``,
    ``est.peak_bytes`` and ``est.memory`` (its breakdown), ``est.seconds`` (a
    :class:`StepTime`, with ``hardware=``) of rank 0, ``est[r]`` for each distinct
    rank ``r`` in ``est.ranks`` and ``est.alike[r]`` the ranks it stands for;
    ``print(est)`` shows them as a table.

    Example::

        def program():
            mesh = functp.make_mesh((4,), ("tp",))
            w = functp.shard(torch.randn(4096, 1024), mesh, P("tp"))
            f = functp.shard_map(lambda w, x: functp.psum(x @ w, "tp"), mesh,
                                 in_specs=(P("tp"), P(None, "tp")), out_specs=P())
            x = functp.shard(torch.randn(8, 4096), mesh, P(None, "tp"))
            return f(w, x)

        est = functp.estimate(program, 4, hardware="h100-sxm")
        est.comm.summary()       # {('all_reduce', ('tp',)): 1}
        est.flops                # 2 * 8 * 1024 * 1024 = 16777216
        est.peak_bytes           # 20971520: the 4096 x 1024 block and its kin
        print(est)               # a table per rank, with the predicted step time
        functp.estimate(lambda: (lambda: program()), 4, warmup=1)   # a later step
    """
    ranks = _check_call(nprocs, ranks, reads, routing, warmup)
    hw = hardware_profile(hardware) if hardware is not None else None
    est, board = Estimate(nprocs, hardware=hw), {}     # (board: _DryRank's)

    def trace(r):
        return _fresh_trace(fn, nprocs, r, args, kwargs, hw, (reads, routing), warmup, board)
    gc.freeze()     # (not collected first: 0.15 s with torch and a model imported)
    try:
        if ranks == "auto":
            traced, stands_for = _distinct_ranks(trace, nprocs)
            est.per_rank = {r: traced[r][0] for r in stands_for}
            est.alike, est.traced = stands_for, sorted(traced)
        else:
            est.per_rank = {r: trace(r)[0] for r in ranks}
            est.alike, est.traced = {r: [r] for r in ranks}, list(ranks)
    finally:
        gc.unfreeze()
    return est


def _fresh_trace(*args) -> tuple:
    """``_trace(*args)`` after a collection. Python's collector frees reference
    cycles (and tensors they hold) when its allocation counters say so: each trace
    starts them from zero, so that the same program gives the same peak (the
    caller's objects are frozen meanwhile, which makes those collections cheap; they
    are frozen without a full collection first, which scanned every object of the
    process: 0.15 s of each estimate with torch and a model imported)."""
    gc.collect()
    return _trace(*args)


def _check_call(nprocs, ranks, reads=None, routing="uniform", warmup=0):
    """``estimate``'s arguments checked: ``"auto"`` or the sorted ranks to trace."""
    _host_reads.Values(reads, routing)      # (raises on a bad routing=)
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ShardingError(f"functp.estimate: warmup must be an int >= 0 (the step's "
                            f"calls before the one measured), got {warmup!r}")
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ShardingError(f"functp.estimate: nprocs must be a positive int, got {nprocs!r}")
    if not (isinstance(ranks, str) and ranks == "auto"):
        ranks = sorted(set(int(r) for r in ranks))
        if not ranks or not all(0 <= r < nprocs for r in ranks):
            raise ShardingError(f"functp.estimate: ranks={list(ranks)} must be \"auto\" "
                                f"or ranks of the world, 0 to {nprocs - 1}")
    if _world.current_run() is not None or _world.dry_run() is not None:
        raise ShardingError("functp.estimate was called inside a simulated or estimated "
                            "rank; call it once, from outside the program")
    return ranks


def _fingerprint(e: RankEstimate) -> tuple:
    """What makes two ranks' steps the same for an estimate: every collective, and
    every operator with its FLOPs and bytes, in order."""
    return tuple((c.op, tuple(c.axes), c.nbytes) for c in e.comm.events), tuple(e.calls)


def _alike(a: RankEstimate, b: RankEstimate) -> bool:
    """The same collectives and operators. Not the peak memory: with the same
    operators it differs only by when Python's garbage collector frees reference
    cycles, which varies from run to run (71 MB of a 1 TiB peak on a 70B model, a
    few % of a tiny model's, on the first trace in a process)."""
    return _fingerprint(a) == _fingerprint(b)


def _distinct_ranks(trace, nprocs: int) -> tuple[dict, dict[int, list[int]]]:
    """Traces as few ranks as tell which ranks' programs differ, and which rank
    stands for which. Along each axis of the first mesh the program makes, the first,
    a middle and the last position can differ (pipeline stages, uneven last blocks,
    shifts that leave the ends out); the middle ones are taken to be alike. Rank 0
    is traced, then position 1 and the last along each axis (the others at 0); the
    axes where one of them differs from rank 0 are crossed with each other.

    **Returns:** ``({rank: (RankEstimate, dry rank)} of the traced ranks,
    {representative: [ranks it stands for]})``."""
    traced = {0: trace(0)}
    meshes = traced[0][1].meshes
    shape = next(iter(meshes))[0] if meshes else (nprocs,)
    grid = torch.arange(nprocs).reshape(shape)
    at = {(0,) * len(shape): 0}

    def rank_at(pos: tuple) -> int:
        if pos not in at:
            at[pos] = int(grid[pos])
            if at[pos] not in traced:
                traced[at[pos]] = trace(at[pos])
        return at[pos]

    def where(d: int, i: int) -> int:       # the position standing for position i
        return 0 if i == 0 else d - 1 if i == d - 1 else 1
    uneven = []
    for a, d in enumerate(shape):
        for i in sorted({where(d, i) for i in range(1, d)}):
            r = rank_at(tuple(i if b == a else 0 for b in range(len(shape))))
            if not _alike(traced[r][0], traced[0][0]) and a not in uneven:
                uneven.append(a)
    rep_of: dict[int, int] = {}             # traced rank -> the first one alike it
    stands_for: dict[int, list[int]] = {}
    for pos in itertools.product(*map(range, shape)):
        stand_in = rank_at(tuple(where(shape[a], i) if a in uneven else 0
                                 for a, i in enumerate(pos)))
        if stand_in not in rep_of:
            rep_of[stand_in] = next((q for q in dict.fromkeys(rep_of.values())
                                     if _alike(traced[q][0], traced[stand_in][0])), stand_in)
        stands_for.setdefault(rep_of[stand_in], []).append(int(grid[pos]))
    return traced, {r: sorted(v) for r, v in sorted(stands_for.items())}


def _trace(fn, nprocs: int, rank: int, args, kwargs,
           hw: Hardware | None, rules: tuple = (None, "uniform"), warmup: int = 0,
           board: dict | None = None) -> tuple[RankEstimate, _DryRank]:
    """Runs ``fn`` once as ``rank`` (and the step it returns ``warmup + 1`` times),
    on fake tensors, under torch's counters."""
    prefix = f"functp_dry{next(_ids)}_"
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    devices = _fake_devices.Devices()
    caller = _world.process_state()
    previous = _crosscheck.set_debug(False)     # no peers to compare with
    dry = _DryRank(rank, nprocs, prefix, board)
    # the host's work is counted for a time prediction only (counting Python calls
    # slows the trace)
    host = _Host() if hw is not None else None
    _world.set_dry_run(dry)
    try:
        with mode, _host_reads.Values(*rules) as values, _host_reads.ToList(values), devices:
            fargs, fkwargs = optree.tree_map(lambda x: values.fake_of(mode, x),
                                             (args, kwargs), none_is_leaf=True)
            # (MemTracker on top, as on a real run: it sees the operators the
            # program calls, not the recorder's decompositions of them; the
            # values just above the fakes, where the others see every operator)
            with _comm_log.comm_log() as log, _OpRecorder(host) as ops, \
                    _tracker_class()(host) as mem:
                if host is not None:
                    host.watch(ops.calls, log.events)
                    values.on_sync = host.sync
                try:
                    result, mark = _run(
                        fn, fargs, fkwargs, host, warmup,
                        lambda: _Mark(ops, log, mem, values, host))
                except (DataDependentOutputException, DynamicOutputShapeException) as e:
                    raise _host_reads.refused(e, rank) from None
                except RuntimeError as e:
                    if "_apply(): Couldn't swap" not in str(e):
                        raise
                    raise _fake_devices.refused(e, rank) from None
    finally:
        _world.set_dry_run(None)
        _crosscheck.set_debug(previous)
        _mesh.forget_groups(prefix)
        _world.restore_state(caller)      # the program's draws are not the caller's
    counts = ops.flops
    calls, uncounted = ops.calls, ops.uncounted
    if mark is not None:              # the measured step's own, from its start
        counts = {op: n - mark.flops.get(op, 0) for op, n in counts.items()}
        calls = calls[mark.calls:]
        log.events[:mark.events] = []
        uncounted = {k: n - mark.uncounted.get(k, 0) for k, n in uncounted.items()
                     if n > mark.uncounted.get(k, 0)}
    by_op = {str(op): int(n) for op, n in counts.items() if n}
    peak = mem.get_tracker_snapshot("peak")
    dev, snap = next(iter(peak.items()), (None, {}))
    # the collectives' buffers, out of the categories MemTracker filed them under
    comm = mem.comm_at_peak.get(dev, {})
    snap = {**{k: v - comm.get(k, 0) for k, v in snap.items()},
            "Communication": sum(comm.values())}
    breakdown = {str(k.value if hasattr(k, "value") else k): int(v) for k, v in snap.items()
                 if k != "Total" and v}
    seconds = None
    if hw is not None:
        seconds = host.time(hw, ops.calls, log.events, dry.members)
        busy, ticks = map(sum, zip(*dry.pipelined)) if dry.pipelined else (0, 0)
        if busy:               # a pipeline stage: its bubble (_DryRank.pipelined)
            seconds = replace(seconds, idle=seconds.compute * (ticks - busy) / busy)
    resident = (mark.resident if mark is not None else
                sum(breakdown.get(k, 0) for k in ("Parameter", "Buffer", "Optstate")))
    return RankEstimate(rank, log, sum(by_op.values()), by_op, uncounted,
                        int(snap.get("Total", 0)), breakdown, seconds, values.reads,
                        calls, result, resident, devices.assumed()), dry


def _run(fn, fargs, fkwargs, host, warmup: int, mark):
    """``fn(*fargs, **fkwargs)``, and with ``warmup`` the step it returns, called
    ``warmup`` times then once more after ``mark()``: ``(result, the mark or None)``.
    The host's Python calls are counted inside the calls only (not the estimate's
    own code between them)."""
    count = host.python if host is not None else contextlib.nullcontext()
    with count:
        result = fn(*fargs, **fkwargs)
    if not warmup:
        return result, None
    if not callable(result):
        raise ShardingError(
            f"functp.estimate(..., warmup={warmup}): the program must return its step, "
            f"a function of no arguments (called {warmup} time(s), then once more, "
            f"measured); it returned {type(result).__name__}")
    for _ in range(warmup):
        with count:
            result()
    gc.collect()            # (what a cycle of the last step held, freed as it would be)
    at = mark()
    with count:
        out = result()
    return out, at


class _Mark:
    """The counters where the measured step starts (``warmup=``): the operators,
    collectives, FLOPs and reads so far; the memory peak restarted there, the bytes
    held then its resident bytes; the host's count starts there."""

    def __init__(self, ops, log, mem, values, host) -> None:
        self.calls, self.events = len(ops.calls), len(log.events)
        self.flops = dict(ops.flops)
        self.uncounted = dict(ops.uncounted)
        values.forget_reads()
        self.resident = mem.restart()
        if host is not None:
            host.start_here()
