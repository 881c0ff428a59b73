"""Looking at a distributed program: ``print_ranks`` (what each rank holds) and
``visualize_sharding`` (which rank holds which block of a tensor, as text)."""
from __future__ import annotations

from typing import Any, Sequence

import optree
import torch

from ..runtime import _world
from ..mesh._mesh import Mesh
from ..mesh._layout import block, layout
from ..mesh._spec import normalize_spec
from ..runtime._torch_compat import DisableFuncTorch, unwrap_functorch

__all__ = ["print_ranks", "visualize_sharding"]

def _plain(x: Any) -> Any:
    """A tensor as its value: functorch wrappers (``torch.func.grad``) and autograd
    history removed, so it prints as ``tensor(...)``. Call with functorch disabled
    (or ``detach`` would wrap the result again)."""
    if not isinstance(x, torch.Tensor):
        return x
    return unwrap_functorch(x).detach()


def _format(v: Any) -> str:
    if isinstance(v, str):
        return v
    with DisableFuncTorch():
        return repr(optree.tree_map(_plain, v))


def _ranks(rs: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    out, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if j == i else f"{rs[i]}-{rs[j]}" if j > i + 1
                   else f"{rs[i]}, {rs[j]}")
        i = j + 1
    return ", ".join(out)


def print_ranks(*values: Any, sep: str = " ") -> None:
    """Prints every rank's ``values`` from rank 0, labelled by rank, in rank order;
    ranks that would print the same text share a line.

    A collective over all ranks: call it on every rank (inside or outside a
    ``shard_map`` body, under ``torch.func`` transforms too: tensors print as their
    values). Under :func:`functp.simulate` the output is in one piece, not interleaved.

    **Arguments:** ``values`` – anything printable (tensors and pytrees of them);
    ``sep`` – between values, as for ``print``.

    Example, in a body on a mesh of 2 ranks::

        functp.print_ranks("block", x)
        # [rank 0] block tensor([0., 1.])
        # [rank 1] block tensor([2., 3.])
    """
    text = ""
    for i, v in enumerate(values):
        text += sep if i else ""
        # a multi-line value (a matrix) keeps its columns under its first line
        indent = "\n" + " " * len(text.rsplit("\n", 1)[-1])
        text += _format(v).replace("\n", indent)
    with _world.peers("functp.print_ranks"):
        texts = [b.decode() for b in _world.all_gather_bytes(text.encode())]
    if _world.process_index() != 0:
        return
    groups: dict[str, list[int]] = {}
    for r, t in enumerate(texts):
        groups.setdefault(t, []).append(r)
    for t, rs in sorted(groups.items(), key=lambda kv: kv[1][0]):
        label = f"[rank {rs[0]}]" if len(rs) == 1 else f"[ranks {_ranks(rs)}]"
        lines = t.split("\n")
        print("\n".join([f"{label} {lines[0]}"] + [" " * (len(label) + 1) + ln
                                                    for ln in lines[1:]]))


def _span(off: int, size: int, n: int) -> str:
    return ":" if (off, size) == (0, n) else f"{off}:{off + size}"


def visualize_sharding(x: torch.Tensor | Sequence[int], spec: Any, mesh: Mesh) -> str:
    """Which rank holds which block of a tensor laid out by ``spec`` on ``mesh``, as
    text (JAX's ``visualize_array_sharding``). No communication.

    **Arguments:** ``x`` – the global tensor, or its shape; ``spec`` – a ``P``;
    ``mesh`` – the mesh.

    **Returns:** a table: for a 1-d or 2-d tensor, the grid of blocks with the ranks
    holding each; otherwise one line per distinct block.

    Example, on ``make_mesh((2, 2), ("dp", "tp"))``::

        print(functp.visualize_sharding(torch.zeros(4, 6), P("dp", "tp"), mesh))
        # float32[4, 6] as P('dp', 'tp') on Mesh(dp=2, tp=2; cpu)
        #         [:, 0:3]  [:, 3:6]
        # [0:2, :]  rank 0    rank 1
        # [2:4, :]  rank 2    rank 3
    """
    if isinstance(x, torch.Tensor):
        shape, head = tuple(x.shape), f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
    else:
        shape = tuple(int(n) for n in x)
        head = f"shape {list(shape)}"
    spec = normalize_spec(spec, mesh.axis_names, "visualize_sharding", shape)
    lay = layout(spec, len(shape))
    holders: dict[tuple, list[int]] = {}
    for r, pos in sorted(mesh._positions.items()):
        coord = dict(zip(mesh.axis_names, pos))
        key = tuple(block(n, axes, mesh.shape, coord) for n, axes in zip(shape, lay))
        holders.setdefault(key, []).append(r)
    title = f"{head} as {spec!r} on {mesh!r}"

    def who(rs: list[int]) -> str:
        return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {_ranks(rs)}"

    if len(shape) not in (1, 2):
        width = max(len(_index(k, shape)) for k in holders)
        return "\n".join([title] + [f"{_index(k, shape).ljust(width)}  {who(rs)}"
                                    for k, rs in holders.items()])
    rows = sorted({k[0] for k in holders}) if len(shape) == 2 else [None]
    cols = sorted({k[-1] for k in holders})
    col_head = [(f"[:, {_span(*c, shape[1])}]" if len(shape) == 2
                 else f"[{_span(*c, shape[0])}]") for c in cols]
    row_head = [f"[{_span(*r, shape[0])}, :]" if r is not None else "" for r in rows]
    cells = [[who(holders[(r, c) if r is not None else (c,)]) for c in cols] for r in rows]
    w0 = max(len(h) for h in row_head)
    ws = [max(len(col_head[j]), *(len(cells[i][j]) for i in range(len(rows))))
          for j in range(len(cols))]
    lines = [title, " " * w0 + "".join("  " + h.ljust(w) for h, w in zip(col_head, ws))]
    for h, row in zip(row_head, cells):
        lines.append(h.ljust(w0) + "".join("  " + c.ljust(w) for c, w in zip(row, ws)))
    return "\n".join(ln.rstrip() for ln in lines)


def _index(key: tuple, shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(_span(o, s, n) for (o, s), n in zip(key, shape)) + "]"
