"""The check mode's comparison of *values* across ranks: ranks that must hold the same
tensor (a replicated input or output, a "full" tensor given to ``shard``) compare a
fingerprint of it, and blocks that should differ but are all alike draw a warning.

A fingerprint is four float64 numbers: the sum, the sum of absolute values, a sum
weighted by position (so that a permutation shows) and whether every element is
equal. Ranks compare them with a relative tolerance, so that the last-bit differences
of non-deterministic kernels (atomics on a GPU) are not reported; values that really
differ (each rank drew its own random tensor, a sum that was never all-reduced)
differ far beyond it. One all-gather over the mesh per call, in the check mode only.
"""
from __future__ import annotations

import warnings

import torch

from . import _crosscheck
from ._errors import ShardingError, leaf_text
from ._torch_compat import DisableFuncTorch, unwrap_functorch

_RTOL = 1e-5
_warned: set = set()          # (body, path) pairs already warned about


def _plain(x: torch.Tensor) -> torch.Tensor:
    # the value under functorch wrappers (torch.func.grad, vmap: a batched value is
    # compared with its batch dimension, the same on every rank)
    return unwrap_functorch(x).detach()


def _fingerprint(x: torch.Tensor) -> torch.Tensor:
    x = _plain(x)
    if x.is_complex():
        x = torch.view_as_real(x)
    v = x.reshape(-1).to(torch.float64)
    if v.numel() == 0:
        return torch.zeros(4, dtype=torch.float64, device=v.device)
    w = torch.arange(1, v.numel() + 1, dtype=torch.float64, device=v.device).remainder_(7.0)
    const = (v.amax() == v.amin()) | (v.numel() == 1)
    return torch.stack([v.sum(), v.abs().sum(), (v * w).sum(), const.to(torch.float64)])


def _exchange(mesh, leaves: list, idx: list[int], what: str) -> torch.Tensor | None:
    """Every rank's fingerprints of ``leaves[i]`` for ``i`` in ``idx``: ``[mesh size,
    len(idx), 4]`` in check-group order; None where nothing is compared (one rank, no
    such leaf, or the check mode skips this call -- the same answer on every rank)."""
    if mesh.check.size == 1 or not idx or _crosscheck._skip(None):
        return None
    with DisableFuncTorch(), torch.no_grad():
        mine = torch.stack([_fingerprint(leaves[i]) for i in idx]).reshape(-1)
        table = _crosscheck._gather(mine.to(mesh.check.device), mesh.check, what)
    return table.view(mesh.check.size, len(idx), 4).cpu()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = max(float(a[1]), float(b[1]), 1e-300)
    for i in (0, 1, 2):
        if not (abs(float(a[i]) - float(b[i])) <= _RTOL * scale
                or (a[i].isnan() and b[i].isnan())):
            return False
    return True


def _classes(mesh, free: set) -> dict[tuple, list[int]]:
    """The mesh's ranks (check-group indices) grouped by their position on every axis
    but ``free``: the ranks of one class must hold the same value."""
    out: dict[tuple, list[int]] = {}
    for i, r in enumerate(mesh.check.ranks):
        pos = mesh._positions[r]
        out.setdefault(tuple(p for a, p in zip(mesh.axis_names, pos) if a not in free),
                       []).append(i)
    return out


def _differing(mesh, table: torch.Tensor, k: int, free: set) -> tuple[list[int], list[str]] | None:
    """The first class whose ranks hold different values of leaf ``k``, as (global
    ranks, the axes along which they differ); None if every class agrees."""
    for members in _classes(mesh, free).values():
        ref = table[members[0], k]
        bad = [i for i in members if not _same(table[i, k], ref)]
        if bad:
            # the axes along which two ranks that differ only there hold other values
            axes = [a for a in mesh.axis_names if a in free and any(
                not _same(table[i, k], table[c[0], k])
                for c in _classes(mesh, {a}).values() for i in c if i in members)]
            return [mesh.check.ranks[i] for i in [members[0]] + bad], axes
    return None


def _sums(table: torch.Tensor, k: int, ranks: list[int], mesh) -> str:
    at = {r: i for i, r in enumerate(mesh.check.ranks)}
    return ", ".join(f"rank {r}: {float(table[at[r], k, 0]):.6g}" for r in ranks[:4])


def _refuse_first_difference(mesh, table: torch.Tensor | None, idx: list[int], free_of,
                             message) -> None:
    """Raises, agreed on every rank, for the first compared leaf ``leaves[i]`` (row
    ``k`` of ``table``) whose ranks differ along the axes ``free_of(i)`` says must
    agree: ``message(i, ranks, axes, sums)`` is the text."""
    if table is None:
        return
    for k, i in enumerate(idx):
        free = free_of(i)
        bad = _differing(mesh, table, k, free) if free else None
        if bad is not None:
            ranks, axes = bad
            raise _crosscheck.agreed(ShardingError(
                message(i, ranks, axes, _sums(table, k, ranks, mesh))))


def _replicated(manual: tuple[str, ...], specs: list):
    """Leaf ``i`` -> the manual axes its spec leaves out: those its ranks must agree on."""
    return lambda i: {a for a in manual if a not in specs[i].axes}


def check_full(mesh, paths: list[str], leaves: list, what: str) -> None:
    """``shard``: every rank's "full" tensor must be the same one."""
    idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    table = _exchange(mesh, leaves, idx, f"{what}: comparing full tensors")
    everywhere = lambda i: set(mesh.axis_names)  # noqa: E731
    _refuse_first_difference(mesh, table, idx, everywhere, lambda i, ranks, _, sums: (
        f"{what}: {leaf_text(paths[i], leaves[i].shape)} differs across ranks {ranks} "
        f"(sums {sums}), but {what} takes each rank's block of one full tensor that every "
        f"rank holds. Make it the same everywhere (call torch.manual_seed with one seed on "
        f"every rank before drawing it), or pass src_rank=0 to use rank 0's. "
        f"[FUNCTP_DEBUG check]"))


def check_inputs(mesh, manual: tuple[str, ...], name: str, paths: list[str], leaves: list,
                 specs: list) -> None:
    """A ``shard_map`` entry: an input replicated over an axis must be the same along
    it (an error); blocks split over an axis that are all alike draw a warning (full
    tensors passed where blocks are expected)."""
    idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and specs[i] is not None]
    table = _exchange(mesh, leaves, idx, f"shard_map({name}) entry: comparing inputs")
    if table is None:
        return
    _refuse_first_difference(mesh, table, idx, _replicated(manual, specs),
                             lambda i, ranks, axes, sums: (
        f"{leaf_text(f'in_specs for {paths[i]}', leaves[i].shape)} of shard_map({name}): "
        f"{specs[i]!r} says it is replicated over {tuple(axes)}, but ranks {ranks} hold "
        f"different values (sums {sums}). Pass the same tensor on every rank along "
        f"{tuple(axes)} (one seed before drawing it, or functp.shard(..., src_rank=0)), or "
        f"name {axes[0]!r} in its spec if each rank's value is its own block. "
        f"[FUNCTP_DEBUG check]"))
    for k, i in enumerate(idx):
        _warn_if_alike(mesh, table, k, manual, name, paths[i], leaves[i], specs[i])


def _warn_if_alike(mesh, table, k: int, manual, name: str, path: str, x, spec) -> None:
    split = {a for a in manual if a in spec.axes}
    if split and x.numel() > 1 and (name, path) not in _warned:
        members = next(iter(_classes(mesh, split).values()))
        if len(members) > 1 and not bool(table[members[0], k, 3]) and all(
                _same(table[j, k], table[members[0], k]) for j in members):
            _warned.add((name, path))
            warnings.warn(
                f"{leaf_text(f'in_specs for {path}', x.shape)} of shard_map({name}): "
                f"{spec!r} splits it over {tuple(a for a in manual if a in split)}, but "
                f"every rank along them holds the same block. Did you pass the full "
                f"tensor? shard_map takes each rank's own block: functp.shard(full, "
                f"mesh, specs) gives it. [FUNCTP_DEBUG check]", stacklevel=5)


def check_outputs(mesh, manual: tuple[str, ...], name: str, paths: list[str], leaves: list,
                  specs: list, check_vma: bool) -> None:
    """A ``shard_map`` exit: an output that out_specs declares replicated over an axis
    must be the same along it (vma mode proves it for what it tracks; with
    ``check_vma=False`` nothing else would notice)."""
    idx = [i for i, y in enumerate(leaves) if isinstance(y, torch.Tensor) and specs[i] is not None
           and any(a not in specs[i].axes for a in manual)]
    table = _exchange(mesh, leaves, idx, f"shard_map({name}) exit: comparing outputs")
    how = ("with check_vma=False nothing tracks which values vary" if not check_vma
           else "it was computed from something vma tracking cannot see (a Python number "
                "that differs per rank, such as axis_index, or data from outside the body)")
    _refuse_first_difference(mesh, table, idx, _replicated(manual, specs),
                             lambda i, ranks, axes, sums: (
        f"{leaf_text(f'{paths[i]} of shard_map({name})', leaves[i].shape)} differs across "
        f"ranks {ranks} (sums {sums}), but out_specs {specs[i]!r} says it is replicated over "
        f"{tuple(axes)}; {how}. Reduce it with functp.psum/pmean(..., {axes[0]!r}), or name "
        f"{axes[0]!r} in its out_spec. [FUNCTP_DEBUG check]"))
