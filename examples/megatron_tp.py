"""Megatron-style tensor parallelism written by hand: a stack of transformer blocks
whose attention heads and MLP hidden units are split over 'tp', with one psum per
attention and one per MLP.

    torchrun --standalone --nproc-per-node 2 examples/megatron_tp.py
    python examples/megatron_tp.py        # launches the 2 local processes itself
    python examples/megatron_tp.py --simulate  # or as 2 simulated ranks in one process

Megatron-LM (Shoeybi et al., 2019) splits q/k/v and fc1 by output features
(column-parallel) and o and fc2 by input features (row-parallel), so each rank
computes whole heads and whole hidden units from the replicated activations, and its
row-parallel matmul yields a *partial sum* of the output. Two operators glue this:
  f: identity forward, all-reduce of the gradient backward (where the replicated
     activations enter the parallel region) -- functp.pvary;
  g: all-reduce forward, identity backward (where the partial sums leave it)
     -- functp.psum.
With vma tracking f would be inserted implicitly (the replicated activations meet the
tp-split weights); it is written out here to show where Megatron puts it. Every SGD
step prints the loss beside the unsharded model's and the collectives it issued:
2 all-reduces per block forward (g) and 2 backward (f), none for the parameters.
"""
from __future__ import annotations

import math

import torch

import functp
from _example import finish, launch
from functp import P

NPROC = 2                                   # processes when launched directly
D, HEADS, FFN, SEQ, BATCH, LAYERS, STEPS, LR = 16, 4, 32, 6, 4, 2, 4, 0.1


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(D, D) for _ in range(4))
        self.fc1, self.fc2 = torch.nn.Linear(D, FFN), torch.nn.Linear(FFN, D)


class Transformer(torch.nn.Module):
    """Plain single-device model: its forward is the function ``transformer`` below
    with all heads and the identity for ``f`` and ``g``."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, x):
        return transformer(dict(self.named_parameters()), x, HEADS)


def identity(t):
    return t


def attention(p, h, heads):
    """Causal self-attention over the heads whose q/k/v/o weights ``p`` holds."""
    b, s, _ = h.shape
    split = lambda t: t.view(b, s, heads, -1).transpose(1, 2)
    q, k, v = (split(h @ p[n + ".weight"].T + p[n + ".bias"]) for n in "qkv")
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    att = ((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])).masked_fill(~mask, -torch.inf)
    # o is row-parallel: this is a partial sum over the heads p holds; its bias is
    # added once, after g
    return (att.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1) @ p["o.weight"].T


def mlp(p, h):
    """fc1 column-parallel, fc2 row-parallel: a partial sum over p's hidden units."""
    return torch.relu(h @ p["fc1.weight"].T + p["fc1.bias"]) @ p["fc2.weight"].T


def block(p, x, heads, f, g):
    ln = lambda t, n: torch.nn.functional.layer_norm(t, (D,), p[n + ".weight"], p[n + ".bias"])
    x = x + g(attention(p, f(ln(x, "norm1")), heads)) + p["o.bias"]
    return x + g(mlp(p, f(ln(x, "norm2")))) + p["fc2.bias"]


def transformer(p, x, heads, f=identity, g=identity):
    for i in range(LAYERS):
        pre = f"blocks.{i}."
        x = block({k[len(pre):]: v for k, v in p.items() if k.startswith(pre)}, x, heads, f, g)
    return x


def megatron_specs(names):
    """The layout, declared beside the model: column-parallel weights split their
    output features (dim 0 of a torch Linear weight) and biases, row-parallel ones
    their input features; norms and row-parallel biases replicated."""
    def spec(name):
        layer, kind = name.split(".")[-2:]
        if layer in ("q", "k", "v", "fc1"):
            return P("tp", None) if kind == "weight" else P("tp")
        if layer in ("o", "fc2") and kind == "weight":
            return P(None, "tp")
        return P()
    return {n: spec(n) for n in names}


def mse(out, y):
    return ((out - y) ** 2).mean()


def local_loss(p, x, y):
    # this rank's heads and hidden units; x and y are whole (replicated over tp)
    heads = HEADS // functp.axis_size("tp")
    out = transformer(p, x, heads, f=lambda t: functp.pvary(t, "tp"),   # Megatron's f
                      g=lambda t: functp.psum(t, "tp"))                 # Megatron's g
    return mse(out, y)          # out is invariant over tp: the loss is too, no reduction


def main() -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    mesh = functp.make_mesh((functp.process_count(),), ("tp",))
    rank0 = functp.process_index() == 0

    torch.manual_seed(0)                    # the same model and data on every rank
    model = Transformer()
    apply, params = functp.functionalize(model)
    specs = megatron_specs(params)
    local = functp.shard(params, mesh, specs)
    if rank0:
        for k in ("q.weight", "o.weight", "fc1.bias", "norm1.weight"):
            k = "blocks.0." + k
            print(f"{k:22s} full {tuple(params[k].shape)} -> local {tuple(local[k].shape)}"
                  f"  {specs[k]}")

    step = torch.func.grad_and_value(
        functp.shard_map(local_loss, mesh, in_specs=(specs, P(), P()), out_specs=P()))
    ref_step = torch.func.grad_and_value(lambda p, x, y: mse(apply(p, x), y))
    ref = dict(params)
    ok = True
    for i in range(STEPS):
        x, y = torch.randn(BATCH, SEQ, D), torch.randn(BATCH, SEQ, D)
        with functp.comm_log() as log:
            grads, loss = step(local, x, y)
        local = {k: v - LR * grads[k] for k, v in local.items()}     # SGD on the blocks
        ref_grads, ref_loss = ref_step(ref, x, y)
        ref = {k: v - LR * ref_grads[k] for k, v in ref.items()}
        comms = log.summary()
        match = (math.isclose(loss.item(), ref_loss.item(), rel_tol=1e-9, abs_tol=1e-12)
                 and comms == {("all_reduce", ("tp",)): 4 * LAYERS})
        ok &= match
        if rank0:
            print(f"step {i}: sharded loss {loss.item():.12f}   unsharded {ref_loss.item():.12f}"
                  f"   {'match' if match else 'MISMATCH'}   collectives {comms}")
    final = functp.unshard(local, mesh, specs)
    return finish(final, ref, ok, "tensor-parallel training", STEPS)


if __name__ == "__main__":
    launch(main, NPROC)
