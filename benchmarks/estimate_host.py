"""Host time in ``functp.estimate``: a host-bound step on this CPU, predicted and measured.

    PYTHONPATH=$PWD python3 benchmarks/estimate_host.py

The transformers Llama of ``gpu_step.py --configs host`` (8 layers, hidden 64, 8 tokens,
float32): each variant's step is estimated (``hardware=functp.calibrate()``: this
machine's per-operator-call cost) and run (median of 20 steps after 3 warm-ups).
Prints predicted ms, measured ms, their ratio, the operator calls the estimate counted
and the bound it names.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import functp  # noqa: E402
import gpu_step  # noqa: E402

warnings.simplefilter("ignore")
CONFIG = gpu_step.CONFIGS["host-bound h64 L8 1x8"]


def build():
    """``gpu_step.build`` in float32 on the CPU, without its ``.to()`` (which a module
    built inside an estimated program cannot take)."""
    import transformers
    c = CONFIG
    cfg = transformers.LlamaConfig(
        vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["inter"],
        num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
        num_key_value_heads=c["kv"], max_position_embeddings=64,
        attn_implementation="sdpa", tie_word_embeddings=c["tie"])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(c["vocab"], (c["B"], c["T"]), generator=torch.Generator().manual_seed(0))
    return model, ids


def steps(model, ids):
    return {**gpu_step.plain_steps(model, ids, 1), **gpu_step.functp_steps(model, ids, 1)}


def measured(name: str) -> float:
    model, ids = build()
    step = steps(model, ids)[name](lambda f: f)
    for _ in range(3):
        step()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def predicted(name: str, hw) -> functp.Estimate:
    def program():
        model, ids = build()
        return steps(model, ids)[name](lambda f: f)()
    return functp.estimate(program, 1, hardware=hw)


def main() -> None:
    hw = functp.calibrate()
    print(f"per operator call on this host: {hw.host_call * 1e6:.2f} us ({hw.sources['host_call']})")
    print(f"{'variant':24s} {'predicted ms':>12s} {'measured ms':>12s} {'ratio':>6s} "
          f"{'op calls':>9s} bound")
    for name in ("plain tape", "plain func.grad", "functp tape", "functp value_and_grad",
                 "functp func.grad"):
        e = predicted(name, hw)
        t = measured(name)
        p = e.seconds.overlapped
        print(f"{name:24s} {p * 1e3:12.2f} {t * 1e3:12.2f} {p / t:6.2f} "
              f"{e.seconds.host_calls:9d} {e.seconds.bound}")


if __name__ == "__main__":
    main()
