"""Train a small Llama (GQA attention, SwiGLU, one mixture-of-experts layer) with a
tensor-parallel plan on a (dp=2, tp=2) mesh, and check it against one process.

    torchrun --standalone --nproc-per-node 4 examples/tp_llama.py
    python examples/tp_llama.py          # launches the 4 local processes itself
    python examples/tp_llama.py --simulate  # or as 4 simulated ranks in one process

The model (functp/models/llama.py) is ordinary single-device torch.nn code. Its
layout is a plain dict of wildcard rules, like transformers' tp_plan:
heads, MLP units and experts split over 'tp' (with sequence parallelism for the norms
and the residual stream), the batch over 'dp'. `functp.parallelize` turns the module
into local parameter blocks, their specs, and an `apply` that inserts the plan's
collectives at module boundaries inside a shard_map body. Every step prints the
sharded loss beside the loss of the unsharded model trained with the same data.
"""
from __future__ import annotations

import math

import torch

import functp
from _example import finish, launch
from functp import P
from functp.models import LLAMA_MOE_SP_PLAN, Llama, LlamaConfig

BATCH, SEQ, STEPS, LR = 8, 8, 10, 1e-2


def lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    rank0 = functp.process_index() == 0

    torch.manual_seed(0)                          # the same model and data on every rank
    cfg = LlamaConfig(moe_layers=(1,))
    model = Llama(cfg)
    apply, params, specs = functp.parallelize(model, mesh, LLAMA_MOE_SP_PLAN, axis="tp")
    if rank0:
        for name in ("embed_tokens.weight", "layers.0.mlp.gate_up_proj.weight",
                     "layers.1.mlp.experts.down_proj", "norm.weight"):
            print(f"{name:36s} full {tuple(model.get_parameter(name).shape)} -> local "
                  f"{tuple(params[name].shape)}  {specs[name]}  ({apply.styles[name]})")

    def local_loss(p, ids, targets):              # this rank's blocks, this rank's batch
        return functp.pmean(lm_loss(apply(p, ids), targets), "dp")

    step = torch.func.grad_and_value(
        functp.shard_map(local_loss, mesh, in_specs=(specs, P("dp"), P("dp")), out_specs=P()))

    ref_apply, full = functp.functionalize(model)
    ref_step = torch.func.grad_and_value(lambda p, ids, t: lm_loss(ref_apply(p, ids), t))

    local = {k: v.clone().requires_grad_() for k, v in params.items()}
    ref = {k: v.clone().requires_grad_() for k, v in full.items()}
    opt, ref_opt = torch.optim.AdamW(local.values(), lr=LR), torch.optim.AdamW(ref.values(), lr=LR)
    batches = [torch.randint(cfg.vocab_size, (BATCH, SEQ + 1)) for _ in range(2)]
    ok = True
    for i in range(STEPS):
        ids, targets = batches[i % 2][:, :-1], batches[i % 2][:, 1:]
        grads, loss = step({k: v.detach() for k, v in local.items()},
                           *functp.shard((ids, targets), mesh, P("dp")))
        ref_grads, ref_loss = ref_step({k: v.detach() for k, v in ref.items()}, ids, targets)
        for d, g, o in ((local, grads, opt), (ref, ref_grads, ref_opt)):
            for k, v in d.items():
                v.grad = g[k]
            o.step()
        match = math.isclose(loss.item(), ref_loss.item(), rel_tol=1e-9, abs_tol=1e-12)
        ok &= match
        if rank0:
            print(f"step {i}: sharded loss {loss.item():.12f}   unsharded {ref_loss.item():.12f}"
                  f"   {'match' if match else 'MISMATCH'}")
    final = apply.unshard({k: v.detach() for k, v in local.items()})
    return finish(final, ref, ok, "sharded training", STEPS, how='AdamW ')


if __name__ == "__main__":
    launch(main, 4)
