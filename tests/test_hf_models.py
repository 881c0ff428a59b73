"""Every decoder LM of the installed transformers that defines a tensor-parallel plan,
as a new user would run it: ``functp.parallelize(model, mesh, "auto")`` on a tiny
float64 configuration, loss and every parameter's gradient against the unsharded
model. Each model type either matches or raises a ``ShardingError`` whose reason is
listed in ``REFUSED`` below; nothing runs silently wrong and nothing crashes.

``REFUSED`` and ``NOT_BUILT`` may only shrink: a type that starts to work makes its
test fail until its entry is removed, so the list always says what functp does.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import functp
from functp import P

transformers = pytest.importorskip("transformers")
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

BATCH, SEQ, VOCAB = 4, 8, 32

# one tiny configuration for all: keys a config class does not know are kept as
# plain attributes and read by nobody. 4 query heads, 2 key/value heads of 8 (tp=2
# splits whole heads), 4 experts of which 2 per token, MLA ranks of 16.
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    attn_implementation="eager", experts_implementation="eager",   # grouped_mm: no float64
    num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=16, shared_expert_intermediate_size=16, n_shared_experts=1,
    moe_shared_expert_intermediate_size=16, shared_intermediate_size=16,
    first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
    router_jitter_noise=0.0, dense_intermediate_size=32, intermediate_size_mlp=32,
    kv_lora_rank=16, q_lora_rank=16, o_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
    v_head_dim=8, index_head_dim=8, index_topk=4, swa_head_dim=8,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_head_dim=8,
    hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB)

_MLA = dict(qk_rope_head_dim=4, qk_nope_head_dim=4, num_key_value_heads=4, head_dim=4)
EXTRA = {    # what a type needs beyond TINY to build and run unsharded
    **{t: _MLA for t in ("axk1", "axk2", "deepseek_v2", "deepseek_v3", "deepseek_v32",
                         "glm4_moe_lite", "glm_moe_dsa", "longcat_flash", "minicpm3", "youtu")},
    # activation sparsity on the first layer, as Gemma-3n's first layers have it
    "gemma3n_text": dict(num_kv_shared_layers=0, activation_sparsity_pattern=[0.95, 0.0],
                         laurel_rank=4, altup_num_inputs=2, sliding_window=4,
                         layer_types=["sliding_attention", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "granitemoehybrid": dict(mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1),
    # its causal LM builds the vision and audio embedders: tiny ones
    "phi4_multimodal": dict(
        vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        audio_config=dict(hidden_size=16, intermediate_size=16, num_blocks=1,
                          num_attention_heads=2, ext_pw_out_channel=16, downsample_rate=1,
                          depthwise_seperable_out_channel=16, nemo_conv_channels=16)),
    "cohere_compass_text": dict(
        layer_types=["full_attention"] * 2,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}

# types whose unsharded model cannot run here as a tiny float64 model (the reason)
NOT_BUILT = {
    "llama4": "transformers maps it to Llama4ForCausalLM with the multimodal Llama4Config, "
              "which that class cannot read; llama4_text is the same model",
    "inkling2_text": "its router computes in float32 against the weight's dtype, so the "
                     "model cannot run in float64",
    "dots3_note_text": "its config validates per-layer sub-configs that a tiny config "
                       "does not reproduce",
}

# types functp refuses with a ShardingError: a substring of the message (the reason)
REFUSED: dict[str, str] = {}

# types whose models compute a part in float32 whatever the parameters' dtype (MoE
# routers' softmax, some norms): a float32 rounding of a 1e-16 difference shows as
# ~1e-7 relative there
FLOAT32_INSIDE = {
    "afmoe", "axk1", "bailing_hybrid", "deepseek_v3", "dots1", "exaone_moe", "flex_olmo",
    "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text", "glm4_moe", "hy_v3",
    "kimi_linear", "kolibri1", "minimax", "minimax_m2", "minimax_m3_vl_text", "mixtral",
    "olmo2", "olmo3", "olmo_hybrid", "olmoe", "solar_open", "deepseek_v2", "deepseek_v32",
    "axk2", "glm4_moe_lite", "glm_moe_dsa", "hy_v4", "llama4_text", "nemotron_h",
    "mimo_v2_flash", "inkling_text"}

# a representative set also runs on a 2 x 2 (dp, tp) mesh
TWO_D = {"llama", "qwen3_moe", "gemma3n_text", "deepseek_v2", "granite_swa", "llama4_text",
         "doge"}


def _types() -> list[str]:
    out = []
    for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config = CONFIG_MAPPING[t]
        except (KeyError, ValueError, ImportError):
            continue
        if getattr(config, "base_model_tp_plan", None):
            out.append(t)
    return out


def _build(model_type: str, **fields):
    # (fields: a test's own changes to TINY, passed here rather than set on the module,
    # which simulated ranks share)
    config = CONFIG_MAPPING[model_type](**{**TINY, **EXTRA.get(model_type, {}), **fields})
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    torch.manual_seed(0)                         # the same weights on every rank
    return cls(config).double().eval()


def _lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _max_error(actual: dict, expected: dict, loss, ref_loss) -> tuple[float, str]:
    """Largest error of the loss and of each gradient, relative to that tensor's
    largest entry, a gradient of pure rounding noise (1e-20 where others are 1e-2)
    measured against the largest gradient of all."""
    scale = max(g.abs().max().item() for g in expected.values())
    worst = (abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), "loss")
    for k, ref in expected.items():
        err = (actual[k] - ref).abs().max().item()
        rel = err / max(ref.abs().max().item(), 1e-6 * scale)
        worst = max(worst, (rel, k))
    return worst


def _survey(model_type: str, shape: tuple, names: tuple, **fields):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # transformers' notes about tiny configs
        model = _build(model_type, **fields)
    mesh = functp.make_mesh(shape, names)
    dp = "dp" if "dp" in names else None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    tgt = torch.randint(VOCAB, (BATCH, SEQ), generator=g)
    forward = lambda run_model, p, i: run_model(p, input_ids=i, use_cache=False).logits
    ref_apply, full = functp.functionalize(model)
    ref_grads, ref_loss = torch.func.grad_and_value(
        lambda p: _lm_loss(forward(ref_apply, p, ids), tgt))(full)
    try:
        apply, params, specs = functp.parallelize(model, mesh, "auto")

        def local_loss(p, i, t):
            loss = _lm_loss(forward(apply, p, i), t)
            return functp.pmean(loss, dp) if dp else loss
        step = functp.shard_map(local_loss, mesh, in_specs=(specs, P(dp), P(dp)),
                                out_specs=P())
        grads, loss = torch.func.grad_and_value(step)(
            params, *functp.shard((ids, tgt), mesh, P(dp)))
    except functp.ShardingError as e:
        return "refused", str(e)
    return "ran", _max_error(apply.unshard(grads), ref_grads, loss, ref_loss)


_CASES = [(t, "tp2") for t in _types()] + [(t, "dp2_tp2") for t in _types() if t in TWO_D]
_MESHES = {"tp2": ((2,), ("tp",)), "dp2_tp2": ((2, 2), ("dp", "tp"))}


@pytest.mark.parametrize("model_type,mesh_name", _CASES, ids=[f"{t}-{m}" for t, m in _CASES])
def test_auto_plan_is_exact_or_refused_with_its_reason(run, model_type, mesh_name):
    if model_type in NOT_BUILT:
        pytest.skip(NOT_BUILT[model_type])
    shape, names = _MESHES[mesh_name]
    outcome, detail = run(len(names) * 2 if len(names) == 2 else 2, _survey, model_type,
                          shape, names)[0]
    if model_type in REFUSED:
        assert outcome == "refused", (
            f"{model_type} now runs under 'auto' (worst error {detail}): remove it from "
            f"REFUSED if that is exact")
        assert REFUSED[model_type] in detail, detail
        return
    assert outcome == "ran", f"{model_type} refused: {detail}"
    error, where = detail
    tol = 1e-5 if model_type in FLOAT32_INSIDE else 1e-10
    assert error <= tol, f"{model_type}: {where} differs from the unsharded model by {error:.2e}"


def test_every_listed_type_exists():
    # a stale entry would hide nothing, but would make the lists lie
    known = set(_types())
    for table in (REFUSED, NOT_BUILT, EXTRA, TWO_D, FLOAT32_INSIDE):
        assert set(table) <= known, set(table) - known


def _verify_gemma3n():
    from functp.parallel._plans import _auto_plan
    model = _build("gemma3n_text")
    mesh = functp.make_mesh((2,), ("tp",))
    # transformers' own plan, without the rules 'auto' adds so that the activation
    # sparsity's mean and deviation are over the whole intermediate dimension
    plan = {k: v for k, v in _auto_plan(model).items()
            if not k.endswith(("0.mlp.gate_proj", "0.mlp.act_fn"))}
    with pytest.raises(functp.ShardingError) as e:
        functp.verify_plan(model, mesh, plan)
    report = functp.verify_plan(model, mesh, "auto")
    apply, _, _ = functp.parallelize(model, mesh, "auto", verify=True)
    return str(e.value), report, apply.split_share, repr(apply)


def test_verify_plan_names_the_module_fed_by_a_reduction_over_a_split_dimension(run):
    message, report, share, text = run(2, _verify_gemma3n)[0]
    assert "first module whose output differs" in message, message
    assert "'model.layers.0.mlp.act_fn'" in message, message
    assert report["max_error"] < 1e-5 and report["modules"] > 50, report
    assert 0 < share < 1 and f"{share:.0%} of parameter elements split" in text, text


def _doge_with_transformers_plan():
    from functp.parallel._plans import _auto_plan
    model = _build("doge")
    mesh = functp.make_mesh((2,), ("tp",))
    # transformers' plan as it is: dt_proj row-parallel, its output every head's
    plan = {k: ("rowwise" if k.endswith("dt_proj") else v) for k, v in _auto_plan(model).items()
            if not k.endswith("self_attn")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # (its norms: no rule, replicated)
        apply, params, specs = functp.parallelize(model, mesh, plan)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    step = functp.shard_map(lambda p, i: apply(p, input_ids=i, use_cache=False).logits.sum(),
                            mesh, in_specs=(specs, P()), out_specs=P())
    with pytest.raises(functp.ShardingError) as e:
        step(params, ids)
    return str(e.value)


def test_a_raw_error_under_a_plan_names_the_module_and_its_rules(run):
    message = run(2, _doge_with_transformers_plan)[0]
    assert "module 'model.layers.0.self_attn' (DogeAttention) raised RuntimeError" in message
    assert "'model.layers.0.self_attn.dt_proj'" in message and "'rowwise'" in message, message


def _split_by_auto(model_type):
    model = _build(model_type)
    apply, _, specs = functp.parallelize(model, functp.make_mesh((2,), ("tp",)), "auto")
    return {k for k, s in specs.items() if s.axes}, apply.split_share


def test_auto_splits_the_standard_parts_a_plan_leaves_out(run):
    # GraniteMoE's plan covers only its experts, Qwen2-MoE's not its shared expert:
    # 'auto' adds Megatron rules where they split exactly (the survey checks that)
    split, share = run(2, _split_by_auto, "granitemoe")[0]
    assert "model.layers.0.self_attn.q_proj.weight" in split and share > 0.9, (share, split)
    split, share = run(2, _split_by_auto, "qwen2_moe")[0]
    assert "model.layers.1.mlp.shared_expert.down_proj.weight" in split, split
