"""A GPT-2-style decoder (learned positions, fused qkv, GELU MLP, tied LM head) and
its tensor-parallel plans.

The model code is single-device; the only concession to sharding is that sizes that
a rank holds a part of (heads) are read from the tensors (``view(b, s, -1, hd)``),
never from the config.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.placement_types import Replicate, Shard

from ..parallel._tp import PrepareOutput

__all__ = ["GPT2Config", "GPT2", "GPT2_TP_PLAN", "GPT2_SP_PLAN"]


@dataclass
class GPT2Config:
    vocab_size: int = 32
    n_positions: int = 16
    n_embd: int = 16
    n_head: int = 4
    n_layer: int = 2
    layer_norm_epsilon: float = 1e-5


class GPT2Attention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)     # [q; k; v] fused
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2)
                   for t in self.c_attn(x).chunk(3, dim=-1))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(b, s, -1))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """``GPT2(cfg)(ids) -> logits``; ``ids`` of shape ``[batch, seq]``."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight                   # tied, as in GPT-2

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# Megatron layout: heads and MLP units split over 'tp'. The tied embedding / LM-head
# weight is split by vocabulary rows in both of its uses.
GPT2_TP_PLAN = {
    "wte": "embedding_rowwise",
    "wpe": "replicated",
    "h.*.ln_1": "replicated",
    "h.*.attn.c_attn": "packed_colwise_qkv",     # each rank: its heads of q, of k, of v
    "h.*.attn.c_proj": "rowwise",
    "h.*.ln_2": "replicated",
    "h.*.mlp.c_fc": "colwise",
    "h.*.mlp.c_proj": "rowwise",
    "ln_f": "replicated",
    "lm_head": "colwise_gather_output",
}

# Sequence parallel on top: the residual stream and the norms hold a slice of the
# sequence; each norm's output is all-gathered into the tensor-parallel region and
# its row-parallel output reduce-scattered back.
GPT2_SP_PLAN = {
    **GPT2_TP_PLAN,
    "wte": "embedding_rowwise_sp",
    "wpe": PrepareOutput(Replicate(), Shard(0)),   # this rank's positions: [seq, hidden]
    "h.*.ln_1": "sequence_parallel",
    "h.*.attn.c_proj": "rowwise_sp",
    "h.*.ln_2": "sequence_parallel",
    "h.*.mlp.c_proj": "rowwise_sp",
    "ln_f": "sequence_parallel",
}
