"""What the always-on size check of a user-called ``ragged_all_to_all`` costs (issue 41,
item 5), against the same exchange without it, in the same run.

    python benchmarks/ragged_sizes.py          # launches 2 local gloo processes

A body makes one ``ragged_offsets`` plan and runs ``K`` exchanges forward with it:

- ``plan's lists``: the plan's own lists, unchanged: not checked (what every
  exchange with lists and ``recv_offsets`` did before the check);
- ``own lists (checked)``: the same values as the caller's own lists: one all-gather
  of every rank's sizes and one host read per exchange;
- ``planned_ragged_all_to_all``: functp's own dispatch's entry (ExpertDispatch's
  sizes): not checked.

Per variant: collectives and Python calls (cProfile) per exchange, and the median
time per exchange (rounds interleaved), for a small (host-bound) and a larger
exchange. Rank 0 prints and writes benchmarks/results/ragged_sizes.json.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import functp  # noqa: E402
from functp import P  # noqa: E402
from functp.ops._ragged import planned_ragged_all_to_all  # noqa: E402
from _run import main_or_launch, save_and_leave  # noqa: E402
from calls import count  # noqa: E402  (Python calls per call, as calls.py counts them)

K = 8            # exchanges per body
ROUNDS = 15
VARIANTS = ("plan's lists", "own lists (checked)", "planned_ragged_all_to_all")


def _step(mesh, variant: str, rows: int, hidden: int):
    n = mesh.shape["ep"]

    def body(x):
        plan = functp.ragged_offsets([rows] * n, "ep")
        send, recv = plan.send_sizes, plan.recv_sizes
        fn = functp.ragged_all_to_all
        if variant == "own lists (checked)":
            send, recv = list(send), list(recv)
        elif variant == "planned_ragged_all_to_all":
            fn = planned_ragged_all_to_all
        out = x.new_zeros(plan.recv_total, hidden)
        for _ in range(K):
            out = fn(x, out, plan.input_offsets, send, plan.output_offsets, recv, "ep",
                     recv_offsets=plan.recv_offsets)
        return out

    f = functp.shard_map(body, mesh, in_specs=P("ep"), out_specs=P("ep"))
    x = torch.randn(rows * n, hidden)
    return lambda: f(x)


def measure(mesh, rows: int, hidden: int) -> dict:
    steps = {v: _step(mesh, v, rows, hidden) for v in VARIANTS}
    res = {}
    for v, fn in steps.items():
        with functp.comm_log() as log:
            fn()
        res[v] = {"collectives_per_body": log.count(), "calls_per_body": count(fn, 5)}
    times = {v: [] for v in VARIANTS}
    for _ in range(ROUNDS):
        for v, fn in steps.items():
            dist.barrier()
            t = time.perf_counter()
            fn()
            times[v].append((time.perf_counter() - t) * 1e3)
    base = statistics.median(times[VARIANTS[0]])
    for v in VARIANTS:
        med = statistics.median(times[v])
        r = res[v]
        r["ms_per_body"] = med
        r["ratio_to_plans_lists"] = med / base
        r["extra_ms_per_exchange"] = (med - base) / K
        r["extra_calls_per_exchange"] = (r["calls_per_body"]
                                         - res[VARIANTS[0]]["calls_per_body"]) / K
    return res


def main() -> None:
    torch.set_num_threads(1)
    functp.set_debug(False)
    mesh = functp.make_mesh((dist.get_world_size() if dist.is_initialized() else 2,), ("ep",))
    res = {"torch": torch.__version__, "ranks": mesh.size, "exchanges_per_body": K,
           "small (8 rows x 8 per peer)": measure(mesh, 8, 8),
           "larger (512 rows x 256 per peer)": measure(mesh, 512, 256)}
    if dist.get_rank() == 0:
        print(f"ragged_all_to_all size check, {mesh.size} gloo ranks, {K} exchanges a body, "
              f"median of {ROUNDS} interleaved rounds")
        for size in [k for k in res if "per peer" in k]:
            print(size)
            for v, r in res[size].items():
                print(f"  {v:28s} {r['ms_per_body']:8.3f} ms ({r['ratio_to_plans_lists']:.2f}x)"
                      f"  +{r['extra_ms_per_exchange']:.3f} ms/exchange"
                      f"  collectives/body {r['collectives_per_body']}"
                      f"  calls/body {r['calls_per_body']:.0f}"
                      f" (+{r['extra_calls_per_exchange']:.0f}/exchange)")
    save_and_leave("ragged_sizes", res)


if __name__ == "__main__":
    main_or_launch(main, 2, __file__)
