"""Sequence parallelism around a tensor-parallel region (Megatron-SP): the residual
stream and the norms split over the sequence on 'tp'; all_gather into the
tensor-parallel attention/MLP, psum_scatter out of it.

    torchrun --standalone --nproc-per-node 2 examples/sequence_parallel.py
    python examples/sequence_parallel.py  # launches the 2 local processes itself
    python examples/sequence_parallel.py --simulate  # or as 2 simulated ranks in one process

In plain Megatron tensor parallelism (examples/megatron_tp.py) the activations
between the parallel regions -- the residual stream, the layer norms -- are
replicated: every rank stores and normalises all tokens. Sequence parallelism
(Korthikanti et al., 2022) splits them along the sequence instead and swaps the two
operators at the region's edges:
  entering: all_gather(h, 'tp', axis=1, tiled=True) -- the whole sequence for the
            column-parallel matmuls (backward: psum_scatter of the gradient);
  leaving:  psum_scatter(partial, 'tp', scatter_dimension=1, tiled=True) -- sum the
            row-parallel partial sums and keep this rank's tokens (backward: all_gather).
An all-gather plus a reduce-scatter move the same bytes as the one all-reduce they
replace, while the norms, residual adds and their activations shrink by 1/tp. The
norm weights (and the row-parallel biases) are replicated but now see different
tokens on each rank: vma gives their gradients the all-reduce over 'tp' that
Megatron-SP adds by hand. Every SGD step prints the loss beside the unsharded
model's and the collectives it issued.
"""
from __future__ import annotations

import math

import torch

import functp
from _example import finish, launch
from functp import P

NPROC = 2                                   # processes when launched directly
D, HEADS, FFN, SEQ, BATCH, LAYERS, STEPS, LR = 16, 4, 32, 8, 4, 2, 4, 0.1


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(D, D) for _ in range(4))
        self.fc1, self.fc2 = torch.nn.Linear(D, FFN), torch.nn.Linear(FFN, D)


class Transformer(torch.nn.Module):
    """Plain single-device model: its forward is ``transformer`` below with all
    heads and the identity for ``enter`` and ``leave``."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, x):
        return transformer(dict(self.named_parameters()), x, HEADS)


def identity(t):
    return t


def attention(p, h, heads):
    """Causal self-attention over the heads whose weights ``p`` holds; a partial sum
    over those heads (o is row-parallel, its bias is added after ``leave``)."""
    b, s, _ = h.shape
    split = lambda t: t.view(b, s, heads, -1).transpose(1, 2)
    q, k, v = (split(h @ p[n + ".weight"].T + p[n + ".bias"]) for n in "qkv")
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    att = ((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])).masked_fill(~mask, -torch.inf)
    return (att.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1) @ p["o.weight"].T


def mlp(p, h):
    return torch.relu(h @ p["fc1.weight"].T + p["fc1.bias"]) @ p["fc2.weight"].T


def block(p, x, heads, enter, leave):
    """``enter`` takes the normed activations into the tensor-parallel region,
    ``leave`` brings its partial sums back to the layout of the residual stream."""
    ln = lambda t, n: torch.nn.functional.layer_norm(t, (D,), p[n + ".weight"], p[n + ".bias"])
    x = x + leave(attention(p, enter(ln(x, "norm1")), heads)) + p["o.bias"]
    return x + leave(mlp(p, enter(ln(x, "norm2")))) + p["fc2.bias"]


def transformer(p, x, heads, enter=identity, leave=identity):
    for i in range(LAYERS):
        pre = f"blocks.{i}."
        x = block({k[len(pre):]: v for k, v in p.items() if k.startswith(pre)}, x, heads,
                  enter, leave)
    return x


def tp_specs(names):
    """The tensor-parallel layout of the weights (as in megatron_tp.py)."""
    def spec(name):
        layer, kind = name.split(".")[-2:]
        if layer in ("q", "k", "v", "fc1"):
            return P("tp", None) if kind == "weight" else P("tp")
        if layer in ("o", "fc2") and kind == "weight":
            return P(None, "tp")
        return P()
    return {n: spec(n) for n in names}


# the activations' layout: (batch, sequence, features), the sequence split over 'tp'
SEQ_SPEC = P(None, "tp")


def mse(out, y):
    return ((out - y) ** 2).mean()


def local_loss(p, x, y):
    # x, y: this rank's tokens of every sequence
    heads = HEADS // functp.axis_size("tp")
    out = transformer(
        p, x, heads,
        enter=lambda h: functp.all_gather(h, "tp", axis=1, tiled=True),
        leave=lambda h: functp.psum_scatter(h, "tp", scatter_dimension=1, tiled=True))
    return functp.pmean(mse(out, y), "tp")   # equal-sized token blocks: mean of means


def main() -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    mesh = functp.make_mesh((functp.process_count(),), ("tp",))
    rank0 = functp.process_index() == 0

    torch.manual_seed(0)                    # the same model and data on every rank
    apply, params = functp.functionalize(Transformer())
    specs = tp_specs(params)
    local = functp.shard(params, mesh, specs)

    step = torch.func.grad_and_value(
        functp.shard_map(local_loss, mesh, in_specs=(specs, SEQ_SPEC, SEQ_SPEC), out_specs=P()))
    ref_step = torch.func.grad_and_value(lambda p, x, y: mse(apply(p, x), y))
    ref = dict(params)
    # per block: 2 all-gathers and 2 reduce-scatters forward, the same backward (each
    # one's transpose), plus the loss's pmean and one bucketed all-reduce of the
    # replicated parameters' gradients
    expected = {("all_gather", ("tp",)): 4 * LAYERS, ("reduce_scatter", ("tp",)): 4 * LAYERS,
                ("all_reduce", ("tp",)): 2}
    ok = True
    for i in range(STEPS):
        x, y = torch.randn(BATCH, SEQ, D), torch.randn(BATCH, SEQ, D)
        xl, yl = functp.shard((x, y), mesh, SEQ_SPEC)
        if rank0 and i == 0:
            print(f"activations: full {tuple(x.shape)} -> local {tuple(xl.shape)}  {SEQ_SPEC}")
        with functp.comm_log() as log:
            grads, loss = step(local, xl, yl)
        local = {k: v - LR * grads[k] for k, v in local.items()}     # SGD on the blocks
        ref_grads, ref_loss = ref_step(ref, x, y)
        ref = {k: v - LR * ref_grads[k] for k, v in ref.items()}
        comms = log.summary()
        match = (math.isclose(loss.item(), ref_loss.item(), rel_tol=1e-9, abs_tol=1e-12)
                 and comms == expected)
        ok &= match
        if rank0:
            print(f"step {i}: sharded loss {loss.item():.12f}   unsharded {ref_loss.item():.12f}"
                  f"   {'match' if match else 'MISMATCH'}")
            print(f"    collectives {comms}")
    final = functp.unshard(local, mesh, specs)
    return finish(final, ref, ok, "sequence-parallel training", STEPS)


if __name__ == "__main__":
    launch(main, NPROC)
