"""Data parallelism with torch.func.grad: the batch split over 'dp', the parameters
replicated, and no DDP wrapper.

    torchrun --standalone --nproc-per-node 2 examples/data_parallel.py
    python examples/data_parallel.py      # launches the 2 local processes itself
    python examples/data_parallel.py --simulate  # or as 2 simulated ranks in one process

The loss is the single-device loss of each rank's slice of the batch, averaged over
'dp' with pmean. Nothing else is written: the parameters are replicated (P()), and
when a replicated value meets the dp-split batch functp inserts an implicit pvary,
whose backward is a psum over 'dp'. So torch.func.grad returns, on every rank, the
gradient of the whole-batch loss: the gradient all-reduce of DDP falls out of the
vma rules, bucketed into one all-reduce per step. Every SGD step prints the loss next
to the loss of the unsharded model trained on one process, and the collectives the
step issued.
"""
from __future__ import annotations

import math

import torch

import functp
from _example import launch, shutdown
from functp import P

NPROC = 2                                   # processes when launched directly
D, HIDDEN, BATCH, STEPS, LR = 8, 32, 16, 5, 0.1


class MLP(torch.nn.Module):
    """Plain single-device model code: nothing here knows about the mesh."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = (torch.nn.Linear(D, HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN),
                                        torch.nn.Linear(HIDDEN, D))

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


# the layout: every parameter replicated, the batch split over 'dp'
PARAM_SPECS = P()                           # one spec for the whole parameter dict
BATCH_SPEC = P("dp")


def main() -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    mesh = functp.make_mesh((functp.process_count(),), ("dp",))
    rank0 = functp.process_index() == 0

    torch.manual_seed(0)                    # the same model and data on every rank
    apply, params = functp.functionalize(MLP())

    def loss_fn(p, x, y):                   # the single-device loss
        return ((apply(p, x) - y) ** 2).mean()

    def local_loss(p, x, y):
        # this rank's slice of the batch; pmean makes it the whole-batch mean (the
        # slices are equal-sized). Its backward divides the cotangent by the dp size,
        # and the implicit pvary of p sums the per-rank gradients: together, DDP's
        # averaged gradient.
        return functp.pmean(loss_fn(p, x, y), "dp")

    step = torch.func.grad_and_value(
        functp.shard_map(local_loss, mesh, in_specs=(PARAM_SPECS, BATCH_SPEC, BATCH_SPEC),
                         out_specs=P()))
    ref_step = torch.func.grad_and_value(loss_fn)

    local = functp.shard(params, mesh, PARAM_SPECS)     # replicated: the full tensors
    ref = dict(params)
    ok = True
    for i in range(STEPS):
        x, y = torch.randn(BATCH, D), torch.randn(BATCH, D)
        with functp.comm_log() as log:
            grads, loss = step(local, *functp.shard((x, y), mesh, BATCH_SPEC))
        local = {k: v - LR * grads[k] for k, v in local.items()}     # plain SGD
        ref_grads, ref_loss = ref_step(ref, x, y)
        ref = {k: v - LR * ref_grads[k] for k, v in ref.items()}
        # one all-reduce forward (the pmean of the loss), one backward (all the
        # parameter gradients in a single bucket)
        comms = log.summary()
        match = (math.isclose(loss.item(), ref_loss.item(), rel_tol=1e-9, abs_tol=1e-12)
                 and comms == {("all_reduce", ("dp",)): 2})
        ok &= match
        if rank0:
            print(f"step {i}: sharded loss {loss.item():.12f}   unsharded {ref_loss.item():.12f}"
                  f"   {'match' if match else 'MISMATCH'}   collectives {comms}")
    # the parameters are replicated, so every rank's copy is the whole model
    err = max((local[k] - ref[k]).abs().max().item() for k in ref)
    ok &= err < 1e-9
    if rank0:
        print(f"max |param difference| after {STEPS} steps: {err:.2e}")
        print("data-parallel training matches the unsharded model" if ok else "MISMATCH")
    return shutdown(ok)


if __name__ == "__main__":
    launch(main, NPROC)
