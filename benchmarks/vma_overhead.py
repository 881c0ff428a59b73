"""Per-step cost of vma tracking (check_vma=True) against check_vma=False.

    python benchmarks/vma_overhead.py            # launches 4 local gloo processes

One training step (loss and gradients of a transformer block, two sizes) on a mesh of
4 CPU processes in three layouts: data parallel (dp=4), tensor parallel (tp=4) and
2-D (dp=2, tp=2); through torch.func.grad and through tape autograd. The two modes
alternate step by step so both see the same machine noise; the table gives the
median step time of each and their ratio (median and 10th-90th percentile of the
per-pair ratios), plus the collectives each mode issues per step. Writes
benchmarks/results/vma_overhead.json.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import functp  # noqa: E402
from functp import P  # noqa: E402
from _block import init_params, local_loss, tp_specs  # noqa: E402
from _run import main_or_launch  # noqa: E402

SIZES = {"small": (64, 256), "medium": (256, 1024)}     # (hidden, ffn)
HEADS, SEQ, BATCH = 8, 32, 8
WARMUP, STEPS = 5, int(os.environ.get("STEPS", "30"))
LAYOUTS = {"dp": ((4,), ("dp",)), "tp": ((4,), ("tp",)), "2d": ((2, 2), ("dp", "tp"))}


def _step_fns(layout, size, check_vma):
    shape, names = LAYOUTS[layout]
    mesh = functp.make_mesh(shape, names)
    tp = "tp" if "tp" in names else None
    dp = "dp" if "dp" in names else None
    D, FFN = SIZES[size]
    params = init_params(D, FFN)
    specs = tp_specs(params) if tp else {k: P() for k in params}
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, SEQ, D, generator=g), torch.randn(BATCH, SEQ, D, generator=g)
    data_spec = P(dp) if dp else P()
    local = functp.shard(params, mesh, specs)
    xl, yl = functp.shard((x, y), mesh, data_spec)
    loss = functp.shard_map(lambda p, x, y: local_loss(p, x, y, HEADS, tp, dp), mesh,
                            in_specs=(specs, data_spec, data_spec), out_specs=P(),
                            check_vma=check_vma)
    func_step = lambda: torch.func.grad_and_value(loss)(local, xl, yl)
    tape_params = {k: v.clone().requires_grad_() for k, v in local.items()}

    def tape_step():
        out = loss(tape_params, xl, yl)
        return torch.autograd.grad(out, list(tape_params.values())), out
    return {"torch.func.grad": func_step, "tape autograd": tape_step}


def _time(fn) -> float:
    torch.distributed.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    torch.set_num_threads(1)
    functp.make_mesh((4,), ("dp",))
    rank0 = torch.distributed.get_rank() == 0
    rows = []
    for size, layout in [(s, l) for s in SIZES for l in LAYOUTS]:
        fns = {m: _step_fns(layout, size, m) for m in (True, False)}
        for path in ("torch.func.grad", "tape autograd"):
            counts = {}
            for m in (True, False):
                for _ in range(WARMUP):
                    fns[m][path]()
                with functp.comm_log() as log:
                    fns[m][path]()
                counts[m] = len(log)
            times = {True: [], False: []}
            for i in range(STEPS):
                order = (True, False) if i % 2 else (False, True)
                for m in order:
                    times[m].append(_time(fns[m][path]))
            # every rank times the same steps; rank 0's numbers are reported
            ratios = sorted(a / b for a, b in zip(times[True], times[False]))
            q = lambda p: ratios[min(len(ratios) - 1, int(p * len(ratios)))]
            rows.append({
                "size": size, "layout": layout, "path": path,
                "vma_ms": 1e3 * statistics.median(times[True]),
                "sum_ms": 1e3 * statistics.median(times[False]),
                "ratio": statistics.median(ratios), "ratio_p10": q(0.1), "ratio_p90": q(0.9),
                "collectives_vma": counts[True], "collectives_sum": counts[False]})
    if rank0:
        hdr = (f"{'size':7} {'layout':6} {'path':16} {'vma ms':>8} {'sum ms':>8} {'vma/sum':>8} "
               f"{'p10-p90':>13} {'colls vma':>9} {'colls sum':>9}")
        print(f"sizes (hidden, ffn) {SIZES}, heads={HEADS} seq={SEQ} batch={BATCH}, "
              f"4 gloo ranks, {STEPS} steps per mode")
        print(hdr)
        for r in rows:
            print(f"{r['size']:7} {r['layout']:6} {r['path']:16} {r['vma_ms']:8.2f} {r['sum_ms']:8.2f} "
                  f"{r['ratio']:8.3f} {r['ratio_p10']:6.3f}-{r['ratio_p90']:<6.3f} "
                  f"{r['collectives_vma']:9d} {r['collectives_sum']:9d}")
        out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "vma_overhead.json"), "w") as f:
            json.dump({"config": dict(SIZES=SIZES, HEADS=HEADS, SEQ=SEQ, BATCH=BATCH,
                                      STEPS=STEPS, ranks=4, torch=torch.__version__),
                       "rows": rows}, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main_or_launch(main, 4, __file__)
