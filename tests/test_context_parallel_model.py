"""A tiny causal transformer block (RMSNorm, GQA attention with a rotary embedding,
an MLP) over a cp-split sequence: its loss and every gradient (the weights' and the
input's) equal the unsharded float64 model's (1e-10), for every strategy, in the
load-balanced layout (positions from functp.cp_positions, into the rotary embedding
and the mask) and in contiguous blocks, through torch.func.grad and tape autograd."""
from __future__ import annotations

import torch

import functp
from functp import P

TOL = 1e-10
D, HQ, HK, HD, SEQ, BATCH = 16, 4, 2, 4, 16, 2


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64) / shape[-1] ** 0.5
    return {"wq": w(HQ * HD, D), "wk": w(HK * HD, D), "wv": w(HK * HD, D),
            "wo": w(D, HQ * HD), "w1": w(2 * D, D), "w2": w(D, 2 * D),
            "norm": 1 + 0.1 * w(D)}


def _rms(x, weight):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * weight


def _rotary(x, positions):
    """(b, h, s, hd) rotated by each token's original position."""
    half = x.shape[-1] // 2
    freq = 1.0 / 10000 ** (torch.arange(half, dtype=torch.float64) / half)
    ang = positions.to(torch.float64)[:, None] * freq[None, :]
    cos, sin = ang.cos(), ang.sin()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


def block(p, x, positions, attend):
    """The block on tokens ``x`` (b, s, D) at original ``positions``; ``attend`` is
    SDPA-layout causal attention."""
    b, s, _ = x.shape
    h = _rms(x, p["norm"])

    def heads(t, n):
        return t.view(b, s, n, HD).transpose(1, 2)
    q = _rotary(heads(h @ p["wq"].T, HQ), positions)
    k = _rotary(heads(h @ p["wk"].T, HK), positions)
    v = heads(h @ p["wv"].T, HK)
    x = x + attend(q, k, v).transpose(1, 2).reshape(b, s, HQ * HD) @ p["wo"].T
    return x + torch.relu(_rms(x, p["norm"]) @ p["w1"].T) @ p["w2"].T


def _whole(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=True)


def _model_body(n):
    mesh = functp.make_mesh((n,), ("cp",))
    params = _params()
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(BATCH, SEQ, D, generator=g, dtype=torch.float64) for _ in range(2))

    def ref_loss(p, x):
        return ((block(p, x, torch.arange(SEQ), _whole) - y) ** 2).mean()
    ref_g = torch.func.grad(ref_loss, argnums=(0, 1))(params, x)
    want = ref_loss(params, x)
    bad = {}
    for strategy in ("allgather", "ulysses", "ring"):
        for balanced in (True, False):
            def loss(p, x, y, strategy=strategy, balanced=balanced):
                def attend(q, k, v):
                    return functp.attention(q, k, v, "cp", strategy=strategy, causal=True,
                                            balanced=balanced)
                pos = functp.cp_positions(SEQ, balanced=balanced)
                out = block(p, x, pos, attend)
                return functp.psum(((out - y) ** 2).sum(), "cp") / y.numel() / n
            step = functp.shard_map(loss, mesh, in_specs=(P(), P(None, "cp"), P(None, "cp")),
                                    out_specs=P())
            xl, yl = functp.cp_shard((x, y), mesh, balanced=balanced)
            (gp, gx), value = torch.func.grad_and_value(step, argnums=(0, 1))(params, xl, yl)
            tp = {k: t.detach().requires_grad_() for k, t in params.items()}
            tx = xl.detach().requires_grad_()
            step(tp, tx, yl).backward()
            for how, (ps, xs) in (("func.grad", (gp, gx)),
                                  ("tape", ({k: t.grad for k, t in tp.items()}, tx.grad))):
                gx_full = functp.cp_unshard(xs, mesh, balanced=balanced)
                err = max([(ps[k] - ref_g[0][k]).abs().max().item() for k in params]
                          + [(gx_full - ref_g[1]).abs().max().item(),
                             abs(value.item() - want.item())])
                if err > TOL:
                    bad[(strategy, balanced, how)] = err
    assert not bad, f"gradients off the unsharded model's: {bad}"
    return want.item()


def test_transformer_block_loss_and_every_gradient(run):
    for n in (2, 4):
        losses = run(n, _model_body, n)
        assert len(set(losses)) == 1 and losses[0] > 0
