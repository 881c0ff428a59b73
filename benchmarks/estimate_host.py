"""Host time in ``functp.estimate``: host-bound steps predicted and measured.

    PYTHONPATH=$PWD python3 benchmarks/estimate_host.py            # all three tables
    PYTHONPATH=$PWD python3 benchmarks/estimate_host.py --h200     # the H200 table only

1. **Counts.** The transformers Llama of ``gpu_step.py --configs host`` (8 layers,
   hidden 64, 8 tokens, float32) on this CPU: a warm real step's operator calls and
   Python calls (the counters ``functp.calibrate`` uses: a dispatch mode, and
   ``PyCalls``) against the estimate's, of a step after one warm-up call
   (``warmup=1``) and of a first step (``warmup=0``: first-call work included).
2. **This CPU.** Each variant's step run (median of 30 steps after 3 warm-ups) and
   predicted (``warmup=1``) with two profiles: ``functp.calibrate()`` (its default
   calibration steps) and ``functp.calibrate(host_steps=...)`` given the two *plain*
   steps of this model (functp's three steps are then predicted from their counts).
3. **The H200** (``tests/data/gpu_step_h200.json``: every eager row of the runs of
   2026-11-27, issue 39's included). Each configuration estimated here as the cuda
   bf16 program it is (``warmup=1``), on the ``h100-sxm`` profile with the H200's
   measured matmul and copy rates; its host costs are the profile's built-in ones.
   The script also prints the costs solved from the 187M model's two *plain* rows
   (their mean over the recorded runs): the built-ins are those numbers. Per row:
   measured and predicted ms, and the ratio to the plain tape step of the same run
   measured and predicted (GPU host timings vary between runs: the 187M plain tape
   step took 21.3 to 32.4 ms in four runs of the same code).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import statistics
import sys
import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import functp  # noqa: E402
import gpu_step  # noqa: E402
from functp.tools import _hardware  # noqa: E402
from functp.tools._host_count import PyCalls  # noqa: E402

warnings.simplefilter("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = gpu_step.CONFIGS["host-bound h64 L8 1x8"]
VARIANTS = ("plain tape", "plain func.grad", "functp tape", "functp value_and_grad",
            "functp func.grad")
H200_RUNS = os.path.join(HERE, "..", "tests", "data", "gpu_step_h200.json")
H200_RATES = os.path.join(HERE, "..", "tests", "data", "gpu_truth_h200.json")


def build(c=CONFIG, device="cpu", dtype=torch.float32):
    """``gpu_step.build`` without its ``.to()`` (which a module built inside an
    estimated program cannot take): built in ``dtype`` on ``device``."""
    import transformers
    cfg = transformers.LlamaConfig(
        vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["inter"],
        num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
        num_key_value_heads=c["kv"], max_position_embeddings=max(c["T"], 64),
        attn_implementation="sdpa", tie_word_embeddings=c["tie"])
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(cfg)
            ids = torch.randint(c["vocab"], (c["B"], c["T"]),
                                generator=torch.Generator().manual_seed(0)).to(device)
    finally:
        torch.set_default_dtype(old)
    return model, ids


def steps(model, ids):
    """All five steps on one model, as ``gpu_step.py`` makes them (so the plain steps
    run with functp's plan hooks on the modules, as on the GPU)."""
    return {**gpu_step.plain_steps(model, ids, 1), **gpu_step.functp_steps(model, ids, 1)}


def program(name: str, c=CONFIG, device="cpu", dtype=torch.float32):
    """The estimated program: builds the model and the batch, returns the step."""
    def setup():
        model, ids = build(c, device, dtype)
        return steps(model, ids)[name](lambda f: f)
    return setup


def predicted(name: str, hw, warmup: int = 1, **build_args) -> functp.Estimate:
    setup = program(name, **build_args)
    if warmup:
        return functp.estimate(setup, 1, hardware=hw, warmup=warmup)
    return functp.estimate(lambda: setup()(), 1, hardware=hw)


class _Ops(TorchDispatchMode):
    """Counts the operators dispatched (as calibrate's host counter does)."""
    calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.namespace != "prim"
        return func(*args, **(kwargs or {}))


def real_counts(name: str) -> tuple[int, int]:
    """(operator calls, Python calls) of a warm real step on this CPU."""
    step = program(name)()
    step()
    step()
    with _Ops() as ops:
        step()
    with PyCalls() as py:
        step()
    return ops.calls, py.total + py.builtin


def measured(name: str) -> float:
    step = program(name)()
    for _ in range(3):
        step()
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def counts_table() -> None:
    hw = _hardware.HARDWARE["h100-sxm"]
    print("Counts, host-bound Llama on this CPU: a warm real step against the estimate "
          "(warmup=1: after one call; warmup=0: a first step)")
    print(f"{'variant':24s} {'real ops':>9s} {'est ops':>8s} {'ratio':>6s} {'real Py':>8s} "
          f"{'warm Py':>8s} {'ratio':>6s} {'first Py':>8s} {'ratio':>6s}")
    for name in VARIANTS:
        o, p = real_counts(name)
        w, f = predicted(name, hw).seconds, predicted(name, hw, warmup=0).seconds
        print(f"{name:24s} {o:9d} {w.host_calls:8d} {w.host_calls / o:6.3f} {p:8d} "
              f"{w.python_calls:8d} {w.python_calls / p:6.3f} {f.python_calls:8d} "
              f"{f.python_calls / p:6.3f}", flush=True)


def cpu_table() -> None:
    default = functp.calibrate()
    own = functp.calibrate(host_steps=[program(n)() for n in VARIANTS[:2]])
    for hw, what in ((default, "functp.calibrate()"),
                     (own, "functp.calibrate(host_steps=[plain tape, plain func.grad])")):
        print(f"{what}: {hw.host_call * 1e6:.2f} us per operator call, "
              f"{hw.host_python * 1e6:.3f} us per Python call")
    print(f"{'variant':24s} {'measured':>9s} {'default':>8s} {'ratio':>6s} {'own':>8s} "
          f"{'ratio':>6s} {'op calls':>9s} {'Py calls':>9s} bound")
    for name in VARIANTS:
        t = measured(name)
        e, o = predicted(name, default), predicted(name, own)
        p, q = e.seconds.overlapped, o.seconds.overlapped
        print(f"{name:24s} {t * 1e3:9.2f} {p * 1e3:8.2f} {p / t:6.2f} {q * 1e3:8.2f} "
              f"{q / t:6.2f} {o.seconds.host_calls:9d} {o.seconds.python_calls:9d} "
              f"{o.seconds.bound}", flush=True)


def h200_profile() -> _hardware.Hardware:
    """h100-sxm with the H200's measured bf16 matmul and copy rates (the profile the
    GPU rows are predicted on; its host costs are the built-in ones)."""
    rates = json.load(open(H200_RATES))
    flops = rates["measured_bf16_matmul_tflops"] * 1e12
    copy = rates["measured_copy_bytes_per_s_read_plus_write"]
    return dataclasses.replace(_hardware.HARDWARE["h100-sxm"], name="H200 (measured rates)",
                               flops={"float32": flops / 2, "bfloat16": flops},
                               memory_bandwidth=copy / 2)


def solve(rows: dict, counts: dict) -> tuple[float, float]:
    """The per-operator and per-Python-call costs that give the 187M model's two plain
    rows (each the mean over the runs that measured it) from the estimate's counts."""
    (o1, p1), (o2, p2) = [(counts[n].host_calls, counts[n].python_calls) for n in VARIANTS[:2]]
    t1, t2 = [statistics.mean(rows[n]) * 1e-3 for n in VARIANTS[:2]]
    det = o1 * p2 - o2 * p1
    return (t1 * p2 - t2 * p1) / det, (o1 * t2 - o2 * t1) / det


def h200_table() -> None:
    data = json.load(open(H200_RUNS))
    hw = h200_profile()
    configs = list(dict.fromkeys(r["config"] for run in data["runs"] for r in run["rows"]))
    est = {}
    for c in configs:
        for n in VARIANTS:
            est[c, n] = predicted(n, hw, c=gpu_step.CONFIGS[c], device="cuda",
                                  dtype=torch.bfloat16).seconds
    plain = collections.defaultdict(list)
    for run in data["runs"]:
        for r in run["rows"]:
            if r["config"] == "h1024 L8 4x512" and r["variant"] in VARIANTS[:2]:
                plain[r["variant"]].append(r["ms"])
    per_op, per_py = solve(plain, {n: est["h1024 L8 4x512", n] for n in VARIANTS})
    print(f"\nH200 (tests/data/gpu_step_h200.json), estimated here as cuda bf16 programs, "
          f"warmup=1, on {hw.name}: host {hw.host_call * 1e6:.2f} us per operator call, "
          f"{hw.host_python * 1e6:.3f} us per Python call (solved now from the 187M plain "
          f"rows' means, {statistics.mean(plain['plain tape']):.2f} and "
          f"{statistics.mean(plain['plain func.grad']):.2f} ms: {per_op * 1e6:.2f} us, "
          f"{per_py * 1e6:.3f} us)")
    print(f"{'run':15s} {'config':21s} {'variant':22s} {'H200 ms':>8s} {'pred ms':>8s} "
          f"{'ratio':>6s} {'x plain':>7s} {'pred x':>7s} {'ratio':>6s} {'calls':>6s} "
          f"{'est Py':>6s} {'est ops':>7s} bound")
    for run in data["runs"]:
        base = {r["config"]: r["ms"] for r in run["rows"] if r["variant"] == "plain tape"}
        for r in run["rows"]:
            s = est[r["config"], r["variant"]]
            p, b = s.overlapped * 1e3, est[r["config"], "plain tape"].overlapped * 1e3
            x, px = r["ms"] / base[r["config"]], p / b
            print(f"{run['name']:15s} {r['config']:21s} {r['variant']:22s} {r['ms']:8.2f} "
                  f"{p:8.2f} {p / r['ms']:6.2f} {x:7.2f} {px:7.2f} {px / x:6.2f} "
                  f"{r['calls'] or '-':>6} {s.python_calls:6d} {s.host_calls:7d} {s.bound}",
                  flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if "--h200" not in sys.argv[1:]:
        counts_table()
        cpu_table()
    h200_table()
