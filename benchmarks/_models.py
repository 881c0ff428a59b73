"""The model the comparison benchmark trains, written three ways over one parameter dict.

A stack of ``LAYERS`` pre-norm MLP blocks, ``x + fc2(relu(fc1(rmsnorm(x))))``, and a
mean-squared-error loss against a target. The parameters live in a dict keyed by the
``torch.nn`` names (``blocks.0.fc1.weight``, ...), so that the same numbers can be run

- as a pure function of the dict (:func:`forward`), with hooks where a parallel
  layout puts its collectives (the functp bodies and the hand-written versions use it);
- as an ``nn.Module`` (:class:`MLPStack`), for DDP, FSDP2, DTensor and the unsharded
  reference.

The data (``x``, ``y``: batch x sequence x hidden) are seeded, the same on every rank.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

SIZES = {"small": (64, 256), "medium": (256, 1024)}     # name -> (hidden, ffn)
LAYERS, BATCH, SEQ = 2, 8, 32

PARAM_KINDS = ("norm.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def names(layers: int = LAYERS) -> list[str]:
    return [f"blocks.{i}.{k}" for i in range(layers) for k in PARAM_KINDS]


def init_params(hidden: int, ffn: int, layers: int = LAYERS, dtype=torch.float32,
                seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded full parameters (the same on every rank). Norm weights and biases are
    perturbed away from 1 / 0 so that every gradient is non-trivial."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    p = {}
    for i in range(layers):
        b = f"blocks.{i}."
        p[b + "norm.weight"] = 1 + 0.1 * rnd(hidden)
        p[b + "fc1.weight"] = rnd(ffn, hidden) / math.sqrt(hidden)
        p[b + "fc1.bias"] = 0.1 * rnd(ffn)
        p[b + "fc2.weight"] = rnd(hidden, ffn) / math.sqrt(ffn)
        p[b + "fc2.bias"] = 0.1 * rnd(hidden)
    return {k: v.to(dtype) for k, v in p.items()}


def init_data(hidden: int, dtype=torch.float32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, SEQ, hidden, generator=g, dtype=torch.float64)
    y = torch.randn(BATCH, SEQ, hidden, generator=g, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w


def block_params(p: dict, i: int) -> dict[str, torch.Tensor]:
    """Block ``i``'s parameters by short name (``fc1.weight``, ...)."""
    return {k: p[f"blocks.{i}.{k}"] for k in PARAM_KINDS}


_id = lambda t: t


def block(bp: dict, x: torch.Tensor, pre: Callable = _id, post: Callable = _id) -> torch.Tensor:
    """One pre-norm MLP block on parameters ``bp`` (short names). ``pre`` runs on the
    normed activations before ``fc1`` (an all-gather of the sequence for sequence
    parallelism, Megatron's ``f``), ``post`` on the ``fc2`` output before its bias is
    added (``psum`` for tensor parallelism, a reduce-scatter for sequence parallelism)."""
    h = pre(rms_norm(x, bp["norm.weight"]))
    h = torch.relu(h @ bp["fc1.weight"].T + bp["fc1.bias"]) @ bp["fc2.weight"].T
    return x + post(h) + bp["fc2.bias"]


def forward(p: dict, x: torch.Tensor, layers: int = LAYERS, *, params_of: Callable | None = None,
            pre: Callable = _id, post: Callable = _id) -> torch.Tensor:
    """The whole stack. ``params_of(p, i)`` gives block ``i``'s parameters (default:
    :func:`block_params`; FSDP gathers them there)."""
    params_of = params_of or block_params
    for i in range(layers):
        x = block(params_of(p, i), x, pre, post)
    return x


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def global_loss(p: dict, x: torch.Tensor, y: torch.Tensor, layers: int = LAYERS) -> torch.Tensor:
    """The unsharded loss: the oracle every variant is checked against."""
    return mse(forward(p, x, layers), y)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return rms_norm(x, self.weight)


class Block(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.norm = RMSNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class MLPStack(nn.Module):
    """The same model as :func:`forward`, as modules (parameter names match)."""

    def __init__(self, params: dict[str, torch.Tensor], layers: int = LAYERS):
        super().__init__()
        ffn, hidden = params["blocks.0.fc1.weight"].shape
        dtype = params["blocks.0.fc1.weight"].dtype
        self.blocks = nn.ModuleList([Block(hidden, ffn) for _ in range(layers)])
        self.to(dtype)
        with torch.no_grad():
            for k, v in self.named_parameters():
                v.copy_(params[k])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x
