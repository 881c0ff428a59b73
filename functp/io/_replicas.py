"""What the ranks save must agree on before a save writes anything: whether every
rank saves the same tree (always: one small all-reduce; if not, ``_stage_trees``
checks their union), and, in the check mode (``FUNCTP_DEBUG=1``), equal blocks on
the ranks that replicate a leaf (a checkpoint keeps one copy of it)."""
from __future__ import annotations

import json
import zlib
from typing import Any

import torch
import torch.distributed as dist

from ..mesh._mesh import Mesh
from ..runtime import _crosscheck
from ..runtime._errors import CheckpointError
from ._failures import all_ok
from ._tree_file import encode

__all__ = ["check_replicas", "fingerprint", "same_tree"]

def same_tree(keys: list[str], device: torch.device) -> bool:
    """Whether every rank passes the same keys (paths), in one all-reduce of a CRC32 of
    them and their count. A save's tree file then holds rank 0's structure, otherwise
    (a pipeline's stages, each holding its own layers) the union's (``_stage_trees``);
    a load's checksum check shares the ranges among the ranks only then."""
    crc, n = zlib.crc32("\n".join(keys).encode()), len(keys)
    t = torch.tensor([crc, -crc, n, -n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t[0]) == -int(t[1]) and int(t[2]) == -int(t[3])


def fingerprint(x: Any) -> int:
    """CRC32 of a leaf's dtype, shape and bytes (of its data encoding, for a value)."""
    if not isinstance(x, torch.Tensor):
        return zlib.crc32(json.dumps(encode(x)).encode())
    crc = zlib.crc32(f"{x.dtype} {tuple(x.shape)}".encode())
    data = x.detach().resolve_conj().resolve_neg().contiguous().cpu().reshape(-1)
    data = data.view(torch.uint8)
    return zlib.crc32(memoryview(data.numpy()), crc)


def check_replicas(what: str, path: str, items, keys, mesh: Mesh) -> None:
    """Check mode: every leaf's blocks are equal on the ranks that replicate it (those
    at the same place along the axes its spec mentions; every rank, for a non-tensor
    leaf): a checkpoint keeps one copy, so a rank that differs would be lost without a
    word. One small all-gather of a CRC32 per leaf; every rank raises the same error."""
    check = mesh.check
    fps = all_ok(what, path, torch.device(mesh.device_type),
                  lambda: [fingerprint(x) for _, x, _ in items])
    gather = lambda t: _crosscheck._gather(t.to(check.device), check, f"{what} (check of "
                                           f"replicated leaves)").view(check.size, -1).cpu()
    if not keys:
        return
    table = gather(torch.tensor(fps, dtype=torch.int64))
    positions = [mesh._positions[r] for r in check.ranks]
    bad = []
    for i, (p, x, s) in enumerate(items):
        mentioned = set(s.axes) if s is not None else set()
        replicas: dict[tuple, list[int]] = {}
        for row, (r, pos) in enumerate(zip(check.ranks, positions)):
            place = tuple(c for a, c in zip(mesh.axis_names, pos) if a in mentioned)
            replicas.setdefault(place, []).append(row)
        for rows in replicas.values():
            kinds: dict[int, list[int]] = {}
            for row in rows:
                kinds.setdefault(int(table[row, i]), []).append(check.ranks[row])
            if len(kinds) > 1:
                bad.append((p, keys[i], x, s, mentioned, list(kinds.values())))
                break
    if not bad:
        return
    p, key, x, s, mentioned, groups = bad[0]
    over = [a for a in mesh.axis_names if a not in mentioned]
    differ = "; ".join(f"ranks {g} hold {'one' if j == 0 else 'another'}"
                       for j, g in enumerate(groups))
    more = f" (and {len(bad) - 1} more leaves)" if len(bad) > 1 else ""
    if isinstance(x, torch.Tensor):
        fix = (f"make them equal first (a functp.pmean/psum over {tuple(over)} inside the "
               f"step, or a copy of one rank's value), or give it a spec that mentions "
               f"{over[0]!r} if its blocks are meant to differ")
        kind = f"is saved under {s!r}, replicated over {tuple(over)}"
    else:
        fix = "make the ranks agree on it, or keep it out of the saved tree"
        kind = "is a non-tensor value, saved once for all ranks"
    raise CheckpointError(
        f"{what}: leaf {p} (key '{key}') {kind} on {check.mesh}, but its "
        f"{'blocks' if isinstance(x, torch.Tensor) else 'values'} differ: "
        f"{differ}{more} [FUNCTP_DEBUG check] ({path})\nthe checkpoint would keep one "
        f"rank's copy only; {fix}")
