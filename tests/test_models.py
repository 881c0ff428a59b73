"""The reference models (GPT-2-style, Llama-style with and without MoE layers) under
their default plans: loss and every parameter's gradient equal the unsharded float64
model on (tp=2), (tp=4), (dp=2, tp=2) and with sequence parallelism; AdamW steps on
the local blocks track the unsharded loss curve; the example runs and matches."""
from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch

import functp
from functp import P
from functp.models import (GPT2, GPT2_SP_PLAN, GPT2_TP_PLAN, LLAMA_MOE_SP_PLAN, LLAMA_MOE_TP_PLAN,
                           LLAMA_SP_PLAN, LLAMA_TP_PLAN, GPT2Config, Llama, LlamaConfig)
from _oracle import assert_tree_close
from _programs import _run_example

BATCH, SEQ = 4, 8

MODELS = {    # name: (build, tp plan, sp plan)
    "gpt2": (lambda: GPT2(GPT2Config()), GPT2_TP_PLAN, GPT2_SP_PLAN),
    "llama": (lambda: Llama(LlamaConfig()), LLAMA_TP_PLAN, LLAMA_SP_PLAN),
    "llama_moe": (lambda: Llama(LlamaConfig(moe_layers=(1,))), LLAMA_MOE_TP_PLAN,
                  LLAMA_MOE_SP_PLAN),
}
MESHES = {"tp2": ((2,), ("tp",)), "tp4": ((4,), ("tp",)), "dp2_tp2": ((2, 2), ("dp", "tp"))}


def _build(name: str):
    torch.manual_seed(0)                 # the same weights on every rank
    return MODELS[name][0]().double()


def _data(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(vocab, (BATCH, SEQ), generator=g),
            torch.randint(vocab, (BATCH, SEQ), generator=g))


def _lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _setup(name: str, mesh_name: str, sp: bool, check_vma: bool = True):
    model = _build(name)
    mesh = functp.make_mesh(*MESHES[mesh_name])
    plan = MODELS[name][2 if sp else 1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # the default plans cover every parameter
        apply, params, specs = functp.parallelize(model, mesh, plan)
    dp = "dp" if "dp" in mesh.axis_names else None
    data_spec = P(dp)

    def local_loss(p, ids, tgt):
        loss = _lm_loss(apply(p, ids), tgt)
        return functp.pmean(loss, dp) if dp else loss
    step = functp.shard_map(local_loss, mesh, in_specs=(specs, data_spec, data_spec),
                            out_specs=P(), check_vma=check_vma)
    ref_apply, full = functp.functionalize(model)
    ref_loss = lambda p, ids, tgt: _lm_loss(ref_apply(p, ids), tgt)
    return SimpleNamespace(mesh=mesh, apply=apply, params=params, step=step, full=full,
                           ref_loss=ref_loss, data_spec=data_spec,
                           vocab=model.lm_head.weight.shape[0])


def _gradients_match(name, mesh_name, sp, check_vma=True):
    t = _setup(name, mesh_name, sp, check_vma)
    ids, tgt = _data(t.vocab)
    ref_grads, ref = torch.func.grad_and_value(t.ref_loss)(t.full, ids, tgt)
    grads, loss = torch.func.grad_and_value(t.step)(
        t.params, *functp.shard((ids, tgt), t.mesh, t.data_spec))
    assert_tree_close(loss, ref, "loss")
    assert_tree_close(t.apply.unshard(grads), ref_grads, "grad")
    assert sorted(grads) == sorted(t.full)
    return loss.item()


CASES = [(m, mesh, False) for m in ("gpt2", "llama") for mesh in MESHES] + [
    ("gpt2", "tp2", True), ("gpt2", "dp2_tp2", True), ("llama", "tp4", True),
    ("llama", "dp2_tp2", True), ("llama_moe", "tp2", False), ("llama_moe", "dp2_tp2", True)]


@pytest.mark.parametrize("name,mesh_name,sp", CASES,
                         ids=[f"{m}-{mesh}{'-sp' if sp else ''}" for m, mesh, sp in CASES])
def test_loss_and_every_gradient_match_the_unsharded_model(run, name, mesh_name, sp):
    world = math.prod(MESHES[mesh_name][0])
    losses = run(world, _gradients_match, name, mesh_name, sp)
    assert len(set(losses)) == 1


def test_sequence_parallel_llama_without_vma_gives_the_same_gradients(run):
    run(2, _gradients_match, "llama_moe", "tp2", True, False)


def _adamw_curve(name, mesh_name, sp, steps=20):
    t = _setup(name, mesh_name, sp)
    local = {k: v.clone().requires_grad_() for k, v in t.params.items()}
    ref = {k: v.clone().requires_grad_() for k, v in t.full.items()}
    opt = torch.optim.AdamW(local.values(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.values(), lr=1e-2)
    grad_step = torch.func.grad_and_value(t.step)
    curve, ref_curve = [], []
    for i in range(steps):
        ids, tgt = _data(t.vocab, seed=i % 4)
        grads, loss = grad_step({k: v.detach() for k, v in local.items()},
                                *functp.shard((ids, tgt), t.mesh, t.data_spec))
        ref_grads, ref_l = torch.func.grad_and_value(t.ref_loss)(
            {k: v.detach() for k, v in ref.items()}, ids, tgt)
        for d, g, o in ((local, grads, opt), (ref, ref_grads, ref_opt)):
            for k, v in d.items():
                v.grad = g[k]
            o.step()
        curve.append(loss.item())
        ref_curve.append(ref_l.item())
    final = t.apply.unshard({k: v.detach() for k, v in local.items()})
    assert_tree_close(final, {k: v.detach() for k, v in ref.items()}, "parameters after AdamW")
    return curve, ref_curve


@pytest.mark.parametrize("name,sp", [("gpt2", True), ("llama_moe", False)])
def test_adamw_on_local_blocks_tracks_the_unsharded_loss_curve(run, name, sp):
    curve, ref_curve = run(4, _adamw_curve, name, "dp2_tp2", sp)[0]
    assert curve[-1] < curve[0] - 0.1                     # it does learn
    for i, (a, b) in enumerate(zip(curve, ref_curve)):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), (i, a, b)


# transformers' causal LMs, tiny: 4 heads and 4 key-value heads (tp=4 splits whole
# heads), head_dim 8; the MoEs with 4 experts, 2 per token
_MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            experts_implementation="eager")      # (grouped_mm has no float64)
_HF = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
       "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
       "mistral": ("MistralConfig", "MistralForCausalLM", {}),
       "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
       "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
       "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
       "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),          # functp's shipped plan
       "mixtral": ("MixtralConfig", "MixtralForCausalLM", _MOE),
       "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", _MOE)}


def _hf_model(name):
    import transformers
    cfg, cls = (getattr(transformers, c) for c in _HF[name][:2])
    config = cfg(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                 max_position_embeddings=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 **_HF[name][2])
    torch.manual_seed(0)
    return cls(config).double().eval()


def _hf_auto(name, mesh_name):
    model = _hf_model(name)
    mesh = functp.make_mesh(*MESHES[mesh_name])
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # 'auto' covers the model: nothing to warn
        apply, params, specs = functp.parallelize(model, mesh, "auto")
    dp = "dp" if "dp" in mesh.axis_names else None
    forward = lambda run_model, p, ids: run_model(p, ids, use_cache=False).logits
    ref_apply, full = functp.functionalize(model)
    ids, tgt = _data(32)
    ref_grads, ref = torch.func.grad_and_value(
        lambda p: _lm_loss(forward(ref_apply, p, ids), tgt))(full)

    def local_loss(p, i, t):
        loss = _lm_loss(forward(apply, p, i), t)
        return functp.pmean(loss, dp) if dp else loss
    step = functp.shard_map(local_loss, mesh, in_specs=(specs, P(dp), P(dp)), out_specs=P())
    grads, loss = torch.func.grad_and_value(step)(params, *functp.shard((ids, tgt), mesh, P(dp)))
    # the MoE routers take their softmax in float32 (router_logits.float()): a 1e-16
    # difference in a sharded sum can move a routing weight by one float32 ulp, which
    # shows as ~1e-6 relative in some gradients
    tol = dict(rtol=1e-5, atol=1e-7) if _HF[name][2] else dict(rtol=1e-10, atol=1e-10)
    assert_tree_close(loss, ref, "loss", tol)
    assert_tree_close(apply.unshard(grads), ref_grads, "grad", tol)
    return sorted(k for k, s in specs.items() if s != P())     # what the plan split


@pytest.mark.parametrize("mesh_name", ["tp4", "dp2_tp2"])
@pytest.mark.parametrize("name", list(_HF))
def test_transformers_auto_plan_matches_the_unsharded_model(run, name, mesh_name):
    pytest.importorskip("transformers")
    split = run(4, _hf_auto, name, mesh_name)[0]
    assert "model.embed_tokens.weight" in split or name == "gpt2"
    assert "lm_head.weight" in split or name in ("gemma", "gpt2")   # tied to the embedding
    if name == "gpt2":
        assert {"transformer.wte.weight", "transformer.h.1.mlp.c_proj.weight"} <= set(split)
        return
    assert ("model.layers.1.mlp.experts.down_proj" if "_moe" in name or name == "mixtral"
            else "model.layers.1.mlp.down_proj.weight") in split


def _auto_errors():
    import transformers
    mesh = functp.make_mesh((2,), ("tp",))
    grouped = _hf_model("mixtral")
    grouped._tp_plan = {"model.layers.*.mlp.experts": "grouped_gemm"}     # no functp style
    gpt2 = transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        vocab_size=32, n_embd=16, n_layer=1, n_head=4, pad_token_id=0))    # no plan shipped
    out = []
    for model in (grouped, gpt2, torch.nn.Linear(4, 4)):
        with pytest.raises(functp.ShardingError) as e:
            functp.parallelize(model, mesh, "auto")
        out.append(str(e.value))
    return out


def test_auto_plan_says_what_it_cannot_do(run):
    pytest.importorskip("transformers")
    moe, gpt2, plain = run(2, _auto_errors)[0]
    assert "'model.layers.*.mlp.experts': 'grouped_gemm'" in moe and "pass a plan dict" in moe
    assert "GPT2ForSequenceClassification no tensor-parallel plan" in gpt2
    assert "Linear carries no transformers tensor-parallel plan" in plain


def test_example_matches_unsharded():
    # on 4 simulated ranks: test_examples launches train_2d as processes
    out = _run_example("tp_llama.py", nproc=4, simulate=True)
    assert "sharded training matches the unsharded model" in out, out


def _comm_counts(sp):
    t = _setup("llama", "tp2", sp)
    ids, tgt = _data(t.vocab)
    with functp.comm_log() as log:
        torch.func.grad(t.step)(t.params, ids, tgt)
    return log.summary()


def test_llama_communication_is_the_megatron_minimum(run):
    layers = LlamaConfig().num_hidden_layers
    # TP, forward: the embedding's and each row-parallel layer's all-reduce, the LM head's
    # gather; backward: Megatron's f, the all-reduce of the activation cotangent entering
    # each column-parallel region (attention, MLP, LM head)
    assert run(2, _comm_counts, False)[0] == {
        ("all_reduce", ("tp",)): (1 + 2 * layers) + (2 * layers + 1),
        ("all_gather", ("tp",)): 1}
    # SP: all-gather into each region and reduce-scatter out of it (and the transposes
    # in backward), the LM head's gather, one bucketed all-reduce of the norm weights
    assert run(2, _comm_counts, True)[0] == {
        ("all_gather", ("tp",)): (2 * layers + 1) * 2 + 1,
        ("reduce_scatter", ("tp",)): (1 + 2 * layers) * 2,
        ("all_reduce", ("tp",)): 1}
