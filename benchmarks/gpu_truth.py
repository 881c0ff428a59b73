"""Ground truth for ``functp.estimate`` on a GPU: the CUDA allocator's peaks and the
step time of the gpu-truth programs (tests/data/gpu_truth_programs.py, plain PyTorch) and
of functp's steps of the same models (tests/data/gpu_truth_functp_programs.py).

    python benchmarks/gpu_truth.py                       # on a CUDA machine; world size 1
    python benchmarks/gpu_truth.py --rows mid --steps "plain tape,functp tape"

Each (row, step) is measured as the shared gpu-truth rows were: ``base =
memory_allocated()``; build the model, the batch and the step; one warm-up step; 5 timed
steps (median ms, synchronized; the host's enqueue time beside it); ``peak_total =
max_memory_allocated() - base``; ``resident = memory_allocated() - base`` after the
steps; then the peak of one more step above ``resident``. Everything is freed before the
next. Rank 0 prints and writes benchmarks/results/gpu_truth.json in the rows' format of
tests/data/gpu_truth_h200.json.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _run import main_or_launch, save_and_leave  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data")
STEPS = ("plain tape", "functp tape", "functp value_and_grad", "functp func.grad")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(DATA, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rows() -> list[dict]:
    import json
    truth = json.load(open(os.path.join(DATA, "gpu_truth_h200.json")))["rows"]
    extra = dict(name="h2048 L4 tied 2x2048 sdpa", config=dict(
        hidden=2048, inter=8192, heads=16, kv=8, vocab=32000, layers=4, B=2, T=2048,
        attn="sdpa", tie=True))
    return [dict(name=r["name"], config=r["config"]) for r in truth] + [extra]


def measure(row: dict, step: str, reps: int) -> dict:
    plain, fp = _load("gpu_truth_programs"), _load("gpu_truth_functp_programs")
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run = (plain.program(row["config"], "cuda") if step == "plain tape"
           else fp.program(row["config"], "cuda", step))
    run()
    torch.cuda.synchronize()
    total, host = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = run()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        total.append(time.perf_counter() - t0)
        host.append(t1 - t0)
        del out
    peak_total = torch.cuda.max_memory_allocated() - base
    resident = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    out = run()
    torch.cuda.synchronize()
    step_peak = torch.cuda.max_memory_allocated() - base - resident
    del out, run
    return dict(name=row["name"], config=row["config"], step=step,
                peak_total_bytes=peak_total, resident_bytes=resident,
                step_peak_above_resident_bytes=step_peak,
                median_step_ms=round(statistics.median(total) * 1e3, 2),
                median_host_ms=round(statistics.median(host) * 1e3, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=None, help="comma-separated name prefixes")
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    import functp
    functp.make_mesh((1, 1), ("dp", "tp"), device_type="cuda")     # joins the group
    chosen = [r for r in rows() if not args.rows
              or any(r["name"].startswith(s.strip()) for s in args.rows.split(","))]
    out = []
    print(f"gpu_truth: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    print(f"{'row':28s} {'step':22s} {'ms':>8s} {'host ms':>8s} {'peak GiB':>9s} "
          f"{'resident':>9s} {'step peak':>9s}", flush=True)
    for row in chosen:
        for step in args.steps.split(","):
            try:
                r = measure(row, step.strip(), args.reps)
            except Exception as e:          # one failing variant must not lose the rest
                r = dict(name=row["name"], config=row["config"], step=step,
                         error=f"{type(e).__name__}: {str(e)[:400]}")
                print(f"{row['name']:28s} {step:22s} FAILED {r['error']}", flush=True)
                out.append(r)
                continue
            out.append(r)
            g = 2 ** 30
            print(f"{r['name']:28s} {r['step']:22s} {r['median_step_ms']:8.2f} "
                  f"{r['median_host_ms']:8.2f} {r['peak_total_bytes'] / g:9.3f} "
                  f"{r['resident_bytes'] / g:9.3f} "
                  f"{r['step_peak_above_resident_bytes'] / g:9.3f}", flush=True)
    import transformers
    save_and_leave("gpu_truth", {
        "machine": f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
                   f"transformers {transformers.__version__}",
        "rows": out})


if __name__ == "__main__":
    main_or_launch(main, 1, __file__, *sys.argv[1:])
