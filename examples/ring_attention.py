"""Context parallelism with ring attention: the sequence split over 'cp', key/value
blocks passed around the ring with ppermute, softmax computed online.

    torchrun --standalone --nproc-per-node 4 examples/ring_attention.py
    python examples/ring_attention.py     # launches the 4 local processes itself
    python examples/ring_attention.py --simulate  # or as 4 simulated ranks in one process

Each rank holds one contiguous block of the sequence (P(None, 'cp')) and computes
its queries, keys and values. Attention needs every key for every query, so the
(key, value) blocks travel around the ring: at each of the cp steps a rank attends
its queries to the block it holds, then passes that block to its right neighbour
with ppermute and receives one from its left. The softmax over all keys is never
materialised: a running max, a running denominator and a running weighted sum are
rescaled as each block arrives (the online softmax of flash attention), which gives
exactly softmax(QK^T)V in the end (Liu et al., 2023, "Ring Attention").

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


def ring_attention(q, k, v):
    """Causal attention of this rank's query block to the whole sequence, whose key and
    value blocks visit this rank one per step. All blocks are (batch, heads, S/cp, d)."""
    n, me = functp.axis_size("cp"), functp.axis_index("cp")
    blk = q.shape[-2]
    right = [(r, (r + 1) % n) for r in range(n)]
    q = q / math.sqrt(q.shape[-1])
    q_pos = me * blk + torch.arange(blk)                 # global positions of my queries
    kv = torch.stack([k, v])                             # one message per step, not two
    m = l = acc = None                                   # running max, denominator, sum
    for step in range(n):
        src = (me - step) % n                            # whose block I hold now
        s = q @ kv[0].transpose(-1, -2)
        k_pos = src * blk + torch.arange(blk)
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], -torch.inf)   # causal
        # Blocks from later in the sequence are all masked (src > me) and add nothing,
        # but they are computed anyway: a rank that skipped them would leave the
        # blocks it received unused, autograd would then skip its backward ppermutes,
        # and the ranks waiting in theirs would hang. Same ops on every rank; the
        # rank only changes the values (here, the mask).
        # The max only keeps exp() in range: the result does not depend on it, so it
        # needs no gradient. Step 0 is the diagonal block, where every query sees at
        # least itself, so m is finite from then on and exp(-inf - m) is 0.
        m_blk = s.amax(-1, keepdim=True).detach()
        m_new = m_blk if m is None else torch.maximum(m, m_blk)
        p = torch.exp(s - m_new)
        if m is None:
            l, acc = p.sum(-1, keepdim=True), p @ kv[1]
        else:
            scale = torch.exp(m - m_new)                 # rescale what came before
            l = l * scale + p.sum(-1, keepdim=True)
            acc = acc * scale + p @ kv[1]
        m = m_new
        if step < n - 1:
            # send my current block right, receive the left neighbour's. Its backward
            # sends the blocks' gradients left.
            kv = functp.ppermute(kv, "cp", right)
    return acc / l


def sharded_forward(p, x):
    """The same layer on this rank's tokens: projections are per token, so only the
    attention itself needs the other blocks."""
    q, k, v = heads(x @ p["qkv.weight"].T + p["qkv.bias"])
    return merge(ring_attention(q, k, v)) @ p["o.weight"].T + p["o.bias"]


# the layout: the sequence (dim 1) split over 'cp', the weights replicated
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
    xl, yl = functp.shard((x, y), mesh, SEQ_SPEC)
    with functp.comm_log() as log:
        (g_params, g_x), loss = torch.func.grad_and_value(loss_fn, argnums=(0, 1))(params, xl, yl)
    g_x = functp.unshard(g_x, mesh, SEQ_SPEC)

    (r_params, r_x), ref_loss = torch.func.grad_and_value(
        lambda p, x: mse(apply(p, x), y), argnums=(0, 1))(params, x)
    out = functp.shard_map(sharded_forward, mesh, in_specs=(PARAM_SPECS, SEQ_SPEC),
                           out_specs=SEQ_SPEC)(params, xl)
    out_err = (functp.unshard(out, mesh, SEQ_SPEC) - apply(params, x)).abs().max().item()

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
