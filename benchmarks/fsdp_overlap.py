"""FSDP across two emulated hosts: functp's FSDP plan family against torch's
``fully_shard`` (FSDP2), and against the computation alone.

    python benchmarks/fsdp_overlap.py              # two hosts: netns_cluster.sh up, run, down (root)
    python benchmarks/fsdp_overlap.py --local      # 2 local gloo processes instead (no link limit)

The hosts, the model and the rounds are those of ``overlap.py`` (issue 25's 8 x
(Linear(1024, 1024) + ReLU), MSE loss, an SGD update, ``--batch`` rows per host; each
round runs every variant once after a barrier; medians of rank 0). Each parameter is
stored as its half over the ``fsdp`` axis of the two hosts:

- FSDP2: ``fully_shard`` on each Linear and on the root, ``reshard_after_forward=False``
  (the gathered weights kept for the backward, as functp keeps them) and ``=True``
  (freed after the forward, gathered again in the backward); tape autograd;
- functp: ``parallelize(model, mesh, {"fsdp": FullyShard(2, groups=["*"])})`` (each
  Linear a gather group, FSDP2's units here) in one shard_map'd loss
  (``pmean`` over ``fsdp``), through tape autograd, ``torch.func.grad`` and
  ``functp.value_and_grad``; "no prefetch": the plan's ``FullyShard`` with
  ``prefetch=False`` (each module gathers its weights in its own pre-hook); "no
  overlap": ``functp.set_overlap(enabled=False)`` (the reduce-scatters waited on where
  the backward issues them); "free_full_weight": ``FullyShard(2, free=True)`` (the
  gathered weights freed after the forward and gathered again in the tape backward,
  as ``reshard_after_forward=True``);
- compute: the unsharded step on the host's batch, with no communication.

Ratios are to FSDP2 with ``reshard_after_forward=False``; functp's collectives are
counted per step with ``comm_log``. Writes ``results/fsdp_overlap_b<batch>.json``.
(A separate script from ``overlap.py``, which measures data parallelism: the two
share the model, the hosts and the timing loop, not their variants.)
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from overlap import cli, functp_steps, make_model, measure, mse, tape_step  # noqa: E402


def _fsdp2(x, y, reshard: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model()
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return tape_step(model, x, y)


def _functp(x, y, prefetch: bool = True, free: bool = False):
    """functp's FSDP family: (tape step, torch.func.grad step, value_and_grad step)."""
    import functp
    from functp import P
    from functp import FullyShard
    n = dist.get_world_size()
    mesh = functp.make_mesh((n,), ("fsdp",))
    # the units FSDP2's wrapping above makes (each Linear): a Sequential has no
    # ModuleList of layers, so functp's default rule would make the model one group
    family = FullyShard(n, prefetch=prefetch, free=free, groups=["*"])
    apply, params, specs = functp.parallelize(make_model(), mesh, {"fsdp": family})
    loss = functp.shard_map(lambda p, x, y: functp.pmean(mse(apply(p, x), y), "fsdp"),
                            mesh, in_specs=(specs, P("fsdp"), P("fsdp")), out_specs=P())
    return functp_steps(loss, params, x, y)


def _no_overlap(step):
    import functp

    def run():
        prev = functp.set_overlap(enabled=False)
        try:
            step()
        finally:
            functp.set_overlap(**prev)
    return run


def variants(x, y) -> dict:
    """name -> (a step, functp's collectives per step or None)."""
    import functp
    out = {"compute alone": (tape_step(make_model(), x, y), 0),
           "FSDP2, reshard_after_forward=False": (_fsdp2(x, y, False), None),
           "FSDP2, reshard_after_forward=True": (_fsdp2(x, y, True), None)}
    tape, func_grad, vag = _functp(x, y, True)
    tape0, func_grad0, _ = _functp(x, y, prefetch=False)
    tape_free, _, vag_free = _functp(x, y, free=True)
    for name, step in (("functp tape", tape), ("functp torch.func.grad", func_grad),
                       ("functp.value_and_grad", vag),
                       ("functp tape, no prefetch", tape0),
                       ("functp torch.func.grad, no prefetch", func_grad0),
                       ("functp tape, free_full_weight", tape_free),
                       ("functp.value_and_grad, free_full_weight", vag_free),
                       ("functp tape, no overlap", _no_overlap(tape))):
        step()                       # the first call checks the modules' order
        with functp.comm_log() as log:
            step()
        out[name] = (step, len(log))
    for name, (step, _) in out.items():
        if name.startswith("FSDP2"):
            step()                   # (FSDP2's lazy init, outside the timed rounds)
    return out


def main() -> None:
    measure(variants, "FSDP2, reshard_after_forward=False", "vs_fsdp2", "fsdp_overlap")


if __name__ == "__main__":
    cli(main, __file__, 29532)
