"""Fully sharded data parallelism (FSDP / ZeRO-3): parameters, gradients and the batch
all split over 'dp'; each layer's weights gathered just before the layer runs.

    torchrun --standalone --nproc-per-node 2 examples/fsdp.py
    python examples/fsdp.py               # launches the 2 local processes itself
    python examples/fsdp.py --simulate    # or as 2 simulated ranks in one process

Every parameter is stored as its block along dim 0 (P('dp')), so each rank keeps
1/dp of the model. Inside the shard_map body a layer's blocks are all_gather'ed
(tiled) into the whole weights right before the layer runs. The transpose of
all_gather is psum_scatter: the backward of each gather is a reduce-scatter that
sums the per-rank weight gradients over 'dp' and leaves each rank the gradient of
its own block. No gradient all-reduce and no wrapper: it is the same data-parallel
program as examples/data_parallel.py with the gathers written out.

Two ways to run the step are shown and compared:
- torch.func.grad of one shard_map'd loss: autograd keeps the gathered weights for
  the backward (one all-gather per parameter per step);
- tape autograd with torch.utils.checkpoint around each layer: the gathered weights
  are freed after the forward and gathered again in the backward, as FSDP does
  (reshard_after_forward): twice the all-gathers, 1/dp of the weight memory.
Every step prints the loss beside the unsharded model's, the collectives each
variant issued, and whether everything matches.
"""
from __future__ import annotations

import functools
import math

import torch
from torch.func import functional_call

import functp
from _example import finish, launch
from functp import P

NPROC = 2                                   # processes when launched directly
D, HIDDEN, BATCH, STEPS, LR = 8, 32, 16, 4, 0.1


def make_model() -> torch.nn.Sequential:
    """Plain single-device model code."""
    return torch.nn.Sequential(torch.nn.Linear(D, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, D))


# the layout: every parameter split along its first dimension over 'dp' (weights by
# output rows, biases by entries), the batch split over 'dp' too
PARAM_SPECS = P("dp")
BATCH_SPEC = P("dp")


def mse(out, y):
    return ((out - y) ** 2).mean()


def run_layers(model, p, x, unit):
    """The model's forward, layer by layer. Each layer that has parameters is an FSDP
    unit: ``unit(layer, its parameter blocks, x)`` runs it."""
    for name, layer in model.named_children():
        own = {k.split(".", 1)[1]: v for k, v in p.items() if k.startswith(name + ".")}
        x = unit(layer, own, x) if own else layer(x)
    return x


def gathered_call(layer, blocks, x):
    """Gathers the layer's whole weights from every rank's block and runs it. The
    gathered weights vary over 'dp' (each rank has its own copy, with its own
    gradient contribution), so the backward of the gather is a psum_scatter."""
    full = {k: functp.all_gather(v, "dp", tiled=True) for k, v in blocks.items()}
    return functional_call(layer, full, (x,))


def main() -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    mesh = functp.make_mesh((functp.process_count(),), ("dp",))
    rank0 = functp.process_index() == 0

    torch.manual_seed(0)                    # the same model and data on every rank
    model = make_model()
    apply, params = functp.functionalize(model)
    local = functp.shard(params, mesh, PARAM_SPECS)        # this rank's blocks only
    if rank0:
        for k in ("0.weight", "0.bias"):
            print(f"{k:9s} full {tuple(params[k].shape)} -> local {tuple(local[k].shape)}")

    # (a) one shard_map over the whole step, differentiated with torch.func.grad
    def local_loss(p, x, y):
        return functp.pmean(mse(run_layers(model, p, x, gathered_call), y), "dp")

    func_step = torch.func.grad_and_value(
        functp.shard_map(local_loss, mesh, in_specs=(PARAM_SPECS, BATCH_SPEC, BATCH_SPEC),
                         out_specs=P()))

    # (b) tape autograd, each unit its own shard_map under torch.utils.checkpoint, so
    # the backward recomputes the unit, all_gather included. The checkpointed function
    # must be the whole shard_map'd unit: a checkpoint *inside* a shard_map body would
    # recompute collectives after the body has returned, which functp refuses, and
    # torch.func.grad refuses checkpoint (saved-tensor hooks) altogether.
    def remat_unit(layer, blocks, x):
        mapped = functp.shard_map(functools.partial(gathered_call, layer), mesh,
                                  in_specs=(PARAM_SPECS, BATCH_SPEC), out_specs=BATCH_SPEC)
        return torch.utils.checkpoint.checkpoint(mapped, blocks, x, use_reentrant=False)

    loss_of_out = functp.shard_map(lambda out, y: functp.pmean(mse(out, y), "dp"), mesh,
                                   in_specs=(BATCH_SPEC, BATCH_SPEC), out_specs=P())

    def remat_step(p, x, y):
        p = {k: v.detach().requires_grad_() for k, v in p.items()}
        loss = loss_of_out(run_layers(model, p, x, remat_unit), y)
        loss.backward()
        return {k: v.grad for k, v in p.items()}, loss.detach()

    ref_step = torch.func.grad_and_value(lambda p, x, y: mse(apply(p, x), y))
    ref = dict(params)
    n_params = len(params)
    ok = True
    for i in range(STEPS):
        x, y = torch.randn(BATCH, D), torch.randn(BATCH, D)
        xl, yl = functp.shard((x, y), mesh, BATCH_SPEC)
        with functp.comm_log() as log_a:
            grads, loss = func_step(local, xl, yl)
        with functp.comm_log() as log_b:
            grads_b, loss_b = remat_step(local, xl, yl)
        ref_grads, ref_loss = ref_step(ref, x, y)
        # gradients come back as this rank's blocks, laid out like the parameters
        same_b = all(torch.allclose(grads[k], grads_b[k], rtol=1e-10, atol=1e-13) for k in grads)
        local = {k: v - LR * grads[k] for k, v in local.items()}      # SGD on the blocks
        ref = {k: v - LR * ref_grads[k] for k, v in ref.items()}
        # (a): a gather per parameter forward, a reduce-scatter per parameter backward,
        # the loss's pmean; (b): the gathers again in the backward
        counts_ok = (log_a.summary() == {("all_gather", ("dp",)): n_params,
                                         ("reduce_scatter", ("dp",)): n_params,
                                         ("all_reduce", ("dp",)): 1}
                     and log_b.count("all_gather") == 2 * n_params
                     and log_b.count("reduce_scatter") == n_params)
        match = (math.isclose(loss.item(), ref_loss.item(), rel_tol=1e-9, abs_tol=1e-12)
                 and math.isclose(loss_b.item(), ref_loss.item(), rel_tol=1e-9, abs_tol=1e-12)
                 and same_b and counts_ok)
        ok &= match
        if rank0:
            print(f"step {i}: sharded loss {loss.item():.12f}   unsharded {ref_loss.item():.12f}"
                  f"   {'match' if match else 'MISMATCH'}")
            print(f"    torch.func.grad: {log_a.summary()}")
            print(f"    checkpointed:    {log_b.summary()}")
    final = functp.unshard(local, mesh, PARAM_SPECS)
    return finish(final, ref, ok, "FSDP training", STEPS)


if __name__ == "__main__":
    launch(main, NPROC)
