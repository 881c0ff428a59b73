"""Host time in ``functp.estimate``: host-bound steps predicted and measured.

    PYTHONPATH=$PWD python3 benchmarks/estimate_host.py

1. **This CPU.** The transformers Llama of ``gpu_step.py --configs host`` (8 layers,
   hidden 64, 8 tokens, float32): each variant's step is estimated and run (median of
   30 steps after 3 warm-ups). Two profiles: ``functp.calibrate()`` (the host's costs
   fitted to a tiny decoder's steps) and ``functp.calibrate(host_steps=...)`` given
   the two *plain* steps of this model (functp's three steps are then predicted from
   their counts alone). Prints predicted ms, measured ms, their ratio, the operator
   and Python calls the estimate counted, and the bound it names.
2. **The H200 of issue 39.** The 187M Llama (hidden 1024, 8 layers, 4 x 512, bf16,
   cuda), estimated here on the CPU: its operator and Python calls per variant, the
   GPU profile's two host costs solved from the two plain rows measured on the H200
   (26.22 ms tape, 1.48 x 26.22 ms func.grad), and functp's three steps predicted
   against the H200's (1.71x, 2.22x, 3.43x the plain tape step).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import functp  # noqa: E402
import gpu_step  # noqa: E402
from functp.tools import _hardware  # noqa: E402

warnings.simplefilter("ignore")
CONFIG = gpu_step.CONFIGS["host-bound h64 L8 1x8"]
VARIANTS = ("plain tape", "plain func.grad", "functp tape", "functp value_and_grad",
            "functp func.grad")
# the H200 rows of issue 39 (ms): plain tape, and each variant's ratio to it
H200_TAPE = 26.22
H200 = {"plain tape": 1.0, "plain func.grad": 1.48, "functp tape": 1.71,
        "functp value_and_grad": 2.22, "functp func.grad": 3.43}


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
    return {**gpu_step.plain_steps(model, ids, 1), **gpu_step.functp_steps(model, ids, 1)}


def measured(name: str) -> float:
    model, ids = build()
    step = steps(model, ids)[name](lambda f: f)
    for _ in range(3):
        step()
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def predicted(name: str, hw, **build_args) -> functp.Estimate:
    def program():
        model, ids = build(**build_args)
        return steps(model, ids)[name](lambda f: f)()
    return functp.estimate(program, 1, hardware=hw)


def plain_steps():
    model, ids = build()
    s = steps(model, ids)
    return [s["plain tape"](lambda f: f), s["plain func.grad"](lambda f: f)]


def cpu_table() -> None:
    default = functp.calibrate()
    own = functp.calibrate(host_steps=plain_steps())
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
              f"{o.seconds.bound}")


def h200_table() -> None:
    c = gpu_step.CONFIGS["h1024 L8 4x512"]
    # the H200's measured rates (tests/data/gpu_truth_h200.json), the h100-sxm
    # profile's links and host costs
    hw = dataclasses.replace(_hardware.HARDWARE["h100-sxm"], name="H200 (measured rates)",
                             flops={"float32": 762.4e12 / 2, "bfloat16": 762.4e12},
                             memory_bandwidth=4.126e12 / 2)
    counts = {n: predicted(n, hw, c=c, device="cuda", dtype=torch.bfloat16).seconds
              for n in VARIANTS}
    (o1, p1), (o2, p2) = [(counts[n].host_calls, counts[n].python_calls)
                          for n in ("plain tape", "plain func.grad")]
    t1, t2 = H200_TAPE * 1e-3, H200_TAPE * H200["plain func.grad"] * 1e-3
    det = o1 * p2 - o2 * p1
    per_op, per_py = (t1 * p2 - t2 * p1) / det, (o1 * t2 - o2 * t1) / det
    print(f"\nH200, 187M Llama (bf16, cuda fakes): host costs solved from the two plain "
          f"rows: {per_op * 1e6:.2f} us per operator call, {per_py * 1e6:.3f} us per "
          f"Python call (built-in: {hw.host_call * 1e6:.2f}, "
          f"{hw.host_python * 1e6:.3f})")
    print(f"{'variant':24s} {'H200 ms':>8s} {'predicted':>9s} {'ratio':>6s} {'op calls':>9s} "
          f"{'Py calls':>9s} {'device ms':>9s} bound")
    for n in VARIANTS:
        s, t = counts[n], H200_TAPE * H200[n]
        print(f"{n:24s} {t:8.2f} {s.overlapped * 1e3:9.2f} {s.overlapped * 1e3 / t:6.2f} "
              f"{s.host_calls:9d} {s.python_calls:9d} "
              f"{max(s.compute, s.communication) * 1e3:9.2f} {s.bound}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    if "--h200" not in sys.argv[1:]:
        cpu_table()
    h200_table()
