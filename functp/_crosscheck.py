"""The cross-rank check mode (``FUNCTP_DEBUG=1`` or :func:`set_debug`), and the
errors a failed collective turns into.

SPMD code goes wrong quietly when ranks disagree: a collective one rank skipped pairs
with the next one of another rank; blocks of other shapes or dtypes crash inside the
backend or come back as garbage. In the check mode every collective (forward and
backward) and every ``shard_map`` boundary first exchanges a five-number fingerprint
over the whole mesh: a sequence number, a hash of what runs (collective, axes,
direction; a boundary's leaves), a hash of where it was called, a hash of the block
(dtype and shape, compared within one process group of the collective's axes) and
that group's index. If the fingerprints differ, the
ranks exchange their descriptions and every rank raises the same ``ShardingError``
naming each rank's collective and call site — before the real collective runs, so
nothing is left half-done. A rank that never arrives (it returned early or raised)
makes the others fail after the mesh's timeout, with the collective they waited in.

Like ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, it costs an extra small all-gather per
collective (``benchmarks/crosscheck.py`` measures it); off, it costs one flag test.
Nothing is checked while ``torch.compile`` traces.
"""
from __future__ import annotations

import linecache
import os
import re
import sys
import zlib

import torch

from . import _world
from ._errors import ShardingError, first_line

__all__ = ["set_debug", "debug_enabled"]

# read on every collective: a module global, not a function call
ENABLED = os.environ.get("FUNCTP_DEBUG", "0").strip().lower() not in ("", "0", "false", "no")

_PKG = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_MAX_TEXT = 8192              # bytes of one rank's description in an error
_seq: dict[str, int] = {}     # check group name -> fingerprints exchanged so far
_c10d = torch.ops._c10d_functional


def set_debug(enabled: bool = True) -> bool:
    """Turns the cross-rank check mode on or off (as ``FUNCTP_DEBUG=1`` does at import).

    **Arguments:** ``enabled`` – check before every collective and at every
    ``shard_map`` boundary that all ranks run the same collective with the same shape
    and dtype. Switch it on every rank at the same point of the program.

    **Returns:** the previous setting. Example::

        functp.set_debug(True)
        step(params, batch)    # a rank that diverges raises ShardingError on every rank
    """
    global ENABLED
    prev, ENABLED = ENABLED, bool(enabled)
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
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


def _crc(s: str) -> int:
    # stable across processes, unlike hash() of a str
    return zlib.crc32(s.encode())


def _skip(x: torch.Tensor | None) -> bool:
    return torch.compiler.is_compiling() or (
        x is not None and isinstance(x, torch._subclasses.FakeTensor))


def _gather(t: torch.Tensor, check, what: str) -> torch.Tensor:
    try:
        return _world.wait(_c10d.all_gather_into_tensor(t, check.size, check.group_name))
    except RuntimeError as e:
        raise ShardingError(
            f"{what}: not every rank of the mesh reached it within the mesh's timeout "
            f"({_reason(e)}); a rank skipped it, raised before it or returned early. "
            f"[FUNCTP_DEBUG check]") from None


def _reason(e: BaseException) -> str:
    """The first line of a backend's error, without its C++ source location."""
    line = first_line(e)
    return re.sub(r"^\[[^\]]*\]\s*", "", line)[:200] if line else type(e).__name__


def check(check, head: str, details: tuple[str, ...] = (), block: str = "",
          instance: int = 0) -> None:
    """Every rank of ``check``'s group compares ``head`` (one line: what runs) and
    ``details`` (e.g. one line per input leaf) with all others, and ``block`` (a
    collective's dtype and shape) with the ranks of the same ``instance`` (of its
    process group: blocks of uneven layouts differ between groups); raises on every
    rank if they differ."""
    seq = _seq.get(check.group_name, 0)
    _seq[check.group_name] = seq + 1
    site = call_site()
    body = "\n".join(details)
    row = torch.tensor([seq, _crc(head + "\n" + body), _crc(site), _crc(block), instance],
                       dtype=torch.int64, device=check.device)
    what = f"{head} {block}".rstrip()
    table = _gather(row, check, f"{what} (check #{seq}) at {site}").view(check.size, 5)
    same = (table[:, :3] == table[0, :3]).all()
    for i in table[:, 4].unique():
        rows = table[table[:, 4] == i, 3]
        same = same & (rows == rows[0]).all()
    if bool(same):
        return
    texts = _texts(f"#{seq} {what}\n      at {site}\n{body}", check)
    raise ShardingError(_disagreement(texts, check))


def _texts(text: str, check) -> list[str]:
    """Every rank's ``text``, in group order (two small all-gathers of bytes)."""
    data = text.encode()[:_MAX_TEXT]
    n = torch.tensor([len(data)], dtype=torch.int64, device=check.device)
    sizes = _gather(n, check, "exchanging descriptions").tolist()
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = _gather(buf.to(check.device), check, "exchanging descriptions").view(check.size, -1)
    return [bytes(r[:k].tolist()).decode(errors="replace") for r, k in zip(rows.cpu(), sizes)]


def _disagreement(texts: list[str], check) -> str:
    """Each distinct description once, with the ranks that gave it; of detail lines
    (one per leaf) only those not every rank has."""
    lines = [t.split("\n") for t in texts]
    common = set(lines[0][2:]).intersection(*(set(ls[2:]) for ls in lines[1:]))
    seen: dict[str, list[int]] = {}
    for r, ls in zip(check.ranks, lines):
        own = [x for x in ls[2:] if x not in common][:4]
        seen.setdefault("\n".join(ls[:2] + ["    " + x for x in own]), []).append(r)
    parts = [f"ranks disagree on {check.mesh} [FUNCTP_DEBUG check]: every rank must reach "
             f"the same collectives and shard_map boundaries in the same order, with the "
             f"same block shapes and dtypes:"]
    for text, ranks in seen.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        parts.append(f"  {who}: {text}")
    parts.append("a rank that skipped or added a collective (a branch on the rank or on "
                 "data, an exception caught inside a body) or passed other block shapes "
                 "or dtypes diverged here or just before")
    return "\n".join(parts)


def collective(op: str, g, x: torch.Tensor) -> None:
    """Called before each raw collective while the check mode is on."""
    if _skip(x):
        return
    check(g.check, f"{_direction()} {op} over {g.axes} of", block=f"{x.dtype} {tuple(x.shape)}",
          instance=g.instance)


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


def failed(op: str, g, e: BaseException) -> ShardingError:
    """The error for a collective whose wait failed (a timeout, a peer gone)."""
    try:
        seq = f"#{g.pg()._get_sequence_number_for_group()} "
    except Exception:        # noqa: BLE001 - the number is a courtesy
        seq = ""
    return ShardingError(
        f"{op} over {g.axes} (collective {seq}of its process group) failed: {_reason(e)}. "
        f"A rank did not join it within the mesh's timeout, or left. Run with "
        f"FUNCTP_DEBUG=1 to have ranks compare every collective first and name the one "
        f"that diverged; make_mesh(..., timeout=seconds) sets how long to wait")


def forget(prefix: str) -> None:
    """Drops the sequence numbers of check groups whose names start with ``prefix``
    (those of a finished simulation)."""
    for name in [n for n in _seq if n.startswith(prefix)]:
        del _seq[name]
