"""Pipeline parallelism: a GPipe schedule over a 'pp' axis, activations passed from
stage to stage with ppermute, the backward pipeline derived by torch.func.grad.

    torchrun --standalone --nproc-per-node 2 examples/pipeline.py
    python examples/pipeline.py           # launches the 2 local processes itself
    python examples/pipeline.py --simulate  # or as 2 simulated ranks in one process

The model is a stack of identical residual layers whose weights are stacked along a
leading layer dimension; P('pp') on that dimension gives each stage a contiguous
run of layers. The batch is cut into microbatches. At every tick each stage runs
its layers on the activation it holds, then ppermute shifts all activations one
stage to the right; stage 0 takes in the next microbatch and the last stage's
result is a finished microbatch. With M microbatches and S stages a forward takes
M + S - 1 ticks, S - 1 of them partly idle (the "bubble").

The whole schedule is one shard_map'd function, and its gradient is taken with
torch.func.grad like any other: the transpose of ppermute is the inverse shift, so
autograd runs the backward pipeline (gradients flowing from the last stage back to
the first, tick by tick in reverse) without a hand-written backward schedule. Every
SGD step prints the loss beside the unsharded stack's and the collectives issued.
"""
from __future__ import annotations

import math

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


# the layout: consecutive layers per stage; the data replicated (only the first stage
# reads the inputs and only the last the targets -- a real run would load them there)
SPECS = {"w": P("pp"), "b": P("pp")}
DATA_SPEC = P()


def mse(out, y):
    return ((out - y) ** 2).mean()


def gpipe_loss(p, microbatches, targets):
    """The loss of the whole batch, computed by a GPipe forward over the stages.
    ``microbatches``, ``targets``: (M, batch/M, D)."""
    n, stage = functp.axis_size("pp"), functp.axis_index("pp")
    m = microbatches.shape[0]
    to_next = [(s, s + 1) for s in range(n - 1)]    # the last stage sends nowhere
    # Every stage runs the same ops at every tick; the stage index only picks values
    # (torch.where). Skipping work with an `if` on the stage would make ranks differ
    # in which collectives' results they use, and autograd would then skip some
    # ranks' backward ppermutes while others wait in theirs.
    first, last = torch.tensor(stage == 0), torch.tensor(stage == n - 1)
    state = torch.zeros_like(microbatches[0])       # the activation this stage holds
    finished = []
    for t in range(m + n - 1):
        # stage 0 takes microbatch t (after the last one, a stale copy whose result
        # never reaches the end); the others keep what their left neighbour sent
        state = torch.where(first, microbatches[min(t, m - 1)], state)
        state = run_layers(p["w"], p["b"], state)   # all stages at once
        if t >= n - 1:
            finished.append(state)                  # on the last stage: microbatch t-n+1
        if t < m + n - 2:
            state = functp.ppermute(state, "pp", to_next)
    # only the last stage's value is the loss; psum makes it every stage's (and its
    # backward hands the cotangent to every stage, where() zeroes it but on the last)
    loss = mse(torch.stack(finished), targets)
    return functp.psum(torch.where(last, loss, 0.0), "pp")


def schedule(n, m):
    """The tick-by-tick table the loop above follows (for printing)."""
    rows = []
    for s in range(n):
        cells = [f"m{t - s}" if 0 <= t - s < m else " ." for t in range(m + n - 1)]
        rows.append(f"    stage {s}: " + " ".join(cells))
    return "\n".join(rows)


def main() -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    mesh = functp.make_mesh((functp.process_count(),), ("pp",))
    n = mesh.shape["pp"]
    rank0 = functp.process_index() == 0

    torch.manual_seed(0)                    # the same model and data on every rank
    apply, params = functp.functionalize(Stack())
    local = functp.shard(params, mesh, SPECS)
    if rank0:
        print(f"{n} stages x {LAYERS // n} layers, {MICRO} microbatches of {BATCH // MICRO}; "
              f"forward schedule:\n{schedule(n, MICRO)}")

    step = torch.func.grad_and_value(
        functp.shard_map(gpipe_loss, mesh, in_specs=(SPECS, DATA_SPEC, DATA_SPEC),
                         out_specs=P()))
    ref_step = torch.func.grad_and_value(lambda p, x, y: mse(apply(p, x), y))
    ref = dict(params)
    # M + S - 2 shifts forward, as many backward; the psum of the loss
    expected = {("all_reduce", ("pp",)): 1}
    if n > 1:
        expected[("permute", ("pp",))] = 2 * (MICRO + n - 2)
    ok = True
    for i in range(STEPS):
        x, y = torch.randn(BATCH, D), torch.randn(BATCH, D)
        with functp.comm_log() as log:
            grads, loss = step(local, x.view(MICRO, -1, D), y.view(MICRO, -1, D))
        local = {k: v - LR * grads[k] for k, v in local.items()}     # SGD on each stage
        ref_grads, ref_loss = ref_step(ref, x, y)
        ref = {k: v - LR * ref_grads[k] for k, v in ref.items()}
        comms = log.summary()
        match = (math.isclose(loss.item(), ref_loss.item(), rel_tol=1e-9, abs_tol=1e-12)
                 and comms == expected)
        ok &= match
        if rank0:
            print(f"step {i}: pipelined loss {loss.item():.12f}   unsharded {ref_loss.item():.12f}"
                  f"   {'match' if match else 'MISMATCH'}   collectives {comms}")
    final = functp.unshard(local, mesh, SPECS)
    return finish(final, ref, ok, "pipelined training", STEPS)


if __name__ == "__main__":
    launch(main, NPROC)
