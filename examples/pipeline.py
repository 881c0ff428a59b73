"""Pipeline parallelism with functp.pipeline: a stack of residual layers split into
stages over a 'pp' axis, its microbatches run by a schedule (1F1B by default).

    torchrun --standalone --nproc-per-node 2 examples/pipeline.py
    python examples/pipeline.py           # launches the 2 local processes itself
    python examples/pipeline.py --simulate  # or as 2 simulated ranks in one process
    python examples/pipeline.py --schedule zero_bubble   # gpipe, 1f1b, zero_bubble

The model's layer weights are stacked along a leading layer dimension; P('pp') on
that dimension gives each stage a contiguous run of layers, and ``run_layers`` is the
stage function: it runs whichever layers it is given. The batch is cut into
microbatches; ``functp.pipeline`` runs the schedule's table (printed first: F is a
microbatch's forward, B its backward, W zero-bubble's weight gradient), moving
activations to the next stage and gradients to the previous one, and returns the
batch's mean loss and this stage's gradients. Every SGD step prints the loss beside
the unsharded stack's and the collectives issued (``permute``: the tick transfers;
``all_gather``: the pipeline's agreements and the loss). docs/pipelines.md explains
the schedules; docs/howto.md's "Pipeline parallelism" shows the same GPipe written
by hand with ppermute, its backward derived by torch.func.grad.
"""
from __future__ import annotations

import math
import sys

import torch

import functp
from _example import finish, launch
from functp import P

NPROC = 2                                   # processes when launched directly
D, LAYERS, BATCH, MICRO, STEPS, LR = 8, 4, 8, 4, 4, 0.1


class Stack(torch.nn.Module):
    """Plain single-device model: LAYERS residual tanh layers."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(LAYERS, D, D) / math.sqrt(D))
        self.b = torch.nn.Parameter(torch.zeros(LAYERS, D))

    def forward(self, x):
        return run_layers(self.w, self.b, x)


def run_layers(w, b, x):
    """Applies the layers whose weights ``w``, ``b`` hold (all, or one stage's run)."""
    for i in range(w.shape[0]):
        x = x + torch.tanh(x @ w[i] + b[i])
    return x


# the layout: consecutive layers per stage. The batch is whole on every rank (only the
# first stage reads the inputs and only the last the targets)
SPECS = {"w": P("pp"), "b": P("pp")}


def mse(out, y):
    return ((out - y) ** 2).mean()


def gpipe_by_hand(p, microbatches, targets):
    """The same model's loss by a GPipe forward written by hand over 'pp' with ppermute
    (docs/howto.md's), its backward derived by torch.func.grad: what functp.pipeline
    replaces, kept because functp.estimate traces it (tests/test_estimate.py,
    benchmarks/estimate_time.py). ``microbatches``, ``targets``: (M, batch/M, D).
    Every stage runs the same ops at every tick; the stage index only picks values."""
    n, stage = functp.axis_size("pp"), functp.axis_index("pp")
    m = microbatches.shape[0]
    first, last = torch.tensor(stage == 0), torch.tensor(stage == n - 1)
    state, finished = torch.zeros_like(microbatches[0]), []
    for t in range(m + n - 1):
        state = torch.where(first, microbatches[min(t, m - 1)], state)
        state = run_layers(p["w"], p["b"], state)
        if t >= n - 1:
            finished.append(state)
        if t < m + n - 2:
            state = functp.ppermute(state, "pp", [(s, s + 1) for s in range(n - 1)])
    loss = mse(torch.stack(finished), targets)
    return functp.psum(torch.where(last, loss, 0.0), "pp")


SCHEDULE = (sys.argv[sys.argv.index("--schedule") + 1] if "--schedule" in sys.argv
            else "1f1b")


def main() -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    mesh = functp.make_mesh((functp.process_count(),), ("pp",))
    n = mesh.shape["pp"]
    rank0 = functp.process_index() == 0

    torch.manual_seed(0)                    # the same model and data on every rank
    apply, params = functp.functionalize(Stack())
    local = functp.shard(params, mesh, SPECS)
    step = functp.pipeline(lambda p, x: run_layers(p["w"], p["b"], x), mesh,
                           microbatches=MICRO, schedule=SCHEDULE, loss_fn=mse)
    if rank0:
        print(f"{n} stages x {LAYERS // n} layers, {MICRO} microbatches of {BATCH // MICRO}; "
              f"{SCHEDULE} schedule:\n{step.schedule.text()}")

    ref_step = torch.func.grad_and_value(lambda p, x, y: mse(apply(p, x), y))
    ref = dict(params)
    ok = True
    for i in range(STEPS):
        x, y = torch.randn(BATCH, D), torch.randn(BATCH, D)
        with functp.comm_log() as log:
            loss, grads = step(local, x, y)
        local = {k: v - LR * grads[k] for k, v in local.items()}     # SGD on each stage
        ref_grads, ref_loss = ref_step(ref, x, y)
        ref = {k: v - LR * ref_grads[k] for k, v in ref.items()}
        comms = log.summary()
        match = math.isclose(loss.item(), ref_loss.item(), rel_tol=1e-9, abs_tol=1e-12)
        ok &= match
        if rank0:
            print(f"step {i}: pipelined loss {loss.item():.12f}   unsharded {ref_loss.item():.12f}"
                  f"   {'match' if match else 'MISMATCH'}   collectives {comms}")
    final = functp.unshard(local, mesh, SPECS)
    return finish(final, ref, ok, "pipelined training", STEPS)


if __name__ == "__main__":
    launch(main, NPROC)
