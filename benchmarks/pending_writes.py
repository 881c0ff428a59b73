"""Python calls per step while a forward collective is pending (issue 41 item 2).

    python benchmarks/pending_writes.py       # 2 simulated ranks, this process

A body gathers a weight (``all_gather``, kept pending: read only at the end), then
runs 20 operators on another tensor, out of place or in place, under
``torch.func.grad``. While the gather is pending, functp's dispatch mode sees each
operator: an in-place one is checked against the gather's input (the memory the
backend still reads). Rows: lazy waits on (the default) and off
(``set_overlap(forward=False)``: waited at once, no mode), in the same run; run it on
two trees to compare them (``benchmarks/README.md``, issue 41).
"""
from __future__ import annotations

import cProfile
import pstats

import torch

import functp
from functp import P

REPS = 10


def _count(inplace: bool, forward: bool) -> float:
    functp.set_overlap(forward=forward)
    mesh = functp.make_mesh((2,), ("x",))

    def body(w, h):
        full = functp.all_gather(w, "x", tiled=True)     # pending until the end
        for _ in range(20):
            h = h.mul_(1.0) if inplace else h * 1.0
        return functp.psum(full.sum() + h.sum(), "x")

    step = torch.func.grad(functp.shard_map(body, mesh, in_specs=(P("x"), P("x")),
                                            out_specs=P()))
    w = functp.shard(torch.randn(4), mesh, P("x"))
    h = functp.shard(torch.randn(4, 8), mesh, P("x"))
    for _ in range(3):
        step(w, h.clone())
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(REPS):
        step(w, h.clone())
    prof.disable()
    return pstats.Stats(prof).total_calls / REPS      # this rank's thread only


def main() -> None:
    print(f"Python calls per step of rank 0 (torch {torch.__version__}, 2 simulated ranks)")
    for inplace in (False, True):
        lazy, now = (functp.simulate(_count, 2, inplace, f, check=False)[0]
                     for f in (True, False))
        what = "20 in-place ops" if inplace else "20 out-of-place ops"
        print(f"  {what:22s} lazy {lazy:7.0f}   waited at once {now:7.0f}   "
              f"({lazy / now:.2f}x)")


if __name__ == "__main__":
    main()
