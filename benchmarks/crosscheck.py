"""What the cross-rank check mode (``FUNCTP_DEBUG=1``) costs per collective and per step.

    python benchmarks/crosscheck.py [--nproc 2] [--device cpu|cuda]

With the check on, each collective and each ``shard_map`` boundary first all-gathers
a 3-number fingerprint over the whole mesh. Rank 0 prints, per psum and per step of
the tensor-parallel MLP of ``_models.py`` (small size, ``torch.func.grad``): time
with the check off and on (median of 7 rounds), the difference per collective, and
Python calls (cProfile; stable where times are not). Writes
benchmarks/results/crosscheck.json.
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
from calls import count  # noqa: E402
from _run import main_or_launch, save_and_leave  # noqa: E402


def seconds(fn, device: str, reps: int = 20, rounds: int = 7) -> float:
    """Median over rounds of the mean time of ``fn`` (after a warm-up)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    out = []
    for _ in range(rounds):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        out.append((time.perf_counter() - t0) / reps)
    return statistics.median(out)


def cases(mesh, device: str) -> dict:
    k = 8
    x = torch.randn(1024, device=device)
    psums = functp.shard_map(lambda x: sum(functp.psum(x, "tp") for _ in range(k)).sum(),
                             mesh, in_specs=P("tp"), out_specs=P())
    hidden, ffn = M.SIZES["small"]
    params = {n: t.to(device) for n, t in M.init_params(hidden, ffn).items()}
    xs, ys = (t.to(device) for t in M.init_data(hidden))
    specs = {n: {"fc1.weight": P("tp", None), "fc1.bias": P("tp"),
                 "fc2.weight": P(None, "tp")}.get(n.split(".", 2)[2], P()) for n in params}
    local = functp.shard(params, mesh, specs)
    loss = functp.shard_map(
        lambda p, x, y: M.mse(M.forward(p, x, post=lambda h: functp.psum(h, "tp")), y),
        mesh, in_specs=(specs, P(), P()), out_specs=P())
    out = {}
    for name, fn in ((f"{k} psums of 1024 floats, torch.func.grad",
                      lambda: torch.func.grad(psums)(x)),
                     ("TP MLP step (small), torch.func.grad",
                      lambda: torch.func.grad(loss)(local, xs, ys))):
        with functp.comm_log() as log:
            fn()
        out[name] = (fn, len(log.events))
    return out


def main(device: str) -> None:
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = functp.make_mesh((int(os.environ["WORLD_SIZE"]),), ("tp",), device)
    res = {"torch": torch.__version__, "ranks": mesh.size, "device": device, "rows": {}}
    for name, (fn, colls) in cases(mesh, device).items():
        row = {"collectives": colls}
        for on in (False, True):
            prev = functp.set_debug(on)
            row["on" if on else "off"] = {"s": seconds(fn, device), "calls": count(fn, 5)}
            functp.set_debug(prev)
        # each boundary is checked too: 2 forward and 2 backward per step
        row["us_per_check"] = (row["on"]["s"] - row["off"]["s"]) / (colls + 4) * 1e6
        res["rows"][name] = row
    if dist.get_rank() == 0:
        print(f"FUNCTP_DEBUG check cost (torch {torch.__version__}, {mesh.size} ranks, {device})")
        print(f"  {'':44s} {'off ms':>8s} {'on ms':>8s} {'ratio':>6s} {'us/check':>9s} "
              f"{'calls off':>9s} {'calls on':>9s}")
        for name, r in res["rows"].items():
            print(f"  {name:44s} {r['off']['s'] * 1e3:8.3f} {r['on']['s'] * 1e3:8.3f} "
                  f"{r['on']['s'] / r['off']['s']:6.2f} {r['us_per_check']:9.1f} "
                  f"{r['off']['calls']:9.0f} {r['on']['calls']:9.0f}")
    save_and_leave("crosscheck", res)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = ap.parse_args()
    main_or_launch(lambda: main(a.device), a.nproc, __file__, "--device", a.device)
