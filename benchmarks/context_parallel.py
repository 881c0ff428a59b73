"""functp.attention's three strategies against torch's context parallelism, on the
same causal attention over the same sequence split over 4 gloo processes: step time
(forward + backward, medians, the variants interleaved in both orders), the
collectives and the bytes each rank hands them, and the peak memory of a step.

    python benchmarks/context_parallel.py            # launches 4 local processes
    python benchmarks/context_parallel.py --seq 4096 --rounds 7

torch's public ``context_parallel`` (torch.distributed.tensor.experimental) cannot run
on the CPU: its SDPA dispatch has handlers for the flash, efficient and cuDNN CUDA
kernels only, and the CPU's ``_scaled_dot_product_flash_attention_for_cpu`` has no
sharding rule (``NotImplementedError`` in this torch); the math backend fails on
DTensor/Tensor mixing. So the torch rows call what ``context_parallel`` runs
underneath, its ``_templated_ring_attention`` forward and backward (load-balanced,
``rotate_method`` ALL_GATHER, torch's default), with the CPU flash kernels: the same
algorithm and collectives, without the DTensor dispatch. Both sides take the
load-balanced layout (rank i holds chunks i and 2cp-1-i).

Writes benchmarks/results/context_parallel.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import functp
from functp import P

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = P(None, None, "cp", None)


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--world", type=int, default=4)
    return p.parse_args(argv)


def _functp_step(strategy, mesh):
    def loss(q, k, v, w):
        out = functp.attention(q, k, v, "cp", strategy=strategy, causal=True)
        return functp.psum((out * w).sum(), "cp")
    f = functp.shard_map(loss, mesh, in_specs=(SPEC,) * 4, out_specs=P())

    def step(q, k, v, w):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        f(*leaves, w).backward()
        return [t.grad for t in leaves]
    return step


def _torch_step():
    # what context_parallel runs underneath (module docstring), on the CPU kernels
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    group = dist.group.WORLD

    def step(q, k, v, w):
        out, lse = cp._templated_ring_attention(group, 2, fwd, q, k, v, is_causal=True)[:2]
        return cp._templated_ring_attention_backward(
            group, 2, bwd, w, "grad_out", q, k, v, out, lse, is_causal=True,
            dropout_p=0.0, scale=None)[:3]
    return step


def _peak_bytes(step, args):
    """The most bytes of tensors alive at once during one step (torch's MemTracker)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    mt = MemTracker()
    with mt:
        step(*args)
    snap = mt.get_tracker_snapshot("peak")
    return max(v.get("Total", 0) for v in snap.values()) if snap else 0


def _counts(step, args):
    from torch.distributed.tensor.debug import CommDebugMode
    with functp.comm_log() as log, CommDebugMode() as cdm:
        step(*args)
    funcol = {str(k).split(".")[-1]: v for k, v in cdm.get_comm_counts().items()}
    ours = {op: n for (op, _), n in log.summary().items()}
    return ours or funcol, log.nbytes()


def main(argv=None) -> dict:
    a = _args(argv)
    torch.set_num_threads(1)
    mesh = functp.make_mesh((functp.process_count(),), ("cp",))
    n = mesh.shape["cp"]
    torch.manual_seed(0)
    full = [torch.randn(1, a.heads, a.seq, a.head_dim) for _ in range(4)]
    blocks = functp.cp_shard(tuple(full), mesh, dim=2)
    steps = {s: _functp_step(s, mesh) for s in ("allgather", "ulysses", "ring")}
    steps["torch ring (allgather rotate)"] = _torch_step()
    ref = steps["allgather"](*blocks)
    rows = {}
    for name, step in steps.items():
        step(*blocks)                                    # warm-up
        grads = step(*blocks)
        err = max((g - r).abs().max().item() for g, r in zip(grads, ref))
        colls, nbytes = _counts(step, blocks)
        if not nbytes:
            # torch's collectives (funcol, counted by CommDebugMode) each take one
            # buffer of this rank's K and V, concatenated (or their gradients'):
            # the same count comm_log would give
            nbytes = sum(colls.values()) * 2 * blocks[1].numel() * blocks[1].element_size()
        rows[name] = {"times": [], "max |grad - allgather|": err, "collectives": colls,
                      "bytes": nbytes, "peak bytes": _peak_bytes(step, blocks)}
    names = list(steps)
    for r in range(a.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):     # both orders
            dist.barrier()
            t0 = time.perf_counter()
            steps[name](*blocks)
            dist.barrier()
            rows[name]["times"].append(time.perf_counter() - t0)
    base = statistics.median(rows["torch ring (allgather rotate)"]["times"])
    for row in rows.values():
        row["median s"] = statistics.median(row.pop("times"))
        row["time / torch"] = row["median s"] / base
    result = {"seq": a.seq, "heads": a.heads, "head_dim": a.head_dim, "cp": n,
              "dtype": "float32", "rounds": a.rounds, "rows": rows}
    if functp.process_index() == 0:
        for name, row in rows.items():
            print(f"{name:30s} {row['median s'] * 1e3:8.1f} ms  x{row['time / torch']:.2f}  "
                  f"peak {row['peak bytes'] / 2**20:7.1f} MiB  {row['collectives']}  "
                  f"{row['bytes']} B  err {row['max |grad - allgather|']:.1e}")
        os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
        with open(os.path.join(HERE, "results", "context_parallel.json"), "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    return result


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
        dist.destroy_process_group()
    else:
        from torch.distributed.run import main as torchrun
        nproc = _args(sys.argv[1:]).world
        torchrun(["--standalone", "--nproc-per-node", str(nproc), __file__] + sys.argv[1:])
