"""Gradient all-reduces of k microbatches, with and without ``unreduced=``.

    python benchmarks/accumulation.py      # 4 local gloo processes; results/accumulation.json

The MLP of ``_models.py`` (small) on a 4-way DP mesh and on a 2 × 2 (dp, tp) mesh,
one step of 4 microbatches under ``torch.func.grad``: all-reduces over an axis set
containing ``dp`` and their bytes (comm_log; counts, not times), for one big batch,
for 4 microbatches each reducing its gradient, and for 4 microbatches with
``shard_map(..., unreduced="dp")`` and one ``reduce_unreduced``.
"""
from __future__ import annotations

import os
import sys

import optree
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import functp  # noqa: E402
from functp import P  # noqa: E402
import _models as M  # noqa: E402
from _run import main_or_launch, save_and_leave  # noqa: E402

K = 4


def layout(two_d: bool):
    hidden, ffn = M.SIZES["small"]
    params = M.init_params(hidden, ffn)
    x, y = (t.repeat(K, *[1] * (t.ndim - 1)) for t in M.init_data(hidden))   # K rows a rank
    if not two_d:
        return functp.make_mesh((4,), ("dp",)), params, {n: P() for n in params}, x, y, None
    specs = {n: {"fc1.weight": P("tp", None), "fc1.bias": P("tp"),
                 "fc2.weight": P(None, "tp")}.get(n.split(".", 2)[2], P()) for n in params}
    return (functp.make_mesh((2, 2), ("dp", "tp")), params, specs, x, y,
            lambda h: functp.psum(h, "tp"))


def over_dp(log) -> tuple[int, int]:
    """(count, bytes) of the all-reduces over dp that move more than the loss scalar."""
    ev = [e for e in log.events if "dp" in e.axes and e.nbytes > 8]
    return len(ev), sum(e.nbytes for e in ev)


def measure(two_d: bool) -> dict:
    mesh, params, specs, x, y, post = layout(two_d)
    local = functp.shard(params, mesh, specs)
    xl, yl = functp.shard(x, mesh, P("dp")), functp.shard(y, mesh, P("dp"))

    def loss(p, x, y):
        return functp.pmean(M.mse(M.forward(p, x, post=post or (lambda h: h)), y), "dp")

    plain = functp.shard_map(loss, mesh, in_specs=(specs, P("dp"), P("dp")), out_specs=P())
    acc = functp.shard_map(loss, mesh, in_specs=(specs, P("dp"), P("dp")), out_specs=P(),
                           unreduced="dp")
    out = {}
    with functp.comm_log() as log:
        torch.func.grad(plain)(local, xl, yl)
    out["one batch"] = over_dp(log)
    for name, step in ((f"{K} microbatches", plain), (f"{K} microbatches, unreduced", acc)):
        with functp.comm_log() as log:
            g = None
            for xb, yb in zip(xl.chunk(K), yl.chunk(K)):
                gi = torch.func.grad(step)(local, xb, yb)
                g = gi if g is None else optree.tree_map(torch.add, g, gi)
            if step is acc:
                functp.reduce_unreduced(g, mesh, specs, "dp")
        out[name] = over_dp(log)
    return out


def main() -> None:
    torch.set_num_threads(1)
    res = {"torch": torch.__version__, "microbatches": K,
           "DP (4)": measure(False), "2-D (dp=2, tp=2)": measure(True)}
    if dist.get_rank() == 0:
        print(f"gradient all-reduces over dp per step (MLP small, {K} microbatches)")
        for lay in ("DP (4)", "2-D (dp=2, tp=2)"):
            for k, (n, b) in res[lay].items():
                print(f"  {lay:18s} {k:30s} {n:4d} all-reduces {b:10d} bytes")
    save_and_leave("accumulation", res)


if __name__ == "__main__":
    main_or_launch(main, 4, __file__)
