"""A small pre-norm transformer block, as an unsharded function of a parameter dict
and as a Megatron-style per-shard program (heads and MLP units split over 'tp')."""
from __future__ import annotations

import math

import torch

import functp
from functp import P


def init_params(d: int, ffn: int, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype) / math.sqrt(s[-1])
    p = {"norm1": torch.ones(d, dtype=dtype), "norm2": torch.ones(d, dtype=dtype)}
    for n in "qkv":
        p[f"{n}.w"], p[f"{n}.b"] = r(d, d), torch.zeros(d, dtype=dtype)
    p["o.w"], p["o.b"] = r(d, d), torch.zeros(d, dtype=dtype)
    p["fc1.w"], p["fc1.b"] = r(ffn, d), torch.zeros(ffn, dtype=dtype)
    p["fc2.w"], p["fc2.b"] = r(d, ffn), torch.zeros(d, dtype=dtype)
    return p


def tp_specs(p) -> dict:
    specs = {k: P() for k in p}
    for n in ("q", "k", "v", "fc1"):
        specs[f"{n}.w"], specs[f"{n}.b"] = P("tp", None), P("tp")
    specs["o.w"], specs["fc2.w"] = P(None, "tp"), P(None, "tp")
    return specs


def _rms(x, w):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w


def block(p, x, heads: int, reduce=lambda t: t):
    b, s, _ = x.shape
    h = _rms(x, p["norm1"])
    split = lambda t: t.view(b, s, heads, -1).transpose(1, 2)
    q, k, v = (split(h @ p[f"{n}.w"].T + p[f"{n}.b"]) for n in "qkv")
    att = torch.softmax((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]), -1) @ v
    x = x + reduce(att.transpose(1, 2).reshape(b, s, -1) @ p["o.w"].T) + p["o.b"]
    h = torch.relu(_rms(x, p["norm2"]) @ p["fc1.w"].T + p["fc1.b"]) @ p["fc2.w"].T
    return x + reduce(h) + p["fc2.b"]


def local_loss(p, x, y, heads: int, tp: str | None, dp: str | None):
    """The per-shard loss: heads and MLP split over ``tp`` (if given), batch over ``dp``."""
    n = functp.axis_size(tp) if tp else 1
    out = block(p, x, heads // n, (lambda t: functp.psum(t, tp)) if tp else (lambda t: t))
    loss = ((out - y) ** 2).mean()
    return functp.pmean(loss, dp) if dp else loss
