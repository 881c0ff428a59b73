"""Peak memory and collectives of a 4-layer tensor-parallel step with every block
rematerialized (``functp.checkpoint``) against none.

    python benchmarks/remat.py [--device cuda]     # 2 gloo processes; results/remat.json

The pre-norm MLP blocks of ``_models.py`` at the medium size (hidden 256, ffn 1024),
4 layers, 16 × 128 tokens, Megatron TP over 2 ranks, one ``torch.func.grad`` step and
one tape step: the rise of peak memory during the step (peak RSS on the CPU, with
glibc's mmap threshold fixed so that freed blocks leave the RSS; the CUDA allocator's
peak on a GPU; min of 3), the median time of 5, and the collectives (comm_log).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import functp  # noqa: E402
from functp import P  # noqa: E402
import _models as M  # noqa: E402
import compare  # noqa: E402
from _run import main_or_launch, save_and_leave  # noqa: E402

LAYERS, BATCH, SEQ = 4, 16, 128


def variants(device: str):
    hidden, ffn = M.SIZES["medium"]
    mesh = functp.make_mesh((int(os.environ["WORLD_SIZE"]),), ("tp",), device)
    params = {k: v.to(device) for k, v in M.init_params(hidden, ffn, LAYERS).items()}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, hidden, generator=g).to(device)
    y = torch.randn(BATCH, SEQ, hidden, generator=g).to(device)
    specs = {n: {"fc1.weight": P("tp", None), "fc1.bias": P("tp"),
                 "fc2.weight": P(None, "tp")}.get(n.split(".", 2)[2], P()) for n in params}
    local = functp.shard(params, mesh, specs)
    psum = lambda h: functp.psum(h, "tp")     # noqa: E731

    def make(policy):
        blk = lambda bp, h: M.block(bp, h, post=psum)    # noqa: E731
        if policy != "none":
            blk = functp.checkpoint(blk, policy=policy)

        def loss(p, x, y):
            h = x
            for i in range(LAYERS):
                h = blk(M.block_params(p, i), h)
            return M.mse(h, y)
        return functp.shard_map(loss, mesh, in_specs=(specs, P(), P()), out_specs=P())

    out = {}
    for name, pol in (("no remat", "none"), ("remat every block", None),
                      ("remat, dots_saveable", functp.remat_policies.dots_saveable)):
        step = make(pol)

        def grad_step(step=step):
            return torch.func.grad(step)(local, x, y)

        def tape_step(step=step):
            p = {k: v.detach().requires_grad_() for k, v in local.items()}
            return torch.autograd.grad(step(p, x, y), list(p.values()))
        out[name] = {"torch.func.grad": grad_step, "tape": tape_step}
    return out


def main(device: str) -> None:
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    compare._DEVICE = device
    rows = {}
    for name, modes in variants(device).items():
        for mode, fn in modes.items():
            fn()
            with functp.comm_log() as log:
                fn()
            mem = min(compare._peak_rss_rise(fn) for _ in range(3))
            times = []
            for _ in range(5):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            rows[f"{name} | {mode}"] = {
                "peak_mib": mem / 2 ** 20, "ms": statistics.median(times) * 1e3,
                "collectives": {f"{op}:{'+'.join(ax)}": c for (op, ax), c in log.summary().items()}}
    if dist.get_rank() == 0:
        print(f"remat: {LAYERS} layers, medium, {BATCH}x{SEQ} tokens, TP over "
              f"{dist.get_world_size()} ranks ({device}, torch {torch.__version__})")
        for k, r in rows.items():
            print(f"  {k:45s} peak {r['peak_mib']:8.1f} MiB  {r['ms']:8.1f} ms  {r['collectives']}")
    save_and_leave("remat", {"torch": torch.__version__, "device": device, "rows": rows})


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = ap.parse_args()
    # big blocks straight from mmap and back on free: peak RSS then follows the live
    # tensors (glibc would otherwise keep freed blocks of a recompute in its heap, and
    # the high-water mark would not show what remat saves); read at the processes' start
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    main_or_launch(lambda: main(a.device), 2, __file__, "--device", a.device)
