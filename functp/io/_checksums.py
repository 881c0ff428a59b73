"""Checksums of a checkpoint: ``save`` records the CRC32 of every byte range DCP
stored (and of ``.metadata`` and the tree file) in ``.functp_checksums.json``, written
last, which also marks the save as finished; ``load`` checks the ranges it reads
before DCP reads them."""
from __future__ import annotations

import json
import os
import re
import zlib
from typing import Any

import torch
import torch.distributed as dist

from ..runtime._errors import CheckpointError
from ._failures import all_ok
from ._format import METADATA, SUMS, TREE
from ._replicas import same_tree

__all__ = ["record_checksums", "unmark", "verify"]

def _entries(meta) -> list[tuple[Any, Any]]:
    """``[(MetadataIndex, _StorageInfo)]`` of the stored byte ranges, in one order on
    every rank."""
    return sorted(meta.storage_data.items(), key=lambda e: (e[0].fqn, tuple(e[0].offset or ())))


def _entry_key(index) -> tuple[str, tuple[int, ...] | None]:
    # DCP's own key of a byte range: MetadataIndex hashes (fqn, offset) only
    return index.fqn, None if index.offset is None else tuple(index.offset)


def _crc(file: str, start: int, length: int) -> int:
    crc = 0
    with open(file, "rb") as f:
        f.seek(start)
        while length:
            b = f.read(min(length, 1 << 24))
            if not b:
                raise EOFError(f"{file} ends before byte {start + length}")
            crc, length = zlib.crc32(b, crc), length - len(b)
    return crc


def _writer(relative_path: str, world: int) -> int:
    """The rank that wrote a data file: DCP names them ``__{rank}_{n}.distcp``
    (filesystem.py, ``_FileSystemWriter.prepare_global_plan`` and ``write_data``).
    Any other name falls to rank 0, so every range gets a checksum."""
    m = re.match(r"__(\d+)_", relative_path)
    return int(m.group(1)) if m and int(m.group(1)) < world else 0


def record_checksums(what: str, path: str, meta, device: torch.device, tree: bytes) -> None:
    """After ``dcp.save``: each rank computes the CRC32s of the ranges in the files it
    wrote (still in its page cache), one all-reduce collects them, rank 0 writes the
    tree file (``tree``, rank 0's) and then :data:`SUMS`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    entries = _entries(meta)
    mine = all_ok(what, path, device, lambda: {
        i: _crc(os.path.join(path, s.relative_path), s.offset, s.length)
        for i, (_, s) in enumerate(entries) if _writer(s.relative_path, world) == rank})
    crcs = torch.zeros(len(entries), dtype=torch.int64)
    for i, c in mine.items():
        crcs[i] = c
    crcs = crcs.to(device)
    dist.all_reduce(crcs)          # each range is summed by one rank: the sum is its CRC
    crcs = crcs.tolist()

    def write() -> None:
        if rank != 0:
            return
        _write_whole(os.path.join(path, TREE), tree)
        with open(os.path.join(path, METADATA), "rb") as f:
            record = {"metadata": zlib.crc32(f.read()), "tree": zlib.crc32(tree), "entries": [
                [i.fqn, None if i.offset is None else list(i.offset), s.relative_path,
                 s.offset, s.length, c] for (i, s), c in zip(entries, crcs)]}
        _write_whole(os.path.join(path, SUMS), json.dumps(record).encode())
    all_ok(what, path, device, write)     # and no rank returns before the mark is there


def _write_whole(file: str, data: bytes) -> None:
    """``data`` into ``file``, whole or not at all."""
    tmp = file + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)


def unmark(path: str) -> None:
    """Removes the finished-save mark, so that an overwrite that fails midway leaves
    a checkpoint that ``load`` calls incomplete rather than a mix of two saves."""
    try:
        os.remove(os.path.join(path, SUMS))
    except (FileNotFoundError, NotADirectoryError):
        pass     # nothing to unmark; DCP reports a path it cannot write to


def verify(what: str, path: str, meta, sums, fqns, device: torch.device | None) -> None:
    """Checks every stored range of the keys ``fqns`` against its checksum, before DCP
    reads it. With ``device`` the ranks share the work when they load the same keys
    (rank r the ranges i with ``i % world == r``), each checks its own keys' when they
    do not (a pipeline's stages), and they agree on the first bad range in one
    all-reduce, so every rank raises the same error; without, this process checks
    them all."""
    if sums is None:
        return               # plain DCP: nothing to check against
    entries = _entries(meta)                    # (the same list on every rank)
    wanted = [i for i, (index, _) in enumerate(entries) if index.fqn in fqns]
    if device is not None and same_tree(sorted(fqns), device):
        wanted = wanted[dist.get_rank()::dist.get_world_size()]
    bad = len(entries)
    for i in wanted:
        index, s = entries[i]
        rec = sums.get(_entry_key(index))
        try:
            ok = (rec is not None and tuple(rec[:3]) == (s.relative_path, s.offset, s.length)
                  and _crc(os.path.join(path, s.relative_path), s.offset, s.length) == rec[3])
        except (OSError, EOFError):
            ok = False
        if not ok:
            bad = i
            break
    if device is not None:
        flag = torch.tensor([bad], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        bad = int(flag)
    if bad < len(entries):
        index, s = entries[bad]
        raise CheckpointError(
            f"{what}: key '{index.fqn}' is corrupted: bytes {s.offset}..{s.offset + s.length}"
            f" of {s.relative_path} fail their checksum ({path})\n"
            f"the file was changed, truncated or lost after the save; restore it or save again")
