"""How long functp.estimate takes on a Llama-3-8B-shaped transformers model on 64
ranks (dp 8 x tp 8, one 2048-token sequence per dp rank, bfloat16), and what it says.

    python benchmarks/estimate_llama8b.py [layers]      # 32 layers by default

Eager attention and an explicit attention mask: transformers' SDPA and packed-
sequence checks read the mask's values on the host, which a dry run cannot (estimate
names that line). Measured here (2 cores, torch 2.13): 32 layers in 9.1 s, 0.43 GB
peak RSS.
"""
from __future__ import annotations

import resource
import sys
import time

import torch
import transformers

import functp
from functp import P

LAYERS = int(sys.argv[1]) if len(sys.argv) > 1 else 32
SEQ, VOCAB = 2048, 128256


def program():
    mesh = functp.make_mesh((8, 8), ("dp", "tp"))
    torch.set_default_dtype(torch.bfloat16)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=LAYERS, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=SEQ, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config)
    apply, params, specs = functp.parallelize(model, mesh, "auto")

    def local_loss(p, ids, targets):
        logits = apply(p, ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return functp.pmean(loss, "dp")

    step = torch.func.grad(functp.shard_map(local_loss, mesh, in_specs=(specs, P("dp"), P("dp")),
                                            out_specs=P()))
    ids = torch.randint(0, VOCAB, (1, SEQ))
    return step(params, ids, ids)


if __name__ == "__main__":
    t0 = time.perf_counter()
    est = functp.estimate(program, 64, hardware="h100-sxm")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print(f"{LAYERS} layers: estimated in {time.perf_counter() - t0:.1f} s, peak RSS {rss:.2f} GiB")
    print(est)
