"""How long functp.estimate takes on a Llama-3-8B-shaped transformers model on 64
ranks (dp 8 x tp 8, a batch of 8 sequences of 2048 tokens per dp rank, bfloat16,
one torch.func.grad step), what it says, and the analytic counts beside it.

    python benchmarks/estimate_llama8b.py [layers]      # 32 layers by default

Eager attention and an explicit attention mask: transformers' SDPA and packed-
sequence checks read the mask's values on the host, which a dry run cannot (estimate
names that line). `estimate_llama70b.py` runs the same code on a 70B shape.
"""
from __future__ import annotations

import resource
import sys
import time

import torch
import transformers

import functp
from functp import P

SEQ, VOCAB = 2048, 128256
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8)


def program(shape: dict, mesh_shape: tuple[int, int], batch: int):
    """One training step's gradient of a Llama of ``shape`` on a (dp, tp) mesh,
    ``batch`` sequences per dp rank."""
    mesh = functp.make_mesh(mesh_shape, ("dp", "tp"))
    torch.set_default_dtype(torch.bfloat16)
    config = transformers.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=SEQ,
                                      attn_implementation="eager", **shape)
    model = transformers.LlamaForCausalLM(config)
    apply, params, specs = functp.parallelize(model, mesh, "auto")

    def local_loss(p, ids, targets):
        logits = apply(p, ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return functp.pmean(loss, "dp")

    step = torch.func.grad(functp.shard_map(local_loss, mesh, in_specs=(specs, P("dp"), P("dp")),
                                            out_specs=P()))
    ids = torch.randint(0, VOCAB, (batch, SEQ))
    return step(params, ids, ids)


def analytic(shape: dict, tp: int, batch: int) -> dict:
    """Counts by hand for one rank: parameters (every matrix split over tp, the norms
    whole), and matmul FLOPs of forward and backward: 6 per weight per token (the
    embedding is a lookup, not a matmul) and attention's QK^T and AV, 4 * seq *
    hidden per token and layer forward (eager attention computes the masked half
    too), times 3."""
    h, f, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    layers = L * (2 * h * h + 2 * h * kv + 3 * h * f)
    matrices = layers + 2 * VOCAB * h                  # with the embedding and the head
    norms = (2 * L + 1) * h
    tokens = batch * SEQ
    flops = 6 * tokens * (layers + VOCAB * h) / tp + 3 * L * 4 * tokens * SEQ * h / tp
    return {"params": matrices / tp + norms, "params_total": matrices + norms,
            "matmul_flops": flops}


def report(name: str, shape: dict, mesh_shape: tuple[int, int], batch: int) -> None:
    n = mesh_shape[0] * mesh_shape[1]
    t0 = time.perf_counter()
    est = functp.estimate(program, n, shape, mesh_shape, batch, hardware="h100-sxm")
    took = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    by_hand = analytic(shape, mesh_shape[1], batch)
    e = est[est.ranks[0]]
    mm = sum(v for k, v in e.flops_by_op.items() if k in ("aten.mm", "aten.bmm", "aten.addmm"))
    print(f"{name} ({shape['num_hidden_layers']} layers) on {n} ranks "
          f"(dp {mesh_shape[0]} x tp {mesh_shape[1]}), {batch} x {SEQ} tokens per dp rank: "
          f"estimated in {took:.1f} s, peak RSS {rss:.2f} GiB")
    print(f"  parameters: {by_hand['params_total'] / 1e9:.2f} B in all, "
          f"{by_hand['params'] / 1e9:.3f} B per rank by hand; the estimate holds "
          f"{e.memory.get('Parameter', 0) / 2 / 1e9:.3f} B (bf16) at its peak")
    print(f"  matmul FLOPs per rank: {mm / 1e12:.2f} T estimated, "
          f"{by_hand['matmul_flops'] / 1e12:.2f} T by hand")
    print(est)


if __name__ == "__main__":
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    report("Llama-3-8B shape", dict(LLAMA_8B, num_hidden_layers=layers), (8, 8), 8)
