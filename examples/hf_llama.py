"""Train a transformers Llama with its own tensor-parallel plan on a (dp=2, tp=2) mesh,
and check every step against the unsharded model.

    torchrun --standalone --nproc-per-node 4 examples/hf_llama.py
    python examples/hf_llama.py             # launches the 4 local processes itself
    python examples/hf_llama.py --simulate  # or as 4 simulated ranks in one process

Needs transformers. `functp.parallelize(model, mesh, "auto")` reads the plan
transformers ships with the model (`model._tp_plan`: q/k/v/gate/up column-parallel,
o/down row-parallel, the embedding and the LM head split over the vocabulary); no
plan line is written here. The batch is split over 'dp'; vma gives the parameters'
gradients their all-reduce over 'dp'. AdamW steps on the local blocks.
"""
from __future__ import annotations

import math

import torch
import transformers

import functp
from _example import finish, launch
from functp import P

BATCH, SEQ, STEPS, LR = 4, 8, 6, 1e-2


def lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> bool:
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    rank0 = functp.process_index() == 0

    torch.manual_seed(0)                          # the same model and data on every rank
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(config).double()
    apply, params, specs = functp.parallelize(model, mesh, "auto")
    if rank0:
        for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight",
                     "model.layers.0.mlp.down_proj.weight", "model.norm.weight"):
            print(f"{name:40s} full {tuple(model.get_parameter(name).shape)} -> local "
                  f"{tuple(params[name].shape)}  {specs[name]}")

    def forward(run_model, p, ids):
        return run_model(p, ids, use_cache=False).logits

    def local_loss(p, ids, targets):              # this rank's blocks, this rank's batch
        return functp.pmean(lm_loss(forward(apply, p, ids), targets), "dp")

    step = torch.func.grad_and_value(
        functp.shard_map(local_loss, mesh, in_specs=(specs, P("dp"), P("dp")), out_specs=P()))
    ref_apply, full = functp.functionalize(model)
    ref_step = torch.func.grad_and_value(lambda p, i, t: lm_loss(forward(ref_apply, p, i), t))

    local = {k: v.clone() for k, v in params.items()}
    ref = {k: v.clone() for k, v in full.items()}
    opt = torch.optim.AdamW(local.values(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.values(), lr=LR)
    ok = True
    for i in range(STEPS):
        batch = torch.randint(config.vocab_size, (BATCH, SEQ + 1))
        ids, targets = batch[:, :-1], batch[:, 1:]
        with functp.comm_log() as log:
            grads, loss = step(local, *functp.shard((ids, targets), mesh, P("dp")))
        ref_grads, ref_loss = ref_step(ref, ids, targets)
        functp.set_grads(local, grads)
        functp.set_grads(ref, ref_grads)
        opt.step()
        ref_opt.step()
        match = math.isclose(loss.item(), ref_loss.item(), rel_tol=1e-9, abs_tol=1e-12)
        ok &= match
        if rank0:
            print(f"step {i}: sharded loss {loss.item():.12f}   unsharded {ref_loss.item():.12f}"
                  f"   {'match' if match else 'MISMATCH'}   collectives {log.summary()}")
    final = apply.unshard(local)
    return finish(final, ref, ok, "transformers Llama training", STEPS, how="AdamW ")


if __name__ == "__main__":
    launch(main, 4)
