"""A small block for the expert-parallel tests: a dense MLP (tensor-parallel on a
``tp`` axis) and a Llama MoE after it, with experts that run only where a row is
routed (as transformers' eager experts do), seeded data, and its unsharded float64
loss and gradients (the oracle), optionally with routes dropped by hand."""
from __future__ import annotations

import torch
from torch import nn

import functp
from functp.models.llama import LlamaConfig, LlamaExperts, LlamaMoE

H, F, S, K = 8, 12, 3, 2         # hidden, intermediate, sequence, experts per token


class Block(nn.Module):
    """A dense MLP (tensor-parallel on a tp axis) and an MoE after it, residual."""

    def __init__(self, experts: int):
        super().__init__()
        self.up, self.down = nn.Linear(H, F), nn.Linear(F, H)
        self.moe = LlamaMoE(LlamaConfig(hidden_size=H, intermediate_size=F,
                                        num_experts=experts, num_experts_per_tok=K))

    def forward(self, x):
        x = x + self.down(torch.tanh(self.up(x)))
        return x + self.moe(x)


class HitExperts(LlamaExperts):
    """Runs only the experts some row is routed to, as transformers' eager experts do:
    with no rows its output is a constant, connected to nothing."""

    def forward(self, x, weights, indices):
        out = torch.zeros_like(x)
        for e in sorted(set(indices.flatten().tolist())):
            w = (weights * (indices == e)).sum(-1, keepdim=True)
            gate, up = (x @ self.gate_up_proj[e].T).chunk(2, dim=-1)
            out = out + w * ((torch.nn.functional.silu(gate) * up) @ self.down_proj[e].T)
        return out


def _block(experts: int) -> Block:
    torch.manual_seed(0)
    block = Block(experts).double()
    block.moe.experts.__class__ = HitExperts
    return block


def _batch(rows: int, seq: int = S) -> torch.Tensor:
    return torch.randn(rows, seq, H, generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64)


def _reference(module, x, drop=None):
    """Loss and gradients of the unsharded module (routes dropped by hand if asked)."""
    apply, full = functp.functionalize(module)
    hook = None
    if drop is not None:
        hook = module.moe.router.register_forward_hook(
            lambda m, a, out: (drop(*out), out[1]))
    try:
        grads, loss = torch.func.grad_and_value(lambda p: (apply(p, x) ** 2).mean())(full)
    finally:
        if hook is not None:
            hook.remove()
    return grads, loss
