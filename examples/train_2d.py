"""Train a small transformer block on a (dp=2, tp=2) mesh with torch.func.grad.

    torchrun --standalone --nproc-per-node 4 examples/train_2d.py
    python examples/train_2d.py          # launches the 4 local processes itself
    python examples/train_2d.py --simulate  # or as 4 simulated ranks in one process

The model is ordinary single-device torch.nn code. The layout is declared beside it:
attention heads and the MLP's hidden units are split over 'tp' (Megatron: q/k/v and
fc1 column-parallel, o and fc2 row-parallel), the batch over 'dp', everything else
replicated. Every step prints the sharded loss next to the loss of the unsharded
model trained on one process with the same data, and says whether they match.
"""
from __future__ import annotations

import math

import torch

import functp
from _example import finish, launch
from functp import P

D, HEADS, FFN, SEQ, BATCH, STEPS, LR = 16, 4, 32, 8, 8, 5, 0.1


class Block(torch.nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
        self.q, self.k, self.v = (torch.nn.Linear(D, D) for _ in range(3))
        self.o = torch.nn.Linear(D, D)
        self.fc1, self.fc2 = torch.nn.Linear(D, FFN), torch.nn.Linear(FFN, D)

    def forward(self, x):
        return block(dict(self.named_parameters()), x, HEADS)


def attention(p, h, heads):
    """Causal self-attention over whatever heads ``p`` holds (all, or a tp shard)."""
    b, s, _ = h.shape
    split = lambda t: t.view(b, s, heads, -1).transpose(1, 2)
    q, k, v = (split(h @ p[n + ".weight"].T + p[n + ".bias"]) for n in "qkv")
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    att = ((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])).masked_fill(~mask, -1e9)
    return (att.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1) @ p["o.weight"].T


def layer_norm(x, w, b):
    return torch.nn.functional.layer_norm(x, (D,), w, b)


def block(p, x, heads, reduce=lambda t: t):
    """One forward of the block. ``reduce`` sums the row-parallel partial results over
    'tp' in the sharded program and is the identity for the unsharded model."""
    h = layer_norm(x, p["norm1.weight"], p["norm1.bias"])
    x = x + reduce(attention(p, h, heads)) + p["o.bias"]
    h = layer_norm(x, p["norm2.weight"], p["norm2.bias"])
    h = torch.relu(h @ p["fc1.weight"].T + p["fc1.bias"]) @ p["fc2.weight"].T
    return x + reduce(h) + p["fc2.bias"]


# the layout, declared beside the model: column-parallel weights split their output
# features over 'tp', row-parallel ones their input features; all else replicated
SPECS = {
    "norm1.weight": P(), "norm1.bias": P(), "norm2.weight": P(), "norm2.bias": P(),
    **{f"{n}.weight": P("tp", None) for n in "qkv"}, **{f"{n}.bias": P("tp") for n in "qkv"},
    "o.weight": P(None, "tp"), "o.bias": P(),
    "fc1.weight": P("tp", None), "fc1.bias": P("tp"), "fc2.weight": P(None, "tp"), "fc2.bias": P(),
}


def local_loss(p, x, y):
    # this rank's heads and MLP units, this rank's slice of the batch
    tp = functp.axis_size("tp")
    out = block(p, x, HEADS // tp, reduce=lambda t: functp.psum(t, "tp"))
    return functp.pmean(((out - y) ** 2).mean(), "dp")


def main() -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    rank0 = functp.process_index() == 0

    torch.manual_seed(0)                       # the same model and data on every rank
    model = Block()
    apply, params = functp.functionalize(model)     # apply(params, x) == model(x)

    def global_loss(p, x, y):                       # the unsharded reference
        return ((apply(p, x) - y) ** 2).mean()

    data = [(torch.randn(BATCH, SEQ, D), torch.randn(BATCH, SEQ, D)) for _ in range(STEPS)]

    local = functp.shard(params, mesh, SPECS)
    loss_fn = functp.shard_map(local_loss, mesh, in_specs=(SPECS, P("dp"), P("dp")),
                               out_specs=P())
    step = torch.func.grad_and_value(loss_fn)    # gradients of the global loss, as blocks
    ref = dict(params)
    ok = True
    for i, (x, y) in enumerate(data):
        grads, loss = step(local, *functp.shard((x, y), mesh, P("dp")))
        local = {k: v - LR * grads[k] for k, v in local.items()}        # plain SGD on blocks
        ref_grads, ref_loss = torch.func.grad_and_value(global_loss)(ref, x, y)
        ref = {k: v - LR * ref_grads[k] for k, v in ref.items()}
        match = math.isclose(loss.item(), ref_loss.item(), rel_tol=1e-9, abs_tol=1e-12)
        ok &= match
        if rank0:
            print(f"step {i}: sharded loss {loss.item():.12f}   unsharded {ref_loss.item():.12f}"
                  f"   {'match' if match else 'MISMATCH'}")
    final = functp.unshard(local, mesh, SPECS)
    return finish(final, ref, ok, "sharded training", STEPS)


if __name__ == "__main__":
    launch(main, 4)
