"""Expert-parallel MoE layer step: the ragged dispatch (``functp.ExpertDispatch()``,
exact traffic) against the padded one (``dispatch="padded"``, every block the worst
case) and the ragged one with a capacity factor of 1.0, on gloo processes.

    python benchmarks/moe.py                 # 4 local gloo processes (ep=4)
    python benchmarks/moe.py --steps 20

Per variant, on rank 0: bytes this rank sends per step by collective (``comm_log``,
forward and backward of ``torch.func.grad``), the collective counts, the median
step time, and the ratios padded / ragged. Writes results/moe.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _run import main_or_launch, save_and_leave  # noqa: E402

import functp  # noqa: E402
from functp import P  # noqa: E402
from functp.models.llama import LlamaConfig, LlamaMoE  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 128, 256, 8, 2, 512     # TOKENS per rank


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = LlamaMoE(LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER,
                                        num_experts=EXPERTS, num_experts_per_tok=TOP_K))

    def forward(self, x):
        return x + self.moe(x)


VARIANTS = {"ragged": dict(), "padded": dict(dispatch="padded"),
            "ragged_cf1.0": dict(capacity_factor=1.0)}


def _measure(name: str, mesh, steps: int) -> dict:
    torch.manual_seed(0)
    dispatch = functp.ExpertDispatch(**VARIANTS[name])
    plan = {"moe.router": "replicated", "moe.experts": dispatch}
    apply, params, specs = functp.parallelize(Layer(), mesh, plan, axis="ep")
    n = mesh.shape["ep"]
    x = torch.randn(n * TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    xl = functp.shard(x, mesh, P("ep"))
    step = functp.shard_map(lambda p, xb: functp.pmean((apply(p, xb) ** 2).mean(), "ep"),
                            mesh, in_specs=(specs, P("ep")), out_specs=P())
    grad = torch.func.grad(step)
    with functp.comm_log() as log:
        grad(params, xl)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        grad(params, xl)
        times.append(time.perf_counter() - t0)
    ops = sorted({e.op for e in log.events})
    return {"bytes": {op: log.nbytes(op) for op in ops},
            "bytes_total": log.nbytes(),
            "collectives": {op: log.count(op) for op in ops},
            "step_ms_median": 1e3 * statistics.median(times),
            "dropped_pairs_rank0": dispatch.dropped.get("moe.experts", 0),
            "routed_pairs_rank0": TOKENS * TOP_K}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    mesh = functp.make_mesh((functp.process_count(),), ("ep",))
    res = {"config": dict(hidden=HIDDEN, intermediate=INTER, experts=EXPERTS, top_k=TOP_K,
                          tokens_per_rank=TOKENS, ranks=mesh.shape["ep"], steps=args.steps,
                          dtype="float32", torch=torch.__version__)}
    for name in VARIANTS:
        res[name] = _measure(name, mesh, args.steps)
    res["padded_over_ragged"] = {
        "bytes": res["padded"]["bytes_total"] / res["ragged"]["bytes_total"],
        "step_time": res["padded"]["step_ms_median"] / res["ragged"]["step_ms_median"]}
    if functp.process_index() == 0:
        for name in VARIANTS:
            r = res[name]
            print(f"{name:14s} bytes {r['bytes_total']:>10,}  {r['collectives']}  "
                  f"median {r['step_ms_median']:.1f} ms  dropped {r['dropped_pairs_rank0']}")
        print("padded / ragged:", res["padded_over_ragged"])
    save_and_leave("moe", res)


if __name__ == "__main__":
    main_or_launch(main, 4, __file__, *sys.argv[1:])
