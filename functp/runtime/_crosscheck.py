"""The cross-rank check mode (``FUNCTP_DEBUG=1`` or :func:`set_debug`), and the
errors a failed collective turns into.

SPMD code goes wrong quietly when ranks disagree: a collective one rank skipped pairs
with the next one of another rank; blocks of other shapes or dtypes crash inside the
backend or come back as garbage. In the check mode every collective (forward and
backward) and every ``shard_map`` boundary first exchanges a fingerprint over the
whole mesh: the axes of its process group (a boundary's: all), a sequence number in
that group, a hash of what runs (collective, axes, direction; a boundary's leaves), a
hash of the block (dtype and shape), the rank's place in the mesh and a hash of the
mesh (six ints on any mesh: an exchange whose ranks checked over two meshes pairs, and
they disagree, rather than aborting in the backend). Each rank is compared
with the peers of its own group only: groups may run different numbers of
collectives (a MoE's tensor-parallel ones follow its data-parallel shard's routing),
and a rank whose group is done waits, exchanging again, while others finish theirs.
Where it was called is not compared (the same ``psum`` in both branches of an ``if``
is the same collective) but is printed when ranks differ. If a group's fingerprints
differ, or no rank can go on (each waits for a peer that is elsewhere), the ranks
exchange their descriptions and every rank raises the same ``ShardingError``
naming each rank's collective and call site — before the real collective runs, so
nothing is left half-done. A rank that never arrives (it returned early or raised)
makes the others fail after the mesh's timeout, with the collective they waited in.

Like ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, it costs an extra small all-gather per
collective (and one per extra round a waiting group takes) (``benchmarks/crosscheck.py`` measures it); off, it costs one flag test.
Nothing is checked while ``torch.compile`` traces.
"""
from __future__ import annotations

import linecache
import math
import os
import re
import sys
import zlib

import torch

from . import _compile
from . import _star
from . import _world
from ._errors import ShardingError, first_line
from ._torch_compat import (FakeTensor, c10d_functional as _c10d, current_graph_task_id,
                            resolve_process_group, sequence_number)

__all__ = ["set_debug", "debug_enabled"]

# read on every collective: a module global, not a function call
ENABLED = os.environ.get("FUNCTP_DEBUG", "0").strip().lower() not in ("", "0", "false", "no")

_PKG = _world.PACKAGE_DIR
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_MAX_TEXT = 8192              # bytes of one rank's description in an error
_seq: dict[str, int] = {}     # check group name -> fingerprints exchanged so far
# bumped by every set_debug call: a mesh whose ranks last agreed on the setting at
# another generation agrees again at its next shard_map (see agree_mode)
GENERATION = 0
_RAISED = "raised "           # how a rank that raised inside a body describes itself
_RAISED_RE = re.compile(r"^#\d+ \w+ shard_map\(.*?\) raised ")


def set_debug(enabled: bool = True) -> bool:
    """Turns the cross-rank check mode on or off (as ``FUNCTP_DEBUG=1`` does at import).

    **Arguments:** ``enabled`` – check before every collective and at every
    ``shard_map`` boundary that all ranks run the same collective with the same shape
    and dtype. Switch it on every rank at the same point of the program: the ranks
    compare their settings at ``make_mesh`` and at the next ``shard_map`` after a
    change, and raise ``ShardingError`` on every rank if they differ.

    **Returns:** the previous setting. Example::

        functp.set_debug(True)
        step(params, batch)    # a rank that diverges raises ShardingError on every rank
    """
    global ENABLED, GENERATION
    prev, ENABLED = ENABLED, bool(enabled)
    GENERATION += 1
    return prev


def debug_enabled() -> bool:
    """Whether the cross-rank check mode is on."""
    return ENABLED


def call_site() -> str:
    """``file:line in function: source`` of the innermost frame outside functp and torch
    (the user's call, or the ``backward``/``grad`` call during a backward)."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not (name.startswith(_PKG) or name.startswith(_TORCH) or name.startswith("<frozen")):
            src = linecache.getline(name, f.f_lineno).strip()
            where = f"{os.path.basename(name)}:{f.f_lineno} in {f.f_code.co_name}"
            return f"{where}: {src}" if src else where
        f = f.f_back
    return "(no caller outside torch)"


def _direction() -> str:
    return "backward" if current_graph_task_id() != -1 else "forward"


def _crc(s: str) -> int:
    # stable across processes, unlike hash() of a str
    return zlib.crc32(s.encode())


def _skip(x: torch.Tensor | None) -> bool:
    return _compile.tracing() or (x is not None and isinstance(x, FakeTensor))


def agreed(e: BaseException) -> BaseException:
    """Marks ``e`` as known to every rank (raised by all of them together, or past
    agreeing: a peer is gone): a body runner passes it on without another check."""
    try:
        e.__functp_agreed__ = True
    except AttributeError:       # (an exception type without a __dict__)
        pass
    return e


def is_agreed(e: BaseException) -> bool:
    return getattr(e, "__functp_agreed__", False)


def _gather(t: torch.Tensor, check, what: str) -> torch.Tensor:
    try:
        if _world.SIMULATING or check.device.type != "cpu":
            return _world.wait(_c10d.all_gather_into_tensor(t, check.size, check.group_name))
        # (gloo: through the group's first rank, not its ring all-gather: _star)
        return _star.gather(t, resolve_process_group(check.group_name))()
    except RuntimeError as e:
        raise agreed(ShardingError(
            f"{what}: not every rank of the mesh reached it within the mesh's timeout "
            f"({_reason(e)}); a rank skipped it, raised before it or returned early "
            f"(outside a shard_map body, where its error is not agreed), or has the "
            f"check mode off. [FUNCTP_DEBUG check]")) from None


def _reason(e: BaseException) -> str:
    """The first line of a backend's error, without its C++ source location."""
    line = first_line(e)
    return re.sub(r"^\[[^\]]*\]\s*", "", line)[:200] if line else type(e).__name__


def check(check, head: str, details: tuple[str, ...] = (), block: str = "",
          axes: tuple[str, ...] | None = None) -> None:
    """The ranks of the process group over ``axes`` (None: the whole mesh of
    ``check``) compare ``head`` (one line: what runs), ``details`` (e.g. one line per
    input leaf) and ``block`` (a collective's dtype and shape); raises on every rank of
    the mesh if they differ.

    Each exchange is over the whole mesh, but a rank is only held to its own group's
    peers: where the number of a group's collectives depends on data that group
    shares (a MoE's tensor-parallel collectives, per data-parallel shard), a group
    that is done waits, repeating its exchange, while the others go on with theirs
    (:func:`_verdict`). A rank whose peers are at another collective of the same
    group, or a mesh where no rank can go on, is a disagreement."""
    mask = _mask(check, axes)
    name = f"{check.group_name}|{mask}"
    seq = _seq.get(name, 0)
    _seq[name] = seq + 1
    site = call_site()
    body = "\n".join(details)
    # (the call site is printed, never compared: the same collective reached from two
    # source lines, as in both branches of an if, is the same collective)
    # The row has the same length on every mesh: where ranks exchange with two meshes'
    # check groups over one process group (a rank that chose another mesh), the rows
    # pair and the ranks disagree; rows of two lengths ended the process in gloo.
    placed = _place(check)
    row = torch.tensor([mask, seq, _crc(head + "\n" + body), _crc(block), *placed[:2]],
                       dtype=torch.int64, device=check.device)
    what = f"{head} {block}".rstrip()
    while True:
        table = _gather(row, check, f"{what} (check #{seq}) at {site}").view(check.size, -1)
        table = table.cpu()
        go, me = _verdict(table, check, placed)
        if go is None:
            break
        if go[me]:
            return
    # every rank raises in this exchange, some at a group's collective, some at the
    # mesh's: they count afresh, together, so that the mesh stays usable
    forget(f"{check.group_name}|")
    meshes = bool((table[:, 5] != table[0, 5]).any())
    texts = _texts(f"#{seq} {what}\n      at {site}\n{body}"
                   + (f"\non {check.mesh}" if meshes else ""), check)
    raise agreed(ShardingError(_disagreement(texts, check, meshes)))


# check group -> this rank's place in its mesh, the mesh's crc, and the mesh's strides
# and sizes (what turns a place back into coordinates)
_PLACES: dict = {}


def _place(check) -> tuple:
    """This rank's position in its mesh (row-major over the mesh's axes; its coordinates
    follow from the mesh's shape), a crc of the mesh's axes and sizes, and the mesh's
    strides and sizes as tensors (made once per mesh: the check runs per collective)."""
    got = _PLACES.get(check)
    if got is None:
        sizes = check.axis_sizes
        place = sum(c * math.prod(sizes[i + 1:]) for i, c in enumerate(check.coordinate))
        strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
        got = _PLACES[check] = (place, _crc(f"{check.axis_names} {check.axis_sizes}"),
                                torch.tensor(strides, dtype=torch.int64),
                                torch.tensor(check.axis_sizes, dtype=torch.int64))
    return got


def _mask(check, axes: tuple[str, ...] | None) -> int:
    """The axes of a group as bits, in the mesh's order (all of them: the whole mesh)."""
    names = check.axis_names
    return sum(1 << i for i, a in enumerate(names) if axes is None or a in axes)


def _verdict(table: torch.Tensor, check, placed: tuple):
    """From every rank's row (its group's axes as bits, sequence number, what it runs,
    its block, its place in its mesh and the mesh's crc), the same answer on every
    rank: which ranks go on (all of their group is at the same collective), and this
    rank's row; None when ranks disagree (a peer of the same group is at another of its
    collectives, or on another mesh) or no rank can go on (each waits for a peer that
    is elsewhere). ``placed``: :func:`_place` of ``check``."""
    masks, fps, places, layouts = table[:, 0], table[:, :4], table[:, 4], table[:, 5]
    if bool((layouts != layouts[0]).any()):
        return None, 0
    if not check.axis_names:             # (a check group without coordinates: one group)
        return (None if bool((fps != fps[0]).any()) else torch.ones(len(fps)).bool()), 0
    place, _, strides, sizes = placed
    me = int((places == place).nonzero()[0, 0])
    coords = places[:, None].div(strides, rounding_mode="floor") % sizes   # from the places
    bits = ((masks[:, None] >> torch.arange(coords.shape[1])) & 1).bool()
    # peers[r, m]: m is in r's group (the same place on every axis outside it)
    peers = ((coords[:, None, :] == coords[None, :, :]) | bits[:, None, :]).all(-1)
    same = (fps[:, None, :] == fps[None, :, :]).all(-1)
    same_group = masks[:, None] == masks[None, :]
    if bool((peers & same_group & ~same).any()):
        return None, me
    go = (~peers | same).all(-1)
    return (go if bool(go.any()) else None), me


def _texts(text: str, check) -> list[str]:
    """Every rank's ``text``, in group order (two small all-gathers of bytes)."""
    data = text.encode()[:_MAX_TEXT]
    n = torch.tensor([len(data)], dtype=torch.int64, device=check.device)
    sizes = _gather(n, check, "exchanging descriptions").tolist()
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = _gather(buf.to(check.device), check, "exchanging descriptions").view(check.size, -1)
    return [bytes(r[:k].tolist()).decode(errors="replace") for r, k in zip(rows.cpu(), sizes)]


def _disagreement(texts: list[str], check, meshes: bool = False) -> str:
    """Each distinct description once, with the ranks that gave it; of detail lines
    (one per leaf) only those not every rank has. ``meshes``: the ranks checked over
    different meshes (each description names its own)."""
    lines = [t.split("\n") for t in texts]
    raisers = [r for r, ls in zip(check.ranks, lines) if _RAISED_RE.match(ls[0])]
    if raisers and not meshes:
        return _raised_elsewhere(raisers, lines, check)
    common = set(lines[0][2:]).intersection(*(set(ls[2:]) for ls in lines[1:]))
    seen: dict[str, list[int]] = {}
    for r, ls in zip(check.ranks, lines):
        own = [x for x in ls[2:] if x not in common][:4]
        seen.setdefault("\n".join(ls[:2] + ["    " + x for x in own]), []).append(r)
    # (the same text on every rank: with two meshes, neither is named as the mesh)
    on = "which mesh they run on" if meshes else check.mesh
    parts = [f"ranks disagree on {on} [FUNCTP_DEBUG check]: every rank must reach "
             f"the same collectives and shard_map boundaries in the same order, with the "
             f"same block shapes and dtypes{', over the same mesh' if meshes else ''}:"]
    for text, ranks in seen.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        parts.append(f"  {who}: {text}")
    parts.append("ranks that chose their mesh by rank or by data diverged here: make one "
                 "mesh and use it on every rank" if meshes else
                 "a rank that skipped or added a collective (a branch on the rank or on "
                 "data, an exception caught inside a body) or passed other block shapes "
                 "or dtypes diverged here or just before")
    return "\n".join(parts)


def _raised_elsewhere(raisers: list[int], lines: list[list[str]], check) -> str:
    """The message every rank raises when some ranks raised inside a body."""
    at = dict(zip(check.ranks, lines))
    first = at[raisers[0]]
    who = f"rank {raisers[0]}" if len(raisers) == 1 else f"ranks {raisers}"
    parts = [f"{who} of {check.mesh} raised inside a shard_map body: "
             f"{first[0][_RAISED_RE.match(first[0]).end():]}"]
    parts += [x for x in first[2:] if x]
    others = [r for r in check.ranks if r not in raisers]
    for r in others[:4]:
        parts.append(f"  rank {r} stopped at {at[r][0]}\n  {at[r][1].strip()}")
    parts.append("every rank raises together instead of waiting for the raising one; "
                 "the mesh stays usable, so a program that catches this error can go on "
                 "with its next step [FUNCTP_DEBUG check]")
    return "\n".join(parts)


def raised(mesh, name: str, e: BaseException) -> None:
    """Called by a body runner whose body raised ``e`` on this rank (check mode on):
    joins the other ranks' next check with a description of ``e``, so that they raise
    a ``ShardingError`` there instead of waiting for this rank (``e`` gets a note)."""
    if is_agreed(e) or mesh.check.size == 1 or _skip(None):
        return
    tb = e.__traceback__
    where = ""
    while tb is not None:       # the innermost frame of the user's code
        name_ = tb.tb_frame.f_code.co_filename
        if not (name_.startswith(_PKG) or name_.startswith(_TORCH)):
            src = linecache.getline(name_, tb.tb_lineno).strip()
            where = f"{os.path.basename(name_)}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}: {src}"
        tb = tb.tb_next
    head = f"{_direction()} shard_map({name}) {_RAISED}{type(e).__name__}: {first_line(e)[:300]}"
    try:
        check(mesh.check, head, (f"    raised at {where}",) if where else ())
    except ShardingError as told:
        if hasattr(e, "add_note"):
            e.add_note(f"functp: the other ranks of {mesh!r} raise ShardingError with "
                       f"this exception's description (they were told at the check mode's "
                       f"next exchange): {first_line(told)}")
    agreed(e)


def agree_mode(mesh) -> None:
    """The ranks of ``mesh`` compare whether the check mode is on (at ``make_mesh``
    and at the first ``shard_map`` after :func:`set_debug`): a rank with it off would
    never join the exchanges of a rank with it on."""
    mesh._debug_generation = GENERATION
    if mesh.check.size == 1 or _skip(None):
        return
    mine = torch.tensor([int(ENABLED)], dtype=torch.int64, device=mesh.check.device)
    flags = _gather(mine, mesh.check, "comparing the check mode (FUNCTP_DEBUG)").tolist()
    if len(set(flags)) > 1:
        on = [r for r, f in zip(mesh.check.ranks, flags) if f]
        off = [r for r, f in zip(mesh.check.ranks, flags) if not f]
        raise agreed(ShardingError(
            f"the cross-rank check mode (FUNCTP_DEBUG) is on on ranks {on} and off on "
            f"ranks {off} of {mesh!r}: with it on, a rank exchanges a fingerprint before "
            f"every collective, which ranks with it off never join. Set FUNCTP_DEBUG the "
            f"same in every process's environment, or call functp.set_debug(...) with the "
            f"same value on every rank"))


def collective(op: str, g, x: torch.Tensor) -> None:
    """Called before each raw collective while the check mode is on."""
    if _skip(x):
        return
    check(g.check, f"{_direction()} {op} over {g.axes} of", block=f"{x.dtype} {tuple(x.shape)}",
          axes=g.axes)


def boundary(mesh, name: str, where: str, paths: list[str], leaves: list) -> None:
    """A ``shard_map`` entry or exit: ranks compare the blocks' shapes and dtypes."""
    if mesh.check.size == 1 or _skip(None):
        return
    details = tuple(f"{p}: {x.dtype} {tuple(x.shape)}" for p, x in zip(paths, leaves)
                    if isinstance(x, torch.Tensor))
    check(mesh.check, f"{_direction()} shard_map({name}) {where}", details)


class _Mark(torch.autograd.Function):
    """Identity whose backward is a boundary check: the backward of a body begins
    (at its outputs) and ends (at its inputs) on every rank together."""

    generate_vmap_rule = True

    @staticmethod
    def forward(mesh, name, where, *xs):
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mesh, ctx.name, ctx.where = inputs[:3]

    @staticmethod
    def backward(ctx, *cts):
        boundary(ctx.mesh, ctx.name, ctx.where, [], [])
        return (None, None, None, *cts)

    @staticmethod
    def jvp(ctx, *tangents):      # forward mode needs no agreement: nothing is exchanged
        return tuple(tangents[3:])


def mark(mesh, name: str, where: str, leaves: list) -> list:
    """``leaves`` with the tensors that need gradients passed through :class:`_Mark`
    (each distinct tensor once, so aliases stay aliases)."""
    if mesh.check.size == 1 or _skip(None):
        return leaves
    idx: dict[int, list[int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            idx.setdefault(id(x), []).append(i)
    if not idx:
        return leaves
    firsts = [v[0] for v in idx.values()]
    outs = _Mark.apply(mesh, name, where, *[leaves[i] for i in firsts])
    leaves = list(leaves)
    for v, y in zip(idx.values(), outs):
        for i in v:
            leaves[i] = y
    return leaves


def failed(op: str, g, e: BaseException, cause: str | None = None) -> ShardingError:
    """The error for a collective whose wait failed (a timeout, a peer gone);
    ``cause``: what a peer found before it left (``_watch``), said first."""
    try:
        seq = f"#{sequence_number(g.pg())} "
    except Exception:        # noqa: BLE001 - the number is a courtesy
        seq = ""
    if cause:
        return agreed(ShardingError(
            f"{cause} (here: {op} over {g.axes}, collective {seq}of its process group, "
            f"failed: {_reason(e)})"))
    return agreed(ShardingError(
        f"{op} over {g.axes} (collective {seq}of its process group) failed: {_reason(e)}. "
        f"A rank did not join it within the mesh's timeout, or left. Run with "
        f"FUNCTP_DEBUG=1 to have ranks compare every collective first and name the one "
        f"that diverged; make_mesh(..., timeout=seconds) sets how long to wait"))


def forget(prefix: str) -> None:
    """Drops the sequence numbers of check groups whose names start with ``prefix``
    (those of a finished simulation; its meshes' places too, where the prefix is a
    group's name's start).

    **Arguments:** ``prefix`` – the start of c10d group names (a check group's own
    ``name|`` for its counters alone). **Returns:** None."""
    for name in [n for n in _seq if n.startswith(prefix)]:
        del _seq[name]
    for c in [c for c in _PLACES if c.group_name.startswith(prefix)]:
        del _PLACES[c]
