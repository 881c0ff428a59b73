"""Expert parallelism for a mixture-of-experts layer: experts split over 'ep', tokens
sent to the rank that holds their expert with all_to_all, and sent back.

    torchrun --standalone --nproc-per-node 2 examples/moe_expert_parallel.py
    python examples/moe_expert_parallel.py   # launches the 2 local processes itself
    python examples/moe_expert_parallel.py --simulate  # or as 2 simulated ranks in one process

The MoE layer is written once, GShard-style, over a group of tokens: a router picks
the top-k experts of each token, every expert gets a buffer of ``capacity`` slots,
a one-hot dispatch tensor copies each token into its experts' buffers, the experts
run batched over their buffers, and a combine tensor (dispatch x gate) sums the
results back per token. On one device all experts are local. With expert
parallelism each rank holds E/ep experts (P('ep') on the expert dimension) and 1/ep
of the tokens (P('ep'), as with data parallelism); two all_to_alls wrap the experts:
  dispatch: the (E, capacity, D) buffers of this rank's tokens -> every rank gets,
            for each of its own experts, the slots that all ranks filled for it;
  return:   the inverse, bringing each expert's results home.
all_to_all is linear and its transpose is the inverse all_to_all, so the backward
is the same exchange in reverse. The norm and router weights are replicated over
'ep' and see different tokens on each rank: vma sums their gradients over 'ep'. Every SGD step
prints the loss beside the unsharded layer's and the collectives it issued.
"""
from __future__ import annotations

import math

import torch

import functp
from _example import finish, launch
from functp import P

NPROC = 2                                   # processes when launched directly
D, HIDDEN, EXPERTS, TOP_K, TOKENS, STEPS, LR = 8, 16, 4, 2, 16, 4, 0.2


class MoE(torch.nn.Module):
    """Plain single-device model: a pre-norm residual MoE-MLP, x + MoE(norm(x)), on a
    (tokens, D) batch."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.router = torch.nn.Linear(D, EXPERTS, bias=False)
        self.w_in = torch.nn.Parameter(torch.randn(EXPERTS, D, HIDDEN) / math.sqrt(D))
        self.w_out = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, D) / math.sqrt(HIDDEN))

    def forward(self, x):
        return moe_block(dict(self.named_parameters()), x)


def identity(t):
    return t


def route(router_weight, x):
    """(tokens, E) gates: softmax over each token's top-k router logits, 0 elsewhere."""
    logits = x @ router_weight.T
    top, idx = logits.topk(TOP_K, dim=-1)
    return torch.zeros_like(logits).scatter(-1, idx, top.softmax(-1))


def dispatch_tensor(gates, capacity):
    """(tokens, E, capacity) one-hot: token t goes to slot ``slot[t, e]`` of expert e's
    buffer if e is one of its top-k. Slots are numbered in token order."""
    chosen = gates > 0
    slot = (chosen.cumsum(0) - 1).clamp(min=0)
    # capacity here is the number of tokens in the group, so no token is dropped (a
    # production MoE uses a smaller capacity and drops the overflow)
    return torch.nn.functional.one_hot(slot, capacity).to(gates.dtype) * chosen[..., None]


def experts(w_in, w_out, buf):
    """Each expert's MLP on its own buffer: (experts held, slots, D) -> same shape."""
    return torch.bmm(torch.relu(torch.bmm(buf, w_in)), w_out)


def moe_block(p, x, send=identity, receive=identity):
    """``send`` takes the (E, capacity, D) buffers to the ranks holding the experts,
    ``receive`` brings the experts' outputs back; both are the identity on one device."""
    h = torch.nn.functional.layer_norm(x, (D,), p["norm.weight"], p["norm.bias"])
    gates = route(p["router.weight"], h)
    dispatch = dispatch_tensor(gates, capacity=x.shape[0])
    buf = torch.einsum("tec,td->ecd", dispatch, h)          # every expert's tokens
    out = receive(experts(p["w_in"], p["w_out"], send(buf)))
    combine = dispatch * gates[..., None]                   # gate-weighted slots
    return x + torch.einsum("tec,ecd->td", combine, out)


def dense_reference(p, x):
    """An independent oracle: every expert on every token, weighted by its gate."""
    h = torch.nn.functional.layer_norm(x, (D,), p["norm.weight"], p["norm.bias"])
    gates = route(p["router.weight"], h)
    outs = experts(p["w_in"], p["w_out"], h.expand(EXPERTS, *h.shape))   # (E, tokens, D)
    return x + torch.einsum("te,etd->td", gates, outs)


# the layout: expert weights split over 'ep' along the expert dimension, the norm
# and the router replicated; tokens split over 'ep' (expert parallelism reuses the data axis)
SPECS = {"norm.weight": P(), "norm.bias": P(), "router.weight": P(),
         "w_in": P("ep"), "w_out": P("ep")}
TOKEN_SPEC = P("ep")


def mse(out, y):
    return ((out - y) ** 2).mean()


def local_loss(p, x, y):
    # buffers (E, C, D): split the expert dim into ep chunks, chunk j to rank j, and
    # concatenate what arrives along the slot dim -> (E/ep, ep*C, D): for each local
    # expert, the slots every rank filled for it, in rank order
    send = lambda b: functp.all_to_all(b, "ep", split_axis=0, concat_axis=1, tiled=True)
    # and back: split the slots by source rank, return them, stack on the expert dim
    receive = lambda b: functp.all_to_all(b, "ep", split_axis=1, concat_axis=0, tiled=True)
    return functp.pmean(mse(moe_block(p, x, send, receive), y), "ep")


def main() -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    mesh = functp.make_mesh((functp.process_count(),), ("ep",))
    rank0 = functp.process_index() == 0

    torch.manual_seed(0)                    # the same model and data on every rank
    model = MoE()
    apply, params = functp.functionalize(model)
    local = functp.shard(params, mesh, SPECS)
    if rank0:
        for k in SPECS:
            print(f"{k:14s} full {tuple(params[k].shape)} -> local {tuple(local[k].shape)}"
                  f"  {SPECS[k]}")

    step = torch.func.grad_and_value(
        functp.shard_map(local_loss, mesh, in_specs=(SPECS, TOKEN_SPEC, TOKEN_SPEC),
                         out_specs=P()))
    ref_step = torch.func.grad_and_value(lambda p, x, y: mse(apply(p, x), y))
    ref = dict(params)
    # 2 all_to_alls forward, their inverses backward; the loss's pmean and one
    # bucketed gradient all-reduce for the replicated norm and router
    expected = {("all_to_all", ("ep",)): 4, ("all_reduce", ("ep",)): 2}
    ok = True
    for i in range(STEPS):
        x, y = torch.randn(TOKENS, D), torch.randn(TOKENS, D)
        if i == 0:                          # the dispatch/combine formulation is exact
            ok &= torch.allclose(apply(ref, x), dense_reference(ref, x), rtol=1e-12, atol=1e-12)
        with functp.comm_log() as log:
            grads, loss = step(local, *functp.shard((x, y), mesh, TOKEN_SPEC))
        local = {k: v - LR * grads[k] for k, v in local.items()}     # SGD on the blocks
        ref_grads, ref_loss = ref_step(ref, x, y)
        ref = {k: v - LR * ref_grads[k] for k, v in ref.items()}
        comms = log.summary()
        match = (math.isclose(loss.item(), ref_loss.item(), rel_tol=1e-9, abs_tol=1e-12)
                 and comms == expected)
        ok &= match
        if rank0:
            print(f"step {i}: sharded loss {loss.item():.12f}   unsharded {ref_loss.item():.12f}"
                  f"   {'match' if match else 'MISMATCH'}   collectives {comms}")
    final = functp.unshard(local, mesh, SPECS)
    return finish(final, ref, ok, "expert-parallel training", STEPS)


if __name__ == "__main__":
    launch(main, NPROC)
