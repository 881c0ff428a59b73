"""``rank_meshes``: the same program estimated on several mesh shapes, the shapes that
fit a memory budget sorted by predicted step time.

Each candidate is one :func:`functp.estimate` of the program with the mesh built for
it; nothing here models a layout, so a candidate costs what the program issues on
it, collectives, FLOPs and memory alike.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..mesh import _mesh
from ..runtime._errors import ShardingError
from ._estimate import Estimate, _bytes, estimate
from ._hardware import Hardware, hardware_profile

__all__ = ["rank_meshes", "MeshRanking", "MeshCandidate", "mesh_shapes"]


def mesh_shapes(nprocs: int, ndim: int) -> list[tuple[int, ...]]:
    """Every shape of ``ndim`` axes whose sizes multiply to ``nprocs`` (axes of size
    1 included), in lexicographic order: ``mesh_shapes(4, 2)`` is
    ``[(1, 4), (2, 2), (4, 1)]``."""
    divisors = [d for d in range(1, nprocs + 1) if nprocs % d == 0]
    return [s for s in itertools.product(divisors, repeat=ndim) if math.prod(s) == nprocs]


@dataclass
class MeshCandidate:
    """One mesh shape of :func:`rank_meshes`: ``shape`` (axis name -> size), its
    ``estimate`` (None if the program failed on it, ``error`` saying why), the
    largest ``peak_bytes`` and the slowest ``seconds`` (a ``StepTime``) over the
    distinct ranks (a step ends when its slowest rank's does), and whether it
    ``fits`` the memory budget."""
    shape: dict[str, int]
    estimate: Estimate | None
    peak_bytes: int = 0
    seconds: Any = None
    fits: bool = False
    error: str = ""


@dataclass
class MeshRanking:
    """The candidates of :func:`rank_meshes`, best first: those that fit the memory
    budget by predicted step time (``seconds.serial``: functp's eager collectives
    block, so nothing overlaps today), then those that do not fit, smallest peak
    first, then those the program failed on. ``ranking.best`` is the first shape
    that fits (None if none does); ``print(ranking)`` shows the table."""
    axis_names: tuple[str, ...]
    nprocs: int
    hardware: Hardware
    memory: float
    candidates: list[MeshCandidate]

    @property
    def best(self) -> dict[str, int] | None:
        return self.candidates[0].shape if self.candidates and self.candidates[0].fits else None

    def __iter__(self):
        return iter(self.candidates)

    def __len__(self) -> int:
        return len(self.candidates)

    def __getitem__(self, i: int) -> MeshCandidate:
        return self.candidates[i]

    def __str__(self) -> str:
        head = "  ".join(f"{a:>4}" for a in self.axis_names)
        lines = [f"functp.rank_meshes: {self.nprocs} ranks on {self.hardware.name}, "
                 f"memory budget {_bytes(self.memory)} per rank",
                 f"{head}  {'peak memory':>11}  {'step time (overlapped .. serial)':>32}  "
                 f"{'collectives':>11}  fits"]
        for c in self.candidates:
            sizes = "  ".join(f"{c.shape[a]:>4}" for a in self.axis_names)
            if c.estimate is None:
                lines.append(f"{sizes}  fails: {c.error}")
                continue
            comm = max(len(e.comm) for e in c.estimate.per_rank.values())
            lines.append(f"{sizes}  {_bytes(c.peak_bytes):>11}  {str(c.seconds):>32}  "
                         f"{comm:>11}  {'yes' if c.fits else 'no'}")
        return "\n".join(lines)


def rank_meshes(fn: Callable[..., Any], nprocs: int, axis_names: Sequence[str], *args: Any,
                hardware: str | Hardware, memory: float | None = None,
                shapes: Sequence[Sequence[int]] | None = None, **kwargs: Any) -> MeshRanking:
    """Estimates ``fn(mesh, *args, **kwargs)`` on every candidate mesh of ``nprocs``
    ranks with axes ``axis_names`` and ranks the candidates: those whose peak memory
    fits ``memory`` by predicted step time, then the rest.

    ``fn`` is a program as :func:`functp.estimate` runs it, taking the mesh as its
    first argument instead of making it (``make_mesh(shape, axis_names)`` is called
    for it inside the dry run). A candidate the program raises on (a size a split
    does not divide, heads that a tp size does not divide) is listed with the error.

    **Arguments:** ``fn`` – the per-rank program, ``fn(mesh, *args, **kwargs)``;
    ``nprocs`` – ranks; ``axis_names`` – the mesh's axes, in ``make_mesh``'s order;
    ``hardware`` – a profile name or a ``Hardware`` (the time model and the default
    budget); ``memory`` – bytes per rank (default ``hardware.memory``); ``shapes`` –
    the candidate shapes (default every factorization of ``nprocs``,
    :func:`mesh_shapes`).

    **Returns:** a :class:`MeshRanking`, best first (``ranking.best``).

    Example::

        def step(mesh, x):
            w = functp.shard(torch.randn(1024, 1024), mesh, P(None, "tp"))
            f = functp.shard_map(lambda w, x: functp.pmean((x @ w).sum(), ("dp", "tp")),
                                 mesh, in_specs=(P(None, "tp"), P("dp")), out_specs=P())
            return f(w, x)

        ranking = functp.rank_meshes(step, 8, ("dp", "tp"), torch.randn(64, 1024),
                                     hardware="h100-sxm")
        print(ranking)            # dp x tp = 1x8, 2x4, 4x2, 8x1, fastest first
        ranking.best              # e.g. {'dp': 8, 'tp': 1}
    """
    axis_names = tuple(axis_names)
    hw = hardware_profile(hardware)
    budget = hw.memory if memory is None else memory
    if not budget:
        raise ShardingError(f"functp.rank_meshes: the profile {hw.name!r} has no memory "
                            f"size; pass memory= (bytes per rank)")
    shapes = mesh_shapes(nprocs, len(axis_names)) if shapes is None else shapes
    out, first_error = [], None
    for shape in shapes:
        shape = tuple(int(s) for s in shape)
        cand = MeshCandidate(dict(zip(axis_names, shape)), None)
        try:
            est = estimate(_with_mesh, nprocs, fn, shape, axis_names, args, kwargs,
                           hardware=hw)
        except Exception as e:         # listed: a layout the program cannot run
            first_error = first_error or e
            cand.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        else:
            cand.estimate = est
            cand.peak_bytes = max(e.peak_bytes for e in est.per_rank.values())
            cand.seconds = max((e.seconds for e in est.per_rank.values()),
                               key=lambda t: (t.serial, t.overlapped))
            cand.fits = cand.peak_bytes <= budget
        out.append(cand)
    if out and all(c.estimate is None for c in out):
        raise first_error
    out.sort(key=lambda c: (c.estimate is None, not c.fits,
                            (c.seconds.serial, c.seconds.overlapped) if c.fits
                            else (c.peak_bytes, 0.0) if c.estimate is not None else (0.0, 0.0)))
    return MeshRanking(axis_names, nprocs, hw, budget, out)


def _with_mesh(fn, shape, axis_names, args, kwargs):
    return fn(_mesh.make_mesh(shape, axis_names), *args, **kwargs)
