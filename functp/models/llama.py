"""A Llama-style decoder (RMSNorm, rotary positions, GQA attention, SwiGLU with a
packed ``gate_up_proj``, optional mixture-of-experts layers) and its tensor-parallel
plans.

Written for one device. Sizes that a rank may hold part of (heads, experts) are read
from the tensors, never from the config, so the same code runs on local blocks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "Llama", "LLAMA_TP_PLAN", "LLAMA_SP_PLAN", "LLAMA_MOE_TP_PLAN",
           "LLAMA_MOE_SP_PLAN"]


@dataclass
class LlamaConfig:
    vocab_size: int = 32
    hidden_size: int = 16
    intermediate_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int = 4          # GQA: 2 query heads per key/value head
    head_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_layers: tuple[int, ...] = ()      # indices of layers whose MLP is a MoE block


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[batch, heads, seq, head_dim]``."""
    s, hd = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=x.dtype) / hd)
    freqs = torch.arange(s, dtype=x.dtype)[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return x * emb.cos() + _rotate_half(x) * emb.sin()


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.head_dim, self.theta = hd, cfg.rope_theta
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        split = lambda t: t.view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        q, k = apply_rotary(q, self.theta), apply_rotary(k, self.theta)
        groups = q.shape[1] // k.shape[1]             # query heads per key/value head
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(b, s, -1))


class LlamaMLP(nn.Module):
    """SwiGLU with gate and up projections fused in one weight ``[gate; up]``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaRouter(nn.Module):
    """Top-k softmax router: ``(weights, indices)``, each ``[..., k]``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.randn(cfg.num_experts, cfg.hidden_size) / cfg.hidden_size ** 0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, indices = (x @ self.weight.T).softmax(-1).topk(self.top_k, dim=-1)
        return weights / weights.sum(-1, keepdim=True), indices


class LlamaExperts(nn.Module):
    """SwiGLU experts stacked on dimension 0. Expert ``e`` adds its output to the
    tokens routed to it, weighted; an index that names no expert here (``-1``)
    contributes nothing."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        e, h, f = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * f, h) / h ** 0.5)
        self.down_proj = nn.Parameter(torch.randn(e, h, f) / f ** 0.5)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            w = (weights * (indices == e)).sum(-1, keepdim=True)
            gate, up = (x @ self.gate_up_proj[e].T).chunk(2, dim=-1)
            out = out + w * ((F.silu(gate) * up) @ self.down_proj[e].T)
        return out


class LlamaMoE(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.router, self.experts = LlamaRouter(cfg), LlamaExperts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = self.router(x)
        return self.experts(x, weights, indices)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, moe: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMoE(cfg) if moe else LlamaMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """``Llama(cfg)(ids) -> logits``; ``ids`` of shape ``[batch, seq]``.

    On a mesh with a ``pp`` axis ``functp.parallelize`` splits it into pipeline
    stages by ``_pp_plan`` (transformers' form: each part's inputs and outputs): a
    later stage is called with the previous one's hidden states as
    ``inputs_embeds=``, its embedding removed."""

    _pp_plan = {"embed_tokens": (["input_ids"], ["inputs_embeds"]),
                "layers": (["hidden_states"], ["hidden_states"]),
                "norm": (["hidden_states"], ["hidden_states"]),
                "lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i in cfg.moe_layers)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        with torch.no_grad():      # non-trivial norm weights, so their gradients are tested
            for m in self.modules():
                if isinstance(m, RMSNorm):
                    m.weight.add_(0.1 * torch.randn_like(m.weight))

    def forward(self, ids: torch.Tensor | None = None, *,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


# Megatron layout over 'tp': attention heads (q, and the key/value heads of GQA) and
# MLP units split, vocabulary-parallel embedding, LM head gathered.
LLAMA_TP_PLAN = {
    "embed_tokens": "embedding_rowwise",
    "layers.*.input_layernorm": "replicated",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.post_attention_layernorm": "replicated",
    "layers.*.mlp.gate_up_proj": "packed_colwise",     # matching gate and up slices
    "layers.*.mlp.down_proj": "rowwise",
    "norm": "replicated",
    "lm_head": "colwise_gather_output",
}

# Sequence parallel on top: norms and the residual stream hold a slice of the
# sequence; all-gather into each tensor-parallel region, reduce-scatter out of it.
LLAMA_SP_PLAN = {
    **LLAMA_TP_PLAN,
    "embed_tokens": "embedding_rowwise_sp",
    "layers.*.input_layernorm": "sequence_parallel",
    "layers.*.self_attn.o_proj": "rowwise_sp",
    "layers.*.post_attention_layernorm": "sequence_parallel",
    "layers.*.mlp.down_proj": "rowwise_sp",
    "norm": "sequence_parallel",
}

# MoE layers: experts split over the same axis (expert parallel), router replicated
# with its top-k indices renumbered to the local experts.
LLAMA_MOE_TP_PLAN = {
    **LLAMA_TP_PLAN,
    "layers.*.mlp.router": "ep_router",
    "layers.*.mlp.experts": "ep_experts",
}

LLAMA_MOE_SP_PLAN = {
    **LLAMA_SP_PLAN,
    "layers.*.mlp.router": "ep_router",
    "layers.*.mlp.experts": "ep_experts_sp",
}
