"""Context parallelism with ring attention: the sequence split over 'cp' in the
load-balanced layout, key/value blocks passed around the ring by functp.attention.

    torchrun --standalone --nproc-per-node 4 examples/ring_attention.py
    python examples/ring_attention.py     # launches the 4 local processes itself
    python examples/ring_attention.py --simulate  # or as 4 simulated ranks in one process

functp.cp_shard gives each rank two chunks of the sequence (chunks i and 2cp-1-i of
2cp: one early, one late, so that causal attention is the same work on every rank)
and each rank computes its queries, keys and values. Attention needs every key for
every query: functp.attention(..., strategy="ring") passes the (key, value) blocks
around the ring with ppermute, each transfer issued before the block in hand is
computed, and merges the blocks' softmaxes online (Liu et al., 2023, "Ring
Attention"); the causal mask is built from the tokens' original positions, not
their places on the rank. strategy="allgather" or "ulysses" give the same numbers
(docs/long_sequences.md says when to pick which).

The backward of ppermute is the inverse permutation, so torch.func.grad sends the
key/value gradients back around the ring the other way: no attention backward is
written by hand. The projections are replicated over 'cp' and see different tokens
on each rank: vma sums their gradients. The program prints the loss and the
gradients (projection weights and input) beside those of full causal attention on
one process, and the collectives issued.
"""
from __future__ import annotations

import math

import torch

import functp
from _example import launch, shutdown
from functp import P

NPROC = 4                                   # processes when launched directly
D, HEADS, SEQ, BATCH = 16, 2, 16, 2


class SelfAttention(torch.nn.Module):
    """Plain single-device causal self-attention."""

    def __init__(self):
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)

    def forward(self, x):
        q, k, v = heads(self.qkv(x))
        s = q.shape[-2]
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        att = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~causal, -torch.inf)
        return self.o(merge(att.softmax(-1) @ v))


def heads(qkv):
    """(batch, seq, 3D) -> q, k, v of shape (batch, heads, seq, D/heads)."""
    b, s, _ = qkv.shape
    return qkv.view(b, s, 3, HEADS, -1).permute(2, 0, 3, 1, 4)


def merge(o):
    b, h, s, d = o.shape
    return o.transpose(1, 2).reshape(b, s, h * d)


def sharded_forward(p, x):
    """The same layer on this rank's tokens: projections are per token, so only the
    attention itself needs the other blocks."""
    q, k, v = heads(x @ p["qkv.weight"].T + p["qkv.bias"])
    out = functp.attention(q, k, v, "cp", strategy="ring", causal=True)
    return merge(out) @ p["o.weight"].T + p["o.bias"]


# the layout: the sequence (dim 1) split over 'cp' (functp.cp_shard's load-balanced
# order), the weights replicated
SEQ_SPEC = P(None, "cp")
PARAM_SPECS = P()


def mse(out, y):
    return ((out - y) ** 2).mean()


def main() -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    mesh = functp.make_mesh((functp.process_count(),), ("cp",))
    n = mesh.shape["cp"]
    rank0 = functp.process_index() == 0

    torch.manual_seed(0)                    # the same model and data on every rank
    apply, params = functp.functionalize(SelfAttention())
    x, y = torch.randn(BATCH, SEQ, D), torch.randn(BATCH, SEQ, D)

    def local_loss(p, x, y):
        return functp.pmean(mse(sharded_forward(p, x), y), "cp")

    loss_fn = functp.shard_map(local_loss, mesh, in_specs=(PARAM_SPECS, SEQ_SPEC, SEQ_SPEC),
                               out_specs=P())
    xl, yl = functp.cp_shard((x, y), mesh)          # two chunks of the sequence each
    with functp.comm_log() as log:
        (g_params, g_x), loss = torch.func.grad_and_value(loss_fn, argnums=(0, 1))(params, xl, yl)
    g_x = functp.cp_unshard(g_x, mesh)              # back in the sequence's own order

    (r_params, r_x), ref_loss = torch.func.grad_and_value(
        lambda p, x: mse(apply(p, x), y), argnums=(0, 1))(params, x)
    out = functp.shard_map(sharded_forward, mesh, in_specs=(PARAM_SPECS, SEQ_SPEC),
                           out_specs=SEQ_SPEC)(params, xl)
    out = functp.cp_unshard(out, mesh)
    out_err = (out - apply(params, x)).abs().max().item()

    def report(what, a, b, err):
        match = err < 1e-10
        if rank0:
            print(f"{what:24s} ring {a:+.12f}   full {b:+.12f}   "
                  f"max |diff| {err:.1e}   {'match' if match else 'MISMATCH'}")
        return match

    ok = report("attention output[0,0,0]", out[0, 0, 0].item(), apply(params, x)[0, 0, 0].item(),
                out_err)
    ok &= report("loss", loss.item(), ref_loss.item(), abs(loss.item() - ref_loss.item()))
    for k in params:
        ok &= report(f"grad {k}", g_params[k].flatten()[0].item(), r_params[k].flatten()[0].item(),
                     (g_params[k] - r_params[k]).abs().max().item())
    ok &= report("grad x", g_x.flatten()[0].item(), r_x.flatten()[0].item(),
                 (g_x - r_x).abs().max().item())
    # n-1 ppermutes forward, n-1 back; the loss's pmean, one bucketed gradient all-reduce
    comms = log.summary()
    expected = {("all_reduce", ("cp",)): 2}
    if n > 1:
        expected[("permute", ("cp",))] = 2 * (n - 1)
    ok &= comms == expected
    if rank0:
        print(f"collectives {comms}")
        print("ring attention matches full attention" if ok else "MISMATCH")
    return shutdown(ok)


if __name__ == "__main__":
    launch(main, NPROC)
